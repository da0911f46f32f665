"""The CUDA backend's op interface: the same op names and signatures as backends/numpy_ops.py, each
launched from the module of its op family (docs/gpu-internals.md has the op table: op -> kernel
file -> launcher module -> NumPy function). Model code calls ops through this module only.

| module | owns |
|---|---|
| runtime.py | context, streams, memory, host slots, timers, graphs, launch helpers, L2 prefetch |
| gemm.py | every product path and its routing (gemv, skinny, cuBLASLt / cuBLAS, wgmma, split K) |
| algos.py | cuBLASLt algorithm choice (in memory; on disk through algo_cache.py) |
| attention.py | unfused and fused attention, rotary embeddings, the KV cache and cached attention |
| norms.py | embedding, LayerNorm, residual and row-gather kernels |
| activation.py | bias + GELU and gated GELU |
| pooling.py | pooling modes and L2 normalisation |
| fp8.py | e4m3 quantisation and the scaled product |
| sampling.py | token choice, its bookkeeping, beam selection |
| wordpiece.py | the GPU tokenizer: WordPiece ids of UTF-8 texts, packed |
| families.py / kernels.py / launch.py | instantiation tables / compilation / cuLaunchKernelEx |
| driver.py | the asynchronous driver calls that keep the GIL (copies, events, graph launches) |
"""

from __future__ import annotations

from .activation import GELU_FORMS, add_bias_act, add_bias_gelu, gated_gelu
from .attention import (add_qkv_bias_split_heads, add_relative_bias, cached_attention, decode_attention,
                        masked_softmax, merge_heads, rotary_qkv, varlen_attention, write_kv_cache)
from .families import prepare_kernels
from .fp8 import add_bias_gelu_quantize, add_bias_residual_layernorm_quantize, check_fp8, matmul_fp8, quantize_rows
from .gemm import (NORM_PROLOGUE_ROWS, batched_matmul, blas_split_k, dense, matmul, matmul_act, matmul_bias_act,
                   matmul_bias_gelu, matmul_bias_residual_layernorm, matmul_residual_layernorm, norm_matmul,
                   norm_product, partials_size, split_k, wgmma_ln_fits)
from .norms import (add_bias_residual, add_bias_residual_layernorm, embed_layernorm, embed_positions, gather_rows,
                    layernorm, residual_layernorm)
from .pooling import POOL_CODES, l2_normalize, pool, pool_packed
from .runtime import (STORAGE, DeviceTimer, GraphCache, HostSlot, context, copy_from_host, copy_to_host_async, empty,
                      fetch, join_beside, join_branches, pinned_empty, planning, prefetch_kv, prefetch_l2,
                      storage_dtype, synchronize, to_device, to_host, upload, zero)
from .sampling import CHOICE_STATE_WORDS, append_tokens, beam_select, choice_slices, choose_tokens, mark_seen, \
    sample_clusters
from .wordpiece import pack_rows, prepare_wordpiece, wordpiece_tokenize

name = "cuda"

__all__ = [
    "name", "GELU_FORMS", "add_bias_act", "add_bias_gelu", "gated_gelu", "add_qkv_bias_split_heads", "add_relative_bias",
    "cached_attention", "decode_attention", "masked_softmax", "merge_heads", "rotary_qkv", "varlen_attention",
    "write_kv_cache", "prepare_kernels", "add_bias_gelu_quantize", "add_bias_residual_layernorm_quantize",
    "check_fp8", "matmul_fp8", "quantize_rows", "batched_matmul", "blas_split_k", "dense", "matmul", "matmul_act",
    "matmul_bias_act", "matmul_bias_gelu", "matmul_bias_residual_layernorm", "matmul_residual_layernorm",
    "NORM_PROLOGUE_ROWS", "norm_product", "norm_matmul", "partials_size", "split_k",
    "wgmma_ln_fits", "add_bias_residual", "add_bias_residual_layernorm", "embed_layernorm", "embed_positions",
    "gather_rows", "layernorm", "residual_layernorm", "POOL_CODES", "l2_normalize", "pool", "pool_packed", "STORAGE",
    "DeviceTimer", "GraphCache", "HostSlot", "context", "copy_from_host", "copy_to_host_async", "empty",
    "join_beside", "join_branches", "pinned_empty", "planning", "prefetch_kv", "prefetch_l2", "storage_dtype",
    "synchronize", "to_device", "to_host", "upload", "fetch", "zero", "CHOICE_STATE_WORDS", "append_tokens", "beam_select",
    "choice_slices", "choose_tokens", "mark_seen", "sample_clusters", "pack_rows", "prepare_wordpiece", "wordpiece_tokenize",
]
