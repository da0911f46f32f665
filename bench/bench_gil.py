"""Calls into the engine from a thread beside another thread that runs Python, as a service's
engine and tokenizer threads run beside its event loop.

A thread that gives up the GIL for a call (CuPy's CUDA calls, ctypes.CDLL's, NumPy on larger
arrays, a blocking wait) gets it back only when the thread holding it lets go: at once if that
thread is idle, up to the interpreter's switch interval (5 ms) if it runs Python. Measured here:
the wall time of a call from a second thread while the main thread is
  - idle (asleep);
  - in bursts: 2 ms of Python, then 2 ms asleep, as an event loop handles a burst of requests;
  - busy: Python all the time.
Calls: the GPU tokenizer (GpuTokenizer.encode), HF `tokenizers` (Tokenizer.encode: its Rust code
runs without the GIL) and Encoder.encode with the GPU tokenizer (the engine's tokenizer and
worker threads, the caller waiting on its future), on CALL_TEXTS of bench_serve's short
sentences, all-MiniLM-L6-v2's shape and tokenizer, random weights, fp16. The ratio printed: HF's
time over the GPU tokenizer's, beside each kind of main thread.

Usage: python bench/bench_gil.py --model-src PATH [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_serve import sentences  # noqa: E402

CALL_TEXTS = 256
CALLS = 60
MODES = ("idle", "bursts", "busy")


def _spin(seconds: float):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def beside(mode: str, fn) -> list:
    """Wall times (s) of CALLS calls of fn from a second thread while this one is `mode`."""
    times, finished = [], threading.Event()

    def calls():
        for _ in range(CALLS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finished.set()

    caller = threading.Thread(target=calls)
    caller.start()
    while not finished.is_set():
        if mode == "idle":
            time.sleep(0.001)
        elif mode == "bursts":
            _spin(0.002)
            time.sleep(0.002)
        else:
            _spin(0.005)
    caller.join()
    return times


def markdown(r: dict) -> str:
    out = [f"# Calls beside a thread that runs Python — {r['device']}, {r['date']}", "",
           f"Wall time of one call from a second thread, {CALLS} calls, {r['texts']} short sentences a call "
           "(bench_serve's), all-MiniLM-L6-v2 shape and tokenizer, random weights, fp16; the main thread idle, in "
           "bursts (2 ms of Python, 2 ms asleep) or busy (Python all the time). Versions: "
           + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".", "",
           "| call | main thread | median ms | mean ms |", "|---|---|---|---|"]
    for c in r["cases"]:
        out.append(f"| {c['call']} | {c['main']} | {c['median_ms']} | {c['mean_ms']} |")
    out += ["", "HF `tokenizers` time / GPU tokenizer time: "
            + ", ".join(f"{m} {r['hf_over_gpu'][m]}x" for m in MODES) + ".", ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-src", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import cupy
    import numpy as np
    from bench.bench_pipeline import make_model
    from ftengine import Encoder
    model = make_model(args.model_src, Path(tempfile.mkdtemp(prefix="ftengine-gil-")) / "model")
    texts = sentences(model / "vocab.txt", CALL_TEXTS)
    with Encoder.from_pretrained(model, device="cuda", tokenizer="gpu") as encoder:
        gpu = encoder.tokenizer
        gpu.tables  # built before any timing
        hf = gpu._cpu
        if not np.array_equal(gpu.encode(texts).ids, hf.encode(texts).ids):
            raise SystemExit("the GPU tokenizer's ids differ from HF's")
        calls = {"GPU tokenizer": lambda: gpu.encode(texts), "HF tokenizers": lambda: hf.encode(texts),
                 "Encoder.encode (GPU tokenizer)": lambda: encoder.encode(texts)}
        for fn in calls.values():
            for _ in range(10):
                fn()
        cases = []
        for name, fn in calls.items():
            for mode in MODES:
                times = beside(mode, fn)
                cases.append({"call": name, "main": mode, "median_ms": round(1e3 * statistics.median(times), 3),
                              "mean_ms": round(1e3 * statistics.fmean(times), 3)})
                print(json.dumps(cases[-1]), flush=True)
    median = {(c["call"], c["main"]): c["median_ms"] for c in cases}
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result = {"device": props["name"].decode(), "date": date.today().isoformat(), "texts": CALL_TEXTS,
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__}, "cases": cases,
              "hf_over_gpu": {m: round(median["HF tokenizers", m] / median["GPU tokenizer", m], 2) for m in MODES}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gil.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "gil.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
