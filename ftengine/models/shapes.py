"""The shapes a pass runs at: a batch's tokens, sequences and longest sequence rounded up to a few
buckets (the BERT encoders' two layouts, GPT-2's prefills, the encoder-decoders' encoder), so that
a CUDA graph captured for one shape serves many batches; and whether a batch fits a runner."""

from __future__ import annotations

import numpy as np


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return -(-x // m) * m


def bucket_padded(b: int, s: int, *, max_seq_len: int, max_batch_tokens: int) -> tuple[int, int]:
    """The padded shape a (b, s) batch runs at: s up to a multiple of 16, b up to a power of two
    (multiples of 16 past 16), within the limits (b * s itself must fit them).
    Few distinct shapes -> few CUDA graphs."""
    s_pad = min(max_seq_len, round_up(s, 16))
    if b * s_pad > max_batch_tokens:
        s_pad = s
    b_pad = 1 << (b - 1).bit_length() if b <= 16 else round_up(b, 16)
    return max(b, min(b_pad, max_batch_tokens // s_pad)), s_pad


def bucket_packed(t: int, b: int, s: int, *, max_batch_tokens: int, max_seq_len: int) -> tuple[int, int, int]:
    """(tokens, sequences, longest) a packed batch runs at: tokens up to a multiple of 64 to
    512, then up to a quarter of the power of two below them (640, 768, 896, 1024, 1280, ...:
    four rungs an octave, each power of two one, so that full batches of power-of-two shapes
    carry no padding); sequences up to a power of two; longest up to 32 (the CUDA attention's
    short-sequence kernel: attention.py VARLEN_SHORT_SEQ) or a multiple of 64 (its query tile)."""
    t_pad = round_up(t, 64)
    if t_pad > 512:
        t_pad = round_up(t, 1 << ((t - 1).bit_length() - 3))
    t_pad = min(t_pad, max_batch_tokens)
    b_pad = min(1 << (b - 1).bit_length(), max_batch_tokens)
    return t_pad, b_pad, min(32 if s <= 32 else round_up(s, 64), max_seq_len)


def run_shape(layout: str, lengths: np.ndarray, *, max_batch_tokens: int, max_seq_len: int,
              totals: tuple = ()) -> tuple:
    """The bucketed shape (tokens, sequences, longest) a batch of these lengths runs at; totals:
    their (sum, max) where the caller has them."""
    b = len(lengths)
    total, s = totals or (int(lengths.sum()), int(lengths.max()))
    if layout == "padded":
        bp, sp = bucket_padded(b, s, max_seq_len=max_seq_len, max_batch_tokens=max_batch_tokens)
        return bp * sp, bp, sp
    return bucket_packed(total, b, s, max_batch_tokens=max_batch_tokens, max_seq_len=max_seq_len)


def fits(layout: str, count: int, total: int, longest: int, *, max_batch_tokens: int, max_seq_len: int) -> bool:
    """Whether `count` sequences of `total` tokens, the longest `longest`, fit one batch: real
    tokens when packed, count x longest when padded."""
    used = count * longest if layout == "padded" else total
    return used <= max_batch_tokens and longest <= max_seq_len


def fit_count(layout: str, count: int, total: int, longest: int, lengths: np.ndarray, *, max_batch_tokens: int,
              max_seq_len: int) -> int:
    """How many of `lengths` (longest first), taken in order, join a batch of `count` sequences of
    `total` tokens, the longest `longest`, while it `fits`; into an empty batch at least one."""
    if not len(lengths):
        return 0
    widest = max(longest, int(lengths[0]))  # longest first: the widest of any prefix
    if widest > max_seq_len:
        n = 0
    elif layout == "padded":
        n = max_batch_tokens // widest - count
    else:
        n = int(np.searchsorted(np.cumsum(lengths), max_batch_tokens - total, side="right"))
    n = min(max(n, 0), len(lengths))
    return n if count else max(n, 1)

