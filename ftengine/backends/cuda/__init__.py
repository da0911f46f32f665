"""The CUDA backend: kernels from kernels_cu/ compiled with NVRTC, cuBLAS through ctypes."""

from __future__ import annotations

from pathlib import Path

import ftengine


def kernel_dir() -> Path:
    """The folder of CUDA sources: ftengine/kernels_cu inside a built wheel,
    kernels_cu/ beside the package in a source checkout or editable install."""
    package = Path(ftengine.__file__).resolve().parent
    for candidate in (package / "kernels_cu", package.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"CUDA kernel sources (kernels_cu/common.cuh) not found beside {package}")
