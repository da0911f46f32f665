"""Launchers of the decoder's token choice (greedy, sampling, HF's logits processors) and its
bookkeeping (kernels_cu/sampling.cu, sampling_levels.cu; on sm_90+, sampling_cluster.cu), and of
beam search's selection (beam.cu)."""

from __future__ import annotations

import numpy as np

from ...errors import DeviceError
from .kernels import kernel
from .runtime import _launch, _threads, context


# sampling.cu token choice: threads per block, the most slices per row, the fewest tokens a slice
# gets, histogram bins and the u64 words of a row's state (the bins and 8 words)
CHOICE_THREADS, CHOICE_SLICES_MAX, CHOICE_SLICE_MIN = 256, 64, 1024
CHOICE_BINS, CHOICE_STATE_WORDS = 2048, 2048 + 8

# sampling_cluster.cu choose_sample (sm_90: a thread-block cluster per row): threads per block, the most blocks of
# a cluster (a power of two), the u32 words of a block's histogram (three pieces of each bin's mass), the most tokens
# a block holds (no piece's sum passes 32 bits) and the room for a select's candidates past its first digit.
# (measurements: docs/gpu-internals.md, sampling.py SAMPLE_THREADS, SAMPLE_CLUSTER_MAX, SAMPLE_HIST_WORDS, SAMPLE_SLICE_MAX)
SAMPLE_THREADS, SAMPLE_CLUSTER_MAX, SAMPLE_HIST_WORDS, SAMPLE_SLICE_MAX = 256, 8, 3 * 2048, 65536
SAMPLE_CANDIDATES = 2048
# each file's kernels (none templated on the element type: families.SHARED)
SAMPLING_KERNELS = {"sampling.cu": ["choose_prepare", "mark_seen", "append_tokens", "increment"],
                    "sampling_levels.cu": ["choose_level", "choose_draw"],
                    "sampling_cluster.cu": ["choose_sample<false>", "choose_sample<true>"],
                    "beam.cu": ["beam_logsumexp", "beam_candidates", "beam_select"]}


