"""The cuBLASLt algorithm file (ftengine/backends/cuda/algo_cache.py) across processes: BERT-base fp16
(HF random initialisation), the first batch of each row bucket in a new process, and whether two
processes give the same embeddings bit for bit. Two processes one after the other, twice: with the
algorithm choices in memory only (FTENGINE_ALGO_CACHE empty: each process times the candidate
algorithms of each bucket's first shape anew, as before the file), and with one file for both (the
second process reads the first one's choices). Each process: the runner built, one 1 x 128 batch
(no product of 4,096 rows or more: no trial) to load the kernels, then per batch shape its first
call (planning with the trial where there is one, graph capture, replay: end to end, synchronised)
and the median of 10 calls after it. A process first run before the four, its figures dropped,
fills the kernel cache.

Usage: python bench/bench_algo_cache.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(32, 128), (64, 128), (128, 128), (256, 128)]  # 4,096 to 32,768 tokens: one row bucket each
ENV = "FTENGINE_ALGO_CACHE"


def child(folder: Path, out: Path):
    """One process's figures (JSON on stdout) and embeddings (out, .npz)."""
    from ftengine.backends.cuda import ops as cuda_ops
    from ftengine.checkpoint import load_bert_weights
    from ftengine.config import load_bert_config
    from ftengine.models.bert import Batch, BertRunner
    config = load_bert_config(folder)
    runner = BertRunner(config, load_bert_weights(folder, config), cuda_ops, dtype="fp16", max_batch_tokens=32768,
                        max_seq_len=512)
    rng = np.random.default_rng(0)

    def batch(b, s):
        ids = rng.integers(1000, config.vocab_size, (b, s)).tolist()
        return Batch.from_lists(ids, [[0] * s] * b)

    def embed(x):
        result = runner.embed(x, pooling=("mean",), normalize=True)
        cuda_ops.synchronize()
        return result

    embed(batch(1, 128))
    rows, embeddings = [], {}
    for b, s in SHAPES:
        x = batch(b, s)
        t0 = time.perf_counter()
        embeddings[f"{b}x{s}"] = embed(x)
        first = (time.perf_counter() - t0) * 1e3
        steady = []
        for _ in range(10):
            t0 = time.perf_counter()
            embed(x)
            steady.append((time.perf_counter() - t0) * 1e3)
        rows.append({"batch": f"{b} x {s}", "first_ms": round(first, 2),
                     "steady_ms": round(statistics.median(steady), 3)})
    np.savez(out, **embeddings)
    print(json.dumps({"rows": rows, "device": cuda_ops.context().device_name}))


def run_child(folder: Path, out: Path, algo_folder: str) -> dict:
    env = dict(os.environ, **{ENV: algo_folder})
    done = subprocess.run([sys.executable, __file__, "--child", str(folder), "--embeddings", str(out)], env=env,
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--embeddings", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(Path(args.child), Path(args.embeddings))
        return
    from bench.bench_encoder import save_hf_bert_base, versions
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_hf_bert_base(tmp / "bert-base")
        run_child(tmp / "bert-base", tmp / "warm.npz", "")
        modes = {"memory only": "", "one file": str(tmp / "algos")}
        results = {}
        for mode, algo_folder in modes.items():
            runs = [run_child(tmp / "bert-base", tmp / f"{mode}-{i}.npz", algo_folder) for i in range(2)]
            first, second = (np.load(tmp / f"{mode}-{i}.npz") for i in range(2))
            for i, row in enumerate(runs[1]["rows"]):
                name = f"{SHAPES[i][0]}x{SHAPES[i][1]}"
                row["first_ms_process_1"] = runs[0]["rows"][i]["first_ms"]
                row["steady_ms_process_1"] = runs[0]["rows"][i]["steady_ms"]
                row["max_abs_diff_vs_process_1"] = float(np.abs(first[name] - second[name]).max())
                row["bit_equal"] = bool(np.array_equal(first[name], second[name]))
            results[mode] = runs[1]["rows"]
            device = runs[1]["device"]
    report = {"device": device, "date": date.today().isoformat(), "versions": versions(), "modes": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "algo_cache.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "algo_cache.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report) -> str:
    lines = [f"# cuBLASLt algorithm file across processes — {report['device']}, {report['date']}", "",
             "BERT-base fp16 (HF random initialisation), packed, end to end. Two processes one after the other: "
             "their first call of each batch shape (the trial of the row bucket's candidate algorithms where "
             "there is one, graph capture, replay) and the median of 10 calls after it; whether the second "
             "process's embeddings equal the first's bit for bit. `memory only`: FTENGINE_ALGO_CACHE empty, "
             "each process times the candidates again (as before the file), so the two agree where their "
             "trials pick the same candidates; `one file`: the second process reads the first one's choices.",
             "", "| choices | batch | first call ms, process 1 | first call ms, process 2 | steady ms (1 / 2) "
             "| process 2 = process 1 | max abs diff |", "|---|---|---|---|---|---|---|"]
    for mode, rows in report["modes"].items():
        for row in rows:
            lines.append(f"| {mode} | {row['batch']} | {row['first_ms_process_1']:.1f} | {row['first_ms']:.1f} "
                         f"| {row['steady_ms_process_1']:.3f} / {row['steady_ms']:.3f} "
                         f"| {'bit for bit' if row['bit_equal'] else 'no'} | {row['max_abs_diff_vs_process_1']:.2g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
