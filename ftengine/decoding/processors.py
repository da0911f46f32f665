"""Logits processing with HuggingFace `generate` semantics and order, in NumPy (float32):

processors: repetition penalty, then min-new-tokens (eos masked);
warpers (sampling only): temperature, top-k, top-p; then greedy argmax or a seeded draw.
"""

from __future__ import annotations

import numpy as np

NEG_INF = np.float32(-np.inf)


def repetition_penalty(scores: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Tokens seen in a sequence so far (prompt included; seen (B, V) nonzero): score / penalty
    when positive, score * penalty when negative (HF RepetitionPenaltyLogitsProcessor)."""
    penalised = np.where(scores < 0, scores * np.float32(penalty), scores / np.float32(penalty))
    return np.where(seen.astype(bool), penalised, scores)


def no_repeat_ngram(scores: np.ndarray, histories: list, n: int) -> np.ndarray:
    """-inf for every token that would complete an n-gram already present in a row's history
    (prompt included), as HF NoRepeatNGramLogitsProcessor."""
    out = scores.copy()
    for row, seq in enumerate(histories):
        if len(seq) < n:
            continue
        prefix = tuple(seq[len(seq) - n + 1:])
        banned = [seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == prefix]
        out[row, banned] = NEG_INF
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


def _exp_shifted(scores: np.ndarray) -> np.ndarray:
    """exp(score - row max) in float32 (as the GPU computes it), widened to float64: masses are
    summed in float64, since float32 rounding of a 50,000-term sum is as large as one token's
    probability and would move top-p cut-offs and draws."""
    return np.exp(scores - scores.max(axis=-1, keepdims=True)).astype(np.float64)


def top_p(scores: np.ndarray, p: float) -> np.ndarray:
    """Drop the least likely tokens whose cumulative probability (ascending) is <= 1 - p, always
    keeping the most likely one (HF TopPLogitsWarper)."""
    order = np.argsort(scores, axis=-1, kind="stable")                  # ascending
    e = _exp_shifted(np.take_along_axis(scores, order, axis=-1))
    cumulative = np.cumsum(e, axis=-1) / e.sum(axis=-1, keepdims=True)
    remove_sorted = cumulative <= 1 - p
    remove_sorted[:, -1] = False
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, NEG_INF, scores)


def sample(scores: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw per row, in token order: the first token whose cumulative probability
    exceeds u * total."""
    e = _exp_shifted(scores)
    cdf = np.cumsum(e, axis=-1)
    picks = np.array([np.searchsorted(c, float(ui) * c[-1], side="right") for c, ui in zip(cdf, u)])
    last = e.shape[-1] - 1 - np.argmax(e[:, ::-1] > 0, axis=-1)   # never past the last possible token
    return np.minimum(picks, last)


def process(scores: np.ndarray, seen: np.ndarray, eos, step: int, params, histories=None) -> np.ndarray:
    """HF's processors in HF's order: repetition penalty, no-repeat n-grams, min new tokens."""
    if params.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, seen, params.repetition_penalty)
    if params.no_repeat_ngram_size:
        scores = no_repeat_ngram(scores, histories, params.no_repeat_ngram_size)
    if step < params.min_new_tokens:
        scores = suppress(scores, range(len(scores)), np.asarray(eos))
    return scores


def choose(logits: np.ndarray, seen: np.ndarray, eos, step: int, params, histories=None) -> np.ndarray:
    """Next token per row of logits (B, V) float32 after `step` generated tokens: processors,
    then argmax, or warpers and a seeded draw. -1 for a row with a non-finite logit.
    histories (token lists, prompt included) are needed for no_repeat_ngram_size only."""
    from .philox import uniforms
    bad = ~np.isfinite(logits).all(axis=-1)
    scores = process(np.where(bad[:, None], np.float32(0), logits), seen, eos, step, params, histories)
    if not params.do_sample:
        tokens = np.argmax(scores, axis=-1)
    else:
        if params.temperature != 1.0:
            scores = temperature(scores, params.temperature)
        if params.top_k:
            scores = top_k(scores, params.top_k)
        if params.top_p < 1.0:
            scores = top_p(scores, params.top_p)
        tokens = sample(scores, uniforms(params.seed, np.arange(len(scores)), step))
    return np.where(bad, -1, tokens).astype(np.int32)
