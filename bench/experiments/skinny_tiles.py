"""Tile shapes of the tensor-core skinny product (gemv.cu skinny_mma), timed side by side with
cuBLASLt (what ops.matmul runs past GEMV_ROWS rows without it) and the CUDA-core gemv.

Every (tiles, warps, unroll) candidate is first checked against NumPy on odd shapes (rows, columns
and K not multiples of the tiles), with and without the bias + GELU epilogue, then timed on GPT-2
small's decode-step products (fp16, random operands): each product captured 20 times into a graph
(programmatic dependent launches, as ops.py captures them), replayed between events, median of 5.
The winners are what ftengine/backends/cuda/kernels.py SKINNY_TILES lists.

    PYTHONPATH=. python3 bench/experiments/skinny_tiles.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
from ftengine.backends.cuda import gemm, launch as cuda_launch  # noqa: E402

CANDIDATES = [(t, w, u) for t in (1, 2, 4, 8) for w in (2, 4, 8) if t * w <= 16 for u in (1, 2, 4) if t * u <= 8]
# name -> (N, K, epilogue, logits in float)
SHAPES = {"qkv 768->2304": (2304, 768, 0, False), "attn out 768->768": (768, 768, 0, False),
          "ffn up 768->3072 + gelu": (3072, 768, 2, False), "ffn down 3072->768": (768, 3072, 0, False),
          "lm head 768->50257": (50257, 768, 0, True)}
ROWS = (1, 4, 8, 16, 32)
CHECKS = [(5, 50, 96), (13, 777, 800), (32, 1000, 256), (17, 64, 3072), (1, 33, 32), (8, 16, 64)]


def name(cfg, out="__half"):
    return f"skinny_mma<__half, {out}, {cfg[0]}, {cfg[1]}, {cfg[2]}>"


def build():
    import cupy
    from ftengine.backends.cuda import kernels
    names = sorted({name(c, o) for c in CANDIDATES for o in ("__half", "float")})
    names += [f"gemv<__half, {o}, 8, 2>" for o in ("__half", "float")]
    return cupy.RawModule(code=kernels.source("gemv.cu"), options=kernels.compile_options(), name_expressions=names)


def launch(mod, kname, grid, block, out, x, w, bias, epilogue, dependent):
    """On the current stream, or (dependent) as a programmatic dependent launch on ops.py's stream."""
    from ftengine.backends.cuda import kernels, ops
    k = mod.get_function(kname)
    args = (out, x, w, bias, np.int32(x.shape[0]), np.int32(w.shape[0]), np.int32(x.shape[1]), np.int32(epilogue))
    if dependent:
        cuda_launch.launch_ex(k, grid, block, args, 0, ops.context().stream.ptr)
    else:
        k(grid, block, args)


