"""Beam search on the NumPy backend against HF `generate(num_beams=4, num_return_sequences=2)`:
token-exact hypotheses and scores, for every early_stopping x length_penalty, with an eos id the
model actually produces, prompts of different lengths."""

import numpy as np
import pytest

from ftengine.checkpoint import load_gpt2_weights
from ftengine.config import load_gpt2_config
from ftengine.backends import numpy_ops
from ftengine.decoding.beam import beam_search
from ftengine.decoding.generate import GenerationParams
from ftengine.errors import InputError
from ftengine.generator import Generator
from ftengine.models.gpt2 import GPT2Runner
from tests.hf_oracle import hf_gpt2
from tests.tolerances import BEAM_SCORE_FP32
from weights.fixtures import write_gpt2_checkpoint

PAD = 255
NEW = 12


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return write_gpt2_checkpoint(tmp_path_factory.mktemp("beam"), seed=9, n_embd=48, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def hf(gpt2):
    return hf_gpt2(gpt2)


@pytest.fixture(scope="module")
def runner(gpt2):
    config = load_gpt2_config(gpt2)
    return GPT2Runner(config, load_gpt2_weights(gpt2, config), numpy_ops, dtype="fp32", max_batch=4,
                      max_len=config.n_positions)


@pytest.fixture(scope="module")
def cases(runner):
    """Prompts of three lengths, each with an eos id its own greedy continuation produces early."""
    rng = np.random.default_rng(21)
    out = []
    for n in (2, 7, 13):
        prompt = rng.integers(0, 250, n).tolist()
        runner.prefill([prompt])
        first = int(np.argmax(runner.logits(1)[0]))
        runner.decode(np.array([first]), np.array([n]))
        out.append((prompt, int(np.argmax(runner.logits(1)[0]))))  # the second greedy token
    return out


def _hf_beams(hf, prompt, eos, **kwargs):
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=2,
                          output_scores=True, return_dict_in_generate=True, max_new_tokens=NEW,
                          eos_token_id=eos, pad_token_id=PAD, do_sample=False, **kwargs)
    return out.sequences[:, len(prompt):].tolist(), out.sequences_scores.numpy()


def assert_beams_match_hf(hf, ops, path, cases, **options):
    """All prompts in one batch, the eos ids of every case shared, against HF on each prompt alone:
    token-exact hypotheses, scores within BEAM_SCORE_FP32."""
    config = load_gpt2_config(path)
    runner = GPT2Runner(config, load_gpt2_weights(path, config), ops, dtype="fp32", max_batch=4 * len(cases),
                        max_len=config.n_positions)
    eos = tuple(sorted({e for _, e in cases}))
    params = GenerationParams(max_new_tokens=NEW, num_beams=4, num_return_sequences=2, eos_token_ids=eos,
                              **options).checked(vocab_size=config.vocab_size)
    ours = beam_search(runner, [p for p, _ in cases], params)
    for (prompt, _), hypotheses in zip(cases, ours):
        rows, scores = _hf_beams(hf, prompt, list(eos), **options)
        for (tokens, score), row, ref_score in zip(hypotheses, rows, scores):
            assert row[:len(tokens)] == tokens and all(t == PAD for t in row[len(tokens):]), (prompt, row, tokens)
            assert abs(score - ref_score) <= BEAM_SCORE_FP32
    return ours


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [0.0, 0.5, 1.0, 2.0])
def test_beams_match_hf(gpt2, hf, cases, early_stopping, length_penalty):
    assert_beams_match_hf(hf, numpy_ops, gpt2, cases, early_stopping=early_stopping, length_penalty=length_penalty)


def test_the_eos_ids_end_hypotheses_early(gpt2, hf, cases):
    """The comparison above is meaningful: with these eos ids, hypotheses do finish before max length."""
    ours = assert_beams_match_hf(hf, numpy_ops, gpt2, cases)
    eos = {e for _, e in cases}
    for (prompt, _), hypotheses in zip(cases, ours):
        assert any(t[-1] in eos and len(t) < NEW for t, _ in hypotheses), prompt


