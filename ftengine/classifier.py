"""Classifier: sequence classification (sentiment, NLI, moderation) with ...ForSequenceClassification
checkpoints, as HF's text-classification pipeline gives it: a softmax over the labels for a
single-label model, a sigmoid for a multi-label one or one logit, labels from config.json's
id2label. The reranker's encoder and head tables read the checkpoints (BERT, RoBERTa / XLM-R /
CamemBERT, DistilBERT, MPNet, ModernBERT); SequenceHead holds what the Reranker shares."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from .config import check_head_architecture, read_json
from .hub import model_folder
from .encoder import Encoder, _as_list
from .errors import InputError


class SequenceHead:
    """An encoder with a ...ForSequenceClassification head, what Classifier and Reranker share:
    loading, the head's logits, closing."""

    def __init__(self, path, *, device: str = "auto", dtype: str | None = None, max_length: int | None = None,
                 cuda_graphs: bool = True, layout: str = "auto", tokenizer: str = "auto"):
        path = model_folder(path)
        check_head_architecture(path, read_json(path / "config.json", "model config"), "sequence")
        self._encoder = Encoder(path, device=device, dtype=dtype, max_length=max_length, cuda_graphs=cuda_graphs,
                                layout=layout, classifier=True, tokenizer=tokenizer)
        self.path, self.device, self.dtype = self._encoder.path, self._encoder.device, self._encoder.dtype
        self.max_length = self._encoder.max_length
        self.num_labels = self._encoder.dim

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", dtype: str | None = None, *, max_length: int | None = None,
                        cuda_graphs: bool = True, layout: str = "auto", tokenizer: str = "auto"):
        """Load a ...ForSequenceClassification folder (config.json, model.safetensors, tokenizer.json).
        tokenizer: as Encoder.from_pretrained's (pairs too)."""
        return cls(path, device=device, dtype=dtype, max_length=max_length, cuda_graphs=cuda_graphs, layout=layout,
                   tokenizer=tokenizer)

    def _submit(self, inputs: list, *, pairs: bool, batch_tokens, truncate: bool, requests: int = 1) -> Future:
        """The engine's future of an EncodeResult whose embeddings are the head's logits, of texts
        or (text, text) pairs; truncate=False fails it with TooLongError for an input longer than
        max_length instead of cutting it. Cancelling the future drops work not yet run."""
        return self._encoder.submit_inputs(inputs, pairs=pairs, batch_tokens=batch_tokens, truncate=truncate,
                                           requests=requests)

    @staticmethod
    def head_logits(result) -> np.ndarray:
        """(N, labels) float32 logits of a finished _submit future's EncodeResult."""
        return result.embeddings.astype(np.float32)

    @staticmethod
    def head_tokens(future) -> int:
        """The tokens a _submit future's inputs took (waiting for it if need be); 0 for None."""
        return 0 if future is None else future.result().tokens

    def close(self, *, cancel: bool = False):
        self._encoder.close(cancel=cancel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Classifier(SequenceHead):
    """Texts (or text pairs) -> labels with scores. Thread-safe like Encoder (calls share one
    engine); close it, or use it as a context manager, to stop the engine's threads."""

    def __init__(self, path, **options):
        super().__init__(path, **options)
        config = read_json(self._encoder.config_path, "model config")
        names = config.get("id2label") or {}
        self.labels = [str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(self.num_labels)]
        self._label_array = np.array(self.labels, dtype=object)  # labels picked by an index array
        problem = config.get("problem_type")
        self.function = ("sigmoid" if problem == "multi_label_classification" or self.num_labels == 1 else
                         "none" if problem == "regression" else "softmax")

    def logits(self, inputs, *, batch_tokens: int | None = None, truncate: bool = True) -> tuple[np.ndarray, int]:
        """((N, num_labels) float32 logits, the tokens the inputs took) of texts, or of (text, text)
        pairs (tokenised as the model's tokenizer pairs them). truncate=False refuses an input
        longer than max_length (TooLongError) instead of cutting it."""
        future = self.submit_logits(inputs, batch_tokens=batch_tokens, truncate=truncate)
        return (np.zeros((0, self.num_labels), np.float32) if future is None else
                self.head_logits(future.result())), self.head_tokens(future)

    def submit_logits(self, inputs, *, batch_tokens: int | None = None, truncate: bool = True, requests: int = 1):
        """logits' work without waiting: the engine's future, or None for no inputs.
        head_logits(future.result()) gives the logits (head_tokens the tokens); a service awaits
        the future and cancels it when its client goes away. requests: how many callers'
        requests the inputs join (EncodeEngine.submit)."""
        inputs = _as_list(inputs)
        if not inputs:
            return None
        pairs = all(isinstance(x, (tuple, list)) for x in inputs)
        return self._submit(inputs, pairs=pairs, batch_tokens=batch_tokens, truncate=truncate, requests=requests)

    def scores(self, logits: np.ndarray) -> np.ndarray:
        """The pipeline's function_to_apply on logits (N, num_labels)."""
        if self.function == "sigmoid":
            return 1.0 / (1.0 + np.exp(-logits))
        if self.function == "softmax":
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            return shifted / shifted.sum(axis=1, keepdims=True)
        return logits

    def predict(self, inputs, *, top_k: int | None = 1, batch_tokens: int | None = None) -> list:
        """Per input, as the text-classification pipeline returns them: with top_k=1 its best
        {"label", "score"}; with another top_k (None: every label) a list of them, best first."""
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise InputError(f"top_k must be an integer >= 1 or None, found {top_k!r}")
        logits, _ = self.logits(inputs, batch_tokens=batch_tokens)
        return self.ranked(self.scores(logits), top_k)

    def ranked(self, scores: np.ndarray, top_k: int | None) -> list:
        """Per row of scores (N, num_labels), its labels best first as predict gives them: one
        argsort, one gather and one list of items for all the rows (a service's reply to each
        request)."""
        order = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
        picked = (order + np.arange(0, scores.size, scores.shape[1])[:, None]).ravel()
        items = [{"label": label, "score": value} for label, value in
                 zip(self._label_array[order.ravel()].tolist(), scores.ravel()[picked].tolist())]
        k = order.shape[1]
        return items if top_k == 1 else [items[i:i + k] for i in range(0, len(items), k)]
