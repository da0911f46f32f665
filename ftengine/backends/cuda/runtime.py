"""The CUDA backend's runtime: each thread's context (stream, cuBLAS handles, device facts), memory
and host transfers, host slots, timers, graph capture and its branches, and the launch helpers
every op family uses.

Every launch goes on one non-blocking stream per thread; GEMMs go through the capture-safe cuBLAS
binding on that stream, so a whole forward pass can be captured as a CUDA graph (GraphCache).
Kernel scalars are wrapped as np.int32 / np.int64 / np.float32. bf16 tensors are stored as uint16
words (NumPy has no bfloat16).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from ...errors import DeviceError
from . import cublas as cb
from . import driver
from .kernels import ARCH_SPECIFIC, CUDA_TYPES, kernel
from .launch import launch_ex


# vector widths (elements) per type, widest first: at most 16 bytes
VECS = {"float": (4, 2, 1), "__half": (8, 4, 2, 1), "__nv_bfloat16": (8, 4, 2, 1)}
ROW_ITEMS = (1, 4)  # vectors per thread in the row (LayerNorm) kernels

# dtype -> activation storage (fp8: fp16 activations, e4m3 product operands)
STORAGE = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "fp8": np.float16}
ROW_THREADS = 256


class _Context:
    def __init__(self):
        import cupy
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.cublas_workspace = cupy.empty((cb.WORKSPACE_BYTES,), dtype=np.uint8)
        self.blas = cb.Cublas(self.stream.ptr, self.cublas_workspace.data.ptr, cb.WORKSPACE_BYTES)
        self.lt = cb.CublasLt(self.stream.ptr, self.cublas_workspace.data.ptr, cb.WORKSPACE_BYTES)
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.sm_count = props["multiProcessorCount"]
        self.l2_bytes = int(props.get("l2CacheSize", 0))
        self.device_name = _device_name(props)
        self.capability = (props["major"], props["minor"])
        # kernels captured into graphs launch with programmatic dependent launch where the GPU has it
        self.dependent_launch = props["major"] >= 9
        self.clusters = props["major"] >= 9  # thread-block clusters, distributed shared memory
        self.wgmma = runs_wgmma()
        self.shared_mem_optin = int(props.get("sharedMemPerBlockOptin", 48 * 1024))
        # the prefetches' branches of a captured graph, and the ends of their launches, which the
        # capture joins before it ends; the ends of work launched beside the capture's stream
        # (write_kv_cache(beside=True)), which join_beside joins
        self.branch_stream = cupy.cuda.Stream(non_blocking=True)
        self.branch_ends = []
        self.beside_ends = []
        self.transfers = None  # upload's and fetch's page-locked buffers (_Transfers), made on first use


def runs_wgmma() -> bool:
    """Whether the current GPU runs the wgmma kernels (attention_sm90.cu, gemm_sm90.cu: their
    architecture alone); without a thread context (prepare_kernels may run on a thread of its own)."""
    import cupy
    capability = cupy.cuda.Device().compute_capability  # e.g. "90"
    return (int(capability[:-1]), int(capability[-1])) == ARCH_SPECIFIC["attention_sm90.cu"][1]


def _device_name(props) -> str:
    return props["name"].decode() if isinstance(props["name"], bytes) else props["name"]


_local = threading.local()


@contextmanager
def planning():
    """While the body runs, ops launch nothing: a new matrix product shape of TRIAL_MIN_ROWS rows
    or more only gets its algorithm chosen, timed on the call's own buffers (its input filled
    with random values, its output overwritten: activations, which the pass that follows computes
    again). A graph is captured after such a pass, since nothing can be timed inside a capture."""
    _local.planning = True
    try:
        yield
    finally:
        _local.planning = False


def _planning() -> bool:
    return getattr(_local, "planning", False)


def context() -> _Context:
    """This thread's stream, cuBLAS handle and workspace. Each thread that drives the GPU
    (an engine's worker, a Generator's worker, a test) gets its own, so two of them never
    share a stream: a graph captured on one cannot swallow another's launches."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        try:
            ctx = _local.ctx = _Context()
        except ImportError as e:
            raise DeviceError(f"the CUDA backend needs CuPy: {e}") from None
    return ctx


def storage_dtype(dtype_name: str):
    return STORAGE[dtype_name]


def empty(shape, dtype):
    cupy = context().cupy
    with context().stream:
        return cupy.empty(shape, dtype=dtype)


