"""BART, mBART-50, NLLB and M2M100 (with its own sentencepiece files), T5, flan-t5 and mT5 encoder-decoders against HF transformers on small
random checkpoints in each family's exact format: the tokenizer's ids and text with language codes, the
encoder's output and the first step's logits, greedy and beam search token for token with their
scores under each checkpoint's generation defaults (BART-cnn's forced <s>, n-gram ban, length
penalty and minimum length; the target language as the forced first token; T5's relative
position biases and RMS norms, ReLU with a tied head or gated GELU with an untied one), and the
bad input the language options take."""

import pytest

from ftengine import InputError, Translator
from ftengine.config import load_seq2seq_config
from ftengine.seq2seq_text import load_text
from tests.hf_oracle import assert_candidates_match, assert_encoder_and_first_logits_match, hf_seq2seq_generate
from tests.tolerances import BATCHING_INVARIANCE_FP32, BEAM_SCORE_FP32, GPU_FP32_REL, HF_FP32_MAX_ABS
from weights.fixtures import write_bart_family_checkpoint, write_t5_checkpoint

transformers = pytest.importorskip("transformers")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a dog", "", "some other words were there",
         "Ünïcödé ✓ text, with punctuation!"]
# family -> (source language, target language) as its tokenizer spells them
LANGUAGES = {"bart": (None, None), "mbart": ("en_XX", "fr_XX"), "nllb": ("eng_Latn", "deu_Latn"),
             "m2m100": ("fr", "de"), "t5": (None, None), "flan-t5": (None, None), "mt5": (None, None)}


def write_family(name: str, folder, **shape):
    if name == "flan-t5":  # attention not as wide as the model, as flan-t5-small's (6 heads of 64 in 512)
        heads = shape.get("heads", 4)
        shape.update(heads=heads + 1, d_kv=shape.get("d_model", 32) // heads)
    if name in ("t5", "flan-t5", "mt5"):
        return write_t5_checkpoint(folder, gated=name != "t5", model_type="mt5" if name == "mt5" else "t5", **shape)
    return write_bart_family_checkpoint(folder, name, **shape)


@pytest.fixture(scope="module", params=list(LANGUAGES))
def family(request, tmp_path_factory):
    return request.param, write_family(request.param, tmp_path_factory.mktemp(request.param), seed=5)


@pytest.fixture(scope="module")
def hf(family):
    import torch
    torch.manual_seed(0)
    name, folder = family
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if LANGUAGES[name][0]:
        tokenizer.src_lang = LANGUAGES[name][0]
    return model, tokenizer


def language_id(tokenizer, code: str) -> int:
    """A language code's id as HF's tokenizer of the family gives it."""
    return tokenizer.get_lang_id(code) if hasattr(tokenizer, "get_lang_id") else tokenizer.convert_tokens_to_ids(code)


def hf_generate(hf, text: str, tgt_lang: str | None, **options):
    """HF's hypotheses and beam scores for one source, the target language forced first."""
    if tgt_lang is not None:
        options["forced_bos_token_id"] = language_id(hf[1], tgt_lang)
    return hf_seq2seq_generate(*hf, text, **options)


def test_tokenizer_matches_hf(family, hf):
    name, folder = family
    _, tokenizer = hf
    config = load_seq2seq_config(folder)
    ours = load_text(folder, config.model_type)
    languages = [None] if LANGUAGES[name][0] is None else list(LANGUAGES[name])
    for src_lang in languages:
        if src_lang is not None:
            tokenizer.src_lang = src_lang
        for text in TEXTS + ["  spaced   out  ", "zzz qqq", "<mask> inside"]:
            ids = tokenizer(text).input_ids
            assert [t for part in ours.source_parts(text, src_lang) for t in part] == ids, (src_lang, text)
            assert ours.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), text
    tokenizer.src_lang = LANGUAGES[name][0] if LANGUAGES[name][0] else None


def test_encoder_output_and_first_logits_match_hf(family, hf):
    name, folder = family
    model, tokenizer = hf
    assert_encoder_and_first_logits_match(folder, model, tokenizer, TEXTS[:3], HF_FP32_MAX_ABS)


