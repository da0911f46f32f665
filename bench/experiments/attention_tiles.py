"""Tile shapes of the tensor-core varlen attention (attention_varlen.cu), timed side by side.

Every (warps, query tiles per warp, key tile, blocks per SM) candidate is first checked against
the NumPy reference on a ragged batch (plain and causal), then timed on the encoder benchmark's
attention shapes with torch SDPA in the same run. The winners are what
ftengine/backends/cuda/attention.py VARLEN_TILES lists (with the blocks per SM of varlen_mma_name).

    PYTHONPATH=. python3 bench/experiments/attention_tiles.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# (warps, mt, kn, min_blocks) per head dim
CANDIDATES = {
    32: [(4, 1, 64, 0), (8, 1, 64, 2), (4, 2, 64, 2), (4, 2, 64, 3), (8, 2, 128, 1)],
    64: [(4, 1, 64, 4), (4, 2, 64, 0), (4, 1, 64, 0), (8, 1, 64, 2), (8, 1, 64, 1), (4, 2, 64, 2), (4, 2, 128, 1)],
    128: [(4, 1, 64, 0), (8, 1, 64, 0), (8, 1, 64, 1), (4, 1, 64, 2)],
}
# (batch, sequence, causal) timed for every head dim (heads = 768 / d), as bench_encoder.py
SHAPES = [(64, 512, False), (256, 128, False), (16, 2048, False), (32, 128, False), (1, 128, False),
          (1, 512, True), (32, 128, True)]


def name(d, cfg, general=False):
    w, mt, kn, minb = cfg
    return f"varlen_attention_mma<__half, {d}, {'true' if general else 'false'}, {w}, {mt}, {kn}, {minb}>"


def smem(d, cfg):
    return 2 * 2 * cfg[2] * (d + 8) * 2


def build():
    import cupy
    from ftengine.backends.cuda import kernels

    def one(d):
        names = [name(d, c) for c in CANDIDATES[d]]
        return d, cupy.RawModule(code=kernels.source("attention_varlen.cu"), options=kernels.compile_options(),
                                 name_expressions=names)
    with ThreadPoolExecutor(3) as pool:
        return dict(pool.map(one, CANDIDATES))


def launch(mod, d, cfg, ctx, qkv, bias, cu, heads, max_seqlen, causal):
    import cupy
    k = mod.get_function(name(d, cfg))
    size = smem(d, cfg)
    if size > 48 * 1024:
        k.max_dynamic_shared_size_bytes = size
    b = cu.size - 1
    block_m = 16 * cfg[0] * cfg[1]
    scale_log2 = np.float32(1.4426950408889634 / np.sqrt(d))
    k((-(-max_seqlen // block_m), b * heads), (32 * cfg[0],),
      (ctx, qkv, bias, cu, np.int32(b), np.int32(heads), np.int32(ctx.shape[0]), scale_log2,
       np.int32(causal), np.int32(0), cu, cu, np.int32(0)), shared_mem=size)
    return cupy


def timed(fn, repeat=20):
    import cupy
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(5):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / repeat)
    return statistics.median(times)


def check(mods):
    """Max abs error of every candidate vs the NumPy reference on a ragged fp16 batch."""
    import cupy
    from ftengine.backends import numpy_ops
    rng = np.random.default_rng(0)
    lengths = [517, 300, 77, 1, 128, 64]
    cu_h = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu_h[-1]) + 5
    errors = {}
    for d, mod in mods.items():
        heads = 768 // d // 4
        h = heads * d
        qkv_h = rng.standard_normal((t, 3 * h)).astype(np.float16)
        bias_h = (rng.standard_normal(3 * h) * 0.1).astype(np.float16)
        qkv, bias, cu = cupy.asarray(qkv_h), cupy.asarray(bias_h), cupy.asarray(cu_h)
        for causal in (False, True):
            ref = np.empty((t, h), np.float32)
            numpy_ops.varlen_attention(ref, qkv_h.astype(np.float32), bias_h.astype(np.float32), cu_h,
                                       heads=heads, max_seqlen=max(lengths), causal=causal)
            for cfg in CANDIDATES[d]:
                ctx = cupy.full((t, h), np.nan, np.float16)
                launch(mod, d, cfg, ctx, qkv, bias, cu, heads, max(lengths), causal)
                err = float(np.max(np.abs(cupy.asnumpy(ctx).astype(np.float32) - ref)))
                errors[f"d{d} {cfg} causal={causal}"] = err
    return errors


def profile(mods, b=64, s=512, d=64):
    import cupy
    import torch
    heads, t = 768 // d, b * s
    qkv = cupy.asarray(np.random.default_rng(1).standard_normal((t, 3 * heads * d), np.float32).astype(np.float16))
    bias = cupy.zeros(3 * heads * d, np.float16)
    cu = cupy.asarray(np.arange(0, t + 1, s, dtype=np.int32))
    ctx = cupy.empty((t, heads * d), np.float16)
    for cfg in CANDIDATES[d]:
        launch(mods[d], d, cfg, ctx, qkv, bias, cu, heads, s, False)
    tq, tk, tv = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
    cupy.cuda.Device().synchronize()


def main():
    import cupy
    import torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--profile", action="store_true",
                        help="one launch of each head-dim-64 candidate and of SDPA at 64 x 512, for a profiler")
    args = parser.parse_args()
    mods = build()
    if args.profile:
        return profile(mods)
    errors = check(mods)
    for key, err in errors.items():
        print(f"check {key}: max abs err {err:.2e}{'  FAIL' if not err < 2e-3 else ''}", flush=True)
    rows = []
    for d in CANDIDATES:
        heads = 768 // d
        h = heads * d
        for b, s, causal in SHAPES:
            t = b * s
            qkv = cupy.asarray(np.random.default_rng(1).standard_normal((t, 3 * h), np.float32).astype(np.float16))
            bias = cupy.zeros(3 * h, np.float16)
            cu = cupy.asarray(np.arange(0, t + 1, s, dtype=np.int32))
            ctx = cupy.empty((t, h), np.float16)
            flops = 4 * b * heads * s * s * d / (2 if causal else 1)
            tq, tk, tv = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
            sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
            row = {"d": d, "shape": f"{b}x{s}{' causal' if causal else ''}", "sdpa_ms": round(sdpa, 4)}
            for cfg in CANDIDATES[d]:
                ms = timed(lambda: launch(mods[d], d, cfg, ctx, qkv, bias, cu, heads, s, causal))
                row[str(cfg)] = round(ms, 4)
                row[f"{cfg} tflops"] = round(flops / ms / 1e9, 1)
            best = min(CANDIDATES[d], key=lambda c: row[str(c)])
            print(f"d{d} {row['shape']}: sdpa {sdpa:.4f} ms ({flops / sdpa / 1e9:.0f} TFLOP/s); "
                  + "; ".join(f"{c} {row[str(c)]:.4f}" for c in CANDIDATES[d])
                  + f"; best {best} = {sdpa / row[str(best)]:.2f}x sdpa", flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"errors": errors, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
