"""kernels_cu/ is found from an editable install and from a built wheel."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ftengine.backends.cuda import kernel_dir

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))


def test_editable_install_finds_source_tree_kernels():
    assert kernel_dir() == ROOT / "kernels_cu"


@pytest.mark.slow
def test_wheel_carries_kernels(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("ftengine-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.split("/")[-1] for n in names if n.startswith("ftengine/kernels_cu/")) == SOURCES
    assert "cli.py" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    probe = "from ftengine.backends.cuda import kernel_dir; print(kernel_dir())"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {probe}"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == target / "ftengine" / "kernels_cu"
