"""TokenClassifier: token classification (NER, PII detection) with ...ForTokenClassification
checkpoints of the BERT, RoBERTa / XLM-R / CamemBERT, DistilBERT and MPNet families, as HF's
token-classification pipeline gives it: each token's softmax over the labels, then the
pipeline's aggregation ("none", "simple", "first", "average", "max") into entities with their
words and character offsets.

The encoder runs on either backend, and the per-token head (labels x hidden) with it, after the
last layer (in the pass's CUDA graph on the GPU): only each token's label logits come back, and the
softmax over those few labels runs on the host."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from .backends import get_ops, resolve_device
from .checkpoint import SafetensorsFiles, load_bert_weights
from .config import check_head_architecture, load_bert_config, read_json
from .encoder import DTYPES, _as_list
from .engine import OwnsWorker, SerialWorker
from .errors import CheckpointError, ConfigError, DeviceError, InputError
from .hub import model_folder
from .models.bert import PACKED_HEAD_DIMS, Batch, BertRunner
from .tokenizer import Tokenizer

STRATEGIES = ("none", "simple", "first", "average", "max")
BATCH_TOKENS = 8192  # tokens a forward pass takes at most


class _Request:
    """A submitted call: its texts, their encodings' windows, how to aggregate, its future."""

    def __init__(self, texts: list, windows: list, strategy: str, ignore: set):
        self.texts, self.windows, self.strategy, self.ignore = texts, windows, strategy, ignore
        self.future = Future()


