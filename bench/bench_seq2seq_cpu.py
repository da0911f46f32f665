"""Encoder-decoders on the CPU: ftengine's NumPy backend against CTranslate2 (float32 and int8),
same process, same cores. Reported, not a target: CTranslate2's CPU kernels are hand-tuned
C++ (oneDNN / MKL, int8 GEMMs), ours are NumPy's BLAS calls.

Marian-base's shapes (opus-mt-en-de: d_model 512, 6 + 6 layers, a 58,101-token vocabulary) with
HF's random initialisation, saved once, converted by CTranslate2's own converter (with a
synthetic vocabulary of that size) and loaded by both; 32-token sources of random ids, 64 new
tokens (a minimum and maximum of 64 on both sides); batch 1 and 8; greedy and beam 4. Both are
timed from token ids (CTranslate2: token strings) in to chosen ids out; the better of two runs
after a warm-up. CTranslate2 runs with intra_threads = the machine's cores.

Usage: python bench/bench_seq2seq_cpu.py --out bench/results   (needs ctranslate2, transformers)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_seq2seq import MARIAN_BASE, NEW, SOURCE, seq2seq_generation  # noqa: E402
from ftengine.backends import numpy_ops  # noqa: E402
from weights.fixtures import write_marian_tokenizer  # noqa: E402

CASES = [("greedy", 1), ("greedy", 8), ("beam 4", 1), ("beam 4", 8)]
RUNS = 2


def save_model(folder: Path) -> list:
    """Marian-base with HF's random weights and a vocab.json of its 58,101 tokens (synthetic
    pieces; the sentencepiece files are the test fixture's, which the converter only loads).
    Returns the tokens by id."""
    import torch
    from transformers import MarianConfig, MarianMTModel
    torch.manual_seed(0)
    MarianMTModel(MarianConfig(**MARIAN_BASE)).save_pretrained(str(folder))
    write_marian_tokenizer(folder)
    v = MARIAN_BASE["vocab_size"]
    tokens = ["</s>", "<unk>"] + [f"\u2581w{i}" for i in range(2, v - 1)] + ["<pad>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    return tokens


def best_ms(run) -> float:
    run()
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def ours(folder: Path, sources: list, beams: int) -> float:
    return best_ms(seq2seq_generation(folder, sources, beams, numpy_ops, "fp32")[1])


def theirs(model_dir: Path, tokens: list, sources: list, beams: int, compute_type: str) -> float:
    import ctranslate2
    translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type,
                                        intra_threads=os.cpu_count())
    batch = [[tokens[i] for i in s] for s in sources]
    return best_ms(lambda: translator.translate_batch(batch, beam_size=beams, max_decoding_length=NEW,
                                                      min_decoding_length=NEW, max_batch_size=len(batch)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    import ctranslate2
    import transformers
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder, converted = Path(tmp) / "marian-base", {}
        tokens = save_model(folder)
        for quantization in ("float32", "int8"):
            converted[quantization] = Path(tmp) / f"ct2-{quantization}"
            ctranslate2.converters.TransformersConverter(str(folder)).convert(
                str(converted[quantization]), quantization=quantization, force=True)
        for mode, batch in CASES:
            beams = 4 if mode.startswith("beam") else 1
            sources = rng.integers(2, MARIAN_BASE["vocab_size"] - 1, (batch, SOURCE)).tolist()
            for s in sources:
                s[-1] = MARIAN_BASE["eos_token_id"]
            row = {"mode": mode, "batch": batch, "ftengine_numpy_ms": round(ours(folder, sources, beams), 1)}
            for quantization, path in converted.items():
                row[f"ct2_{quantization}_ms"] = round(theirs(path, tokens, sources, beams, quantization), 1)
            row["tokens"] = batch * NEW
            print(json.dumps(row), flush=True)
            rows.append(row)
    cpu = platform.processor() or platform.machine()
    result = {"date": date.today().isoformat(), "cores": os.cpu_count(), "cpu": cpu, "rows": rows,
              "versions": {"python": platform.python_version(), "numpy": np.__version__,
                           "ctranslate2": ctranslate2.__version__, "transformers": transformers.__version__}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seq2seq_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Encoder-decoders on the CPU — {os.cpu_count()} cores ({cpu}), {result['date']}", "",
             "Marian-base shapes, HF random initialisation, 32-token sources, 64 new tokens; ftengine's NumPy backend "
             "(fp32) and CTranslate2 "
             f"{ctranslate2.__version__} (float32, int8) in one process; best of {RUNS} after a warm-up; "
             "generated tokens/s = batch x 64 / whole generation. Reported, not a target.", "",
             "| mode | batch | ftengine NumPy tokens/s | CTranslate2 float32 tokens/s | CTranslate2 int8 tokens/s "
             "| NumPy / CT2 float32 |", "|---|---|---|---|---|---|"]
    for r in rows:
        rate = {k: r["tokens"] / r[k] * 1e3 for k in ("ftengine_numpy_ms", "ct2_float32_ms", "ct2_int8_ms")}
        lines.append(f"| {r['mode']} | {r['batch']} | {rate['ftengine_numpy_ms']:,.0f} | {rate['ct2_float32_ms']:,.0f} "
                     f"| {rate['ct2_int8_ms']:,.0f} | {rate['ftengine_numpy_ms'] / rate['ct2_float32_ms']:.2f}x |")
    (out / "seq2seq_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
