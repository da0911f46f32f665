"""Reference ops: plain NumPy, float32, obvious. The golden model every CUDA op is checked against.

Each op writes into an explicit output buffer; the CUDA launchers in backends/cuda/ops.py
have the same names and signatures, so models/ code runs unchanged on either backend.
Layout: tokens are rows. A padded batch of B sequences of S slots is (B*S, H), row b*S + s.

It is also the CPU backend users without a GPU run, so the element-wise ops that dominate
after the matrix products (GELU, LayerNorm, attention's softmax) run over cache-sized row
blocks, in place, on a pool of threads (one per core: NumPy's ufuncs run on one core each and
release the GIL); the formulas stay the reference ones.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from ..errors import DeviceError

name = "numpy"
STORAGE = {"fp32": np.float32}
CHOICE_STATE_WORDS = 1  # choose_tokens' state per row: none here (the CUDA backend's keeps its selects' counts)


# ------------------------------------------------------------------ memory

def check_fp8():
    raise DeviceError("dtype fp8 needs a CUDA GPU with FP8 tensor cores; the CPU (NumPy) backend computes in fp32")


def storage_dtype(dtype_name: str):
    return STORAGE[dtype_name]


def empty(shape, dtype):
    return np.empty(shape, dtype=dtype)


pinned_empty = empty


def to_device(array, dtype=None):
    return np.ascontiguousarray(array, dtype=dtype or array.dtype)


def copy_from_host(dst, src):
    dst[...] = src


def to_host(array):
    return np.asarray(array)


def synchronize():
    pass


def prepare_kernels(files, dtype_name: str, *, head_dim: int, gelu_product: str | None = None,
                    ln_product: bool = False):
    """Nothing to compile on the CPU."""


class DeviceTimer:
    """Wall time of the (synchronous) work between creation and stop() (events: unused here)."""

    def __init__(self, events=None):
        self._start = time.perf_counter()
        self._end = None

    def stop(self):
        self._end = time.perf_counter()

    def seconds(self) -> float:
        return self._end - self._start


class GraphCache:
    """The CUDA backend captures forward passes as graphs; here every call runs directly."""

    def __init__(self, capacity: int = 32, *, enabled: bool = True):
        self.enabled = enabled

    def run(self, key, launch):
        launch()


# ------------------------------------------------------------------ helpers

def _layernorm(x, gamma, beta, eps):
    x = x.astype(np.float32)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _erf(x):
    """erf, Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7 plus the rounding of x's dtype), vectorised."""
    sign = np.sign(x)
    a = np.abs(x)
    t = 1 / (1 + np.float32(0.3275911) * a)
    c = [np.float32(v) for v in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)]
    poly = t * (c[0] + t * (c[1] + t * (c[2] + t * (c[3] + t * c[4]))))
    return sign * (1 - poly * np.exp(-a * a))


def _gelu(x, form):
    if form == "erf":
        return 0.5 * x * (1.0 + _erf(x * np.float32(1.0 / math.sqrt(2.0))))
    if form == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    raise ValueError(f"unknown GELU form {form!r}")


# -------------------------------------------------- blocked, threaded element-wise passes

PARALLEL_WORK = 1 << 22    # multiply-adds below which an op runs in the calling thread (pool hand-offs cost more)
BLOCK_ELEMENTS = 1 << 17   # float32 values per block (512 KiB): large enough that the per-call cost is small
_WORKERS = max(1, os.cpu_count() or 1)
_pool = None
_pool_pid = None


def _threads() -> ThreadPoolExecutor:
    """The pool, one thread per core; made again in a forked child (its threads do not survive a fork)."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="ftengine-cpu")
        _pool_pid = os.getpid()
    return _pool


class _OneBlasThread:
    """While any op is inside this context, each BLAS call runs on one thread: the pool's
    threads already keep every core busy, and BLAS's own threads, which spin for a while after
    each call, would take cores from them. The first to enter sets the limit, the last to leave
    restores the process's setting (threadpoolctl), so overlapping callers never leave it
    changed. threadpoolctl lets one thread at a time control OpenBLAS (the first that sets a
    limit): from any other thread this is a no-op, which costs speed only."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside = 0
        self._controller = None
        self._limit = None

    def __enter__(self):
        with self._lock:
            if self._inside == 0:
                from threadpoolctl import ThreadpoolController
                if self._controller is None:
                    self._controller = ThreadpoolController()
                self._limit = self._controller.limit(limits=1, user_api="blas")
            self._inside += 1

    def __exit__(self, *exc):
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                self._limit.restore_original_limits()
                self._limit = None


