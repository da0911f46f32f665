"""Token choice, its bookkeeping and beam selection: the twins of kernels_cu/sampling.cu,
sampling_cluster.cu and beam.cu, on the reference decoding code (decoding/processors.py,
decoding/beam.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np


CHOICE_STATE_WORDS = 1  # choose_tokens' state per row: none here (the CUDA backend's keeps its selects' counts)


def mark_seen(seen, tokens, rows):
    """seen (B, V): seen[rows[i], tokens[i]] = 1, for rows[i] >= 0 (-1: a padding token)."""
    keep = rows >= 0
    seen[rows[keep], tokens[keep]] = 1


def choose_tokens(out, logits, seen, eos, step, *, scratch, state, params, seed, seq=None, lengths=None):
    """out (B,) int32: the next token of each row of logits (B, V) float32 after step[0] chosen
    tokens, HF `generate` processors and order (see decoding/processors.py), eos ids `eos` masked
    before params.min_new_tokens; -1 for a row with a non-finite logit. seed (2,) uint32: the
    draw's seed as low and high words (read here, not params.seed). seq (B, L) and lengths (B,):
    each row's tokens so far (for no_repeat_ngram_size). scratch and state: unused here."""
    from ...decoding.processors import choose
    params = replace(params, seed=int(seed[0]) | int(seed[1]) << 32)
    histories = None
    if params.no_repeat_ngram_size:
        histories = [seq[b, :lengths[b]].tolist() for b in range(len(logits))]
    out[...] = choose(logits, seen, eos, int(step[0]), params, histories)


def append_tokens(history, seq, lengths, next_ids, next_pos, finished, seen, step, chosen, eos):
    """After choose_tokens: history[step, b] = chosen[b] (-2 for a row finished earlier); a live
    row appends its token to seq (B, L), feeds it next (next_ids, next_pos), marks it seen, and
    finishes on an eos id or on -1. Then step[0] += 1."""
    s = int(step[0])
    for b in range(len(chosen)):
        if finished[b]:
            history[s, b] = -2
            continue
        token = int(chosen[b])
        history[s, b] = token
        if token < 0:
            finished[b] = 1
            continue
        n = int(lengths[b])
        seq[b, n], next_ids[b], next_pos[b], lengths[b] = token, token, n, n + 1
        seen[b, token] = 1
        if token in eos:
            finished[b] = 1
    step[0] = s + 1


def beam_select(logits, state, eos, *, params, batch):
    """One beam-search step for `batch` items of params.num_beams rows each (see
    decoding/beam.py reference_step, which this is)."""
    from ...decoding.beam import reference_step
    reference_step(logits, state, np.asarray(eos), params, batch)
