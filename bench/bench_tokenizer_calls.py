"""Small tokenizer calls: the GPU tokenizer against HF `tokenizers` by the number of texts a call.

A service tokenises each request on its own (TEI `POST /embed`: a few short sentences; `POST
/rerank`: a query and its texts as pairs), so its calls are small, where the GPU tokenizer's fixed
cost (copies, launches, two waits for the device) outweighs its speed. Measured on bench_serve's
short sentences (6 to 19 vocabulary words) and on pairs of one and another:
  - one thread: the median wall time of a call of n texts (or pairs), each tokenizer;
  - THREADS threads calling at once, as a service's request threads do: texts a second, all told.
The ids are checked equal first. The figures set gpu_tokenizer.AUTO_MIN_TEXTS, the call size below
which `tokenizer="auto"` hands a call to the CPU tokenizer.

Usage: python bench/bench_tokenizer_calls.py --model-src PATH [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_serve import sentences  # noqa: E402

SIZES = (1, 8, 32, 64, 128, 256, 512, 2048)
THREADED_SIZES = (1, 32, 256)
THREADS = 8
SECONDS = 2.0


def _call_seconds(fn, inputs: list, repeats: int = 30) -> float:
    fn(inputs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _threaded_rate(fn, inputs: list) -> float:
    """Inputs a second with THREADS threads each calling fn(inputs) for SECONDS."""
    counts = [0] * THREADS
    stop = time.perf_counter() + SECONDS

    def work(k):
        while time.perf_counter() < stop:
            fn(inputs)
            counts[k] += len(inputs)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-src", type=Path, required=True, help="a folder with the model's tokenizer files")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import cupy
    from ftengine.backends.cuda import ops
    from ftengine.gpu_tokenizer import GpuTokenizer
    from ftengine.tokenizer import Tokenizer
    cpu = Tokenizer(args.model_src, max_length=256)
    gpu = GpuTokenizer(cpu, ops=ops)
    gpu.tables  # noqa: B018  (built before timing)
    texts = sentences(args.model_src / "vocab.txt", max(SIZES), seed=1)
    pairs = list(zip(sentences(args.model_src / "vocab.txt", max(SIZES), seed=2), texts))
    kinds = {"texts": (texts, "encode"), "pairs": (pairs, "encode_pairs")}
    for inputs, method in kinds.values():
        a, b = getattr(gpu, method)(inputs), getattr(cpu, method)(inputs)
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.lengths, b.lengths), method
    rows = []
    for kind, (inputs, method) in kinds.items():
        for n in SIZES:
            row = {"kind": kind, "n": n}
            for name, tok in (("gpu", gpu), ("cpu", cpu)):
                row[f"{name}_us"] = round(_call_seconds(getattr(tok, method), inputs[:n]) * 1e6, 1)
                if n in THREADED_SIZES:
                    row[f"{name}_threads_per_s"] = round(_threaded_rate(getattr(tok, method), inputs[:n]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result = {"device": props["name"].decode(), "date": date.today().isoformat(), "threads": THREADS,
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenizer_calls.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "tokenizer_calls.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    out = [f"# Small tokenizer calls — {r['device']}, {r['date']}", "",
           "The GPU tokenizer (`GpuTokenizer.encode` / `encode_pairs`, the whole call) against HF `tokenizers` "
           "(`Tokenizer`), on short sentences of 6 to 19 vocabulary words (bench_serve's) and pairs of them, "
           "all-MiniLM-L6-v2's tokenizer, max length 256. One thread: median wall time of a call. "
           f"{r['threads']} threads: each calling with the same n at once, inputs a second all told. Versions: "
           + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".", "",
           "| inputs | n a call | GPU µs | HF µs | GPU / HF time | GPU, threads (inputs/s) | HF, threads (inputs/s) |",
           "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        threaded = [f"{row[k]:,}" if k in row else "" for k in ("gpu_threads_per_s", "cpu_threads_per_s")]
        out.append(f"| {row['kind']} | {row['n']:,} | {row['gpu_us']:,} | {row['cpu_us']:,} | "
                   f"{row['gpu_us'] / row['cpu_us']:.2f} | {threaded[0]} | {threaded[1]} |")
    return "\n".join(out + [""])


if __name__ == "__main__":
    main()
