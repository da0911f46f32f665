"""GPU: beam search and no_repeat_ngram_size on the CUDA backend against HF `generate` (fp32),
with the prompts, eos ids and checks of the NumPy-backend tests (tests/test_beam_search.py)."""

import numpy as np
import pytest

from ftengine.checkpoint import load_gpt2_weights
from ftengine.config import load_gpt2_config
from ftengine.decoding.beam import beam_search
from ftengine.decoding.generate import GenerationParams
from ftengine.models.gpt2 import GPT2Runner
from tests.test_beam_search import NEW, PAD, assert_beams_match_hf, cases, check_no_repeat_ngram, gpt2, hf, runner  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cu():
    from ftengine.backends.cuda import ops
    return ops


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [0.0, 0.5, 1.0, 2.0])
def test_cuda_beams_match_hf(cu, gpt2, hf, cases, early_stopping, length_penalty):  # noqa: F811
    assert_beams_match_hf(hf, cu, gpt2, cases, early_stopping=early_stopping, length_penalty=length_penalty)


@pytest.mark.parametrize("options", [dict(no_repeat_ngram_size=2), dict(repetition_penalty=1.5),
                                     dict(min_new_tokens=5)])
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
