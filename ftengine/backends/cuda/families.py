"""Which kernels each file of kernels_cu/ instantiates, in one place (one table for every element
type, one for the kernels every type shares), and which files a runner compiles before its first
launch. The tile and variant constants come from the launcher modules that route to them."""

from __future__ import annotations

import numpy as np

from .attention import (SOFTMAX_PER_LANE, SOFTMAX_VEC, VARLEN_HEAD_DIMS, VARLEN_SHORT_HEAD_DIMS, VARLEN_TILES,
                        VARLEN_WG_HEAD_DIMS, varlen_mma_name)
from .fp8 import FP8_KERNELS
from .gemm import (BLAS_SPLITS, GEMV_COLS, SKINNY_TILES, SPLIT_COUNTS, SPLIT_TILES, WGMMA_TILES, norm_kernels,
                   skinny_name, wgmma_ln_name, wgmma_name)
from .kernels import CUDA_TYPES, prepare
from .norms import LN_ROW_WARPS, ROW_WARP_ITEMS
from .pooling import POOL_WARPS
from .runtime import ROW_ITEMS, STORAGE, VECS, runs_wgmma, vec_width
from .sampling import SAMPLING_KERNELS


def _softmax_variants(t: str) -> list[str]:
    names = [f"masked_softmax_block<{t}>"]
    for per_lane in SOFTMAX_PER_LANE:
        names.append(f"masked_softmax_warp<{t}, {per_lane}, 1>")
        if per_lane % SOFTMAX_VEC[t] == 0:
            names.append(f"masked_softmax_warp<{t}, {per_lane}, {SOFTMAX_VEC[t]}>")
    return names


def _row_variants(kernel: str, t: str, v: int) -> list[str]:
    return [f"{kernel}<{t}, {v}, {i}>" for i in ROW_ITEMS]


def _after_product_variants(kernel: str, t: str, v: int, splits) -> list[str]:
    """A row kernel <T, X, SPLITS, VEC, ITEMS> that reads a product: a plain one (X = T), and
    (16-bit types, rows of whole 16-byte vectors: the widest width) a split one's float partial
    sums of each count in `splits`."""
    plain = [f"{kernel}<{t}, {t}, 1, {v}, {i}>" for i in ROW_ITEMS]
    split = [f"{kernel}<{t}, float, {s}, {v}, {i}>" for s in splits for i in ROW_ITEMS]
    return plain + ([] if t == "float" or v != VECS[t][0] else split)


def _widest(t: str, v: int, names: list[str]) -> list[str]:
    """names (kernels without a vector width) at the widest width only."""
    return names if v == VECS[t][0] else []


def _gemv(t: str, v: int) -> list[str]:
    skinny = [] if t == "float" else ([skinny_name(t, o, tiles) for o in (t, "float") for tiles in SKINNY_TILES.values()]
                                      + [skinny_name(t, "float", tiles) for tiles in SPLIT_TILES.values()])
    return [f"gemv<{t}, {o}, {v}, {c}>" for o in dict.fromkeys((t, "float")) for c in GEMV_COLS] + _widest(t, v, skinny)


# file -> (element type t, vector width v) -> the kernels of the files whose kernels read rows in
# vectors of v elements (runtime._vec: the widest of VECS[t] that divides the row), with those of the
# file that take no width listed at the widest. The file's kernels are listed width by width, widest
# first, so that modules hold the kernels of one width: a model's rows take one or two widths
# (prepare_kernels' `rows`), and the others are compiled at their first launch.
BY_WIDTH = {
    "embedding.cu": lambda t, v: _row_variants("embed_layernorm", t, v),
    "layernorm.cu": lambda t, v: _after_product_variants("add_bias_residual_layernorm", t, v, BLAS_SPLITS) + _widest(
        t, v, [f"add_bias_residual_layernorm<{t}, {t}, 1, {v}, {i}, {LN_ROW_WARPS}>" for i in ROW_WARP_ITEMS]),
    "activation.cu": lambda t, v: [f"add_bias_gelu<{t}, {v}>", f"gated_gelu<{t}, {v}>"]
    + _widest(t, v, [] if t == "float" else [f"add_bias_act<{t}>"]),
    "attention.cu": lambda t, v: [f"add_qkv_bias_split_heads<{t}, {v}>", f"merge_heads<{t}, {v}>"]
    + _widest(t, v, _softmax_variants(t) + [f"add_relative_bias<{t}>"]),
    "decoder.cu": lambda t, v: [f"embed_positions<{t}, {v}>", *_row_variants("layernorm", t, v),
                                f"add_bias_residual<{t}, {v}>",
                                *_after_product_variants("residual_layernorm", t, v, SPLIT_COUNTS),
                                f"write_kv_cache<{t}, {v}>", f"cached_attention<{t}, {v}>", f"gather_rows<{t}, {v}>"],
    "gemv.cu": _gemv,
}


