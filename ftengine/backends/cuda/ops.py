"""CUDA launchers: the same op names and signatures as backends/numpy_ops.py.

Every launch goes on one non-blocking stream owned by this module; GEMMs go through the
capture-safe cuBLAS binding on that stream, so a whole forward pass can be captured as a
CUDA graph (GraphCache). Kernel scalars are wrapped as np.int32 / np.int64 / np.float32.
bf16 tensors are stored as uint16 words (NumPy has no bfloat16).
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from ...errors import DeviceError
from . import cublas as cb
from .algo_cache import AlgoCache, cache_folder, key_text
from .kernels import (ARCH_SPECIFIC, ATTENTION_FLAGS, ATTENTION_MANY_BLOCKS, ATTENTION_THREADS, BLAS_SPLIT_MIN_K,
                      BLAS_SPLIT_MIN_ROWS, BLAS_SPLIT_OUTPUTS, CHOICE_BINS, CHOICE_SLICES_MAX, CHOICE_SLICE_MIN,
                      CHOICE_STATE_WORDS, CHOICE_THREADS, CUDA_TYPES, GELU_ROWS, GEMM_BK, GEMM_THREADS, GEMV_COLS,
                      GEMV_ROWS, GEMV_THREADS, GEMV_WIDE_BLOCKS_PER_SM, LN_CLUSTER_MAX, LN_ROW_WARPS, LN_WARP_MAX_ROWS,
                      LN_WARP_MIN_ROWS, POOL_WARPS, POOL_WARPS_PER_SM, ROW_ITEMS, ROW_WARP_ITEMS, SAMPLE_CANDIDATES,
                      SAMPLE_CLUSTER_MAX, SAMPLE_HIST_WORDS, SAMPLE_SLICE_MAX, SAMPLE_THREADS, SKINNY_MIN_COLUMNS,
                      SKINNY_MIN_ROWS, SKINNY_ROWS, SKINNY_SPLITS, SKINNY_TILES, SOFTMAX_PER_LANE, SOFTMAX_VEC,
                      SPLIT_MIN_ROWS, SPLIT_SLICE_K, SPLIT_TILES, VARLEN_BLOCK_M, VARLEN_HEAD_DIMS, VARLEN_TILES,
                      VARLEN_WG_BLOCK_M, VARLEN_WG_HEAD_DIMS, VARLEN_WG_KN, VARLEN_WG_TMA_MIN_SEQ, VECS,
                      WGMMA_GELU_MIN_OUTPUTS, WGMMA_LN_MIN_ROWS, WGMMA_LN_TILE, WGMMA_NARROW_MAX_K,
                      WGMMA_NARROW_TILES_PER_SM, WGMMA_SPLIT_ROWS,
                      ArchKernel, TensorMap, kernel, kernel_cache_dir, launch_ex, max_active_clusters, prepare,
                      skinny_name, varlen_mma_name, wgmma_ln_name, wgmma_name, wgmma_shared_mem, wgmma_tiles,
                      wgmma_x_rows)

name = "cuda"
# dtype -> activation storage (fp8: fp16 activations, e4m3 product operands)
STORAGE = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "fp8": np.float16}
POOL_CODES = {"cls": 0, "max": 1, "mean": 2, "mean_sqrt_len": 3, "lasttoken": 4, "weightedmean": 5}
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
        self.device_name = _device_name(props)
        self.capability = (props["major"], props["minor"])
        # kernels captured into graphs launch with programmatic dependent launch where the GPU has it
        self.dependent_launch = props["major"] >= 9
        self.clusters = props["major"] >= 9  # thread-block clusters, distributed shared memory
        # the wgmma kernels (attention_sm90.cu, gemm_sm90.cu) run on their architecture alone
        self.wgmma = (props["major"], props["minor"]) == ARCH_SPECIFIC["attention_sm90.cu"][1]
        self.shared_mem_optin = int(props.get("sharedMemPerBlockOptin", 48 * 1024))
        # the prefetches' branches of a captured graph, and the ends of their launches, which the
        # capture joins before it ends; the ends of work launched beside the capture's stream
        # (write_kv_cache(beside=True)), which join_beside joins
        self.branch_stream = cupy.cuda.Stream(non_blocking=True)
        self.branch_ends = []
        self.beside_ends = []


def _device_name(props) -> str:
    return props["name"].decode() if isinstance(props["name"], bytes) else props["name"]


_local = threading.local()
# the cuBLASLt algorithm each product shape runs, chosen once per process and shared by every
# thread (so two engines compute a shape with the same algorithm, bit for bit): plan key -> algo;
# and per row bucket (rows up to the next power of two, the other dimensions the same) the algorithm
# timed fastest for the first shape of that bucket, which later shapes of it reuse where cuBLASLt
# accepts it (a batch's padded shapes are many, their trials would cost more than they gain). Both
# are kept on disk for later processes (algo_cache.py, _earlier_algo).
_ALGOS = {}
_BUCKET_ALGOS = {}
_ALGOS_LOCK = threading.Lock()
TRIAL_REPEATS = 10  # products per timed graph of each candidate algorithm
# products of fewer rows run cuBLASLt's heuristic's first algorithm untimed. The best of its candidates
# gained up to 19% at 32,768 rows and 3-8% at 4,096 (BERT-base's 32 x 128 tokens: QKV 23.6 -> 22.5 us,
# attention output 9.5 -> 8.9, bench/results/gemm.md 2026-11-25); at 128 rows 0-10% of 3.4-6.6 us,
# about the noise of a trial's 10 products there
TRIAL_MIN_ROWS = 4096


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


def prepare_kernels(files, dtype_name: str, *, head_dim: int, gelu_product: str | None = None,
                    ln_product: bool = False):
    """Compile the kernel modules a runner needs for one dtype (and the shared ones), in
    parallel, before its first launch; where the GPU runs the wgmma kernels (fp16, bf16), with
    the wgmma attention beside the fused attention if the model's head_dim is the one it takes,
    and with the wgmma products where the runner's matmul_bias_gelu calls take the erf form
    (gelu_product: that form, None for a runner that makes no such call) or where it calls
    matmul_bias_residual_layernorm (ln_product)."""
    if dtype_name in ("fp16", "bf16") and context().wgmma:
        if "attention_varlen.cu" in files and head_dim in VARLEN_WG_HEAD_DIMS:
            files = (*files, "attention_sm90.cu")
        if gelu_product == "erf" or ln_product:
            files = (*files, "gemm_sm90.cu")
    prepare(files, (CUDA_TYPES[np.dtype(STORAGE[dtype_name]).name],))


# ------------------------------------------------------------------ memory

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


def to_device(array, dtype=None):
    """Host array -> device array of storage dtype `dtype` (bf16: uint16 words)."""
    dtype = np.dtype(dtype or array.dtype)
    host = _bf16_words(array) if dtype == np.uint16 and array.dtype != np.uint16 else \
        np.ascontiguousarray(array, dtype=dtype)
    out = empty(host.shape, dtype)
    out.set(host, stream=context().stream)
    return out


def copy_from_host(dst, src):
    """dst (device) = src (host), queued on the stream: a page-locked src must stay unchanged until
    the copy has run; a pageable one is staged before this returns. One cudaMemcpyAsync where src
    already matches dst (CuPy's set() costs a small batch's host 10-20 us more)."""
    src = np.ascontiguousarray(src, dtype=dst.dtype)
    if src.shape != dst.shape or not dst.flags.c_contiguous:
        dst.set(src, stream=context().stream)  # refuses a shape mismatch
        return
    runtime = context().cupy.cuda.runtime
    runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, runtime.memcpyHostToDevice, context().stream.ptr)


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
        self._start.record(context().stream)

    def stop(self):
        self._end.record(context().stream)

    def seconds(self) -> float:
        self._end.synchronize()
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
        graph.launch(stream=ctx.stream)


# ------------------------------------------------------------------ launch helpers

def _ctype(a) -> str:
    return CUDA_TYPES[a.dtype.name]


def _launch(file, kname, grid, block, args, shared_mem=0, cluster=None):
    """Launch a kernel on this thread's stream; inside a graph capture on sm_90+, as a programmatic
    dependent launch (scheduled while the kernel before it runs: at that kernel's end, or once it
    has passed its wait where it starts with common.cuh's wait_then_launch_next, as the decode
    step's kernels do), from Python the plain way (CuPy's launch costs the host less); with
    `cluster` (sm_90+), in thread-block clusters of those dimensions."""
    if _planning():
        return
    k = kernel(file, kname)
    if shared_mem > 48 * 1024 and k.max_dynamic_shared_size_bytes < shared_mem:
        k.max_dynamic_shared_size_bytes = shared_mem  # opt in past the 48 KiB default, once
    ctx = context()
    dependent = ctx.dependent_launch and ctx.stream.is_capturing()
    if dependent or cluster is not None or isinstance(k, ArchKernel):
        launch_ex(k, grid, block, args, shared_mem, ctx.stream.ptr, dependent=dependent, cluster=cluster)
        return
    with ctx.stream:
        k(grid, block, args, shared_mem=shared_mem)


# passes of PREFETCH_ROWS rows (decode steps, short prefills and encoder batches): the runners ask
# the L2 for the next layer's weights as each layer starts (prefetch_l2). H100, fp16, captured
# passes replayed: GPT-2 small's decode step at 2 rows 294.6 -> 287.4 us, 4 rows 343.5 -> 331.8,
# 32 rows 417 -> 393, 64 rows 542 -> 532, 128 rows 650 -> 646, a 2 x 8 prefill 0.449 -> 0.423 ms;
# BERT-base 1 x 16 0.426 -> 0.393 ms, 1 x 128 0.432 -> 0.403, 2 x 64 0.419 -> 0.390. Not at 1 row
# (272.4 us either way; on an H200 252.5 -> 269), nor from 256 rows on, where it gained nothing
# (BERT-base 1 x 256, 4 x 128) or competed with the products: GPT-2 prefill 1 x 512 0.583 -> 0.606
# ms, 32 x 128 2.11 -> 2.27
PREFETCH_ROWS = range(2, 129)
# decode steps of KV_PREFETCH_ROWS rows ask the L2 for the next layer's cached keys and values while
# a layer runs (prefetch_kv), up to KV_PREFETCH_BYTES of them a layer. H100, GPT-2 small fp16 decode
# step replayed, 32 / 96 / 160 positions cached: 1 row 271.1 -> 269.8, 283.4 -> 277.3, 304.6 ->
# 293.9 us; 4 rows 333.2 -> 332.2, 346.2 -> 339.8, 367.2 -> 355.7; 8 rows (96) 352.2 -> 347.7. Not
# from 16 rows on, where it competed with the products: 16 rows 378.0 -> 383.2, 32 rows 434.7 ->
# 438.3, 64 rows 632.2 -> 634.9
KV_PREFETCH_ROWS, KV_PREFETCH_BYTES = range(1, 9), 24 << 20


def prefetch_l2(arrays, *, rows: int):
    """For a pass of `rows` rows in PREFETCH_ROWS, inside a graph capture on sm_90+: the L2
    fetches up to four arrays (the weights of the launches that follow) on a branch of the graph
    beside those launches, from the point the capture has reached; the capture joins the branch
    before it ends (join_branches). Elsewhere nothing: outside a graph the prefetch could not run
    ahead of the launches it is for."""
    if len(arrays) > 4:
        raise DeviceError(f"prefetch_l2 takes at most 4 arrays, got {len(arrays)}")
    misaligned = [i for i, a in enumerate(arrays) if a.data.ptr % 16]
    if misaligned:
        raise DeviceError(f"prefetch_l2: array {misaligned[0]} does not start on a 16-byte boundary")
    if not arrays or rows not in PREFETCH_ROWS or not _branching():
        return
    pairs = [(a, a.nbytes // 16 * 16) for a in arrays] + [(arrays[0], 0)] * (4 - len(arrays))
    _on_branch("gemv.cu", "prefetch_l2", (4,), (32,), tuple(v for a, n in pairs for v in (a, np.int64(n))))


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
    _on_branch("gemv.cu", "prefetch_kv", (positions.size,), (32,),
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


def _vec(a, *widths) -> int:
    """The widest vector (at most 16 bytes) of a's element type that divides every width."""
    return next(v for v in VECS[_ctype(a)] if all(w % v == 0 for w in widths))


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


