"""Generator: prompts -> generated text with GPT-2 checkpoints."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from .backends import get_ops, resolve_device
from .checkpoint import load_gpt2_weights
from .config import load_gpt2_config
from .decoding.beam import hypotheses
from .decoding.generate import GenerationParams, check_max_batch, check_prompts, stream_tokens
from .encoder import DTYPES
from .engine import OwnsWorker, SerialWorker
from .errors import ConfigError, DeviceError, InputError
from .hub import model_folder
from .models.gpt2 import GPT2Runner, prepare_kernels

CPU_DEFAULT_BATCH = 64
MAX_DEFAULT_BATCH = 256


def decoding_device_dtype(device: str, dtype: str | None) -> tuple[str, str]:
    """The device ("auto" resolved) and dtype a decoding model runs in: fp16 on the GPU and fp32
    on the CPU by default; the CPU (NumPy) backend computes in fp32 only."""
    device = resolve_device(device)
    dtype = dtype or ("fp16" if device == "cuda" else "fp32")
    if dtype not in DTYPES:
        fp8 = " (fp8 is for the encoders)" if dtype == "fp8" else ""
        raise DeviceError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}{fp8}")
    if device == "cpu" and dtype != "fp32":
        raise DeviceError(f"dtype {dtype} needs the CUDA backend; the CPU (NumPy) backend computes in fp32")
    return device, dtype


@dataclass
class Candidate:
    text: str
    token_ids: list          # new tokens only, the eos that ended the sequence included
    score: float | None = None


@dataclass
class GenerationResult:
    prompt: str
    text: str
    token_ids: list
    score: float | None
    candidates: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids, "score": self.score,
                "candidates": [vars(c) for c in self.candidates]}


class Generator(OwnsWorker):
    """Prompts -> generated text. Safe to call from any number of threads: calls are
    serialised (one at a time, on the Generator's own worker thread, which owns the model's
    device state); a stream holds the Generator until it ends or is closed."""

    def __init__(self, path: Path, *, device: str = "auto", dtype: str | None = None, cuda_graphs: bool = True):
        path = model_folder(path)
        device, dtype = decoding_device_dtype(device, dtype)
        self.device, self.dtype, self.cuda_graphs = device, dtype, cuda_graphs
        self.ops = get_ops(device)
        self.path = path
        self.config = load_gpt2_config(path)
        # the kernels compile (NVRTC, without the GIL) while the weights load; the first runner then
        # waits only for what is left (kernels.module compiles each module once, whoever asks first)
        threading.Thread(target=self._prepare, name="ftengine-generator-kernels", daemon=True).start()
        self.weights = load_gpt2_weights(path, self.config, views=device == "cuda")
        self.tokenizer = _load_tokenizer(path)
        self._runner = None
        # every call runs on this one thread, which owns the runner (and its CUDA stream)
        self._worker = SerialWorker("ftengine-generator")

    def _prepare(self):
        try:
            prepare_kernels(self.config, self.ops, self.dtype)
        except Exception:  # the first runner prepares again, and reports the failure
            pass

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", dtype: str | None = None, *,
                        cuda_graphs: bool = True) -> "Generator":
        """Load a GPT-2 checkpoint folder (config.json, *.safetensors, tokenizer.json).
        dtype: fp32, fp16 or bf16 (default fp16 on the GPU, fp32 on the CPU); cuda_graphs=False
        runs each decode step's launches directly."""
        return cls(Path(path), device=device, dtype=dtype, cuda_graphs=cuda_graphs)

    def _runner_for(self, batch: int, prompts: list, params: GenerationParams) -> GPT2Runner:
        """A runner for `batch` sequences whose KV cache holds the longest prompt + max_new_tokens
        (rounded up to 64 positions, at most n_positions), reused while it is large enough."""
        if not prompts:
            raise InputError("no prompts to continue")
        check_prompts(prompts, params, self.config.n_positions)
        need = max(len(p) for p in prompts) + params.max_new_tokens
        length = min(self.config.n_positions, -(-need // 64) * 64)
        r = self._runner
        if r is None or r.max_batch < batch or r.max_len < need:
            self._runner = r = GPT2Runner(self.config, self.weights, self.ops, dtype=self.dtype,
                                          max_batch=batch, max_len=length, graphs=self.cuda_graphs)
        return r

    def encode_prompts(self, prompts) -> list:
        if isinstance(prompts, str):
            prompts = [prompts]
        encoded = []
        for i, text in enumerate(prompts):
            if not isinstance(text, str):
                raise InputError(f"prompt {i + 1} is a {type(text).__name__}, not a str")
            encoded.append(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return encoded

    def params(self, max_new_tokens: int, eos_token_id=None, **options) -> GenerationParams:
        eos = self.config.eos_token_ids if eos_token_id is None else (eos_token_id,)
        return GenerationParams(max_new_tokens=max_new_tokens, eos_token_ids=tuple(eos), **options) \
            .checked(vocab_size=self.config.vocab_size)

    def stream(self, prompts, *, max_new_tokens: int, eos_token_id=None, **options):
        """Yield, per step, a list of (prompt index, new token id) for the prompts still running
        (greedy or sampling; beam search has no per-step stream). Every prompt of a stream runs
        at once (no waves). While a stream is open, other calls on this Generator wait for it
        to finish or be closed."""
        ids = self.encode_prompts(prompts)
        params = self.params(max_new_tokens, eos_token_id, **options)
        if params.num_beams > 1:
            raise InputError("streaming is for greedy and sampled generation; beam search returns its hypotheses at the end")
        with self._worker.hold():
            steps = self._worker.call(lambda: stream_tokens(self._runner_for(len(ids), ids, params), ids, params))
            try:
                while (step := self._worker.call(next, steps, None)) is not None:
                    yield step
            finally:
                self._worker.call(steps.close)

    def generate(self, prompts, *, max_new_tokens: int, eos_token_id: int | None = None,
                 max_batch: int | None = None, **options) -> list:
        """Generated continuations, one GenerationResult per prompt, in input order.
        options: min_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, seed,
        no_repeat_ngram_size, num_beams, length_penalty, early_stopping, num_return_sequences.
        Prompts decode in waves of at most `max_batch` sequences (beam search: max_batch //
        num_beams prompts), so memory is bounded by the wave, not by the number of prompts;
        default: what half the free device memory holds (64 on the CPU), at most 256. A seeded
        draw depends on the prompt's place in its wave, as it does on its place in a call."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = self.params(max_new_tokens, eos_token_id, **options)
        ids = self.encode_prompts(texts)
        if not ids:
            raise InputError("no prompts to continue")
        if max_batch is None:
            max_batch = max(params.num_beams, self.default_max_batch(max(len(p) for p in ids) + max_new_tokens))
        wave = check_max_batch(max_batch, params) // params.num_beams
        found = []
        for start in range(0, len(ids), wave):
            found += self._worker.call(self._search, ids[start:start + wave], params)
        results = []
        for text, scored in zip(texts, found):
            cands = [Candidate(self.decode(t), t, s) for t, s in scored]
            results.append(GenerationResult(text, cands[0].text, cands[0].token_ids, cands[0].score, cands))
        return results

    def default_max_batch(self, length: int) -> int:
        """Sequences of `length` tokens whose KV cache and activations fit in half the free
        device memory (64 on the CPU), within 1..MAX_DEFAULT_BATCH."""
        if self.device != "cuda":
            return CPU_DEFAULT_BATCH
        import cupy
        c = self.config
        length = min(c.n_positions, -(-length // 64) * 64)
        item = 4 if self.dtype == "fp32" else 2
        cache = 2 * c.n_layer * length * c.n_embd * item
        activations = length * (8 * c.n_embd + c.n_inner) * item
        per_sequence = cache + activations + 9 * c.vocab_size + 16 * length
        free, _ = cupy.cuda.runtime.memGetInfo()
        return max(1, min(MAX_DEFAULT_BATCH, int(free // 2 // per_sequence)))

    def _search(self, ids: list, params: GenerationParams) -> list:
        """Hypotheses [(new token ids, score)] per prompt; runs on the worker thread."""
        return hypotheses(self._runner_for(len(ids) * params.num_beams, ids, params), ids, params)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"no tokenizer.json in {path}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ConfigError(f"{file}: cannot load tokenizer ({e})") from None
