"""What dtype fp8 costs in accuracy, product by product: the default model (all-MiniLM-L6-v2) run on
the NumPy backend in fp32 with e4m3 rounding applied to the operands of chosen products, as the
CUDA fp8 path applies it (bench/results/fp8_accuracy.{json,md}).

Each product's operands are rounded the way ftengine's fp8 path rounds them: activations per token
(row amax / 448, e4m3 round-to-nearest-even, numpy_ops.e4m3_bytes), weights per output channel
(row). A variant names the products so rounded (`qkv`, `out`: the attention output projection,
`up`: the FFN up-projection, `down`: the FFN down-projection); `/128` rounds with one scale per
128 columns of K instead of one per row (per token for activations, per channel for weights);
`weights` / `activations` round only the weights / only the activations of those products; `int8`
rounds to symmetric int8 instead (amax / 127, round to nearest), as an answer to what would do better. The
row `qkv up down` is what `--dtype fp8` computes today (the output projection stays fp16); its
figure is checked against the GPU's in bench/results/encoder.md. Everything else is fp32 here, so
the cosines isolate the e4m3 rounding; each is between a variant's pooled, normalised embedding
and the plain fp32 one's, over the same synthetic lines.

    python bench/fp8_accuracy.py --model-src PATH [--lines 2000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from datetime import date
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_encoder import synthetic_lines  # noqa: E402
from ftengine import Encoder  # noqa: E402
from ftengine.backends import numpy_ops  # noqa: E402

VARIANTS = ("qkv up down", "qkv up down out", "qkv up", "up down", "qkv down", "qkv", "up", "down",
            "qkv up down /128", "down /128", "qkv up down weights", "qkv up down activations",
            "qkv up down int8", "qkv up down int8 weights")


def rounded(a, group: int | None, int8: bool = False):
    """a (rows, K) float32 with e4m3 rounding applied as the fp8 path applies it (numpy_ops.
    quantize_rows: one scale per row), or per `group` columns; int8: symmetric int8 instead."""
    a = np.asarray(a, np.float32)
    rows, k = a.shape
    blocks = a.reshape(-1, group or k)
    if int8:
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
        values = np.rint(blocks / scale) * scale
    else:
        q, scales = np.empty(blocks.shape, np.uint8), np.empty(blocks.shape[0], np.float32)
        numpy_ops.quantize_rows(q, scales, blocks)
        values = numpy_ops.e4m3_values(q) * scales[:, None]
    return values.reshape(rows, k)


def fp8_ops(products: set, group: int | None, operands=("activations", "weights"), int8=False):
    """numpy_ops with the `operands` of `products` rounded to e4m3 (or int8) before each of them;
    a product is known by its weight's shape (E x E: the attention output, 3E x E: the QKV)."""
    ops = types.ModuleType("fp8_ops")
    ops.__dict__.update({k: v for k, v in vars(numpy_ops).items() if not k.startswith("__")})

    def r(x, weight, name):
        if name not in products:
            return x, weight
        return (rounded(x, group, int8) if "activations" in operands else x,
                rounded(weight, group, int8) if "weights" in operands else weight)

    def matmul(out, x, weight):
        name = "qkv" if weight.shape[0] == 3 * weight.shape[1] else None
        numpy_ops.matmul(out, *r(x, weight, name))

    def matmul_bias_gelu(out, x, weight, bias, *, form):
        numpy_ops.matmul_bias_gelu(out, *r(x, weight, "up"), bias, form=form)

    def matmul_bias_residual_layernorm(out, x, weight, *rest, **options):
        name = "out" if weight.shape[0] == weight.shape[1] else "down"
        numpy_ops.matmul_bias_residual_layernorm(out, *r(x, weight, name), *rest, **options)

    ops.matmul, ops.matmul_bias_gelu = matmul, matmul_bias_gelu
    ops.matmul_bias_residual_layernorm = matmul_bias_residual_layernorm
    return ops


def embed(model: Path, lines: list, ops=None):
    """The model's pooled, normalised embeddings of `lines` on the NumPy backend (through `ops`)."""
    with mock.patch("ftengine.encoder.get_ops", lambda device: ops or numpy_ops):
        with Encoder.from_pretrained(model, device="cpu") as encoder:
            return encoder.encode(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-src", type=Path, required=True, help="all-MiniLM-L6-v2 (sentence-transformers folder)")
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    lines = synthetic_lines(a.lines, np.random.default_rng(6))
    reference = embed(a.model_src, lines)
    rows = []
    for variant in VARIANTS:
        names = set(variant.split())
        group = 128 if "/128" in names else None
        operands = tuple(names & {"activations", "weights"}) or ("activations", "weights")
        products = names - {"/128", "activations", "weights", "int8"}
        got = embed(a.model_src, lines, fp8_ops(products, group, operands, "int8" in names))
        cos = (got * reference).sum(1)
        rows.append({"variant": variant, "cosine_min": round(float(cos.min()), 6),
                     "cosine_mean": round(float(cos.mean()), 6)})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        result = {"date": date.today().isoformat(), "model": a.model_src.name, "lines": len(lines), "rows": rows}
        (a.out / "fp8_accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
        md = [f"# dtype fp8 accuracy, product by product — all-MiniLM-L6-v2, {result['date']}", "",
              f"NumPy backend (fp32) with e4m3 rounding of the named products' operands (activations per token, "
              f"weights per output channel; `/128`: one scale per 128 columns of K instead; `weights` / "
              f"`activations`: only those operands; `int8`: symmetric int8 instead of e4m3), {len(lines):,} "
              f"synthetic lines; cosine of the pooled, normalised embeddings against plain fp32. "
              f"`qkv up down` is `--dtype fp8` as it ships.", "",
              "| e4m3 products | cosine min | cosine mean |", "|---|---|---|"]
        md += [f"| {r['variant']} | {r['cosine_min']:.6f} | {r['cosine_mean']:.6f} |" for r in rows]
        (a.out / "fp8_accuracy.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