_one_blas_thread = _OneBlasThread()


def _by_row_blocks(fn, rows: int, width: int):
    """fn(lo, hi) over blocks of rows of about BLOCK_ELEMENTS values, on the thread pool."""
    step = max(1, BLOCK_ELEMENTS // max(1, width))
    spans = [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]
    if len(spans) <= 1:
        for lo, hi in spans:
            fn(lo, hi)
        return
    for future in [_threads().submit(fn, lo, hi) for lo, hi in spans]:
        future.result()


# A&S 7.1.26 with z = |y| / sqrt(2): erfc(z) = t (c1 + t (c2 + ... + t c5)) exp(-z^2), t = 1 / (1 + p z).
# GELU(y) = y - m for y >= 0 and m for y < 0, with m = y erfc(z) / 2: the coefficients are halved.
_ERF_P = np.float32(0.3275911 / math.sqrt(2.0))
_ERFC_HALF = [np.float32(v / 2) for v in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)]


def _gelu_block(out, y, form):
    """out = GELU(y) for one block (out must not be y), in place with two scratch arrays:
    _gelu's formulas, rearranged for fewer passes."""
    if form == "tanh":
        u = y * y
        u *= np.float32(0.044715)
        u += 1
        u *= y
        u *= np.float32(math.sqrt(2.0 / math.pi))
        np.tanh(u, out=u)
        u += 1
        u *= y
        np.multiply(u, 0.5, out=out)
        return
    if form != "erf":
        raise ValueError(f"unknown GELU form {form!r}")
    a = np.abs(y)
    t = a * _ERF_P
    t += 1
    np.reciprocal(t, out=t)
    m = t * _ERFC_HALF[4]
    for c in _ERFC_HALF[3::-1]:
        m += c
        m *= t
    np.multiply(a, a, out=a)
    a *= -0.5
    np.exp(a, out=a)
    m *= a
    np.multiply(m, y, out=out)
    np.subtract(y, out, out=out, where=y >= 0)


def _layernorm_block(out, y, gamma, beta, eps):
    """out = LayerNorm(y) row by row, y (a scratch block) overwritten: _layernorm in place."""
    y -= y.mean(axis=-1, keepdims=True)
    var = np.square(y).mean(axis=-1, keepdims=True)
    var += eps
    np.sqrt(var, out=var)
    y /= var
    y *= gamma
    np.add(y, beta, out=out)


# ------------------------------------------------------------------ ops

def embed_layernorm(out, ids, token_types, positions, word_emb, pos_emb, type_emb, gamma, beta, *, eps):
    """out (T, H) = LayerNorm(word_emb[ids] + pos_emb[positions] + type_emb[token_types])."""
    x = word_emb[ids] + pos_emb[positions] + type_emb[token_types]
    out[...] = _layernorm(x, gamma, beta, eps)