def mark_seen(seen, tokens, rows):
    n = tokens.size
    _launch("sampling.cu", "mark_seen", (max(1, -(-n // 256)),), (256,),
            (seen, tokens, rows, np.int32(n), np.int32(seen.shape[1])))


def choice_slices(b: int, v: int) -> tuple[int, int, int]:
    """(slices, tokens per slice, tokens per chunk) of each row's vocabulary in the token choice:
    enough blocks for about two waves of 128 at any batch, slices of at least CHOICE_SLICE_MIN
    tokens, none empty; the draw's chunks (a multiple of 32 tokens dividing the slice) fit the
    row's CHOICE_BINS state words. Depends on (b, v) only, so a draw's sums are the same on every GPU."""
    chunk = 32 * -(-v // (32 * CHOICE_BINS))
    slices = max(1, min(CHOICE_SLICES_MAX, -(-256 // b), -(-v // CHOICE_SLICE_MIN)))
    size = -(-v // slices // chunk) * chunk
    return -(-v // size), size, chunk


def sample_clusters(v: int) -> tuple[int, int]:
    """(blocks per row, tokens per block) of choose_sample: a cluster of up to SAMPLE_CLUSTER_MAX
    blocks (a power of two) with slices of at least CHOICE_SLICE_MIN tokens. Depends on v only, so
    a row's draw sums the same way at any batch size."""
    blocks = SAMPLE_CLUSTER_MAX
    while blocks > 1 and -(-v // blocks) < CHOICE_SLICE_MIN:
        blocks //= 2
    return blocks, -(-v // blocks)


def _sample_shared_mem(blocks: int, slice_: int) -> int:
    """choose_sample's dynamic shared memory: a histogram, a range of the cluster's, the slice and
    a select's candidates (its static shared memory, sample_few's copies of them among it, comes
    on top)."""
    return SAMPLE_HIST_WORDS * 4 + CHOICE_BINS // blocks * 8 + 4 * (slice_ + SAMPLE_CANDIDATES)


# Measurements: docs/gpu-internals.md, sampling.py choose_tokens
def choose_tokens(out, logits, seen, eos, step, *, scratch, state, params, seed, seq=None, lengths=None):
    """out (B,) int32: the next token of each row of logits (B, V) float32; HF processors and
    order (reference: decoding/processors.py choose); -1 for a non-finite row. Each row's
    vocabulary is split over several blocks (sampling.cu; sampling's selects and draw:
    sampling_levels.cu); sampling on sm_90+ runs as one kernel, a thread-block cluster per row,
    where a block's slice fits its shared memory. step (1,) int32,
    seed (2,) uint32 (the draw's seed, GenerationParams.seed_words: read here, not params.seed)
    and, for no_repeat_ngram_size, seq (B, L) / lengths (B,) are device arrays; scratch (B, V)
    float32; state (B, CHOICE_STATE_WORDS) uint64, zero before the call and left zero after it."""
    b, v = logits.shape
    ngram = params.no_repeat_ngram_size
    if ngram and (seq is None or lengths is None):
        raise ValueError("no_repeat_ngram_size needs the sequences (seq, lengths)")
    if state.shape[0] < b or state.shape[1] != CHOICE_STATE_WORDS or state.dtype != np.uint64:
        raise ValueError(f"state must be ({b}, {CHOICE_STATE_WORDS}) uint64, got {state.shape} {state.dtype}")
    seq = step if seq is None else seq
    lengths = step if lengths is None else lengths
    length = seq.shape[1] if seq.ndim == 2 else 0
    sample = bool(params.do_sample)
    # token masses in fixed point: v * 2^bits < 2^63
    scale = np.float64(2.0 ** (63 - int(np.ceil(np.log2(v + 1)))))
    if seed.shape != (2,) or seed.dtype != np.uint32:
        raise ValueError(f"seed must be (2,) uint32 (its low and high words), got {seed.shape} {seed.dtype}")
    blocks, slice_ = sample_clusters(v)
    smem = _sample_shared_mem(blocks, slice_)
    ctx = context()
    # top-k's select finds its threshold among at most SAMPLE_FEW candidates in one step (and top-p after it among
    # top-k's survivors): choose_sample<true>. (measurements: docs/gpu-internals.md, sampling.py choose_sample)
    name = f"choose_sample<{'true' if 0 < params.top_k < v else 'false'}>"
    if (sample and ctx.clusters and slice_ <= SAMPLE_SLICE_MAX
            and smem + kernel("sampling_cluster.cu", name).shared_size_bytes <= ctx.shared_mem_optin):
        _launch("sampling_cluster.cu", name, (b, blocks), (SAMPLE_THREADS,),
                (out, logits, seen, eos, np.int32(eos.size), step, seq, lengths, np.int32(length), np.int32(ngram),
                 np.int32(v), np.int32(slice_), np.int32(params.min_new_tokens), np.float32(params.temperature),
                 np.float32(params.repetition_penalty), np.int32(params.top_k), np.float32(params.top_p), scale,
                 seed),
                shared_mem=smem, cluster=(1, blocks, 1))
        return
    slices, size, chunk = choice_slices(b, v)
    grid, block, words = (b, slices), (CHOICE_THREADS,), np.int32(CHOICE_STATE_WORDS)
    _launch("sampling.cu", "choose_prepare", grid, block,
            (out, scratch, logits, seen, eos, np.int32(eos.size), step, seq, lengths, np.int32(length),
             np.int32(ngram), np.int32(v), np.int32(size), np.int32(params.min_new_tokens), np.int32(sample),
             np.float32(params.temperature), np.float32(params.repetition_penalty), state, words))
    if not sample:
        return
    for mode, on in ((0, 0 < params.top_k < v), (1, params.top_p < 1.0)):
        for level in range(3) if on else ():
            _launch("sampling_levels.cu", "choose_level", grid, block,
                    (scratch, state, words, np.int32(v), np.int32(size), np.int32(level), np.int32(mode),
                     np.int32(params.top_k), np.float32(params.top_p), scale))
    _launch("sampling_levels.cu", "choose_draw", grid, block,
            (out, scratch, state, words, np.int32(v), np.int32(size), np.int32(chunk), step, seed))


def append_tokens(history, seq, lengths, next_ids, next_pos, finished, seen, step, chosen, eos):
    b, length = seq.shape
    _launch("sampling.cu", "append_tokens", (1,), (_threads(b, 1024),),
            (history, seq, lengths, next_ids, next_pos, finished, seen, step, chosen, eos, np.int32(eos.size),
             np.int32(b), np.int32(length), np.int32(seen.shape[1])))


def beam_select(logits, state, eos, *, params, batch):
    """One beam-search step (reference: decoding/beam.py reference_step): row log-sum-exp as
    partial sums over CANDIDATE_CHUNK vocabulary slices (state.stats: (rows, slices, 2)), then
    FasterTransformer's two-stage top-k (vocabulary slices of each beam, then the beams of each
    item) with the processors applied in stage 1 (which adds up those partial sums first), then
    HF's bookkeeping, then step += 1. params.renormalize_logits: the processed rows' log-sum-exp
    as partial sums too (state.renorm), which stage 2 subtracts before it adds the beams' scores."""
    from ...decoding.beam import CANDIDATE_CHUNK, KEEP_MAX, candidates_per_item
    nb = params.num_beams
    rows, v = logits.shape
    length = state.seq.shape[1]
    keep = candidates_per_item(params)
    if keep > KEEP_MAX:
        raise DeviceError(f"the CUDA beam search keeps at most {KEEP_MAX} candidates per prompt; num_beams "
                          f"{nb} with {len(params.eos_token_ids)} eos id(s) needs {keep} (use fewer beams)")
    slices = -(-v // CANDIDATE_CHUNK)
    early = {False: 0, True: 1, "never": 2}[params.early_stopping]
    _launch("beam.cu", "beam_logsumexp", (rows, slices), (256,), (state.stats, state.flags, logits, np.int32(v),
                                                                  np.int32(nb), np.int32(CANDIDATE_CHUNK)))
    _launch("beam.cu", "beam_candidates", (rows, slices), (256,),
            (state.keys, state.stats, logits, state.seq, state.run_scores, state.starts, state.flags, state.step,
             eos, np.int32(eos.size), state.banned, state.n_banned, np.int32(v), np.int32(length), np.int32(nb),
             np.int32(keep), np.int32(CANDIDATE_CHUNK), np.float32(params.repetition_penalty),
             np.int32(params.min_new_tokens),
             np.int32(params.no_repeat_ngram_size), state.renorm, np.int32(params.renormalize_logits)),
            shared_mem=CANDIDATE_CHUNK * 4)
    _launch("beam.cu", "beam_select", (batch,), (256,),
            (state.keys, np.int32(slices), np.int32(v), np.int32(length), np.int32(nb), np.int32(keep),
             state.seq, state.fin_seq, state.indir, state.scratch, state.run_scores, state.fin_scores,
             state.fin_len, state.fin_flag, state.flags, state.starts, state.next_ids, state.next_pos, state.step,
             eos, np.int32(eos.size), state.max_new, np.float32(params.length_penalty),
             np.int32(early), state.renorm, np.int32(params.renormalize_logits)))
    _launch("sampling.cu", "increment", (1,), (32,), (state.step,))
