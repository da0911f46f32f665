"""Backends: `numpy_ops` (reference, runs anywhere) and, with a GPU, `cuda.ops` (same op names)."""

from __future__ import annotations

import sys

from ..errors import DeviceError

DEVICES = ("auto", "cpu", "cuda")
_said_fallback = False


def cuda_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:  # a broken driver install reports itself in many ways
        return False


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is usable, else 'cpu' (said once on stderr)."""
    global _said_fallback
    if device not in DEVICES:
        raise DeviceError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    if cuda_available():
        return "cuda"
    if device == "cuda":
        raise DeviceError(
            "device 'cuda' was asked for, but no usable GPU was found (CuPy missing, or no CUDA device); "
            "install ftengine[cuda12] or ftengine[cuda13], or use --device cpu"
        )
    if not _said_fallback:
        print("ftengine: no usable GPU, running on the CPU (NumPy backend)", file=sys.stderr)
        _said_fallback = True
    return "cpu"


def get_ops(device: str):
    if device == "cpu":
        from . import numpy_ops
        return numpy_ops
    from .cuda import ops
    return ops
