"""GPT-2 on the NumPy backend against HF transformers GPT2LMHeadModel (float32, CPU)."""

import json
from dataclasses import replace

import numpy as np
import pytest

from ftengine.backends import numpy_ops
from ftengine.checkpoint import load_gpt2_weights
from ftengine.config import load_gpt2_config
from ftengine.decoding.generate import GenerationParams, stream_tokens
from ftengine.errors import CheckpointError, InputError
from ftengine.generator import Generator
from ftengine.models.gpt2 import GPT2Runner
from tests.hf_oracle import hf_gpt2
from tests.tolerances import BATCHING_INVARIANCE_FP32, BEAM_SCORE_FP32, HF_FP32_MAX_ABS
from weights.fixtures import gpt2_config, random_gpt2_tensors, write_gpt2_checkpoint

PROMPT_LENGTHS = [1, 5, 17, 3, 40, 9, 2, 28]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return write_gpt2_checkpoint(tmp_path_factory.mktemp("gpt2"), seed=4, n_embd=48, n_layer=3, n_head=4)


@pytest.fixture(scope="module")
def hf(gpt2):
    return hf_gpt2(gpt2)


def _prompts(seed, vocab, lengths=PROMPT_LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _runner(path, max_batch=8):
    config = load_gpt2_config(path)
    return GPT2Runner(config, load_gpt2_weights(path, config), numpy_ops, dtype="fp32",
                      max_batch=max_batch, max_len=config.n_positions)


def _hf_generate(hf, prompt, **kwargs):
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          pad_token_id=hf.config.eos_token_id, **kwargs)
    return out[0, len(prompt):].tolist()


def _ours(path, prompts, **kwargs):
    runner = _runner(path)
    params = GenerationParams(**kwargs).checked(vocab_size=runner.config.vocab_size)
    new = [[] for _ in prompts]
    for step in stream_tokens(runner, prompts, params):
        for b, t in step:
            new[b].append(t)
    return new


def test_prompt_logits_match_hf(gpt2, hf):
    import torch
    runner = _runner(gpt2)
    prompts = _prompts(1, runner.config.vocab_size)
    runner.prefill(prompts)
    ours = runner.logits(len(prompts))
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        assert np.abs(ref).max() > 1.0
        assert np.abs(ours[b] - ref).max() <= HF_FP32_MAX_ABS, f"prompt {b}"


def test_padded_prefill_equals_the_unpadded_one(gpt2):
    """The bucketed prefill the CUDA backend replays from graphs, run here on the NumPy backend:
    padding tokens and empty prompts change neither the logits nor the cache (beyond the rounding
    of matrix products over more rows) nor the seen tokens."""
    plain, padded = _runner(gpt2), _runner(gpt2)
    padded.bucket_prefill = True
    prompts = _prompts(6, plain.config.vocab_size, [5, 17, 3])
    for r in (plain, padded):
        r.prefill(prompts)
    assert np.abs(padded.logits(3) - plain.logits(3)).max() <= BATCHING_INVARIANCE_FP32
    for i in range(plain.config.n_layer):
        for ours, theirs in zip(padded._caches(i), plain._caches(i)):
            for b, p in enumerate(prompts):
                assert np.abs(ours[b, :, :len(p)] - theirs[b, :, :len(p)]).max() <= BATCHING_INVARIANCE_FP32, (i, b)
    seen = (plain.max_batch, plain.config.vocab_size)
    assert np.array_equal(padded.ws.view("seen", seen), plain.ws.view("seen", seen))
    for r in (plain, padded):
        r.decode([7, 8, 9], [5, 17, 3])
    assert np.abs(padded.logits(3) - plain.logits(3)).max() <= BATCHING_INVARIANCE_FP32


def test_decode_step_logits_match_hf(gpt2, hf):
    """Feed three more tokens one step at a time; each step's logits equal HF's full forward."""
    import torch
    runner = _runner(gpt2)
    prompts = _prompts(2, runner.config.vocab_size, [4, 11])
    runner.prefill(prompts)
    rng = np.random.default_rng(3)
    seqs = [list(p) for p in prompts]
    for step in range(3):
        tokens = rng.integers(0, runner.config.vocab_size, 2)
        runner.decode(tokens, np.array([len(p) + step for p in prompts]))
        logits = runner.logits(2)
        for b in range(2):
            seqs[b].append(int(tokens[b]))
            with torch.no_grad():
                ref = hf(torch.tensor([seqs[b]])).logits[0, -1].numpy()
            assert np.abs(logits[b] - ref).max() <= HF_FP32_MAX_ABS


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_token_exact_for_a_batch_of_prompts(gpt2, hf, penalty):
    """8 prompts of different lengths in one batch: each gives exactly what HF gives it alone."""
    prompts = _prompts(5, hf.config.vocab_size)
    ours = _ours(gpt2, prompts, max_new_tokens=32, repetition_penalty=penalty, eos_token_ids=(256,))
    for b, p in enumerate(prompts):
        assert ours[b] == _hf_generate(hf, p, max_new_tokens=32, do_sample=False, repetition_penalty=penalty), b


