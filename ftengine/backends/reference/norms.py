"""Embeddings, LayerNorms, residual adds and row gathers: the twins of kernels_cu/embedding.cu,
layernorm.cu and decoder.cu's row kernels."""

from __future__ import annotations

import numpy as np

from .runtime import _by_row_blocks


def _layernorm(x, gamma, beta, eps, rms=False):
    """LayerNorm of the last axis in float32; rms: T5's RMS norm (no mean taken out)."""
    x = x.astype(np.float32)
    mean = np.float32(0.0) if rms else x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _layernorm_block(out, y, gamma, beta, eps):
    """out = LayerNorm(y) row by row, y (a scratch block) overwritten: _layernorm in place."""
    y -= y.mean(axis=-1, keepdims=True)
    var = np.square(y).mean(axis=-1, keepdims=True)
    var += eps
    np.sqrt(var, out=var)
    y /= var
    y *= gamma
    np.add(y, beta, out=out)


def embed_layernorm(out, ids, token_types, positions, word_emb, pos_emb, type_emb, gamma, beta, *, eps):
    """out (T, H) = LayerNorm(word_emb[ids] + pos_emb[positions] + type_emb[token_types])."""
    x = word_emb[ids] + pos_emb[positions] + type_emb[token_types]
    out[...] = _layernorm(x, gamma, beta, eps)


def add_bias_residual_layernorm(out, x, bias, residual, gamma, beta, *, eps):
    """out (T, H) = LayerNorm(x + bias + residual). out may alias residual."""
    def block(lo, hi):
        y = x[lo:hi] + bias
        y += residual[lo:hi]
        _layernorm_block(out[lo:hi], y, gamma, beta, eps)
    _by_row_blocks(block, out.shape[0], out.shape[1])


def embed_positions(out, ids, positions, wte, wpe, *, unplaced=-1):
    """out (T, E) = wte[ids] + wpe[positions], without the position where ids == unplaced
    (M2M100's pad, which HF gives its zero position row; -1: none)."""
    ids = np.asarray(ids)
    out[...] = wte[ids] + np.where((ids == unplaced)[:, None], np.float32(0), wpe[positions])


def layernorm(out, x, gamma, beta, *, eps, rms=False):
    """out (T, E) = LayerNorm(x) (rms: T5's RMS norm, beta zeros)."""
    out[...] = _layernorm(x, gamma, beta, eps, rms)


def add_bias_residual(out, x, bias, residual):
    """out (T, E) = x + bias + residual. out may alias residual."""
    out[...] = x + bias + residual


def residual_layernorm(hidden, normed, x, bias, gamma, beta, *, eps, rms=False):
    """hidden (T, E) += x + bias; normed (T, E) = LayerNorm(hidden) (rms: T5's RMS norm)."""
    hidden += x + bias
    normed[...] = _layernorm(hidden, gamma, beta, eps, rms)


def gather_rows(out, x, rows):
    """out (N, E) = x[rows]."""
    out[...] = x[rows]
