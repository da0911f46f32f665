"""e4m3 product operands, as kernels_cu/fp8.cu rounds them, and the scaled product."""

from __future__ import annotations

import numpy as np

from ...errors import DeviceError
from .activation import add_bias_gelu
from .norms import add_bias_residual_layernorm


def check_fp8():
    raise DeviceError("dtype fp8 needs a CUDA GPU with FP8 tensor cores; the CPU (NumPy) backend computes in fp32")


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
