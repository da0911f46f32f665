"""An experiment, not used by the package: a tensor-core product for a few hundred rows with the
bias + GELU epilogue fused (bench/experiments/tile_mma.cu: mma.sync from cp.async stages, small
tiles, the K steps optionally shared by several warp groups), checked and timed against what
ftengine runs instead (cuBLASLt, then the bias + GELU pass; the tanh form: cuBLASLt's GELU_BIAS
epilogue; plain products: ops.matmul).

Every candidate (BM, BN, WM, WN, KS, BK, STAGES) is first checked against NumPy (float64) on
shapes that are not multiples of its tiles (rows, columns and K tails), plain and with bias +
GELU in both forms, fp16 and bf16, outputs poisoned; then each product is replayed alone from a
graph, beside ops.py's.

Measured on the H100 (2026-11-24): every check passes, but no candidate comes near cuBLASLt, even
with the GELU pass that fusing would save. Best candidate against the package, us:

    product (rows x N x K)             package   tile_mma (best)
    128 x 3072 x 768, bias + erf GELU     6.6       9.7 (64, 64, 2, 2, 2, 64, 4)
    1024 x 3072 x 768, bias + erf GELU   13.3      37.0
    128 x 3072 x 768, bias + tanh GELU    4.9      10.1
    128 x 2304 x 768                      3.7       7.4
    64 x 768 x 768                        3.3       5.4 (32, 64, 1, 2, 2, 64, 6)
    128 x 1536 x 384, bias + erf GELU     5.0       6.2 (32, 64, 1, 2, 4, 64, 6)

Routed into ops.matmul_bias_gelu for 33-1024 rows (the best candidate), BERT-base's captured
layers took 1 x 128 403.0 against 367.9 us, 8 x 128 904.1 against 614.6; GPT-2 small's prefill
1 x 512 702.2 against 544.9. Why: at 1,024 rows the 64 x 64 tiles move 151 MB through the L2
(about 27 us at its rate), where cuBLASLt's large wgmma tiles move a quarter of that; at 64-128
rows a block has 12 K steps of 64 to go through one after another, each a barrier, a wait for its
copies and the dependent ldmatrix -> mma chain of 4-16 warps (about 0.4 us a step), where
cuBLASLt's kernels take 3-4 us for the whole product. The first version (BK 32, 4 warps, no group
split, fragments not loaded ahead) took 12.3 us at 128 x 3072 x 768. Fusing the GELU into a
product pays only in a kernel at cuBLASLt's speed: see gemm_tiles.py for the wgmma one.

    PYTHONPATH=. python3 bench/experiments/tile_mma.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from ftengine.backends.cuda import runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (BM, BN, WM, WN, KS, BK, STAGES)
CANDIDATES = [(64, 64, 2, 2, 1, 64, 4), (64, 64, 2, 2, 2, 64, 4), (64, 64, 2, 2, 4, 64, 4), (32, 64, 1, 2, 4, 64, 6),
              (64, 128, 2, 4, 2, 64, 4), (32, 64, 1, 2, 2, 64, 6), (64, 128, 2, 2, 4, 64, 3)]
# (M, N, K, epilogue): 0 plain, 1 bias + erf GELU, 2 bias + tanh GELU
CHECKS = [(1000, 3000, 760, 1), (129, 130, 72, 0), (77, 512, 8, 1), (300, 600, 200, 2), (33, 2304, 768, 0),
          (513, 768, 3072, 0), (128, 3072, 768, 1)]
PRODUCTS = [(3072, 768, 1), (3072, 768, 2), (2304, 768, 0), (768, 768, 0), (1536, 384, 1)]
ROWS = (64, 128, 256, 512, 1024)


def name(ctype: str, tiles: tuple) -> str:
    return f"tile_mma<{ctype}, {', '.join(map(str, tiles))}>"


def shared_bytes(tiles: tuple, itemsize: int) -> int:
    """The kernel's dynamic shared memory: its stages, or the sums its groups but the first leave there."""
    bm, bn, wm, wn, ks, bk, stages = tiles
    return max(stages * (bm + bn) * (bk + 8) * itemsize, (ks - 1) * bm * bn * 4)


def main():
    import cupy
    from bench_encoder import graph_ms
    from gemm_tiles import check_candidates
    from ftengine.backends.cuda import kernels
    from ftengine.backends.cuda import ops as cu

    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    folder = Path(__file__).resolve().parent
    names = [name(t, c) for t in ("__half", "__nv_bfloat16") for c in CANDIDATES]
    code = (folder.parents[1] / "kernels_cu" / "common.cuh").read_text() + "\n" + (folder / "tile_mma.cu").read_text()
    module = cupy.RawModule(code=code, options=kernels.compile_options(), name_expressions=names)
    ctx = cu.context()
    rng = np.random.default_rng(0)
    result = {"device": ctx.device_name, "candidates": CANDIDATES, "products": []}

    def launch(tiles, out, x, w, bias, epilogue):
        m, k = x.shape
        n = w.shape[0]
        bm, bn, wm, wn, ks = tiles[:5]
        kernel = module.get_function(name(runtime._ctype(x), tiles))
        size = shared_bytes(tiles, x.itemsize)
        if kernel.max_dynamic_shared_size_bytes < size:
            kernel.max_dynamic_shared_size_bytes = size
        with ctx.stream:
            kernel((-(-n // bn), -(-m // bm)), (32 * wm * wn * ks,),
                   (out, x, w, bias, np.int32(m), np.int32(n), np.int32(k), np.int32(epilogue)), shared_mem=size)

    failures = check_candidates(CANDIDATES, CHECKS, launch, rng)
    result["failures"] = failures
    print(f"{failures} failed checks", flush=True)

    for n, k, epi in PRODUCTS:
        for m in ROWS:
            x = cu.to_device(rng.standard_normal((m, k)).astype(np.float32) / np.sqrt(k) ** 0.5, np.float16)
            w = cu.to_device(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k) ** 0.5, np.float16)
            b = cu.to_device(rng.standard_normal(n).astype(np.float32), np.float16)
            out = cu.empty((m, n), np.float16)

            def package():
                if epi:
                    cu.matmul_bias_gelu(out, x, w, b, form="erf" if epi == 1 else "tanh")
                else:
                    cu.matmul(out, x, w)
            package()
            row = {"m": m, "n": n, "k": k, "epilogue": epi, "package_us": round(graph_ms(package) * 1e3, 2)}
            for tiles in CANDIDATES:
                row[str(tiles)] = round(graph_ms(lambda t=tiles: launch(t, out, x, w, b, epi)) * 1e3, 2)
            best = min(CANDIDATES, key=lambda c: row[str(c)])
            print(json.dumps(row) + f"  best {best}: {row['package_us'] / row[str(best)]:.2f}x the package's speed",
                  flush=True)
            result["products"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
