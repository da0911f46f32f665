"""Row kernels: embeddings + LayerNorm (kernels_cu/embedding.cu), bias + residual + LayerNorm
(layernorm.cu), and the decoder's embeddings, LayerNorms, residual adds and row gathers (decoder.cu)."""

from __future__ import annotations

import numpy as np

from .runtime import VECS, _ctype, _launch, _row_kernel_shape, _threads, _vec


# layernorm.cu add_bias_residual_layernorm with a warp a row (LN_ROW_WARPS rows a block, up to ROW_WARP_ITEMS[-1]
# 16-byte vectors a lane: no block barrier, more rows in flight): ops. add_bias_residual_layernorm takes it for such
# rows from LN_WARP_MIN_ROWS to LN_WARP_MAX_ROWS rows. (measurements: docs/gpu-internals.md, norms.py ROW_WARP_ITEMS,
# LN_ROW_WARPS, LN_WARP_MIN_ROWS, LN_WARP_MAX_ROWS)
ROW_WARP_ITEMS, LN_ROW_WARPS, LN_WARP_MIN_ROWS, LN_WARP_MAX_ROWS = (1, 2), 4, 1024, 8192


def embed_layernorm(out, ids, token_types, positions, word_emb, pos_emb, type_emb, gamma, beta, *, eps):
    t, h = out.shape
    vec, items, threads = _row_kernel_shape(out, h)
    _launch("embedding.cu", f"embed_layernorm<{_ctype(out)}, {vec}, {items}>", (t,), (threads,),
            (out, ids, token_types, positions, word_emb, pos_emb, type_emb, gamma, beta,
             np.int32(h), np.float32(eps)))


def add_bias_residual_layernorm(out, x, bias, residual, gamma, beta, *, eps):
    """out (T, H) = LayerNorm(x + bias + residual). x (T, H) of out's dtype, or a split product's
    float32 partial sums (slices, T, H), added up in slice order. out may alias residual. A block a
    row; a warp a row for rows of up to ROW_WARP_ITEMS[-1] 16-byte vectors a lane from
    LN_WARP_MIN_ROWS to LN_WARP_MAX_ROWS rows (figures: docs/gpu-internals.md)."""
    t, h = out.shape
    args = (out, x, bias, residual, gamma, beta, np.int32(t), np.int32(h), np.float32(eps))
    ct, vec = _ctype(out), _vec(out, h)
    if x.ndim == 2 and vec == VECS[ct][0] and LN_WARP_MIN_ROWS <= t <= LN_WARP_MAX_ROWS:
        items = -(-(h // vec) // 32)
        if items <= ROW_WARP_ITEMS[-1]:
            items = min(i for i in ROW_WARP_ITEMS if i >= items)
            _launch("layernorm.cu", f"add_bias_residual_layernorm<{ct}, {ct}, 1, {vec}, {items}, {LN_ROW_WARPS}>",
                    (-(-t // LN_ROW_WARPS),), (32 * LN_ROW_WARPS,), args)
            return
    vec, items, threads = _row_kernel_shape(out, h)
    slices = x.shape[0] if x.ndim == 3 else 1
    _launch("layernorm.cu", f"add_bias_residual_layernorm<{ct}, {_ctype(x)}, {slices}, {vec}, {items}>", (t,),
            (threads,), args)


def embed_positions(out, ids, positions, wte, wpe, *, unplaced=-1):
    t, e = out.shape
    vec = _vec(out, e)
    _launch("decoder.cu", f"embed_positions<{_ctype(out)}, {vec}>", (t,), (_threads(e // vec),),
            (out, ids, positions, wte, wpe, np.int32(e), np.int32(unplaced)))


def layernorm(out, x, gamma, beta, *, eps, rms=False):
    t, h = out.shape
    vec, items, threads = _row_kernel_shape(out, h)
    _launch("decoder.cu", f"layernorm<{_ctype(out)}, {vec}, {items}>", (t,), (threads,),
            (out, x, gamma, beta, np.int32(h), np.float32(eps), np.int32(rms)))


def add_bias_residual(out, x, bias, residual):
    t, e = out.shape
    vec = _vec(out, e)
    _launch("decoder.cu", f"add_bias_residual<{_ctype(out)}, {vec}>", (t,), (_threads(e // vec),),
            (out, x, bias, residual, np.int32(e)))


def residual_layernorm(hidden, normed, x, bias, gamma, beta, *, eps, rms=False):
    """hidden (T, E) += x + bias; normed = LayerNorm(hidden) (rms: T5's RMS norm, beta zeros). x
    (T, E) of hidden's dtype, or a split product's float32 partial sums (slices, T, E), added up in
    slice order."""
    t, h = hidden.shape
    vec, items, threads = _row_kernel_shape(hidden, h)
    slices = x.shape[0] if x.ndim == 3 else 1
    _launch("decoder.cu", f"residual_layernorm<{_ctype(hidden)}, {_ctype(x)}, {slices}, {vec}, {items}>", (t,),
            (threads,), (hidden, normed, x, bias, gamma, beta, np.int32(h), np.float32(eps), np.int32(rms)))


def gather_rows(out, x, rows):
    n, e = out.shape
    vec = _vec(out, e)
    _launch("decoder.cu", f"gather_rows<{_ctype(out)}, {vec}>", (n,), (_threads(e // vec),),
            (out, x, rows, np.int32(e)))
