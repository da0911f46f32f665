"""Compile kernels_cu/*.cu with cupy.RawModule: one module per (file, element type), on demand.

common.cuh is prepended to each source (not #included) so that CuPy's compile cache key
covers it. Each op family lists its template instantiations here, in one place. A runner
calls `prepare` with the files and types it uses, which compiles them in parallel.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from . import kernel_dir

# numpy storage dtype name -> CUDA element type (bf16 is stored as uint16 words)
CUDA_TYPES = {"float32": "float", "float16": "__half", "uint16": "__nv_bfloat16"}
SOFTMAX_PER_LANE = (1, 2, 4, 8, 16, 32)     # warp kernel: S <= 32 * PER_LANE
SOFTMAX_VEC = {"float": 4, "__half": 8, "__nv_bfloat16": 8}  # 16 bytes
# vector widths (elements) per type, widest first: at most 16 bytes
VECS = {"float": (4, 2, 1), "__half": (8, 4, 2, 1), "__nv_bfloat16": (8, 4, 2, 1)}
ROW_ITEMS = (1, 4)  # vectors per thread in the row (LayerNorm) kernels
# layernorm.cu add_bias_residual_layernorm with a warp a row (LN_ROW_WARPS rows a block, up to
# ROW_WARP_ITEMS[-1] 16-byte vectors a lane: no block barrier, more rows in flight): ops.
# add_bias_residual_layernorm takes it for such rows from LN_WARP_MIN_ROWS to LN_WARP_MAX_ROWS rows.
# H100 fp16, 2026-11-26, us, a block a row -> a warp a row, at 512 / 1,024 / 4,096 / 8,192 / 16,384 /
# 32,768 rows: 384 columns (all-MiniLM-L6-v2) 2.16 / 2.53 / 4.74 / 7.26 / 12.38 / 27.86 -> 2.04 / 2.17 /
# 3.23 / 5.48 / 11.00 / 28.10; 512 columns 2.14 / 2.53 / 4.79 / 7.25 / 18.29 / 34.92 -> 2.05 / 2.24 /
# 3.64 / 5.83 / 19.24 / 35.91; 256 columns 2.07 / 2.42 / 4.49 / 6.94 / 11.86 / 22.55 -> 1.66 / 1.74 /
# 2.46 / 3.47 / 5.59 / 18.32 (768 columns, three vectors a lane, lost: 5.39 -> 5.82 at 4,096 rows;
# two warps a row there, a scratch kernel: 1,024 / 2,048 / 4,096 / 8,192 rows 2.67 / 3.71 / 5.26 / 10.52
# -> 2.50 / 3.20 / 5.11 / 10.72, too little for BERT-base's passes to route it).
# all-MiniLM-L6-v2's 32 x 128 pass, GPU only: 0.366 -> 0.349 ms.
ROW_WARP_ITEMS, LN_ROW_WARPS, LN_WARP_MIN_ROWS, LN_WARP_MAX_ROWS = (1, 2), 4, 1024, 8192
VARLEN_HEAD_DIMS = (32, 64, 128)  # fused attention (attention_varlen.cu)
VARLEN_BLOCK_M = 64               # its query tile (fp32)
# tensor-core kernel tiles: (warps, 16-query tiles per warp, keys per K/V tile); narrow by
# default, wide (twice the queries per warp) for sequences of 1024+ at head dim <= 64 with blocks
# for every SM twice (measured on the H100 by kernels_cu/dev/attention_tiles.py)
VARLEN_TILES = {"narrow": (4, 1, 64), "wide": (4, 2, 64)}
ATTENTION_FLAGS = {"rows_are_tokens": 1, "indirect": 2, "write_kv": 4}  # decoder.cu cached_attention
ATTENTION_THREADS = 256           # its block (ATTN_THREADS); half that from ATTENTION_MANY_BLOCKS (row, head) blocks
ATTENTION_MANY_BLOCKS = 256       # on (GPT-2 small, H100: b32 step 572 -> 524 us, beam 4 x 32 1083 -> 945 us)
GELU_ROWS = 4                     # activation.cu add_bias_gelu: rows per block
# gemm_sm90.cu matmul_wgmma (sm_90a): its tile rows and K step (GEMM_BM, GEMM_BK), threads, and per
# tile width BN the K stages in shared memory (WGMMA_TILES); ops.matmul_bias_gelu takes it for the
# erf form, 256-column tiles from WGMMA_GELU_MIN_OUTPUTS outputs (rows x columns) on. H100 fp16, us,
# against cuBLASLt's product + the bias + GELU pass (kernels_cu/dev/gemm_tiles.py, 2026-11-25, the
# package's kernel): BERT-base's 768 -> 3,072 at 32,768 rows 306.9 against 349.5, 8,192 rows 81.4
# against 90.6, 4,096 rows 41.8 against 46.5, 1,024 rows 15.5 against 13.7; all-MiniLM-L6-v2's 384 ->
# 1,536 at 32,768 rows 105.4 against 132.8, 8,192 rows (4,096 x 3,072 outputs) 28.9 against 30.3,
# 4,096 rows 19.9 against 17.5. Since each stage is released as soon as its products are done and the
# erf GELU takes one MUFU operation (later the same day): 299.4 against 368.5 at 32,768 rows, 39.4
# against 42.8 at 4,096; all-MiniLM-L6-v2's 101.5 against 135.1 (bench/results/gemm.md).
# Below WGMMA_GELU_MIN_OUTPUTS, products of K <= WGMMA_NARROW_MAX_K or of WGMMA_SPLIT_ROWS rows or
# fewer (where the kernel splits K between its two consumer warpgroups) take the narrow tiles: 128
# columns where that makes WGMMA_NARROW_TILES_PER_SM tiles an SM or more, else 64 (H100, 2026-11-25,
# us against cuBLASLt + the pass: all-MiniLM-L6-v2's 384 -> 1,536 at 16-64 rows 3.8-3.9 against 4.8,
# 128-512 rows 4.7-5.0 against 5.0-5.8, 1,024 rows (128) 6.7-7.4 against 7.1-7.2, 2,048 rows 10.9-11.2
# against 10.5-10.6, 4,096 rows 15.7 against 17.3; BERT-base's 768 -> 3,072 at 16-64 rows 4.8-5.0
# against 5.7-6.0, x's box then 64 rows). At BERT-base's K = 768 past 64 rows they do not win (128-256
# rows 6.4-6.8 against 6.6-7.2, 1,024 rows 15.7-16.4 against 13.4): there a tile's K steps take longer
# than cuBLASLt's whole product, whatever the ring's depth. GPU-only passes (captured, replayed),
# cuBLASLt + the pass -> the narrow tiles, ms: all-MiniLM-L6-v2 at 1 x 16 / 1 x 128 / 4 x 128 / 32 x
# 128 tokens 0.134 / 0.149 / 0.184 / 0.398 -> 0.130 / 0.145 / 0.173 / 0.390; BERT-base at 1 x 16 / 1 x
# 64 0.336 / 0.348 -> 0.325 / 0.339 (1 x 128 and up unchanged: the same route).
GEMM_BM, GEMM_BK, GEMM_THREADS = 128, 64, 288
# The 128-column tile at BERT-base's 4,096 x 3,072 x 768 instead (WGMMA_GELU_MIN_OUTPUTS 8,192 x 3,072,
# WGMMA_NARROW_MAX_K 768): BERT-base 32 x 128 end to end 1.62-1.64 -> 1.67-1.68 ms (H100, 2026-11-26,
# three alternating rounds).
WGMMA_TILES = {256: 3, 128: 4, 64: 8}
WGMMA_GELU_MIN_OUTPUTS = 4096 * 3072
# (WGMMA_SPLIT_ROWS is gemm_sm90.cu's split_k test, M <= 64, and ops.py's x box then: change them together)
WGMMA_NARROW_MAX_K, WGMMA_SPLIT_ROWS, WGMMA_NARROW_TILES_PER_SM = 384, 64, 0.5
# gemm_sm90.cu matmul_wgmma_ln (the product + bias + residual + LayerNorm, a cluster of blocks across
# each row): its tile width and stages (WGMMA_LN_TILE), the widest row it takes (LN_CLUSTER_MAX tiles)
# and the rows from which ops.matmul_bias_residual_layernorm takes it (WGMMA_LN_MIN_ROWS). H100 fp16,
# 2026-11-25, us, fused against cuBLASLt + the LayerNorm kernel, K -> N: all-MiniLM-L6-v2's 384 -> 384
# at 4,096 / 8,192 / 16,384 / 32,768 rows 10.9 / 11.8 / 20.8 / 44.5 against 9.2 / 13.1 / 25.4 / 51.7,
# 1,536 -> 384 18.7 / 20.8 / 42.9 / 80.6 against 13.5 / 24.4 / 44.3 / 86.9 (three 128-column blocks
# instead of two 192-column ones: 55.6 and 99.3 at 32,768 rows). BERT-base's rows (768: clusters of
# 4, of which an H100 runs 30 at once, against 66 of 2) gain nothing: 768 -> 768 at 4,096 / 32,768
# rows 24.9 / 113.1 against 14.5 / 108.8, 3,072 -> 768 58.6 / 265.8 against 33.7 / 268.7. Clusters
# of 3 with 256 columns (39 at once) would need more than the 168 registers a thread of a 288-thread
# block gets (three warps share a quarter of the register file): they spill. A block's tile takes
# about 12 us at K = 768 (the ring's fill and the epilogue) where cuBLASLt's smaller tiles fill every
# SM: below 8,192 rows the fused kernel loses at every width. End to end, clusters of 4 for BERT-base's
# 768-column rows (LN_CLUSTER_MAX 4) gained nothing either, though they save the LayerNorm pass's
# memory traffic at the 700 W limit that large batches run at (kernels_cu/dev/gemm_tiles.py): H100,
# 2026-11-26, BERT-base fp16 packed, ms end to end / GPU only, three alternating rounds, 2 -> 4: 256 x
# 128 11.57-12.17 / 11.93-12.08 -> 11.97-12.41 / 11.73-12.12, 64 x 512 13.13-13.45 / 13.03-13.12 ->
# 13.44-13.71 / 13.18-13.28.
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
# gemv.cu: output columns a block, narrow or wide (ops.py: wide where it still gives every SM
# GEMV_WIDE_BLOCKS_PER_SM blocks; H100, 1-4 rows: 768->2304, 768->3072 and the LM head 0.1-3 us
# faster, 768->768 and 3072->768 0.1-0.9 us slower; 8 columns slower everywhere)
GEMV_COLS, GEMV_WIDE_BLOCKS_PER_SM = (2, 4), 2
# gemv.cu skinny_mma, for SKINNY_MIN_ROWS .. SKINNY_ROWS rows of 16-bit x (below, the wide gemv is
# faster: GPT-2's LM head at 2 rows 28.3 against 30.9 us, at 3 rows 30.7 against 31.0; at 4 rows 33.8
# against 31.1) and products of SKINNY_MIN_COLUMNS output columns or more (an LM head; narrower ones
# cover too few SMs with 16-column blocks: cuBLAS wins there); its (16-column tiles, warps, chunks in
# flight) for up to `rows` rows of x, chosen on the H100 by kernels_cu/dev/skinny_tiles.py (one chunk
# in flight, a candidate since 2026-11-24: GPT-2's LM head at 16 rows 36.7 -> 33.9 us, at 32 rows
# 39.3 -> 37.3; at 4-8 rows it lost 0.3-0.4 us)
SKINNY_ROWS, SKINNY_MIN_ROWS, SKINNY_MIN_COLUMNS = 32, 4, 16384
SKINNY_TILES = {8: (1, 4, 4), 16: (2, 4, 1), 32: (4, 4, 1)}
# skinny_mma with K split over the grid's rows, for a narrow product that residual_layernorm reads
# (attention output, FFN down: ops.py matmul_residual_layernorm), SPLIT_MIN_ROWS .. SKINNY_ROWS rows:
# float partial sums of SKINNY_SPLITS slices (the largest at most max(2, K / SPLIT_SLICE_K)); its
# (tiles, warps, chunks in flight) for up to `rows` rows. H100, weights read from memory
# (kernels_cu/dev/skinny_split.py), product + residual_layernorm at 32 rows against cuBLASLt's:
# 768->768 5.42 against 6.05 us, 3072->768 7.19 against 8.31; at 8 rows 4.90 / 6.69 against 5.84 / 8.02
SPLIT_MIN_ROWS, SPLIT_SLICE_K = 8, 384
SKINNY_SPLITS = (2, 4, 8)
SPLIT_TILES = {8: (1, 8, 2), 32: (2, 8, 2)}
# a long-K product that a residual + LayerNorm reads (FFN down), from BLAS_SPLIT_MIN_ROWS rows (GPT-2:
# where the skinny split above does not take it): cuBLAS computes its K slices as one strided batch of
# float32 partial sums, which the LayerNorm kernel adds up (no reduction kernel: ops.py blas_split_k).
# BLAS_SPLIT_OUTPUTS lists (most M x N outputs, slices).
# H100 fp16, 768 outputs a row, product + residual_layernorm, us, before -> split (best slices),
# K = 3072: 4 rows 6.5 -> 5.6 (4), 32 rows 6.7 -> 5.8 (4), 128 rows 8.5 -> 6.7 (4), 256 rows 8.8 -> 7.3
# (4), 512 rows 10.3 -> 9.7 (2), 1024 rows 14.0 -> 12.8 (2), 2048 rows 18.4 -> 22.5 (2: none taken);
# K = 768 gains at most 0.4 us (48-512 rows) and loses at 32 rows or fewer: none taken. Captured passes,
# us: GPT-2 small decode step at 4 rows 339.9 -> 321.6 (8 and 32 rows, against the skinny split:
# 345.5 -> 339.9 and 432.9 -> 431.3, but see ops.matmul_residual_layernorm);
# prefill 4 x 64 434.3 -> 418.4, 1 x 512 549.6 -> 542.5; BERT-base layers 1 x 128 381.0 -> 363.6,
# 8 x 128 637.0 -> 621.1
# Two slices up to 4,096 rows (BLAS_SPLIT_OUTPUTS' second entry 4,096 x 768) measured slower (H100,
# 2026-11-26, ms end to end / GPU only, three alternating rounds): BERT-base 32 x 128 1.62-1.64 /
# 1.56-1.62 -> 1.73-1.75 / 1.72-1.74, GPT-2 prefill 32 x 128 1.80 / 1.65-1.68 -> 1.90-1.91 / 1.76.
BLAS_SPLIT_MIN_ROWS, BLAS_SPLIT_MIN_K = 4, 2048
BLAS_SPLIT_OUTPUTS = ((256 * 768, 4), (1024 * 768, 2))
# sampling.cu token choice: threads per block, the most slices per row, the fewest tokens a slice
# gets, histogram bins and the u64 words of a row's state (the bins and 8 words)
CHOICE_THREADS, CHOICE_SLICES_MAX, CHOICE_SLICE_MIN = 256, 64, 1024
CHOICE_BINS, CHOICE_STATE_WORDS = 2048, 2048 + 8
# pooling.cu: the warps a block may have (they split a sequence's rows), and the most warps a launch
# takes an SM (ops._pool_warps: the most warps a block such that the launch stays within them, else the
# fewest). H100 fp16, 2026-11-26, us, mean pooling, BERT-base's 768 columns at batch x tokens, one
# thread a column over every row (before) / 2 / 4 / 8 warps a block: 1 x 128 6.84 / 3.93 / 2.59 / 1.94,
# 32 x 128 7.16 / 4.41 / 3.10 / 2.73, 64 x 128 7.23 / 5.15 / 4.11 / 4.41, 128 x 128 7.48 / 6.42 / 7.16 /
# 7.55, 256 x 128 24.33 / 25.18 / 24.18 / 26.94, 64 x 512 61.15 / 35.18 / 23.58 / 24.59, 16 x 2,048
# 225.9 / 116.3 / 61.8 / 34.7; all-MiniLM-L6-v2's 384 at 1 x 16 1.82 / 1.54 / 1.32 / 1.52, 256 x 128
# 7.44 / 6.33 / 7.31 / 7.50
POOL_WARPS, POOL_WARPS_PER_SM = (2, 4, 8), 48
FP8_KERNELS = ("quantize_rows", "add_bias_residual_layernorm_quantize", "add_bias_gelu_quantize")  # a block per row
# sampling.cu choose_sample (sm_90: a thread-block cluster per row): threads per block, the most
# blocks of a cluster (a power of two), the u32 words of a block's histogram (three pieces of each
# bin's mass), the most tokens a block holds (no piece's sum passes 32 bits) and the room for a
# select's candidates past its first digit. Fewer blocks a row, choose_tokens alone (H100, 2026-11-26,
# us, 2 / 4 / 8 blocks, two runs alike): batch 32 top-k 40 36.2 / 29.3 / 25.8, top-p 0.9 54.7 / 42.1 /
# 38.4, sampling alone 24.2 / 17.7 / 13.9; batch 1 top-k 40 34.8 / 22.8 / 18.8. Each halving of the
# slice saves less than the one before: about 20 us of a batch-32 top-k choice do not depend on the
# slice (its barriers and exchanges), so 16 blocks (a non-portable cluster size) would gain 2-3 us.
SAMPLE_THREADS, SAMPLE_CLUSTER_MAX, SAMPLE_HIST_WORDS, SAMPLE_SLICE_MAX = 256, 8, 3 * 2048, 65536
SAMPLE_CANDIDATES = 2048
# attention_sm90.cu (wgmma): its head dims, queries per block (one warpgroup: two a block measured
# slower at every shape, on the first kernel and again on today's, and two 16-row tiles a warp slower
# but at 16 x 2,048 tokens: kernels_cu/dev/attention_wgmma.py) and keys per K/V tile. A query tile's
# keys split over 2 or 4 blocks where the grid leaves SMs idle (short batches), the blocks' states
# merged through distributed shared memory in a cluster, was right (max abs err 2e-5 pooled, 0.003
# logits) but slower (H100, fp16, 2026-11-26, ms, GPU-only passes replayed): BERT-base 1 x 128 0.373
# -> 0.424 (2 blocks), 1 x 512 0.551 -> 0.622 (2) / 1.055 (4), GPT-2 prefill 1 x 512 0.551 -> 0.629 /
# 1.050; without the cluster and the merge (outputs wrong, timing only) 0.364, 0.530 / 0.532 and
# 0.530 / 0.521: what the split saves (under 3 us a layer) is less than the merge costs. As a
# persistent kernel (4 blocks an SM taking the (query tile, sequence, head) items in turn, the next
# item's queries (cp.async into a second buffer, the bias added once they land) and first K/V tile
# copied during the current item's last tile), the same bits but slower (H100, fp16, 2026-11-26, us,
# three alternating rounds, torch SDPA in brackets): 64 x 512 164-175 -> 180-194 (135), 16 x 2,048
# 571-604 -> 625-667 (449), 256 x 128 81.9 -> 79.3-80.1 (72.1), 32 x 128 12.2 -> 14.2, 1 x 128 3.8 ->
# 4.2, head dim 32 at 64 x 512 216 -> 253-266, causal 4 x 1,024 32.5 -> 39.0; BERT-base passes (GPU
# replay, ms) 256 x 128 12.08-12.17 -> 12.02-12.04, 64 x 512 13.47-13.55 -> 13.61: a block's start
# (its queries' and first tile's latency) is not what the per-tile kernel loses to SDPA.
VARLEN_WG_HEAD_DIMS, VARLEN_WG_BLOCK_M, VARLEN_WG_KN = (64, 32), 64, 64
# attention_sm90.cu varlen_attention_wgmma_tma (TMA copies, S from shared memory; figures there): head
# dim 64, batches whose longest sequence passes VARLEN_WG_TMA_MIN_SEQ (more than two key tiles a
# block); shorter ones keep varlen_attention_wgmma, 1 us a block faster there (H100: BERT-base's 32 x
# 128 attention 12.3 against 13.2 us)
VARLEN_WG_TMA_MIN_SEQ = 2 * VARLEN_WG_KN + 1
SAMPLING_KERNELS = ["choose_prepare", "choose_level", "choose_draw", "choose_sample<false>", "choose_sample<true>",
                    "mark_seen", "append_tokens", "increment", "beam_logsumexp", "beam_candidates", "beam_select"]


def varlen_mma_name(ctype: str, d: int, general: bool, tiles: str) -> str:
    """The tensor-core varlen attention kernel for head dim d and the VARLEN_TILES entry `tiles`;
    the narrow kernels (plain and general) ask the register allocator for 4 blocks per SM (2 at
    head dim 128)."""
    warps, mt, kn = VARLEN_TILES[tiles]
    min_blocks = 0 if tiles != "narrow" else (4 if d <= 64 else 2)
    return f"varlen_attention_mma<{ctype}, {d}, {'true' if general else 'false'}, {warps}, {mt}, {kn}, {min_blocks}>"


def skinny_name(ctype: str, out_ctype: str, tiles: tuple) -> str:
    """The skinny_mma instantiation of `tiles` (a SKINNY_TILES or SPLIT_TILES value)."""
    tiles, warps, unroll = tiles
    return f"skinny_mma<{ctype}, {out_ctype}, {tiles}, {warps}, {unroll}>"


def _softmax_variants(t: str) -> list[str]:
    names = [f"masked_softmax_block<{t}>"]
    for per_lane in SOFTMAX_PER_LANE:
        names.append(f"masked_softmax_warp<{t}, {per_lane}, 1>")
        if per_lane % SOFTMAX_VEC[t] == 0:
            names.append(f"masked_softmax_warp<{t}, {per_lane}, {SOFTMAX_VEC[t]}>")
    return names


# file -> kernel templates; each is instantiated for every type in CUDA_TYPES
def _row_variants(kernel: str, t: str) -> list[str]:
    return [f"{kernel}<{t}, {v}, {i}>" for v in VECS[t] for i in ROW_ITEMS]


def _vec_variants(kernel: str, t: str) -> list[str]:
    return [f"{kernel}<{t}, {v}>" for v in VECS[t]]


def _after_product_variants(kernel: str, t: str, splits) -> list[str]:
    """A row kernel <T, X, SPLITS, VEC, ITEMS> that reads a product: a plain one (X = T), and
    (16-bit types, rows of whole 16-byte vectors) a split one's float partial sums of each count
    in `splits`."""
    plain = [f"{kernel}<{t}, {t}, 1, {v}, {i}>" for v in VECS[t] for i in ROW_ITEMS]
    split = [f"{kernel}<{t}, float, {s}, {VECS[t][0]}, {i}>" for s in splits for i in ROW_ITEMS]
    return plain + ([] if t == "float" else split)


# the slice counts of split products: cuBLAS's (ops.py blas_split_k), which BERT's and GPT-2's
# LayerNorm kernels read, and gemv.cu skinny_mma's, which GPT-2's reads
BLAS_SPLITS = tuple(s for _, s in BLAS_SPLIT_OUTPUTS)
SPLIT_COUNTS = tuple(sorted(set(SKINNY_SPLITS) | set(BLAS_SPLITS)))


FAMILIES = {
    "embedding.cu": lambda t: _row_variants("embed_layernorm", t),
    "layernorm.cu": lambda t: _after_product_variants("add_bias_residual_layernorm", t, BLAS_SPLITS)
    + [f"add_bias_residual_layernorm<{t}, {t}, 1, {VECS[t][0]}, {i}, {LN_ROW_WARPS}>" for i in ROW_WARP_ITEMS],
    "activation.cu": lambda t: _vec_variants("add_bias_gelu", t) + _vec_variants("gated_gelu", t),
    "rotary.cu": lambda t: [f"rotary_qkv<{t}>"],
    "attention.cu": lambda t: (_vec_variants("add_qkv_bias_split_heads", t) + _vec_variants("merge_heads", t)
                               + _softmax_variants(t) + [f"add_relative_bias<{t}>"]),
    "attention_varlen.cu": lambda t: ([f"varlen_attention_simt<{d}>" for d in VARLEN_HEAD_DIMS] if t == "float" else
                                      [varlen_mma_name(t, d, g, tiles) for d in VARLEN_HEAD_DIMS
                                       for g in (False, True) for tiles in VARLEN_TILES
                                       if tiles == "narrow" or d <= 64]),
    "pooling.cu": lambda t: [f"{k}<{t}, {w}>" for k in ("pool", "pool_packed") for w in POOL_WARPS],
    "decoder.cu": lambda t: (_vec_variants("embed_positions", t) + _row_variants("layernorm", t)
                             + _vec_variants("add_bias_residual", t)
                             + _after_product_variants("residual_layernorm", t, SPLIT_COUNTS)
                             + _vec_variants("write_kv_cache", t) + _vec_variants("cached_attention", t)
                             + _vec_variants("gather_rows", t)),
    "sampling.cu": lambda t: [],
    "gemv.cu": lambda t: ([f"gemv<{t}, {o}, {v}, {c}>" for o in dict.fromkeys((t, "float")) for v in VECS[t]
                           for c in GEMV_COLS]
                          + ([] if t == "float" else [skinny_name(t, o, tiles) for o in (t, "float")
                                                      for tiles in SKINNY_TILES.values()]
                             + [skinny_name(t, "float", tiles) for tiles in SPLIT_TILES.values()])),
    # dtype fp8: fp16 activations, e4m3 product operands (sm_89+)
    "fp8.cu": lambda t: ([n for k in FP8_KERNELS for n in _row_variants(k, t)] if t == "__half" else []),
    # wgmma (sm_90a: ARCH_SPECIFIC)
    "attention_sm90.cu": lambda t: [] if t == "float" else ([f"varlen_attention_wgmma<{t}, {d}>"
                                                             for d in VARLEN_WG_HEAD_DIMS]
                                                            + [f"varlen_attention_wgmma_tma<{t}>"]),
    "gemm_sm90.cu": lambda t: [] if t == "float" else [wgmma_name(t, bn, 1) for bn in WGMMA_TILES] + [wgmma_ln_name(t)],
}
# files of arch-specific instructions (sm_90a: wgmma), which run on that exact architecture only:
# file -> (NVRTC's target, the compute capability it runs on, the files its source follows). They
# are compiled by NVRTC for that target (CuPy's RawModule targets the plain sm_XY of the device)
# and used on GPUs of that compute capability alone.
ARCH_SPECIFIC = {"attention_sm90.cu": ("sm_90a", (9, 0), ("attention_varlen.cu", "sm90.cuh")),
                 "gemm_sm90.cu": ("sm_90a", (9, 0), ("sm90.cuh",))}
# file -> kernels every dtype uses (not templated on the element type): one module of their own,
# so that an fp16 run never compiles the fp32 instantiations (the fp32 varlen attention alone
# takes 17 s to compile on an H100)
SHARED = {"pooling.cu": ["l2_normalize<float>"], "sampling.cu": SAMPLING_KERNELS,
          "gemv.cu": ["prefetch_l2", "prefetch_kv"], "activation.cu": ["add_bias_act<float>"]}
SHARED_KEY = "shared"


def compile_options() -> tuple[str, ...]:
    options = ["--std=c++17", "-DNDEBUG"]
    include = "/usr/local/cuda/include"  # NVRTC may not find the toolkit headers on its own
    if os.path.isdir(include):
        options.append(f"-I{include}")
    return tuple(options)


def source(file: str) -> str:
    """common.cuh, then the files an ARCH_SPECIFIC file's source follows, then the file."""
    folder = kernel_dir()
    parts = ("common.cuh", *(ARCH_SPECIFIC[file][2] if file in ARCH_SPECIFIC else ()), file)
    return "\n".join((folder / part).read_text() for part in parts)


