"""sentence-transformers folder settings and the tokenizer (tokenizer.json, vocab.txt fallback)."""

import json

import numpy as np
import pytest

from ftengine.errors import ConfigError, InputError
from ftengine.tokenizer import Tokenizer, parse_pooling, read_folder_settings
from weights.fixtures import write_bert_checkpoint, write_sentence_transformers_files


def test_plain_bert_folder_defaults(tmp_path):
    s = read_folder_settings(write_bert_checkpoint(tmp_path))
    assert (s.pooling, s.normalize, s.max_length) == (("mean",), False, None)


def test_legacy_pooling_booleans_in_sentence_transformers_order(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    write_sentence_transformers_files(folder, normalize=True, max_seq_length=20, pooling={
        "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": True})
    s = read_folder_settings(folder)
    assert (s.pooling, s.normalize, s.max_length) == (("cls", "mean", "mean_sqrt_len", "lasttoken"), True, 20)


@pytest.mark.parametrize("value, expected", [
    ("max", ("max",)),
    (["lasttoken", "cls"], ("lasttoken", "cls")),  # sentence-transformers 5+ concatenates in the list's order
    ("mean_sqrt_len_tokens", ("mean_sqrt_len",)),
])
def test_pooling_mode_string_or_list(tmp_path, value, expected):
    folder = write_bert_checkpoint(tmp_path)
    write_sentence_transformers_files(folder, pooling={"pooling_mode": value})
    assert read_folder_settings(folder).pooling == expected


def test_unsupported_pooling_is_named(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    write_sentence_transformers_files(folder, pooling={"pooling_mode_weightedmean_tokens": True,
                                                       "pooling_mode_cls_token": True})
    assert read_folder_settings(folder).pooling == ("cls", "weightedmean")
    with pytest.raises(ConfigError, match=r"pooling mode 'median' is not supported; supported: cls, max, mean"):
        parse_pooling("mean,median", "--pooling")


def test_unsupported_module_is_named(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "path": "2_CNN", "type": "sentence_transformers.models.CNN"}]))
    with pytest.raises(ConfigError, match="module 'sentence_transformers.models.CNN' is not supported; ftengine runs "
                                          "Transformer, Pooling, Dense and Normalize modules, in that order"):
        read_folder_settings(folder)
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
                                                     {"idx": 1, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ConfigError, match="module 'sentence_transformers.models.Dense' is not supported after Normalize"):
        read_folder_settings(folder)


def test_vocab_txt_fallback_tokenises_like_tokenizer_json(tmp_path):
    folder = write_bert_checkpoint(tmp_path / "a")
    texts = ["Hello World, the quick brown fox!", "  lazy dog  ", "", "unknownwordxyz 123"]
    full = Tokenizer(folder, max_length=16).encode(texts)
    (folder / "tokenizer.json").unlink()
    fallback = Tokenizer(folder, max_length=16).encode(texts)
    assert np.array_equal(fallback.ids, full.ids) and np.array_equal(fallback.lengths, full.lengths)
    third = full.starts[2]
    assert full.ids[third:third + full.lengths[2]].tolist() == [2, 3]  # an empty line is [CLS] [SEP]


def test_truncation_is_flagged(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    out = Tokenizer(folder, max_length=6).encode(["the dog", "the quick brown fox jumps over"])
    assert out.lengths.tolist() == [4, 6]
    assert out.truncated.tolist() == [False, True]
    assert out.ids[-1] == 3  # still ends with [SEP]


def test_exactly_max_length_is_not_truncated(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    out = Tokenizer(folder, max_length=6).encode(["the quick brown fox", "the quick brown fox jumps"])
    assert out.lengths.tolist() == [6, 6] and out.truncated.tolist() == [False, True]


def test_non_string_text_is_named_one_based(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    with pytest.raises(InputError, match="text 2 is a int, not a str"):
        Tokenizer(folder, max_length=6).encode(["ok", 3])


@pytest.mark.parametrize("single, types", [
    ("[CLS] $A [SEP]", [0, 0, 0, 0]),        # BERT's template: type ids are not even read
    ("[CLS] $A:1 [SEP]:1", [0, 1, 1, 1]),    # a template that sets them: read from each encoding
])
def test_type_ids_follow_the_post_processor(tmp_path, single, types):
    from tokenizers import Tokenizer as HF
    from tokenizers import processors
    folder = write_bert_checkpoint(tmp_path)
    tok = HF.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(folder / "tokenizer.json"))
    out = Tokenizer(folder, max_length=16).encode(["the dog"])
    assert out.type_ids.tolist() == types == tok.encode("the dog").type_ids
