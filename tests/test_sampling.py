"""Logits processors against HF's, the Philox RNG against its published test vectors, and the
sampler's frequencies against the distribution it samples from."""

import numpy as np
import pytest

from ftengine.decoding import processors as P
from ftengine.decoding.philox import philox4x32, uniforms
from tests.tolerances import PROCESSORS_FP32

# Random123's known-answer vectors for Philox4x32-10 (counter, key, output)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(x) for x in philox4x32(counter, key)) == expected


def test_philox_vectorised_and_uniforms():
    counters = np.array([c for c, _, _ in PHILOX_KAT])
    keys = np.array([k for _, k, _ in PHILOX_KAT])
    assert [tuple(map(int, row)) for row in philox4x32(counters, keys)] == [e for _, _, e in PHILOX_KAT]
    u = uniforms(7, np.arange(100_000), 3)
    assert u.dtype == np.float32 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and not np.array_equal(u, uniforms(7, np.arange(100_000), 4))


def _torch(x):
    import torch
    return torch.from_numpy(x)


@pytest.fixture
def logits():
    return np.random.default_rng(0).standard_normal((6, 500)).astype(np.float32) * 3


def _same(ours, ref):
    ref = ref.numpy()
    assert np.array_equal(np.isneginf(ours), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(ours[finite], ref[finite], rtol=PROCESSORS_FP32, atol=PROCESSORS_FP32)


@pytest.mark.parametrize("t", [0.3, 0.7, 1.5])
def test_temperature_matches_hf(logits, t):
    from transformers.generation.logits_process import TemperatureLogitsWarper
    _same(P.temperature(logits, t), TemperatureLogitsWarper(t)(None, _torch(logits.copy())))


@pytest.mark.parametrize("k", [1, 2, 40, 499, 500])
def test_top_k_matches_hf(logits, k):
    from transformers.generation.logits_process import TopKLogitsWarper
    _same(P.top_k(logits, k), TopKLogitsWarper(k)(None, _torch(logits.copy())))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999, 1.0])
def test_top_p_matches_hf(logits, p):
    from transformers.generation.logits_process import TopPLogitsWarper
    _same(P.top_p(logits, p), TopPLogitsWarper(p)(None, _torch(logits.copy())))


def test_top_k_then_top_p_matches_hf(logits):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    ref = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(30)(None, _torch(logits.copy())))
    _same(P.top_p(P.top_k(logits, 30), 0.8), ref)


@pytest.mark.parametrize("penalty", [0.7, 1.2, 2.0])
def test_repetition_penalty_matches_hf(logits, penalty):
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    rng = np.random.default_rng(1)
    histories = [rng.integers(0, 500, n).tolist() for n in (1, 5, 40, 7, 3, 60)]  # repeats included
    width = max(len(h) for h in histories)
    ref = []
    for row, h in zip(logits, histories):  # HF takes a rectangular id tensor: one row at a time
        ids = torch.tensor([h + [h[-1]] * (width - len(h))])
        ref.append(RepetitionPenaltyLogitsProcessor(penalty)(ids, _torch(row[None].copy()))[0])
    seen = np.zeros(logits.shape, np.uint8)
    for b, h in enumerate(histories):
        seen[b, h] = 1
    _same(P.repetition_penalty(logits, seen, penalty), torch.stack(ref))


def test_sampled_frequencies_match_the_distribution():
    """Chi-square of 200,000 seeded draws from a fixed 12-token distribution (with a zero)."""
    probs = np.array([0.3, 0.2, 0.1, 0.1, 0.08, 0.07, 0.05, 0.04, 0.03, 0.02, 0.01, 0.0])
    scores = np.log(np.maximum(probs, 1e-30)).astype(np.float32)
    scores[-1] = -np.inf
    n = 200_000
    draws = P.sample(np.broadcast_to(scores, (n, len(probs))), uniforms(2024, np.arange(n), 0))
    counts = np.bincount(draws, minlength=len(probs))
    assert counts[-1] == 0
    expected = probs[:-1] * n
    chi2 = (((counts[:-1] - expected) ** 2) / expected).sum()
    assert chi2 < 31.26  # chi-square critical value, 10 degrees of freedom, p = 0.001