class TokenClassifier(OwnsWorker):
    """Texts -> entities. Safe to call from any number of threads: the model runs on the
    TokenClassifier's own worker thread, which owns its device state; calls waiting together
    share its batches."""

    def __init__(self, path, *, device: str = "auto", dtype: str | None = None, max_length: int | None = None):
        path = model_folder(path)
        self.path, self.device = path, resolve_device(device)
        self.dtype = dtype or ("fp16" if self.device == "cuda" else "fp32")
        if self.dtype not in DTYPES:
            raise DeviceError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device == "cpu" and self.dtype != "fp32":
            raise DeviceError(f"dtype {self.dtype} needs the CUDA backend; the CPU (NumPy) backend computes in fp32")
        self.config = load_bert_config(path)
        if self.config.family == "modernbert":
            raise ConfigError(f"{path}: ModernBERT token classification is not supported yet")
        raw = read_json(path / "config.json", "model config")
        check_head_architecture(path, raw, "token")
        self.weights = load_bert_weights(path, self.config)
        self.head_weight, self.head_bias = _token_head(path, self.config.hidden_size)
        names = raw.get("id2label") or {}
        self.labels = [str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(len(self.head_bias))]
        limit = self.config.max_position_embeddings
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or not 2 <= max_length <= limit):
            raise InputError(f"max_length {max_length!r} must be within 2..{limit} (the model's "
                             "max_position_embeddings)")
        self.max_length = min(max_length or _tokenizer_limit(path) or limit, limit)
        self.tokenizer = Tokenizer(path, max_length=self.max_length)
        self._word_aware, self._unk_id = self.tokenizer.marks_subwords, self.tokenizer.unk_id
        self.ops = get_ops(self.device)
        self._runner = None
        self._worker = SerialWorker("ftengine-tokens")
        self._waiting, self._waiting_lock = [], threading.Lock()  # submitted requests the worker has not taken

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", dtype: str | None = None, *,
                        max_length: int | None = None) -> "TokenClassifier":
        """Load a ...ForTokenClassification folder (config.json with id2label, model.safetensors,
        tokenizer.json)."""
        return cls(path, device=device, dtype=dtype, max_length=max_length)

    def predict(self, texts, *, aggregation_strategy: str = "none", stride: int | None = None,
                ignore_labels=("O",)) -> list:
        """Per text, the token-classification pipeline's entities: with "none" one dict per token
        {"entity", "score", "index", "word", "start", "end"}; otherwise grouped {"entity_group",
        "score", "word", "start", "end"}. Texts longer than max_length are cut, as the pipeline
        cuts them; with a stride, split into windows of max_length tokens overlapping by `stride`,
        each window's entities found, and overlapping ones resolved as the pipeline does (the
        longer, then the higher score)."""
        return self.entities(texts, aggregation_strategy=aggregation_strategy, stride=stride,
                             ignore_labels=ignore_labels)[0]

    def entities(self, texts, *, aggregation_strategy: str = "none", stride: int | None = None,
                 ignore_labels=("O",)) -> tuple:
        """(predict's entities, the tokens the texts took)."""
        return self.submit(texts, aggregation_strategy=aggregation_strategy, stride=stride,
                           ignore_labels=ignore_labels).result()

    def submit(self, texts, *, aggregation_strategy: str = "none", stride: int | None = None,
               ignore_labels=("O",)) -> Future:
        """entities() without waiting: the texts are tokenised here (a bad argument raises here),
        then queued for the worker; the future's result is (entities, tokens). Requests waiting
        together run in the same forward passes; a request cancelled before the worker takes it
        is dropped."""
        if aggregation_strategy not in STRATEGIES:
            raise InputError(f"aggregation_strategy {aggregation_strategy!r} is not one of {', '.join(STRATEGIES)}")
        if stride is not None:
            if isinstance(stride, bool) or not isinstance(stride, int) or not 0 <= stride < self.max_length:
                raise InputError(f"stride must be an integer within 0..{self.max_length - 1}, found {stride!r}")
            if aggregation_strategy == "none":
                raise InputError("stride needs an aggregation_strategy other than none (the pipeline's rule: "
                                 "windows' tokens are only merged as entities)")
        texts = _as_list(texts)
        encodings = self.tokenizer.encodings(texts, stride=stride or 0) if texts else []
        windows = [[enc] + (list(enc.overflowing) if stride is not None else []) for enc in encodings]
        request = _Request(texts, windows, aggregation_strategy, set(ignore_labels))
        with self._waiting_lock:
            self._waiting.append(request)
        self._worker.submit(self._run_waiting)
        return request.future

    def _run_waiting(self):
        """The requests waiting (none if an earlier run took them), in shared forward passes, then
        each one's entities; runs on the worker thread."""
        with self._waiting_lock:
            taken, self._waiting = self._waiting, []
        live = [r for r in taken if r.future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            every = self._scores([w for r in live for text_windows in r.windows for w in text_windows])
        except BaseException as e:  # the model failed: every request of the pass learns why
            for r in live:
                r.future.set_exception(e)
            return
        at = 0
        for r in live:
            count = sum(map(len, r.windows))
            scores, at = iter(every[at:at + count]), at + count
            try:
                found = []
                for text, text_windows in zip(r.texts, r.windows):
                    per_window = [self._entities(text, w, next(scores), r.strategy, r.ignore) for w in text_windows]
                    found.append(per_window[0] if len(per_window) == 1 else _overlaps_resolved(sum(per_window, [])))
                r.future.set_result((found, sum(len(w.ids) for text_windows in r.windows for w in text_windows)))
            except Exception as e:
                r.future.set_exception(e)

    # ------------------------------------------------------------------ the model

    def _scores(self, encodings: list) -> list:
        """Each encoding's (tokens, labels) softmax scores; runs on the worker thread."""
        if self._runner is None:
            layout = "packed" if self.config.head_dim in PACKED_HEAD_DIMS else "padded"
            self._runner = BertRunner(self.config, self.weights, self.ops, dtype=self.dtype,
                                      max_batch_tokens=max(BATCH_TOKENS, self.max_length), max_seq_len=self.max_length,
                                      layout=layout, token_head=(self.head_weight, self.head_bias))
        out, batch, batch_tokens = [], [], 0
        for enc in encodings + [None]:
            length = 0 if enc is None else len(enc.ids)
            if enc is not None and (not batch or batch_tokens + length <= BATCH_TOKENS):
                batch.append(enc)
                batch_tokens += length
                continue
            if batch:
                types = [e.type_ids if self.config.type_vocab_size > 1 else [0] * len(e.ids) for e in batch]
                for logits in self._runner.token_logits(Batch.from_lists([e.ids for e in batch], types)):
                    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
                    out.append(shifted / shifted.sum(axis=-1, keepdims=True))
            batch, batch_tokens = [enc], length
        return out

    # ------------------------------------------------------------------ the pipeline's aggregation

    def _entities(self, text: str, enc, scores: np.ndarray, strategy: str, ignore: set) -> list:
        tokens, words = [], enc.tokens  # an Encoding's properties build a new list at each read
        top = scores.max(axis=1).tolist()
        for idx, (token_id, (start, end), special) in enumerate(zip(enc.ids, enc.offsets, enc.special_tokens_mask)):
            if special:
                continue
            word, ref = words[idx], text[start:end]
            if self._word_aware:
                subword = len(word) != len(ref)
            else:
                subword = start > 0 and " " not in text[start - 1:start + 1]
            if token_id == self._unk_id:
                word, subword = ref, False
            tokens.append({"word": word, "scores": scores[idx], "top": top[idx], "start": start, "end": end,
                           "index": idx, "is_subword": subword})
        if strategy in ("none", "simple"):
            labels, best = self.labels, scores.argmax(axis=1).tolist()
            entities = [{"entity": labels[best[t["index"]]], "score": t["top"], "index": t["index"],
                         "word": t["word"], "start": t["start"], "end": t["end"]} for t in tokens]
        else:
            entities = [self._word(group, strategy) for group in _words(tokens)]
        if strategy != "none":  # a group the filter below would drop is not built (most are "O")
            entities = [self._group(g) for g in _groups(entities) if _group_label(g) not in ignore]
        return [e for e in entities if e.get("entity") not in ignore and e.get("entity_group") not in ignore]

    def _word(self, tokens: list, strategy: str) -> dict:
        if strategy == "first":
            scores = tokens[0]["scores"]
        elif strategy == "max":
            scores = max(tokens, key=lambda t: t["top"])["scores"]
        elif len(tokens) == 1:  # the mean of one row is the row
            scores = tokens[0]["scores"]
        else:
            scores = np.nanmean(np.stack([t["scores"] for t in tokens]), axis=0)
        best = int(scores.argmax())
        return {"entity": self.labels[best], "score": float(scores[best]), "word": self._join(tokens),
                "start": tokens[0]["start"], "end": tokens[-1]["end"]}

    def _group(self, entities: list) -> dict:
        return {"entity_group": _group_label(entities),
                "score": _nanmean([e["score"] for e in entities]), "word": self._join(entities),
                "start": entities[0]["start"], "end": entities[-1]["end"]}

    def _join(self, pieces: list) -> str:
        return self.tokenizer.join_tokens([p["word"] for p in pieces])


def _group_label(entities: list) -> str:
    """A group's entity_group, as the pipeline names it: its first label past the first "-"."""
    return entities[0]["entity"].split("-", 1)[-1]


def _nanmean(values: list) -> float:
    """np.nanmean of a few floats, as the pipeline takes a group's score, without its per-call
    cost (most of a request's aggregation time): the mean of those that are not NaN."""
    kept = [v for v in values if v == v]
    return sum(kept) / len(kept) if kept else float("nan")


def _overlaps_resolved(entities: list) -> list:
    """Entities of overlapping windows, by start: of two that overlap the longer stays, or at equal
    lengths the higher score (the pipeline's aggregate_overlapping_entities, step for step)."""
    if not entities:
        return entities
    entities = sorted(entities, key=lambda e: e["start"])
    kept, previous = [], entities[0]
    for entity in entities:
        if previous["start"] <= entity["start"] < previous["end"]:
            length, previous_length = entity["end"] - entity["start"], previous["end"] - previous["start"]
            if length > previous_length or length == previous_length and entity["score"] > previous["score"]:
                previous = entity
        else:
            kept.append(previous)
            previous = entity
    kept.append(previous)
    return kept


def _words(tokens: list) -> list:
    """Tokens grouped into words: a token that is not a subword starts one."""
    groups = []
    for token in tokens:
        if groups and token["is_subword"]:
            groups[-1].append(token)
        else:
            groups.append([token])
    return groups


def _tag(label: str) -> tuple:
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _groups(entities: list) -> list:
    """Adjacent entities of one tag, a B- label starting a new group."""
    groups = []
    for entity in entities:
        bi, tag = _tag(entity["entity"])
        if groups and tag == _tag(groups[-1][-1]["entity"])[1] and bi != "B":
            groups[-1].append(entity)
        else:
            groups.append([entity])
    return groups


def _token_head(path: Path, hidden: int) -> tuple:
    """classifier.weight (labels, hidden) and classifier.bias, float32."""
    files = SafetensorsFiles(path)
    stored = set(files.names())
    if "classifier.weight" not in stored or "classifier.bias" not in stored:
        raise CheckpointError(f"{path}: classifier.weight / classifier.bias are missing: not a token-classification "
                              "checkpoint")
    weight, bias = files.float32("classifier.weight"), files.float32("classifier.bias")
    if weight.ndim != 2 or weight.shape[1] != hidden or bias.shape != (weight.shape[0],):
        raise CheckpointError(f"{path}: classifier.weight is {list(weight.shape)} and classifier.bias "
                              f"{list(bias.shape)}; expected [labels, {hidden}] and [labels]")
    return weight, bias


def _tokenizer_limit(path: Path) -> int | None:
    """tokenizer_config.json's model_max_length where it is a real limit (HF truncates there)."""
    settings = path / "tokenizer_config.json"
    if not settings.is_file():
        return None
    value = json.loads(settings.read_text(encoding="utf-8")).get("model_max_length")
    return value if isinstance(value, int) and 0 < value < 1_000_000 else None