@pytest.mark.parametrize("options", [
    {},
    {"num_beams": 1, "max_new_tokens": 6},
    {"num_beams": 4},
    {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.6, "no_repeat_ngram_size": 2},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_translations_match_hf_generate(family, hf, options):
    name, folder = family
    src_lang, tgt_lang = LANGUAGES[name]
    with Translator.from_pretrained(folder, device="cpu") as translator:
        results = translator.translate(TEXTS, src_lang=src_lang, tgt_lang=tgt_lang, **options)
    assert_candidates_match(results, [hf_generate(hf, text, tgt_lang, **options) for text in TEXTS], BEAM_SCORE_FP32)
    for result in results:
        assert result.text == hf[1].decode(result.token_ids, skip_special_tokens=True)
        if tgt_lang is not None:  # the target language's code is the first token generated
            assert result.token_ids[0] == language_id(hf[1], tgt_lang)


def test_language_options_are_checked(family):
    name, folder = family
    with Translator.from_pretrained(folder, device="cpu") as translator:
        if LANGUAGES[name][0] is None:
            with pytest.raises(InputError, match="unknown language 'fr_XX'; this model knows: none"):
                translator.translate(TEXTS, tgt_lang="fr_XX")
            return
        with pytest.raises(InputError, match="tgt_lang: this model translates into several languages"):
            translator.translate(TEXTS)
        with pytest.raises(InputError, match="src_lang: unknown language 'xx'; this model knows: .*"
                                             + LANGUAGES[name][1]):
            translator.translate(TEXTS, src_lang="xx", tgt_lang=LANGUAGES[name][1])
        long = translator.translate(["word " * 200], tgt_lang=LANGUAGES[name][1])[0]
        assert long.token_ids[0] == translator.text.codes[LANGUAGES[name][1]]
        sources = translator.encode_sources(["word " * 200], src_lang=LANGUAGES[name][0])
        assert len(sources[0]) == translator.config.max_positions and sources[0][-1] == translator.config.eos_token_id
        assert sources[0][0] == translator.text.codes[LANGUAGES[name][0]]


def test_translate_command_takes_the_languages(family, hf, tmp_path):
    import json

    from click.testing import CliRunner

    from ftengine.cli import main
    name, folder = family
    src_lang, tgt_lang = LANGUAGES[name]
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    languages = [] if src_lang is None else ["--src-lang", src_lang, "--tgt-lang", tgt_lang]
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["translate", str(src), "-o", str(out), "--model", str(folder), "--device", "cpu",
                                  "--num-beams", "2", "--quiet", *languages])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [row["token_ids"] for row in rows] == [hf_generate(hf, t, tgt_lang, num_beams=2)[0][0] for t in TEXTS]
    if src_lang is None:
        return
    for args, message in (([], "--tgt-lang: this model translates into several languages"),
                          (["--tgt-lang", "xx_YY"], "--tgt-lang: unknown language 'xx_YY'"),
                          (["--src-lang", "yy", "--tgt-lang", tgt_lang], "--src-lang: unknown language 'yy'")):
        r = CliRunner().invoke(main, ["translate", str(src), "--model", str(folder), "--device", "cpu", *args])
        assert r.exit_code == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def assert_pads_take_no_position(name: str, folder, ops, text: str, scale: float, *, gpu: bool = False):
    """M2M100 / NLLB number positions around the pad token as HF does (create_position_ids_from_input_ids):
    a pad in a source (a literal <pad> in its text) has no position and the tokens after it do not
    count it; a pad the decoder generates has none. The pad's row of the tied table is scaled up
    (scale: enough that greedy decoding with no_repeat_ngram_size 1 generates it mid-sequence from
    `text`, which has <pad> in it, for this fixture's seed); against HF's
    generate (which runs the decoder step by step, as we do): the encoder's output, the tokens and
    every step's logits after the forced first one, within HF_FP32_MAX_ABS (gpu: GPU_FP32_REL of
    the largest reference value)."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file, save_file

    from ftengine.decoding.generate import GenerationParams
    from ftengine.models.seq2seq import Seq2SeqRunner
    from ftengine.seq2seq_checkpoint import load_seq2seq_weights

    def assert_close(found, ref, what):
        bound = GPU_FP32_REL * max(1.0, float(np.abs(ref).max())) if gpu else HF_FP32_MAX_ABS
        assert np.abs(found - ref).max() <= bound, what

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.shared.weight"][1] *= scale
    save_file(tensors, str(folder / "model.safetensors"))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    src_lang, tgt_lang = LANGUAGES[name]
    tokenizer.src_lang = src_lang
    config = load_seq2seq_config(folder)
    pad, new, lang = config.pad_token_id, 16, language_id(tokenizer, tgt_lang)
    source = tokenizer(text).input_ids
    assert source.count(pad) == text.count("<pad>") > 0
    ids = torch.tensor([source])
    with torch.no_grad():  # the attention mask as the tokenizer gives it: pads in the text are attended
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, no_repeat_ngram_size=1,
                             forced_bos_token_id=lang, output_logits=True, return_dict_in_generate=True)
        states = model.get_encoder()(ids).last_hidden_state[0].numpy()
    tokens = ref.sequences[0, 1:].tolist()
    assert pad in tokens[1:-1] and config.eos_token_id not in tokens, tokens
    runner = Seq2SeqRunner(config, load_seq2seq_weights(folder, config), ops, dtype="fp32", max_batch=1, max_len=32,
                           max_source=32)
    runner.encode([source])
    found = ops.to_host(runner.ws.view(runner.out, (len(source), config.d_model)))
    assert_close(found, states, "encoder output")
    runner.set_constraints(banned=(), forced_bos=lang, forced_eos=None)
    params = GenerationParams(max_new_tokens=new, no_repeat_ngram_size=1,
                              eos_token_ids=(config.eos_token_id,)).checked(vocab_size=config.vocab_size)
    runner.start([[config.decoder_start_token_id]], params)
    for step in range(1, new):
        runner.steps(1, 1, params)
        assert_close(runner.logits(1)[0], ref.logits[step][0].numpy(), f"logits of step {step}")
    assert runner.fetch_history(1, 0, new).wait()[:, 0].tolist() == tokens


@pytest.mark.parametrize("name, text", [("nllb", "hello <pad> world"), ("m2m100", "the quick <pad><pad> brown fox")])
def test_pads_take_no_position_as_in_hf(name, text, tmp_path):
    from ftengine.backends import numpy_ops
    assert_pads_take_no_position(name, write_family(name, tmp_path, seed=5), numpy_ops, text, 3.0)


@pytest.fixture(scope="module", params=list(LANGUAGES))
def family_gpu(request, tmp_path_factory):
    """Head size 32, which the CUDA encoder's fused attention takes (flan-t5: 3 heads of 32 in 64)."""
    folder = write_family(request.param, tmp_path_factory.mktemp(f"{request.param}-gpu"), seed=6, d_model=64, heads=2,
                          ffn=96)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if LANGUAGES[request.param][0]:
        tokenizer.src_lang = LANGUAGES[request.param][0]
    return request.param, folder, (model, tokenizer)


@pytest.mark.gpu
def test_cuda_pads_take_no_position_as_in_hf(cuda_translator, tmp_path):
    """As test_pads_take_no_position_as_in_hf, on the GPU in fp32 (head size 32)."""
    from ftengine.backends.cuda import ops
    folder = write_family("m2m100", tmp_path, seed=6, d_model=64, heads=2, ffn=96)
    assert_pads_take_no_position("m2m100", folder, ops, "a <pad> dog <pad> there", 3.0, gpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"num_beams": 1}, {"num_beams": 4}], ids=["greedy", "beam4"])
