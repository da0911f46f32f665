"""GELU (erf and tanh forms), bias + GELU and gated GELU: kernels_cu/activation.cu's twins."""

from __future__ import annotations

import math

import numpy as np

from .runtime import _by_row_blocks


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


def gated_gelu(out, x, bias, *, form):
    """GeGLU: out (T, I) = GELU(x[:, :I] + bias[:I]) * (x[:, I:] + bias[I:]), x (T, 2I)."""
    i = out.shape[1]

    def block(lo, hi):
        y = x[lo:hi] + bias
        _gelu_block(out[lo:hi], y[:, :i], form)
        out[lo:hi] *= y[:, i:]
    _by_row_blocks(block, out.shape[0], 2 * i)


def add_bias_gelu(out, x, bias, *, form):
    """out (T, I) = GELU(x + bias), erf or tanh form. out may alias x."""
    def block(lo, hi):
        y = x[lo:hi] + bias
        _gelu_block(out[lo:hi], y, form)
    _by_row_blocks(block, out.shape[0], out.shape[1])


def activate(y, act: str):
    """act(y) for the activations of activation.cu add_bias_act: identity, tanh, relu, gelu (erf), silu."""
    if act == "tanh":
        return np.tanh(y)
    if act == "relu":
        return np.maximum(y, np.float32(0.0))
    if act == "gelu":
        return _gelu(y, "erf")
    if act == "silu":
        return y / (np.float32(1.0) + np.exp(-y))
    if act != "identity":
        raise ValueError(f"unknown activation {act!r}")
    return y


def add_bias_act(out, x, bias, *, act):
    """out (T, N) = act(x + bias); out may alias x."""
    out[...] = activate(x + bias, act)