def matmul(out, x, weight):
    """out (M, N) = x (M, K) @ weight (N, K)^T  -- weight in HF's (out, in) layout. Large
    products are split by rows over the thread pool, one BLAS thread each."""
    m = x.shape[0]
    parts = min(_WORKERS, max(1, m // 64))
    if parts <= 1 or m * weight.shape[0] * x.shape[1] < PARALLEL_WORK:
        np.matmul(x, weight.T, out=out)
        return
    bounds = np.linspace(0, m, parts + 1).astype(int)
    with _one_blas_thread:
        for future in [_threads().submit(np.matmul, x[lo:hi], weight.T, out=out[lo:hi])
                       for lo, hi in zip(bounds[:-1], bounds[1:])]:
            future.result()


def matmul_bias_gelu(out, x, weight, bias, *, form):
    """out (M, N) = GELU(x @ weight^T + bias), erf or tanh form."""
    matmul(out, x, weight)
    add_bias_gelu(out, out, bias, form=form)


def add_qkv_bias_split_heads(q, k, v, qkv, bias, *, batch, seq, heads):
    """qkv (B*S, 3H) + bias (3H,) -> q, k, v each (B*heads, S, D)."""
    hidden = qkv.shape[1] // 3
    d = hidden // heads
    x = (qkv + bias).reshape(batch, seq, 3, heads, d)          # (B, S, 3, heads, D)
    for i, dst in enumerate((q, k, v)):
        dst[...] = x[:, :, i].transpose(0, 2, 1, 3).reshape(batch * heads, seq, d)


def batched_matmul(out, a, b, *, transpose_b, alpha=1.0):
    """out (N, M, P) = alpha * a (N, M, K) @ b (N, K, P), or b^T when b is (N, P, K)."""
    out[...] = alpha * np.matmul(a, b.transpose(0, 2, 1) if transpose_b else b)


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


def gated_gelu(out, x, bias, *, form):
    """GeGLU: out (T, I) = GELU(x[:, :I] + bias[:I]) * (x[:, I:] + bias[I:]), x (T, 2I)."""
    i = out.shape[1]

    def block(lo, hi):
        y = x[lo:hi] + bias
        _gelu_block(out[lo:hi], y[:, :i], form)
        out[lo:hi] *= y[:, i:]
    _by_row_blocks(block, out.shape[0], 2 * i)


def merge_heads(out, ctx, *, batch, seq, heads):
    """ctx (B*heads, S, D) -> out (B*S, heads*D)."""
    d = ctx.shape[-1]
    out[...] = ctx.reshape(batch, heads, seq, d).transpose(0, 2, 1, 3).reshape(batch * seq, heads * d)


def add_bias_residual_layernorm(out, x, bias, residual, gamma, beta, *, eps):
    """out (T, H) = LayerNorm(x + bias + residual). out may alias residual."""
    def block(lo, hi):
        y = x[lo:hi] + bias
        y += residual[lo:hi]
        _layernorm_block(out[lo:hi], y, gamma, beta, eps)
    _by_row_blocks(block, out.shape[0], out.shape[1])


def dense(out, x, weight, bias, *, activation, norm=()):
    """out (M, N) = activation(x @ weight^T + bias), then LayerNorm with norm = (gamma, beta,
    eps) if given: a layer of the head after pooling."""
    y = x @ weight.T + bias
    if activation == "tanh":
        y = np.tanh(y)
    elif activation == "relu":
        y = np.maximum(y, 0.0)
    elif activation == "gelu":
        y = _gelu(y, "erf")
    elif activation != "identity":
        raise ValueError(f"unknown activation {activation!r}")
    out[...] = _layernorm(y, *norm) if norm else y


def add_bias_gelu(out, x, bias, *, form):
    """out (T, I) = GELU(x + bias), erf or tanh form. out may alias x."""
    def block(lo, hi):
        y = x[lo:hi] + bias
        _gelu_block(out[lo:hi], y, form)
    _by_row_blocks(block, out.shape[0], out.shape[1])


# ------------------------------------------------------------------ fp8 (e4m3) product operands, as kernels_cu/fp8.cu

E4M3_MAX = np.float32(448.0)


def e4m3_bytes(v) -> np.ndarray:
    """float32 values -> e4m3 bytes: round to nearest even, saturating at +-448 (cvt.rn.satfinite)."""
    v = np.asarray(v, np.float32)
    a = np.minimum(np.abs(v), E4M3_MAX).astype(np.float64)
    _, e = np.frexp(a)
    exp = np.clip(e.astype(np.int64) - 1, -6, 8)     # the binade (subnormals share the lowest)
    m = np.rint(a / np.exp2(exp - 3)).astype(np.int64)  # 3 mantissa bits: 8..16 (normal), 0..8 (subnormal)
    carry = m == 16
    exp, m = exp + carry, np.where(carry, 8, m)
    normal = m >= 8
    fields = np.where(normal, (exp + 7) << 3 | (m - 8), m)
    return (np.signbit(v).astype(np.int64) << 7 | fields).astype(np.uint8)


def e4m3_values(q) -> np.ndarray:
    """e4m3 bytes -> float32 values."""
    q = np.asarray(q, np.uint8).astype(np.int64)
    e, m = (q >> 3) & 15, q & 7
    magnitude = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0))
    return np.where(q >> 7, -magnitude, magnitude).astype(np.float32)


