"""Encoder-decoder translation (Marian / opus-mt format) against HF transformers on small random
checkpoints written in its exact format: the tokenizer's ids and text, the encoder's hidden
states, the first step's logits, greedy and beam search token for token with their scores (with
the checkpoint's generation defaults: the pad token banned, eos forced at the last step), batches
of mixed lengths equal to one by one, threads, and the `ftengine translate` command; the same for a
model with separate source and target vocabularies."""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from click.testing import CliRunner

from ftengine import InputError, Translator
from ftengine.cli import main
from ftengine.seq2seq_text import MarianText
from tests.hf_oracle import assert_candidates_match, assert_encoder_and_first_logits_match, hf_seq2seq_generate
from tests.tolerances import BATCHING_INVARIANCE_FP32, BEAM_SCORE_FP32, HF_FP32_MAX_ABS
from weights.fixtures import write_marian_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a dog", "", "some other words were there",
         "Ünïcödé ✓ text, with punctuation!"]


@pytest.fixture(scope="module", params=["swish", "relu", "gelu"])
def marian(request, tmp_path_factory):
    return write_marian_checkpoint(tmp_path_factory.mktemp(f"marian-{request.param}"), seed=3,
                                   activation=request.param)


@pytest.fixture(scope="module")
def hf(marian):
    import torch
    torch.manual_seed(0)
    model = transformers.MarianMTModel.from_pretrained(marian).eval()
    return model, transformers.MarianTokenizer.from_pretrained(marian)


def hf_generate(hf, text: str, **options):
    """HF's hypotheses and beam scores for one source."""
    return hf_seq2seq_generate(*hf, text, **options)


def assert_matches_hf(results, hf, options):
    """Each TEXTS result's candidates are HF generate's hypotheses, token for token, with its
    beam scores."""
    assert_candidates_match(results, [hf_generate(hf, text, **options) for text in TEXTS], BEAM_SCORE_FP32)


def test_tokenizer_matches_marian_tokenizer(marian, hf):
    _, tokenizer = hf
    ours = MarianText(marian)
    for text in TEXTS + [">>fra<< hello there", "  spaced   out  ", "zzz qqq"]:
        ids = tokenizer(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), text


def test_encoder_states_and_first_logits_match_hf(marian, hf):
    model, tokenizer = hf
    assert_encoder_and_first_logits_match(marian, model, tokenizer, TEXTS[:3], HF_FP32_MAX_ABS)


