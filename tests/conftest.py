import os

import numpy as np
import pytest

from weights.fixtures import add_classification_head, write_bert_checkpoint

# The HF oracle must never try the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_usable() -> bool:
    from ftengine.backends import cuda_available
    return cuda_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def algo_cache_folder(tmp_path_factory):
    """The cuBLASLt algorithm choices that ops.py keeps on disk (backends/cuda/algo_cache.py) go to a
    folder of this session's own (inherited by the CLI's subprocesses), so that no test reads
    another run's choices or writes the user's cache."""
    from ftengine.backends.cuda.algo_cache import ENV
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(tmp_path_factory.mktemp("algo_cache")))
        yield


@pytest.fixture(scope="session")
def st_model(tmp_path_factory):
    """A small random sentence-transformers-style folder: mean pooling, normalised, max 48 tokens."""
    return write_bert_checkpoint(
        tmp_path_factory.mktemp("st_model"), seed=1, max_positions=64,
        sentence_transformers={"pooling": {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True},
                               "normalize": True, "max_seq_length": 48},
    )


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def cuda_translator():
    """Translator.from_pretrained on the CUDA backend (skips where there is no usable GPU)."""
    if not _cuda_usable():
        pytest.skip("needs a CUDA GPU and CuPy")
    from ftengine import Translator
    return lambda folder, **kw: Translator.from_pretrained(folder, device="cuda", **kw)


@pytest.fixture(scope="session")
def small_classifier(tmp_path_factory):
    """A small random BERT ...ForSequenceClassification folder: three labels, max 32 tokens."""
    folder = tmp_path_factory.mktemp("small-classifier")
    write_bert_checkpoint(folder, seed=11, max_positions=32)
    add_classification_head(folder, num_labels=3, seed=12)
    return folder
