"""A capture-safe cuBLAS binding: ctypes calls into the libcublas (and libcublasLt) that CuPy
already loaded, with our own handles bound to our stream and a preallocated workspace.

CuPy's own cuBLAS wrapper refuses any call during CUDA-graph capture (cupy#6290); calling the
library directly does not, provided the handle, stream and workspace are set before capture.
"""

from __future__ import annotations

import ctypes

from ...errors import DeviceError

OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 2, 14, 28
COMPUTE_32F = 68
GEMM_DEFAULT = -1
# numpy storage dtype name -> cudaDataType (uint8: e4m3 bytes, the operands of dtype fp8's products)
DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "uint16": CUDA_R_16BF, "uint8": CUDA_R_8F_E4M3}
WORKSPACE_BYTES = 32 << 20  # cuBLAS asks for 32 MiB on Hopper


def _loaded_library(name: str) -> str:
    """Path of the library `name` (libcublas.so, libcublasLt.so) that CuPy's cuBLAS module
    pulled into this process (libcublas loads libcublasLt)."""
    import cupy_backends.cuda.libs.cublas  # noqa: F401  (loads libcublas)
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if f"/{name}" in path:
                return path
    raise DeviceError(f"{name} is not loaded by CuPy; cannot bind cuBLAS")


class Cublas:
    def __init__(self, stream_ptr: int, workspace_ptr: int, workspace_bytes: int):
        lib = ctypes.CDLL(_loaded_library("libcublas.so"))
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


# cuBLASLt (cublasLt.h): matmul descriptor, layout and preference attributes, epilogues
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 17, 18, 31, 32
SCALE_OUTER_VEC_32F = 3  # a float32 scale per row of op(A) and per column of op(B)
PREF_MAX_WORKSPACE_BYTES = 1
EPILOGUES = {"none": 1, "bias": 4, "gelu_bias": 36}  # DEFAULT, BIAS, GELU_BIAS (tanh-form GELU after the bias)
CANDIDATES = 8  # heuristic algorithms kept per shape (bench/results/gemm.md: the best was among the first 8)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


