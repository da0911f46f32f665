"""An experiment, not used by the package: BERT's products that feed a residual + LayerNorm (the
attention output projection, 768 -> 768, and the FFN down-projection, 3,072 -> 768) run in row
chunks, each chunk's LayerNorm right after its product, so that the LayerNorm reads the product
while it is still in the L2 (50 MB on the H100; a 32,768-row product is 50 MB of fp16), against
the package's whole product then whole LayerNorm (ops.matmul_bias_residual_layernorm). Each form
is first checked against the whole form (the same kernels on row views: equal within fp16
rounding of the product), then timed as a graph of 20 repeats.

Measured on the H100 (2026-11-25), fp16, 32,768 rows, us: every chunked form equals the whole one
bit for bit, but none is faster. 768 -> 768: product 59.5 + LayerNorm 51.1; whole 108.8, chunks of
16,384 rows 117.1, 8,192 115.2, 4,096 137.1. 3,072 -> 768: product 215.7 + LayerNorm 52.0; whole
258.8, chunks 264.0, 268.2, 276.3. The chunks' products lose more (fewer tiles a wave at N = 768)
than their LayerNorms gain from the L2.

    PYTHONPATH=. python3 bench/experiments/ln_chunks.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

ROWS = 32768
SHAPES = [(768, 768), (3072, 768)]  # (K, N)
CHUNKS = [32768, 16384, 8192, 4096]  # rows a chunk (32,768: the package's form)


def main():
    from bench.bench_encoder import graph_ms
    from ftengine.backends.cuda import ops as cu

    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    h = 768
    gamma, beta, bias = (cu.to_device(rng.standard_normal(h).astype(np.float32), np.float16) for _ in range(3))
    residual = cu.to_device(rng.standard_normal((ROWS, h)).astype(np.float32), np.float16)
    out, product = cu.empty((ROWS, h), np.float16), cu.empty((ROWS, h), np.float16)
    rows = []
    for k, n in SHAPES:
        x = cu.to_device(rng.standard_normal((ROWS, k)).astype(np.float32) / np.sqrt(k), np.float16)
        w = cu.to_device(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), np.float16)

        def run(chunk):
            for i in range(0, ROWS, chunk):
                j = i + chunk
                cu.matmul(product[i:j], x[i:j], w)
                cu.add_bias_residual_layernorm(out[i:j], product[i:j], bias, residual[i:j], gamma, beta, eps=1e-12)

        for chunk in CHUNKS:
            run(chunk)  # each chunk size's cuBLASLt algorithm timed outside the capture
        run(ROWS)
        whole = cu.to_host(out)
        row = {"k": k, "n": n, "product_ms": graph_ms(lambda: cu.matmul(product, x, w)),
               "layernorm_ms": graph_ms(lambda: cu.add_bias_residual_layernorm(out, product, bias, residual, gamma,
                                                                               beta, eps=1e-12))}
        for chunk in CHUNKS:
            run(chunk)
            err = float(np.abs(cu.to_host(out) - whole).max())
            row[f"{chunk} ms"] = graph_ms(lambda chunk=chunk: run(chunk))
            row[f"{chunk} max_abs_diff"] = err
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": cu.context().device_name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
