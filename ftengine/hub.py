"""Model locations: a local folder, or a HuggingFace Hub id (`org/name`, optionally `@revision`)
resolved through `huggingface_hub` into its cache (the `hub` extra), downloading only the files
ftengine reads. HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply as they do for every HF library. A
local folder of that name wins."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ConfigError

# the files a model folder may need: config, weights, tokenizer, sentence-transformers modules,
# generation defaults; never pytorch_model.bin, ONNX or other formats' copies
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
               "merges.txt", "*.spm", "sentencepiece.bpe.model", "modules.json", "sentence_bert_config.json",
               "config_sentence_transformers.json", "*/config.json", "*/model.safetensors"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def model_folder(location) -> Path:
    """The local folder of a model: `location` itself where it is a folder, else a Hub id's
    snapshot in the cache (downloaded where missing and the Hub is reachable)."""
    path = Path(location)
    if path.is_dir():
        return path
    text = str(location)
    if not _HUB_ID.match(text):
        raise ConfigError(f"model folder not found: {text}")
    repo, _, revision = text.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:
        raise ConfigError(f"model folder not found: {text} (to load it as a Hub id: pip install "
                          "'ftengine[hub]')") from None
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=MODEL_FILES))
    except GatedRepoError:
        raise ConfigError(f"{text}: a gated model on the Hub: accept its terms there and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{text}: no such local folder, and no such model on the Hub (or it is private: set "
                          "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{text}: the Hub has no revision {revision!r} of {repo}") from None
    except LocalEntryNotFoundError:
        raise ConfigError(f"{text}: not in the HuggingFace cache, and the Hub cannot be reached (HF_HUB_OFFLINE, or "
                          "no network)") from None
    except OSError as e:
        raise ConfigError(f"{text}: cannot fetch it from the Hub: {e}") from None