def algo_from_bytes(raw: bytes) -> _Algo | None:
    """An algorithm from its bytes (bytes(algo), as algo_cache.py keeps them); None where they are
    not one's size."""
    return _Algo.from_buffer_copy(raw) if len(raw) == ctypes.sizeof(_Algo) else None


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLt:
    """cuBLASLt matrix products with a fused epilogue (bias, bias + tanh GELU) on our stream and
    workspace; e4m3 operands (A and B both) carry outer-vector scales: D = sa[i] sb[j] (A8 B8)[i, j].
    One plan per shape (descriptor, layouts and up to CANDIDATES algorithms from cuBLASLt's
    heuristic, best guess first), made on first use: planning launches nothing, so it may happen
    inside a graph capture. Which candidate runs is the caller's choice (ops.py
    times them once per shape), the heuristic's first by default."""

    def __init__(self, stream_ptr: int, workspace_ptr: int, workspace_bytes: int):
        lib = ctypes.CDLL(_loaded_library("libcublasLt.so"))
        self._lib = lib
        vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i32, i32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, u64, u64, i64]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_Heuristic),
                                                       ctypes.POINTER(i32)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz,
                                       vp]
        lib.cublasLtMatmulAlgoCheck.argtypes = [vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo),
                                                ctypes.POINTER(_Heuristic)]
        lib.cublasLtGetVersion.restype = sz
        self.version = int(lib.cublasLtGetVersion())
        self.handle = vp()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._stream = vp(stream_ptr)
        self._workspace, self._workspace_bytes = vp(workspace_ptr), workspace_bytes
        self._pref = vp()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self._pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(workspace_bytes)
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(self._pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                             ctypes.sizeof(limit)), "preference")
        self._plans = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _check(self, status: int, what: str):
        if status != 0:
            get = getattr(self._lib, "cublasLtGetStatusString", None)
            text = ""
            if get is not None:
                get.restype = ctypes.c_char_p
                text = get(status).decode() + " "
            raise DeviceError(f"cuBLASLt {what} failed: {text}(status {status})")

    def _set(self, desc, attr: int, value):
        self._check(self._lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    f"descriptor attribute {attr}")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        self._check(self._lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "layout")
        return layout

    def candidates(self, key) -> list:
        """The plan's algorithms for a key (transa, transb, m, n, k, a_type, lda, b_type, ldb,
        c_type, ldc, epilogue), the heuristic's best guess first."""
        return self._plan(key)[4]

    def supports(self, key, algo: _Algo) -> bool:
        """Whether `algo` (chosen for another shape) runs the product of plan key `key`, within our
        workspace (cublasLtMatmulAlgoCheck)."""
        desc, a, b, c, _ = self._plan(key)
        result = _Heuristic()
        status = self._lib.cublasLtMatmulAlgoCheck(self.handle, desc, a, b, c, c, ctypes.byref(algo),
                                                   ctypes.byref(result))
        return status == 0 and result.workspace_size <= self._workspace_bytes

    def _plan(self, key):
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._heuristics(key, CANDIDATES)
        return plan

    def _heuristics(self, key, count: int) -> tuple:
        """(descriptor, A, B, C layouts, the algorithms of up to `count` heuristic results, best first)."""
        transa, transb, m, n, k, a_type, lda, b_type, ldb, c_type, ldc, epilogue = key
        desc = ctypes.c_void_p()
        self._check(self._lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, CUDA_R_32F), "descriptor")
        self._set(desc, DESC_TRANSA, ctypes.c_int32(transa))
        self._set(desc, DESC_TRANSB, ctypes.c_int32(transb))
        self._set(desc, DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[epilogue]))
        if epilogue != "none":  # the heuristic reads the bias pointer's alignment: any 256-byte aligned one
            self._set(desc, DESC_BIAS_POINTER, ctypes.c_void_p(256))
        if a_type == CUDA_R_8F_E4M3:
            for mode, pointer in ((DESC_A_SCALE_MODE, DESC_A_SCALE_POINTER), (DESC_B_SCALE_MODE, DESC_B_SCALE_POINTER)):
                self._set(desc, mode, ctypes.c_int32(SCALE_OUTER_VEC_32F))
                self._set(desc, pointer, ctypes.c_void_p(256))
        a = self._layout(a_type, *((k, m) if transa == OP_T else (m, k)), lda)
        b = self._layout(b_type, *((n, k) if transb == OP_T else (k, n)), ldb)
        c = self._layout(c_type, m, n, ldc)
        found, returned = (_Heuristic * count)(), ctypes.c_int(0)
        self._check(self._lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, self._pref, count,
                                                             found, ctypes.byref(returned)),
                    f"heuristic m={m} n={n} k={k} epilogue={epilogue}")
        if returned.value < 1:
            raise DeviceError(f"cuBLASLt has no algorithm for m={m} n={n} k={k} with epilogue {epilogue}")
        return desc, a, b, c, [_Algo.from_buffer_copy(r.algo) for r in list(found)[:returned.value]]

    def matmul(self, transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, c_type, ldc, *,
               epilogue: str = "none", bias: int = 0, scales: tuple = (), algo: _Algo | None = None):
        """Column-major C (m, n) = epilogue(op(A) op(B) [+ bias (m,)]); fp32 compute. Pointers
        must be 256-byte aligned (every workspace entry and device array is). e4m3 A and B:
        `scales` = pointers to their float32 scales (m,) and (n,). `algo`: one of the plan's
        candidates (default: the heuristic's first)."""
        desc, la, lb, lc, candidates = self._plan((transa, transb, m, n, k, a_type, lda, b_type, ldb, c_type, ldc,
                                                   epilogue))
        algo = candidates[0] if algo is None else algo
        if epilogue != "none":
            self._set(desc, DESC_BIAS_POINTER, ctypes.c_void_p(bias))
        if a_type == CUDA_R_8F_E4M3:
            self._set(desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(scales[0]))
            self._set(desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(scales[1]))
        self._check(self._lib.cublasLtMatmul(self.handle, desc, ctypes.byref(self._one), a, la, b, lb,
                                             ctypes.byref(self._zero), c, lc, c, lc, ctypes.byref(algo),
                                             self._workspace, self._workspace_bytes, self._stream),
                    f"matmul m={m} n={n} k={k} epilogue={epilogue}")