def _bf16_words(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


# to_device's float32 staging on the device, in elements: the most device memory a conversion holds
# beside its result
STAGING_ELEMENTS = 1 << 23


def to_device(array, dtype=None):
    """Host array -> device array of storage dtype `dtype` (bf16: uint16 words). float32 going to a
    16-bit type, and the transpose of a contiguous float32 matrix (GPT-2's Conv1D weights, loaded as
    views), are copied as they are and converted or laid out on the device (convert.cu): done on
    the host, the two took most of a second of GPT-2 small's start."""
    dtype = np.dtype(dtype or array.dtype)
    transposed = array.ndim == 2 and array.flags.f_contiguous and not array.flags.c_contiguous
    if array.dtype == np.float32 and array.size and (dtype in (np.float16, np.uint16) or
                                                     (transposed and dtype == np.float32)):
        return _converted(array, dtype, transposed)
    host = _bf16_words(array) if dtype == np.uint16 and array.dtype != np.uint16 else \
        np.ascontiguousarray(array, dtype=dtype)
    out = empty(host.shape, dtype)
    out.set(host, stream=context().stream)
    return out


def _converted(array: np.ndarray, dtype: np.dtype, transposed: bool):
    """to_device's device-side conversion: a transposed matrix whole, anything else in pieces of at
    most STAGING_ELEMENTS through one float32 staging buffer (the stream orders each piece's copy
    after the kernel that read the one before)."""
    stream, name = context().stream, f"convert_rows<{CUDA_TYPES[dtype.name]}>"
    out = empty(array.shape, dtype)
    if transposed:
        staged = empty(array.T.shape, np.float32)
        staged.set(array.T, stream=stream)
        rows, cols = array.shape
        _launch("convert.cu", name, _grid(out.size), (ROW_THREADS,),
                (out, staged, np.int64(rows), np.int64(cols), np.int32(1)))
        return out
    flat, out_flat = array.reshape(-1), out.reshape(-1)
    staged = empty(min(flat.size, STAGING_ELEMENTS), np.float32)
    for at in range(0, flat.size, STAGING_ELEMENTS):
        piece = flat[at:at + STAGING_ELEMENTS]
        staged[:piece.size].set(piece, stream=stream)
        _launch("convert.cu", name, _grid(piece.size), (ROW_THREADS,),
                (out_flat[at:], staged, np.int64(1), np.int64(piece.size), np.int32(0)))
    return out


def _grid(n: int) -> tuple:
    """A grid-stride kernel's blocks for n elements: enough to fill the GPU, no more."""
    return (max(1, min(-(-n // ROW_THREADS), 32 * context().sm_count)),)


def copy_from_host(dst, src):
    """dst (device) = src (host), queued on the stream: a page-locked src must stay unchanged until
    the copy has run (queued keeping the GIL: driver.py); a pageable one is staged before this
    returns. One copy where src already matches dst (CuPy's set() costs a small batch's host 10-20
    us more)."""
    src = np.ascontiguousarray(src, dtype=dst.dtype)
    if src.shape != dst.shape or not dst.flags.c_contiguous:
        dst.set(src, stream=context().stream)  # refuses a shape mismatch
        return
    if src.nbytes and driver.page_locked(src.ctypes.data):
        driver.copy_to_device(dst.data.ptr, src.ctypes.data, src.nbytes, context().stream.ptr)
        return
    runtime = context().cupy.cuda.runtime
    runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, runtime.memcpyHostToDevice, context().stream.ptr)


class _Transfers:
    """A thread's page-locked buffers for upload and fetch, grown as needed, and the events that
    say when the last copy out of (or into) each has run (a query of one never recorded: at once)."""

    ALIGN = 16

    def __init__(self, cupy):
        self.buffers = {"up": None, "down": None}
        self.events = {name: cupy.cuda.Event(block=False, disable_timing=True) for name in self.buffers}

    def place(self, name: str, arrays) -> tuple:
        """(the buffer, each array's byte offset in it), the buffer at least their aligned size,
        free (its last copy waited for)."""
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // self.ALIGN) * self.ALIGN
        wait(self.events[name])
        buffer = self.buffers[name]
        if buffer is None or buffer.size < size:
            buffer = self.buffers[name] = pinned_empty(max(size, 2 * (0 if buffer is None else buffer.size), 4096),
                                                       np.uint8)
        return buffer, offsets

    def recorded(self, name: str):
        driver.record(self.events[name].ptr, context().stream.ptr)


def _transfers() -> _Transfers:
    ctx = context()
    if ctx.transfers is None:
        ctx.transfers = _Transfers(ctx.cupy)
    return ctx.transfers


def upload(*arrays) -> list:
    """Host arrays -> new device arrays, through this thread's page-locked buffer in one copy,
    queued keeping the GIL (driver.py): the calls a thread beside a busy event loop makes."""
    hosts = [np.ascontiguousarray(a) for a in arrays]
    transfers = _transfers()
    buffer, offsets = transfers.place("up", hosts)
    size = offsets[-1] + hosts[-1].nbytes if hosts else 0
    for h, at in zip(hosts, offsets):
        buffer[at:at + h.nbytes] = h.reshape(-1).view(np.uint8)
    device = empty((max(size, 1),), np.uint8)
    if size:
        driver.copy_to_device(device.data.ptr, buffer.ctypes.data, size, context().stream.ptr)
    transfers.recorded("up")
    return [device[at:at + h.nbytes].view(h.dtype).reshape(h.shape) for h, at in zip(hosts, offsets)]


def fetch(*arrays) -> list:
    """Contiguous device arrays -> new host arrays, after the stream's work, through this thread's
    page-locked buffer: the copies queued keeping the GIL (driver.py), one wait."""
    transfers = _transfers()
    buffer, offsets = transfers.place("down", arrays)
    stream = context().stream.ptr
    for a, at in zip(arrays, offsets):
        if a.nbytes:
            driver.copy_to_host(buffer.ctypes.data + at, a.data.ptr, a.nbytes, stream)
    transfers.recorded("down")
    wait(transfers.events["down"])
    return [buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape).copy() for a, at in zip(arrays, offsets)]


def wait(event):
    """Until the work before the event's last record has run: a query first, which keeps the GIL,
    so that work already done costs no hand-over of it (driver.py)."""
    if not driver.done(event.ptr):
        event.synchronize()


def to_host(array):
    """Device -> host float32 (bf16 words widened), after the stream's work is done."""
    host = array.get(stream=context().stream)
    context().stream.synchronize()
    if host.dtype == np.uint16:
        return (host.astype(np.uint32) << 16).view(np.float32)
    return host


def synchronize():
    context().stream.synchronize()


def pinned_empty(shape, dtype):
    """A host array in page-locked memory (from CuPy's pinned pool), so copies can run async.
    (cupyx.empty_pinned does the same, but importing cupyx costs a third of a warm start.)"""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    memory = context().cupy.cuda.alloc_pinned_memory(max(1, math.prod(shape) * dtype.itemsize))
    return np.ndarray(shape, dtype=dtype, buffer=memory)


class DeviceTimer:
    """Device time of the work queued on this thread's stream between creation and stop();
    events: a (start, end) pair to record (a HostSlot's), new ones by default."""

    def __init__(self, events=None):
        cupy = context().cupy
        self._start, self._end = events or (cupy.cuda.Event(), cupy.cuda.Event())
        driver.record(self._start.ptr, context().stream.ptr)

    def stop(self):
        driver.record(self._end.ptr, context().stream.ptr)

    def seconds(self) -> float:
        wait(self._end)
        return context().cupy.cuda.get_elapsed_time(self._start, self._end) / 1e3


class GraphCache:
    """Captured forward passes, keyed by shape, least recently used dropped past `capacity`.
    With enabled=False every call runs the launches directly (for debugging)."""

    def __init__(self, capacity: int = 32, *, enabled: bool = True):
        self.capacity = capacity
        self.enabled = enabled
        self.graphs = OrderedDict()

    def run(self, key, launch):
        ctx = context()
        if not self.enabled:
            launch()
            return
        graph = self.graphs.get(key)
        if graph is None:
            with planning():  # new product shapes' algorithms chosen first: no timing inside a capture
                launch()
            ctx.stream.begin_capture()
            try:
                launch()
            finally:
                join_branches()
                graph = ctx.stream.end_capture()
            self.graphs[key] = graph
            if len(self.graphs) > self.capacity:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        driver.launch_graph(graph.graphExec, ctx.stream.ptr)


def _ctype(a) -> str:
    return CUDA_TYPES[a.dtype.name]


def _launch(file, kname, grid, block, args, shared_mem=0, cluster=None):
    """Launch a kernel on this thread's stream; inside a graph capture on sm_90+, as a programmatic
    dependent launch (scheduled while the kernel before it runs: at that kernel's end, or once it
    has passed its wait where it starts with common.cuh's wait_then_launch_next, as the decode
    step's kernels do), from Python the plain way (CuPy's launch costs the host less) except for the
    ARCH_SPECIFIC files' kernels (they take TensorMaps, by value); with `cluster` (sm_90+), in
    thread-block clusters of those dimensions."""
    if _planning():
        return
    k = kernel(file, kname)
    if shared_mem > 48 * 1024 and k.max_dynamic_shared_size_bytes < shared_mem:
        k.max_dynamic_shared_size_bytes = shared_mem  # opt in past the 48 KiB default, once
    ctx = context()
    dependent = ctx.dependent_launch and ctx.stream.is_capturing()
    if dependent or cluster is not None or file in ARCH_SPECIFIC:
        launch_ex(k, grid, block, args, shared_mem, ctx.stream.ptr, dependent=dependent, cluster=cluster)
        return
    with ctx.stream:
        k(grid, block, args, shared_mem=shared_mem)


def launch_held(file, kname, grid, block, args):
    """Launch a kernel on this thread's stream, not inside a capture, keeping the GIL
    (driver.py): the launches of a thread beside a busy event loop (the GPU tokenizer's)."""
    launch_ex(kernel(file, kname), grid, block, args, 0, context().stream.ptr, dependent=False)


# passes of PREFETCH_ROWS rows (decode steps, short prefills and encoder batches): the runners ask the L2 for the next
# layer's weights as each layer starts (prefetch_l2), unless they come to more than PREFETCH_L2_SHARE of the L2, where
# even a part of them slowed the steps down. (measurements: docs/gpu-internals.md, runtime.py PREFETCH_ROWS,
# PREFETCH_L2_SHARE)
PREFETCH_ROWS, PREFETCH_L2_SHARE = range(2, 129), 1 / 3
PREFETCH_ARRAYS = 4  # prefetch.cu prefetch_l2's arrays a launch

# decode steps of KV_PREFETCH_ROWS rows ask the L2 for the next layer's cached keys and values while a layer runs
# (prefetch_kv), up to KV_PREFETCH_BYTES of them a layer. (measurements: docs/gpu-internals.md, runtime.py
# KV_PREFETCH_ROWS, KV_PREFETCH_BYTES)
KV_PREFETCH_ROWS, KV_PREFETCH_BYTES = range(1, 9), 24 << 20


def prefetch_l2(arrays, *, rows: int):
    """For a pass of `rows` rows in PREFETCH_ROWS, inside a graph capture on sm_90+, and arrays
    that come to PREFETCH_L2_SHARE of the L2 at most: the L2 fetches them (the weights of the
    launches that follow) on a branch of the graph beside those launches, from the point the
    capture has reached; the capture joins the branch before it ends (join_branches). Elsewhere
    nothing: outside a graph the prefetch could not run ahead of the launches it is for."""
    misaligned = [i for i, a in enumerate(arrays) if a.data.ptr % 16]
    if misaligned:
        raise DeviceError(f"prefetch_l2: array {misaligned[0]} does not start on a 16-byte boundary")
    if (not arrays or rows not in PREFETCH_ROWS or not _branching()
            or sum(a.nbytes for a in arrays) > PREFETCH_L2_SHARE * context().l2_bytes):
        return
    fetched = [(a, np.int64(a.nbytes // 16 * 16)) for a in arrays]
    for first in range(0, len(fetched), PREFETCH_ARRAYS):
        pairs = fetched[first:first + PREFETCH_ARRAYS]
        pairs += [(pairs[0][0], np.int64(0))] * (PREFETCH_ARRAYS - len(pairs))
        _on_branch("prefetch.cu", "prefetch_l2", (PREFETCH_ARRAYS,), (32,), tuple(v for pair in pairs for v in pair))


def prefetch_kv(k_cache, v_cache, positions):
    """For a decode step of KV_PREFETCH_ROWS rows (positions.size), inside a graph capture on
    sm_90+: the L2 fetches the keys and values its attention reads (caches (B, H, L, D), positions
    0 .. positions[b] - 1 of the first rows), on a branch beside the launches that follow, unless
    they come to more than KV_PREFETCH_BYTES in all (counted on the device, as the positions grow).
    Elsewhere, or for positions of D not whole 16-byte units, nothing."""
    _, heads, length, d = k_cache.shape
    row_bytes = d * k_cache.itemsize
    if positions.size not in KV_PREFETCH_ROWS or row_bytes % 16 or not _branching():
        return
    _on_branch("prefetch.cu", "prefetch_kv", (positions.size,), (32,),
               (k_cache, v_cache, positions, np.int32(positions.size), np.int32(heads), np.int32(length),
                np.int32(row_bytes), np.int64(KV_PREFETCH_BYTES)))


def _branching() -> bool:
    """Whether a launch may fork a branch: inside a graph capture (not planning) on sm_90+."""
    ctx = context()
    return not _planning() and ctx.dependent_launch and ctx.stream.is_capturing()


def _on_branch(file: str, name: str, grid, block, args, *, beside: bool = False):
    """Launches kernel `name` of `file` on a branch of the graph being captured, forked from the
    point the capture has reached; join_branches joins it, or with beside=True join_beside (which
    join_branches calls too)."""
    ctx = context()
    fork = ctx.cupy.cuda.Event(disable_timing=True)
    fork.record(ctx.stream)
    ctx.branch_stream.wait_event(fork)
    launch_ex(kernel(file, name), grid, block, args, 0, ctx.branch_stream.ptr, dependent=False)
    end = ctx.cupy.cuda.Event(disable_timing=True)
    end.record(ctx.branch_stream)
    (ctx.beside_ends if beside else ctx.branch_ends).append(end)


def join_beside():
    """The capturing stream waits for the work launched beside it (write_kv_cache(beside=True))."""
    ctx = context()
    for end in ctx.beside_ends:
        ctx.stream.wait_event(end)
    ctx.beside_ends.clear()


def join_branches():
    """The capturing stream waits for the ends of every branch it forked (a capture must join
    every stream it forked before it ends)."""
    join_beside()
    ctx = context()
    for end in ctx.branch_ends:
        ctx.stream.wait_event(end)
    ctx.branch_ends.clear()


def vec_width(ctype: str, *lengths) -> int:
    """The widest vector (at most 16 bytes) of CUDA element type ctype that divides every length."""
    return next(v for v in VECS[ctype] if all(n % v == 0 for n in lengths))


def _vec(a, *lengths) -> int:
    return vec_width(_ctype(a), *lengths)


def _threads(n: int, limit: int = 1024) -> int:
    return int(min(limit, max(32, -(-n // 32) * 32)))


def _row_kernel_shape(a, h: int, *, deep: bool = False):
    """(VEC, ITEMS, threads) for a one-block-per-row kernel holding the row in registers: the
    fewest vectors per thread that fit; deep: the most that still leave a warp per row (fewer
    threads a row, so more rows in flight on an SM: add_bias_gelu_quantize over 32,768 x 3,072
    takes 128 us instead of 142 on the H100, bit-identical)."""
    vec = _vec(a, h)
    vectors = h // vec
    fitting = [i for i in ROW_ITEMS if vectors <= 1024 * i]
    if not fitting:
        raise DeviceError(f"row length {h} is too long for the row kernels (at most {1024 * ROW_ITEMS[-1] * vec})")
    items = max((i for i in fitting if vectors >= 32 * i), default=fitting[0]) if deep else fitting[0]
    return vec, items, _threads(-(-vectors // items))


def zero(array):
    if _planning():
        return
    with context().stream:
        array.fill(0)


class HostSlot:
    """The host side of one batch in flight, reused by the batch after it once that one has been
    waited for: a DeviceTimer's events, a page-locked buffer for the results (grown to the largest
    asked for) and the event their copy completes. Creating the events and the buffer per batch
    cost a small batch's host about 25 us."""

    def __init__(self):
        cupy = context().cupy
        self.events = (cupy.cuda.Event(), cupy.cuda.Event())
        self.done = cupy.cuda.Event(block=False, disable_timing=True)
        self._memory = None

    def array(self, shape, dtype) -> np.ndarray:
        """A page-locked host array of this shape and dtype over the slot's buffer."""
        dtype = np.dtype(dtype)
        size = max(1, math.prod(shape) * dtype.itemsize)
        if self._memory is None or self._memory.size < size:
            self._memory = pinned_empty(size, np.uint8)
        return self._memory[:math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)

    def record(self):
        """Mark the work queued on the stream so far (a copy from the slot's buffer) as what wait()
        waits for."""
        driver.record(self.done.ptr, context().stream.ptr)

    def wait(self):
        """Until the work record() last marked has run (at once where none was)."""
        wait(self.done)


class _Pending:
    """A device-to-host copy in flight on the stream; wait() returns the host array."""

    def __init__(self, array, slot=None):
        cupy, stream = context().cupy, context().stream.ptr
        self.host = pinned_empty(array.shape, array.dtype) if slot is None else slot.array(array.shape, array.dtype)
        if array.nbytes:
            driver.copy_to_host(self.host.ctypes.data, array.data.ptr, array.nbytes, stream)
        self.event = cupy.cuda.Event(block=False, disable_timing=True) if slot is None else slot.done
        driver.record(self.event.ptr, stream)

    def wait(self):
        wait(self.event)
        return np.array(self.host)


def copy_to_host_async(array, slot=None):
    """Queue a copy of a contiguous device array to the host behind the stream's work; returns a
    handle whose wait() gives the host array. slot: a HostSlot whose buffer and event the copy
    takes over (the caller has waited for the slot's previous copy)."""
    return _Pending(array, slot)
