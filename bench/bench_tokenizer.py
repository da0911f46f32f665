"""Tokenisation alone: the GPU tokenizer (kernels_cu/wordpiece.cu) against HF `tokenizers`, same lines.

The lines are bench_pipeline's (whole vocabulary words of the model's tokenizer, log-normal token
counts), tokenised with truncation at the model's max length, in groups of the sizes the encode
engine hands its tokenizer. Timed after a warm-up (the GPU tokenizer: median of 3 runs; HF, whose run takes seconds: one):
  - HF `tokenizers` (Tokenizer.encode: encode_batch_fast on every core),
  - the GPU tokenizer's whole call (GpuTokenizer.encode: bytes to the device, kernels, ids back), on
    Python strings and on the file's undecoded lines (RawTexts, as `ftengine encode FILE` hands them),
  - its kernels alone (CUDA events around wordpiece_tokenize + pack_rows, the input on the device).
Both tokenizers' ids are checked equal first.

Usage: python bench/bench_tokenizer.py --model-src PATH [--lines 200000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_pipeline import make_lines  # noqa: E402

GROUPS = (4096, 8192, 65536)  # the engine's group of str texts, encode's window of a file, a large call
TARGET_TOKENS_PER_S = 50e6


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kernel_seconds(gpu, groups: list) -> float:
    """Device time of the two kernels over all groups (inputs already on the device)."""
    import cupy
    from ftengine.backends.cuda import ops
    tables = gpu.tables
    staged = []
    for texts in groups:
        raw, starts, stops = gpu._bytes(texts)
        starts, stops, cut = gpu._cut(raw, starts, stops)
        n = len(texts)
        staged.append((ops.to_device(raw), ops.to_device(starts), ops.to_device(stops), ops.to_device(cut),
                       ops.empty((n, tables.max_length), np.int32), ops.empty((n,), np.int32),
                       ops.empty((n,), np.uint8), ops.empty((n * tables.max_length,), np.int32),
                       ops.to_device(np.arange(n, dtype=np.int64) * tables.max_length)))

    def run():
        for text, starts, stops, cut, ids, lengths, flags, packed, offsets in staged:
            ops.wordpiece_tokenize(tables, text, starts, stops, cut, ids, lengths, flags)
            ops.pack_rows(ids, lengths, offsets, packed)
    run()
    stream = ops.context().stream
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(5):
        start.record(stream)
        run()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-src", type=Path, required=True, help="a folder with the model's tokenizer files")
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import cupy
    import tokenizers
    from ftengine.backends.cuda import ops
    from ftengine.gpu_tokenizer import GpuTokenizer
    from ftengine.textio import _raw_windows
    from ftengine.tokenizer import Tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lines.txt"
        make_lines(path, args.lines, args.model_src / "vocab.txt")
        lines = path.read_text(encoding="utf-8").splitlines()
        data = path.read_bytes().rstrip(b"\n")
    cpu = Tokenizer(args.model_src, max_length=256)
    gpu = GpuTokenizer(cpu, ops=ops)
    t0 = time.perf_counter()
    gpu.tables  # noqa: B018 - waits for the tables (measured, or from the disk cache)
    tables_s = time.perf_counter() - t0
    rows = []
    for size in GROUPS:
        groups = [lines[at:at + size] for at in range(0, len(lines), size)]
        raw = list(_raw_windows(data, size, 1, "lines.txt", "strict"))  # as RawLines.windows makes them
        tokens = 0
        for texts in groups:
            want, got = cpu.encode(texts), gpu.encode(texts)
            assert np.array_equal(want.ids, got.ids) and np.array_equal(want.truncated, got.truncated)
            tokens += want.tokens
        assert np.array_equal(np.concatenate([gpu.encode(r).ids for r in raw]),
                              np.concatenate([cpu.encode(t).ids for t in groups]))
        hf = _median_seconds(lambda: [cpu.encode(t) for t in groups], 1)
        whole = _median_seconds(lambda: [gpu.encode(t) for t in groups], 3)
        undecoded = _median_seconds(lambda: [gpu.encode(r) for r in raw], 3)
        kernels = _kernel_seconds(gpu, groups)
        for name, sec in (("HF tokenizers (all cores)", hf), ("GPU tokenizer, whole call", whole),
                          ("GPU tokenizer, whole call, file bytes", undecoded),
                          ("GPU tokenizer, kernels only", kernels)):
            rows.append({"group": size, "tokenizer": name, "seconds": round(sec, 4), "lines_per_s": round(len(lines) / sec),
                         "tokens_per_s": round(tokens / sec), "vs_hf": round(hf / sec, 2)})
            print(json.dumps(rows[-1]), flush=True)
    result = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "date": date.today().isoformat(),
              "lines": len(lines), "tokens": tokens, "tables_seconds": round(tables_s, 2),
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__,
                           "tokenizers": tokenizers.__version__, "numpy": np.__version__},
              "rows": rows}
    out = [f"# Tokenisation alone — {result['device']}, {result['date']}", "",
           f"{len(lines):,} lines ({tokens:,} tokens after truncation at 256), all-MiniLM-L6-v2's tokenizer, the "
           "same ids from both (checked). Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
           + f". Target: the GPU tokenizer at {TARGET_TOKENS_PER_S / 1e6:.0f} M tokens/s or more.", "",
           "| texts a call | tokenizer | lines/s | tokens/s | vs HF |", "|---|---|---|---|---|"]
    out += [f"| {r['group']:,} | {r['tokenizer']} | {r['lines_per_s']:,} | {r['tokens_per_s'] / 1e6:.1f} M | "
            f"{r['vs_hf']}x |" for r in rows]
    out += ["", f"Tables (Unicode table from the disk cache or measured, vocabulary trie): {tables_s:.2f} s.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenizer.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "tokenizer.md").write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()
