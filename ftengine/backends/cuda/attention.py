"""Attention launchers: the unfused path's kernels (kernels_cu/attention.cu), the fused
variable-length attention (attention_varlen.cu; on sm_90 the wgmma kernels of attention_sm90.cu),
rotary embeddings (rotary.cu), and the decoder's KV cache and cached attention (decoder.cu)."""

from __future__ import annotations

import numpy as np

from ...errors import DeviceError
from .gemm import _tma_operands
from .launch import TensorMap
from .runtime import ROW_THREADS, _branching, _ctype, _launch, _on_branch, _planning, _threads, _vec, context


SOFTMAX_PER_LANE = (1, 2, 4, 8, 16, 32)     # warp kernel: S <= 32 * PER_LANE
SOFTMAX_VEC = {"float": 4, "__half": 8, "__nv_bfloat16": 8}  # 16 bytes
VARLEN_HEAD_DIMS = (32, 64, 128)  # fused attention (attention_varlen.cu)
VARLEN_BLOCK_M = 64               # its query tile (fp32)

# tensor-core kernel tiles: (warps, 16-query tiles per warp, keys per K/V tile); narrow by
# default, wide (twice the queries per warp) for sequences of 1024+ at head dim <= 64 with blocks
# for every SM twice (measured on the H100 by bench/experiments/attention_tiles.py); short (one block of
# 64 threads a sequence and head) for plain 16-bit attention whose longest sequence is at most
# VARLEN_SHORT_SEQ tokens, at VARLEN_SHORT_HEAD_DIMS, on every GPU (in place of the wgmma kernel on
# sm_90; measurements: docs/gpu-internals.md, attention.py VARLEN_SHORT_SEQ)
VARLEN_TILES = {"narrow": (4, 1, 64), "wide": (4, 2, 64), "short": (2, 1, 32)}
VARLEN_SHORT_SEQ, VARLEN_SHORT_HEAD_DIMS = 32, (32, 64)
ATTENTION_FLAGS = {"rows_are_tokens": 1, "indirect": 2, "write_kv": 4, "queries_only": 8}  # decoder.cu cached_attention
ATTENTION_THREADS = 256           # its block (ATTN_THREADS); half that from ATTENTION_MANY_BLOCKS (row, head) blocks
ATTENTION_MANY_BLOCKS = 256       # on (GPT-2 small, H100: b32 step 572 -> 524 us, beam 4 x 32 1083 -> 945 us)

# attention_sm90.cu (wgmma): its head dims, queries per block (one warpgroup) and keys per K/V tile (measurements:
# docs/gpu-internals.md, attention.py VARLEN_WG_HEAD_DIMS)
VARLEN_WG_HEAD_DIMS, VARLEN_WG_BLOCK_M, VARLEN_WG_KN = (64, 32), 64, 64

# attention_sm90.cu varlen_attention_wgmma_tma (TMA copies, S from shared memory): head dim 64, batches whose longest
# sequence passes VARLEN_WG_TMA_MIN_SEQ (more than two key tiles a block); shorter ones keep varlen_attention_wgmma
# (measurements: docs/gpu-internals.md, attention.py VARLEN_WG_TMA_MIN_SEQ)
VARLEN_WG_TMA_MIN_SEQ = 2 * VARLEN_WG_KN + 1


def varlen_mma_name(ctype: str, d: int, general: bool, tiles: str) -> str:
    """The tensor-core varlen attention kernel for head dim d and the VARLEN_TILES entry `tiles`;
    the narrow kernels (plain and general) ask the register allocator for 4 blocks per SM (2 at
    head dim 128)."""
    warps, mt, kn = VARLEN_TILES[tiles]
    min_blocks = 0 if tiles != "narrow" else (4 if d <= 64 else 2)
    return f"varlen_attention_mma<{ctype}, {d}, {'true' if general else 'false'}, {warps}, {mt}, {kn}, {min_blocks}>"


