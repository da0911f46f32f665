"""config.json and safetensors loading: every bad file gets its own clear message."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from ftengine.checkpoint import load_bert_weights
from ftengine.config import load_bert_config
from ftengine.errors import CheckpointError, ConfigError
from weights.fixtures import bert_config, random_bert_tensors, write_bert_checkpoint


def _write(folder, tensors, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    config = config or bert_config()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _load(folder):
    return load_bert_weights(folder, load_bert_config(folder))


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("key, value, message", [
    ("model_type", "gpt2", r"model_type 'gpt2' is not supported by the encoder; supported: bert"),
    ("hidden_act", "relu", r"hidden_act 'relu' is not supported; supported: gelu, gelu_new, gelu_pytorch_tanh"),
    ("position_embedding_type", "relative_key", r"position_embedding_type 'relative_key' is not supported; supported: absolute"),
    ("hidden_size", "32", r"key 'hidden_size' must be int"),
    ("num_attention_heads", 5, r"hidden_size 32 is not divisible by num_attention_heads 5"),
    ("layer_norm_eps", -1.0, r"layer_norm_eps' must be a number > 0"),
])
def test_bad_config_values(tmp_path, key, value, message):
    config = bert_config()
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_bert_config(tmp_path)


def test_missing_required_key(tmp_path):
    config = bert_config()
    del config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: required key 'num_hidden_layers' is missing"):
        load_bert_config(tmp_path)


def test_config_values_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(bert_config(type_vocab=1, eps=1e-7, hidden_act="gelu_new")))
    c = load_bert_config(tmp_path)
    assert (c.type_vocab_size, c.layer_norm_eps, c.gelu, c.pad_token_id, c.max_position_embeddings) == (1, 1e-7, "tanh", 0, 64)


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON"):
        load_bert_config(tmp_path)


# ---------------------------------------------------------------- checkpoint

def test_qkv_fused_in_query_key_value_order(tmp_path):
    tensors = random_bert_tensors(bert_config(), seed=2)
    w = _load(_write(tmp_path, tensors))
    p = "encoder.layer.1.attention.self."
    expected = np.concatenate([tensors[p + n + ".weight"] for n in ("query", "key", "value")])
    np.testing.assert_array_equal(w.layers[1].qkv_weight, expected)
    np.testing.assert_array_equal(w.layers[1].qkv_bias[32:64], tensors[p + "key.bias"])


def test_prefixed_names_and_heads_are_accepted(tmp_path):
    """BertForX checkpoints: `bert.` prefix, an MLM head and a classifier, ignored by name."""
    tensors = random_bert_tensors(bert_config(), prefix="bert.")
    tensors["cls.predictions.bias"] = np.ones(3, np.float32)
    tensors["classifier.weight"] = np.ones((2, 32), np.float32)
    tensors["bert.embeddings.position_ids"] = np.arange(64, dtype=np.int64)[None]
    w = _load(_write(tmp_path, tensors))
    np.testing.assert_array_equal(w.word_emb, tensors["bert.embeddings.word_embeddings.weight"])


def test_missing_tensors_are_listed_together(tmp_path):
    tensors = random_bert_tensors(bert_config())
    del tensors["encoder.layer.0.output.dense.bias"]
    del tensors["embeddings.LayerNorm.weight"]
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) missing: .*embeddings.LayerNorm.weight.*encoder.layer.0.output.dense.bias"):
        _load(_write(tmp_path, tensors))


def test_unexpected_tensor_is_an_error(tmp_path):
    tensors = random_bert_tensors(bert_config())
    tensors["encoder.layer.2.output.dense.bias"] = np.ones(32, np.float32)  # a third layer, config says 2
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\) for a BERT with 2 layers: encoder.layer.2.output.dense.bias"):
        _load(_write(tmp_path, tensors))


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    tensors = random_bert_tensors(bert_config())
    tensors["encoder.layer.1.intermediate.dense.weight"] = np.ones((36, 32), np.float32)
    with pytest.raises(CheckpointError, match=r"encoder.layer.1.intermediate.dense.weight is \[36, 32\], config says \[37, 32\]"):
        _load(_write(tmp_path, tensors))


def test_truncated_file_names_the_file(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        _load(folder)


def test_corrupt_header_names_the_file(tmp_path):
    folder = write_bert_checkpoint(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage-header}")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        _load(folder)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(bert_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights in .*pytorch_model.bin is a pickle and is never loaded"):
        _load(tmp_path)


def test_bf16_tensors_widen_exactly(tmp_path):
    """A bf16 checkpoint (written by torch, as HF does) loads as the float32 of each bf16 value."""
    import torch
    from safetensors.torch import save_file as save_torch
    tensors = random_bert_tensors(bert_config(), seed=4)
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()}
    tmp_path.joinpath("config.json").write_text(json.dumps(bert_config()))
    save_torch(bf16, str(tmp_path / "model.safetensors"))
    w = _load(tmp_path)
    expected = bf16["encoder.layer.0.intermediate.dense.weight"].float().numpy()
    np.testing.assert_array_equal(w.layers[0].ffn_in_weight, expected)
    assert not np.array_equal(expected, tensors["encoder.layer.0.intermediate.dense.weight"])


def _shard(folder, tensors, weight_map_override=None):
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard))
        weight_map.update({k: shard for k in keys})
    weight_map.update(weight_map_override or {})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_loads(tmp_path):
    tmp_path.joinpath("config.json").write_text(json.dumps(bert_config()))
    tensors = random_bert_tensors(bert_config(), seed=6)
    _shard(tmp_path, tensors)
    w = _load(tmp_path)
    np.testing.assert_array_equal(w.layers[1].ffn_ln_beta, tensors["encoder.layer.1.output.LayerNorm.bias"])


def test_sharded_index_escaping_the_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    folder.joinpath("config.json").write_text(json.dumps(bert_config()))
    tensors = random_bert_tensors(bert_config())
    save_file({"embeddings.word_embeddings.weight": tensors["embeddings.word_embeddings.weight"]},
              str(tmp_path / "outside.safetensors"))
    _shard(folder, tensors, {"embeddings.word_embeddings.weight": "../outside.safetensors"})
    with pytest.raises(CheckpointError, match=r"shard '../outside.safetensors' for tensor 'embeddings.word_embeddings.weight' is outside the model folder"):
        _load(folder)
