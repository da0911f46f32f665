"""An experiment, not used by the package: a decode step's feed-forward (M <= 4 rows, fp16,
relu(x W1^T + b1) W2^T + b2, then the residual + LayerNorm) as one kernel that copies its weights
into shared memory with bulk copies (bench/experiments/ffn_step.cu), checked against the package's
kernels and timed against them, at the shapes of NLLB-600M (1,024 -> 4,096), t5-base (768 ->
3,072) and Marian-base (512 -> 2,048). Issue 53 asked whether a persistent kernel a layer could
halve NLLB-600M's decode step; an earlier form of the first kernel here lost (docs/gpu-internals.md,
NORM_PROLOGUE_ROWS), its weights thought to stream too slowly.

Each case is a sequence replayed from a graph of 40 (programmatic dependent launch, as a step's
graph runs), us per sequence, median of five replays; "prev" is the product before the feed-forward
in a step (E -> E), timed alone and subtracted:
  package: prev; matmul_act (relu); matmul_residual_layernorm (the second product, split, + LN)
  copy: the barrier kernel's bulk copies alone, every block its slices of W1 and W2 (no prev)
  barrier: prev; ffn_barrier (one block an SM, a grid barrier between the products), no LayerNorm
  clusters CL: prev; ffn_clusters (no grid barrier: each block its rows of W1 and of W2^T, the
      shares of the output added over clusters of CL blocks); residual_layernorm over the slices
--trace: each block's stage times (globaltimer) for the two kernels.

Measured on the H200 (2026-11-30, this file with --trace; us):

    shape, rows     package  copy (TB/s)  barrier  clusters 2 / 4 / 8   prev
    NLLB 1,024, 1     8.4    4.2 (4.0)      9.9    13.1 / 13.3 / 12.5   1.8
    NLLB 1,024, 4    10.7    4.2 (4.0)     12.7    16.0 / 18.0 / 17.3   2.7
    t5 768, 1         6.4    3.4 (2.8)      8.1    12.8 /  9.2 /  8.1   1.6
    t5 768, 4         9.0    3.4 (2.8)     10.1    13.8 / 14.3 / 13.3   2.5
    Marian 512, 1     5.3    2.9 (1.5)      6.7    12.5 /  8.9 /  8.0   1.5
    Marian 512, 4     8.1    2.9 (1.5)      7.8    12.8 /  9.4 /  8.2   2.4

The package column includes its LayerNorm kernel, the barrier column does not (it would add about
2 us). The weights stream: NLLB's 16.8 MB in 4.2 us is 4.0 TB/s, about the H200's bandwidth (a
scratch form's cp.async loop of 16-byte copies took 3.8 us). What the kernels lose is elsewhere.
Stage times of the barrier kernel at NLLB's shape, one row, from the first block's start (median /
last block): the copies issued and the rows loaded 1.7 / 1.9 (the rows' one read queues behind the
weights in flight), the first product done 4.1 / 4.5, the grid barrier passed 5.9 / 6.0 (1.4 us
from the last arrival), the second product done 8.4 / 8.5 (its rows of W2 arrive last). The cluster
kernel's blocks end 5.1 / 5.4 us after the first starts with clusters of two (every block resident);
with four or eight some clusters start 5.1 us late, in a second wave, and end at 8.5-8.7; and the
LayerNorm's sums over 16 to 66 slices of partial sums cost it more than the kernel saves. A scratch
barrier form that read the rows of x from shared memory for every weight row took 9.6 / 14.7 us at
one / four rows (four times the weights' bytes read from shared memory at four rows).

So one feed-forward kernel would save at most 2-3 us of the ~34 us a layer takes at NLLB's shape,
and the grid barrier a persistent layer would pass at each of its ~8 dependent stages costs about
what a kernel boundary costs now (1.4-1.9 us against 2-5 us), as the GPT-2 step in one kernel found
(decode_step.py). Not pursued.

    PYTHONPATH=. python3 bench/experiments/ffn_step.py [--trace]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = ((1024, 4096, "NLLB"), (768, 3072, "t5"), (512, 2048, "Marian"))
ROWS = (1, 4)
CLUSTERS = (2, 4, 8)
REPS = 40


def module(sms: int):
    from ftengine.backends.cuda import kernel_dir
    from ftengine.backends.cuda.kernels import CachedModule, options
    text = (kernel_dir() / "common.cuh").read_text() + (Path(__file__).resolve().parent / "ffn_step.cu").read_text()
    names = [barrier_name(m, e, f) for e, f, _ in SHAPES for m in ROWS]
    names += [cluster_name(m, e, f, sms, c) for e, f, _ in SHAPES for m in ROWS for c in CLUSTERS]
    return CachedModule(text, names, options("gemv.cu"))


def barrier_name(m: int, e: int, f: int) -> str:
    return f"ffn_barrier<{m}, {e // 256}, {-(-f // 2048)}>"


def cluster_blocks(sms: int, cluster: int) -> int:
    return sms // cluster * cluster


def cluster_name(m: int, e: int, f: int, sms: int, cluster: int) -> str:
    return f"ffn_clusters<{m}, {e // 256}, {-(-f // cluster_blocks(sms, cluster))}, {cluster}>"


def timed(cupy, stream, launch, reps: int = REPS, rounds: int = 5) -> float:
    """us per launch() replayed from a graph of `reps`, the median of `rounds` replays."""
    launch()
    stream.synchronize()
    stream.begin_capture()
    for _ in range(reps):
        launch()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    runs = []
    for _ in range(rounds):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        graph.launch(stream)
        b.record(stream)
        b.synchronize()
        runs.append(cupy.cuda.get_elapsed_time(a, b) * 1e3 / reps)
    return float(np.median(runs))


def stage_line(name: str, stamps, blocks: int, stages: tuple) -> str:
    st = stamps.get().reshape(-1, 8)[:blocks, :len(stages)].astype(np.int64)
    st -= st[:, 0].min()
    return f"  {name}: " + " ".join(f"{s} {np.median(st[:, i]) / 1e3:.2f}/{st[:, i].max() / 1e3:.2f}"
                                    for i, s in enumerate(stages))


def relative(got, want) -> float:
    return float(np.abs(got.get().astype(np.float32) - want).max() / np.abs(want).max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="store_true", help="each block's stage times of the two kernels")
    args = parser.parse_args()

    import cupy
    from ftengine.backends.cuda import families, gemm, norms
    from ftengine.backends.cuda.launch import launch_ex
    from ftengine.backends.cuda.runtime import context, planning

    ctx = context()
    stream, sms = ctx.stream, ctx.sm_count
    # the cluster kernel's slices of partial sums, for the package's residual_layernorm
    families.SPLIT_COUNTS = tuple(sorted(set(families.SPLIT_COUNTS) | {sms // c for c in CLUSTERS}))
    mod = module(sms)
    rng = np.random.default_rng(0)
    print("shape, rows | package | copy (TB/s) | barrier | clusters " + " / ".join(map(str, CLUSTERS)) + " | prev")
    for e, f, label in SHAPES:
        w1 = cupy.asarray(rng.standard_normal((f, e)) / 32, cupy.float16)
        w2 = cupy.asarray(rng.standard_normal((e, f)) / 64, cupy.float16)
        w2t = cupy.ascontiguousarray(w2.T)
        wo = cupy.asarray(rng.standard_normal((e, e)) / 32, cupy.float16)
        b1, b2 = (cupy.asarray(rng.standard_normal(n) / 8, cupy.float16) for n in (f, e))
        gamma = cupy.asarray(1 + rng.standard_normal(e) / 8, cupy.float16)
        beta = cupy.asarray(rng.standard_normal(e) / 8, cupy.float16)
        for m in ROWS:
            before, start = (cupy.asarray(rng.standard_normal((m, e)), cupy.float16) for _ in range(2))
            x, out, product = (cupy.zeros((m, e), cupy.float16) for _ in range(3))
            hidden, normed = cupy.zeros((m, e), cupy.float16), cupy.zeros((m, e), cupy.float16)
            inter = cupy.zeros((m, f), cupy.float16)
            most = max(gemm.partials_size(m, e), max(sms // c for c in CLUSTERS) * m * e)
            partials = cupy.zeros(most, cupy.float32)
            arrivals = cupy.zeros(2, cupy.uint32)
            stamps = cupy.zeros(sms * 8, cupy.uint64)

            def prev():
                gemm.matmul(x, before, wo)

            def package():
                prev()
                gemm.matmul_act(inter, x, w1, b1, act="relu")
                gemm.matmul_residual_layernorm(hidden, normed, inter, w2, b2, gamma, beta, eps=1e-5,
                                               product=product, partials=partials)

            k = mod.get_function(barrier_name(m, e, f))
            k_smem = (-(-f // sms) * e + -(-e // sms) * f) * 2
            k.max_dynamic_shared_size_bytes = k_smem

            def barrier_kernel(copy_only=0, on=0):
                launch_ex(k, (sms,), (256,), (out, inter, x, w1, b1, w2, b2, arrivals, np.int32(e), np.int32(f),
                                              np.int32(copy_only), stamps, np.int32(on)),
                          k_smem, stream.ptr, dependent=False)

            def barrier():
                prev()
                barrier_kernel()

            def clusters(c, on=0, norm=True):
                blocks = cluster_blocks(sms, c)
                kc = mod.get_function(cluster_name(m, e, f, sms, c))
                smem = 2 * -(-f // blocks) * e * 2 + m * e * 4
                kc.max_dynamic_shared_size_bytes = smem
                slices = partials[:blocks // c * m * e].reshape(blocks // c, m, e)

                def run():
                    prev()
                    launch_ex(kc, (blocks,), (256,), (slices, x, w1, b1, w2t, np.int32(e), np.int32(f), np.int32(1),
                                                      stamps, np.int32(on)),
                              smem, stream.ptr, dependent=stream.is_capturing(), cluster=(c, 1, 1))
                    if norm:
                        norms.residual_layernorm(hidden, normed, slices, b2, gamma, beta, eps=1e-5)
                return run

            with planning():
                package()
            hidden[:] = start
            package()
            stream.synchronize()
            want_x = x.get().astype(np.float32)
            hid = np.maximum(want_x @ w1.get().astype(np.float32).T + b1.get(), 0).astype(np.float16)
            want_out = hid.astype(np.float32) @ w2.get().astype(np.float32).T + b2.get()
            want_normed = normed.get().astype(np.float32)
            barrier()
            stream.synchronize()
            errors = [relative(out, want_out)]
            for c in CLUSTERS:
                hidden[:] = start
                clusters(c)()
                stream.synchronize()
                errors.append(relative(normed, want_normed))
            assert max(errors) < 1e-2, (label, m, errors)

            t_prev = timed(cupy, stream, prev)
            t_package = timed(cupy, stream, package) - t_prev
            t_copy = timed(cupy, stream, lambda: barrier_kernel(copy_only=1))
            t_barrier = timed(cupy, stream, barrier) - t_prev
            t_clusters = [timed(cupy, stream, clusters(c)) - t_prev for c in CLUSTERS]
            mb = (w1.nbytes + w2.nbytes) / 1e6
            print(f"{label} {e}, {m} | {t_package:.1f} | {t_copy:.1f} ({mb / t_copy:.1f}) | {t_barrier:.1f} | "
                  + " / ".join(f"{t:.1f}" for t in t_clusters) + f" | {t_prev:.1f}", flush=True)
            if args.trace:
                barrier_kernel(on=1)
                stream.synchronize()
                print(stage_line("barrier", stamps, sms, ("start", "issued", "first product", "barrier", "rows",
                                                          "end")))
                for c in CLUSTERS:
                    clusters(c, on=1, norm=False)()
                    stream.synchronize()
                    print(stage_line(f"clusters {c}", stamps, cluster_blocks(sms, c),
                                     ("start", "issued", "W1", "W2", "shares", "end")))


if __name__ == "__main__":
    main()