# ------------------------------------------------------------------ ops

def embed_layernorm(out, ids, token_types, positions, word_emb, pos_emb, type_emb, gamma, beta, *, eps):
    t, h = out.shape
    vec, items, threads = _row_kernel_shape(out, h)
    _launch("embedding.cu", f"embed_layernorm<{_ctype(out)}, {vec}, {items}>", (t,), (threads,),
            (out, ids, token_types, positions, word_emb, pos_emb, type_emb, gamma, beta,
             np.int32(h), np.float32(eps)))


GELU_FORMS = {"erf": 0, "tanh": 1}


def _gelu_form(form: str) -> int:
    """The kernels' code for a GELU form; an unknown one is refused."""
    if form not in GELU_FORMS:
        raise ValueError(f"unknown GELU form {form!r}")
    return GELU_FORMS[form]


def _gemv_args(out, x, weight, bias, epilogue) -> tuple:
    """gemv.cu's arguments (gemv and skinny_mma): out, x, weight, the bias (the weight where there is
    none: never read), M, N, K, the epilogue."""
    (m, k), n = x.shape, weight.shape[0]
    return (out, x, weight, weight if bias is None else bias, np.int32(m), np.int32(n), np.int32(k),
            np.int32(epilogue))


def _gemv(out, x, weight, bias, epilogue, cols=None):
    """gemv.cu gemv, `cols` output columns a block (a GEMV_COLS entry): by default the wide one where
    it still gives every SM GEMV_WIDE_BLOCKS_PER_SM blocks, else the narrow one."""
    k, n = x.shape[1], weight.shape[0]
    if cols is None:
        narrow, wide = GEMV_COLS
        cols = wide if n >= wide * GEMV_WIDE_BLOCKS_PER_SM * context().sm_count else narrow
    _launch("gemv.cu", f"gemv<{_ctype(x)}, {_ctype(out)}, {_vec(x, k)}, {cols}>", (-(-n // cols),), (GEMV_THREADS,),
            _gemv_args(out, x, weight, bias, epilogue))


def _skinny_operands(x, weight) -> bool:
    """Whether the skinny kernel reads x and weight: 16-bit, of one dtype, 16-byte aligned."""
    return (x.dtype != np.float32 and weight.dtype == x.dtype and x.data.ptr % 16 == 0
            and weight.data.ptr % 16 == 0)


def _skinny_fits(x, weight) -> bool:
    """Whether x @ weight^T goes to the tensor-core skinny kernel: SKINNY_MIN_ROWS .. SKINNY_ROWS
    rows, SKINNY_MIN_COLUMNS output columns or more, K a multiple of 32, operands it reads."""
    m, k = x.shape
    return (SKINNY_MIN_ROWS <= m <= SKINNY_ROWS and weight.shape[0] >= SKINNY_MIN_COLUMNS and k % 32 == 0
            and _skinny_operands(x, weight))


def _skinny(out, x, weight, bias, epilogue, *, table=SKINNY_TILES, splits=1):
    """gemv.cu skinny_mma with the tiles `table` lists for x's rows; splits > 1: K in that many
    slices over the grid's rows, out (splits, M, N) their float partial sums."""
    tiles = table[min(r for r in table if r >= x.shape[0])]
    _launch("gemv.cu", skinny_name(_ctype(x), _ctype(out), tiles), (-(-weight.shape[0] // (16 * tiles[0])), splits),
            (32 * tiles[1],), _gemv_args(out, x, weight, bias, epilogue))


def matmul(out, x, weight):
    """out (M, N) = x (M, K) @ weight (N, K)^T; out may be float32 while x and weight are 16-bit
    (the LM head's logits). A few rows of x against many columns (an LM head at batch 4-32): the
    tensor-core skinny kernel (gemv.cu); else up to GEMV_ROWS rows: the weight-streaming kernel
    (gemv.cu); more: cuBLASLt, column-major: out^T = op_T(W^T) @ x^T."""
    if _skinny_fits(x, weight):
        _skinny(out, x, weight, None, 0)
    elif x.shape[0] <= GEMV_ROWS:
        _gemv(out, x, weight, None, 0)
    else:
        _lt_matmul(out, x, weight)


def _lt_aligned(*arrays) -> bool:
    """Whether every array starts on a 256-byte boundary, as cuBLASLt's plans assume."""
    return all(a.data.ptr % 256 == 0 for a in arrays)


def _lt_matmul(out, x, weight, bias=None, epilogue="none", scales=()):
    """out = epilogue(x @ weight^T [+ bias]) through cuBLASLt, from TRIAL_MIN_ROWS rows on with the
    algorithm timed fastest for the first shape of its row bucket (chosen on its first call outside
    a capture; the heuristic's first inside one, and for fewer rows);
    cuBLAS's GemmEx (no epilogue) for operands not 256-byte aligned, which cuBLASLt's plans assume.
    e4m3 x and weight: scales = (weight's per row, x's per row), float32."""
    m, k = x.shape
    n = weight.shape[0]
    types = [cb.DATA_TYPES[a.dtype.name] for a in (weight, x, out)]
    pointers = [a.data.ptr for a in (weight, x, out)]
    ctx = context()
    if not _lt_aligned(weight, x, out, *([bias] if bias is not None else []), *scales):
        if epilogue != "none" or scales:
            raise DeviceError("a fused cuBLASLt epilogue or an fp8 product needs 256-byte aligned operands")
        if not _planning():
            with ctx.stream:
                ctx.blas.gemm(cb.OP_T, cb.OP_N, n, m, k, pointers[0], types[0], k, pointers[1], types[1], k,
                              pointers[2], types[2], n)
        return
    key = (cb.OP_T, cb.OP_N, n, m, k, types[0], k, types[1], k, types[2], n, epilogue)

    def product(algo):
        ctx.lt.matmul(*key[:5], pointers[0], types[0], k, pointers[1], types[1], k, pointers[2], types[2], n,
                      epilogue=epilogue, bias=0 if bias is None else bias.data.ptr,
                      scales=tuple(a.data.ptr for a in scales), algo=algo)
    with ctx.stream:
        algo = _ALGOS.get(key)
        if algo is None and m >= TRIAL_MIN_ROWS and not ctx.stream.is_capturing():
            algo = _earlier_algo(ctx, key)
            if algo is None:
                if _planning():  # x holds what the skipped launches left (zeros in a new workspace): time on real-like values
                    _fill_random(x)
                algo = _choose_algo(ctx, key, product)
        if not _planning():
            product(algo)


def _fill_random(a):
    """a = standard normal values in its storage type (bf16 words truncated from float32)."""
    cupy = context().cupy
    values = cupy.random.standard_normal(a.shape, dtype=np.float32)
    a[...] = (values.view(np.uint32) >> 16).astype(np.uint16) if a.dtype == np.uint16 else values.astype(a.dtype)


def _row_bucket(key):
    """The plan key with its rows (key[3]) rounded up to a power of two."""
    return key[:3] + (1 << (key[3] - 1).bit_length(),) + key[4:]


def _earlier_algo(ctx, key):
    """The algorithm chosen before for key, now key's own, where cuBLASLt runs key with it: the one
    an earlier process timed for key itself (the GPU's algorithm file, algo_cache.py), else the one
    timed for the first shape of key's row bucket (in this process, else in an earlier one: a bucket
    then holds the earlier process's algorithm, as it did there); None: key gets a trial of its own."""
    bucket = _row_bucket(key)
    entries = _algo_file(ctx)[1]
    algo = _stored_algo(entries, "shape", key)
    if algo is None or not ctx.lt.supports(key, algo):
        stored = _stored_algo(entries, "bucket", bucket)
        with _ALGOS_LOCK:
            if bucket not in _BUCKET_ALGOS and stored is not None:
                _BUCKET_ALGOS[bucket] = stored
            algo = _BUCKET_ALGOS.get(bucket)
        if algo is None or not ctx.lt.supports(key, algo):
            return None
    with _ALGOS_LOCK:
        return _ALGOS.setdefault(key, algo)


def _stored_algo(entries, kind: str, key):
    """The algorithm file's entry for a shape's or a row bucket's plan key, None where it has none."""
    raw = entries.get(key_text((kind, *key)))
    return None if raw is None else cb.algo_from_bytes(raw)


_ALGO_FILES = {}  # (folder, fingerprint) -> (AlgoCache, its entries: read once, then what this process adds)


def _algo_file(ctx) -> tuple:
    """The GPU's algorithm file (algo_cache.py) and its entries (name -> bytes)."""
    fingerprint = {"device": ctx.device_name, "capability": list(ctx.capability), "sms": ctx.sm_count,
                   "cublaslt": ctx.lt.version, "workspace": cb.WORKSPACE_BYTES, "candidates": cb.CANDIDATES}
    where = (cache_folder(kernel_cache_dir()), json.dumps(fingerprint, sort_keys=True))
    with _ALGOS_LOCK:
        if where not in _ALGO_FILES:
            cache = AlgoCache(where[0], fingerprint)
            _ALGO_FILES[where] = (cache, cache.load())
        return _ALGO_FILES[where]


def _keep_algos(ctx, chosen: dict):
    """Add timed algorithms ((kind, *plan key) -> algo) to the GPU's algorithm file, but for entries
    it holds already."""
    cache, entries = _algo_file(ctx)
    with _ALGOS_LOCK:
        new = {key_text(k): bytes(a) for k, a in chosen.items() if key_text(k) not in entries}
        entries.update(new)
    if new:
        cache.save(new)


# Known gap (H100, 2026-11-25, a scratch run): for BERT-base's FFN down-projection at
# 32,768 rows (768 x 3,072 weights) the trial picks the 8th candidate every time (4 of 4 trials; also
# 4 of 4 with three timed replays each, in alternating order), which a graph of 20 products replayed
# alone times at 231.8 us against 212.9 for the 2nd (bench/results/gemm.md: ftengine 0.232 ms against
# Lt best 0.220). For the other shapes measured (QKV at 4,096 and 32,768 rows, the attention output at
# 4,096) the pick is the fastest. Why the trial's timing disagrees there is not known.
# In the whole pass it matters less than the GPU's clock (H100, 2026-11-26): BERT-base 256 x 128
# replayed (GPU only) with each of the 8 candidates in turn took 12.53-12.76 ms (the trial's pick,
# the 2nd that run, 12.55; the fastest alone, the 8th at 231.5 us, 12.53), and 12.20 ms measured
# first, before those runs; the QKV and attention-output products' candidates alike (12.52-12.85,
# 12.53-12.70 ms).
# Measured and not kept: the host's launch time as part of a candidate's cost. An algorithm that zeroes a
# workspace word before its kernel adds a memset node to a captured pass, which the host takes about
# 1.6 us to launch against 0.1-0.3 us for a kernel node (H100, 2026-11-26, graphs of 12 products:
# BERT-base's QKV at 4,096 rows, the candidates with a 4-byte workspace 19.7-20.8 us, those without
# 2.4-3.2; the trial's pick is one of the former, 22.5 us a product against 23.1 for the heuristic's
# first), and BERT-base 32 x 128's pass takes 23 us to launch against 2-3 us at 1 x 128. But the GPU
# starts on a graph's first nodes while the host launches the rest: picking by GPU time + the quickest
# of 3 launches left BERT-base 32 x 128 end to end at 1.625-1.667 ms against 1.625-1.640, GPT-2's
# prefill 32 x 128 at 1.800-1.994 against 1.806-1.819 (three alternating rounds).
def _choose_algo(ctx, key, product):
    """The fastest of the shape's candidate algorithms on this call's operands, recorded for the
    whole process and in the GPU's algorithm file for the processes after it (with the row bucket's
    algorithm, where the file has none: _keep_algos): each candidate's TRIAL_REPEATS products
    captured in a graph, replayed once to warm up and once between events (launched one by one
    from Python, a small product would measure the host's launch rate instead of the GPU)."""
    cupy = ctx.cupy
    candidates = ctx.lt.candidates(key)
    times = []
    for algo in candidates:
        ctx.stream.begin_capture()
        try:
            for _ in range(TRIAL_REPEATS):
                product(algo)
        finally:
            graph = ctx.stream.end_capture()
        graph.launch(stream=ctx.stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(ctx.stream)
        graph.launch(stream=ctx.stream)
        end.record(ctx.stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    bucket = _row_bucket(key)
    with _ALGOS_LOCK:
        algo = _ALGOS.setdefault(key, candidates[int(np.argmin(times))])
        bucket_algo = _BUCKET_ALGOS.setdefault(bucket, algo)
    _keep_algos(ctx, {("shape", *key): algo, ("bucket", *bucket): bucket_algo})
    return algo


# The erf pass beside the products instead (H100, BERT-base FFN at 32,768 rows, fp16, 2026-11-25):
# the up-projection in 2-16 row chunks, each chunk's pass on a second stream (normal or high
# priority) while the next chunk's product runs, the down-projection per chunk after its pass:
# 563-674 us against 556 for the unchunked up product + pass + down product (the products alone 417):
# chunked products cost more than the overlap hides.
def matmul_bias_gelu(out, x, weight, bias, *, form):
    """out (M, N) = GELU(x @ weight^T + bias): fused into the skinny or gemv kernel where matmul
    would run one (see there); else the tanh form in cuBLASLt's GELU_BIAS epilogue (the same
    formula, on the fp32 accumulator); the erf form (no cuBLASLt epilogue computes it) fused into
    the wgmma product where _wgmma_tile gives it a tile, else as a product, then one bias + GELU pass."""
    code = _gelu_form(form)
    if _skinny_fits(x, weight):
        _skinny(out, x, weight, bias, 1 + code)
    elif x.shape[0] <= GEMV_ROWS:
        _gemv(out, x, weight, bias, 1 + code)
    elif form == "tanh" and _lt_aligned(out, x, weight, bias):
        _lt_matmul(out, x, weight, bias, "gelu_bias")
    elif form == "erf" and (bn := _wgmma_tile(out, x, weight, bias)):
        _matmul_wgmma(out, x, weight, bias, 1 + code, bn)
    else:
        _lt_matmul(out, x, weight)
        add_bias_gelu(out, out, bias, form=form)


def _tma_operands(x, *others) -> bool:
    """Whether x and the others can be gemm_sm90.cu's tensor maps: x's type throughout, contiguous
    rows of 16-byte multiples from 16-byte aligned starts."""
    return all(a.dtype == x.dtype and a.flags.c_contiguous and a.data.ptr % 16 == 0
               and a.shape[-1] * a.itemsize % 16 == 0 for a in (x, *others))


def _wgmma_tile(out, x, weight, bias) -> int | None:
    """The tile width (a WGMMA_TILES key) of gemm_sm90.cu's matmul_wgmma for out = epilogue(x @
    weight^T + bias), or None where it does not run it: on a GPU of its architecture, one 16-bit type
    throughout, contiguous rows of 16-byte multiples from 16-byte aligned starts (what its tensor maps
    take); 256 columns from WGMMA_GELU_MIN_OUTPUTS outputs on; below that, for K up to
    WGMMA_NARROW_MAX_K or up to WGMMA_SPLIT_ROWS rows only, 128 columns where that makes
    WGMMA_NARROW_TILES_PER_SM tiles an SM, else 64 (figures in kernels.py)."""
    if not (context().wgmma and x.dtype in (np.float16, np.uint16) and bias.dtype == x.dtype
            and bias.flags.c_contiguous and bias.data.ptr % 16 == 0 and _tma_operands(x, out, weight)):
        return None
    (m, k), n = x.shape, weight.shape[0]
    if m * n >= WGMMA_GELU_MIN_OUTPUTS:
        return 256
    if k > WGMMA_NARROW_MAX_K and m > WGMMA_SPLIT_ROWS:
        return None
    return 128 if wgmma_tiles(m, n, 128) >= WGMMA_NARROW_TILES_PER_SM * context().sm_count else 64


def _matmul_wgmma(out, x, weight, bias, epilogue: int, bn: int):
    """gemm_sm90.cu matmul_wgmma (see _wgmma_tile): out (M, N) = x (M, K) @ weight (N, K)^T with
    epilogue 1 + a GELU form's code (+ bias, then GELU), in GEMM_BM x bn tiles; a persistent grid of
    at most one block per SM."""
    (m, k), n = x.shape, weight.shape[0]
    if _planning():
        return
    maps = (TensorMap(x, GEMM_BK, wgmma_x_rows(m)), TensorMap(weight, GEMM_BK, bn), TensorMap(out, 64, 64))
    _launch("gemm_sm90.cu", wgmma_name(_ctype(x), bn, epilogue), (min(context().sm_count, wgmma_tiles(m, n, bn)),),
            (GEMM_THREADS,), (bias, *maps, np.int32(m), np.int32(n), np.int32(k)),
            shared_mem=wgmma_shared_mem(x.itemsize, bn))


HEAD_ACTIVATIONS = {"identity": 0, "tanh": 1, "relu": 2, "gelu": 3}


def dense(out, x, weight, bias, *, activation, norm=()):
    """out (M, N) = activation(x (M, K) @ weight (N, K)^T + bias), then LayerNorm with norm =
    (gamma, beta, eps) if given, all float32: the layers of a head after pooling (cuBLAS, then
    one bias + activation (+ norm) pass)."""
    m, k = x.shape
    n = weight.shape[0]
    if not _planning():
        with context().stream:
            context().blas.gemm(cb.OP_T, cb.OP_N, n, m, k, weight.data.ptr, cb.DATA_TYPES["float32"], k, x.data.ptr,
                                cb.DATA_TYPES["float32"], k, out.data.ptr, cb.DATA_TYPES["float32"], n)
    gamma, beta, eps = norm or (bias, bias, 0.0)
    _launch("activation.cu", "add_bias_act<float>", (m,), (_threads(n, 256),),
            (out, out, bias, np.int32(n), np.int32(HEAD_ACTIVATIONS[activation]), np.int32(bool(norm)), gamma, beta,
             np.float32(eps)))


def add_qkv_bias_split_heads(q, k, v, qkv, bias, *, batch, seq, heads):
    t, h3 = qkv.shape
    d = q.shape[-1]
    vec = _vec(qkv, d)
    _launch("attention.cu", f"add_qkv_bias_split_heads<{_ctype(qkv)}, {vec}>", (t,), (_threads(h3 // vec),),
            (q, k, v, qkv, bias, np.int32(seq), np.int32(heads), np.int32(d)))


def batched_matmul(out, a, b, *, transpose_b, alpha=1.0):
    """out (N, M, P) = alpha * a (N, M, K) @ b (N, K, P), or b^T when b is (N, P, K)."""
    nb, m, k = a.shape
    p = out.shape[2]
    dt = cb.DATA_TYPES[out.dtype.name]
    op_b, ld_b = (cb.OP_T, k) if transpose_b else (cb.OP_N, p)
    if _planning():
        return
    with context().stream:
        context().blas.gemm_strided_batched(op_b, cb.OP_N, p, m, k, b.data.ptr, dt, ld_b, p * k,
                                            a.data.ptr, dt, k, m * k, out.data.ptr, dt, p, m * p, nb,
                                            alpha=alpha)


def add_relative_bias(scores, table, buckets, *, heads, max_len):
    """scores (B*heads, S, S) += table[buckets[k - q + max_len - 1], head] (MPNet), in place."""
    n, s, _ = scores.shape
    _launch("attention.cu", f"add_relative_bias<{_ctype(scores)}>", (n * s,), (_threads(s, 256),),
            (scores, table, buckets, np.int32(s), np.int32(heads), np.int32(max_len)))


def masked_softmax(probs, scores, lengths, *, heads, window=0):
    n, s, _ = scores.shape
    rows = n * s
    t = _ctype(scores)
    if s <= 32 * SOFTMAX_PER_LANE[-1]:
        per_lane = next(p for p in SOFTMAX_PER_LANE if 32 * p >= s)
        vec = SOFTMAX_VEC[t] if (s % SOFTMAX_VEC[t] == 0 and per_lane % SOFTMAX_VEC[t] == 0) else 1
        warps = 4
        _launch("attention.cu", f"masked_softmax_warp<{t}, {per_lane}, {vec}>",
                ((rows + warps - 1) // warps,), (32 * warps,),
                (probs, scores, lengths, np.int64(rows), np.int32(s), np.int32(heads), np.int32(window)))
    else:
        _launch("attention.cu", f"masked_softmax_block<{t}>", (rows,), (ROW_THREADS,),
                (probs, scores, lengths, np.int64(rows), np.int32(s), np.int32(heads), np.int32(window)),
                shared_mem=s * 4)


def varlen_attention(ctx, qkv, bias, cu_seqlens, *, heads, max_seqlen, causal=False, window=0, rel_bias=None):
    """Fused attention over the padding-free layout: tensor cores for fp16/bf16 (on sm_90, wgmma at
    head dims 64 and 32 without window or bias: attention_sm90.cu, at head dim 64 with TMA copies
    past VARLEN_WG_TMA_MIN_SEQ tokens), SIMT for fp32.
    causal: query i of a sequence sees its keys 0..i only (a decoder's prefill); window > 0: keys
    within that distance only; rel_bias = (table, buckets, max_len): MPNet's relative position
    bias, looked up per score inside the kernel."""
    t, h = ctx.shape
    d = h // heads
    if d not in VARLEN_HEAD_DIMS:
        raise DeviceError(f"fused attention supports head_dim {VARLEN_HEAD_DIMS}, not {d}")
    b = cu_seqlens.size - 1
    ct = _ctype(ctx)
    scale_log2 = np.float32(1.4426950408889634 / np.sqrt(d))
    threads, block_m, file = 128, VARLEN_BLOCK_M, "attention_varlen.cu"
    general = bool(window or rel_bias is not None)
    if ct == "float":
        name, smem = f"varlen_attention_simt<{d}>", 0
    elif d in VARLEN_WG_HEAD_DIMS and not general and context().wgmma:
        # wgmma: two stages of swizzled K and V tiles, the staged queries (rows of D + 8), 1024 bytes
        # of alignment; the TMA kernel for longer sequences (VARLEN_WG_TMA_MIN_SEQ), also its mbarriers
        threads, block_m, file = 128, VARLEN_WG_BLOCK_M, "attention_sm90.cu"
        name, smem = f"varlen_attention_wgmma<{ct}, {d}>", (2 * 2 * VARLEN_WG_KN * d + block_m * (d + 8)) * 2 + 1024
        if d == 64 and max_seqlen >= VARLEN_WG_TMA_MIN_SEQ and _tma_operands(qkv):
            if not _planning():
                _launch(file, f"varlen_attention_wgmma_tma<{ct}>", (-(-max_seqlen // block_m), b * heads), (threads,),
                        (ctx, qkv, bias, cu_seqlens, np.int32(b), np.int32(heads), np.int32(t), scale_log2,
                         np.int32(bool(causal)), TensorMap(qkv, d, VARLEN_WG_KN)), shared_mem=smem + 16)
            return
    else:  # two stages of K and V tiles of KN rows of D + 8 elements; the general variant for windows
        # and biases; the wide tiles for long sequences (VARLEN_TILES)
        warps, mt, kn = VARLEN_TILES["wide"]
        blocks = b * heads * -(-max_seqlen // (16 * warps * mt))
        wide = d <= 64 and max_seqlen >= 1024 and blocks >= 2 * context().sm_count
        tiles = "wide" if wide else "narrow"
        warps, mt, kn = VARLEN_TILES[tiles]
        threads, block_m = 32 * warps, 16 * warps * mt
        name, smem = varlen_mma_name(ct, d, general, tiles), 2 * 2 * kn * (d + 8) * 2
    table, buckets, max_len = rel_bias if rel_bias is not None else (cu_seqlens, cu_seqlens, 0)
    _launch(file, name, (-(-max_seqlen // block_m), b * heads), (threads,),
            (ctx, qkv, bias, cu_seqlens, np.int32(b), np.int32(heads), np.int32(t), scale_log2,
             np.int32(bool(causal)), np.int32(window), table, buckets, np.int32(max_len)), shared_mem=smem)


def rotary_qkv(qkv, bias, positions, cos, sin, *, heads):
    """Adds the QKV bias and rotates every head's query and key by its token's position, in place."""
    t, h3 = qkv.shape
    _launch("rotary.cu", f"rotary_qkv<{_ctype(qkv)}>", (t,), (_threads(2 * h3 // 3 // 2, 256),),
            (qkv, bias, positions, cos, sin, np.int32(heads), np.int32(h3 // 3 // heads)))


def gated_gelu(out, x, bias, *, form):
    """GeGLU: out (T, I) = GELU(x[:, :I] + bias[:I]) * (x[:, I:] + bias[I:]); one block per row,
    VEC columns per thread at a time."""
    t, i = out.shape
    code = _gelu_form(form)
    vec = _vec(out, i)
    _launch("activation.cu", f"gated_gelu<{_ctype(out)}, {vec}>", (t,), (_threads(i // vec, 256),),
            (out, x, bias, np.int32(i), np.int32(code)))


def merge_heads(out, ctx, *, batch, seq, heads):
    t, h = out.shape
    d = ctx.shape[-1]
    vec = _vec(out, d)
    _launch("attention.cu", f"merge_heads<{_ctype(out)}, {vec}>", (t,), (_threads(h // vec),),
            (out, ctx, np.int32(seq), np.int32(heads), np.int32(d)))


def add_bias_residual_layernorm(out, x, bias, residual, gamma, beta, *, eps):
    """out (T, H) = LayerNorm(x + bias + residual). x (T, H) of out's dtype, or a split product's
    float32 partial sums (slices, T, H), added up in slice order. out may alias residual. A block a
    row; a warp a row for rows of up to ROW_WARP_ITEMS[-1] 16-byte vectors a lane from
    LN_WARP_MIN_ROWS to LN_WARP_MAX_ROWS rows (figures in kernels.py)."""
    t, h = out.shape
    args = (out, x, bias, residual, gamma, beta, np.int32(t), np.int32(h), np.float32(eps))
    ct, vec = _ctype(out), _vec(out, h)
    if x.ndim == 2 and vec == VECS[ct][0] and LN_WARP_MIN_ROWS <= t <= LN_WARP_MAX_ROWS:
        items = -(-(h // vec) // 32)
        if items <= ROW_WARP_ITEMS[-1]:
            items = min(i for i in ROW_WARP_ITEMS if i >= items)
            _launch("layernorm.cu", f"add_bias_residual_layernorm<{ct}, {ct}, 1, {vec}, {items}, {LN_ROW_WARPS}>",
                    (-(-t // LN_ROW_WARPS),), (32 * LN_ROW_WARPS,), args)
            return
    vec, items, threads = _row_kernel_shape(out, h)
    slices = x.shape[0] if x.ndim == 3 else 1
    _launch("layernorm.cu", f"add_bias_residual_layernorm<{ct}, {_ctype(x)}, {slices}, {vec}, {items}>", (t,),
            (threads,), args)


def add_bias_gelu(out, x, bias, *, form):
    """out (T, I) = GELU(x + bias), GELU_ROWS rows per block."""
    t, i = out.shape
    code = _gelu_form(form)
    vec = _vec(out, i)
    _launch("activation.cu", f"add_bias_gelu<{_ctype(out)}, {vec}>", (-(-t // GELU_ROWS),), (_threads(i // vec),),
            (out, x, bias, np.int32(i), np.int32(t), np.int32(code)))


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


def _pool_modes(kernel: str, out, hidden, modes, extra_args, skip: int):
    """One launch per pooling mode, each writing its H columns of out (B, modes*H): a block takes 32
    columns of a sequence, its warps (_pool_warps) its rows (pooling.cu)."""
    b, h = out.shape[0], hidden.shape[1]
    warps = _pool_warps(b * -(-h // 32))
    for i, mode in enumerate(modes):
        if mode not in POOL_CODES:
            raise ValueError(f"unknown pooling mode {mode!r}")
        _launch("pooling.cu", f"{kernel}<{_ctype(hidden)}, {warps}>", (b, -(-h // 32)), (32 * warps,),
                (out, hidden, *extra_args, np.int32(h), np.int32(out.shape[1]), np.int32(i * h),
                 np.int32(POOL_CODES[mode]), np.int32(skip)))


def _pool_warps(blocks: int) -> int:
    """The warps a pooling block has: the most of POOL_WARPS that keep `blocks` blocks within
    POOL_WARPS_PER_SM warps an SM, else the fewest (figures in kernels.py)."""
    limit = POOL_WARPS_PER_SM * context().sm_count
    return max((w for w in POOL_WARPS if blocks * w <= limit), default=min(POOL_WARPS))


def pool(out, hidden, lengths, *, seq, modes, skip=0):
    """out (B, modes*H) float32 from padded hidden states (B*S, H) of any storage type; each
    sequence's first `skip` tokens left out (as numpy_ops.pool)."""
    _pool_modes("pool", out, hidden, modes, (lengths, np.int32(seq)), skip)


def pool_packed(out, hidden, cu_seqlens, *, modes, skip=0):
    """out (B, modes*H) float32 from the padding-free hidden states (T, H)."""
    _pool_modes("pool_packed", out, hidden, modes, (cu_seqlens,), skip)


# ------------------------------------------------------------------ decoder (GPT-2)

def embed_positions(out, ids, positions, wte, wpe):
    t, e = out.shape
    vec = _vec(out, e)
    _launch("decoder.cu", f"embed_positions<{_ctype(out)}, {vec}>", (t,), (_threads(e // vec),),
            (out, ids, positions, wte, wpe, np.int32(e)))


def layernorm(out, x, gamma, beta, *, eps):
    t, h = out.shape
    vec, items, threads = _row_kernel_shape(out, h)
    _launch("decoder.cu", f"layernorm<{_ctype(out)}, {vec}, {items}>", (t,), (threads,),
            (out, x, gamma, beta, np.int32(h), np.float32(eps)))


def add_bias_residual(out, x, bias, residual):
    t, e = out.shape
    vec = _vec(out, e)
    _launch("decoder.cu", f"add_bias_residual<{_ctype(out)}, {vec}>", (t,), (_threads(e // vec),),
            (out, x, bias, residual, np.int32(e)))


def split_k(m: int, n: int, k: int, dtype) -> int:
    """How many K slices matmul_residual_layernorm splits an m x k @ (n x k)^T product of dtype
    into (1: none): SPLIT_MIN_ROWS .. SKINNY_ROWS rows of 16-bit operands, a narrow product (below
    SKINNY_MIN_COLUMNS) of whole 16-byte vectors (N a multiple of 8: the reader's instantiations),
    K a multiple of 32 with 32 or more per slice."""
    if (np.dtype(dtype) == np.float32 or not SPLIT_MIN_ROWS <= m <= SKINNY_ROWS or n >= SKINNY_MIN_COLUMNS
            or n % 8 or k % 32):
        return 1
    most = max(2, k // SPLIT_SLICE_K)
    return max((s for s in SKINNY_SPLITS if s <= most and 32 * s <= k), default=1)


def blas_split_k(m: int, n: int, k: int, dtype) -> int:
    """How many K slices matmul_residual_layernorm and matmul_bias_residual_layernorm have cuBLAS
    compute as float32 partial sums (1: none): 16-bit operands, BLAS_SPLIT_MIN_ROWS rows or more, K
    of BLAS_SPLIT_MIN_K or more that splits into whole 16-byte vectors, rows of whole 16-byte
    vectors (N a multiple of 8), and few enough outputs (BLAS_SPLIT_OUTPUTS)."""
    if np.dtype(dtype) == np.float32 or m < BLAS_SPLIT_MIN_ROWS or k < BLAS_SPLIT_MIN_K or n % 8:
        return 1
    return next((s for outputs, s in BLAS_SPLIT_OUTPUTS if m * n <= outputs and k % (8 * s) == 0), 1)


def partials_size(rows: int, n: int) -> int:
    """float32 elements of the `partials` buffer matmul_residual_layernorm and
    matmul_bias_residual_layernorm need for up to `rows` rows of n output columns."""
    blas = max(s * min(rows * n, outputs) for outputs, s in BLAS_SPLIT_OUTPUTS)
    return max(max(SKINNY_SPLITS) * min(rows, SKINNY_ROWS) * n, blas)


def _split_partials(partials, splits: int, m: int, n: int):
    """The (splits, m, n) float32 view of `partials` that a split product's sums go to."""
    if partials.dtype != np.float32 or partials.size < splits * m * n:
        raise DeviceError(f"partials holds {partials.size} {partials.dtype} values; a split product of {m} x {n} "
                          f"needs {splits * m * n} float32")
    return partials.ravel()[:splits * m * n].reshape(splits, m, n)


def _split_product(parts, x, weight):
    """parts (S, M, N) float32: parts[s] = x[:, s K/S ..] @ weight[:, s K/S ..]^T, for x (M, K) and
    weight (N, K) of one 16-bit type, through cuBLAS as one strided batch."""
    s, m, n = parts.shape
    k = x.shape[1]
    ks, kind = k // s, cb.DATA_TYPES[x.dtype.name]
    if _planning():
        return
    ctx = context()
    with ctx.stream:
        ctx.blas.gemm_strided_batched(cb.OP_T, cb.OP_N, n, m, ks, weight.data.ptr, kind, k, ks, x.data.ptr, kind, k,
                                      ks, parts.data.ptr, cb.CUDA_R_32F, n, m * n, s)


# The residual + LayerNorm run by the gemv's last block instead (each block counted on an atomic
# counter after a fence; the last one read the product back from the L2, one warp a row): measured
# slower (H100, GPT-2 small fp16, 2026-11-26, ms a step, alternating runs): greedy batch 1 0.292 ->
# 0.346, beam 4 0.372 -> 0.398 (24 such products a step: the count, the fences and the one block's
# tail cost about 2 us more than the second kernel did; not broken down further).
# The LayerNorm left to the product that reads it (issue 15's lever, decode steps of 1-4 rows: this
# gemv's blocks of 4 columns writing each row's sum and sum of squares, the next gemv normalising the
# rows from them as it reads them; no LayerNorm kernel but ln_f's) was right (fp32 logits identical,
# fp16 within 0.0033, the same tokens) but slower (H100, GPT-2 small fp16, 2026-11-26, ms a step,
# alternating, greedy batch 1 / beam 4 batch 1 / greedy batch 4): 0.293 / 0.373 / 0.338 -> 0.331 /
# 0.430 / 0.404 with the 192 blocks' pairs summed by each reading block; in a second run 0.294 / 0.368 /
# 0.339 -> 0.355 / 0.471 / 0.446 summed by each of its warps, 0.357 / 0.524 / 0.494 from blocks of 2
# columns: reading the statistics before its first product cost each reading block more than the
# LayerNorm kernel it replaced.
def matmul_residual_layernorm(hidden, normed, x, weight, bias, gamma, beta, *, eps, product, partials):
    """hidden += x @ weight^T + bias; normed = LayerNorm(hidden), as matmul into `product` (M, N)
    then residual_layernorm. Where split_k, or else blas_split_k, splits the product: gemv.cu
    skinny_mma or cuBLAS sums each K slice into `partials` (float32, partials_size elements at
    least), and residual_layernorm adds them up (rows of whole 16-byte vectors)."""
    (m, k), n = x.shape, weight.shape[0]
    # the skinny split first: at 32 rows cuBLAS's took 1.6 us off a decode step graph, but after
    # other streams' kernels in the process (bench_decoder's note) it made top-k / top-p batch-32
    # generation 1.4 / 3.8 us a step slower (H100, HF's generate run first, medians of 6 alternating runs)
    skinny = split_k(m, n, k, x.dtype) if _skinny_operands(x, weight) else 1
    blas = blas_split_k(m, n, k, x.dtype) if skinny == 1 and weight.dtype == x.dtype else 1
    splits = max(skinny, blas)
    if splits == 1:
        matmul(product, x, weight)
        residual_layernorm(hidden, normed, product, bias, gamma, beta, eps=eps)
        return
    parts = _split_partials(partials, splits, m, n)
    if blas > 1:
        _split_product(parts, x, weight)
    else:
        _skinny(parts, x, weight, None, 0, table=SPLIT_TILES, splits=splits)
    residual_layernorm(hidden, normed, parts, bias, gamma, beta, eps=eps)


# The residual and bias added by cuBLASLt instead (C = residual with beta 1, the BIAS epilogue), then a
# plain LayerNorm, measured slower (H100 fp16, 768 outputs a row, us): K = 768 at 4,096 rows 15.1 ->
# 17.0, 32,768 rows 109.2 -> 121.0 (the product alone 60.7 -> 84.0: reading C costs it more than the
# LayerNorm saves); K = 3,072 at 32,768 rows 267.9 -> 283.5; 128 rows 5.5 -> 5.8 (2026-11-25).
def matmul_bias_residual_layernorm(out, x, weight, bias, residual, gamma, beta, *, eps, product, partials):
    """out = LayerNorm(x @ weight^T + bias + residual): in one kernel where wgmma_ln_fits (gemm_sm90.cu
    matmul_wgmma_ln: the product's sums not rounded to out's type first); else as matmul into
    `product` (M, N) then add_bias_residual_layernorm; where blas_split_k splits the product, cuBLAS
    sums each K slice into `partials` (float32, partials_size elements at least) and
    add_bias_residual_layernorm adds them up. `out` may alias `residual`."""
    if wgmma_ln_fits(out, x, weight, residual, bias, gamma, beta):
        _matmul_wgmma_ln(out, x, weight, bias, residual, gamma, beta, eps)
        return
    (m, k), n = x.shape, weight.shape[0]
    splits = blas_split_k(m, n, k, x.dtype) if weight.dtype == x.dtype else 1
    if splits == 1:
        matmul(product, x, weight)
        add_bias_residual_layernorm(out, product, bias, residual, gamma, beta, eps=eps)
        return
    parts = _split_partials(partials, splits, m, n)
    _split_product(parts, x, weight)
    add_bias_residual_layernorm(out, parts, bias, residual, gamma, beta, eps=eps)


def wgmma_ln_fits(out, x, weight, residual, *vectors) -> bool:
    """Whether matmul_bias_residual_layernorm runs gemm_sm90.cu matmul_wgmma_ln: on a GPU of its
    architecture that runs its clusters, WGMMA_LN_MIN_ROWS rows or more, rows of at most
    LN_CLUSTER_MAX tiles (WGMMA_LN_TILE's columns), one 16-bit type throughout (`vectors`: the bias,
    gamma and beta, where given), contiguous rows of 16-byte multiples from 16-byte aligned starts
    (its tensor maps)."""
    return bool(context().wgmma and x.dtype in (np.float16, np.uint16) and x.shape[0] >= WGMMA_LN_MIN_ROWS
                and weight.shape[0] <= LN_CLUSTER_MAX * WGMMA_LN_TILE[0]
                and all(a.dtype == x.dtype for a in vectors) and _tma_operands(x, out, weight, residual)
                and _ln_clusters(_ctype(x), -(-weight.shape[0] // WGMMA_LN_TILE[0])) > 0)


_LN_CLUSTERS = {}  # (element type, blocks a cluster) -> the clusters of matmul_wgmma_ln the GPU runs at once


def _ln_clusters(ctype: str, ranks: int) -> int:
    """How many clusters of `ranks` blocks of matmul_wgmma_ln the GPU runs at once (0: none, e.g. where
    a partition of the GPU has too few SMs a GPC)."""
    clusters = _LN_CLUSTERS.get((ctype, ranks))
    if clusters is None:
        bn, stages = WGMMA_LN_TILE
        shared = wgmma_shared_mem(2, bn, stages)
        k_fn = kernel("gemm_sm90.cu", wgmma_ln_name(ctype))
        if k_fn.max_dynamic_shared_size_bytes < shared:
            k_fn.max_dynamic_shared_size_bytes = shared
        clusters = _LN_CLUSTERS.setdefault((ctype, ranks), max_active_clusters(k_fn, ranks, GEMM_THREADS, shared))
    return clusters


def _matmul_wgmma_ln(out, x, weight, bias, residual, gamma, beta, eps):
    """gemm_sm90.cu matmul_wgmma_ln (see wgmma_ln_fits): a cluster of ceil(N / tile width) blocks
    across each row band, as many clusters as the GPU runs at once (a persistent grid: a cluster
    that waited for another's SMs would start its row bands after the others had finished theirs)."""
    (m, k), n = x.shape, weight.shape[0]
    if _planning():
        return
    bn, stages = WGMMA_LN_TILE
    ranks, name, shared = -(-n // bn), wgmma_ln_name(_ctype(x)), wgmma_shared_mem(x.itemsize, bn, stages)
    grid = min(-(-m // wgmma_x_rows(m)), _ln_clusters(_ctype(x), ranks)) * ranks
    maps = (TensorMap(x, GEMM_BK, wgmma_x_rows(m)), TensorMap(weight, GEMM_BK, bn), TensorMap(out, 64, 64),
            TensorMap(residual, 64, 64))
    _launch("gemm_sm90.cu", name, (grid,), (GEMM_THREADS,),
            (bias, gamma, beta, *maps, np.int32(m), np.int32(n), np.int32(k), np.float32(eps)), shared_mem=shared,
            cluster=(ranks, 1, 1))


def residual_layernorm(hidden, normed, x, bias, gamma, beta, *, eps):
    """hidden (T, E) += x + bias; normed = LayerNorm(hidden). x (T, E) of hidden's dtype, or a
    split product's float32 partial sums (slices, T, E), added up in slice order."""
    t, h = hidden.shape
    vec, items, threads = _row_kernel_shape(hidden, h)
    slices = x.shape[0] if x.ndim == 3 else 1
    _launch("decoder.cu", f"residual_layernorm<{_ctype(hidden)}, {_ctype(x)}, {slices}, {vec}, {items}>", (t,),
            (threads,), (hidden, normed, x, bias, gamma, beta, np.int32(h), np.float32(eps)))


# a prefill's cache writes on a branch of its graph beside the layer's other launches, joined before
# the next layer's QKV product overwrites their input (write_kv_cache(beside=True), join_beside).
# H100, GPT-2 small fp16 prefill graph replayed: 1 x 512 575.8 -> 549.9 us, 32 x 128 1769.2 -> 1722.7
# (joined after the attention instead: 545.0 and 1754.6)
def write_kv_cache(k_cache, v_cache, qkv, bias, seq_ids, positions, *, heads, beside=False):
    """Token t's key and value (qkv + bias) into cache[seq_ids[t], :, positions[t]] (sequence -1:
    skipped). beside: inside a graph capture on sm_90+, on a branch beside the launches that
    follow, which join_beside joins (the caller's duty before anything overwrites qkv, bias, seq_ids
    or positions, or reads the caches)."""
    t = qkv.shape[0]
    _, _, length, d = k_cache.shape
    vec = _vec(qkv, d)
    name, grid, block = f"write_kv_cache<{_ctype(qkv)}, {vec}>", (t,), (_threads(2 * heads * d // vec),)
    args = (k_cache, v_cache, qkv, bias, seq_ids, positions, np.int32(heads), np.int32(d), np.int32(length))
    if beside and _branching():
        _on_branch("decoder.cu", name, grid, block, args, beside=True)
    else:
        _launch("decoder.cu", name, grid, block, args)


def _attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, indir, flags, heads):
    t = qkv.shape[0]
    _, _, length, d = k_cache.shape
    vec = _vec(qkv, d)
    per_key = 1 << max(0, (d // vec - 1).bit_length())  # threads per key: a power of two
    if per_key > 32:
        raise DeviceError(f"head_dim {d} is too large for the decoder attention kernel (at most {32 * vec})")
    # a block of ATTENTION_THREADS while there are few (row, head) blocks; half that from
    # ATTENTION_MANY_BLOCKS of them on, where more blocks per SM gain more than wider ones
    threads = ATTENTION_THREADS if t * heads < ATTENTION_MANY_BLOCKS else ATTENTION_THREADS // 2
    smem = threads // 32 * (d + 2) * 4
    _launch("decoder.cu", f"cached_attention<{_ctype(qkv)}, {vec}>", (t, heads), (threads,),
            (ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, positions if indir is None else indir,
             np.int32(flags), np.int32(heads), np.int32(d), np.int32(length), np.int32(per_key),
             np.float32(1.0 / np.sqrt(d))), shared_mem=smem)


def cached_attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, *, heads, indir=None):
    flags = 0 if indir is None else ATTENTION_FLAGS["indirect"]
    _attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, indir, flags, heads)


# What a decode step's launches cost (H100, GPT-2 small fp16, 2026-11-26, us a step at batch 1 /
# beam 4, each kind left out of the step, timing only): the q/k/v product 32 / 31, this attention
# 56 / 52, the 24 residual + LayerNorm kernels 50 / 25, the FFN up-projection 40 / 36, of 292 / 372.
# Measured and not kept (ms a step, greedy batch 1 / beam 4 batch 1 / greedy batch 32, the code as
# it is first, alternating runs):
# - the q/k/v product fused into this attention (a cluster of 8 blocks per (token, head), each
#   computing 24 of the head's 192 outputs into block 0's shared memory, which then attends):
#   0.2938 / 0.3729 -> 0.2954 / 0.3920;
# - the first round of keys loaded before the token's position arrives, the token's own key and
#   value stored after the loop: 0.2915 / 0.3692 / 0.4490 -> 0.3036 / 0.3816 / 0.4549 (the store
#   moved alone: 0.2970 / 0.3786 / 0.4529);
# - keys and values held as stored (half the registers at 16 bits), 4 or 8 keys a group a round:
#   0.2920 / 0.3732 / 0.4469 -> 0.2932 / 0.3735 / 0.4495, 0.2989 / 0.3793 / 0.4560; 8 keys as
#   floats: batch 32 0.4469 -> 0.5196; blocks of ATTENTION_THREADS at every batch: 0.4469 -> 0.4810.
# - the output projection fused into this attention (issue 15's lever; batches of 1-4 rows, the
#   head's columns of the weights copied into shared memory while the block attends, each head's
#   share summed into float partials that residual_layernorm adds up in head order; right: the same
#   tokens, fp16 logits within 0.0031), greedy batch 1 / beam 4 batch 1 / greedy batch 4, second run:
#   0.2951 / 0.3758 / 0.3478 -> 0.3134 / 0.4464 / 0.4129 with the head's outputs over 8 blocks that
#   each attend, 0.3212 / 0.3878 / 0.3629 over 4; one block a head (96 KB of weights through one SM),
#   first run: 0.2949 / 0.3728 / 0.3479 -> 0.3608 / 0.4280 / 0.3983.
def decode_attention(ctx, qkv, bias, k_cache, v_cache, positions, indir=None, *, heads):
    """Writes each token's key and value into its own cache row, then attends (one kernel)."""
    flags = ATTENTION_FLAGS["rows_are_tokens"] | ATTENTION_FLAGS["write_kv"]
    if indir is not None:
        flags |= ATTENTION_FLAGS["indirect"]
    _attention(ctx, qkv, bias, k_cache, v_cache, positions, positions, indir, flags, heads)


def zero(array):
    if _planning():
        return
    with context().stream:
        array.fill(0)


def mark_seen(seen, tokens, rows):
    n = tokens.size
    _launch("sampling.cu", "mark_seen", (max(1, -(-n // 256)),), (256,),
            (seen, tokens, rows, np.int32(n), np.int32(seen.shape[1])))


def choice_slices(b: int, v: int) -> tuple[int, int, int]:
    """(slices, tokens per slice, tokens per chunk) of each row's vocabulary in the token choice:
    enough blocks for about two waves of 128 at any batch, slices of at least CHOICE_SLICE_MIN
    tokens, none empty; the draw's chunks (a multiple of 32 tokens dividing the slice) fit the
    row's CHOICE_BINS state words. Depends on (b, v) only, so a draw's sums are the same on every GPU."""
    chunk = 32 * -(-v // (32 * CHOICE_BINS))
    slices = max(1, min(CHOICE_SLICES_MAX, -(-256 // b), -(-v // CHOICE_SLICE_MIN)))
    size = -(-v // slices // chunk) * chunk
    return -(-v // size), size, chunk


def sample_clusters(v: int) -> tuple[int, int]:
    """(blocks per row, tokens per block) of choose_sample: a cluster of up to SAMPLE_CLUSTER_MAX
    blocks (a power of two) with slices of at least CHOICE_SLICE_MIN tokens. Depends on v only, so
    a row's draw sums the same way at any batch size."""
    blocks = SAMPLE_CLUSTER_MAX
    while blocks > 1 and -(-v // blocks) < CHOICE_SLICE_MIN:
        blocks //= 2
    return blocks, -(-v // blocks)


def _sample_shared_mem(blocks: int, slice_: int) -> int:
    """choose_sample's dynamic shared memory: a histogram, a range of the cluster's, the slice and
    a select's candidates (its static shared memory, sample_few's copies of them among it, comes
    on top)."""
    return SAMPLE_HIST_WORDS * 4 + CHOICE_BINS // blocks * 8 + 4 * (slice_ + SAMPLE_CANDIDATES)


# Issue 15's lever "the LM head with the argmax / top-k partials in its epilogue", bounded rather than
# built: GPT-2 small fp16 steps with this choice left out altogether (append_tokens fed a stale token;
# timing only) against the steps as they are, H100, 2026-11-26, ms a step, fresh process, three
# alternating rounds: greedy batch 1 0.291-0.294 -> 0.287, batch 4 0.338-0.339 -> 0.331-0.334, batch 32
# 0.442-0.444 -> 0.432 (one round 0.407); top-k 40 batch 32 0.462-0.469 -> 0.431 (one round 0.413). A
# greedy argmax in the product's epilogue could save at most 4-6 us a step at 1-4 rows (1.5-2%) and
# 11 at 32 (it still needs the processors and a reduction over the product's blocks). Top-k partials
# there would not shrink the select: the LM head's blocks hold 2-64 columns of a row, so their top 40
# keep most of the vocabulary, and the cluster's select over them is the one below. Nor is the
# choice's share of the step its launch as a programmatic dependent one: launched plainly in the step
# graph it gave the same steps (same day, three rounds, ms: greedy batch 32 0.450-0.451 against
# 0.449-0.451, top-k 40 batch 32 0.468-0.487 against 0.468-0.484).
def choose_tokens(out, logits, seen, eos, step, *, scratch, state, params, seed, seq=None, lengths=None):
    """out (B,) int32: the next token of each row of logits (B, V) float32; HF processors and
    order (reference: decoding/processors.py choose); -1 for a non-finite row. Each row's
    vocabulary is split over several blocks (sampling.cu); sampling on sm_90+ runs as one kernel,
    a thread-block cluster per row, where a block's slice fits its shared memory. step (1,) int32,
    seed (2,) uint32 (the draw's seed, GenerationParams.seed_words: read here, not params.seed)
    and, for no_repeat_ngram_size, seq (B, L) / lengths (B,) are device arrays; scratch (B, V)
    float32; state (B, CHOICE_STATE_WORDS) uint64, zero before the call and left zero after it."""
    b, v = logits.shape
    ngram = params.no_repeat_ngram_size
    if ngram and (seq is None or lengths is None):
        raise ValueError("no_repeat_ngram_size needs the sequences (seq, lengths)")
    if state.shape[0] < b or state.shape[1] != CHOICE_STATE_WORDS or state.dtype != np.uint64:
        raise ValueError(f"state must be ({b}, {CHOICE_STATE_WORDS}) uint64, got {state.shape} {state.dtype}")
    seq = step if seq is None else seq
    lengths = step if lengths is None else lengths
    length = seq.shape[1] if seq.ndim == 2 else 0
    sample = bool(params.do_sample)
    # token masses in fixed point: v * 2^bits < 2^63
    scale = np.float64(2.0 ** (63 - int(np.ceil(np.log2(v + 1)))))
    if seed.shape != (2,) or seed.dtype != np.uint32:
        raise ValueError(f"seed must be (2,) uint32 (its low and high words), got {seed.shape} {seed.dtype}")
    blocks, slice_ = sample_clusters(v)
    smem = _sample_shared_mem(blocks, slice_)
    ctx = context()
    # top-k's select finds its threshold among at most SAMPLE_FEW candidates in one step (and top-p
    # after it among top-k's survivors): choose_sample<true>. Top-p alone runs without that code,
    # which measured 1.4 us slower there (H100, batch 32: top-k 40 28.6 -> 25.8 us, top-k 50 +
    # top-p 0.9 48.9 -> 41.0, top-p 0.9 alone 38.6 -> 40.0)
    name = f"choose_sample<{'true' if 0 < params.top_k < v else 'false'}>"
    if (sample and ctx.clusters and slice_ <= SAMPLE_SLICE_MAX
            and smem + kernel("sampling.cu", name).shared_size_bytes <= ctx.shared_mem_optin):
        _launch("sampling.cu", name, (b, blocks), (SAMPLE_THREADS,),
                (out, logits, seen, eos, np.int32(eos.size), step, seq, lengths, np.int32(length), np.int32(ngram),
                 np.int32(v), np.int32(slice_), np.int32(params.min_new_tokens), np.float32(params.temperature),
                 np.float32(params.repetition_penalty), np.int32(params.top_k), np.float32(params.top_p), scale,
                 seed),
                shared_mem=smem, cluster=(1, blocks, 1))
        return
    slices, size, chunk = choice_slices(b, v)
    grid, block, words = (b, slices), (CHOICE_THREADS,), np.int32(CHOICE_STATE_WORDS)
    _launch("sampling.cu", "choose_prepare", grid, block,
            (out, scratch, logits, seen, eos, np.int32(eos.size), step, seq, lengths, np.int32(length),
             np.int32(ngram), np.int32(v), np.int32(size), np.int32(params.min_new_tokens), np.int32(sample),
             np.float32(params.temperature), np.float32(params.repetition_penalty), state, words))
    if not sample:
        return
    for mode, on in ((0, 0 < params.top_k < v), (1, params.top_p < 1.0)):
        for level in range(3) if on else ():
            _launch("sampling.cu", "choose_level", grid, block,
                    (scratch, state, words, np.int32(v), np.int32(size), np.int32(level), np.int32(mode),
                     np.int32(params.top_k), np.float32(params.top_p), scale))
    _launch("sampling.cu", "choose_draw", grid, block,
            (out, scratch, state, words, np.int32(v), np.int32(size), np.int32(chunk), step, seed))


def append_tokens(history, seq, lengths, next_ids, next_pos, finished, seen, step, chosen, eos):
    b, length = seq.shape
    _launch("sampling.cu", "append_tokens", (1,), (_threads(b, 1024),),
            (history, seq, lengths, next_ids, next_pos, finished, seen, step, chosen, eos, np.int32(eos.size),
             np.int32(b), np.int32(length), np.int32(seen.shape[1])))


def beam_select(logits, state, eos, *, params, batch):
    """One beam-search step (reference: decoding/beam.py reference_step): row log-sum-exp as
    partial sums over CANDIDATE_CHUNK vocabulary slices (state.stats: (rows, slices, 2)), then
    FasterTransformer's two-stage top-k (vocabulary slices of each beam, then the beams of each
    item) with the processors applied in stage 1 (which adds up those partial sums first), then
    HF's bookkeeping, then step += 1."""
    from ...decoding.beam import CANDIDATE_CHUNK, KEEP_MAX, candidates_per_item
    nb = params.num_beams
    rows, v = logits.shape
    length = state.seq.shape[1]
    keep = candidates_per_item(params)
    if keep > KEEP_MAX:
        raise DeviceError(f"the CUDA beam search keeps at most {KEEP_MAX} candidates per prompt; num_beams "
                          f"{nb} with {len(params.eos_token_ids)} eos id(s) needs {keep} (use fewer beams)")
    slices = -(-v // CANDIDATE_CHUNK)
    early = {False: 0, True: 1, "never": 2}[params.early_stopping]
    _launch("sampling.cu", "beam_logsumexp", (rows, slices), (256,), (state.stats, state.flags, logits, np.int32(v),
                                                                      np.int32(nb), np.int32(CANDIDATE_CHUNK)))
    _launch("sampling.cu", "beam_candidates", (rows, slices), (256,),
            (state.keys, state.stats, logits, state.seq, state.run_scores, state.starts, state.flags, state.step,
             eos, np.int32(eos.size), np.int32(v), np.int32(length), np.int32(nb), np.int32(keep),
             np.int32(CANDIDATE_CHUNK), np.float32(params.repetition_penalty), np.int32(params.min_new_tokens),
             np.int32(params.no_repeat_ngram_size)), shared_mem=CANDIDATE_CHUNK * 4)
    _launch("sampling.cu", "beam_select", (batch,), (256,),
            (state.keys, np.int32(slices), np.int32(v), np.int32(length), np.int32(nb), np.int32(keep),
             state.seq, state.fin_seq, state.indir, state.scratch, state.run_scores, state.fin_scores,
             state.fin_len, state.fin_flag, state.flags, state.starts, state.next_ids, state.next_pos, state.step,
             eos, np.int32(eos.size), state.max_new, np.float32(params.length_penalty),
             np.int32(early)))
    _launch("sampling.cu", "increment", (1,), (32,), (state.step,))


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
        self.done.record(context().stream)

    def wait(self):
        """Until the work record() last marked has run (at once where none was)."""
        self.done.synchronize()


class _Pending:
    """A device-to-host copy in flight on the stream; wait() returns the host array."""

    def __init__(self, array, slot=None):
        cupy = context().cupy
        self.host = pinned_empty(array.shape, array.dtype) if slot is None else slot.array(array.shape, array.dtype)
        cupy.cuda.runtime.memcpyAsync(self.host.ctypes.data, array.data.ptr, array.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, context().stream.ptr)
        self.event = cupy.cuda.Event(block=False, disable_timing=True) if slot is None else slot.done
        self.event.record(context().stream)

    def wait(self):
        self.event.synchronize()
        return np.array(self.host)


def copy_to_host_async(array, slot=None):
    """Queue a copy of a contiguous device array to the host behind the stream's work; returns a
    handle whose wait() gives the host array. slot: a HostSlot whose buffer and event the copy
    takes over (the caller has waited for the slot's previous copy)."""
    return _Pending(array, slot)


def gather_rows(out, x, rows):
    n, e = out.shape
    vec = _vec(out, e)
    _launch("decoder.cu", f"gather_rows<{_ctype(out)}, {vec}>", (n,), (_threads(e // vec),),
            (out, x, rows, np.int32(e)))


def l2_normalize(out, x):
    """Row-wise L2 normalisation of float32 (pooled) vectors."""
    b, d = out.shape
    _launch("pooling.cu", f"l2_normalize<{_ctype(out)}>", (b,), (ROW_THREADS,), (out, x, np.int32(d)))
