"""`ftengine warmup --model`: on a GPU it runs an embedding model, a reranker and a translator on
batches of several sizes, exits 0 and leaves the algorithm file on disk; without one it is one
clear line and exit status 1."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftengine.backends import cuda_available
from ftengine.cli import main
from weights.fixtures import add_classification_head, write_bert_checkpoint, write_bart_family_checkpoint


@pytest.mark.skipif(cuda_available(), reason="the message of a machine without a GPU")
def test_warmup_without_a_gpu_is_one_clear_line(st_model):
    r = CliRunner().invoke(main, ["warmup", "--model", str(st_model)])
    assert r.exit_code == 1 and "needs a usable GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("kind", ["embed", "rerank", "translate"])
def test_warmup_runs_the_model_and_fills_the_algorithm_file(kind, st_model, tmp_path):
    if kind == "rerank":
        model = add_classification_head(write_bert_checkpoint(tmp_path / "rr", seed=2, max_positions=512))
    elif kind == "translate":
        model = write_bart_family_checkpoint(tmp_path / "nllb", "nllb", seed=3, d_model=64, heads=2, ffn=96)
    else:
        model = st_model
    algos = tmp_path / "algos"
    algos.mkdir()
    # a process of its own: the algorithm file's folder is read when the CUDA backend starts
    r = subprocess.run([sys.executable, "-m", "ftengine.cli", "warmup", "--dtype", "fp16", "--model", str(model)],
                       capture_output=True, text=True, env={**os.environ, "FTENGINE_ALGO_CACHE": str(algos)},
                       cwd=Path(__file__).resolve().parent.parent, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"{model} run once on 4 batch sizes" in r.stderr
    if kind != "translate":  # the encoders' long batches run products of thousands of rows
        assert any(algos.iterdir())
