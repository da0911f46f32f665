"""The tensor-core skinny product (gemv.cu skinny_mma) on GPT-2 small's narrow decode-step
products at 4-32 rows, with K split over the grid's rows (float partial sums that decoder.cu
residual_layernorm adds up), timed against what ops.py runs there today (cuBLASLt; the gemv at up to
GEMV_ROWS rows), each with the kernel that reads its output.

Checked first: every (tiles, warps, unroll, splits) candidate's summed partials against NumPy on
odd shapes, and residual_layernorm over the partials against the NumPy reference fed their rounded
sum. Timed: a graph of as many products (each on its own copy of the weight, so that the weights
come from memory, not the L2, as in a real step) as there are copies, programmatic dependent
launches as ops.py captures them, replayed between events, median of 5, us per product + reader.

Measured on the H100 (2026-11-24), us per product + reader, 32 / 16 / 8 rows: attention output
768->768 cuBLASLt 6.05 / 5.84 / 5.84, split in 2 slices 5.42 / 5.30 / 4.90 (best: 5.28 / 5.12 /
4.90); FFN down 3072->768 8.31 / 8.32 / 8.02, split in 8 slices 7.19 / 6.84 / 6.69 (best: 7.19 /
6.84 / 6.48); tiles (2, 8, 2) from 9 rows on, (1, 8, 2) up to 8: what kernels.py SPLIT_TILES and
ops.py split_k use. Not split (qkv, FFN up + GELU), the skinny kernel lost to cuBLASLt from 16
rows on (5.5 against 4.3 us at 32 rows) and was within 0.3 us of it either way at 4-8 rows: those
products stay on cuBLASLt and the gemv.

    PYTHONPATH=. python3 bench/experiments/skinny_split.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from ftengine.backends.cuda import kernels, launch as cuda_launch, runtime  # noqa: E402

CONFIGS = [(t, w, u) for t in (1, 2) for w in (2, 4, 8) for u in (2, 4)]
SPLITS = (1, 2, 4, 8)
# name -> (N, K, reader): "residual" (attn out, ffn down: residual + LayerNorm reads it, so K may
# be split), "gelu" (ffn up: bias + GELU epilogue), "none" (qkv: the attention reads it)
SHAPES = {"qkv 768->2304": (2304, 768, "none"), "attn out 768->768": (768, 768, "residual"),
          "ffn up 768->3072 + gelu": (3072, 768, "gelu"), "ffn down 3072->768": (768, 3072, "residual")}
ROWS = (4, 8, 16, 32)
CHECKS = [(5, 50, 96), (13, 777, 800), (32, 1000, 256), (17, 64, 3072), (1, 33, 32), (8, 768, 768)]
L2_OVERFLOW_BYTES = 150e6


def skinny_name(cfg, out):
    return f"skinny_mma<__half, {out}, {cfg[0]}, {cfg[1]}, {cfg[2]}>"


def build():
    import cupy
    from ftengine.backends.cuda import kernels
    names = sorted({skinny_name(c, o) for c in CONFIGS for o in ("__half", "float")})
    gemv = cupy.RawModule(code=kernels.source("gemv.cu"), options=kernels.compile_options(), name_expressions=names)
    return gemv


def launch(k, grid, block, args):
    from ftengine.backends.cuda import kernels, ops
    ctx = ops.context()
    cuda_launch.launch_ex(k, grid, block, args, 0, ctx.stream.ptr, dependent=ctx.stream.is_capturing())


def skinny(mod, cfg, out, x, w, bias, epilogue, splits):
    m, k = x.shape
    n = w.shape[0]
    kname = skinny_name(cfg, "float" if out.dtype == np.float32 else "__half")
    launch(mod.get_function(kname), (-(-n // (16 * cfg[0])), splits), (32 * cfg[1],),
           (out, x, w, bias, np.int32(m), np.int32(n), np.int32(k), np.int32(epilogue)))


def residual_split(hidden, normed, partials, bias, gamma, beta):
    from ftengine.backends.cuda import ops
    splits, t, h = partials.shape
    vec, items, threads = runtime._row_kernel_shape(hidden, h)
    kname = f"residual_layernorm<__half, float, {splits}, {vec}, {items}>"
    launch(kernels.kernel("decoder.cu", kname), (t,), (threads,),
           (hidden, normed, partials, bias, gamma, beta, np.int32(h), np.float32(1e-5), np.int32(0)))


def check(mod):
    import cupy
    from ftengine.backends import numpy_ops
    from ftengine.backends.cuda import ops
    rng = np.random.default_rng(0)
    worst = {"product": 0.0, "residual_layernorm": 0.0}
    for m, n, k in CHECKS:
        x_h = rng.standard_normal((m, k)).astype(np.float16)
        w_h = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
        ref = x_h.astype(np.float64) @ w_h.astype(np.float64).T
        x, w = cupy.asarray(x_h), cupy.asarray(w_h)
        for cfg in CONFIGS:
            for splits in SPLITS:
                if splits > k // 32:
                    continue
                parts = cupy.full((splits, m, n), np.nan, np.float32)
                skinny(mod, cfg, parts, x, w, w, 0, splits)
                p = cupy.asnumpy(parts)
                err = float(np.max(np.abs(p.sum(0, dtype=np.float64) - ref)) / np.max(np.abs(ref)))
                if not err < 2e-3:
                    print(f"check FAIL {cfg} splits {splits} m{m} n{n} k{k}: {err:.2e}")
                worst["product"] = max(worst["product"], err)
    for m, h, splits in ((5, 768, 2), (32, 768, 4), (3, 1000, 8), (17, 4096, 2)):
        parts_h = rng.standard_normal((splits, m, h)).astype(np.float32)
        hidden_h = rng.standard_normal((m, h)).astype(np.float16)
        bias_h, gamma_h, beta_h = (rng.standard_normal(h).astype(np.float16) for _ in range(3))
        summed = parts_h[0].copy()
        for s in range(1, splits):
            summed += parts_h[s]
        ref_hidden = hidden_h.astype(np.float32)
        ref_normed = np.empty((m, h), np.float32)
        numpy_ops.residual_layernorm(ref_hidden, ref_normed, summed.astype(np.float16).astype(np.float32),
                                     bias_h.astype(np.float32), gamma_h.astype(np.float32),
                                     beta_h.astype(np.float32), eps=1e-5)
        hidden, normed = cupy.asarray(hidden_h), cupy.empty((m, h), np.float16)
        residual_split(hidden, normed, cupy.asarray(parts_h), *(cupy.asarray(a) for a in (bias_h, gamma_h, beta_h)))
        plain_hidden, plain_normed = cupy.asarray(hidden_h), cupy.empty((m, h), np.float16)
        ops.residual_layernorm(plain_hidden, plain_normed, cupy.asarray(summed.astype(np.float16)),
                               *(cupy.asarray(a) for a in (bias_h, gamma_h, beta_h)), eps=1e-5)
        same = bool(cupy.all(hidden == plain_hidden) and cupy.all(normed == plain_normed))
        err = max(float(np.max(np.abs(cupy.asnumpy(hidden).astype(np.float32) - ref_hidden))),
                  float(np.max(np.abs(cupy.asnumpy(normed).astype(np.float32) - ref_normed))))
        print(f"residual_layernorm over {splits} partials, {m} x {h}: max error {err:.2e}, "
              f"bit-identical to the plain kernel on the rounded sum: {same}")
        worst["residual_layernorm"] = max(worst["residual_layernorm"], err)
        if not same:
            print("check FAIL residual_layernorm")
    print(f"check: worst product error {worst['product']:.2e}, residual_layernorm {worst['residual_layernorm']:.2e}",
          flush=True)
    return worst


def graph_us(fns):
    """us per call of fns, captured once each into one graph (bench_encoder.replay_ms)."""
    from bench.bench_encoder import replay_ms
    from ftengine.backends.cuda import ops
    stream = ops.context().stream
    stream.begin_capture()
    for fn in fns:
        fn()
    return replay_ms(stream.end_capture(), len(fns)) * 1000


def main():
    from ftengine.backends.cuda import ops
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    mod = build()
    with ops.context().stream:  # CuPy's fills and copies on the stream the kernels run on
        worst = check(mod)
        results = timings(mod)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"worst": worst, "results": results}, f, indent=1)


def timings(mod):
    import cupy
    from ftengine.backends.cuda import ops
    rng = np.random.default_rng(1)
    h = 768
    gamma, beta = (cupy.asarray(rng.standard_normal(h).astype(np.float16)) for _ in range(2))
    results = []
    for label, (n, k, reader) in SHAPES.items():
        w0 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
        copies = max(12, int(-(-L2_OVERFLOW_BYTES // w0.nbytes)))
        ws = [cupy.asarray(w0) for _ in range(copies)]
        bias = cupy.asarray(rng.standard_normal(n).astype(np.float16))
        for m in ROWS:
            x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
            out = cupy.empty((m, n), np.float16)
            hidden, normed = cupy.zeros((m, h), np.float16), cupy.empty((m, h), np.float16)
            row = {"product": label, "rows": m, "copies": copies, "floor_us": w0.nbytes / 3.0e6}

            def today(w):
                if reader == "gelu":
                    ops.matmul_bias_gelu(out, x, w, bias, form="tanh")
                    return
                ops.matmul(out, x, w)
                if reader == "residual":
                    ops.residual_layernorm(hidden, normed, out, bias, gamma, beta, eps=1e-5)
            row["today_us"] = graph_us([lambda w=w: today(w) for w in ws])
            for cfg in CONFIGS:
                for splits in SPLITS if reader == "residual" else (1,):
                    if reader == "residual" and splits == 1:
                        def new(w, cfg=cfg):
                            skinny(mod, cfg, out, x, w, bias, 0, 1)
                            ops.residual_layernorm(hidden, normed, out, bias, gamma, beta, eps=1e-5)
                    elif reader == "residual":
                        parts = cupy.empty((splits, m, n), np.float32)

                        def new(w, cfg=cfg, splits=splits, parts=parts):
                            skinny(mod, cfg, parts, x, w, bias, 0, splits)
                            residual_split(hidden, normed, parts, bias, gamma, beta)
                    else:
                        def new(w, cfg=cfg):
                            skinny(mod, cfg, out, x, w, bias, 2 if reader == "gelu" else 0, 1)
                    row[f"{cfg} s{splits}"] = graph_us([lambda w=w: new(w) for w in ws])
            keys = [key for key in row if key.startswith("(")]
            best = min(keys, key=row.get)
            row["best"] = best
            results.append(row)
            top = " ".join(f"{key}:{row[key]:.2f}" for key in sorted(keys, key=row.get)[:6])
            print(f"{label:24s} m{m:<3d} floor {row['floor_us']:4.2f} today {row['today_us']:5.2f} "
                  f"best {best} {row[best]:5.2f} | {top}", flush=True)
    return results


if __name__ == "__main__":
    main()
