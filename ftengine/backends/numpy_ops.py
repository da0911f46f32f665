"""Reference ops: plain NumPy, float32, obvious. The golden model every CUDA op is checked against.

Each op writes into an explicit output buffer; the CUDA launchers (backends/cuda/ops.py) have the
same names and signatures, so models/ code runs unchanged on either backend. Layout: tokens are
rows. A padded batch of B sequences of S slots is (B*S, H), row b*S + s.

It is also the CPU backend users without a GPU run, so the element-wise ops that dominate after the
matrix products (GELU, LayerNorm, attention's softmax) run over cache-sized row blocks, in place, on
a pool of threads; the formulas stay the reference ones. The ops live in reference/, one module per
op family as in backends/cuda/ (docs/gpu-internals.md has the op table).
"""

from __future__ import annotations

from .reference.activation import add_bias_act, add_bias_gelu, gated_gelu
from .reference.attention import (add_qkv_bias_split_heads, add_relative_bias, cached_attention, decode_attention,
                                  masked_softmax, merge_heads, rotary_qkv, varlen_attention, write_kv_cache)
from .reference.fp8 import (E4M3_MAX, add_bias_gelu_quantize, add_bias_residual_layernorm_quantize, check_fp8,
                            e4m3_bytes, e4m3_values, matmul_fp8, quantize_rows)
from .reference.gemm import (NORM_PROLOGUE_ROWS, batched_matmul, dense, matmul, matmul_act, matmul_bias_act,
                             matmul_bias_gelu, matmul_bias_residual_layernorm, matmul_residual_layernorm, norm_matmul,
                             norm_product, partials_size)
from .reference.norms import (add_bias_residual, add_bias_residual_layernorm, embed_layernorm, embed_positions,
                              gather_rows, layernorm, residual_layernorm)
from .reference.pooling import l2_normalize, pool, pool_packed
from .reference.runtime import (STORAGE, DeviceTimer, GraphCache, HostSlot, copy_from_host, copy_to_host_async, empty,
                                fetch, join_beside, pinned_empty, prefetch_kv, prefetch_l2, prepare_kernels,
                                storage_dtype, synchronize, to_device, to_host, upload, zero)
from .reference.sampling import CHOICE_STATE_WORDS, append_tokens, beam_select, choose_tokens, mark_seen
from .reference.wordpiece import pack_rows, prepare_wordpiece, wordpiece_tokenize

name = "numpy"

__all__ = [
    "name", "STORAGE", "storage_dtype", "empty", "pinned_empty", "to_device", "copy_from_host", "to_host", "upload",
    "fetch", "synchronize", "prepare_kernels", "DeviceTimer", "GraphCache", "prefetch_l2", "prefetch_kv", "join_beside", "zero",
    "HostSlot", "copy_to_host_async", "gated_gelu", "add_bias_act", "add_bias_gelu", "embed_layernorm", "add_bias_residual_layernorm",
    "embed_positions", "layernorm", "add_bias_residual", "residual_layernorm", "gather_rows", "matmul", "matmul_act",
    "matmul_bias_act", "matmul_bias_gelu", "batched_matmul", "dense", "partials_size", "matmul_residual_layernorm",
    "matmul_bias_residual_layernorm", "NORM_PROLOGUE_ROWS", "norm_product", "norm_matmul", "add_qkv_bias_split_heads",
    "add_relative_bias", "masked_softmax",
    "varlen_attention", "rotary_qkv", "merge_heads", "write_kv_cache", "cached_attention", "decode_attention",
    "check_fp8", "E4M3_MAX", "e4m3_bytes", "e4m3_values", "quantize_rows", "add_bias_residual_layernorm_quantize",
    "add_bias_gelu_quantize", "matmul_fp8", "pool", "pool_packed", "l2_normalize", "CHOICE_STATE_WORDS", "mark_seen",
    "choose_tokens", "append_tokens", "beam_select", "pack_rows", "prepare_wordpiece", "wordpiece_tokenize"
]