def quantize_rows(q, scales, x):
    """q (rows, H) e4m3 bytes, scales (rows,) float32: each row scaled by amax / 448 (1 for a zero
    row) and rounded to e4m3, so that value ~ e4m3_values(q) * scale."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=1)
    nonzero = amax > 0
    inv = np.where(nonzero, E4M3_MAX / np.where(nonzero, amax, 1), np.float32(1)).astype(np.float32)
    scales[...] = np.where(nonzero, amax / E4M3_MAX, np.float32(1))
    q[...] = e4m3_bytes(x * inv[:, None])


def add_bias_residual_layernorm_quantize(out, q, scales, x, bias, residual, gamma, beta, *, eps):
    """add_bias_residual_layernorm, its output also quantised (quantize_rows) into q, scales."""
    add_bias_residual_layernorm(out, x, bias, residual, gamma, beta, eps=eps)
    quantize_rows(q, scales, out)


def add_bias_gelu_quantize(q, scales, x, bias, *, form):
    """q, scales = quantize_rows(GELU(x + bias))."""
    y = np.empty(x.shape, np.float32)
    add_bias_gelu(y, x, bias, form=form)
    quantize_rows(q, scales, y)


def matmul_fp8(out, x, x_scales, weight, w_scales):
    """out (M, N) = (x_scales[:, None] * x) @ (w_scales[:, None] * weight)^T for e4m3 bytes x, weight."""
    out[...] = (e4m3_values(x) * x_scales[:, None]) @ (e4m3_values(weight) * w_scales[:, None]).T


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


# ------------------------------------------------------------------ decoder (GPT-2)

def embed_positions(out, ids, positions, wte, wpe):
    """out (T, E) = wte[ids] + wpe[positions]."""
    out[...] = wte[ids] + wpe[positions]


def layernorm(out, x, gamma, beta, *, eps):
    """out (T, E) = LayerNorm(x)."""
    out[...] = _layernorm(x, gamma, beta, eps)


def add_bias_residual(out, x, bias, residual):
    """out (T, E) = x + bias + residual. out may alias residual."""
    out[...] = x + bias + residual


def partials_size(rows: int, n: int) -> int:
    """0: matmul_residual_layernorm and matmul_bias_residual_layernorm split no product here."""
    return 0


def matmul_residual_layernorm(hidden, normed, x, weight, bias, gamma, beta, *, eps, product, partials):
    """hidden += x @ weight^T + bias; normed = LayerNorm(hidden), the product through `product`
    (`partials` unused: see partials_size)."""
    matmul(product, x, weight)
    residual_layernorm(hidden, normed, product, bias, gamma, beta, eps=eps)


def matmul_bias_residual_layernorm(out, x, weight, bias, residual, gamma, beta, *, eps, product, partials):
    """out = LayerNorm(x @ weight^T + bias + residual), the product through `product` (`partials`
    unused: see partials_size). out may alias residual."""
    matmul(product, x, weight)
    add_bias_residual_layernorm(out, product, bias, residual, gamma, beta, eps=eps)


def prefetch_l2(arrays, *, rows: int):
    """Nothing here (the CUDA backend's prefetch_l2 asks the L2 to fetch weights ahead of their
    readers)."""


def prefetch_kv(k_cache, v_cache, positions):
    """Nothing here (the CUDA backend's prefetch_kv asks the L2 to fetch a decode step's cached
    keys and values ahead of its attention)."""


def join_beside():
    """Nothing here (the CUDA backend joins the work write_kv_cache(beside=True) branched off)."""


def residual_layernorm(hidden, normed, x, bias, gamma, beta, *, eps):
    """hidden (T, E) += x + bias; normed (T, E) = LayerNorm(hidden)."""
    hidden += x + bias
    normed[...] = _layernorm(hidden, gamma, beta, eps)


def write_kv_cache(k_cache, v_cache, qkv, bias, seq_ids, positions, *, heads, beside=False):
    """Token t's key and value (columns E..3E of qkv + bias) go to cache[seq_ids[t], :, positions[t]];
    tokens of sequence -1 (padding) are skipped. Caches (B, heads, L, D). beside: nothing here (the
    CUDA backend may run the writes on a branch of a captured graph, see join_beside)."""
    e = qkv.shape[1] // 3
    x = (qkv + bias).reshape(-1, 3, heads, e // heads)                 # (T, 3, heads, D)
    keep = seq_ids >= 0                                                # -1: a padding token, no cache row
    k_cache[seq_ids[keep], :, positions[keep]] = x[keep, 1]
    v_cache[seq_ids[keep], :, positions[keep]] = x[keep, 2]


def cached_attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, *, heads, indir=None):
    """ctx (T, E): token t's query (columns 0..E of qkv + bias) attends to positions
    0..positions[t] of its sequence's cache (causal self-attention over the KV cache). With
    indir (B, L), key p of sequence b is read from cache row indir[b, p] (beams share rows)."""
    e = qkv.shape[1] // 3
    d = e // heads
    q = (qkv[:, :e] + bias[:e]).reshape(-1, heads, d)                   # (T, heads, D)
    for t, (b, p) in enumerate(zip(seq_ids, positions)):
        rows = np.full(p + 1, b) if indir is None else indir[b, :p + 1]
        k = k_cache[rows, :, np.arange(p + 1)].transpose(1, 0, 2)       # (heads, p+1, D)
        v = v_cache[rows, :, np.arange(p + 1)].transpose(1, 0, 2)
        scores = np.einsum("hd,hld->hl", q[t], k) / np.sqrt(d)
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        ctx[t] = np.einsum("hl,hld->hd", w, v).reshape(e)


def decode_attention(ctx, qkv, bias, k_cache, v_cache, positions, indir=None, *, heads):
    """A decode step: token r is sequence r's new token. Its key and value go to positions[r] of
    cache row r, then it attends as cached_attention."""
    rows = np.arange(len(positions))
    write_kv_cache(k_cache, v_cache, qkv, bias, rows, positions, heads=heads)
    cached_attention(ctx, qkv, bias, k_cache, v_cache, rows, positions, heads=heads, indir=indir)


def zero(array):
    array[...] = 0


def mark_seen(seen, tokens, rows):
    """seen (B, V): seen[rows[i], tokens[i]] = 1, for rows[i] >= 0 (-1: a padding token)."""
    keep = rows >= 0
    seen[rows[keep], tokens[keep]] = 1


def choose_tokens(out, logits, seen, eos, step, *, scratch, state, params, seed, seq=None, lengths=None):
    """out (B,) int32: the next token of each row of logits (B, V) float32 after step[0] chosen
    tokens, HF `generate` processors and order (see decoding/processors.py), eos ids `eos` masked
    before params.min_new_tokens; -1 for a row with a non-finite logit. seed (2,) uint32: the
    draw's seed as low and high words (read here, not params.seed). seq (B, L) and lengths (B,):
    each row's tokens so far (for no_repeat_ngram_size). scratch and state: unused here."""
    from ..decoding.processors import choose
    params = replace(params, seed=int(seed[0]) | int(seed[1]) << 32)
    histories = None
    if params.no_repeat_ngram_size:
        histories = [seq[b, :lengths[b]].tolist() for b in range(len(logits))]
    out[...] = choose(logits, seen, eos, int(step[0]), params, histories)


