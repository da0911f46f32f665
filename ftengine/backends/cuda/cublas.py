"""A capture-safe cuBLAS binding: ctypes calls into the libcublas that CuPy already loaded,
with our own handle bound to our stream and a preallocated workspace.

CuPy's own cuBLAS wrapper refuses any call during CUDA-graph capture (cupy#6290); calling the
library directly does not, provided the handle, stream and workspace are set before capture.
"""

from __future__ import annotations

import ctypes

from ...errors import DeviceError

OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
COMPUTE_32F = 68
GEMM_DEFAULT = -1
# numpy storage dtype name -> cudaDataType
DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "uint16": CUDA_R_16BF}
WORKSPACE_BYTES = 32 << 20  # cuBLAS asks for 32 MiB on Hopper


def _loaded_libcublas() -> str:
    """Path of the libcublas that CuPy's cuBLAS module pulled into this process."""
    import cupy_backends.cuda.libs.cublas  # noqa: F401  (loads libcublas)
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublas.so" in path and "libcublasLt" not in path:
                return path
    raise DeviceError("libcublas is not loaded by CuPy; cannot bind cuBLAS")


class Cublas:
    def __init__(self, stream_ptr: int, workspace_ptr: int, workspace_bytes: int):
        lib = ctypes.CDLL(_loaded_libcublas())
        self._lib = lib
        lib.cublasGetStatusString.restype = ctypes.c_char_p
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasGemmEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32,
                                     vp, vp, i32, i32, i32, i32]
        lib.cublasGemmStridedBatchedEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, i64,
                                                   vp, i32, i32, i64, vp, vp, i32, i32, i64, i32, i32, i32]
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
        self._check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(workspace_ptr),
                                              ctypes.c_size_t(workspace_bytes)), "cublasSetWorkspace")
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)

    def _check(self, status: int, what: str):
        if status != 0:
            text = self._lib.cublasGetStatusString(status).decode()
            raise DeviceError(f"cuBLAS {what} failed: {text} (status {status})")

    def gemm(self, transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, c_type, ldc, alpha=1.0):
        """Column-major C (m, n) = alpha * op(A) op(B); fp32 compute."""
        alpha_c = self._one if alpha == 1.0 else ctypes.c_float(alpha)
        self._check(self._lib.cublasGemmEx(
            self.handle, transa, transb, m, n, k, ctypes.byref(alpha_c), a, a_type, lda, b, b_type, ldb,
            ctypes.byref(self._zero), c, c_type, ldc, COMPUTE_32F, GEMM_DEFAULT), f"GemmEx m={m} n={n} k={k}")

    def gemm_strided_batched(self, transa, transb, m, n, k, a, a_type, lda, stride_a, b, b_type, ldb,
                             stride_b, c, c_type, ldc, stride_c, batch, alpha=1.0):
        alpha_c = self._one if alpha == 1.0 else ctypes.c_float(alpha)
        self._check(self._lib.cublasGemmStridedBatchedEx(
            self.handle, transa, transb, m, n, k, ctypes.byref(alpha_c), a, a_type, lda, stride_a,
            b, b_type, ldb, stride_b, ctypes.byref(self._zero), c, c_type, ldc, stride_c, batch,
            COMPUTE_32F, GEMM_DEFAULT), f"GemmStridedBatchedEx m={m} n={n} k={k} batch={batch}")
