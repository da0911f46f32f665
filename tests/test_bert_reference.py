"""Level 2: the NumPy reference encoder against HF transformers BertModel (float32, CPU)."""

import numpy as np
import pytest

from ftengine.backends import numpy_ops
from ftengine.checkpoint import load_bert_weights
from ftengine.config import load_bert_config
from ftengine.models.bert import Batch, BertRunner, padded_arrays
from tests.hf_oracle import hf_bert, hf_hidden_states, st_pooling
from tests.tolerances import HF_FP32_MAX_ABS
from weights.fixtures import write_bert_checkpoint

CONFIGS = {  # name -> (fixture config, layouts it runs in: packed needs head_dim 32, 64 or 128)
    "small-erf": (dict(hidden=32, layers=2, heads=4, intermediate=37), ["padded"]),
    "hidden-not-64-multiple": (dict(hidden=48, layers=3, heads=3, intermediate=101), ["padded"]),
    "one-type-tanh": (dict(hidden=40, layers=2, heads=5, intermediate=64, type_vocab=1, hidden_act="gelu_new"), ["padded"]),
    "pytorch-tanh-one-head": (dict(hidden=24, layers=1, heads=1, intermediate=50, hidden_act="gelu_pytorch_tanh"), ["padded"]),
    "minilm-shaped": (dict(hidden=96, layers=2, heads=12, intermediate=384, eps=1e-7), ["padded"]),
    "head-dim-32": (dict(hidden=96, layers=2, heads=3, intermediate=200), ["packed", "padded"]),
    "head-dim-64": (dict(hidden=128, layers=2, heads=2, intermediate=300, type_vocab=1), ["packed", "padded"]),
    "head-dim-128": (dict(hidden=256, layers=1, heads=2, intermediate=257, hidden_act="gelu_new"), ["packed", "padded"]),
}
CASES = [(name, layout) for name, (_, layouts) in CONFIGS.items() for layout in layouts]


def _ragged_batch(rng, config, lengths):
    v, tv = config.vocab_size, config.type_vocab_size
    return Batch.from_lists([rng.integers(0, v, n).tolist() for n in lengths],
                 [rng.integers(0, tv, n).tolist() for n in lengths])


def _runner(path, layout, max_batch_tokens=1024, max_seq_len=64):
    config = load_bert_config(path)
    return BertRunner(config, load_bert_weights(path, config), numpy_ops, dtype="fp32",
                      max_batch_tokens=max_batch_tokens, max_seq_len=max_seq_len, layout=layout)


def _hf_padded(path, batch):
    ids, types, lengths = padded_arrays(batch, b=len(batch.lengths), s=int(batch.lengths.max()), pad_id=0)
    return hf_hidden_states(hf_bert(path), ids, types, lengths)


@pytest.mark.parametrize("name, layout", CASES)
def test_hidden_states_match_hf(tmp_path, rng, name, layout):
    config, _ = CONFIGS[name]
    path = write_bert_checkpoint(tmp_path, seed=len(name), **config)
    runner = _runner(path, layout)
    batch = _ragged_batch(rng, runner.config, [1, 7, 33, 64, 2, 50])
    ours = runner.hidden_states(batch)
    ref = _hf_padded(path, batch)
    assert np.abs(ref).max() > 0.5  # the comparison is not between near-zero tensors
    err = max(np.abs(o - ref[i, :len(o)]).max() for i, o in enumerate(ours))
    assert err <= HF_FP32_MAX_ABS, f"{name} {layout}: max abs {err}"


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_batch_neighbours_do_not_change_results(tmp_path, rng, layout):
    """A sequence gives the same hidden states alone and inside a batch of longer ones."""
    path = write_bert_checkpoint(tmp_path, seed=3, **CONFIGS["head-dim-32"][0])
    runner = _runner(path, layout)
    batch = _ragged_batch(rng, runner.config, [40, 5, 17])
    together = runner.hidden_states(batch)[1].copy()
    one = Batch.from_lists([batch.split(batch.ids)[1]], [batch.split(batch.token_types)[1]])
    alone = runner.hidden_states(one)[0]
    assert np.abs(together - alone).max() <= HF_FP32_MAX_ABS


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("modes", [("cls",), ("max",), ("mean",), ("mean_sqrt_len",), ("weightedmean",),
                                   ("lasttoken",), ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")])
def test_pooling_matches_sentence_transformers(tmp_path, rng, modes, layout):
    path = write_bert_checkpoint(tmp_path, seed=5, **CONFIGS["head-dim-64"][0])
    runner = _runner(path, layout)
    batch = _ragged_batch(rng, runner.config, [3, 17, 9, 1])
    ours = runner.embed(batch, pooling=modes, normalize=False)
    ref = st_pooling(_hf_padded(path, batch), batch.lengths, modes)
    assert ours.shape == (4, len(modes) * runner.config.hidden_size)
    assert np.abs(ours - ref).max() <= HF_FP32_MAX_ABS


@pytest.mark.parametrize("layout, lengths", [("padded", [32, 32, 32]), ("packed", [32, 32, 1]), ("packed", [33])])
def test_batch_over_limits_is_refused(tmp_path, rng, layout, lengths):
    runner = _runner(write_bert_checkpoint(tmp_path, **CONFIGS["head-dim-32"][0]), layout,
                     max_batch_tokens=64, max_seq_len=32)
    with pytest.raises(Exception, match="exceeds this runner's limits"):
        runner.hidden_states(_ragged_batch(rng, runner.config, lengths))


def test_packed_layout_needs_supported_head_dim(tmp_path):
    with pytest.raises(Exception, match=r"packed layout needs head_dim in \(32, 64, 128\), this model has 8"):
        _runner(write_bert_checkpoint(tmp_path), "packed")


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("field, bad", [("token id", "past"), ("token id", -1), ("token type", "past"),
                                        ("token type", -1)])
def test_token_outside_its_table_is_refused(tmp_path, layout, field, bad):
    runner = _runner(write_bert_checkpoint(tmp_path, **CONFIGS["head-dim-32"][0]), layout)
    c = runner.config
    value = (c.vocab_size if field == "token id" else c.type_vocab_size) if bad == "past" else bad
    ids, types = [[2, 3], [2, 4, 3]], [[0, 0], [0, 0, 0]]
    (ids if field == "token id" else types)[1][1] = value
    with pytest.raises(Exception, match=rf"{field} {value} \(sequence 1, position 1\) is outside 0\.\.\d+"):
        runner.hidden_states(Batch.from_lists(ids, types))