def _all_widths(file: str):
    return lambda t: [n for part in sections(file, t) for n in part]


def sections(file: str, t: str) -> list[list[str]]:
    """FAMILIES[file](t) in the parts that never share a module: one a width for BY_WIDTH's files."""
    return [BY_WIDTH[file](t, v) for v in VECS[t]] if file in BY_WIDTH else [FAMILIES[file](t)]


def widths_of(t: str, rows) -> tuple[int, ...]:
    """The vector widths a model's kernels read rows of these lengths in: each length's own, and the
    widest (BY_WIDTH lists the kernels without a width there)."""
    return tuple(dict.fromkeys((VECS[t][0], *(vec_width(t, r) for r in rows))))


def _varlen_attention(t: str, head_dims, general=(False, True)) -> list[str]:
    """The fused attention's kernels for these head dims and variants (general: windows or a
    relative bias; plain otherwise)."""
    if t == "float":
        return [f"varlen_attention_simt<{d}>" for d in head_dims]
    return [varlen_mma_name(t, d, g, tiles) for d in head_dims for g in general for tiles in VARLEN_TILES
            if tiles == "narrow" or (d <= 64 and tiles == "wide")] + _short_attention(t, head_dims, general)


def _short_attention(t: str, head_dims, general=(False, True)) -> list[str]:
    """The fused attention's short-sequence kernels (plain variant, 16-bit types) of these head dims."""
    if t == "float" or False not in general:
        return []
    return [varlen_mma_name(t, d, False, "short") for d in head_dims if d in VARLEN_SHORT_HEAD_DIMS]


def _wgmma_attention(t: str, head_dims) -> list[str]:
    """The wgmma attention's kernels (plain variant only) for those of these head dims it takes."""
    if t == "float":
        return []
    return [f"varlen_attention_wgmma<{t}, {d}>" for d in head_dims if d in VARLEN_WG_HEAD_DIMS] + \
        [f"varlen_attention_wgmma_tma<{t}>" for d in head_dims if d == 64]


# file -> element type -> the file's kernels (template instantiations) of that type
FAMILIES = {
    **{file: _all_widths(file) for file in BY_WIDTH},
    "rotary.cu": lambda t: [f"rotary_qkv<{t}>"],
    "attention_varlen.cu": lambda t: _varlen_attention(t, VARLEN_HEAD_DIMS),
    "pooling.cu": lambda t: [f"{k}<{t}, {w}>" for k in ("pool", "pool_packed") for w in POOL_WARPS],
    "sampling.cu": lambda t: [],
    "sampling_levels.cu": lambda t: [],
    "sampling_cluster.cu": lambda t: [],
    "beam.cu": lambda t: [],
    "wordpiece.cu": lambda t: [],
    "convert.cu": lambda t: [f"convert_rows<{t}>"],
    "prefetch.cu": lambda t: [],
    "gemv_norm.cu": norm_kernels,
    # dtype fp8: fp16 activations, e4m3 product operands (sm_89+)
    "fp8.cu": lambda t: ([n for k in FP8_KERNELS for v in VECS[t] for n in _row_variants(k, t, v)]
                         if t == "__half" else []),
    # wgmma (sm_90a: ARCH_SPECIFIC)
    "attention_sm90.cu": lambda t: _wgmma_attention(t, VARLEN_WG_HEAD_DIMS),
    "gemm_sm90.cu": lambda t: [] if t == "float" else [wgmma_name(t, bn, 1) for bn in WGMMA_TILES] + [wgmma_ln_name(t)],
}