def instantiations(file: str, ctype: str) -> list[str]:
    """The kernels of `file` in the module for element type `ctype`, or SHARED_KEY's."""
    return SHARED.get(file, []) if ctype == SHARED_KEY else FAMILIES[file](ctype)


def all_instantiations(file: str) -> list[str]:
    return [n for t in (*CUDA_TYPES.values(), SHARED_KEY) for n in instantiations(file, t)]


@lru_cache(maxsize=None)
def _owner(file: str, name: str) -> str:
    """The module (element type or SHARED_KEY) that holds kernel `name` of `file`."""
    for key in (*CUDA_TYPES.values(), SHARED_KEY):
        if name in instantiations(file, key):
            return key
    raise KeyError(f"{file} lists no kernel {name!r}")


_compile_locks: dict = {}
_modules: dict = {}
_modules_lock = threading.Lock()


def kernel_cache_dir() -> str:
    """CuPy's on-disk kernel cache, where the arch-specific modules are kept beside CuPy's own."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


class ArchKernel:
    """A kernel of an ArchModule, with the part of CuPy's RawKernel that ops.py uses: `kernel` (the
    loaded function; launched through launch_ex) and `max_dynamic_shared_size_bytes`."""

    def __init__(self, function):
        self.kernel = function

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from cupy.cuda import driver
        return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.kernel.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, size: int):
        from cupy.cuda import driver
        driver.funcSetAttribute(self.kernel.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, size)


class ArchModule:
    """`names` (template instantiations) of `code` compiled by NVRTC for the arch-specific target
    `arch` (e.g. sm_90a) and loaded; the cubin is kept in the kernel cache, keyed by the source,
    names, options and NVRTC's version."""

    def __init__(self, code: str, names, arch: str):
        from cupy.cuda import function
        from cupy_backends.cuda.libs import nvrtc
        options = (*compile_options(), f"--gpu-architecture={arch}")
        key = json.dumps([code, sorted(names), options, list(nvrtc.getVersion())])
        path = os.path.join(kernel_cache_dir(), f"ftengine_{arch}_{hashlib.sha256(key.encode()).hexdigest()}.cubin")
        try:
            with open(path, "rb") as f:
                header, cubin = f.read().split(b"\n", 1)
            lowered = json.loads(header)
        except (OSError, ValueError):
            lowered, cubin = self._compile(nvrtc, code, names, options)
            os.makedirs(kernel_cache_dir(), exist_ok=True)
            part = f"{path}.{os.getpid()}.{threading.get_ident()}.part"
            with open(part, "wb") as f:
                f.write(json.dumps(lowered).encode() + b"\n" + cubin)
            os.replace(part, path)
        self._module = function.Module()
        self._module.load(cubin)
        self._lowered = lowered

    @staticmethod
    def _compile(nvrtc, code: str, names, options) -> tuple[dict, bytes]:
        program = nvrtc.createProgram(code, "kernels.cu", [], [])
        try:
            for n in names:
                nvrtc.addNameExpression(program, n)
            try:
                nvrtc.compileProgram(program, list(options))
            except nvrtc.NVRTCError as e:
                raise RuntimeError(f"NVRTC failed for {options[-1]}: {e}\n{nvrtc.getProgramLog(program)}") from None
            return {n: nvrtc.getLoweredName(program, n) for n in names}, nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)

    def get_function(self, name: str) -> ArchKernel:
        return ArchKernel(self._module.get_function(self._lowered[name]))


