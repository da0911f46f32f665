"""Matrix products and their routing: the weight-streaming gemv and the tensor-core skinny kernel
(kernels_cu/gemv.cu) for a few rows, cuBLASLt (algorithms from algos.py) or cuBLAS for the rest,
gemm_sm90.cu's wgmma products (bias + erf GELU, and product + bias + residual + LayerNorm), K split
into float partial sums that the LayerNorm kernels add up, and the head layers' float32 products.

Each tuning constant sits beside the routing that reads it; docs/gpu-internals.md has the
measurements behind them.
"""

from __future__ import annotations

import numpy as np

from ...errors import DeviceError
from . import cublas as cb
from .activation import ACTIVATIONS, _gelu_form, add_bias_act, add_bias_gelu
from .algos import algorithm
from .kernels import kernel
from .launch import TensorMap, max_active_clusters
from .norms import add_bias_residual_layernorm, residual_layernorm
from .runtime import VECS, _ctype, _launch, _planning, _threads, _vec, context


# gemm_sm90.cu matmul_wgmma (sm_90a): its tile rows and K step (GEMM_BM, GEMM_BK), threads, and per tile width BN the
# K stages in shared memory (WGMMA_TILES); matmul_bias_gelu takes it for the erf form, 256-column tiles from
# WGMMA_GELU_MIN_OUTPUTS outputs (rows x columns) on. (measurements: docs/gpu-internals.md, gemm.py GEMM_BM, GEMM_BK,
# GEMM_THREADS)
GEMM_BM, GEMM_BK, GEMM_THREADS = 128, 64, 288

# The 128-column tile at BERT-base's 4,096 x 3,072 x 768 instead (WGMMA_GELU_MIN_OUTPUTS 8,192 x 3,072,
# WGMMA_NARROW_MAX_K 768): BERT-base 32 x 128 end to end 1.62-1.64 -> 1.67-1.68 ms (H100, 2026-11-26,
# three alternating rounds).
WGMMA_TILES = {256: 3, 128: 4, 64: 8}
WGMMA_GELU_MIN_OUTPUTS = 4096 * 3072

# (WGMMA_SPLIT_ROWS is gemm_sm90.cu's split_k test, M <= 64, and wgmma_x_rows: change them together)
WGMMA_NARROW_MAX_K, WGMMA_SPLIT_ROWS, WGMMA_NARROW_TILES_PER_SM = 384, 64, 0.5

# gemm_sm90.cu matmul_wgmma_ln (the product + bias + residual + LayerNorm, a cluster of blocks across each row): its
# tile width and stages (WGMMA_LN_TILE), the widest row it takes (LN_CLUSTER_MAX tiles) and the rows from which
# matmul_bias_residual_layernorm takes it (WGMMA_LN_MIN_ROWS). (measurements: docs/gpu-internals.md, gemm.py
# WGMMA_LN_TILE, LN_CLUSTER_MAX, WGMMA_LN_MIN_ROWS)
WGMMA_LN_TILE, LN_CLUSTER_MAX, WGMMA_LN_MIN_ROWS = (192, 4), 2, 8192


def wgmma_name(ctype: str, bn: int, epilogue: int) -> str:
    """matmul_wgmma's instantiation for a tile width (its stages from WGMMA_TILES) and epilogue."""
    return f"matmul_wgmma<{ctype}, {WGMMA_TILES[bn]}, {epilogue}, {bn}>"


def wgmma_ln_name(ctype: str) -> str:
    """matmul_wgmma_ln's instantiation (WGMMA_LN_TILE)."""
    bn, stages = WGMMA_LN_TILE
    return f"matmul_wgmma_ln<{ctype}, {stages}, {bn}>"


