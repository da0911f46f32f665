"""Attention: the unfused path's steps, the fused variable-length attention, rotary embeddings and
the decoder's KV cache and cached attention (twins of kernels_cu/attention*.cu, rotary.cu, decoder.cu)."""

from __future__ import annotations

import numpy as np

from .runtime import PARALLEL_WORK, _one_blas_thread, _threads


def add_qkv_bias_split_heads(q, k, v, qkv, bias, *, batch, seq, heads):
    """qkv (B*S, 3H) + bias (3H,) -> q, k, v each (B*heads, S, D)."""
    hidden = qkv.shape[1] // 3
    d = hidden // heads
    x = (qkv + bias).reshape(batch, seq, 3, heads, d)          # (B, S, 3, heads, D)
    for i, dst in enumerate((q, k, v)):
        dst[...] = x[:, :, i].transpose(0, 2, 1, 3).reshape(batch * heads, seq, d)


def add_relative_bias(scores, table, buckets, *, heads, max_len):
    """scores (B*heads, S, S) += table[buckets[k - q + max_len - 1], head] (MPNet), in place."""
    n, s, _ = scores.shape
    rel = np.arange(s)[None, :] - np.arange(s)[:, None]                  # (S, S): k - q
    bias = table[buckets[rel + max_len - 1]].transpose(2, 0, 1)          # (heads, S, S)
    scores += np.tile(bias, (n // heads, 1, 1)).astype(scores.dtype)


def masked_softmax(probs, scores, lengths, *, heads, window=0):
    """Softmax over the last axis of scores (B*heads, S, S); keys at or past a sequence's
    length get zero weight, and with window > 0 so do keys k with |k - q| > window (a sliding
    window). A row with no valid key (length 0) is all zeros."""
    n, s, _ = scores.shape
    key_valid = np.arange(s)[None, :] < np.repeat(np.asarray(lengths), heads)[:, None]  # (B*heads, S)
    valid = key_valid[:, None, :] & _window_mask(s, window)[None]
    masked = np.where(valid, scores, -np.inf)
    row_max = masked.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(valid, np.exp(masked - row_max), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    probs[...] = np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _window_mask(s: int, window: int) -> np.ndarray:
    """(S, S) bool: query q sees key k (|k - q| <= window; every key when window is 0)."""
    if not window:
        return np.ones((s, s), dtype=bool)
    return np.abs(np.arange(s)[None, :] - np.arange(s)[:, None]) <= window


def varlen_attention(ctx, qkv, bias, cu_seqlens, *, heads, max_seqlen, causal=False, window=0, rel_bias=None):
    """ctx (T, H) = softmax(Q K^T / sqrt(D) + bias) V for each sequence and head of the
    padding-free layout, with Q | K | V = qkv (T, 3H) + bias (3H,). Rows past cu_seqlens[B] are
    zeroed. causal: query i of a sequence sees its keys 0..i only (a decoder's prefill);
    window > 0: keys within that distance only (a sliding window); rel_bias = (table (buckets,
    heads), buckets (2*max_len - 1,), max_len): MPNet's relative position bias on the scores.
    Sequences run in parallel on the thread pool."""
    hidden = qkv.shape[1] // 3
    d = hidden // heads
    x = (qkv + bias).reshape(-1, 3, heads, d)                       # (T, 3, heads, D)
    ctx[int(cu_seqlens[-1]):] = 0.0
    scale = np.float32(1.0 / np.sqrt(d))

    def scores_of(q, k, n):
        scores = np.matmul(q, k.transpose(0, 2, 1))                   # (heads, L, L)
        scores *= scale
        if rel_bias is not None:
            table, buckets, max_len = rel_bias
            rel = np.arange(n)[None, :] - np.arange(n)[:, None]
            scores += table[buckets[rel + max_len - 1]].transpose(2, 0, 1)
        if window or causal:
            visible = _window_mask(n, window)
            if causal:
                visible &= np.tri(n, dtype=bool)
            scores[:, ~visible] = -np.inf
        return scores

    def one(lo, hi):
        n = hi - lo
        q, k, v = (x[lo:hi, i].transpose(1, 0, 2) for i in range(3))  # (heads, L, D)
        scores = scores_of(q, k, n)
        # softmax is the same whatever each row is shifted by: one shift per head (its largest
        # score) instead of one per row, and the row sums from a product with ones
        scores -= scores.max(axis=(1, 2), keepdims=True)
        np.exp(scores, out=scores)
        total = np.matmul(scores, np.ones((n, 1), np.float32))       # (heads, L, 1)
        if not (total > 1e-30).all():  # a row far below its head's largest score underflowed: shift per row
            scores = scores_of(q, k, n)
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores, v)                                     # (heads, L, D)
        out /= total
        ctx[lo:hi] = out.transpose(1, 0, 2).reshape(n, hidden)

    spans = [(int(cu_seqlens[b]), int(cu_seqlens[b + 1])) for b in range(len(cu_seqlens) - 1)
             if cu_seqlens[b + 1] > cu_seqlens[b]]
    if sum((hi - lo) ** 2 for lo, hi in spans) * hidden < PARALLEL_WORK:
        for lo, hi in spans:
            one(lo, hi)
        return
    with _one_blas_thread:
        for future in [_threads().submit(one, lo, hi) for lo, hi in spans]:
            future.result()


def rotary_qkv(qkv, bias, positions, cos, sin, *, heads):
    """qkv (T, 3H) += bias (3H,), in place, then every head's query and key rotated by its
    token's position p (rotary embeddings, HF's rotate_half form): with x1, x2 the two halves of
    the head, x1 <- x1 cos - x2 sin and x2 <- x2 cos + x1 sin, cos / sin = cos[p] / sin[p], (P, D/2)."""
    t, h3 = qkv.shape
    d = h3 // 3 // heads
    x = (qkv + bias).reshape(t, 3, heads, d)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    for i in (0, 1):
        x1, x2 = x[:, i, :, :d // 2].copy(), x[:, i, :, d // 2:].copy()
        x[:, i, :, :d // 2] = x1 * c - x2 * s
        x[:, i, :, d // 2:] = x2 * c + x1 * s
    qkv[...] = x.reshape(t, h3)


def merge_heads(out, ctx, *, batch, seq, heads):
    """ctx (B*heads, S, D) -> out (B*S, heads*D)."""
    d = ctx.shape[-1]
    out[...] = ctx.reshape(batch, heads, seq, d).transpose(0, 2, 1, 3).reshape(batch * seq, heads * d)


def write_kv_cache(k_cache, v_cache, qkv, bias, seq_ids, positions, *, heads, beside=False):
    """Token t's key and value (columns E..3E of qkv + bias) go to cache[seq_ids[t], :, positions[t]];
    tokens of sequence -1 (padding) are skipped. Caches (B, heads, L, D). beside: nothing here (the
    CUDA backend may run the writes on a branch of a captured graph, see join_beside)."""
    e = qkv.shape[1] // 3
    x = (qkv + bias).reshape(-1, 3, heads, e // heads)                 # (T, 3, heads, D)
    keep = seq_ids >= 0                                                # -1: a padding token, no cache row
    k_cache[seq_ids[keep], :, positions[keep]] = x[keep, 1]
    v_cache[seq_ids[keep], :, positions[keep]] = x[keep, 2]


def cached_attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, *, heads, indir=None, rel_bias=None):
    """ctx (T, E): token t's query (columns 0..E of qkv + bias) attends to positions
    0..positions[t] of its sequence's cache (causal self-attention over the KV cache). With
    indir (B, L), key p of sequence b is read from cache row indir[b, p] (beams share rows).
    rel_bias = (table (buckets, heads), buckets (2 * max_len - 1,), max_len): key j's score gets
    table[buckets[j - positions[t] + max_len - 1]] added (T5). qkv may hold the E query columns
    alone (a cross-attention's queries)."""
    d = k_cache.shape[-1]
    e = heads * d
    q = (qkv[:, :e] + bias[:e]).reshape(-1, heads, d)                   # (T, heads, D)
    for t, (b, p) in enumerate(zip(seq_ids, positions)):
        rows = np.full(p + 1, b) if indir is None else indir[b, :p + 1]
        k = k_cache[rows, :, np.arange(p + 1)].transpose(1, 0, 2)       # (heads, p+1, D)
        v = v_cache[rows, :, np.arange(p + 1)].transpose(1, 0, 2)
        scores = np.einsum("hd,hld->hl", q[t], k) / np.sqrt(d)
        if rel_bias is not None:
            table, buckets, max_len = rel_bias
            scores += table[buckets[np.arange(p + 1) - p + max_len - 1]].T
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        ctx[t] = np.einsum("hl,hld->hd", w, v).reshape(e)


def decode_attention(ctx, qkv, bias, k_cache, v_cache, positions, indir=None, *, heads, rel_bias=None):
    """A decode step: token r is sequence r's new token. Its key and value go to positions[r] of
    cache row r, then it attends as cached_attention."""
    rows = np.arange(len(positions))
    write_kv_cache(k_cache, v_cache, qkv, bias, rows, positions, heads=heads)
    cached_attention(ctx, qkv, bias, k_cache, v_cache, rows, positions, heads=heads, indir=indir, rel_bias=rel_bias)
