"""Hub ids wherever a model is named: `org/name` (and `@revision`) resolved from a HuggingFace
cache laid out as the Hub's client lays it out (no network: the suite runs offline), a local
folder of that name winning, and one clear error for an id that is not there."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ftengine import ConfigError, Encoder
from tests.tolerances import BATCHING_INVARIANCE_FP32

pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
EXE = str(Path(sys.executable).with_name("ftengine"))


def cached(hf_home: Path, repo: str, folder: Path, *, commit: str = COMMIT) -> Path:
    """`folder`'s files as the Hub's client caches a download of `repo` at `commit` (main)."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, st_model, monkeypatch):
    import huggingface_hub.constants as constants
    home = tmp_path / "hf"
    cached(home, "org/tiny", st_model)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HOME", str(home))
    return home


def test_a_cached_hub_id_loads_as_its_folder(hub_cache, st_model):
    texts = ["the quick brown fox", "hello world"]
    with Encoder.from_pretrained(st_model, device="cpu") as local:
        expected = local.encode(texts)
    for name in ("org/tiny", f"org/tiny@{COMMIT}", "org/tiny@main"):
        with Encoder.from_pretrained(name, device="cpu") as encoder:
            assert str(encoder.path).startswith(str(hub_cache))
            assert np.abs(encoder.encode(texts) - expected).max() <= BATCHING_INVARIANCE_FP32


def test_ids_not_in_the_cache_are_one_clear_error(hub_cache):
    with pytest.raises(ConfigError, match="org/absent: not in the HuggingFace cache, and the Hub cannot be reached"):
        Encoder.from_pretrained("org/absent", device="cpu")
    with pytest.raises(ConfigError, match="org/tiny@v9"):
        Encoder.from_pretrained("org/tiny@v9", device="cpu")
    with pytest.raises(ConfigError, match="model folder not found: no/such/thing/here"):
        Encoder.from_pretrained("no/such/thing/here", device="cpu")


def test_a_local_folder_of_that_name_wins(hub_cache, tmp_path, monkeypatch):
    from weights.fixtures import write_bert_checkpoint
    monkeypatch.chdir(tmp_path)
    local = write_bert_checkpoint(tmp_path / "org" / "tiny", seed=9, sentence_transformers={
        "pooling": {"word_embedding_dimension": 32, "pooling_mode_cls_token": True}, "max_seq_length": 16})
    with Encoder.from_pretrained("org/tiny", device="cpu") as encoder:
        assert Path(encoder.path).resolve() == local.resolve()


def test_the_command_line_takes_a_hub_id(tmp_path, st_model):
    home = tmp_path / "hf"
    cached(home, "org/tiny", st_model)
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([EXE, "encode", str(src), "-o", str(tmp_path / "o.npy"), "--model", "org/tiny", "--device",
                           "cpu", "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert np.load(tmp_path / "o.npy").shape == (2, 32)
    done = subprocess.run([EXE, "encode", str(src), "-o", str(tmp_path / "o.npy"), "--model", "org/other",
                           "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1 and done.stderr.strip() == ("ftengine: error: org/other: not in the HuggingFace "
                                                           "cache, and the Hub cannot be reached (HF_HUB_OFFLINE, "
                                                           "or no network)")
