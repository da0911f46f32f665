"""Beam search with HuggingFace `generate` semantics (its vectorised beam search, transformers 5):
log-softmax in float32, HF's processors (and a log-softmax after them with renormalize_logits),
2 x num_beams candidates per step (more with several eos ids), finished hypotheses scored
sum(log p) / generated_length ** length_penalty (eos included), early_stopping True / False /
"never".

Every prompt of a batch has num_beams rows (row b * num_beams + j) and its own state in device
memory (running and finished hypotheses, scores, flags); a step updates it with one op,
beam_select, whose NumPy form is reference_step below. Beams do not copy their parents' KV cache:
each row keeps a cache indirection (the row whose cache holds each position), gathered from the
parents every step. Prompts are independent: each gives exactly what it gives alone."""

from __future__ import annotations

import numpy as np

from ..errors import InputError
from . import processors as P
from .generate import GenerationParams, check_prompts, pipelined, stream_tokens

NEG = np.float32(-1.0e9)  # HF's "impossible" score, added rather than set, in float32
KEEP_MAX = 64             # candidates per prompt and step the CUDA kernels hold (beam.cu BEAM_KEEP_MAX)
CANDIDATE_CHUNK = 4096    # CUDA stage 1: the vocabulary slice of one block


def candidates_per_item(params: GenerationParams) -> int:
    """HF keeps enough candidates that num_beams of them do not end in an eos id."""
    return max(2, 1 + len(params.eos_token_ids)) * params.num_beams


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower index first), as a stable sort
    of -values would give them: the k-th largest by a partition, then only the candidates sorted
    (a beam step's beams x vocabulary scores are far too many to sort whole). No NaN in values."""
    n = values.shape[-1]
    if n <= 2 * k:
        return np.argsort(-values, kind="stable")[:k]
    kth = np.partition(values, n - k)[n - k]
    above = np.flatnonzero(values > kth)
    chosen = np.concatenate([above, np.flatnonzero(values == kth)[:k - len(above)]])
    return chosen[np.lexsort((chosen, -values[chosen]))]


def reference_step(logits: np.ndarray, st, eos: np.ndarray, params: GenerationParams, batch: int):
    """One step for every prompt not yet done, in place on the state st (see GPT2Runner.beam_state):
    seq / fin_seq / indir (R, L), run_scores / fin_scores / fin_len / fin_flag / next_ids /
    next_pos (R,), flags (B, 3) = improvable, done, non-finite logits; starts (B,); max_new (1,):
    max_new_tokens; step (1,); banned[:n_banned[0]]: tokens banned after the processors above them
    (HF's bad_words_ids), before the renormalisation."""
    nb, vocab = params.num_beams, logits.shape[1]
    keep = candidates_per_item(params)
    top_mask = np.arange(keep) < nb
    step = int(st.step[0])
    penalty = params.length_penalty
    banned = np.asarray(st.banned[:int(st.n_banned[0])], dtype=np.int64)
    for b in range(batch):
        if st.flags[b, 1]:
            continue
        rows = slice(b * nb, (b + 1) * nb)
        if not np.isfinite(logits[rows]).all():
            st.flags[b, 1:] = 1
            continue
        start = int(st.starts[b])
        cur, max_length = start + step, start + int(st.max_new[0])
        running = st.seq[rows, :cur]
        seen = np.zeros((nb, vocab), dtype=np.uint8)
        for i in range(nb):
            seen[i, running[i]] = 1
        histories = [r.tolist() for r in running] if params.no_repeat_ngram_size else None
        log_probs = P.process(_log_softmax(logits[rows]), seen, eos, step, params, histories)
        log_probs[:, banned] = P.NEG_INF
        if params.renormalize_logits:
            log_probs = _log_softmax(log_probs)
        total = (log_probs + st.run_scores[rows][:, None]).reshape(-1)           # (beams * V,)
        pick = _top(total, keep)
        cand_scores, parent, token = total[pick], pick // vocab, pick % vocab
        cand_seq = np.concatenate([running[parent], token[:, None]], axis=1)  # (keep, cur + 1)
        hits = (cur + 1 >= max_length) | np.isin(token, eos)

        # the best candidates that did not stop continue
        cont = cand_scores + hits.astype(np.float32) * NEG
        nxt = _top(cont, nb)
        parents = parent[nxt]

        # the top num_beams candidates that stopped may enter the finished set
        scored = cand_scores / np.float32((cur + 1 - start) ** penalty)
        if st.fin_flag[rows].all() and params.early_stopping is True:
            scored = scored + NEG
        if not st.flags[b, 0]:
            scored = scored + NEG
        scored = scored + (~(hits & top_mask)).astype(np.float32) * NEG
        merged = _top(np.concatenate([st.fin_scores[rows], scored]), nb)
        fin_scores = np.concatenate([st.fin_scores[rows], scored])[merged]
        fin_flag = np.concatenate([st.fin_flag[rows], hits & top_mask])[merged]
        st.fin_seq[rows, :cur + 1] = np.concatenate([st.fin_seq[rows, :cur + 1], cand_seq])[merged]
        st.fin_len[rows] = np.concatenate([st.fin_len[rows], np.full(keep, cur + 1 - start)])[merged]
        st.fin_scores[rows], st.fin_flag[rows] = fin_scores, fin_flag

        st.seq[rows, :cur + 1] = cand_seq[nxt]
        st.run_scores[rows] = cont[nxt]
        st.indir[rows, :cur] = st.indir[rows][parents, :cur]
        st.indir[rows, cur] = np.arange(b * nb, (b + 1) * nb)
        st.next_ids[rows], st.next_pos[rows] = token[nxt], cur

        if params.early_stopping == "never" and penalty > 0.0:
            best_length = max_length - start
        else:
            best_length = cur + 1 - start
        best_possible = cont[nxt][0] / np.float32(best_length ** penalty)
        worst_finished = np.where(fin_flag, fin_scores.min(), NEG)
        improvable = bool(st.flags[b, 0]) and bool((best_possible > worst_finished).any())
        st.flags[b, 0] = improvable
        st.flags[b, 1] = (not improvable) or (fin_flag.all() and params.early_stopping is True) or hits.all()
    st.step[0] = step + 1


def beam_search(runner, prompts: list, params: GenerationParams) -> list:
    """Per prompt, [(new token ids, score)] for the best params.num_return_sequences hypotheses,
    best first. All prompts run together; the host reads the done flags every few steps while the
    next steps run."""
    check_prompts(prompts, params, runner.config.n_positions)
    batch, total = len(prompts), params.max_new_tokens
    runner.beam_start(prompts, params)
    for flags in pipelined(total, lambda n: runner.beam_steps(batch, n, params),
                           lambda first, last: runner.fetch_beam_flags(batch)):
        bad = np.flatnonzero(flags[:, 2])
        if bad.size:
            raise InputError(f"non-finite logits (NaN or inf) for prompt {bad[0] + 1}; the model or its "
                             "weights produce invalid values")
        if flags[:, 1].all():
            break
    return runner.beam_results(prompts, params)


def hypotheses(runner, prompts: list, params: GenerationParams) -> list:
    """Per prompt, [(new token ids, score)]: beam_search's with num_beams > 1, else the one greedy
    or sampled continuation (score None), gathered from stream_tokens."""
    if params.num_beams > 1:
        return beam_search(runner, prompts, params)
    new = [[] for _ in prompts]
    for step in stream_tokens(runner, prompts, params):
        for b, token in step:
            new[b].append(token)
    return [[(tokens, None)] for tokens in new]
