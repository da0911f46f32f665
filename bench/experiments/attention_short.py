"""Tile shapes of the tensor-core varlen attention (attention_varlen.cu) for batches of short
sequences (a sentence: 8 to 23 tokens), against the wgmma kernel (attention_sm90.cu) the encoder
ran there before, timed side by side.

Every (warps, query tiles per warp, key tile) candidate is first checked against the NumPy
reference on a ragged batch of short sequences (plain and causal), then timed on batches of 64,
256 and 1,024 such sequences and of 256 sequences of 30 to 64 tokens, at head dims 32
(all-MiniLM-L6-v2) and 64 (BERT-base), 12 heads, fp16; each kernel's grid over the batch's longest
sequence rounded up to 32 or 64 (shapes.bucket_packed). Microseconds a call, 20 calls captured in a
CUDA graph, the median of 5 replays. The winner is VARLEN_TILES["short"] (attention.py).

    PYTHONPATH=. python3 bench/experiments/attention_short.py
"""

from __future__ import annotations

import numpy as np

# (warps, 16-query tiles a warp, keys a tile)
CANDIDATES = [(1, 1, 16), (1, 1, 32), (2, 1, 16), (2, 1, 32), (1, 2, 32), (2, 1, 64), (4, 1, 64)]
# (sequences, shortest, longest) of a batch
BATCHES = [(64, 8, 23), (256, 8, 23), (1024, 8, 23), (256, 30, 64)]
HEADS = 12


def mma_name(d, cfg):
    w, mt, kn = cfg
    return f"varlen_attention_mma<__half, {d}, false, {w}, {mt}, {kn}, 0>"


def list_candidates():
    """The candidates as kernels of attention_varlen.cu (families.py lists the package's own)."""
    from ftengine.backends.cuda import families
    listed = families.FAMILIES["attention_varlen.cu"]
    extra = [mma_name(d, cfg) for d in (32, 64) for cfg in CANDIDATES]
    families.FAMILIES["attention_varlen.cu"] = lambda t: list(dict.fromkeys(listed(t) + (extra if t == "__half" else [])))


def launcher(cfg, d, out, qkv, bias, cu_seqlens, b, grid_seq, causal=False):
    from ftengine.backends.cuda.runtime import _launch
    w, mt, kn = cfg
    scale_log2 = np.float32(1.4426950408889634 / np.sqrt(d))
    t = out.shape[0]

    def launch():
        _launch("attention_varlen.cu", mma_name(d, cfg), (-(-grid_seq // (16 * w * mt)), b * HEADS), (32 * w,),
                (out, qkv, bias, cu_seqlens, np.int32(b), np.int32(HEADS), np.int32(t), scale_log2,
                 np.int32(causal), np.int32(0), cu_seqlens, cu_seqlens, np.int32(0)),
                shared_mem=2 * 2 * kn * (d + 8) * 2)
    return launch


def graph_us(launch):
    """Microseconds a call: bench_encoder.graph_ms (20 calls captured in a graph, the median of 5
    replays), after one call outside the capture (the kernel's compile)."""
    from bench.bench_encoder import graph_ms
    launch()
    return graph_ms(launch) * 1000


def batch(rng, b, lo, hi, d):
    import cupy
    from ftengine.backends.cuda.runtime import context
    lengths = rng.integers(lo, hi + 1, size=b)
    cu_host = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = -(-int(cu_host[-1]) // 64) * 64
    h = HEADS * d
    qkv_h = rng.standard_normal((t, 3 * h)).astype(np.float16)
    bias_h = (0.1 * rng.standard_normal(3 * h)).astype(np.float16)
    with context().stream:
        arrays = cupy.asarray(qkv_h), cupy.asarray(bias_h), cupy.asarray(cu_host), cupy.empty((t, h), np.float16)
    return lengths, cu_host, qkv_h, bias_h, arrays


def check(rng):
    """Max abs error of every candidate against the NumPy reference, plain and causal."""
    from ftengine.backends import numpy_ops
    from ftengine.backends.cuda.runtime import context
    worst = 0.0
    for d in (32, 64):
        lengths, cu_host, qkv_h, bias_h, (qkv, bias, cu_seqlens, out) = batch(rng, 48, 1, 32, d)
        for causal in (False, True):
            ref = np.empty(out.shape, np.float32)
            numpy_ops.varlen_attention(ref, qkv_h.astype(np.float32), bias_h.astype(np.float32), cu_host,
                                       heads=HEADS, max_seqlen=int(lengths.max()), causal=causal)
            for cfg in CANDIDATES:
                launcher(cfg, d, out, qkv, bias, cu_seqlens, len(lengths), 32, causal)()
                context().stream.synchronize()
                err = float(np.abs(out.get().astype(np.float32) - ref).max())
                worst = max(worst, err)
                print(f"check d{d} {cfg} causal={causal}: max abs err {err:.2e}{'  FAIL' if not err < 2e-3 else ''}")
    return worst


def main():
    from ftengine.backends.cuda.runtime import _launch
    list_candidates()
    rng = np.random.default_rng(0)
    check(rng)
    for d in (32, 64):
        for b, lo, hi in BATCHES:
            lengths, _, _, _, (qkv, bias, cu_seqlens, out) = batch(rng, b, lo, hi, d)
            longest = int(lengths.max())
            grid_seq = 32 if longest <= 32 else -(-longest // 64) * 64
            wgmma = graph_us(lambda: _launch(  # the kernel the encoder ran here before the short tiles
                "attention_sm90.cu", f"varlen_attention_wgmma<__half, {d}>", (-(-grid_seq // 64), b * HEADS), (128,),
                (out, qkv, bias, cu_seqlens, np.int32(b), np.int32(HEADS), np.int32(out.shape[0]),
                 np.float32(1.4426950408889634 / np.sqrt(d)), np.int32(0), np.int32(0), cu_seqlens, cu_seqlens,
                 np.int32(0)),
                shared_mem=(2 * 2 * 64 * d + 64 * (d + 8)) * 2 + 1024))
            times = {cfg: graph_us(launcher(cfg, d, out, qkv, bias, cu_seqlens, b, grid_seq)) for cfg in CANDIDATES}
            best = min(times, key=times.get)
            print(f"d{d} {b} x {lo}-{hi} tokens: wgmma {wgmma:.1f} us; "
                  + "; ".join(f"{cfg} {us:.1f}" for cfg, us in times.items())
                  + f"; best {best} {wgmma / times[best]:.2f}x the wgmma kernel", flush=True)


if __name__ == "__main__":
    main()
