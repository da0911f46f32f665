"""GEMM benchmark: the encoder's and decoder's matrix products through cuBLAS's GemmEx (the
binding before cuBLASLt), cuBLASLt with its heuristic's first algorithm, the fastest of the
plan's candidate algorithms each timed here, and ftengine's ops.matmul (its algorithm timed
once per shape on first use), plus the FFN up-projection with its bias + GELU as a separate
pass against cuBLASLt's fused GELU_BIAS epilogue, the bias + erf GELU product as
ops.matmul_bias_gelu runs it (the wgmma product's tiles on compute capability 9.0: GELU_ROWS x
GELU_SHAPES) against cuBLASLt's product followed by that pass, and the product + bias + residual +
LayerNorm as ops.matmul_bias_residual_layernorm runs it (LN_ROWS x LN_SHAPES) against the product
followed by the LayerNorm kernel. fp16, BERT-base / GPT-2 small /
all-MiniLM-L6-v2 widths, random operands (never zeros). Each figure: the product captured 20 times
into one graph, replayed between events, median.

Usage: python bench/bench_gemm.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_encoder import graph_ms  # noqa: E402
from ftengine.backends.cuda import cublas as cb  # noqa: E402
from ftengine.backends.cuda import algos, gemm  # noqa: E402
from ftengine.backends.cuda import ops as cuda_ops  # noqa: E402

ROWS = (128, 4096, 32768)                                  # 1 x 128, 32 x 128, 256 x 128 tokens
SHAPES = {"qkv 768->2304": (2304, 768), "attn out 768->768": (768, 768), "ffn up 768->3072": (3072, 768),
          "ffn down 3072->768": (768, 3072)}
# the erf bias + GELU product's routes: 16 / 64 / 128 tokens of one sequence up to 256 x 128
GELU_ROWS = (16, 64, 128, 512, 1024, 4096, 32768)
GELU_SHAPES = {"BERT-base 768->3072": (3072, 768), "all-MiniLM-L6-v2 384->1536": (1536, 384)}
# the product + bias + residual + LayerNorm's routes (ops.matmul_bias_residual_layernorm)
LN_ROWS = (4096, 8192, 32768)
LN_SHAPES = {"all-MiniLM-L6-v2 attn out 384->384": (384, 384), "all-MiniLM-L6-v2 ffn down 1536->384": (384, 1536),
             "BERT-base attn out 768->768": (768, 768), "BERT-base ffn down 3072->768": (768, 3072)}


def operands(rng, m, n, k):
    x = cuda_ops.to_device(rng.standard_normal((m, k)).astype(np.float32) / np.sqrt(k), np.float16)
    w = cuda_ops.to_device(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), np.float16)
    bias = cuda_ops.to_device(rng.standard_normal(n).astype(np.float32), np.float16)
    return x, w, bias, cuda_ops.empty((m, n), np.float16)


def erf_gelu_row(rng, m, name, n, k) -> dict:
    """One product's bias + erf GELU: ops.matmul_bias_gelu (its route) against ops.matmul then the
    bias + GELU pass, both timed as captured graphs."""
    x, w, bias, out = operands(rng, m, n, k)
    cuda_ops.matmul(out, x, w)  # the algorithm choice, outside a capture
    tile = gemm._wgmma_tile(out, x, w, bias)
    row = {"product": name, "rows": m, "route": f"wgmma {tile}-column tiles" if tile else "cuBLASLt + pass",
           "ftengine_ms": graph_ms(lambda: cuda_ops.matmul_bias_gelu(out, x, w, bias, form="erf")),
           "product_then_pass_ms": graph_ms(lambda: (cuda_ops.matmul(out, x, w),
                                                     cuda_ops.add_bias_gelu(out, out, bias, form="erf")))}
    for key in ("ftengine_ms", "product_then_pass_ms"):
        row[key] = round(row[key], 4)
    print(json.dumps(row), flush=True)
    return row


def residual_layernorm_row(rng, m, name, n, k) -> dict:
    """One product + bias + residual + LayerNorm: ops.matmul_bias_residual_layernorm (its route)
    against ops.matmul then the add_bias_residual_layernorm kernel, both timed as captured graphs."""
    x, w, bias, product = operands(rng, m, n, k)
    residual, out = (cuda_ops.to_device(rng.standard_normal((m, n)).astype(np.float32), np.float16) for _ in range(2))
    gamma, beta = (cuda_ops.to_device(rng.standard_normal(n).astype(np.float32), np.float16) for _ in range(2))
    partials = cuda_ops.empty((max(1, cuda_ops.partials_size(m, n)),), np.float32)
    cuda_ops.matmul(product, x, w)  # the algorithm choice, outside a capture
    fused = cuda_ops.wgmma_ln_fits(out, x, w, residual)

    def ftengine():
        cuda_ops.matmul_bias_residual_layernorm(out, x, w, bias, residual, gamma, beta, eps=1e-12, product=product,
                                                partials=partials)

    def unfused():
        cuda_ops.matmul(product, x, w)
        cuda_ops.add_bias_residual_layernorm(out, product, bias, residual, gamma, beta, eps=1e-12)
    row = {"product": name, "rows": m, "route": "wgmma, fused" if fused else "cuBLASLt + LayerNorm kernel",
           "ftengine_ms": graph_ms(ftengine), "product_then_layernorm_ms": graph_ms(unfused)}
    for key in ("ftengine_ms", "product_then_layernorm_ms"):
        row[key] = round(row[key], 4)
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    ctx = cuda_ops.context()
    h = cb.CUDA_R_16F
    rows = []
    for m in ROWS:
        for name, (n, k) in SHAPES.items():
            x, w, bias, out = operands(rng, m, n, k)
            ptrs = (w.data.ptr, x.data.ptr, out.data.ptr)

            def gemm_ex():
                with ctx.stream:
                    ctx.blas.gemm(cb.OP_T, cb.OP_N, n, m, k, ptrs[0], h, k, ptrs[1], h, k, ptrs[2], h, n)

            def lt(algo=None, epilogue="none"):
                with ctx.stream:
                    ctx.lt.matmul(cb.OP_T, cb.OP_N, n, m, k, ptrs[0], h, k, ptrs[1], h, k, ptrs[2], h, n,
                                  epilogue=epilogue, bias=bias.data.ptr, algo=algo)
            key = (cb.OP_T, cb.OP_N, n, m, k, h, k, h, k, h, n, "none")
            candidates = ctx.lt.candidates(key)
            timed = [graph_ms(lambda a=c: lt(a)) for c in candidates]
            cuda_ops.matmul(out, x, w)  # ftengine's own choice for the shape, timed outside a capture
            flop = 2 * m * n * k
            row = {"rows": m, "gemm": name, "flop": flop, "gemm_ex_ms": graph_ms(gemm_ex), "lt_ms": graph_ms(lt),
                   "candidates": len(candidates), "lt_best_ms": min(timed),
                   "lt_best_rank": int(np.argmin(timed)) + 1,
                   "ftengine_ms": graph_ms(lambda: cuda_ops.matmul(out, x, w))}
            if name.startswith("ffn up"):
                row["unfused_bias_gelu_ms"] = graph_ms(lambda: (lt(), cuda_ops.add_bias_gelu(out, out, bias,
                                                                                              form="erf")))
                row["lt_gelu_bias_ms"] = graph_ms(lambda: lt(epilogue="gelu_bias"))
            for key_ in [k_ for k_ in row if k_.endswith("_ms")]:
                row[key_] = round(row[key_], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    gelu_rows = [erf_gelu_row(rng, m, name, n, k) for name, (n, k) in GELU_SHAPES.items() for m in GELU_ROWS]
    ln_rows = [residual_layernorm_row(rng, m, name, n, k) for name, (n, k) in LN_SHAPES.items() for m in LN_ROWS]
    import cupy
    result = {"device": ctx.device_name, "date": date.today().isoformat(),
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__,
                           "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion()},
              "rows": rows, "erf_gelu": gelu_rows, "residual_layernorm": ln_rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# GEMM benchmark — {result['device']}, {result['date']}", "",
             "fp16, fp32 accumulation, random operands; each product captured 20 times in a graph and replayed "
             f"(median). `Lt` runs cuBLASLt's heuristic's first algorithm, `Lt best` the fastest of its first "
             f"{cb.CANDIDATES} (rank in brackets), ftengine its own choice among them (timed once per shape).", "",
             "| rows | product | GemmEx ms (TFLOP/s) | Lt ms (TFLOP/s) | Lt best ms (rank) | ftengine ms (TFLOP/s) | "
             "ftengine / GemmEx |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tf = lambda ms: r["flop"] / ms / 1e9  # noqa: E731
        lines.append(f"| {r['rows']} | {r['gemm']} | {r['gemm_ex_ms']:.4f} ({tf(r['gemm_ex_ms']):.0f}) | "
                     f"{r['lt_ms']:.4f} ({tf(r['lt_ms']):.0f}) | {r['lt_best_ms']:.4f} ({r['lt_best_rank']}) | "
                     f"{r['ftengine_ms']:.4f} ({tf(r['ftengine_ms']):.0f}) | {r['ftengine_ms'] / r['gemm_ex_ms']:.2f} |")
    lines += ["", "FFN up-projection with bias + GELU:", "",
              "| rows | product, then the bias + erf GELU kernel ms | cuBLASLt GELU_BIAS epilogue (tanh form) ms |",
              "|---|---|---|"]
    lines += [f"| {r['rows']} | {r['unfused_bias_gelu_ms']:.4f} | {r['lt_gelu_bias_ms']:.4f} |"
              for r in rows if "lt_gelu_bias_ms" in r]
    lines += ["", "Bias + erf GELU as ftengine runs it (ops.matmul_bias_gelu: its route) against cuBLASLt's product "
              "(ftengine's algorithm choice) followed by the bias + GELU pass:", "",
              "| product | rows | route | ftengine ms | cuBLASLt + pass ms | speed-up |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['product']} | {r['rows']} | {r['route']} | {r['ftengine_ms']:.4f} | "
              f"{r['product_then_pass_ms']:.4f} | {r['product_then_pass_ms'] / r['ftengine_ms']:.2f}x |"
              for r in gelu_rows]
    lines += ["", "Product + bias + residual + LayerNorm as ftengine runs it (ops.matmul_bias_residual_layernorm: "
              "its route) against cuBLASLt's product (ftengine's algorithm choice) followed by the LayerNorm kernel:",
              "", "| product | rows | route | ftengine ms | cuBLASLt + LayerNorm ms | speed-up |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['product']} | {r['rows']} | {r['route']} | {r['ftengine_ms']:.4f} | "
              f"{r['product_then_layernorm_ms']:.4f} | {r['product_then_layernorm_ms'] / r['ftengine_ms']:.2f}x |"
              for r in ln_rows]
    lines += ["", f"ftengine times products of {algos.TRIAL_MIN_ROWS:,} rows or more (`TRIAL_MIN_ROWS`), once "
              "per process for the first shape of each row bucket (rows up to the next power of two; the bucket's "
              "other shapes reuse that algorithm where `cublasLtMatmulAlgoCheck` accepts it), so the `ftengine` column "
              "equals `Lt` below that and about `Lt best` past it. The erf bias + GELU pass is what separates the "
              "\"product, then the bias + erf GELU kernel\" column from the product. The last table's routes are "
              "`gemm._wgmma_tile`'s (compute capability 9.0): 256-column tiles from 4,096 x 3,072 outputs on, below "
              "that narrow tiles where K <= 384 or the batch has at most 64 rows (the kernel then splits K between "
              "its two consumer warpgroups), else cuBLASLt and the pass (figures per tile: "
              "`bench/experiments/gemm_tiles.py`). The LayerNorm table's fused route is `ops.wgmma_ln_fits`' (compute "
              "capability 9.0): from 8,192 rows, rows of at most 2 x 192 columns (a cluster of two blocks), where it "
              "measured faster (figures: `gemm.WGMMA_LN_TILE`); BERT-base's 768 columns keep the two kernels."]
    (out / "gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