def test_cuda_fp32_translations_match_hf(family_gpu, cuda_translator, options):
    name, folder, hf = family_gpu
    src_lang, tgt_lang = LANGUAGES[name]
    with cuda_translator(folder, dtype="fp32") as translator:
        results = translator.translate(TEXTS, src_lang=src_lang, tgt_lang=tgt_lang, **options)
        alone = [translator.translate([t], src_lang=src_lang, tgt_lang=tgt_lang, **options)[0] for t in TEXTS]
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    assert_candidates_match(results, [hf_generate(hf, text, tgt_lang, **options) for text in TEXTS], BEAM_SCORE_FP32)


def assert_bucketing_changes_nothing(folder, ops, bound: float):
    """A batch of mixed-length sources encoded at the bucketed shape the CUDA backend runs (tokens and
    sources padded, shapes.bucket_packed) equals the exact shape's pass within `bound`: the encoder's
    output, each source's memory, the first step's logits; the padding writes no memory (the
    caches start as NaN: every position past a source's last stays so)."""
    import numpy as np

    from ftengine.decoding.generate import GenerationParams
    from ftengine.models.seq2seq import Seq2SeqRunner
    from ftengine.seq2seq_checkpoint import load_seq2seq_weights
    config = load_seq2seq_config(folder)
    weights = load_seq2seq_weights(folder, config)
    sources = [[5, 9, 11, config.eos_token_id], [7] * 9 + [config.eos_token_id], [12, config.eos_token_id]]
    params = GenerationParams(max_new_tokens=2, eos_token_ids=(config.eos_token_id,)).checked(
        vocab_size=config.vocab_size)
    found = []
    for bucketed in (False, True):
        runner = Seq2SeqRunner(config, weights, ops, dtype="fp32", max_batch=8, max_len=8, max_source=16)
        runner.bucketed = bucketed
        for i in range(config.decoder_layers):
            for cache in runner._memory(i):
                ops.copy_from_host(cache, np.full(cache.shape, np.nan, np.float32))
        runner.encode(sources, copies=2)
        states = ops.to_host(runner.ws.view(runner.out, (sum(map(len, sources)), config.d_model)))
        memory = np.stack([ops.to_host(a) for i in range(config.decoder_layers) for a in runner._memory(i)])
        runner.start([[config.decoder_start_token_id]] * 6, params)
        found.append((states, memory, runner.logits(6)))
    (states, memory, logits), (b_states, b_memory, b_logits) = found
    assert np.abs(b_states - states).max() <= bound
    for s, source in enumerate(sources):
        assert np.abs(b_memory[:, s, :, :len(source)] - memory[:, s, :, :len(source)]).max() <= bound
    written = np.zeros(b_memory.shape[1:4], bool)
    for s, source in enumerate(sources):
        written[s, :, :len(source)] = True
    assert not np.isnan(b_memory[:, written]).any() and np.isnan(b_memory[:, ~written]).all()
    assert np.abs(b_logits - logits).max() <= bound * max(1.0, float(np.abs(logits).max()))


