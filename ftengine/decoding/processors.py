"""Logits processing with HuggingFace `generate` semantics and order, in NumPy (float32):

processors: repetition penalty, then min-new-tokens (eos masked);
warpers (sampling only): temperature, top-k, top-p; then greedy argmax or a seeded draw.
"""

from __future__ import annotations

import numpy as np

NEG_INF = np.float32(-np.inf)


def repetition_penalty(scores: np.ndarray, histories: list, penalty: float) -> np.ndarray:
    """Each token seen in a sequence's history (prompt included) once: score / penalty when
    positive, score * penalty when negative (HF RepetitionPenaltyLogitsProcessor)."""
    out = scores.copy()
    for b, seen in enumerate(histories):
        idx = np.unique(np.asarray(seen, dtype=np.int64))
        s = out[b, idx]
        out[b, idx] = np.where(s < 0, s * np.float32(penalty), s / np.float32(penalty))
    return out


def suppress(scores: np.ndarray, rows, token_ids) -> np.ndarray:
    """-inf for token_ids in the given rows (min_new_tokens: no eos yet)."""
    out = scores.copy()
    if len(token_ids):
        out[np.ix_(np.asarray(rows, dtype=np.int64), np.asarray(token_ids, dtype=np.int64))] = NEG_INF
    return out


def temperature(scores: np.ndarray, t: float) -> np.ndarray:
    return scores / np.float32(t)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Keep scores >= the k-th largest of each row (ties at the threshold kept, as HF does)."""
    k = min(k, scores.shape[-1])
    kth = np.partition(scores, -k, axis=-1)[:, -k][:, None]
    return np.where(scores < kth, NEG_INF, scores)


def softmax(scores: np.ndarray) -> np.ndarray:
    m = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - m)
    return e / e.sum(axis=-1, keepdims=True)


def top_p(scores: np.ndarray, p: float) -> np.ndarray:
    """Drop the least likely tokens whose cumulative probability (ascending) is <= 1 - p, always
    keeping the most likely one (HF TopPLogitsWarper)."""
    order = np.argsort(scores, axis=-1, kind="stable")                  # ascending
    sorted_scores = np.take_along_axis(scores, order, axis=-1)
    cumulative = np.cumsum(softmax(sorted_scores), axis=-1)
    remove_sorted = cumulative <= np.float32(1 - p)
    remove_sorted[:, -1] = False
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, NEG_INF, scores)


def sample(scores: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw per row: the first token whose cumulative probability exceeds u * total."""
    probs = softmax(scores)
    cdf = np.cumsum(probs, axis=-1)
    picks = np.array([np.searchsorted(c, ui * c[-1], side="right") for c, ui in zip(cdf, u)])
    last = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)   # never past the last possible token
    return np.minimum(picks, last)
