"""GPU: a model's first run loads only kernel modules that its runner compiled ahead
(prepare_kernels), so that nothing compiles while a first request waits."""

import pytest

from ftengine import Encoder, Generator, Translator
from weights.fixtures import write_bert_checkpoint, write_gpt2_checkpoint, write_marian_checkpoint

pytestmark = pytest.mark.gpu


def _gpt2(folder):
    # a feed-forward width of 1004 reads its rows 4 elements at a time, the other rows 8
    with Generator.from_pretrained(write_gpt2_checkpoint(folder, n_embd=256, n_layer=2, n_head=4, n_inner=1004,
                                                         n_positions=128), device="cuda") as generator:
        generator.generate(["hello", "a longer prompt than that"], max_new_tokens=6)


def _marian(folder):
    with Translator.from_pretrained(write_marian_checkpoint(folder, d_model=64, heads=2, ffn=96),
                                    device="cuda") as translator:
        translator.translate(["a b c", "d e f g h"], num_beams=1, max_new_tokens=6)


def _encoder(folder):
    with Encoder.from_pretrained(write_bert_checkpoint(folder, hidden=384, layers=2, heads=12, intermediate=1536,
                                                       max_positions=128), device="cuda") as encoder:
        encoder.encode(["one text", "and another, longer text than the first"])


@pytest.mark.parametrize("run", [_gpt2, _marian, _encoder], ids=["gpt2-greedy", "marian-greedy", "bert-encode"])
def test_a_first_run_loads_only_the_modules_prepared_ahead(tmp_path, monkeypatch, run):
    pytest.importorskip("cupy")
    from ftengine.backends import cuda_available
    if not cuda_available():
        pytest.skip("needs a CUDA GPU and CuPy")
    from ftengine.backends.cuda import kernels
    prepared, modules_of = set(), kernels.modules_of

    def recorded(*args, **kwargs):
        found = modules_of(*args, **kwargs)
        prepared.update(found)
        return found

    monkeypatch.setattr(kernels, "modules_of", recorded)
    monkeypatch.setattr(kernels, "_modules", {})
    kernels.kernel.cache_clear()  # every launch then looks its module up in the fresh table
    try:
        run(tmp_path)
        loaded = set(kernels._modules)
    finally:
        kernels.kernel.cache_clear()
    assert {f for f, _, _ in loaded} >= {"convert.cu", "gemv.cu" if run is not _encoder else "layernorm.cu"}
    assert loaded <= prepared, sorted(loaded - prepared)
