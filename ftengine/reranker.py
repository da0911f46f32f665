"""Reranker: cross-encoder relevance scores for (query, document) pairs, sentence-transformers'
CrossEncoder on ftengine's encoder (BERT, RoBERTa / XLM-R, DistilBERT ...ForSequenceClassification)."""

from __future__ import annotations

import numpy as np

from .classifier import SequenceHead
from .config import head_architecture, read_json
from .encoder import _as_list
from .errors import ConfigError, InputError
from .hub import model_folder

# CrossEncoder's activation_fn (config.json "sentence_transformers") -> what predict applies
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}


class Reranker(SequenceHead):
    """Scores for text pairs. Thread-safe like Encoder (calls share one engine); close it, or
    use it as a context manager, to stop the engine's threads."""

    def __init__(self, path, **options):
        super().__init__(path, **options)
        least = self._encoder.tokenizer.special_tokens(pair=True) + 2  # a token of each text, at least
        if self.max_length < least:
            self._encoder.close()
            raise InputError(f"max_length {self.max_length} is too short for a pair: this model's pair format adds "
                             f"{least - 2} special tokens, so at least {least} leave one token of each text")
        self.activation = _activation(self._encoder.config_path, self.num_labels)

    def predict(self, pairs, *, batch_tokens: int | None = None, activation: bool = True) -> np.ndarray:
        """Scores of (text, text) pairs, in input order: (N,) with one label, else (N, num_labels).
        activation=False gives the raw logits (no sigmoid)."""
        return self.scores(pairs, batch_tokens=batch_tokens, activation=activation)[0]

    def scores(self, pairs, *, batch_tokens: int | None = None, activation: bool = True,
               truncate: bool = True) -> tuple[np.ndarray, int]:
        """(predict's scores, the tokens the pairs took). truncate=False refuses a pair longer than
        max_length (TooLongError, its index the pair's 0-based place) instead of cutting it
        longest-first."""
        future = self.submit_scores(pairs, batch_tokens=batch_tokens, truncate=truncate)
        return self.finish_scores(future, activation=activation), self.head_tokens(future)

    def submit_scores(self, pairs, *, batch_tokens: int | None = None, truncate: bool = True, requests: int = 1):
        """scores' work without waiting: the engine's future, or None for no pairs.
        finish_scores(future) gives the scores once it is done (head_tokens the tokens); a service
        awaits the future and cancels it when its client goes away. requests: how many callers'
        requests the pairs join (EncodeEngine.submit)."""
        pairs = _as_list(pairs)
        return self._submit(pairs, pairs=True, batch_tokens=batch_tokens, truncate=truncate,
                            requests=requests) if pairs else None

    def finish_scores(self, future, *, activation: bool = True) -> np.ndarray:
        """The scores of a submit_scores future (waiting for it if need be)."""
        if future is None:
            return np.zeros((0,) if self.num_labels == 1 else (0, self.num_labels), np.float32)
        logits = self.head_logits(future.result())
        scores = 1.0 / (1.0 + np.exp(-logits)) if activation and self.activation == "sigmoid" else logits
        return (scores[:, 0] if self.num_labels == 1 else scores).astype(np.float32)

    def rank(self, query: str, documents, *, top_k: int | None = None, return_documents: bool = False,
             batch_tokens: int | None = None) -> list[dict]:
        """The documents by score for `query`, best first: [{"corpus_id", "score"(, "text")}], as
        CrossEncoder.rank gives them; top_k keeps the first k."""
        if not isinstance(query, str):
            raise InputError(f"query must be a string, found {type(query).__name__}")
        documents = _as_list(documents)
        if self.num_labels != 1:
            raise InputError(f"rank needs a model with one score per pair; this one has {self.num_labels} labels")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise InputError(f"top_k must be an integer >= 1, found {top_k!r}")
        scores = self.predict([(query, d) for d in documents], batch_tokens=batch_tokens)
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [{"corpus_id": int(i), "score": float(scores[i]), **({"text": documents[i]} if return_documents else {})}
                for i in order]


def model_task(path) -> str:
    """What a model folder serves: "rerank" for a ...ForSequenceClassification checkpoint of one
    label (a cross-encoder), "classify" for one of more labels, "ner" for a
    ...ForTokenClassification one, else "embed"."""
    config = read_json(model_folder(path) / "config.json", "model config") if path is not None else {}
    if head_architecture(config, "token"):
        return "ner"
    if not head_architecture(config, "sequence"):
        return "embed"
    labels = config.get("id2label") or {}
    return "rerank" if config.get("num_labels", len(labels) or 1) == 1 and len(labels) <= 1 else "classify"


def _activation(config_path, num_labels: int) -> str:
    """CrossEncoder's choice: config.json's sentence_transformers.activation_fn, else sigmoid for
    one label and identity for more."""
    config = read_json(config_path, "model config")
    name = (config.get("sentence_transformers") or {}).get("activation_fn") or \
        config.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid" if num_labels == 1 else "identity"
    if name not in ACTIVATIONS:
        raise ConfigError(f"{config_path}: activation_fn {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