def test_top_equals_a_stable_sort():
    """decoding/beam.py _top (a partition, then the candidates sorted) gives what a stable sort of
    -values gives, on values with many ties, -inf, -0.0 and NEG-shifted scores."""
    from ftengine.decoding.beam import NEG, _top
    rng = np.random.default_rng(3)
    for trial in range(2000):
        n = int(rng.integers(1, 3000))
        k = int(rng.integers(1, min(n, 70) + 1))
        kind = trial % 4
        if kind == 0:
            values = rng.standard_normal(n).astype(np.float32)
        elif kind == 1:
            values = rng.integers(-3, 3, n).astype(np.float32)
        elif kind == 2:
            values = rng.standard_normal(n).astype(np.float32)
            values[rng.random(n) < 0.3] = -np.inf
        else:
            values = np.round(rng.standard_normal(n), 1).astype(np.float32) + NEG
            values[rng.random(n) < 0.2] = -0.0
        np.testing.assert_array_equal(_top(values, k), np.argsort(-values, kind="stable")[:k], err_msg=f"{n} {k}")


# each processor alone, then with renormalize_logits (a log-softmax after them: other scores, at
# times other beams)
PROCESSORS = [dict(no_repeat_ngram_size=2), dict(repetition_penalty=1.5), dict(min_new_tokens=5)]
PROCESSOR_OPTIONS = PROCESSORS + [{**o, "renormalize_logits": True} for o in PROCESSORS] + [
    dict(no_repeat_ngram_size=2, repetition_penalty=1.3, min_new_tokens=3, renormalize_logits=True)]


@pytest.mark.parametrize("options", PROCESSOR_OPTIONS)
def test_beams_with_processors_match_hf(gpt2, hf, cases, options):
    assert_beams_match_hf(hf, numpy_ops, gpt2, cases, **options)


@pytest.mark.parametrize("options", PROCESSORS)
def test_renormalizing_changes_the_scores(gpt2, hf, cases, options):
    """The renormalised comparisons above test something: HF's scores move with it."""
    plain = [s for p, _ in cases for s in _hf_beams(hf, p, [e for _, e in cases], **options)[1]]
    renormalized = [s for p, _ in cases
                    for s in _hf_beams(hf, p, [e for _, e in cases], renormalize_logits=True, **options)[1]]
    assert np.abs(np.array(plain) - np.array(renormalized)).max() > 100 * BEAM_SCORE_FP32


def check_no_repeat_ngram(path, hf, ngram, device):
    """Greedy and beam search with no_repeat_ngram_size against HF on the same prompt."""
    import torch
    gen = Generator.from_pretrained(path, device=device, dtype="fp32")
    text = "the cat sat on the mat"
    prompt = gen.encode_prompts([text])[0]
    ours = gen.generate([text], max_new_tokens=NEW, no_repeat_ngram_size=ngram, eos_token_id=PAD + 1)[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          no_repeat_ngram_size=ngram, pad_token_id=PAD, eos_token_id=PAD + 1)
    assert ours.token_ids == ref[0, len(prompt):].tolist()
    if ngram == 1:  # the ban is in effect: no token of prompt or output repeats
        assert not set(ours.token_ids) & set(prompt) and len(set(ours.token_ids)) == len(ours.token_ids)
        assert ours.token_ids != gen.generate([text], max_new_tokens=NEW, eos_token_id=PAD + 1)[0].token_ids
    beams = gen.generate([text], max_new_tokens=NEW, no_repeat_ngram_size=ngram, num_beams=4,
                         num_return_sequences=2, eos_token_id=PAD + 1)[0]
    rows, scores = _hf_beams(hf, prompt, PAD + 1, no_repeat_ngram_size=ngram)
    assert [c.token_ids for c in beams.candidates] == [r[:len(c.token_ids)] for r, c in zip(rows, beams.candidates)]
    assert np.abs(np.array([c.score for c in beams.candidates]) - scores).max() <= BEAM_SCORE_FP32


@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_no_repeat_ngram_matches_hf_in_greedy_and_beams(gpt2, hf, ngram):
    check_no_repeat_ngram(gpt2, hf, ngram, "cpu")


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=0), "num_beams must be within 1..257"),
    (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences must be within 1..num_beams \(2\)"),
    (dict(num_beams=2, do_sample=True), "beam sampling is not supported"),
    (dict(num_beams=2, early_stopping="sometimes"), "early_stopping must be true, false or 'never'"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be >= 0"),
])
def test_beam_options_are_validated(gpt2, kwargs, message):
    with pytest.raises(InputError, match=message):
        Generator.from_pretrained(gpt2, device="cpu").generate(["hi"], max_new_tokens=4, **kwargs)
