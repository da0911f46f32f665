"""Beam search with HuggingFace `generate` semantics (its vectorised beam search, transformers 5):
log-softmax in float32, HF's processors, 2 x num_beams candidates per step (more with several eos
ids), finished hypotheses scored sum(log p) / generated_length ** length_penalty (eos included),
early_stopping True / False / "never", the KV cache reordered by parent beam every step.
One prompt at a time: each prompt gives exactly what it gives alone."""

from __future__ import annotations

import numpy as np

from ..errors import InputError
from . import processors as P
from .generate import GenerationParams, check_prompts

NEG = np.float32(-1.0e9)  # HF's "impossible" score, added rather than set, in float32


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower index first)."""
    return np.argsort(-values, kind="stable")[:k]


def beam_search(runner, prompt: list, params: GenerationParams) -> list:
    """[(new token ids, score)] for the best params.num_return_sequences hypotheses, best first."""
    check_prompts([prompt], params, runner.config.n_positions)
    nb, vocab = params.num_beams, runner.config.vocab_size
    eos = np.asarray(params.eos_token_ids, dtype=np.int64)
    keep = max(2, 1 + len(eos)) * nb
    top_mask = np.arange(keep) < nb
    start = len(prompt)
    max_length = start + params.max_new_tokens
    penalty = params.length_penalty
    running = np.zeros((nb, max_length), dtype=np.int64)        # (beams, L): running hypotheses
    running[:, :start] = prompt
    running_scores = np.full(nb, NEG, dtype=np.float32)
    running_scores[0] = 0.0                                      # identical beams: only the first counts
    finished_seq = running.copy()                                # (beams, L): best finished hypotheses
    finished_len = np.zeros(nb, dtype=np.int64)
    finished_scores = np.full(nb, NEG, dtype=np.float32)
    is_finished = np.zeros(nb, dtype=bool)
    improvable = True
    runner.prefill([list(prompt)] * nb)
    cur = start
    while True:
        logits = runner.logits(nb)
        if not np.isfinite(logits).all():
            raise InputError(f"non-finite logits (NaN or inf) at step {cur - start + 1}; the model or its "
                             "weights produce invalid values")
        seen = np.zeros((nb, vocab), dtype=np.uint8)
        for i in range(nb):
            seen[i, running[i, :cur]] = 1
        histories = [running[i, :cur].tolist() for i in range(nb)]
        log_probs = P.process(_log_softmax(logits), seen, eos, cur - start, params, histories)
        total = (log_probs + running_scores[:, None]).reshape(-1)           # (beams * V,)
        pick = _top(total, keep)
        cand_scores, parent, token = total[pick], pick // vocab, pick % vocab
        cand_seq = running[parent]
        cand_seq[:, cur] = token
        hits = (cur + 1 >= max_length) | np.isin(token, eos)

        # the best candidates that did not stop continue
        cont = cand_scores + hits.astype(np.float32) * NEG
        nxt = _top(cont, nb)
        running, running_scores, parents = cand_seq[nxt], cont[nxt], parent[nxt]

        # the top num_beams candidates that stopped may enter the finished set
        scored = cand_scores / np.float32((cur + 1 - start) ** penalty)
        if is_finished.all() and params.early_stopping is True:
            scored = scored + NEG
        if not improvable:
            scored = scored + NEG
        scored = scored + (~(hits & top_mask)).astype(np.float32) * NEG
        merged = _top(np.concatenate([finished_scores, scored]), nb)
        finished_seq = np.concatenate([finished_seq, cand_seq])[merged]
        finished_scores = np.concatenate([finished_scores, scored])[merged]
        finished_len = np.concatenate([finished_len, np.full(keep, cur + 1 - start)])[merged]
        is_finished = np.concatenate([is_finished, hits & top_mask])[merged]

        runner.reorder(parents)
        cur += 1
        if params.early_stopping == "never" and penalty > 0.0:
            best_length = max_length - start
        else:
            best_length = cur - start
        best_possible = running_scores[0] / np.float32(best_length ** penalty)
        worst_finished = np.where(is_finished, finished_scores.min(), NEG)
        improvable = improvable and bool((best_possible > worst_finished).any())
        stop = (not improvable) or (is_finished.all() and params.early_stopping is True) or hits.all()
        if stop:
            break
        runner.decode(running[:, cur - 1], np.full(nb, cur - 1))
    return [(finished_seq[i, start:start + finished_len[i]].tolist(), float(finished_scores[i]))
            for i in range(params.num_return_sequences)]