def test_eos_and_min_new_tokens(gpt2, hf):
    """An eos id the model actually produces: sequences stop there (eos included), and
    min_new_tokens keeps it out until then, as in HF."""
    prompts = _prompts(6, hf.config.vocab_size, [3, 8])
    free = _ours(gpt2, prompts, max_new_tokens=12)
    eos = free[0][4]
    for min_new in (0, 6):
        ours = _ours(gpt2, prompts, max_new_tokens=12, min_new_tokens=min_new, eos_token_ids=(eos,))
        for b, p in enumerate(prompts):
            ref = _hf_generate(hf, p, max_new_tokens=12, min_new_tokens=min_new, eos_token_id=eos, do_sample=False)
            assert ours[b] == ref, (min_new, b)
    stopped = _ours(gpt2, prompts, max_new_tokens=12, eos_token_ids=(eos,))[0]
    assert stopped[-1] == eos and len(stopped) <= 5


def test_seeded_sampling_is_reproducible(gpt2):
    prompts = _prompts(7, 257, [4, 9, 1])
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    a = _ours(gpt2, prompts, seed=123, **kwargs)
    b = _ours(gpt2, prompts, seed=123, **kwargs)
    c = _ours(gpt2, prompts, seed=124, **kwargs)
    assert a == b and a != c


def test_graph_key_keeps_what_a_step_launch_takes():
    """A captured decode step reads the seed, the eos ids and max_new_tokens (beam search's
    selection) from device memory: generations that differ only there (or in num_return_sequences)
    share a step graph; a parameter a launch takes keys its own."""
    base = GenerationParams(max_new_tokens=8, do_sample=True, top_k=5, seed=1, eos_token_ids=(3,))
    for other in (dict(seed=2), dict(seed=None), dict(max_new_tokens=30), dict(eos_token_ids=(9,)),
                  dict(num_return_sequences=2)):
        assert replace(base, **other).graph_key() == base.graph_key(), other
    for other in (dict(temperature=0.5), dict(top_k=6), dict(top_p=0.9), dict(min_new_tokens=2), dict(do_sample=False),
                  dict(repetition_penalty=1.1), dict(no_repeat_ngram_size=2), dict(eos_token_ids=(3, 4))):
        assert replace(base, **other).graph_key() != base.graph_key(), other
    beams = GenerationParams(max_new_tokens=8, num_beams=3, num_return_sequences=2, eos_token_ids=(3,))
    other = replace(beams, num_return_sequences=1, eos_token_ids=(7,), max_new_tokens=9)
    assert other.graph_key() == beams.graph_key()
    for other in (dict(length_penalty=0.5), dict(early_stopping=True), dict(num_beams=4)):
        assert replace(beams, **other).graph_key() != beams.graph_key(), other
    np.testing.assert_array_equal(GenerationParams(1, seed=2 ** 64 - 2).seed_words(), [2 ** 32 - 2, 2 ** 32 - 1])
    np.testing.assert_array_equal(GenerationParams(1).seed_words(), [0, 0])


def test_lm_head_tied_untied_and_missing(tmp_path):
    from safetensors.numpy import save_file
    untied = gpt2_config(tie=False)
    tensors = random_gpt2_tensors(untied, seed=1)
    (tmp_path / "config.json").write_text(json.dumps(untied))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w = load_gpt2_weights(tmp_path, load_gpt2_config(tmp_path))
    np.testing.assert_array_equal(w.lm_head, tensors["lm_head.weight"])
    np.testing.assert_array_equal(w.layers[0].qkv_weight, tensors["transformer.h.0.attn.c_attn.weight"].T)
    views = load_gpt2_weights(tmp_path, load_gpt2_config(tmp_path), views=True)  # CUDA's: laid out as uploaded
    for laid, view in zip(w.layers, views.layers):
        for slot in ("qkv_weight", "attn_out_weight", "fc_weight", "proj_weight"):
            assert getattr(laid, slot).flags.c_contiguous and not getattr(view, slot).flags.c_contiguous
            np.testing.assert_array_equal(getattr(view, slot), getattr(laid, slot))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head.weight is missing and tie_word_embeddings is false"):
        load_gpt2_weights(tmp_path, load_gpt2_config(tmp_path))