def module(file: str, ctype: str):
    """One compiled module per (file, element type): a run compiles only the types it uses.
    Thread-safe; two threads asking for one module compile it once."""
    key = (file, ctype)
    found = _modules.get(key)
    if found is not None:
        return found
    with _modules_lock:
        lock = _compile_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _modules:
            import cupy
            if file in ARCH_SPECIFIC:
                _modules[key] = ArchModule(source(file), instantiations(file, ctype), ARCH_SPECIFIC[file][0])
            else:
                _modules[key] = cupy.RawModule(code=source(file), options=compile_options(),
                                               name_expressions=instantiations(file, ctype))
    return _modules[key]


def prepare(files, ctypes, *, workers: int = 8):
    """Compile (or load from CuPy's disk cache) the modules of `files` for element types
    `ctypes`, and their shared kernels, in parallel threads: NVRTC runs without the GIL, so a
    cold start costs about the slowest module instead of their sum."""
    import cupy
    keys = [(f, t) for f in files for t in (*dict.fromkeys(ctypes), SHARED_KEY) if instantiations(f, t)]
    device = cupy.cuda.Device().id

    def build(key):
        with cupy.cuda.Device(device):
            m = module(*key)
            m.get_function(instantiations(*key)[0])  # loads the module into the context

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(keys)))) as pool:
        list(pool.map(build, keys))


@lru_cache(maxsize=None)
def kernel(file: str, name: str):
    """A compiled kernel, e.g. kernel("layernorm.cu", "add_bias_residual_layernorm<__half, __half, 1, 8, 1>")."""
    return module(file, _owner(file, name)).get_function(name)


# ------------------------------------------------------------------ programmatic dependent launch

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
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
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
