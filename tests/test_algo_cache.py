"""The on-disk file of cuBLASLt algorithm choices (ftengine/backends/cuda/algo_cache.py): what one
process saves the next reads, other GPUs' and broken files are not trusted, an unwritable folder
is reported once and costs nothing but the trial. Plain files: these run without a GPU; the
CUDA ops' use of the file is tested in test_cuda_ops.py."""

import json
import os
import threading

import pytest

from ftengine.backends.cuda.algo_cache import ENV, AlgoCache, cache_folder, key_text

FINGERPRINT = {"device": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "sms": 132, "cublaslt": 130100,
               "workspace": 32 << 20, "candidates": 8}
ALGO = bytes(range(64))


def test_saved_choices_are_read_by_the_next_process(tmp_path):
    first = AlgoCache(tmp_path, FINGERPRINT)
    assert first.load() == {}
    first.save({"a": ALGO})
    first.save({"b": ALGO[::-1]})
    later = AlgoCache(tmp_path, dict(FINGERPRINT))  # another process: another object, the same file
    assert later.path == first.path
    assert later.load() == {"a": ALGO, "b": ALGO[::-1]}
    assert sorted(os.listdir(tmp_path)) == [first.path.name]  # no temporary file left beside it


def test_another_gpu_or_library_has_a_file_of_its_own(tmp_path):
    AlgoCache(tmp_path, FINGERPRINT).save({"a": ALGO})
    for change in ({"sms": 114}, {"cublaslt": 130200}, {"device": "NVIDIA H200"}):
        other = AlgoCache(tmp_path, {**FINGERPRINT, **change})
        assert other.load() == {}
        assert other.path != AlgoCache(tmp_path, FINGERPRINT).path


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"algorithms": {}}', '{"fingerprint": 3}',
                                     "HEX", "LIST"])
def test_a_file_not_ours_is_ignored_said_once_and_replaced(tmp_path, capsys, content):
    cache = AlgoCache(tmp_path, FINGERPRINT)
    if content == "HEX":  # our fingerprint, an entry that is not hex
        content = json.dumps({"fingerprint": cache.fingerprint, "algorithms": {"a": "zz"}})
    elif content == "LIST":  # our fingerprint, entries in a list
        content = json.dumps({"fingerprint": cache.fingerprint, "algorithms": ["a"]})
    cache.path.write_text(content)
    assert cache.load() == {}
    assert cache.load() == {}
    err = capsys.readouterr().err
    assert err.count(f"ignoring the algorithm cache {cache.path}") == 1
    cache.save({"b": ALGO})
    assert AlgoCache(tmp_path, FINGERPRINT).load() == {"b": ALGO}


def test_a_file_of_another_fingerprint_under_our_name_is_not_trusted(tmp_path):
    cache = AlgoCache(tmp_path, FINGERPRINT)
    cache.path.write_text(json.dumps({"fingerprint": {**cache.fingerprint, "sms": 66},
                                      "algorithms": {"a": ALGO.hex()}}))
    assert cache.load() == {}


def test_an_unwritable_folder_is_said_once_and_nothing_fails(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cache = AlgoCache(blocker / "cache", FINGERPRINT)  # a folder below a regular file cannot be made
    cache.save({"a": ALGO})
    cache.save({"b": ALGO})
    assert cache.load() == {}
    err = capsys.readouterr().err
    assert err.count(f"cannot keep cuBLASLt algorithm choices in {blocker / 'cache'}") == 1
    assert ENV in err
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_threads_saving_at_once_keep_every_entry(tmp_path):
    cache = AlgoCache(tmp_path, FINGERPRINT)
    names = [f"shape{i}" for i in range(16)]
    threads = [threading.Thread(target=cache.save, args=({name: ALGO},)) for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert AlgoCache(tmp_path, FINGERPRINT).load() == {name: ALGO for name in names}


def test_the_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert cache_folder(str(tmp_path / "kernels")) == tmp_path / "kernels"
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert cache_folder(str(tmp_path / "kernels")) == tmp_path / "mine"
    monkeypatch.setenv(ENV, "")
    assert cache_folder(str(tmp_path / "kernels")) is None
    memory_only = AlgoCache(None, FINGERPRINT)
    memory_only.save({"a": ALGO})
    assert memory_only.load() == {}
    assert sorted(os.listdir(tmp_path)) == []


def test_plan_keys_name_their_entries_one_to_one():
    import numpy as np
    key = (1, 0, 768, 4096, 3072, 2, 3072, 2, 3072, 2, 768, "bias")
    assert key_text(key) == '[1,0,768,4096,3072,2,3072,2,3072,2,768,"bias"]'
    assert key_text(tuple(np.int64(v) if not isinstance(v, str) else v for v in key)) == key_text(key)
    assert key_text(key[:-1] + ("none",)) != key_text(key)
