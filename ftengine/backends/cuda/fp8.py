"""FP8 (e4m3) products: row quantisation kernels (kernels_cu/fp8.cu) and the scaled cuBLASLt product."""

from __future__ import annotations

import numpy as np

from ...errors import DeviceError
from .activation import _gelu_form
from .gemm import _lt_matmul
from .runtime import _ctype, _device_name, _launch, _row_kernel_shape


FP8_KERNELS = ("quantize_rows", "add_bias_residual_layernorm_quantize", "add_bias_gelu_quantize")  # a block per row
FP8_MIN_CAPABILITY = 89  # e4m3 tensor cores: Ada (8.9), Hopper (9.0) and later


def check_fp8():
    """Refuse dtype fp8 on a GPU without FP8 tensor cores (the current device of this thread)."""
    import cupy
    device = cupy.cuda.Device()
    capability = int(device.compute_capability)
    if capability < FP8_MIN_CAPABILITY:
        name = _device_name(cupy.cuda.runtime.getDeviceProperties(device.id))
        raise DeviceError(f"dtype fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or later); "
                          f"{name} is {capability // 10}.{capability % 10}")


def quantize_rows(q, scales, x):
    """q (rows, H) e4m3 bytes, scales (rows,) float32 = x's rows, each scaled by amax / 448."""
    t, h = x.shape
    vec, items, threads = _row_kernel_shape(x, h)
    _launch("fp8.cu", f"quantize_rows<{_ctype(x)}, {vec}, {items}>", (t,), (threads,), (q, scales, x, np.int32(h)))


def add_bias_residual_layernorm_quantize(out, q, scales, x, bias, residual, gamma, beta, *, eps):
    """add_bias_residual_layernorm, its output also as e4m3 rows (q, scales) for the next product."""
    t, h = out.shape
    vec, items, threads = _row_kernel_shape(out, h)
    _launch("fp8.cu", f"add_bias_residual_layernorm_quantize<{_ctype(out)}, {vec}, {items}>", (t,), (threads,),
            (out, q, scales, x, bias, residual, gamma, beta, np.int32(h), np.float32(eps)))


def add_bias_gelu_quantize(q, scales, x, bias, *, form):
    """q (T, I) e4m3, scales (T,) = GELU(x + bias), quantised per row."""
    t, i = x.shape
    vec, items, threads = _row_kernel_shape(x, i, deep=True)
    _launch("fp8.cu", f"add_bias_gelu_quantize<{_ctype(x)}, {vec}, {items}>", (t,), (threads,),
            (q, scales, x, bias, np.int32(i), np.int32(_gelu_form(form))))


def matmul_fp8(out, x, x_scales, weight, w_scales):
    """out (M, N) = (x_scales[:, None] * x) @ (w_scales[:, None] * weight)^T: e4m3 x (M, K) and
    weight (N, K) with a float32 scale per row, fp32 accumulation (cuBLASLt, outer-vector scales)."""
    _lt_matmul(out, x, weight, scales=(w_scales, x_scales))