def wgmma_tiles(m: int, n: int, bn: int) -> int:
    """matmul_wgmma's GEMM_BM x bn tiles of an (m, n) product."""
    return -(-m // GEMM_BM) * -(-n // bn)


def wgmma_x_rows(m: int) -> int:
    """The rows of matmul_wgmma's x box for m rows: 64 where it splits K (WGMMA_SPLIT_ROWS), else
    GEMM_BM; its stages expect exactly that many bytes."""
    return 64 if m <= WGMMA_SPLIT_ROWS else GEMM_BM


def wgmma_shared_mem(itemsize: int, bn: int, stages: int | None = None) -> int:
    """matmul_wgmma's dynamic shared memory for BN-column tiles: its K stages (WGMMA_TILES' by
    default), its two result buffers, 1024 (alignment)."""
    stages = WGMMA_TILES[bn] if stages is None else stages
    return (stages * (GEMM_BM + bn) * GEMM_BK + 2 * 64 * bn) * itemsize + 1024


GEMV_ROWS, GEMV_THREADS = 4, 128  # gemv.cu: most rows of x, threads per block

# gemv.cu: output columns a block, narrow or wide (_gemv: wide where it still gives every SM
# GEMV_WIDE_BLOCKS_PER_SM blocks; H100, 1-4 rows: 768->2304, 768->3072 and the LM head 0.1-3 us
# faster, 768->768 and 3072->768 0.1-0.9 us slower; 8 columns slower everywhere)
GEMV_COLS, GEMV_WIDE_BLOCKS_PER_SM = (2, 4), 2

# gemv.cu skinny_mma, for SKINNY_MIN_ROWS .. SKINNY_ROWS rows of 16-bit x (below, the wide gemv is faster) and
# products of SKINNY_MIN_COLUMNS output columns or more (an LM head; narrower ones cover too few SMs with 16-column
# blocks); its (16-column tiles, warps, chunks in flight) for up to `rows` rows of x (measurements:
# docs/gpu-internals.md, gemm.py SKINNY_ROWS)
SKINNY_ROWS, SKINNY_MIN_ROWS, SKINNY_MIN_COLUMNS = 32, 4, 16384
SKINNY_TILES = {8: (1, 4, 4), 16: (2, 4, 1), 32: (4, 4, 1)}

# skinny_mma with K split over the grid's rows, for a narrow product that residual_layernorm reads (attention output,
# FFN down: matmul_residual_layernorm), SPLIT_MIN_ROWS .. SKINNY_ROWS rows: float partial sums of SKINNY_SPLITS
# slices (the largest at most max(2, K / SPLIT_SLICE_K)); its (tiles, warps, chunks in flight) for up to `rows` rows.
# (measurements: docs/gpu-internals.md, gemm.py SPLIT_MIN_ROWS, SPLIT_SLICE_K)
SPLIT_MIN_ROWS, SPLIT_SLICE_K = 8, 384
SKINNY_SPLITS = (2, 4, 8)
SPLIT_TILES = {8: (1, 8, 2), 32: (2, 8, 2)}

# a long-K product that a residual + LayerNorm reads (FFN down), from BLAS_SPLIT_MIN_ROWS rows (GPT-2: where the
# skinny split above does not take it): cuBLAS computes its K slices as one strided batch of float32 partial sums,
# which the LayerNorm kernel adds up (no reduction kernel: blas_split_k). BLAS_SPLIT_OUTPUTS lists (most M x N
# outputs, slices). (measurements: docs/gpu-internals.md, gemm.py BLAS_SPLIT_MIN_ROWS, BLAS_SPLIT_MIN_K)
BLAS_SPLIT_MIN_ROWS, BLAS_SPLIT_MIN_K = 4, 2048
BLAS_SPLIT_OUTPUTS = ((256 * 768, 4), (1024 * 768, 2))


def skinny_name(ctype: str, out_ctype: str, tiles: tuple) -> str:
    """The skinny_mma instantiation of `tiles` (a SKINNY_TILES or SPLIT_TILES value)."""
    tiles, warps, unroll = tiles
    return f"skinny_mma<{ctype}, {out_ctype}, {tiles}, {warps}, {unroll}>"


# the slice counts of split products: cuBLAS's (blas_split_k), which BERT's and GPT-2's
# LayerNorm kernels read, and gemv.cu skinny_mma's, which GPT-2's reads
BLAS_SPLITS = tuple(s for _, s in BLAS_SPLIT_OUTPUTS)
SPLIT_COUNTS = tuple(sorted(set(SKINNY_SPLITS) | set(BLAS_SPLITS)))


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


# gemv.cu gemv_epilogue's codes past GELU's (1 + form): + bias, then the activation
GEMV_EPILOGUES = {"identity": 3, "relu": 4, "silu": 5}


def matmul_bias_act(out, x, weight, bias, *, act):
    """out (M, N) = act(x (M, K) @ weight (N, K)^T + bias) for act in GEMV_EPILOGUES, bias in out's
    dtype (float32 for an LM head's logits): in the epilogue of the few-row kernels (gemv.cu), so a
    decode step's feed-forward and logits bias take no pass of their own; else the product, then
    add_bias_act."""
    if _skinny_fits(x, weight):
        _skinny(out, x, weight, bias, GEMV_EPILOGUES[act])
    elif x.shape[0] <= GEMV_ROWS:
        _gemv(out, x, weight, bias, GEMV_EPILOGUES[act])
    else:
        _lt_matmul(out, x, weight)
        add_bias_act(out, out, bias, act=act)


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
        algo = algorithm(ctx, key, product, x)
        if not _planning():
            product(algo)


# Measurements: docs/gpu-internals.md, gemm.py matmul_bias_gelu
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
    WGMMA_NARROW_TILES_PER_SM tiles an SM, else 64 (figures: docs/gpu-internals.md)."""
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
            (out, out, bias, np.int32(n), np.int32(ACTIVATIONS[activation]), np.int32(bool(norm)), gamma, beta,
             np.float32(eps)))


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


# Measurements: docs/gpu-internals.md, gemm.py matmul_residual_layernorm
def matmul_residual_layernorm(hidden, normed, x, weight, bias, gamma, beta, *, eps, product, partials, rms=False):
    """hidden += x @ weight^T + bias; normed = LayerNorm(hidden), as norm_product then
    residual_layernorm (rms: T5's RMS norm)."""
    parts = norm_product(product, partials, x, weight)
    residual_layernorm(hidden, normed, parts, bias, gamma, beta, eps=eps, rms=rms)


def norm_product(product, partials, x, weight):
    """x @ weight^T for a residual + LayerNorm kernel to read, returned: into `product` (M, N); or,
    where split_k, or else blas_split_k, splits it, gemv.cu skinny_mma or cuBLAS sums each K slice
    into `partials` (float32, partials_size elements at least), returned as (slices, M, N), which
    the LayerNorm kernels add up (rows of whole 16-byte vectors)."""
    (m, k), n = x.shape, weight.shape[0]
    # the skinny split first: at 32 rows cuBLAS's took 1.6 us off a decode step graph, but after
    # other streams' kernels in the process (bench_decoder's note) it made top-k / top-p batch-32
    # generation 1.4 / 3.8 us a step slower (H100, HF's generate run first, medians of 6 alternating runs)
    skinny = split_k(m, n, k, x.dtype) if _skinny_operands(x, weight) else 1
    blas = blas_split_k(m, n, k, x.dtype) if skinny == 1 and weight.dtype == x.dtype else 1
    splits = max(skinny, blas)
    if splits == 1:
        matmul(product, x, weight)
        return product
    parts = _split_partials(partials, splits, m, n)
    if blas > 1:
        _split_product(parts, x, weight)
    else:
        _skinny(parts, x, weight, None, 0, table=SPLIT_TILES, splits=splits)
    return parts


# gemv_norm.cu gemv_norm: a product of up to NORM_PROLOGUE_ROWS rows (a decode step's) whose x is a pending residual +
# LayerNorm, computed by each of its blocks (a warp a row, up to NORM_ITEMS[-1] vectors a lane) while its weights
# arrive, instead of a LayerNorm kernel before it; NORM_PARTS_MAX_BYTES: the most product bytes a block reads for it.
# (measurements: docs/gpu-internals.md, gemm.py NORM_PROLOGUE_ROWS)
NORM_PROLOGUE_ROWS, NORM_ITEMS, NORM_PARTS_MAX_BYTES = GEMV_ROWS, (1, 2), 1 << 20
NORM_BLOCKS_PER_SM = 4  # gemv_norm.cu's: its grid is one wave of at most this many blocks an SM (change them together)


def norm_matmul(out, weight, bias=None, *, act=None, form="erf", parts, res_bias, hidden, hidden_out, normed,
                gamma, beta, eps, rms=False, post=False):
    """The residual + LayerNorm that norm_product's `parts` left pending, then the product that reads
    its output: pre-LayerNorm (post False) hidden + parts + res_bias, then x = LayerNorm of that sum
    (rms: T5's RMS norm), as residual_layernorm; post, x = LayerNorm(parts + res_bias + hidden), as
    add_bias_residual_layernorm. out = x @ weight^T (act None), act(... + bias) (matmul_bias_act's
    acts) or GELU(... + bias) of `form`. In one kernel (gemv_norm.cu gemv_norm) where _norm_fits: the sum
    goes to hidden_out (post: x), x stays on chip; else as those two kernels, then the product, with
    the sum in hidden (in place) and pre-LayerNorm's x in `normed`. Returns the array that holds the
    residual stream: hidden_out or hidden."""
    if _norm_fits(out, weight, parts, hidden, hidden_out):
        _gemv_norm(out, weight, bias, _epilogue(act, form), parts, res_bias, hidden, hidden_out, gamma, beta, eps,
                   rms, post)
        return hidden_out
    if post:
        add_bias_residual_layernorm(hidden, parts, res_bias, hidden, gamma, beta, eps=eps)
        x = hidden
    else:
        residual_layernorm(hidden, normed, parts, res_bias, gamma, beta, eps=eps, rms=rms)
        x = normed
    matmul_act(out, x, weight, bias, act=act, form=form)
    return hidden


def matmul_act(out, x, weight, bias=None, *, act=None, form="erf"):
    """out = x @ weight^T (act None), GELU(... + bias) of `form` (act "gelu": matmul_bias_gelu), or
    act(... + bias) for matmul_bias_act's acts: the product a decoder layer names by its activation."""
    if act is None:
        matmul(out, x, weight)
    elif act == "gelu":
        matmul_bias_gelu(out, x, weight, bias, form=form)
    else:
        matmul_bias_act(out, x, weight, bias, act=act)


def _epilogue(act, form) -> int:
    """gemv.cu's epilogue code for norm_matmul's act (None: none) and GELU form."""
    if act is None:
        return 0
    return 1 + _gelu_form(form) if act == "gelu" else GEMV_EPILOGUES[act]


def _norm_fits(out, weight, parts, hidden, hidden_out) -> bool:
    """Whether norm_matmul runs gemv_norm.cu gemv_norm: up to NORM_PROLOGUE_ROWS rows where matmul would
    run the gemv (not the skinny kernel), one storage type, rows of whole vectors of the widest width
    within NORM_ITEMS[-1] vectors a lane, x's rows in shared memory (48 KiB), a product as stored or in
    BLAS_SPLITS float slices of at most NORM_PARTS_MAX_BYTES, hidden_out apart from hidden, and one
    group of columns a block (NORM_BLOCKS_PER_SM blocks an SM at most: a block that took two was
    slower than the two kernels)."""
    m, k = hidden.shape
    vec = VECS[_ctype(hidden)][0]
    return bool(m <= NORM_PROLOGUE_ROWS and weight.dtype == hidden.dtype == out.dtype and weight.shape[1] == k
                and (parts.ndim == 2 and parts.dtype == hidden.dtype
                     or parts.dtype == np.float32 and parts.shape[0] in (1, *BLAS_SPLITS))
                and not (SKINNY_MIN_ROWS <= m and weight.shape[0] >= SKINNY_MIN_COLUMNS)
                and k % vec == 0 and k // vec <= 32 * NORM_ITEMS[-1] and m * k * hidden.itemsize <= 48 * 1024
                and parts.nbytes <= NORM_PARTS_MAX_BYTES and hidden_out.data.ptr != hidden.data.ptr
                and -(-weight.shape[0] // _norm_cols(weight.shape[0])) <= NORM_BLOCKS_PER_SM * context().sm_count
                and all(a.data.ptr % 16 == 0 for a in (weight, parts, hidden, hidden_out)))


def norm_name(ctype: str, slices: int, cols: int, items: int, post: bool) -> str:
    """gemv_norm's instantiation for storage type ctype (rows in its widest vectors), a product as
    stored (slices 1) or as float partial sums of that many slices."""
    return (f"gemv_norm<{ctype}, {ctype if slices == 1 else 'float'}, {slices}, {ctype}, {VECS[ctype][0]}, {cols}, "
            f"{items}, {int(post)}>")


def norm_items(ctype: str, k: int) -> int:
    """gemv_norm's vectors a lane for rows of k elements of ctype."""
    return min(i for i in NORM_ITEMS if 32 * i * VECS[ctype][0] >= k)


def norm_kernels(ctype: str, k: int | None = None, post: bool | None = None) -> list[str]:
    """gemv_norm's instantiations for ctype: a product as stored or (16-bit types) split into
    BLAS_SPLITS float slices (the only splits at NORM_PROLOGUE_ROWS rows), each GEMV_COLS width, for
    rows of k elements (None: every NORM_ITEMS; none for rows longer than it takes) and post (None:
    both forms)."""
    if k is not None and k > 32 * NORM_ITEMS[-1] * VECS[ctype][0]:
        return []
    slices = (1,) if ctype == "float" else (1, *BLAS_SPLITS)
    items = NORM_ITEMS if k is None else (norm_items(ctype, k),)
    posts = (False, True) if post is None else (post,)
    return [norm_name(ctype, s, c, i, p) for p in posts for i in items for s in slices for c in GEMV_COLS]


def _norm_cols(n: int) -> int:
    """gemv_norm's columns a group for n output columns: as the gemv's (_gemv)."""
    narrow, wide = GEMV_COLS
    return wide if n >= wide * GEMV_WIDE_BLOCKS_PER_SM * context().sm_count else narrow


def _gemv_norm(out, weight, bias, epilogue, parts, res_bias, hidden, hidden_out, gamma, beta, eps, rms, post):
    (m, k), n = hidden.shape, weight.shape[0]
    t = _ctype(hidden)
    slices = parts.shape[0] if parts.ndim == 3 else 1
    cols = _norm_cols(n)
    _launch("gemv_norm.cu", norm_name(t, slices, cols, norm_items(t, k), post), (-(-n // cols),), (GEMV_THREADS,),
            (out, weight, weight if bias is None else bias, parts, res_bias, hidden, hidden_out, gamma, beta,
             np.int32(m), np.int32(n), np.int32(k), np.int32(epilogue), np.float32(eps), np.int32(rms)),
            shared_mem=m * k * hidden.itemsize)


# Measurements: docs/gpu-internals.md, gemm.py matmul_bias_residual_layernorm
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
