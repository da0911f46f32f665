"""The one table of tolerances. Tests take their bounds from here and never loosen them."""

# Model level, NumPy reference vs HF transformers in float32: max |difference| of hidden states
# on real (non-padded) positions.
HF_FP32_MAX_ABS = 1e-4
# Pooled, normalised sentence embeddings vs sentence-transformers' pipeline (fp32).
EMBEDDING_COSINE_FP32 = 0.99999
# The same text embedded alone, in another batch, or in another order (fp32 rounding only).
BATCHING_INVARIANCE_FP32 = 1e-5
# Op level: |ours - reference| <= atol + rtol * |reference|, by compute dtype.
OPS = {
    "fp32": {"atol": 1e-5, "rtol": 1e-5},
    "fp16": {"atol": 2e-3, "rtol": 2e-3},
    "bf16": {"atol": 1.6e-2, "rtol": 1.6e-2},
}