def test_a_bucketed_encoder_pass_equals_the_exact_one(family):
    from ftengine.backends import numpy_ops
    assert_bucketing_changes_nothing(family[1], numpy_ops, BATCHING_INVARIANCE_FP32)


@pytest.mark.gpu
def test_cuda_bucketed_encoder_pass_equals_the_exact_one(family_gpu):
    from ftengine.backends.cuda import ops
    assert_bucketing_changes_nothing(family_gpu[1], ops, GPU_FP32_REL)


def test_a_folder_missing_its_parts_is_refused_by_name(family, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from ftengine.errors import CheckpointError, ConfigError
    name, folder = family
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    tokenizer_file = "vocab.json" if name == "m2m100" else "tokenizer.json"  # M2M100's own files
    (copy / tokenizer_file).unlink()
    with pytest.raises(ConfigError, match="M2M100's tokenizer files are missing: vocab.json" if name == "m2m100"
                       else "no tokenizer.json"):
        Translator.from_pretrained(copy, device="cpu")
    shutil.copy(folder / tokenizer_file, copy / tokenizer_file)
    tensors = load_file(str(folder / "model.safetensors"))
    missing = {"bart": "model.decoder.layernorm_embedding.weight", "t5": "decoder.final_layer_norm.weight",
               "flan-t5": "decoder.block.1.layer.2.DenseReluDense.wi_1.weight",
               "mt5": "decoder.block.1.layer.2.DenseReluDense.wi_0.weight"}.get(name, "model.decoder.layer_norm.weight")
    del tensors[missing]
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"missing: .*{missing}"):
        Translator.from_pretrained(copy, device="cpu")


@pytest.mark.gpu
def test_cuda_t5_defaults_to_bf16_and_graphs_change_no_bit(cuda_translator, tmp_path):
    """T5 on the GPU runs in bf16 unless told (fp16 overflows its activations); bf16 translations
    are the same with and without CUDA graphs, and their agreement with fp32's is reported."""
    folder = write_t5_checkpoint(tmp_path / "flan", gated=True, seed=7, d_model=64, heads=2, ffn=96)
    with cuda_translator(folder) as graphed, cuda_translator(folder, cuda_graphs=False) as direct, \
            cuda_translator(folder, dtype="fp32") as full:
        assert graphed.dtype == "bf16" and full.dtype == "fp32"
        for options in ({}, {"num_beams": 4}):
            a, b = graphed.translate(TEXTS, **options), direct.translate(TEXTS, **options)
            assert [r.token_ids for r in a] == [r.token_ids for r in b]
            same = sum(x.token_ids == y.token_ids for x, y in zip(a, full.translate(TEXTS, **options)))
            print(f"t5 bf16 {options or 'greedy'}: {same} of {len(TEXTS)} translations equal fp32's")