@pytest.mark.parametrize("options", [
    {},
    {"max_new_tokens": 5},
    {"num_beams": 4},
    {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.6, "early_stopping": True},
    {"num_beams": 2, "max_new_tokens": 7, "early_stopping": "never"},
    {"num_beams": 4, "no_repeat_ngram_size": 2, "repetition_penalty": 1.3, "min_new_tokens": 6},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_translations_match_hf_generate(marian, hf, options):
    with Translator.from_pretrained(marian, device="cpu") as translator:
        results = translator.translate(TEXTS, **options)
    assert_matches_hf(results, hf, options)
    for result in results:
        assert result.text == hf[1].decode(result.candidates[0].token_ids, skip_special_tokens=True)


def write_unrenormalized(tmp_path_factory, **shape):
    """A Marian model that bans tokens (bad_words_ids) without renormalize_logits: its pad, whose
    probability is near 0 here, and ten that are not."""
    pad = json.loads((write_marian_checkpoint(tmp_path_factory.mktemp("marian-probe"), seed=3, **shape)
                      / "config.json").read_text())["pad_token_id"]
    folder = write_marian_checkpoint(tmp_path_factory.mktemp("marian-unrenormalized"), seed=3, generation={
        "renormalize_logits": False, "bad_words_ids": [[pad]] + [[token] for token in range(4, 14)]}, **shape)
    return folder, (transformers.MarianMTModel.from_pretrained(folder).eval(),
                    transformers.MarianTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def unrenormalized(tmp_path_factory):
    return write_unrenormalized(tmp_path_factory)


BANNED_OPTIONS = [{"num_beams": 4}, {"num_beams": 3, "num_return_sequences": 2, "repetition_penalty": 1.3,
                                     "no_repeat_ngram_size": 2, "min_new_tokens": 4}]


@pytest.mark.parametrize("options", BANNED_OPTIONS, ids=["beam4", "beam3x2-processors"])
def test_a_ban_without_renormalizing_matches_hf(unrenormalized, options):
    """Beam search bans a token after the log-softmax, as HF's processor does: the other tokens'
    log-probabilities keep the banned one's share (a ban on the logits would renormalise them)."""
    folder, hf = unrenormalized
    with Translator.from_pretrained(folder, device="cpu") as translator:
        assert_matches_hf(translator.translate(TEXTS, **options), hf, options)


def test_a_batch_of_mixed_lengths_equals_one_by_one(marian):
    with Translator.from_pretrained(marian, device="cpu") as translator:
        for options in ({}, {"num_beams": 3}):
            together = translator.translate(TEXTS, max_batch=len(TEXTS) * 3, **options)
            alone = [translator.translate([t], **options)[0] for t in TEXTS]
            assert [r.token_ids for r in together] == [r.token_ids for r in alone]
            budgeted = translator.translate(TEXTS, max_batch_tokens=20, **options)
            assert [r.token_ids for r in budgeted] == [r.token_ids for r in alone]
            if options:  # beam scores: the products' float32 rounding depends on their row counts
                assert np.abs(np.array([r.score for r in together]) - [r.score for r in alone]).max() \
                    <= BATCHING_INVARIANCE_FP32


@pytest.fixture(scope="module")
def separate(tmp_path_factory):
    """A Marian model with separate source and target vocabularies (opus-mt-tc-big's format)."""
    folder = write_marian_checkpoint(tmp_path_factory.mktemp("marian-separate"), seed=5, separate_vocabs=True)
    return folder, (transformers.MarianMTModel.from_pretrained(folder).eval(),
                    transformers.MarianTokenizer.from_pretrained(folder))


def test_separate_vocabularies_match_hf(separate):
    """The source's ids (vocab.json), the target's text (target_vocab.json, target.spm, HF's special
    ids), the encoder states, the first logits and greedy / beam translations, as HF's."""
    folder, (model, tokenizer) = separate
    config = json.loads((folder / "config.json").read_text())
    ours = MarianText(folder)
    # the sides differ in size and in their pad's id, so that HF's special ids (the source's) show
    assert config["vocab_size"] != config["decoder_vocab_size"] and ours.pad_id != config["pad_token_id"]
    for text in TEXTS + [">>fra<< hello there", "zzz qqq"]:
        assert ours.encode(text) == tokenizer(text).input_ids, text
    rng = np.random.default_rng(0)
    for ids in [list(range(config["decoder_vocab_size"]))] + [rng.integers(0, config["decoder_vocab_size"], 12).tolist()
                                                              for _ in range(20)]:
        assert ours.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids
    assert_encoder_and_first_logits_match(folder, model, tokenizer, TEXTS[:3], HF_FP32_MAX_ABS)
    with Translator.from_pretrained(folder, device="cpu") as translator:
        for options in ({}, {"num_beams": 3, "num_return_sequences": 2}):
            results = translator.translate(TEXTS, **options)
            assert_candidates_match(results, [hf_seq2seq_generate(model, tokenizer, t, **options) for t in TEXTS],
                                    BEAM_SCORE_FP32)
            for result in results:
                assert result.text == tokenizer.decode(result.candidates[0].token_ids, skip_special_tokens=True)


def test_separate_vocabularies_are_refused_where_they_cannot_apply(separate, tmp_path):
    import shutil

    from ftengine.config import Seq2SeqConfig
    from ftengine.errors import ConfigError
    folder, _ = separate
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / "target_vocab.json").unlink()
    with pytest.raises(ConfigError, match="Marian's tokenizer files are missing: target_vocab.json"):
        Translator.from_pretrained(copy, device="cpu")
    config = {**json.loads((folder / "config.json").read_text()), "model_type": "bart"}
    with pytest.raises(ConfigError, match="supported for Marian only, not bart"):
        Seq2SeqConfig.from_dict(config, copy / "config.json")


def test_token_budget_batches_keep_order_rows_and_budget():
    from ftengine.translator import _batches
    tokens = [4, 9, 3, 12, 5, 5, 1]
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    batches = _batches(order, tokens, 3, 10)
    assert [i for b in batches for i in b] == order
    assert all(len(b) <= 3 and (sum(tokens[i] for i in b) <= 10 or len(b) == 1) for b in batches)
    assert batches == [[6, 2, 0], [4, 5], [1], [3]]


def test_threads_share_one_translator(marian):
    with Translator.from_pretrained(marian, device="cpu") as translator:
        expected = [r.token_ids for r in translator.translate(TEXTS, num_beams=2)]
        with ThreadPoolExecutor(4) as pool:
            found = list(pool.map(lambda _: [r.token_ids for r in translator.translate(TEXTS, num_beams=2)], range(4)))
    assert found == [expected] * 4


def test_seeded_sampling_repeats_and_options_are_checked(marian):
    with Translator.from_pretrained(marian, device="cpu") as translator:
        a = translator.translate(TEXTS, do_sample=True, seed=5, top_p=0.9)
        b = translator.translate(TEXTS, do_sample=True, seed=5, top_p=0.9)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        with pytest.raises(InputError, match="unknown generation option"):
            translator.translate(TEXTS, beams=2)
        with pytest.raises(InputError, match="max_batch_tokens must be an integer >= 1"):
            translator.translate(TEXTS, max_batch_tokens=0)
        with pytest.raises(InputError, match="num_return_sequences must be within"):
            translator.translate(TEXTS, num_return_sequences=2)
        with pytest.raises(InputError, match="unknown target language 'xx'; this model knows: deu, fra"):
            translator.translate(TEXTS, tgt_lang="xx")
        with pytest.raises(InputError, match="source 1 has"):
            translator.translate(["word " * 200], truncate=False)
        assert len(translator.translate(["word " * 200])[0].token_ids) >= 1  # cut to the model's 64


def test_translate_command(marian, hf, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    out = tmp_path / "out.txt"
    r = CliRunner().invoke(main, ["translate", str(src), "-o", str(out), "--model", str(marian), "--device", "cpu",
                                  "--num-beams", "2"])
    assert r.exit_code == 0, r.output
    assert f"{len(TEXTS)} lines" in r.stderr
    expected = [hf[1].decode(hf_generate(hf, t, num_beams=2)[0][0], skip_special_tokens=True) for t in TEXTS]
    assert out.read_text(encoding="utf-8").splitlines() == expected
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    r = CliRunner().invoke(main, ["translate", str(jsonl), "-o", str(tmp_path / "out.jsonl"), "--model", str(marian),
                                  "--device", "cpu", "--quiet"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["line"] for row in rows] == list(range(1, len(TEXTS) + 1))
    assert [row["token_ids"] for row in rows] == [hf_generate(hf, t)[0][0] for t in TEXTS]
    for args, message in ((["--tgt-lang", "xx"], "unknown target language 'xx'"),
                          (["--src-lang", "en"], "--src-lang"),
                          (["--num-beams", "2", "--num-return-sequences", "3"], "num_return_sequences")):
        r = CliRunner().invoke(main, ["translate", str(src), "--model", str(marian), "--device", "cpu", *args])
        assert r.exit_code == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("options", [[], ["--num-beams", "3", "--num-return-sequences", "2"]],
                         ids=["greedy", "beams"])
def test_translate_command_writes_parquet(marian, hf, tmp_path, options):
    """A .parquet output holds the --json objects' fields a row (the key first), the values HF's."""
    pq = pytest.importorskip("pyarrow.parquet")
    src, out = tmp_path / "in.txt", tmp_path / "out.parquet"
    src.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    r = CliRunner().invoke(main, ["translate", str(src), "-o", str(out), "--model", str(marian), "--device", "cpu",
                                  "--quiet", *options])
    assert r.exit_code == 0, r.output
    table = pq.read_table(out)
    assert table.column_names == ["line", "source", "text", "token_ids", "score", "candidates"]
    rows = table.to_pylist()
    assert [row["line"] for row in rows] == list(range(1, len(TEXTS) + 1))
    assert [row["source"] for row in rows] == TEXTS
    kwargs = {"num_beams": 3, "num_return_sequences": 2} if options else {}
    expected = [hf_generate(hf, t, **kwargs) for t in TEXTS]
    for row, (hypotheses, scores) in zip(rows, expected):
        assert [c["token_ids"] for c in row["candidates"]] == hypotheses and row["token_ids"] == hypotheses[0]
        assert row["text"] == hf[1].decode(hypotheses[0], skip_special_tokens=True)
        if scores is None:
            assert row["score"] is None
        else:
            assert abs(row["score"] - scores[0]) <= BEAM_SCORE_FP32


@pytest.fixture(scope="module")
def marian_gpu(tmp_path_factory):
    """Head size 32, which the CUDA encoder's fused attention takes (opus-mt's is 64)."""
    return write_marian_checkpoint(tmp_path_factory.mktemp("marian-gpu"), seed=4, d_model=64, heads=2, ffn=96)


@pytest.fixture(scope="module")
def hf_gpu(marian_gpu):
    return (transformers.MarianMTModel.from_pretrained(marian_gpu).eval(),
            transformers.MarianTokenizer.from_pretrained(marian_gpu))


GPU_OPTIONS = [{}, {"num_beams": 4}, {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.6}]


@pytest.mark.gpu
@pytest.mark.parametrize("options", GPU_OPTIONS, ids=["greedy", "beam4", "beam3x2"])
def test_cuda_fp32_translations_match_hf(marian_gpu, hf_gpu, cuda_translator, options):
    with cuda_translator(marian_gpu, dtype="fp32") as translator:
        results = translator.translate(TEXTS, **options)
    assert_matches_hf(results, hf_gpu, options)


@pytest.mark.gpu
@pytest.mark.parametrize("options", BANNED_OPTIONS, ids=["beam4", "beam3x2-processors"])
def test_cuda_a_ban_without_renormalizing_matches_hf(tmp_path_factory, cuda_translator, options):
    folder, hf = write_unrenormalized(tmp_path_factory, d_model=64, heads=2, ffn=96)
    with cuda_translator(folder, dtype="fp32") as translator:
        assert_matches_hf(translator.translate(TEXTS, **options), hf, options)


@pytest.mark.gpu
def test_cuda_fp32_separate_vocabularies_match_hf(tmp_path, cuda_translator):
    """The encoder reads the source's table, the decoder and its head the target's, on the GPU too:
    greedy against HF, beams against the NumPy backend (which test_separate_vocabularies_match_hf
    holds to HF), since some transformers releases (5.17) size beam search's scores by the source's
    vocabulary here and fail."""
    folder = write_marian_checkpoint(tmp_path, seed=6, d_model=64, heads=2, ffn=96, separate_vocabs=True)
    model, tokenizer = (transformers.MarianMTModel.from_pretrained(folder).eval(),
                        transformers.MarianTokenizer.from_pretrained(folder))
    with cuda_translator(folder, dtype="fp32") as translator, Translator.from_pretrained(folder, device="cpu") as cpu:
        greedy, beams = GPU_OPTIONS[:2]
        assert_candidates_match(translator.translate(TEXTS, **greedy),
                                [hf_seq2seq_generate(model, tokenizer, t, **greedy) for t in TEXTS], BEAM_SCORE_FP32)
        expected = [([c.token_ids for c in r.candidates], [c.score for c in r.candidates])
                    for r in cpu.translate(TEXTS, **beams)]
        assert_candidates_match(translator.translate(TEXTS, **beams), expected, BEAM_SCORE_FP32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_low_precision_agrees_and_graphs_change_no_bit(marian_gpu, cuda_translator, dtype):
    """fp16 / bf16 translations: the same with and without CUDA graphs, bit for bit; their agreement
    with fp32's tokens is reported (random weights: near ties flip under rounding)."""
    with cuda_translator(marian_gpu, dtype=dtype) as graphed, \
            cuda_translator(marian_gpu, dtype=dtype, cuda_graphs=False) as direct, \
            cuda_translator(marian_gpu, dtype="fp32") as full:
        for options in ({}, {"num_beams": 4}):
            a, b = graphed.translate(TEXTS, **options), direct.translate(TEXTS, **options)
            assert [r.token_ids for r in a] == [r.token_ids for r in b]
            assert [r.score for r in a] == [r.score for r in b]
            reference = full.translate(TEXTS, **options)
            same = sum(x.token_ids == y.token_ids for x, y in zip(a, reference))
            print(f"{dtype} {options or 'greedy'}: {same} of {len(TEXTS)} translations equal fp32's")


def test_an_over_long_source_is_named_by_its_line_past_the_first_window(marian, tmp_path, monkeypatch):
    """--no-truncate refuses a source longer than the model takes, naming the input's line, not its
    place in the window it was read in; nothing is written. translate_stream numbers it in the
    whole stream likewise."""
    import ftengine.cli_text
    import ftengine.translator
    monkeypatch.setattr(ftengine.cli_text, "TRANSLATE_WINDOW", 4)
    monkeypatch.setattr(ftengine.translator, "STREAM_WINDOW", 4)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    texts = [t or "x" for t in TEXTS] + ["word " * 100] + TEXTS[:2]
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    r = CliRunner().invoke(main, ["translate", str(src), "-o", str(out), "--model", str(marian), "--device", "cpu",
                                  "--no-truncate", "--max-new-tokens", "2"])
    assert r.exit_code == 1 and not out.exists(), r.output
    assert f"{src}, line 7: the source has 101 tokens, more than the model's 64 (drop --no-truncate" in r.stderr
    with Translator.from_pretrained(marian, device="cpu") as translator:
        with pytest.raises(InputError, match="source 7 has 101 tokens, more than the model's 64"):
            list(translator.translate_stream(texts, truncate=False, max_new_tokens=2))


def test_translate_ctrl_c_is_interrupted_with_130_and_writes_nothing(marian, tmp_path, monkeypatch):
    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(Translator, "translate", interrupted)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    r = CliRunner().invoke(main, ["translate", str(src), "-o", str(out), "--model", str(marian), "--device", "cpu"])
    assert r.exit_code == 130 and "ftengine: interrupted" in r.stderr and "Traceback" not in r.output, r.output
    assert not out.exists()
