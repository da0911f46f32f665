"""Matrix products (float64 accumulation where the CUDA backend accumulates in float32), the head
layers' dense + activation, and the products followed by residual + LayerNorm."""

from __future__ import annotations

import numpy as np

from .activation import activate, add_bias_gelu
from .norms import _layernorm, add_bias_residual_layernorm, residual_layernorm
from .runtime import _WORKERS, PARALLEL_WORK, _one_blas_thread, _threads


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


def matmul_bias_act(out, x, weight, bias, *, act):
    """out (M, N) = act(x @ weight^T + bias), act identity, relu or silu."""
    matmul(out, x, weight)
    out[...] = activate(out + bias, act)


def batched_matmul(out, a, b, *, transpose_b, alpha=1.0):
    """out (N, M, P) = alpha * a (N, M, K) @ b (N, K, P), or b^T when b is (N, P, K)."""
    out[...] = alpha * np.matmul(a, b.transpose(0, 2, 1) if transpose_b else b)


def dense(out, x, weight, bias, *, activation, norm=()):
    """out (M, N) = activation(x @ weight^T + bias), then LayerNorm with norm = (gamma, beta,
    eps) if given: a layer of the head after pooling."""
    y = activate(x @ weight.T + bias, activation)
    out[...] = _layernorm(y, *norm) if norm else y


def partials_size(rows: int, n: int) -> int:
    """0: matmul_residual_layernorm and matmul_bias_residual_layernorm split no product here."""
    return 0


def matmul_residual_layernorm(hidden, normed, x, weight, bias, gamma, beta, *, eps, product, partials, rms=False):
    """hidden += x @ weight^T + bias; normed = LayerNorm(hidden) (rms: T5's RMS norm), the product
    through `product` (`partials` unused: see partials_size)."""
    matmul(product, x, weight)
    residual_layernorm(hidden, normed, product, bias, gamma, beta, eps=eps, rms=rms)


# the CUDA backend's gemm.NORM_PROLOGUE_ROWS: model code leaves a residual + LayerNorm to the product after it for
# passes of this many rows or fewer (norm_product, norm_matmul), on either backend, so both run one sequence of ops
NORM_PROLOGUE_ROWS = 4


def norm_product(product, partials, x, weight):
    """x @ weight^T into `product`, returned, for a residual + LayerNorm to read (`partials` unused:
    see partials_size)."""
    matmul(product, x, weight)
    return product


def norm_matmul(out, weight, bias=None, *, act=None, form="erf", parts, res_bias, hidden, hidden_out, normed,
                gamma, beta, eps, rms=False, post=False):
    """The residual + LayerNorm that norm_product's `parts` left pending, then the product that reads
    its output. Pre-LayerNorm (post False): hidden_out = hidden + parts + res_bias, x = normed =
    LayerNorm(hidden_out) (rms: T5's RMS norm); post: x = hidden_out = LayerNorm(parts + res_bias +
    hidden). out = x @ weight^T (act None), act(... + bias) (matmul_bias_act's acts) or GELU(... +
    bias) of `form`. Returns the array that holds the residual stream: hidden_out (the CUDA backend
    may leave it in hidden instead, and return that)."""
    if post:
        add_bias_residual_layernorm(hidden_out, parts, res_bias, hidden, gamma, beta, eps=eps)
        x = hidden_out
    else:
        hidden_out[...] = hidden
        residual_layernorm(hidden_out, normed, parts, res_bias, gamma, beta, eps=eps, rms=rms)
        x = normed
    matmul_act(out, x, weight, bias, act=act, form=form)
    return hidden_out


def matmul_act(out, x, weight, bias=None, *, act=None, form="erf"):
    """out = x @ weight^T (act None), GELU(... + bias) of `form` (act "gelu"), or act(... + bias)
    for matmul_bias_act's acts."""
    if act is None:
        matmul(out, x, weight)
    elif act == "gelu":
        matmul_bias_gelu(out, x, weight, bias, form=form)
    else:
        matmul_bias_act(out, x, weight, bias, act=act)


def matmul_bias_residual_layernorm(out, x, weight, bias, residual, gamma, beta, *, eps, product, partials):
    """out = LayerNorm(x @ weight^T + bias + residual), the product through `product` (`partials`
    unused: see partials_size). out may alias residual."""
    matmul(product, x, weight)
    add_bias_residual_layernorm(out, product, bias, residual, gamma, beta, eps=eps)
