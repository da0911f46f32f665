"""Launchers of kernels_cu/pooling.cu: sentence-transformers pooling modes and L2 normalisation."""

from __future__ import annotations

import numpy as np

from .runtime import ROW_THREADS, _ctype, _launch, context


# pooling.cu: the warps a block may have (they split a sequence's rows), and the most warps a launch takes an SM
# (_pool_warps: the most warps a block such that the launch stays within them, else the fewest). (measurements:
# docs/gpu-internals.md, pooling.py POOL_WARPS, POOL_WARPS_PER_SM)
POOL_WARPS, POOL_WARPS_PER_SM = (2, 4, 8), 48
POOL_CODES = {"cls": 0, "max": 1, "mean": 2, "mean_sqrt_len": 3, "lasttoken": 4, "weightedmean": 5}


def _pool_modes(kernel: str, out, hidden, modes, extra_args, skip: int):
    """One launch per pooling mode, each writing its H columns of out (B, modes*H): a block takes 32
    columns of a sequence, its warps (_pool_warps) its rows (pooling.cu)."""
    b, h = out.shape[0], hidden.shape[1]
    warps = _pool_warps(b * -(-h // 32))
    for i, mode in enumerate(modes):
        if mode not in POOL_CODES:
            raise ValueError(f"unknown pooling mode {mode!r}")
        _launch("pooling.cu", f"{kernel}<{_ctype(hidden)}, {warps}>", (b, -(-h // 32)), (32 * warps,),
                (out, hidden, *extra_args, np.int32(h), np.int32(out.shape[1]), np.int32(i * h),
                 np.int32(POOL_CODES[mode]), np.int32(skip)))


def _pool_warps(blocks: int) -> int:
    """The warps a pooling block has: the most of POOL_WARPS that keep `blocks` blocks within
    POOL_WARPS_PER_SM warps an SM, else the fewest (figures: docs/gpu-internals.md)."""
    limit = POOL_WARPS_PER_SM * context().sm_count
    return max((w for w in POOL_WARPS if blocks * w <= limit), default=min(POOL_WARPS))


def pool(out, hidden, lengths, *, seq, modes, skip=0):
    """out (B, modes*H) float32 from padded hidden states (B*S, H) of any storage type; each
    sequence's first `skip` tokens left out (as numpy_ops.pool)."""
    _pool_modes("pool", out, hidden, modes, (lengths, np.int32(seq)), skip)


def pool_packed(out, hidden, cu_seqlens, *, modes, skip=0):
    """out (B, modes*H) float32 from the padding-free hidden states (T, H)."""
    _pool_modes("pool_packed", out, hidden, modes, (cu_seqlens,), skip)


def l2_normalize(out, x):
    """Row-wise L2 normalisation of float32 (pooled) vectors."""
    b, d = out.shape
    _launch("pooling.cu", f"l2_normalize<{_ctype(out)}>", (b,), (ROW_THREADS,), (out, x, np.int32(d)))
