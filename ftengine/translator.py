"""Translator: source texts -> translations (or summaries) with encoder-decoder checkpoints
(Marian / opus-mt, BART, mBART, M2M100 / NLLB), HF `generate`'s results on either backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from .backends import get_ops, resolve_device
from .config import load_seq2seq_config
from .decoding.beam import hypotheses
from .decoding.generate import GenerationParams, check_max_batch
from .engine import OwnsWorker, SerialWorker
from .errors import InputError, TooLongError
from .generator import Candidate, decoding_device_dtype
from .hub import model_folder
from .models.seq2seq import Seq2SeqRunner
from .seq2seq_checkpoint import load_seq2seq_weights
from .seq2seq_text import load_text

DEFAULT_MAX_LENGTH = 20  # HF GenerationConfig's max_length where the checkpoint names none
DEFAULT_TOP_K = 50       # and its top_k
CPU_DEFAULT_BATCH = 16
GPU_DEFAULT_BATCH = 128
STREAM_WINDOW = 1024     # sources read ahead by translate_stream, sorted by length into batches
# the options a call takes, as HF generate names them
OPTIONS = ("max_new_tokens", "min_new_tokens", "num_beams", "num_return_sequences", "length_penalty",
           "early_stopping", "no_repeat_ngram_size", "repetition_penalty", "do_sample", "temperature", "top_k",
           "top_p", "seed")


@dataclass
class TranslationResult:
    source: str
    text: str
    token_ids: list          # generated ids after the decoder start token, the eos that ended it included
    score: float | None
    candidates: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"source": self.source, "text": self.text, "token_ids": self.token_ids, "score": self.score,
                "candidates": [vars(c) for c in self.candidates]}


class Translator(OwnsWorker):
    """Source texts -> translations. Safe to call from any number of threads: calls run one at a
    time on the Translator's own worker thread, which owns the model's device state."""

    def __init__(self, path: Path, *, device: str = "auto", dtype: str | None = None, cuda_graphs: bool = True):
        path = model_folder(path)
        config = load_seq2seq_config(path)
        if dtype is None and config.rms_norm and resolve_device(device) == "cuda":
            dtype = "bf16"  # T5's activations overflow fp16's range (HF clamps them; bf16 needs no clamp)
        device, dtype = decoding_device_dtype(device, dtype)
        self.path, self.device, self.dtype, self.cuda_graphs = path, device, dtype, cuda_graphs
        self.ops = get_ops(device)
        self.config = config
        self.weights = load_seq2seq_weights(path, self.config)
        self.text = load_text(path, self.config.model_type)
        self._runner = None
        self._worker = SerialWorker("ftengine-translator")

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", dtype: str | None = None, *,
                        cuda_graphs: bool = True) -> "Translator":
        """Load an encoder-decoder checkpoint folder (config.json, *.safetensors, the tokenizer's
        files; generation_config.json's fields are each call's defaults)."""
        return cls(Path(path), device=device, dtype=dtype, cuda_graphs=cuda_graphs)

    # ------------------------------------------------------------------ options

    def params(self, tgt_lang: str | None = None, **options) -> tuple[GenerationParams, dict]:
        """(GenerationParams, the decoder's constraints) of a call: generation_config.json's fields,
        overridden by the target language's (its start or forced first token) and by `options`
        (OPTIONS, as HF generate names them). The constraints: decoder_start, banned (tokens),
        forced_bos and forced_eos (a token or None)."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InputError(f"unknown generation option(s): {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
        g = dict(self.config.generation)
        g.update(self.text.target(tgt_lang))
        for name, value in options.items():
            if value is not None:
                g[name] = value
        if "max_new_tokens" not in g:
            g["max_new_tokens"] = g.get("max_length", DEFAULT_MAX_LENGTH) - 1  # the start token counts in max_length
        if "min_new_tokens" not in g and g.get("min_length"):
            g["min_new_tokens"] = max(0, g["min_length"] - 1)
        banned = []
        for words in g.get("bad_words_ids") or ():
            if len(words) != 1:
                raise InputError(f"bad_words_ids {words}: only single-token bans are supported")
            banned.append(words[0])
        sampling = bool(g.get("do_sample", False))
        params = GenerationParams(
            max_new_tokens=g["max_new_tokens"], min_new_tokens=g.get("min_new_tokens", 0), do_sample=sampling,
            temperature=g.get("temperature", 1.0) if sampling else 1.0,
            top_k=g.get("top_k", DEFAULT_TOP_K) if sampling else 0, top_p=g.get("top_p", 1.0) if sampling else 1.0,
            repetition_penalty=g.get("repetition_penalty", 1.0), seed=g.get("seed"),
            eos_token_ids=(self.config.eos_token_id,), no_repeat_ngram_size=g.get("no_repeat_ngram_size", 0),
            num_beams=g.get("num_beams", 1), length_penalty=g.get("length_penalty", 1.0),
            early_stopping=g.get("early_stopping", False), num_return_sequences=g.get("num_return_sequences", 1),
            renormalize_logits=g.get("renormalize_logits", False),
        ).checked(vocab_size=self.config.vocab_size)
        constraints = {"decoder_start": g.get("decoder_start_token_id", self.config.decoder_start_token_id),
                       "banned": tuple(banned), "forced_bos": g.get("forced_bos_token_id"),
                       "forced_eos": g.get("forced_eos_token_id")}
        for name, tokens in (("bad_words_ids", banned), ("forced_bos_token_id", [constraints["forced_bos"]]),
                             ("forced_eos_token_id", [constraints["forced_eos"]])):
            for token in tokens:
                if token is not None and not (isinstance(token, int) and 0 <= token < self.config.vocab_size):
                    raise InputError(f"{name}: token {token!r} is outside the vocabulary")
        return params, constraints

    # ------------------------------------------------------------------ translation

    def check_languages(self, src_lang: str | None, tgt_lang: str | None, names=("src_lang", "tgt_lang")):
        """Refuse languages the model lacks, and no target language where the model translates into
        several and its generation_config.json names none; names: how the caller calls the two."""
        self.text.check_languages(src_lang, tgt_lang, names)
        codes = self.text.target_codes
        g = {"decoder_start_token_id": self.config.decoder_start_token_id, **self.config.generation,
             **self.text.target(tgt_lang)}
        if codes and g.get("forced_bos_token_id") not in codes and g["decoder_start_token_id"] not in codes:
            raise InputError(f"{names[1]}: this model translates into several languages; name one of "
                             f"{', '.join(sorted(self.text.codes))}")

    def encode_sources(self, texts: list, *, src_lang: str | None = None, tgt_lang: str | None = None,
                       truncate: bool = True) -> list:
        """Each text's token ids with the language codes its family places, cut to the model's
        longest source in the text's part (the special tokens kept) or refused with truncate=False."""
        self.text.check_languages(src_lang, tgt_lang)
        limit = self.config.max_positions
        out = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"source {i + 1} is a {type(text).__name__}, not a str")
            prefix, body, suffix = self.text.source_parts(text, src_lang, tgt_lang)
            size = len(prefix) + len(body) + len(suffix)
            if size > limit:
                if not truncate:
                    raise _too_long(i, size, limit)
                body = body[:max(0, limit - len(prefix) - len(suffix))]
            out.append(prefix + body + suffix)
        return out

    def translate(self, texts, *, src_lang: str | None = None, tgt_lang: str | None = None,
                  max_batch: int | None = None, max_batch_tokens: int | None = None, truncate: bool = True,
                  **options) -> list:
        """One TranslationResult per source text, in input order. src_lang / tgt_lang: language
        codes as the model's tokenizer spells them (NLLB's eng_Latn, mBART's en_XX, a Marian
        model's >>fra<< as fra). options: OPTIONS (HF generate's names; default: the checkpoint's
        generation_config.json). Sources run sorted by length, in batches of at most max_batch
        decoder rows (sources x num_beams) and, with max_batch_tokens, of at most that many source
        tokens x num_beams (CTranslate2's batch_type="tokens"; a longer source runs alone)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        self.check_languages(src_lang, tgt_lang)
        params, constraints = self.params(tgt_lang, **options)
        sources = self.encode_sources(texts, src_lang=src_lang, tgt_lang=tgt_lang, truncate=truncate)
        if not sources:
            return []
        rows = self._max_rows(max_batch, params)
        if max_batch_tokens is not None and (isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int)
                                             or max_batch_tokens < 1):
            raise InputError(f"max_batch_tokens must be an integer >= 1, found {max_batch_tokens!r}")
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        found = {}
        for chunk in _batches(order, [len(s) * params.num_beams for s in sources], max(1, rows // params.num_beams),
                              max_batch_tokens):
            hypotheses = self._worker.call(self._search, [sources[i] for i in chunk], params, constraints)
            found.update(zip(chunk, hypotheses))
        results = []
        for i, text in enumerate(texts):
            cands = [Candidate(self.text.decode(t), t, s) for t, s in found[i]]
            results.append(TranslationResult(text, cands[0].text, cands[0].token_ids, cands[0].score, cands))
        return results

    def translate_stream(self, texts, **options):
        """Translations of an iterable of texts, yielded in input order as windows of
        STREAM_WINDOW sources finish: memory is bounded by the window, not by the input."""
        iterator, done = iter(texts), 0
        while window := list(islice(iterator, STREAM_WINDOW)):
            try:
                yield from self.translate(window, **options)
            except TooLongError as e:  # numbered in the whole stream, not in its window
                raise _too_long(done + e.index, e.length, e.max_length) from None
            done += len(window)

    summarize = translate  # a BART / T5 summariser's call is the same

    def _max_rows(self, max_batch, params) -> int:
        if max_batch is None:
            return max(params.num_beams, CPU_DEFAULT_BATCH if self.device == "cpu" else GPU_DEFAULT_BATCH)
        return check_max_batch(max_batch, params)

    def _runner_for(self, rows: int, longest: int, params) -> Seq2SeqRunner:
        """A runner for `rows` decoder rows, sources of `longest` tokens and the call's new tokens
        (rounded up to 64 positions), reused while it is large enough."""
        c = self.config
        need = 1 + params.max_new_tokens  # the start token, then the new ones
        if need > c.max_positions:
            raise InputError(f"max_new_tokens {params.max_new_tokens} is beyond the model's "
                             f"max_position_embeddings {c.max_positions} (less the start token)")
        length = min(c.max_positions, -(-need // 64) * 64)
        source = min(c.max_positions, -(-longest // 64) * 64)
        r = self._runner
        if r is None or r.max_batch < rows or r.max_len < need or r.max_source < longest:
            self._runner = r = Seq2SeqRunner(c, self.weights, self.ops, dtype=self.dtype, max_batch=rows,
                                             max_len=length, max_source=source, graphs=self.cuda_graphs)
        return r

    def _search(self, sources: list, params, constraints: dict) -> list:
        """Hypotheses [(new token ids, score)] per source; runs on the worker thread."""
        nb = params.num_beams
        runner = self._runner_for(len(sources) * nb, max(len(s) for s in sources), params)
        runner.set_constraints(banned=constraints["banned"], forced_bos=constraints["forced_bos"],
                               forced_eos=constraints["forced_eos"])
        prompts = [[constraints["decoder_start"]] for _ in sources]
        runner.encode(sources, copies=nb)
        return hypotheses(runner, prompts, params)


def _too_long(index: int, length: int, limit: int) -> TooLongError:
    return TooLongError(f"source {index + 1} has {length} tokens, more than the model's {limit}", index=index,
                        max_length=limit, length=length)


def _batches(order: list, tokens: list, per_batch: int, max_tokens: int | None) -> list:
    """`order` cut into runs of at most per_batch items and, where max_tokens is given, at most
    that many tokens (tokens[i] each; an item over the budget alone)."""
    batches, current, total = [], [], 0
    for i in order:
        if current and (len(current) == per_batch or (max_tokens is not None and total + tokens[i] > max_tokens)):
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += tokens[i]
    return batches + [current] if current else batches