def append_tokens(history, seq, lengths, next_ids, next_pos, finished, seen, step, chosen, eos):
    """After choose_tokens: history[step, b] = chosen[b] (-2 for a row finished earlier); a live
    row appends its token to seq (B, L), feeds it next (next_ids, next_pos), marks it seen, and
    finishes on an eos id or on -1. Then step[0] += 1."""
    s = int(step[0])
    for b in range(len(chosen)):
        if finished[b]:
            history[s, b] = -2
            continue
        token = int(chosen[b])
        history[s, b] = token
        if token < 0:
            finished[b] = 1
            continue
        n = int(lengths[b])
        seq[b, n], next_ids[b], next_pos[b], lengths[b] = token, token, n, n + 1
        seen[b, token] = 1
        if token in eos:
            finished[b] = 1
    step[0] = s + 1


def beam_select(logits, state, eos, *, params, batch):
    """One beam-search step for `batch` items of params.num_beams rows each (see
    decoding/beam.py reference_step, which this is)."""
    from ..decoding.beam import reference_step
    reference_step(logits, state, np.asarray(eos), params, batch)


class _Ready:
    def __init__(self, array):
        self.array = array

    def wait(self):
        return self.array


class HostSlot:
    """The CUDA backend's reusable host side of a batch in flight; nothing to keep here (copies
    are done when they return)."""

    events = None

    def array(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def record(self):
        pass

    def wait(self):
        pass


def copy_to_host_async(array, slot=None):
    """A copy of array with .wait() -> the host array (here at once; slot unused)."""
    return _Ready(np.array(array))


def gather_rows(out, x, rows):
    """out (N, E) = x[rows]."""
    out[...] = x[rows]


def l2_normalize(out, x):
    """out (B, D) = x / max(||x||, 1e-12), row by row (torch.nn.functional.normalize)."""
    norm = np.sqrt((x.astype(np.float32) ** 2).sum(axis=1, keepdims=True))
    out[...] = x / np.maximum(norm, 1e-12)
