"""The one table of tolerances. Tests take their bounds from here and never loosen them."""

# Model level, NumPy reference vs HF transformers in float32: max |difference| of hidden states
# on real (non-padded) positions.
HF_FP32_MAX_ABS = 1e-4
# Pooled, normalised sentence embeddings vs sentence-transformers' pipeline (fp32).
EMBEDDING_COSINE_FP32 = 0.99999
# The same text embedded alone, in another batch, or in another order (fp32 rounding only).
BATCHING_INVARIANCE_FP32 = 1e-5
# CUDA fp32 hidden states vs HF on the same GPU (TF32 off on both): max abs / max(1, max |ref|).
GPU_FP32_REL = 1e-4
# CUDA fp16/bf16 hidden states: error vs HF fp32 at most this times HF's own error in that dtype.
LOWP_ERROR_FACTOR = 2.0
# Pooled, normalised embeddings in fp16/bf16 vs fp32: cosine at least this.
EMBEDDING_COSINE_LOWP = 0.9999
# Logits processors (temperature, top-k, top-p, repetition penalty) vs HF's on the same float32 logits.
PROCESSORS_FP32 = 1e-6
# Beam search hypothesis scores vs HF generate's sequences_scores (fp32): absolute.
BEAM_SCORE_FP32 = 1e-4
# Op level: |ours - reference| <= atol + rtol * |reference|, by compute dtype.
OPS = {
    "fp32": {"atol": 1e-5, "rtol": 1e-5},
    "fp16": {"atol": 2e-3, "rtol": 2e-3},
    "bf16": {"atol": 1.6e-2, "rtol": 1.6e-2},
}
# dtype fp8 (e4m3, 3 mantissa bits): a stored value is within half a unit in the last place of what
# it stands for: 2^-4 of it (normal numbers), 2^-10 of its row's scale (subnormals).
E4M3_HALF_ULP = 2.0 ** -4
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10
# FP8 products: Hopper's FP8 tensor cores add products into an accumulator narrower than fp32 (about
# 14 bits, DeepSeek-V3 report section 3.3.2) between cuBLASLt's fp32 promotions, so the error is
# bounded relative to sum_k |x_k w_k|, not to the result (measured on the H100: up to 2^-11.8 of it).
FP8_PRODUCT_SUM_REL = 2.0 ** -10
# Pooled, normalised embeddings with dtype fp8 vs fp32, per model: cosine at least this (the
# worst figures measured on the H100 by these tests, rounded down: BERT-base 0.99725 on a
# 1-token text, 0.9987 from 128 tokens on; all-MiniLM-L6-v2 0.9927 over 5,000 lines in
# bench/results/encoder.md).
EMBEDDING_COSINE_FP8 = {"bert-base-hf-init": 0.997, "all-MiniLM-L6-v2": 0.99}
