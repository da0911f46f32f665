"""Hostile input on the command line (issue 56): damaged and invalid Parquet, lone surrogates,
huge CSV cells and huge lines, broken pipes, `.json` input, options that cannot apply. Each one
is the correct result or one `ftengine: error:` line naming the file and the line / row / option,
with no traceback and no output left behind. (The Ray cases are in test_ray_dataset.py.)"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ftengine import Encoder, InputError, Reranker
from ftengine.cli import main
from ftengine.cli_support import rate
from ftengine.records import CSV_BLOCK_BYTES
from ftengine.tokenizer import PREFIX_CHARS_PER_TOKEN, Tokenizer
from tests.tolerances import BATCHING_INVARIANCE_FP32
from weights.fixtures import (WORDS, add_classification_head, write_bert_checkpoint, write_encoder_checkpoint,
                              write_gpt2_checkpoint)

EXE = str(Path(sys.executable).with_name("ftengine"))
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run(*args, input=None):
    result = CliRunner().invoke(main, [*map(str, args)], input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def one_error_line(result, *parts):
    """The run failed with exactly one error line holding every part."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("ftengine: error: "), result.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def texts(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))) for _ in range(n)]


@pytest.fixture(scope="module")
def reranker_model(tmp_path_factory):
    folder = write_bert_checkpoint(tmp_path_factory.mktemp("reranker"), seed=2, max_positions=64)
    return add_classification_head(folder, num_labels=1)


def damaged_parquet(path: Path, *, group: int) -> Path:
    """A Parquet file of 5 row groups (1,000 rows each, snappy) with a data page of row group
    `group` (0-based) overwritten: its footer, and so its schema, still read."""
    table = pa.table({"text": [f"row {i} " + "word " * 10 for i in range(5000)]})
    pq.write_table(table, path, row_group_size=1000, compression="snappy")
    column = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 40, start + column.total_compressed_size - 8):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("group", [0, 2])
def test_damaged_parquet_names_the_file_and_row_group(st_model, tmp_path, group):
    src = damaged_parquet(tmp_path / "corrupt.parquet", group=group)
    out = tmp_path / "out.npy"
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu")
    one_error_line(r, f"cannot read {src} as Parquet: row group {group + 1} of 5",
                   f"rows {group * 1000 + 1}..{group * 1000 + 1000}")
    assert "Traceback" not in r.stderr and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def invalid_utf8_parquet(path: Path) -> Path:
    """Row 3 of the string column `text` holds bytes that are not UTF-8 (written through a view)."""
    raw = pa.array([b"alpha beta", b"gamma", b"bad \xff\xfe bytes", b"delta"], pa.binary())
    pq.write_table(pa.table({"text": raw.view(pa.string()), "id": pa.array(["a", "b", "c", "d"])}), path)
    return path


def test_invalid_utf8_in_a_parquet_column_follows_errors(st_model, tmp_path):
    src = invalid_utf8_parquet(tmp_path / "bad.parquet")
    out = tmp_path / "out.jsonl"
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu")
    one_error_line(r, f"{src}, row 3: invalid UTF-8 in column 'text' at byte 4", "--errors replace")
    assert not out.exists()
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu", "--errors", "replace", "--id-column",
            "id")
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        expected = encoder.encode(["alpha beta", "gamma", "bad \ufffd\ufffd bytes", "delta"])
    assert [row["id"] for row in rows] == ["a", "b", "c", "d"]
    assert np.abs(np.array([row["embedding"] for row in rows]) - expected).max() <= BATCHING_INVARIANCE_FP32


def test_lone_surrogate_in_jsonl_names_the_line_and_replace_replaces(st_model, tmp_path):
    lines = texts(40)
    src = tmp_path / "in.jsonl"
    records = [{"text": t} for t in lines]
    records[20]["text"] = "before \udc00 after"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")  # \udc00 as a JSON escape
    out = tmp_path / "out.npy"
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu")
    one_error_line(r, f"{src}, line 21: field 'text' holds a lone surrogate (U+DC00) at character 8")
    assert not out.exists()
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu", "--errors", "replace")
    assert r.exit_code == 0, r.stderr
    lines[20] = "before \ufffd after"
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        assert np.abs(np.load(out) - encoder.encode(lines)).max() <= BATCHING_INVARIANCE_FP32
        with pytest.raises(InputError, match="text 2 holds a lone surrogate"):
            encoder.encode(["fine", "x\ud800"])
        assert encoder.encode(["still usable"]).shape == (1, 32)


