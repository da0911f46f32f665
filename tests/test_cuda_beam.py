"""GPU: beam search and no_repeat_ngram_size on the CUDA backend against HF `generate` (fp32),
with the prompts, eos ids and checks of the NumPy-backend tests (tests/test_beam_search.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from ftengine.checkpoint import load_gpt2_weights
from ftengine.config import load_gpt2_config
from ftengine.decoding.beam import CANDIDATE_CHUNK, NEG, beam_search, candidates_per_item, reference_step
from ftengine.decoding.generate import GenerationParams
from ftengine.models.gpt2 import GPT2Runner
from tests.test_beam_search import NEW, PAD, PROCESSOR_OPTIONS, assert_beams_match_hf, cases, check_no_repeat_ngram, gpt2, hf, runner  # noqa: F401
from tests.tolerances import BEAM_SCORE_FP32

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    return ops


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [0.0, 0.5, 1.0, 2.0])
def test_cuda_beams_match_hf(cu, gpt2, hf, cases, early_stopping, length_penalty):  # noqa: F811
    assert_beams_match_hf(hf, cu, gpt2, cases, early_stopping=early_stopping, length_penalty=length_penalty)


@pytest.mark.parametrize("options", PROCESSOR_OPTIONS)
def test_cuda_beams_with_processors_match_hf(cu, gpt2, hf, cases, options):  # noqa: F811
    assert_beams_match_hf(hf, cu, gpt2, cases, **options)


@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_cuda_no_repeat_ngram_matches_hf_in_greedy_and_beams(gpt2, hf, ngram):  # noqa: F811
    check_no_repeat_ngram(gpt2, hf, ngram, "cuda")


def _beams(cu, path, prompts, dtype, graphs, eos):
    config = load_gpt2_config(path)
    r = GPT2Runner(config, load_gpt2_weights(path, config), cu, dtype=dtype, max_batch=4 * len(prompts),
                   max_len=config.n_positions, graphs=graphs)
    params = GenerationParams(max_new_tokens=NEW, num_beams=4, num_return_sequences=4, eos_token_ids=eos,
                              length_penalty=0.7).checked(vocab_size=config.vocab_size)
    return beam_search(r, prompts, params)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_cuda_beams_same_with_and_without_graphs(cu, gpt2, cases, dtype):  # noqa: F811
    prompts, eos = [p for p, _ in cases], tuple(sorted({e for _, e in cases}))
    ours = _beams(cu, gpt2, prompts, dtype, True, eos)
    assert ours == _beams(cu, gpt2, prompts, dtype, False, eos)
    for hypotheses in ours:
        scores = [s for _, s in hypotheses]
        assert all(np.isfinite(scores)) and scores == sorted(scores, reverse=True)
        assert all(1 <= len(t) <= NEW for t, _ in hypotheses)


def test_too_many_beam_candidates_for_the_gpu_is_a_clear_error(gpt2):  # noqa: F811
    from ftengine.errors import DeviceError
    from ftengine.generator import Generator
    gen = Generator.from_pretrained(gpt2, device="cuda", dtype="fp32")
    with pytest.raises(DeviceError, match=r"at most 64 candidates per prompt; num_beams 33 with 1 eos id\(s\) needs 66"):
        gen.generate(["hi"], max_new_tokens=4, num_beams=33, eos_token_id=PAD + 1)


def _beam_state(prompts, nb, length, max_new, banned=()):
    """A beam state as GPT2Runner.beam_start uploads it (NumPy), with the CUDA kernels' scratch."""
    batch, r = len(prompts), len(prompts) * nb
    seq = np.zeros((r, length), np.int32)
    for i, p in enumerate(prompts):
        seq[i * nb:(i + 1) * nb, :len(p)] = p
    return SimpleNamespace(
        seq=seq, fin_seq=seq.copy(), indir=np.repeat(np.arange(r, dtype=np.int32), length).reshape(r, length),
        run_scores=np.tile(np.array([0.0] + [NEG] * (nb - 1), np.float32), batch),
        fin_scores=np.full(r, NEG, np.float32), fin_len=np.zeros(r, np.int32), fin_flag=np.zeros(r, np.int32),
        next_ids=np.zeros(r, np.int32), next_pos=np.zeros(r, np.int32),
        flags=np.tile(np.array([1, 0, 0], np.int32), (batch, 1)), starts=np.array([len(p) for p in prompts], np.int32),
        max_new=np.array([max_new], np.int32), step=np.zeros(1, np.int32),
        banned=np.array(list(banned) or [0], np.int32), n_banned=np.array([len(banned)], np.int32))


