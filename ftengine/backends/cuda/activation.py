"""Launchers of kernels_cu/activation.cu: bias + GELU and gated GELU (GeGLU) passes."""

from __future__ import annotations

import numpy as np

from .runtime import _ctype, _launch, _threads, _vec

# activation.cu add_bias_act's codes
ACTIVATIONS = {"identity": 0, "tanh": 1, "relu": 2, "gelu": 3, "silu": 4}


GELU_ROWS = 4                     # activation.cu add_bias_gelu: rows per block
# add_bias_act: columns per block, 4 a thread (measurements: docs/gpu-internals.md, gemm.py matmul_bias_act)
ACT_COLUMNS = 1024
GELU_FORMS = {"erf": 0, "tanh": 1}


def _gelu_form(form: str) -> int:
    """The kernels' code for a GELU form; an unknown one is refused."""
    if form not in GELU_FORMS:
        raise ValueError(f"unknown GELU form {form!r}")
    return GELU_FORMS[form]


def gated_gelu(out, x, bias, *, form):
    """GeGLU: out (T, I) = GELU(x[:, :I] + bias[:I]) * (x[:, I:] + bias[I:]); one block per row,
    VEC columns per thread at a time."""
    t, i = out.shape
    code = _gelu_form(form)
    vec = _vec(out, i)
    _launch("activation.cu", f"gated_gelu<{_ctype(out)}, {vec}>", (t,), (_threads(i // vec, 256),),
            (out, x, bias, np.int32(i), np.int32(code)))


def add_bias_gelu(out, x, bias, *, form):
    """out (T, I) = GELU(x + bias), GELU_ROWS rows per block."""
    t, i = out.shape
    code = _gelu_form(form)
    vec = _vec(out, i)
    _launch("activation.cu", f"add_bias_gelu<{_ctype(out)}, {vec}>", (-(-t // GELU_ROWS),), (_threads(i // vec),),
            (out, x, bias, np.int32(i), np.int32(t), np.int32(code)))


def add_bias_act(out, x, bias, *, act):
    """out (T, N) = act(x + bias) for act in ACTIVATIONS, a block per ACT_COLUMNS columns of a row;
    out may alias x."""
    t, n = out.shape
    _launch("activation.cu", f"add_bias_act<{_ctype(out)}>", (t, -(-n // ACT_COLUMNS)), (_threads(n, 256),),
            (out, x, bias, np.int32(n), np.int32(ACTIVATIONS[act]), np.int32(0), bias, bias, np.float32(0.0)))
