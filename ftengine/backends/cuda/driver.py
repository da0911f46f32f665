"""The asynchronous CUDA calls a thread makes while other threads run Python (a service's engine
and tokenizer threads beside its event loop), through the driver API and ctypes.PyDLL, which keeps
the GIL for the call. CuPy's calls and ctypes.CDLL's give the GIL up, and getting it back waits
until the thread holding it lets go: up to the interpreter's switch interval (5 ms) a call when
that thread is busy (docs/gpu-internals.md, driver.py). Only calls that return at once belong here:
a call that waits for the GPU must give the GIL up."""

from __future__ import annotations

import ctypes
from functools import lru_cache

from ...errors import DeviceError

NOT_READY = 600          # CUDA_ERROR_NOT_READY: cuEventQuery of work not yet done
POINTER_CONTEXT = 1      # CU_POINTER_ATTRIBUTE_CONTEXT: set for page-locked host memory CUDA allocated


@lru_cache(maxsize=None)
def _driver():
    lib = ctypes.PyDLL("libcuda.so.1")
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    for name, args in (("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, pointer, size, pointer]),
                       ("cuMemcpyDtoHAsync_v2", [pointer, ctypes.c_uint64, size, pointer]),
                       ("cuEventRecord", [pointer, pointer]),
                       ("cuEventQuery", [pointer]),
                       ("cuGraphLaunch", [pointer, pointer]),
                       ("cuPointerGetAttribute", [pointer, ctypes.c_int, ctypes.c_uint64])):
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _check(status: int, call: str):
    if status != 0:
        raise DeviceError(f"{call} failed with CUresult {status}")


def copy_to_device(dst: int, src: int, nbytes: int, stream: int):
    """Queue a copy of nbytes from page-locked host memory at src to device memory at dst."""
    _check(_driver().cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def copy_to_host(dst: int, src: int, nbytes: int, stream: int):
    """Queue a copy of nbytes from device memory at src to page-locked host memory at dst (into
    pageable memory the driver would wait for the stream, holding the GIL)."""
    _check(_driver().cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


def record(event: int, stream: int):
    _check(_driver().cuEventRecord(event, stream), "cuEventRecord")


def done(event: int) -> bool:
    """Whether the work before the event's last record has run (at once: no wait)."""
    status = _driver().cuEventQuery(event)
    if status not in (0, NOT_READY):
        _check(status, "cuEventQuery")
    return status == 0


def launch_graph(graph_exec: int, stream: int):
    _check(_driver().cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")


def page_locked(address: int) -> bool:
    """Whether host memory at address was allocated page-locked by CUDA (CuPy's pinned pool)."""
    owner = ctypes.c_void_p()
    return _driver().cuPointerGetAttribute(ctypes.byref(owner), POINTER_CONTEXT, address) == 0