RENORMALIZED = dict(renormalize_logits=True, repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=2)


BANNED = (3, 4095, 4096, 50000, 50255)  # slice edges, and the last (partial) slice


@pytest.mark.parametrize("num_beams, eos, options, banned", [
    (4, (7,), {}, ()), (4, (7, 50256), {}, ()), (16, (7,), {}, ()), (4, (7, 50256), RENORMALIZED, ()),
    (4, (7,), {}, BANNED), (4, (7, 50256), RENORMALIZED, BANNED)])
def test_cuda_beam_step_matches_the_reference_over_vocabulary_slices(cu, num_beams, eos, options, banned):
    """ops.beam_select against decoding/beam.py reference_step, step by step on random logits over
    GPT-2's vocabulary (13 slices of CANDIDATE_CHUNK tokens, the last one partial), three prompts
    until every one is done (eos ids favoured at some steps, max_new_tokens 5): the same tokens,
    parents, cache indirection, lengths and flags, scores within BEAM_SCORE_FP32; 4 and 16 beams
    (8 and 32 candidates a prompt), one and two eos ids (one in the last, partial slice); the
    processors with renormalize_logits (prompts with repeats, so that the penalty and the n-gram
    ban apply); tokens banned after the log-softmax (bad_words_ids), made likely at some steps."""
    vocab, max_new, length = 50257, 5, 24
    assert -(-vocab // CANDIDATE_CHUNK) == 13 and vocab % CANDIDATE_CHUNK
    rng = np.random.default_rng(num_beams + len(eos))
    prompts = [rng.integers(0, vocab, n).tolist() for n in (3, 9, 1)]
    if options:  # a repeated bigram ending the prompt: the ban applies from the first step
        prompts[1] = prompts[1][:4] * 2 + prompts[1][:1]
    params = GenerationParams(max_new_tokens=max_new, num_beams=num_beams, eos_token_ids=eos,
                              length_penalty=0.8, **options).checked(vocab_size=vocab)
    batch, r = len(prompts), len(prompts) * num_beams
    host = _beam_state(prompts, num_beams, length, max_new, banned)
    slices = -(-vocab // CANDIDATE_CHUNK)
    dev = SimpleNamespace(**{k: cu.to_device(v) for k, v in vars(host).items()},
                          scratch=cu.to_device(np.zeros((3 * r, length), np.int32)),
                          stats=cu.to_device(np.zeros((r, slices, 2), np.float32)),
                          renorm=cu.to_device(np.zeros((r, slices, 2), np.float32)),
                          keys=cu.to_device(np.zeros(r * slices * candidates_per_item(params), np.uint64)))
    eos_dev = cu.to_device(np.array(eos, np.int32))
    for step in range(max_new + 1):
        logits = (rng.standard_normal((r, vocab)) * 3).astype(np.float32)
        if step % 2:
            logits[:, list(eos)] += 6.0
        else:
            logits[:, list(banned)] += 6.0
        on_device = cu.to_device(logits)
        reference_step(logits, host, np.array(eos), params, batch)
        cu.beam_select(on_device, dev, eos_dev, params=params, batch=batch)
        for name in ("seq", "fin_seq", "indir", "fin_len", "fin_flag", "next_ids", "next_pos", "flags", "step"):
            np.testing.assert_array_equal(cu.to_host(getattr(dev, name)), getattr(host, name), err_msg=f"{name}, step {step}")
        for name in ("run_scores", "fin_scores"):  # scores shifted by NEG round to multiples of 64: a float32 ulp
            np.testing.assert_allclose(cu.to_host(getattr(dev, name)), getattr(host, name),
                                       rtol=np.finfo(np.float32).eps, atol=BEAM_SCORE_FP32, err_msg=f"{name}, step {step}")
    assert host.flags[:, 1].all() and host.fin_flag.any()