def test_invalid_utf8_in_a_text_option_names_the_option(st_model, reranker_model, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    bad = os.fsdecode(b"query: \xff")  # what Python makes of invalid UTF-8 in argv
    r = run("encode", src, "-o", tmp_path / "o.npy", "--model", st_model, "--device", "cpu", "--prompt", bad)
    one_error_line(r, "--prompt holds a lone surrogate (U+DCFF)")
    r = run("rerank", src, "--model", reranker_model, "--device", "cpu", "--query", bad)
    one_error_line(r, "--query holds a lone surrogate")


def test_csv_cells_longer_than_the_read_block(st_model, tmp_path):
    big = " ".join(np.random.default_rng(3).choice(WORDS, size=600_000))
    assert len(big) > 2 * CSV_BLOCK_BYTES
    rows = ["first", big, "third", "x " * 10, big + " again"]
    table = pa.table({"text": rows, "id": [f"r{i}" for i in range(len(rows))]})
    src = tmp_path / "big.csv"
    pacsv.write_csv(table, src)
    out = tmp_path / "out.npy"
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    assert "5 lines" in r.stderr and "2 truncated" in r.stderr
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        assert np.abs(np.load(out) - encoder.encode(rows)).max() <= BATCHING_INVARIANCE_FP32
    r = run("encode", "-", "--input-format", "csv", "-o", out, "--model", st_model, "--device", "cpu",
            input=src.read_bytes())
    one_error_line(r, "cannot read <stdin> as CSV", "give the file by name")


def test_csv_with_two_columns_of_the_text_name_is_refused(st_model, tmp_path):
    src = tmp_path / "twice.csv"
    src.write_text("text,id,text\nfirst,1,second\n")
    r = run("encode", src, "-o", tmp_path / "o.npy", "--model", st_model, "--device", "cpu")
    one_error_line(r, f"{src}: 2 columns are named 'text'")


def test_json_input_is_read_as_json_lines(st_model, tmp_path):
    lines = texts(7, seed=4)
    src = tmp_path / "a.json"
    src.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(lines)), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["line"] for row in rows] == list(range(1, 8))
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        assert np.abs(np.array([row["embedding"] for row in rows]) - encoder.encode(lines)).max() \
            <= BATCHING_INVARIANCE_FP32
    src.write_text(json.dumps([{"text": t} for t in lines], indent=2))  # a JSON document, not JSON Lines
    r = run("encode", src, "-o", out, "--model", st_model, "--device", "cpu")
    one_error_line(r, f"{src}, line 1: not valid JSON", "read as JSON Lines")


