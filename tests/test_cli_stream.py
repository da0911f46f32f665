"""`ftengine encode` as a stream, run as a user runs it (a subprocess of the installed command):
a million lines in bounded memory, stdin, Ctrl-C and SIGTERM, and the output file's fate."""

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ftengine import Encoder
from tests.tolerances import BATCHING_INVARIANCE_FP32
from weights.fixtures import WORDS

EXE = str(Path(sys.executable).with_name("ftengine"))
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
# Reports the peak RSS of the command it runs in-process, in KiB, on stderr's last line.
PEAK_RSS = ("import resource, sys\nfrom ftengine.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\nsys.exit(code)\n")


def distinct_lines(n: int = 997) -> list[str]:
    rng = np.random.default_rng(8)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(0, 12)))) + f" {i}" for i in range(n)]


def write_lines(path: Path, count: int, lines: list[str]) -> np.ndarray:
    """`count` lines cycling through `lines` in a scrambled order; returns which line each row is."""
    which = (np.arange(count, dtype=np.int64) * 7919) % len(lines)
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, count, 100_000):
            f.write("".join(lines[i] + "\n" for i in which[start:start + 100_000]))
    return which


def run_measured(*args, **kwargs):
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, "encode", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=1200, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return proc, int(proc.stderr.strip().splitlines()[-1].split()[1]) * 1024


@pytest.mark.slow
def test_million_lines_bounded_memory_same_rows(st_model, tmp_path):
    lines = distinct_lines()
    ref = Encoder.from_pretrained(st_model, device="cpu").encode(lines)
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    which = write_lines(big, 1_000_000, lines)
    write_lines(small, 10_000, lines)
    args = ("--model", st_model, "--device", "cpu", "--quiet")
    _, small_rss = run_measured(small, "-o", tmp_path / "small.npy", *args)
    _, big_rss = run_measured(big, "-o", tmp_path / "big.npy", *args)
    got = np.load(tmp_path / "big.npy", mmap_mode="r")
    assert got.shape == (1_000_000, 32) and got.dtype == np.float32
    for start in range(0, len(got), 200_000):
        part = np.asarray(got[start:start + 200_000])
        assert np.abs(part - ref[which[start:start + 200_000]]).max() <= BATCHING_INVARIANCE_FP32
    assert big_rss - small_rss < 300 * 2 ** 20, (big_rss, small_rss)