def skinny(mod, cfg, out, x, w, bias, epilogue, dependent=False):
    launch(mod, name(cfg, "float" if out.dtype == np.float32 else "__half"), (-(-w.shape[0] // (16 * cfg[0])),),
           (32 * cfg[1],), out, x, w, bias, epilogue, dependent)


def gemv(mod, out, x, w, bias, epilogue, dependent=False):
    launch(mod, f"gemv<__half, {'float' if out.dtype == np.float32 else '__half'}, 8, 2>", (-(-w.shape[0] // 2),),
           (128,), out, x, w, bias, epilogue, dependent)


def check(mod):
    """Max error of every candidate vs NumPy (float64 product of the fp16 operands), relative to
    the largest reference value."""
    import cupy
    from ftengine.backends import numpy_ops
    rng = np.random.default_rng(0)
    errors = {}
    for m, n, k in CHECKS:
        x_h = rng.standard_normal((m, k)).astype(np.float16)
        w_h = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
        b_h = rng.standard_normal(n).astype(np.float16)
        plain = x_h.astype(np.float64) @ w_h.astype(np.float64).T
        with_gelu = np.empty((m, n), np.float32)
        numpy_ops.matmul_bias_gelu(with_gelu, x_h.astype(np.float32), w_h.astype(np.float32),
                                   b_h.astype(np.float32), form="erf")
        x, w, b = cupy.asarray(x_h), cupy.asarray(w_h), cupy.asarray(b_h)
        for cfg in CANDIDATES:
            for epilogue, ref in ((0, plain), (1, with_gelu)):
                for dtype in (np.float16, np.float32):
                    out = cupy.full((m, n), np.nan, dtype)
                    skinny(mod, cfg, out, x, w, b, epilogue)
                    got = cupy.asnumpy(out).astype(np.float64)
                    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                    key = f"{cfg} m{m} n{n} k{k} epilogue {epilogue} {np.dtype(dtype).name}"
                    errors[key] = err
    return errors


def graph_ms(fn, repeat=20):
    import cupy
    from ftengine.backends.cuda import ops
    stream = ops.context().stream
    stream.begin_capture()
    for _ in range(repeat):
        fn()
    graph = stream.end_capture()
    graph.launch(stream=stream)
    times = []
    for _ in range(5):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream=stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1000 / repeat)
    return statistics.median(times)


def profile(mod, cfg):
    """One launch each of gemv (1 row), skinny_mma `cfg` (1 and 32 rows) and cuBLASLt (32 rows) on
    the attention output and FFN down products, for a profiler."""
    import cupy
    from ftengine.backends.cuda import ops
    rng = np.random.default_rng(1)
    for n, k in ((768, 768), (768, 3072)):
        w = cupy.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16))
        for m in (1, 32):
            x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
            out = cupy.empty((m, n), np.float16)
            if m == 1:
                gemv(mod, out, x, w, w, 0)
            skinny(mod, cfg, out, x, w, w, 0)
            if m == 32:
                gemm._lt_matmul(out, x, w)
            cupy.cuda.Device().synchronize()


def main():
    import cupy
    from ftengine.backends.cuda import ops
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--profile", help="a candidate, e.g. 1,8,4: launch it once on two shapes, for a profiler")
    args = parser.parse_args()
    mod = build()
    if args.profile:
        return profile(mod, tuple(int(v) for v in args.profile.split(",")))
    errors = check(mod)
    worst = max(errors.values())
    for key, err in errors.items():
        if not err < 2e-3:
            print(f"check FAIL {key}: {err:.2e}")
    print(f"check: {len(errors)} products, worst relative error {worst:.2e}", flush=True)
    cupy.cuda.Device().synchronize()
    rng = np.random.default_rng(1)
    results = []
    for label, (n, k, epilogue, logits) in SHAPES.items():
        w = cupy.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16))
        bias = cupy.asarray(rng.standard_normal(n).astype(np.float16))
        floor_us = w.nbytes / 3.0e6
        for m in ROWS:
            x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float16))
            out = cupy.empty((m, n), np.float32 if logits else np.float16)
            cupy.cuda.Device().synchronize()
            row = {"product": label, "rows": m, "floor_us": floor_us}
            row["cublaslt_us"] = graph_ms(lambda: gemm._lt_matmul(out, x, w))
            if m <= 4:
                row["gemv_us"] = graph_ms(lambda: gemv(mod, out, x, w, bias, epilogue, True))
            for cfg in CANDIDATES:
                row[str(cfg)] = graph_ms(lambda: skinny(mod, cfg, out, x, w, bias, epilogue, True))
            best = min(CANDIDATES, key=lambda c: row[str(c)])
            row["best"] = str(best)
            results.append(row)
            others = " ".join(f"{c}:{row[str(c)]:.1f}" for c in sorted(CANDIDATES, key=lambda c: row[str(c)])[:8])
            print(f"{label:26s} m{m:<3d} floor {floor_us:5.1f} lt {row['cublaslt_us']:6.1f} "
                  f"gemv {row.get('gemv_us', float('nan')):6.1f} best {best} {row[str(best)]:6.1f} | {others}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"errors_worst": worst, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
