"""Pooling modes and L2 normalisation: kernels_cu/pooling.cu's twins."""

from __future__ import annotations

import numpy as np


def pool(out, hidden, lengths, *, seq, modes, skip=0):
    """hidden (B*S, H) -> out (B, len(modes)*H), the modes concatenated in the given order.
    skip: each sequence's first `skip` tokens (a prompt's) are left out, as sentence-transformers'
    include_prompt=false does: cls takes token `skip` (token 0 if there is none), the other
    modes pool tokens skip..len-1 (weightedmean keeps each token's weight s + 1); a sequence with
    no token left pools to zeros (cls aside)."""
    b = out.shape[0]
    h = hidden.shape[1]
    x = hidden.reshape(b, seq, h)
    lengths = np.asarray(lengths)
    first = np.where(lengths > skip, skip, 0)
    valid = ((np.arange(seq)[None, :] < lengths[:, None]) & (np.arange(seq)[None, :] >= skip))[:, :, None]  # (B, S, 1)
    count = np.maximum(lengths - skip, 1).astype(np.float32)[:, None]
    some = (lengths > skip)[:, None]
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(x[np.arange(b), first])
        elif mode == "max":
            parts.append(np.where(some, np.where(valid, x, -np.inf).max(axis=1), 0.0))
        elif mode == "mean":
            parts.append(np.where(valid, x, 0.0).sum(axis=1) / count)
        elif mode == "mean_sqrt_len":
            parts.append(np.where(valid, x, 0.0).sum(axis=1) / np.sqrt(count))
        elif mode == "weightedmean":  # token s weighs s + 1 (sentence-transformers)
            weights = np.where(valid, np.arange(1, seq + 1, dtype=np.float32)[None, :, None], 0.0)
            parts.append((x * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0))
        elif mode == "lasttoken":
            parts.append(np.where(some, x[np.arange(b), np.maximum(lengths - 1, 0)], 0.0))
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    out[...] = np.concatenate(parts, axis=1)


def pool_packed(out, hidden, cu_seqlens, *, modes, skip=0):
    """Pooling over the padding-free layout: sequence b is rows cu_seqlens[b]..cu_seqlens[b+1]
    of hidden (T, H); out (B, len(modes)*H). An empty sequence pools to zeros; skip as in pool."""
    for b in range(out.shape[0]):
        lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        if hi == lo:
            out[b] = 0.0
            continue
        pool(out[b:b + 1], hidden[lo:hi], np.array([hi - lo]), seq=hi - lo, modes=modes, skip=skip)


def l2_normalize(out, x):
    """out (B, D) = x / max(||x||, 1e-12), row by row (torch.nn.functional.normalize)."""
    norm = np.sqrt((x.astype(np.float32) ** 2).sum(axis=1, keepdims=True))
    out[...] = x / np.maximum(norm, 1e-12)
