"""The reference backend's runtime: host arrays standing in for device memory, timers, graphs and
host slots with the CUDA backend's interfaces, and the thread pool that runs the element-wise
passes over cache-sized row blocks (NumPy's ufuncs run on one core each and release the GIL)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


STORAGE = {"fp32": np.float32}


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


def upload(*arrays) -> list:
    """Host arrays -> device arrays (here copies)."""
    return [np.array(a) for a in arrays]


def fetch(*arrays) -> list:
    """Device arrays -> new host arrays."""
    return [np.array(a) for a in arrays]


def synchronize():
    pass


def prepare_kernels(files, dtype_name: str, *, head_dims, general=(False,), gelu_product: str | None = None,
                    ln_product: bool = False, rows=None, norm_product=None):
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


def prefetch_l2(arrays, *, rows: int):
    """Nothing here (the CUDA backend's prefetch_l2 asks the L2 to fetch weights ahead of their
    readers)."""


def prefetch_kv(k_cache, v_cache, positions):
    """Nothing here (the CUDA backend's prefetch_kv asks the L2 to fetch a decode step's cached
    keys and values ahead of its attention)."""


def join_beside():
    """Nothing here (the CUDA backend joins the work write_kv_cache(beside=True) branched off)."""


def zero(array):
    array[...] = 0


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
