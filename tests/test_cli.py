"""The `ftengine encode` command: outputs, order, summary, and every expected error without a traceback."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cli import main
from ftengine import Encoder
from tests.tolerances import BATCHING_INVARIANCE_FP32

LINES = ["the quick brown fox", "", "hello world", "   ", "a dog " * 30, "text line 42"]


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


def run(*args, input=None):
    result = CliRunner().invoke(main, ["encode", *map(str, args)], input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_npy_output_matches_api_in_input_order(st_model, sample, tmp_path):
    out = tmp_path / "emb.npy"
    r = run(sample, "-o", out, "--model", st_model, "--device", "cpu", "--batch-tokens", "64")
    assert r.exit_code == 0, r.output
    got = np.load(out)
    ref = Encoder.from_pretrained(st_model, device="cpu").encode(LINES)
    assert got.dtype == np.float32 and got.shape == (len(LINES), 32)
    assert np.abs(got - ref).max() <= BATCHING_INVARIANCE_FP32
    assert "6 lines" in r.stderr and "1 truncated" in r.stderr and "lines/s" in r.stderr


def test_padded_layout_gives_the_same_embeddings(st_model, sample, tmp_path):
    out = tmp_path / "padded.npy"
    r = run(sample, "-o", out, "--model", st_model, "--device", "cpu", "--layout", "padded", "--quiet")
    assert r.exit_code == 0, r.stderr
    ref = Encoder.from_pretrained(st_model, device="cpu").encode(LINES)  # 32-dim heads of 8: padded
    assert np.abs(np.load(out) - ref).max() <= BATCHING_INVARIANCE_FP32
    r = run(sample, "--model", st_model, "--device", "cpu", "--layout", "packed")
    assert r.exit_code == 1 and "packed layout needs head_dim in (32, 64, 128), this model has 8" in r.stderr


def test_jsonl_on_stdout(st_model, sample):
    r = run(sample, "-o", "-", "--model", st_model, "--device", "cpu", "--quiet")
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["line"] for row in rows] == list(range(1, len(LINES) + 1))
    assert all(len(row["embedding"]) == 32 for row in rows)
    assert r.stderr == ""


def test_stdin_jsonl_file_and_options(st_model, tmp_path):
    out = tmp_path / "emb.jsonl"
    r = run("-", "-o", out, "--model", st_model, "--device", "cpu", "--pooling", "cls,max",
            "--no-normalize", "--max-length", "8", input="hello world\nthe dog\n")
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and len(rows[0]["embedding"]) == 64
    ref = Encoder.from_pretrained(st_model, device="cpu", max_length=8).encode(
        ["hello world", "the dog"], pooling=["cls", "max"], normalize=False)
    assert np.abs(np.array([row["embedding"] for row in rows]) - ref).max() <= BATCHING_INVARIANCE_FP32


def test_invalid_utf8_names_the_line(st_model, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    out = tmp_path / "emb.npy"
    r = run(path, "-o", out, "--model", st_model, "--device", "cpu")
    assert r.exit_code == 1
    assert "bad.txt, line 3: invalid UTF-8" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    r = run(path, "-o", out, "--model", st_model, "--device", "cpu", "--errors", "replace")
    assert r.exit_code == 0 and np.load(out).shape == (3, 32)


def test_no_truncate_names_the_line(st_model, sample, tmp_path):
    r = run(sample, "-o", tmp_path / "e.npy", "--model", st_model, "--device", "cpu", "--no-truncate")
    assert r.exit_code == 1 and "text 5 is longer than max_length 48 tokens" in r.stderr


def test_existing_output_survives_a_failed_run(st_model, tmp_path):
    out = tmp_path / "keep.npy"
    out.write_bytes(b"precious")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xfe\n")
    r = run(bad, "-o", out, "--model", st_model, "--device", "cpu")
    assert r.exit_code == 1 and out.read_bytes() == b"precious"


@pytest.mark.parametrize("args, message", [
    (["-o", "/nonexistent-dir/x.npy"], "output folder /nonexistent-dir does not exist"),
    (["-o", "-", "--format", "npy"], "npy output is binary"),
    (["--model", "/no/such/model"], "model folder not found: /no/such/model"),
    (["--batch-tokens", "10"], "batch_tokens 10 must be at least max_length 48"),
    (["--max-length", "1000"], "max_length 1000 must be within 2..64"),
    (["--pooling", "median"], "pooling mode 'median' is not supported"),
    (["--dtype", "fp16", "--device", "cpu"], "dtype fp16 needs the CUDA backend"),
    (["--dtype", "fp8", "--device", "cpu"], "dtype fp8 needs the CUDA backend"),
])
def test_expected_errors_are_one_line(st_model, sample, args, message):
    args = list(args) + ([] if "--model" in args else ["--model", st_model])
    args = args + ([] if "--device" in args else ["--device", "cpu"])
    r = run(sample, *args)
    assert r.exit_code != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_unwritable_output_checked_before_work(st_model, sample, tmp_path):
    if os.geteuid() == 0:
        out = tmp_path / "dir.npy"
        out.mkdir()
        message = "is a directory"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out, message = locked / "x.npy", "is not writable"
    r = run(sample, "-o", out, "--model", "/no/such/model")
    assert r.exit_code == 1 and message in r.stderr  # refused before the model is even looked at


def test_unknown_architecture(st_model, sample, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(st_model, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "t5"
    (model / "config.json").write_text(json.dumps(config))
    r = run(sample, "--model", model, "--device", "cpu")
    assert r.exit_code == 1 and "model_type 't5' is not supported by the encoder" in r.stderr


def test_cuda_without_gpu_is_an_error(st_model, sample):
    from ftengine.backends import cuda_available
    if cuda_available():
        pytest.skip("a GPU is present: --device cuda is valid here")
    r = run(sample, "--model", st_model, "--device", "cuda")
    assert r.exit_code == 1 and "no usable GPU" in r.stderr


def test_installed_console_script(st_model, sample, tmp_path):
    """The real entry point, as a user runs it: a subprocess of the installed `ftengine`."""
    exe = Path(sys.executable).with_name("ftengine")
    assert exe.is_file(), f"console script not installed beside {sys.executable}"
    out = tmp_path / "emb.npy"
    proc = subprocess.run([str(exe), "encode", str(sample), "-o", str(out), "--model", str(st_model),
                           "--device", "auto"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert np.load(out).shape == (len(LINES), 32)
    assert "running on the CPU" in proc.stderr and "6 lines" in proc.stderr


# ---------------------------------------------------------------- generate

@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    from weights.fixtures import write_gpt2_checkpoint
    return write_gpt2_checkpoint(tmp_path_factory.mktemp("gpt2cli"), seed=2)


def gen(*args, input=None):
    result = CliRunner().invoke(main, ["generate", *map(str, args)], input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_generate_json_in_input_order(gpt2_model, tmp_path):
    from ftengine import Generator
    src = tmp_path / "prompts.txt"
    src.write_text("hello there\nA\nthe quick brown fox\n")
    r = gen("--model", gpt2_model, "--input", src, "--max-new-tokens", 6, "--json", "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    expected = Generator.from_pretrained(gpt2_model, device="cpu").generate(
        ["hello there", "A", "the quick brown fox"], max_new_tokens=6)
    assert [row["prompt"] for row in rows] == ["hello there", "A", "the quick brown fox"]
    for row, e in zip(rows, expected):
        assert row["token_ids"] == e.token_ids and row["text"] == e.text and row["score"] is None
        assert row["candidates"] == [{"text": e.text, "token_ids": e.token_ids, "score": None}]


def test_generate_input_runs_in_windows_named_by_line(gpt2_model, tmp_path, monkeypatch):
    """--input is read, generated and printed a window at a time (GENERATE_WINDOW, shrunk to 2
    here): the results are Generator.generate's in input order, and a prompt that cannot run is
    named by its line in the file, after the windows before it were printed."""
    import ftengine.cli_text
    from ftengine import Generator
    monkeypatch.setattr(ftengine.cli_text, "GENERATE_WINDOW", 2)
    prompts = ["hello there", "A", "the quick brown fox", "zz", "one more"]
    src = tmp_path / "prompts.txt"
    src.write_text("".join(p + "\n" for p in prompts))
    r = gen("--model", gpt2_model, "--input", src, "--max-new-tokens", 4, "--json", "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    expected = Generator.from_pretrained(gpt2_model, device="cpu").generate(prompts, max_new_tokens=4)
    assert [json.loads(line)["token_ids"] for line in r.stdout.splitlines()] == [e.token_ids for e in expected]
    for bad, message in (("", "line 5: the prompt is empty: GPT-2 needs at least one prompt token"),
                         ("word " * 200, "line 5: the prompt has 1000 tokens; with max_new_tokens 4 that is beyond")):
        src.write_text("".join(p + "\n" for p in prompts[:4] + [bad]))
        r = gen("--model", gpt2_model, "--input", src, "--max-new-tokens", 4, "--device", "cpu")
        assert r.exit_code == 1 and f"{src}, {message}" in r.stderr, r.stderr
        assert len(r.stdout.splitlines()) == 4  # the two windows before it


def test_generate_stream_prints_prompt_and_continuation(gpt2_model):
    from ftengine import Generator
    r = gen("--model", gpt2_model, "--prompt", "hi", "--max-new-tokens", 5, "--stream", "--device", "cpu",
            "--do-sample", "--seed", 3, "--top-k", 20)
    assert r.exit_code == 0, r.stderr
    e = Generator.from_pretrained(gpt2_model, device="cpu").generate(
        ["hi"], max_new_tokens=5, do_sample=True, seed=3, top_k=20)[0]
    assert r.stdout == "hi" + e.text + "\n"


def test_generate_beam_json_candidates(gpt2_model):
    from ftengine import Generator
    r = gen("--model", gpt2_model, "--prompt", "hello", "--max-new-tokens", 5, "--num-beams", 3,
            "--num-return-sequences", 2, "--early-stopping", "never", "--length-penalty", 0.5, "--json",
            "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    row = json.loads(r.stdout)
    e = Generator.from_pretrained(gpt2_model, device="cpu").generate(
        ["hello"], max_new_tokens=5, num_beams=3, num_return_sequences=2, early_stopping="never", length_penalty=0.5)[0]
    assert [c["token_ids"] for c in row["candidates"]] == [c.token_ids for c in e.candidates]
    assert row["score"] == e.score == row["candidates"][0]["score"] and len(row["candidates"]) == 2
    assert row["candidates"][0]["score"] >= row["candidates"][1]["score"]


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", 0, "--prompt", "x"], "max_new_tokens must be an integer >= 1"),
    (["--prompt", "x", "--num-beams", 2, "--num-return-sequences", 3], "num_return_sequences must be within 1..num_beams"),
    (["--do-sample", "--temperature", 0, "--prompt", "x"], "temperature must be a finite number > 0"),
    (["--prompt", "x", "--input", "f"], "give exactly one of --prompt and --input"),
    (["--prompt", ""], "prompt 1 is empty"),
    (["--prompt", "x", "--max-new-tokens", 500], "beyond the model's n_positions 128"),
])
def test_generate_errors_are_one_line(gpt2_model, args, message):
    r = gen("--model", gpt2_model, "--device", "cpu", *args)
    assert r.exit_code == 1 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--num-beams", 0], "num_beams must be within 1..257 (the vocabulary), got 0"),
    (["--num-beams", -3], "num_beams must be within 1..257 (the vocabulary), got -3"),
    (["--num-return-sequences", 0], "num_return_sequences must be within 1..num_beams (1), got 0"),
    (["--num-beams", 2, "--length-penalty", "nan"], "length_penalty must be a finite number, got nan"),
    (["--num-beams", 2, "--length-penalty", "-inf"], "length_penalty must be a finite number, got -inf"),
    (["--do-sample", "--temperature", "inf", "--min-new-tokens", 3], "temperature must be a finite number > 0, got inf"),
    (["--temperature", 0], "temperature 0.0 is not a finite number > 0, and it applies to sampling only"),
    (["--repetition-penalty", "inf"], "repetition_penalty must be a finite number > 0, got inf"),
    (["--max-batch", 0], "max_batch must be an integer >= num_beams (1), got 0"),
    (["--num-beams", 3, "--max-batch", 2], "max_batch must be an integer >= num_beams (3), got 2"),
])
def test_generate_bad_options_fail_instead_of_running_something_else(gpt2_model, args, message):
    """Found in a bad-input sweep: each of these used to run greedy decoding or return an empty text."""
    r = gen("--model", gpt2_model, "--device", "cpu", "--prompt", "hello", *args)
    assert r.exit_code == 1, r.stdout
    assert message in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hello", "--num-beams", 2], "--stream is for greedy and sampled generation"),
    (["--prompt", "", "--do-sample"], "prompt 1 is empty"),
    (["--prompt", "hello", "--max-new-tokens", 500], "beyond the model's n_positions 128"),
    (["--prompt", "hello", "--top-p", 2, "--do-sample"], "top_p must be in (0, 1]"),
])
def test_stream_errors_print_no_text_first(gpt2_model, args, message):
    r = gen("--model", gpt2_model, "--device", "cpu", "--stream", *args)
    assert r.exit_code == 1 and message in r.stderr and r.stdout == "", (r.stdout, r.stderr)


def test_generate_ctrl_c_is_interrupted_with_130(gpt2_model, monkeypatch):
    from ftengine import Generator

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(Generator, "generate", interrupted)
    r = gen("--model", gpt2_model, "--device", "cpu", "--prompt", "hello")
    assert r.exit_code == 130 and "ftengine: interrupted" in r.stderr and "Aborted" not in r.output


@pytest.mark.parametrize("stop, code", [("terminated", 143), ("interrupted", 130)])
def test_a_stop_that_a_library_hands_back_wrapped_still_exits_as_a_stop(gpt2_model, monkeypatch, stop, code):
    """A signal that arrives inside a library's C code can come back wrapped (Ray's
    CoreWorker.wait raises SystemError from the SIGTERM handler's exception, seen in an
    encode-dataset run): still the stop's exit code and its one line, no traceback."""
    from ftengine import Generator
    monkeypatch.setattr(Generator, "generate", lambda self, *a, **k: raise_stop(stop, wrapped=True))
    r = gen("--model", gpt2_model, "--device", "cpu", "--prompt", "hello")
    assert r.exit_code == code and f"ftengine: {stop}" in r.stderr and "Traceback" not in r.output, r.output