def test_rerank_max_length_below_the_pair_format_is_refused_and_the_engine_survives(reranker_model, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("a fox runs\nthe dog sleeps\n")
    r = run("rerank", docs, "--model", reranker_model, "--device", "cpu", "--query", "foxes", "--max-length", 2)
    one_error_line(r, "max_length 2 is too short for a pair", "at least 5")
    r = run("rerank", docs, "--model", reranker_model, "--device", "cpu", "--query", "foxes", "--max-length", 5)
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 2, r.stderr
    with pytest.raises(InputError, match="at least 5"):
        Reranker.from_pretrained(reranker_model, device="cpu", max_length=4)
    with Reranker.from_pretrained(reranker_model, device="cpu", max_length=5) as reranker:
        assert reranker.predict([("foxes", "a fox runs " * 20)] * 3).shape == (3,)
        assert reranker.predict([("q", "d")]).shape == (1,)


def test_rerank_refuses_an_empty_query_and_an_empty_document_file(reranker_model, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("a fox\n")
    r = run("rerank", docs, "--model", reranker_model, "--device", "cpu", "--query", "  ")
    one_error_line(r, "--query is empty")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run("rerank", empty, "--model", reranker_model, "--device", "cpu", "--query", "foxes")
    one_error_line(r, f"no documents in {empty}")


def test_npy_output_with_ids_and_a_ranges_file_that_is_not_npy(st_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a", "id": 1}\n')
    r = run("encode", src, "-o", tmp_path / "o.npy", "--id-field", "id", "--model", st_model, "--device", "cpu")
    one_error_line(r, "--id-field", ".npy output, which holds the embeddings alone", "write .jsonl or .parquet")
    ranges = tmp_path / "docs.txt"
    ranges.write_text("not an array\n")
    r = run("encode", src, "-o", tmp_path / "o.jsonl", "--model", st_model, "--device", "cpu", "--precision", "int8",
            "--ranges", ranges)
    one_error_line(r, f"{ranges} is not a .npy array file")
    assert "allow_pickle" not in r.stderr


def broken_pipe_run(command: list, keep: int = 50):
    """Run a command whose reader takes `keep` bytes and goes away: (exit status, stderr)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    proc.stdout.read(keep)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    return proc.wait(timeout=300), stderr


def test_a_reader_that_goes_away_stops_every_command_quietly(st_model, reranker_model, tmp_path):
    src = tmp_path / "big.txt"
    src.write_text("".join(t + "\n" for t in texts(20_000, seed=5)))
    gpt2 = write_gpt2_checkpoint(tmp_path / "gpt2", seed=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(("hello there " * 4 + "\n") * 3000)  # output past a pipe's buffer
    commands = [
        [EXE, "encode", str(src), "-o", "-", "--model", str(st_model), "--device", "cpu", "--quiet"],
        [EXE, "rerank", str(src), "--model", str(reranker_model), "--device", "cpu", "--query", "alpha"],
        [EXE, "generate", "--model", str(gpt2), "--input", str(prompts), "--max-new-tokens", "2", "--device", "cpu"],
    ]
    for command in commands:
        status, stderr = broken_pipe_run(command)
        assert status == 128 + signal.SIGPIPE and stderr == "", (command[1], status, stderr)


def test_a_huge_line_is_tokenised_from_a_bounded_prefix(st_model, tmp_path):
    rng = np.random.default_rng(6)
    huge = " ".join(rng.choice(WORDS, size=2_000_000))  # about 11 MB, one line
    src = tmp_path / "huge.txt"
    src.write_text("short line\n" + huge + "\nlast\n")
    # the peak resident memory of this process image alone (ru_maxrss keeps the forking parent's)
    peak = ("import re, sys\nfrom ftengine.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    code = e.code\n"
            "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
            "print('peak', hwm, file=sys.stderr)\nsys.exit(code)\n")
    out = tmp_path / "out.npy"
    proc = subprocess.run([sys.executable, "-c", peak, "encode", str(src), "-o", str(out), "--model", str(st_model),
                           "--device", "cpu"], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "3 lines" in proc.stderr and "1 truncated" in proc.stderr and " 0 lines/s" not in proc.stderr
    assert int(proc.stderr.strip().splitlines()[-1].split()[1]) < 300_000  # KiB (tokenised whole: 1,000,000)
    with Encoder.from_pretrained(st_model, device="cpu") as encoder:
        prefix = huge[:encoder.max_length * PREFIX_CHARS_PER_TOKEN]  # holds far more than max_length tokens
        assert np.abs(np.load(out) - encoder.encode(["short line", prefix, "last"])).max() <= BATCHING_INVARIANCE_FP32


@pytest.mark.parametrize("kind", ["distilbert", "roberta", "xlm-roberta"])  # WordPiece, byte-level BPE, Unigram
def test_bounded_tokenisation_gives_the_whole_texts_tokens(tmp_path, kind):
    from tokenizers import Tokenizer as HFTokenizer
    folder = write_encoder_checkpoint(tmp_path / kind, kind, seed=1)
    max_length = 24
    ours = Tokenizer(folder, max_length=max_length)
    reference = HFTokenizer.from_str(ours._tok.to_str())  # the same file, as ftengine loads it
    rng = np.random.default_rng(7)
    limit = max_length * PREFIX_CHARS_PER_TOKEN
    cases = [" ".join(rng.choice(WORDS, size=n)) for n in (500, 5_000)]
    cases += ["x" * (limit + 50) + " tail words here",               # no white space until past the prefix
              " " * (2 * limit) + "words after a long run of spaces",  # the prefix overflows nothing
              "word " * (limit // 5 - 3) + "supercalifragilistic" * 40 + " end",
              "!" * 40_000, "ab" * 20_000]                                  # runs without white space
    got = ours.encode(cases)
    for i, text in enumerate(cases):
        expected = reference.encode(text)
        assert got.ids[got.starts[i]:got.starts[i] + got.lengths[i]].tolist() == expected.ids, (kind, i)
        assert bool(got.truncated[i]) == bool(expected.overflowing), (kind, i)


def test_summary_rates_below_one_are_not_rounded_to_zero():
    assert rate(1, 38.2) == "0.0262" and rate(21_900, 1) == "21900" and rate(5, 0) == "0"
