"""Which kernels each file of kernels_cu/ instantiates, in one place (one table for every element
type, one for the kernels every type shares), and which files a runner compiles before its first
launch. The tile and variant constants come from the launcher modules that route to them."""

from __future__ import annotations

import numpy as np

from .attention import (SOFTMAX_PER_LANE, SOFTMAX_VEC, VARLEN_HEAD_DIMS, VARLEN_TILES, VARLEN_WG_HEAD_DIMS,
                        varlen_mma_name)
from .fp8 import FP8_KERNELS
from .gemm import (BLAS_SPLITS, GEMV_COLS, SKINNY_TILES, SPLIT_COUNTS, SPLIT_TILES, WGMMA_TILES, skinny_name,
                   wgmma_ln_name, wgmma_name)
from .kernels import CUDA_TYPES, prepare
from .norms import LN_ROW_WARPS, ROW_WARP_ITEMS
from .pooling import POOL_WARPS
from .runtime import ROW_ITEMS, STORAGE, VECS, context
from .sampling import SAMPLING_KERNELS


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


FAMILIES = {
    "embedding.cu": lambda t: _row_variants("embed_layernorm", t),
    "layernorm.cu": lambda t: _after_product_variants("add_bias_residual_layernorm", t, BLAS_SPLITS)
    + [f"add_bias_residual_layernorm<{t}, {t}, 1, {VECS[t][0]}, {i}, {LN_ROW_WARPS}>" for i in ROW_WARP_ITEMS],
    "activation.cu": lambda t: (_vec_variants("add_bias_gelu", t) + _vec_variants("gated_gelu", t)
                                + ([] if t == "float" else [f"add_bias_act<{t}>"])),
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
    "wordpiece.cu": lambda t: [],
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

# file -> kernels every dtype uses (not templated on the element type): one module of their own,
# so that an fp16 run never compiles the fp32 instantiations (the fp32 varlen attention alone
# takes 17 s to compile on an H100)
SHARED = {"pooling.cu": ["l2_normalize<float>"], "sampling.cu": SAMPLING_KERNELS,
          "gemv.cu": ["prefetch_l2", "prefetch_kv"], "activation.cu": ["add_bias_act<float>"],
          "wordpiece.cu": ["wordpiece_tokenize", "pack_rows"]}


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