def raise_stop(stop: str, *, wrapped: bool):
    """Raise what a Ctrl-C ("interrupted") or SIGTERM ("terminated") raises in the CLI, bare or
    wrapped as Ray's CoreWorker.wait hands it back."""
    from ftengine.cli_support import Terminated
    if not wrapped:
        raise Terminated() if stop == "terminated" else KeyboardInterrupt()
    try:
        raise_stop(stop, wrapped=False)
    except BaseException as e:
        raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from e


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("stop, code", [("terminated", 143), ("interrupted", 130)])
def test_encode_stopped_mid_run_exits_as_a_stop_and_cancels_the_encoder(st_model, sample, tmp_path, monkeypatch,
                                                                        stop, code, wrapped):
    """encode stops as generate does: bare or wrapped, a Ctrl-C exits 130 and a SIGTERM 143 with
    one line and no traceback, the encoder closed with its work cancelled, no output file left."""
    from ftengine import cli as ft_cli
    closed = []
    close = Encoder.close
    monkeypatch.setattr(Encoder, "close",
                        lambda self, *, cancel=False: closed.append(cancel) or close(self, cancel=cancel))
    monkeypatch.setattr(ft_cli, "embed_records", lambda *a, **k: raise_stop(stop, wrapped=wrapped))
    out = tmp_path / "emb.npy"
    r = run(sample, "-o", out, "--model", st_model, "--device", "cpu")
    assert r.exit_code == code and r.stderr.strip() == f"ftengine: {stop}", r.output
    assert closed == [True] and not out.exists()


def test_generate_max_batch_waves_in_input_order(gpt2_model, tmp_path):
    from ftengine import Generator
    prompts = [f"prompt number {i} says" + " more" * (i % 4) for i in range(7)]
    src = tmp_path / "prompts.txt"
    src.write_text("".join(p + "\n" for p in prompts))
    r = gen("--model", gpt2_model, "--input", src, "--max-new-tokens", 6, "--json", "--device", "cpu",
            "--max-batch", 2)
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    g = Generator.from_pretrained(gpt2_model, device="cpu")
    assert [row["prompt"] for row in rows] == prompts
    assert [row["token_ids"] for row in rows] == [g.generate([p], max_new_tokens=6)[0].token_ids for p in prompts]
