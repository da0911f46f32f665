"""The built wheel, installed as a user installs it: into a fresh virtual environment with no
editable install and no source tree on the path, then `ftengine encode` and `ftengine generate`
run from a folder outside the repository."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ftengine.backends.cuda import kernel_dir
from weights.fixtures import write_bert_checkpoint, write_gpt2_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))


def test_editable_install_finds_source_tree_kernels():
    assert kernel_dir() == ROOT / "kernels_cu"


def _tracked_copy(dest: Path) -> Path:
    """The repository's tracked and unignored files only (no build/, no .venv): what a clone has."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, venv bin folder): the wheel built from a clean copy, installed with its
    dependencies into a new venv."""
    work = tmp_path_factory.mktemp("wheel")
    src = _tracked_copy(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(work / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (work / "dist").glob("ftengine-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=300)
    bin_dir = work / "venv" / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheel)], check=True, timeout=900)
    return wheel, bin_dir


def _outside_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow
def test_wheel_holds_every_package_and_no_top_level_cli(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.split("/")[-1] for n in names if n.startswith("ftengine/kernels_cu/")) == SOURCES
    packages = sorted(str(p.parent.relative_to(ROOT)) for p in (ROOT / "ftengine").rglob("__init__.py"))
    for package in packages:
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    assert "cli.py" not in names and "ftengine/cli.py" in names


@pytest.mark.slow
def test_installed_wheel_encodes_and_generates_outside_the_tree(installed, tmp_path):
    _, bin_dir = installed
    env, cwd = _outside_env(), tmp_path
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import ftengine, sys; print(ftengine.__file__)"],
                           capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert not Path(probe.stdout.strip()).is_relative_to(ROOT), "ftengine came from the source tree"
    bert = write_bert_checkpoint(tmp_path / "bert", seed=1)
    (tmp_path / "in.txt").write_text("hello world\nthe quick brown fox\n")
    enc = subprocess.run([str(bin_dir / "ftengine"), "encode", "in.txt", "-o", "emb.npy", "--model", str(bert)],
                         capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert enc.returncode == 0, enc.stderr
    assert np.load(tmp_path / "emb.npy").shape == (2, 32) and "2 lines" in enc.stderr
    gpt2 = write_gpt2_checkpoint(tmp_path / "gpt2", seed=2)
    gen = subprocess.run([str(bin_dir / "ftengine"), "generate", "--model", str(gpt2), "--prompt", "hello",
                          "--max-new-tokens", "4", "--json"], capture_output=True, text=True, cwd=cwd, env=env,
                         timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert '"prompt": "hello"' in gen.stdout
    kernels = subprocess.run([str(bin_dir / "python"), "-c",
                              "from ftengine.backends.cuda import kernel_dir; print(kernel_dir())"],
                             capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    site = Path(probe.stdout.strip()).parent
    assert Path(kernels.stdout.strip()) == site / "kernels_cu"


@pytest.mark.slow
def test_data_formats_without_their_extras_name_the_extra(installed, tmp_path):
    """The bare wheel has no pyarrow and no ray: Parquet and encode-dataset say which extra to install."""
    _, bin_dir = installed
    env, cwd = _outside_env(), tmp_path
    bert = write_bert_checkpoint(tmp_path / "bert", seed=1)
    (tmp_path / "in.txt").write_text("hello world\n")
    (tmp_path / "in.csv").write_text("text\nhello\n")
    for args, message in [
        (["encode", "in.txt", "-o", "out.parquet"], "parquet output needs pyarrow: pip install 'ftengine[data]'"),
        (["encode", "in.csv", "-o", "out.npy"], "csv input needs pyarrow: pip install 'ftengine[data]'"),
        (["encode-dataset", "in.csv", "-o", "out"], "needs the ray extra (pip install 'ftengine[ray]')"),
    ]:
        r = subprocess.run([str(bin_dir / "ftengine"), *args, "--model", str(bert)], capture_output=True, text=True,
                           cwd=cwd, env=env, timeout=300)
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "out.npy").exists()
