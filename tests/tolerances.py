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