# file -> kernels a module holds (one module of all a type's kernels where unlisted): NVRTC's time grows
# with a module's kernels and modules compile in parallel, so the files slow to compile are split
# (a first run's compile: docs/performance.md, Cold start)
MODULE_KERNELS = {"attention_varlen.cu": 1, "attention_sm90.cu": 1, "gemm_sm90.cu": 1, "sampling_cluster.cu": 1,
                  "layernorm.cu": 4, "decoder.cu": 5, "gemv.cu": 4, "gemv_norm.cu": 1}

# file -> kernels every dtype uses (not templated on the element type): one module of their own,
# so that an fp16 run never compiles the fp32 instantiations (the fp32 varlen attention alone
# takes 17 s to compile on an H100)
SHARED = {"pooling.cu": ["l2_normalize<float>"], **SAMPLING_KERNELS,
          "prefetch.cu": ["prefetch_l2", "prefetch_kv"], "activation.cu": ["add_bias_act<float>"],
          "wordpiece.cu": ["wordpiece_tokenize", "pack_rows"]}


def prepare_kernels(files, dtype_name: str, *, head_dims, general=(False,), gelu_product: str | None = None,
                    ln_product: bool = False, rows=None, norm_product=None):
    """Compile the kernel modules a runner needs for one dtype (and the shared ones; and convert.cu,
    which uploads its weights, runtime.to_device, and prefetch.cu, which its graphs launch), in
    parallel, before its first launch:
    - of the fused attention, the kernels of the head dims (head_dims) and variants (general: False
      for plain attention, True for windows or a relative bias; both where a runner launches both)
      its attention runs: where the GPU runs the wgmma kernels (fp16, bf16), the wgmma attention in
      place of the plain variant at the head dims it takes; in 16-bit types, the plain variant's
      short-sequence tiles (attention.short_attention) at the head dims they take;
    - where the GPU runs them, the wgmma products, for a runner whose matmul_bias_gelu calls take the
      erf form (gelu_product: that form, None for a runner that makes no such call) or that calls
      matmul_bias_residual_layernorm (ln_product);
    - of the files of BY_WIDTH, the kernels of the vector widths that rows of these lengths take
      (rows: the model's hidden, head and feed-forward sizes; None: every width).
    - for a runner whose decode steps call norm_matmul (norm_product: its rows' length and whether
      its LayerNorms come after the residual sum), the gemv_norm kernels of that row.
    A kernel left out compiles at its first launch (a graph's eager pass, never inside a capture)."""
    ctype = CUDA_TYPES[np.dtype(STORAGE[dtype_name]).name]
    wgmma = dtype_name in ("fp16", "bf16") and runs_wgmma()
    wg_dims = [d for d in head_dims if d in VARLEN_WG_HEAD_DIMS] if wgmma and False in general else []
    if "attention_varlen.cu" in files and wg_dims:
        files = (*files, "attention_sm90.cu")
    if wgmma and (gelu_product == "erf" or ln_product):
        files = (*files, "gemm_sm90.cu")
    plain = [d for d in head_dims if d not in wg_dims]
    only = {"attention_varlen.cu": set(_varlen_attention(ctype, plain, (False,)) if False in general else ())
            | set(_varlen_attention(ctype, head_dims, (True,)) if True in general else ())
            | set(_short_attention(ctype, head_dims, general)),
            "attention_sm90.cu": set(_wgmma_attention(ctype, wg_dims))}
    if rows is not None:
        only.update({f: {n for v in widths_of(ctype, rows) for n in BY_WIDTH[f](ctype, v)} | set(SHARED.get(f, ()))
                     for f in BY_WIDTH})
    norms = norm_kernels(ctype, *norm_product) if norm_product is not None else []
    if norms:
        files = (*files, "gemv_norm.cu")
        only["gemv_norm.cu"] = set(norms)
    prepare((*files, "convert.cu", "prefetch.cu"), (ctype,), only=only)
