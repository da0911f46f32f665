"""Kernel launches through the driver's cuLaunchKernelEx (programmatic dependent launch,
thread-block clusters, cooperative grids), TMA tensor maps, and cluster occupancy, by ctypes."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np


class _AttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes
    _fields_ = [("value", ctypes.c_int), ("dims", ctypes.c_uint * 3), ("align", ctypes.c_uint64),
                ("pad", ctypes.c_char * 64)]


class _Attribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


COOPERATIVE = 2                         # CU_LAUNCH_ATTRIBUTE_COOPERATIVE
CLUSTER_DIMENSION = 4                   # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


@lru_cache(maxsize=None)
def _encode_tensor_map():
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class TensorMap:
    """A CUtensorMap (cuda.h: 128 opaque bytes, 64-byte aligned) of a row-major 2D device array of
    a 16-bit type, for TMA copies of box_cols x box_rows boxes in the 128-byte swizzle (box rows of
    128 bytes at most); a kernel takes it by value (launch_ex). Elements past the array read as
    zeros and are not written. The array's rows must be 16-byte multiples, 16-byte aligned."""

    DATA_TYPES = {"float16": 6, "uint16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16 (bf16 words)
    SWIZZLE_128B, L2_PROMOTION_256B = 3, 3

    def __init__(self, a, box_cols: int, box_rows: int):
        rows, cols = a.shape
        self._buffer = ctypes.create_string_buffer(128 + 64)
        self.address = -(-ctypes.addressof(self._buffer) // 64) * 64
        status = _encode_tensor_map()(self.address, self.DATA_TYPES[a.dtype.name], 2, a.data.ptr,
                                      (ctypes.c_uint64 * 2)(cols, rows), (ctypes.c_uint64 * 1)(a.strides[0]),
                                      (ctypes.c_uint32 * 2)(box_cols, box_rows), (ctypes.c_uint32 * 2)(1, 1), 0,
                                      self.SWIZZLE_128B, self.L2_PROMOTION_256B, 0)
        if status != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for a {rows} x {cols} "
                               f"{a.dtype.name} array, box {box_cols} x {box_rows}")


@lru_cache(maxsize=None)
def _launch_kernel_ex():
    fn = ctypes.PyDLL("libcuda.so.1").cuLaunchKernelEx  # keeps the GIL: the launch returns at once (driver.py)
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@lru_cache(maxsize=None)
def _max_active_clusters():
    fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
    fn.restype = ctypes.c_int
    return fn


def max_active_clusters(k, cluster: int, block: int, shared_mem: int) -> int:
    """How many clusters of `cluster` blocks (of `block` threads and shared_mem bytes of dynamic shared
    memory, which k must already allow) of kernel k the GPU runs at once (cuOccupancyMaxActiveClusters):
    a cluster's blocks share one GPC, so past 2 blocks this can leave SMs idle (H100, one block an SM:
    30 clusters of 4, 39 of 3)."""
    attributes = (_Attribute * 1)()
    attributes[0].id = CLUSTER_DIMENSION
    attributes[0].value.dims[:] = (cluster, 1, 1)
    config = _LaunchConfig((ctypes.c_uint * 3)(cluster, 1, 1), (ctypes.c_uint * 3)(block, 1, 1), shared_mem, None,
                           ctypes.cast(attributes, ctypes.POINTER(_Attribute)), 1)
    count = ctypes.c_int(0)
    status = _max_active_clusters()(ctypes.byref(count), k.kernel.ptr, ctypes.byref(config))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed with CUresult {status}")
    return count.value


def _dims(d) -> tuple:
    d = tuple(d) if isinstance(d, tuple) else (d,)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


def launch_ex(k, grid, block, args, shared_mem: int, stream_ptr: int, *, dependent: bool = True, cluster=None,
              cooperative: bool = False):
    """Launch kernel k (a CuPy RawKernel) on the stream through cuLaunchKernelEx, with
    - dependent: programmatic stream serialization (sm_90+): captured into a graph, it may be
      scheduled while the kernel before it finishes, and waits for that kernel's results in
      wait_for_previous (common.cuh), which every kernel runs first;
    - cluster: thread-block cluster dimensions (sm_90+), which must divide the grid;
    - cooperative: every block of the grid resident at once (a kernel with grid-wide barriers;
      the launch fails where the grid cannot be).
    Arguments as CuPy takes them: device arrays and NumPy scalars; and TensorMaps (by value)."""
    holders, addresses = [], []
    for a in args:
        if isinstance(a, TensorMap):
            holders.append(a)
            addresses.append(a.address)
            continue
        if isinstance(a, np.generic):
            holders.append(_SCALARS[a.dtype](a.item()))
        elif hasattr(a, "data") and hasattr(a.data, "ptr"):
            holders.append(ctypes.c_void_p(a.data.ptr))
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}: pass a device array, a NumPy scalar "
                            f"or a TensorMap")
        addresses.append(ctypes.addressof(holders[-1]))
    params = (ctypes.c_void_p * len(addresses))(*addresses)
    attributes = (_Attribute * 3)()
    count = 0
    if cooperative:
        attributes[count].id = COOPERATIVE
        attributes[count].value.value = 1
        count += 1
    if dependent:
        attributes[count].id = PROGRAMMATIC_STREAM_SERIALIZATION
        attributes[count].value.value = 1
        count += 1
    if cluster is not None:
        attributes[count].id = CLUSTER_DIMENSION
        attributes[count].value.dims[:] = _dims(cluster)
        count += 1
    config = _LaunchConfig((ctypes.c_uint * 3)(*_dims(grid)), (ctypes.c_uint * 3)(*_dims(block)), shared_mem,
                           stream_ptr, ctypes.cast(attributes, ctypes.POINTER(_Attribute)), count)
    status = _launch_kernel_ex()(ctypes.byref(config), k.kernel.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
