"""Output precision of embeddings, as sentence-transformers' quantize_embeddings defines it.

int8 / uint8: per dimension, the range [min, max] (from calibration embeddings, or given) is cut
into 255 steps; a value becomes floor((x - min) / step) clipped to 0..255 (minus 128 for int8).
binary / ubinary: one bit per dimension (x > 0), packed eight to a byte, big-endian bit order
(NumPy's packbits); binary shifts the bytes by -128 into int8.
"""

from __future__ import annotations

import numpy as np

from .errors import InputError

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
_DTYPES = {"float32": np.float32, "int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return precision


def output_dtype(precision: str) -> np.dtype:
    return np.dtype(_DTYPES[check_precision(precision)])


def output_width(dim: int, precision: str) -> int:
    """Values per row: one per dimension, or one byte per eight dimensions when binary."""
    return -(-dim // 8) if check_precision(precision).endswith("binary") else dim


def needs_ranges(precision: str) -> bool:
    return check_precision(precision).endswith("int8")


def calibration_ranges(embeddings: np.ndarray) -> np.ndarray:
    """(2, dim) float32: each dimension's minimum and maximum over the calibration embeddings."""
    embeddings = np.asarray(embeddings)
    if embeddings.ndim != 2 or len(embeddings) < 2 or not np.issubdtype(embeddings.dtype, np.floating):
        raise InputError(f"calibration needs at least two float embeddings as a (n, dim) array, found "
                         f"{embeddings.dtype} of shape {embeddings.shape}")
    return np.stack([embeddings.min(axis=0), embeddings.max(axis=0)]).astype(np.float32)


def check_ranges(ranges, dim: int) -> np.ndarray:
    ranges = np.asarray(ranges, dtype=np.float32)
    if ranges.shape != (2, dim):
        raise InputError(f"ranges must have shape (2, {dim}) (each dimension's min and max), found {ranges.shape}")
    if not np.isfinite(ranges).all() or (ranges[1] < ranges[0]).any():
        raise InputError("ranges must be finite, with each dimension's max at least its min")
    return ranges


def quantize(embeddings: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """(n, dim) float32 embeddings in `precision`; int8/uint8 need (2, dim) `ranges`."""
    if check_precision(precision) == "float32":
        return embeddings
    if precision.endswith("binary"):
        packed = np.packbits(embeddings > 0, axis=-1)
        return (packed.astype(np.int16) - 128).astype(np.int8) if precision == "binary" else packed
    ranges = check_ranges(ranges, embeddings.shape[1])
    steps = (ranges[1] - ranges[0]) / 255
    steps = np.where(steps == 0, 1, steps)
    levels = np.clip(np.floor((embeddings - ranges[0]) / steps), 0, 255)
    return (levels - 128).astype(np.int8) if precision == "int8" else levels.astype(np.uint8)
