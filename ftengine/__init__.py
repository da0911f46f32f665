"""ftengine: a standalone transformer inference engine (BERT-family encoders, GPT-2 generation).

Public API:
    Encoder.from_pretrained(path=None, device="auto", dtype=None)
    Encoder.encode(texts, *, batch_tokens=None, pooling=None, normalize=None) -> np.ndarray
    Encoder.encode_stream(iterable, ...) -> iterator of np.ndarray chunks, in input order
    await Encoder.encode_async(texts, ...); Encoder.submit(texts, ...) -> Future
    Reranker.from_pretrained(path, device="auto", dtype=None)
    Reranker.predict(pairs) -> np.ndarray; Reranker.rank(query, documents, top_k=None) -> list[dict]
    Classifier.from_pretrained(path, ...).predict(texts or pairs, top_k=1) -> [{"label", "score"}]
    TokenClassifier.from_pretrained(path, ...).predict(texts, aggregation_strategy="none") -> [[entity, ...]]
    Generator.from_pretrained(path, device="auto", dtype=None)
    Generator.generate(prompts, *, max_new_tokens, ...) -> list[GenerationResult]
    Translator.from_pretrained(path, device="auto", dtype=None)
    Translator.translate(texts, *, src_lang=None, tgt_lang=None, num_beams=..., ...) -> list[TranslationResult]
"""

from .classifier import Classifier
from .encoder import EncodeStats, Encoder
from .generator import GenerationResult, Generator
from .reranker import Reranker
from .token_classifier import TokenClassifier
from .translator import TranslationResult, Translator
from .errors import CheckpointError, ConfigError, DeviceError, FtengineError, InputError, OutputError

__all__ = [
    "Encoder",
    "EncodeStats",
    "Reranker",
    "Classifier",
    "TokenClassifier",
    "Generator",
    "GenerationResult",
    "Translator",
    "TranslationResult",
    "FtengineError",
    "ConfigError",
    "CheckpointError",
    "InputError",
    "DeviceError",
    "OutputError",
]
__version__ = "0.1.0"