@pytest.mark.parametrize("kwargs, message", [
    (dict(do_sample=True, temperature=0.0), "temperature must be a finite number > 0, got 0.0; for deterministic output use greedy"),
    (dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=200), "beyond the model's n_positions 128"),
    (dict(min_new_tokens=9), r"min_new_tokens must be within 0..max_new_tokens \(8\)"),
    (dict(eos_token_id=999), r"eos token id 999 is outside the vocabulary 0..256"),
])
def test_generation_options_are_validated(gpt2, kwargs, message):
    gen = Generator.from_pretrained(gpt2, device="cpu")
    kwargs = {"max_new_tokens": 8, **kwargs}
    with pytest.raises(InputError, match=message):
        gen.generate(["hello"], **kwargs)


def test_empty_prompt_and_clamped_top_k(gpt2):
    gen = Generator.from_pretrained(gpt2, device="cpu")
    with pytest.raises(InputError, match="prompt 2 is empty"):
        gen.generate(["ok", ""], max_new_tokens=2)
    with pytest.raises(InputError, match="no prompts to continue"):
        gen.generate([], max_new_tokens=2)
    huge = gen.generate(["hi"], max_new_tokens=4, do_sample=True, top_k=10_000, seed=1)[0].token_ids
    off = gen.generate(["hi"], max_new_tokens=4, do_sample=True, top_k=0, seed=1)[0].token_ids
    assert huge == off  # top_k beyond the vocabulary keeps every token, like top_k=0


@pytest.mark.parametrize("options", [dict(), dict(num_beams=2, num_return_sequences=2, length_penalty=0.7),
                                     dict(repetition_penalty=1.3, no_repeat_ngram_size=2)])
def test_waves_give_the_tokens_of_one_by_one(gpt2, options):
    """3 x max_batch sequences in waves: each prompt's tokens (and beam scores) as when it runs alone."""
    gen = Generator.from_pretrained(gpt2, device="cpu")
    beams = options.get("num_beams", 1)
    max_batch = 2 * beams
    prompts = [f"wave prompt {i}" + " again" * (i % 3) for i in range(3 * max_batch // beams)]
    waves = gen.generate(prompts, max_new_tokens=7, max_batch=max_batch, **options)
    for prompt, got in zip(prompts, waves):
        alone = gen.generate([prompt], max_new_tokens=7, **options)[0]
        assert got.prompt == prompt
        assert [c.token_ids for c in got.candidates] == [c.token_ids for c in alone.candidates]
        if beams > 1:
            assert np.allclose([c.score for c in got.candidates], [c.score for c in alone.candidates],
                               atol=BEAM_SCORE_FP32, rtol=0)


def test_default_max_batch_on_the_cpu_and_its_checks(gpt2):
    """Also: a Generator is a context manager; closed, its next call starts its worker again."""
    with Generator.from_pretrained(gpt2, device="cpu") as gen:
        assert gen.default_max_batch(64) == 64
        with pytest.raises(InputError, match="max_batch must be an integer >= num_beams"):
            gen.generate(["a"], max_new_tokens=2, max_batch=True)
        with pytest.raises(InputError, match="no prompts to continue"):
            gen.generate([], max_new_tokens=2)
        before = gen.generate(["a"], max_new_tokens=3)[0].token_ids
    assert gen.generate(["a"], max_new_tokens=3)[0].token_ids == before
    gen.close()


def test_seeded_sampling_in_waves_draws_as_each_wave_alone(gpt2):
    """A seeded draw depends on the prompt's place in its wave: each wave gives what the same
    prompts give in one call of their own, and the same waves give the same tokens again."""
    gen = Generator.from_pretrained(gpt2, device="cpu")
    prompts = [f"sampled {i}" + " word" * (i % 3) for i in range(6)]
    options = dict(max_new_tokens=8, do_sample=True, seed=11, top_k=20, top_p=0.9, temperature=0.9)
    waves = gen.generate(prompts, max_batch=2, **options)
    for start in (0, 2, 4):
        alone = gen.generate(prompts[start:start + 2], **options)
        assert [r.token_ids for r in waves[start:start + 2]] == [r.token_ids for r in alone]
    assert [r.token_ids for r in gen.generate(prompts, max_batch=2, **options)] == [r.token_ids for r in waves]
