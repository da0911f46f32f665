"""Level 2: the NumPy reference encoder against HF transformers BertModel (float32, CPU)."""

import numpy as np
import pytest

from ftengine.backends import numpy_ops
from ftengine.checkpoint import load_bert_weights
from ftengine.config import load_bert_config
from ftengine.models.bert import BertRunner, make_batch
from tests.hf_oracle import hf_bert, hf_hidden_states, st_pooling
from tests.tolerances import HF_FP32_MAX_ABS
from weights.fixtures import write_bert_checkpoint

CONFIGS = {
    "small-erf": dict(hidden=32, layers=2, heads=4, intermediate=37),
    "hidden-not-64-multiple": dict(hidden=48, layers=3, heads=3, intermediate=101),
    "one-type-tanh": dict(hidden=40, layers=2, heads=5, intermediate=64, type_vocab=1, hidden_act="gelu_new"),
    "pytorch-tanh-one-head": dict(hidden=24, layers=1, heads=1, intermediate=50, hidden_act="gelu_pytorch_tanh"),
    "minilm-shaped": dict(hidden=96, layers=2, heads=12, intermediate=384, eps=1e-7),
}


def _ragged_batch(rng, config, lengths):
    v, tv = config.vocab_size, config.type_vocab_size
    ids = [rng.integers(0, v, n).tolist() for n in lengths]
    types = [rng.integers(0, tv, n).tolist() for n in lengths]
    return make_batch(ids, types, pad_id=config.pad_token_id)


def _runner(path, max_batch_tokens=1024, max_seq_len=64):
    config = load_bert_config(path)
    return BertRunner(config, load_bert_weights(path, config), numpy_ops, dtype="fp32",
                      max_batch_tokens=max_batch_tokens, max_seq_len=max_seq_len)


@pytest.mark.parametrize("name", CONFIGS)
def test_hidden_states_match_hf(tmp_path, rng, name):
    path = write_bert_checkpoint(tmp_path, seed=len(name), **CONFIGS[name])
    runner = _runner(path)
    batch = _ragged_batch(rng, runner.config, [1, 7, 33, 64, 2, 50])
    b, s = batch.shape
    ours = runner.hidden_states(batch).reshape(b, s, -1)
    ref = hf_hidden_states(hf_bert(path), batch.ids, batch.token_types, batch.lengths)
    real = np.arange(s)[None, :] < batch.lengths[:, None]
    assert np.abs(ref).max() > 0.5  # the comparison is not between near-zero tensors
    err = np.abs(ours - ref)[real].max()
    assert err <= HF_FP32_MAX_ABS, f"{name}: max abs {err}"


def test_padding_does_not_change_results(tmp_path, rng):
    """A sequence gives the same hidden states alone and padded inside a longer batch."""
    path = write_bert_checkpoint(tmp_path, seed=3)
    runner = _runner(path)
    batch = _ragged_batch(rng, runner.config, [5, 40])
    both = runner.hidden_states(batch).reshape(2, 40, -1)[0, :5].copy()
    alone = make_batch([batch.ids[0, :5]], [batch.token_types[0, :5]], pad_id=0)
    single = runner.hidden_states(alone).reshape(1, 5, -1)[0]
    assert np.abs(both - single).max() <= HF_FP32_MAX_ABS


@pytest.mark.parametrize("modes", [("cls",), ("max",), ("mean",), ("mean_sqrt_len",), ("lasttoken",),
                                   ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")])
def test_pooling_matches_sentence_transformers(tmp_path, rng, modes):
    path = write_bert_checkpoint(tmp_path, seed=5)
    runner = _runner(path)
    batch = _ragged_batch(rng, runner.config, [3, 17, 9, 1])
    b, s = batch.shape
    ours = runner.embed(batch, pooling=modes, normalize=False)
    ref_hidden = hf_hidden_states(hf_bert(path), batch.ids, batch.token_types, batch.lengths)
    ref = st_pooling(ref_hidden, batch.lengths, modes)
    assert ours.shape == (b, len(modes) * runner.config.hidden_size)
    assert np.abs(ours - ref).max() <= HF_FP32_MAX_ABS


def test_batch_over_limits_is_refused(tmp_path, rng):
    runner = _runner(write_bert_checkpoint(tmp_path), max_batch_tokens=64, max_seq_len=32)
    with pytest.raises(Exception, match="exceeds this runner's limits"):
        runner.hidden_states(_ragged_batch(rng, runner.config, [32, 32, 32]))


def test_token_id_outside_vocab_is_refused(tmp_path):
    runner = _runner(write_bert_checkpoint(tmp_path))
    batch = make_batch([[2, runner.config.vocab_size, 3]], [[0, 0, 0]], pad_id=0)
    with pytest.raises(Exception, match=r"token id \d+ \(sequence 0, position 1\) is outside the vocabulary"):
        runner.hidden_states(batch)