def add_qkv_bias_split_heads(q, k, v, qkv, bias, *, batch, seq, heads):
    t, h3 = qkv.shape
    d = q.shape[-1]
    vec = _vec(qkv, d)
    _launch("attention.cu", f"add_qkv_bias_split_heads<{_ctype(qkv)}, {vec}>", (t,), (_threads(h3 // vec),),
            (q, k, v, qkv, bias, np.int32(seq), np.int32(heads), np.int32(d)))


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


def short_attention(ctype: str, d: int, general: bool, max_seqlen: int) -> bool:
    """Whether the fused attention takes the "short" tiles (VARLEN_TILES): plain attention in a
    16-bit type at VARLEN_SHORT_HEAD_DIMS whose longest sequence is at most VARLEN_SHORT_SEQ."""
    return ctype != "float" and not general and d in VARLEN_SHORT_HEAD_DIMS and max_seqlen <= VARLEN_SHORT_SEQ


def varlen_attention(ctx, qkv, bias, cu_seqlens, *, heads, max_seqlen, causal=False, window=0, rel_bias=None):
    """Fused attention over the padding-free layout: tensor cores for fp16/bf16 (the short tiles
    where short_attention says; else on sm_90, wgmma at head dims 64 and 32 without window or bias:
    attention_sm90.cu, at head dim 64 with TMA copies past VARLEN_WG_TMA_MIN_SEQ tokens), SIMT for
    fp32.
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
    short = short_attention(ct, d, general, max_seqlen)
    if ct == "float":
        name, smem = f"varlen_attention_simt<{d}>", 0
    elif d in VARLEN_WG_HEAD_DIMS and not general and not short and context().wgmma:
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
        # and biases; the short tiles for short batches, the wide ones for long sequences (VARLEN_TILES)
        warps, mt, kn = VARLEN_TILES["wide"]
        blocks = b * heads * -(-max_seqlen // (16 * warps * mt))
        wide = d <= 64 and max_seqlen >= 1024 and blocks >= 2 * context().sm_count
        tiles = "short" if short else "wide" if wide else "narrow"
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


def merge_heads(out, ctx, *, batch, seq, heads):
    t, h = out.shape
    d = ctx.shape[-1]
    vec = _vec(out, d)
    _launch("attention.cu", f"merge_heads<{_ctype(out)}, {vec}>", (t,), (_threads(h // vec),),
            (out, ctx, np.int32(seq), np.int32(heads), np.int32(d)))


# a prefill's cache writes on a branch of its graph beside the layer's other launches, joined before the next layer's
# QKV product overwrites their input (write_kv_cache(beside=True), join_beside). (measurements: docs/gpu-internals.md,
# attention.py write_kv_cache)
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


def _attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, indir, flags, heads, rel_bias=None):
    t = qkv.shape[0]
    _, _, length, d = k_cache.shape
    writes = bool(flags & ATTENTION_FLAGS["write_kv"])
    if qkv.shape[1] == heads * d and not writes:  # a cross-attention's queries alone
        flags |= ATTENTION_FLAGS["queries_only"]
    elif qkv.shape[1] != 3 * heads * d:
        alone = "" if writes else f" or {heads * d} (the queries alone)"
        raise DeviceError(f"attention input of {qkv.shape[1]} columns: expected {3 * heads * d} (Q, K, V of {heads} "
                          f"heads of {d}){alone}")
    vec = _vec(qkv, d)
    per_key = 1 << max(0, (d // vec - 1).bit_length())  # threads per key: a power of two
    if per_key > 32:
        raise DeviceError(f"head_dim {d} is too large for the decoder attention kernel (at most {32 * vec})")
    # a block of ATTENTION_THREADS while there are few (row, head) blocks; half that from
    # ATTENTION_MANY_BLOCKS of them on, where more blocks per SM gain more than wider ones
    threads = ATTENTION_THREADS if t * heads < ATTENTION_MANY_BLOCKS else ATTENTION_THREADS // 2
    smem = threads // 32 * (d + 2) * 4
    table, buckets, max_len = rel_bias if rel_bias is not None else (positions, positions, 0)
    _launch("decoder.cu", f"cached_attention<{_ctype(qkv)}, {vec}>", (t, heads), (threads,),
            (ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, positions if indir is None else indir,
             np.int32(flags), np.int32(heads), np.int32(d), np.int32(length), np.int32(per_key),
             np.float32(1.0 / np.sqrt(d)), table, buckets, np.int32(max_len)), shared_mem=smem)


def cached_attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, *, heads, indir=None, rel_bias=None):
    flags = 0 if indir is None else ATTENTION_FLAGS["indirect"]
    _attention(ctx, qkv, bias, k_cache, v_cache, seq_ids, positions, indir, flags, heads, rel_bias)


# Measurements: docs/gpu-internals.md, attention.py decode_attention
def decode_attention(ctx, qkv, bias, k_cache, v_cache, positions, indir=None, *, heads, rel_bias=None):
    """Writes each token's key and value into its own cache row, then attends (one kernel);
    rel_bias = (float32 table (buckets, heads), buckets (2 * max_len - 1,), max_len): T5's."""
    flags = ATTENTION_FLAGS["rows_are_tokens"] | ATTENTION_FLAGS["write_kv"]
    if indir is not None:
        flags |= ATTENTION_FLAGS["indirect"]
    _attention(ctx, qkv, bias, k_cache, v_cache, positions, positions, indir, flags, heads, rel_bias)
