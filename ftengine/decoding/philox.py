"""Philox4x32-10 (Salmon et al., SC'11), the counter-based RNG of seeded sampling, in NumPy.

(seed, sequence index, step) -> one uniform in [0, 1): counter (step, sequence, 0, 0), key
(seed low 32 bits, seed high 32 bits); the first output word's top 24 bits / 2^24.
Vectorised over counters; uint64 arithmetic for the 32 x 32 -> 64-bit products.
"""

from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57   # multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85   # key schedule (golden ratio, sqrt(3) - 1)
ROUNDS = 10
MASK = 0xFFFFFFFF


def philox4x32(counter, key) -> np.ndarray:
    """counter (..., 4), key (..., 2) as unsigned 32-bit integers -> (..., 4) uint32."""
    c = np.asarray(counter, dtype=np.uint64) & MASK
    k = np.asarray(key, dtype=np.uint64) & MASK
    c0, c1, c2, c3 = (c[..., i] for i in range(4))
    k0, k1 = k[..., 0], k[..., 1]
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p1 = c0 * M0, c2 * M1
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def uniforms(seed: int, sequences, step: int) -> np.ndarray:
    """One float32 uniform in [0, 1) per sequence index, for this seed and step."""
    seq = np.asarray(sequences, dtype=np.uint64)
    counter = np.stack([np.full_like(seq, step), seq, np.zeros_like(seq), np.zeros_like(seq)], axis=-1)
    key = np.broadcast_to(np.array([seed & MASK, (seed >> 32) & MASK], dtype=np.uint64), counter.shape[:-1] + (2,))
    word = philox4x32(counter, key)[..., 0]
    return ((word >> 8).astype(np.float32) * np.float32(2.0 ** -24))