def test_stdin_streams_output_before_input_ends(st_model):
    """Rows come out while standard input is still open: nothing waits for the whole input."""
    lines = distinct_lines(40_000)
    proc = subprocess.Popen([EXE, "encode", "-", "-o", "-", "--model", str(st_model), "--device", "cpu",
                             "--quiet"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV)
    more = threading.Event()

    def feed():
        proc.stdin.write("".join(line + "\n" for line in lines).encode())
        proc.stdin.flush()
        more.wait(timeout=120)
        proc.stdin.write(b"one more line\n")
        proc.stdin.close()

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        first = json.loads(proc.stdout.readline())
        assert first["line"] == 1 and not more.is_set()  # stdin is still open here
        more.set()
        rest = [json.loads(line) for line in proc.stdout]
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        more.set()
        proc.kill()
        proc.wait()
        feeder.join(timeout=60)
    assert [r["line"] for r in [first] + rest] == list(range(1, len(lines) + 2))
    ref = Encoder.from_pretrained(st_model, device="cpu").encode(lines[:5] + ["one more line"])
    got = np.array([r["embedding"] for r in [first] + rest[:4] + rest[-1:]], dtype=np.float32)
    assert np.abs(got - ref).max() <= BATCHING_INVARIANCE_FP32


def _wait_for_temp(folder: Path, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.endswith(".tmp") for p in folder.iterdir()):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_signal_mid_run_leaves_no_output_and_no_temp(st_model, tmp_path, sig, code, word):
    src = tmp_path / "in.txt"
    write_lines(src, 400_000, distinct_lines())
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # as from a terminal: SIGINT at its default even if this test runs with it ignored (a background job)
    proc = subprocess.Popen([EXE, "encode", str(src), "-o", str(out_dir / "emb.npy"), "--model", str(st_model),
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert _wait_for_temp(out_dir), "the run never started writing"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert f"ftengine: {word}" in err and "Traceback" not in err
    assert list(out_dir.iterdir()) == []


def test_output_permissions_follow_the_umask(st_model, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("hello\nworld\n")
    out = tmp_path / "emb.npy"
    proc = subprocess.run(["sh", "-c", f"umask 027 && exec {EXE} encode {src} -o {out} --model {st_model} "
                           "--device cpu --quiet"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    out.chmod(0o604)  # an existing file keeps its mode when replaced
    proc = subprocess.run([EXE, "encode", str(src), "-o", str(out), "--model", str(st_model), "--device", "cpu",
                           "--quiet"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o604 and np.load(out).shape == (2, 32)


def test_symlink_is_written_through(st_model, tmp_path):
    from click.testing import CliRunner
    from cli import main
    src = tmp_path / "in.txt"
    src.write_text("hello\nworld\n")
    real = tmp_path / "data" / "real.npy"
    real.parent.mkdir()
    link = tmp_path / "link.npy"
    link.symlink_to(real)
    r = CliRunner().invoke(main, ["encode", str(src), "-o", str(link), "--model", str(st_model), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and np.load(real).shape == (2, 32)
    assert sorted(p.name for p in real.parent.iterdir()) == ["real.npy"]


def test_dev_stdout_stays_a_device(st_model, tmp_path):
    """-o /dev/stdout writes to standard output (here a pipe); it is not replaced by a file."""
    src = tmp_path / "in.txt"
    src.write_text("hello\nworld\n")
    was_link = os.path.islink("/dev/stdout")
    proc = subprocess.run([EXE, "encode", str(src), "-o", "/dev/stdout", "--format", "jsonl", "--model",
                           str(st_model), "--device", "cpu", "--quiet"], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["line"] for line in proc.stdout.splitlines()] == [1, 2]
    assert os.path.islink("/dev/stdout") == was_link


def test_npy_through_a_pipe(st_model, tmp_path):
    """npy to a pipe: the header needs the row count, so the rows are spooled and sent after it."""
    src = tmp_path / "in.txt"
    src.write_text("hello\nworld\nthe dog\n")
    proc = subprocess.run(["sh", "-c", f"{EXE} encode {src} -o /dev/stdout --format npy --model {st_model} "
                           f"--device cpu --quiet | cat > {tmp_path / 'piped.npy'}"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ref = Encoder.from_pretrained(st_model, device="cpu").encode(["hello", "world", "the dog"])
    assert np.abs(np.load(tmp_path / "piped.npy") - ref).max() <= BATCHING_INVARIANCE_FP32


@pytest.mark.parametrize("target, message", [
    ("/proc/x.npy", "cannot write output /proc/x.npy: "),
    ("/dev/full", "cannot write output /dev/full: No space left on device"),
])
def test_os_errors_on_output_are_one_line(st_model, tmp_path, target, message):
    src = tmp_path / "in.txt"
    src.write_text("hello\nworld\n")
    proc = subprocess.run([EXE, "encode", str(src), "-o", target, "--format", "npy", "--model", str(st_model),
                           "--device", "cpu"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_failed_rename_is_a_clear_error_and_leaves_no_temp(st_model, tmp_path):
    """The rename into place fails (the target became a non-empty directory mid-run): a clear
    error, the temporary file removed."""
    from ftengine.errors import OutputError
    from ftengine.writers import EmbeddingWriter
    target = tmp_path / "out.npy"
    writer = EmbeddingWriter(str(target), "npy", 4)
    writer.write(np.ones((3, 4), np.float32))
    target.mkdir()
    (target / "inside").write_text("x")
    with pytest.raises(OutputError, match=f"cannot write output {target}: "):
        with writer:
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npy"]
