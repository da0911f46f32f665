"""Small random checkpoints in HuggingFace format: config.json, model.safetensors, tokenizer.json.

Weights are drawn from a seeded normal distribution, never zeros, scaled so that every
sub-layer contributes visibly (errors in any op show up in the outputs).
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with",
         "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word",
         "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up",
         "hello", "world", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "text", "line"]


def fixture_vocab() -> list[str]:
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    return SPECIAL + WORDS + chars + ["##" + c for c in string.ascii_lowercase + string.digits]


def write_wordpiece_tokenizer(folder: Path, vocab: list[str]):
    """tokenizer.json (BERT-style WordPiece, lowercasing, the WordPiece decoder) and the matching
    vocab.txt."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    tok = Tokenizer(WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # as the Hub's BERT files have it
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab.index("[CLS]")), ("[SEP]", vocab.index("[SEP]"))],
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "unk_token": "[UNK]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]",
    }), encoding="utf-8")


def bert_config(*, hidden=32, layers=2, heads=4, intermediate=37, max_positions=64, type_vocab=2,
                hidden_act="gelu", vocab_size=None, eps=1e-12) -> dict:
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": vocab_size or len(fixture_vocab()),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
        "type_vocab_size": type_vocab,
        "hidden_act": hidden_act,
        "layer_norm_eps": eps,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }


INITS = ("stress", "hf")


def random_bert_tensors(config: dict, *, seed: int = 0, prefix: str = "", init: str = "stress") -> dict:
    """HF-named float32 tensors for `config`, with a pooler (which ftengine ignores).

    init "stress": large weights (sharp attention, visible biases) so that an error in any op
    shows in the outputs. init "hf": like HF's initialisation (normal, std 0.02), with small
    random biases and LayerNorm parameters instead of HF's zeros and ones: what a randomly
    initialised real model looks like.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}")
    rng = np.random.default_rng(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]

    def mat(*shape, std=None):
        if init == "hf":
            std = 0.02
        elif std is None:
            std = 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def gamma(n):
        return (1.0 + (0.02 if init == "hf" else 0.1) * rng.standard_normal(n)).astype(np.float32)

    t = {
        "embeddings.word_embeddings.weight": mat(config["vocab_size"], h, std=0.5),
        "embeddings.position_embeddings.weight": mat(config["max_position_embeddings"], h, std=0.5),
        "embeddings.token_type_embeddings.weight": mat(config["type_vocab_size"], h, std=0.5),
        "embeddings.LayerNorm.weight": gamma(h),
        "embeddings.LayerNorm.bias": mat(h, std=0.1),
        "pooler.dense.weight": mat(h, h),
        "pooler.dense.bias": mat(h, std=0.1),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            t[p + f"attention.self.{name}.weight"] = mat(h, h, std=2.0 / np.sqrt(h))
            t[p + f"attention.self.{name}.bias"] = mat(h, std=0.1)
        t[p + "attention.output.dense.weight"] = mat(h, h)
        t[p + "attention.output.dense.bias"] = mat(h, std=0.1)
        t[p + "attention.output.LayerNorm.weight"] = gamma(h)
        t[p + "attention.output.LayerNorm.bias"] = mat(h, std=0.1)
        t[p + "intermediate.dense.weight"] = mat(inter, h)
        t[p + "intermediate.dense.bias"] = mat(inter, std=0.1)
        t[p + "output.dense.weight"] = mat(h, inter)
        t[p + "output.dense.bias"] = mat(h, std=0.1)
        t[p + "output.LayerNorm.weight"] = gamma(h)
        t[p + "output.LayerNorm.bias"] = mat(h, std=0.1)
    return {prefix + k: v for k, v in t.items()}


def write_bert_checkpoint(folder, *, seed: int = 0, sentence_transformers: dict | None = None,
                          init: str = "stress", **config_args) -> Path:
    """A random BERT in `folder` (created): config.json, model.safetensors, tokenizer files.

    init: "stress" or "hf", see random_bert_tensors.
    sentence_transformers: None for a plain BERT folder, or a dict with keys
    `pooling` (the 1_Pooling/config.json object), `normalize` (bool), `max_seq_length` (int).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = bert_config(**config_args)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(random_bert_tensors(config, seed=seed, init=init), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    write_wordpiece_tokenizer(folder, fixture_vocab())
    if sentence_transformers is not None:
        write_sentence_transformers_files(folder, **sentence_transformers)
    return folder


def write_sentence_transformers_files(folder: Path, *, pooling: dict, normalize: bool = False,
                                      max_seq_length: int | None = None, prompts: dict | None = None,
                                      default_prompt_name: str | None = None, dense: list | None = None,
                                      seed: int = 0):
    """modules.json and the module folders. dense: Dense modules after pooling, each a dict
    with out_features, activation (a torch.nn class path) and bias; random weights."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    rng = np.random.default_rng(seed)
    width = pooling.get("word_embedding_dimension", 0) * sum(1 for k, v in pooling.items()
                                                             if k.startswith("pooling_mode") and v)
    for spec in dense or []:
        idx = len(modules)
        sub = folder / f"{idx}_Dense"
        sub.mkdir(exist_ok=True)
        out = spec["out_features"]
        (sub / "config.json").write_text(json.dumps({"in_features": width, "out_features": out, "bias": spec["bias"],
                                                     "activation_function": spec["activation"]}), encoding="utf-8")
        tensors = {"linear.weight": (rng.standard_normal((out, width)) / np.sqrt(width)).astype(np.float32)}
        if spec["bias"]:
            tensors["linear.bias"] = (0.1 * rng.standard_normal(out)).astype(np.float32)
        save_file(tensors, str(sub / "model.safetensors"))
        modules.append({"idx": idx, "name": str(idx), "path": sub.name, "type": "sentence_transformers.models.Dense"})
        width = out
    if normalize:
        idx = len(modules)
        modules.append({"idx": idx, "name": str(idx), "path": f"{idx}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling), encoding="utf-8")
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}), encoding="utf-8")
    if prompts is not None:
        (folder / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": prompts, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}),
            encoding="utf-8")


# ---------------------------------------------------------------- RoBERTa / XLM-R / DistilBERT

ROBERTA_SPECIAL = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3, as RoBERTa and XLM-R number them
ENCODER_TYPES = ("roberta", "xlm-roberta", "camembert", "distilbert")
MPNET_BUCKETS = 32


def _byte_level_bpe(special: list):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE
    tok = Tokenizer(BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # as roberta-base's and ModernBERT's
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainer=trainer)
    return tok


def write_bpe_tokenizer(folder: Path):
    """RoBERTa-style tokenizer.json: byte-level BPE (every byte, plus merges learnt from the
    fixture words), <s> $A </s> around each text, </s></s> between a pair."""
    from tokenizers import processors
    tok = _byte_level_bpe(ROBERTA_SPECIAL + ["<mask>"])
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)  # as roberta-base's
    tok.save(str(folder / "tokenizer.json"))
    _special_tokens_config(folder, "RobertaTokenizer")


MODERNBERT_SPECIAL = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]  # ids 0..4


def write_modernbert_tokenizer(folder: Path):
    """ModernBERT-style tokenizer.json: byte-level BPE, [CLS] $A [SEP], pairs [CLS] $A [SEP] $B [SEP]."""
    from tokenizers import processors
    tok = _byte_level_bpe(MODERNBERT_SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
        "unk_token": "[UNK]", "pad_token": "[PAD]", "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "attention_mask"]}), encoding="utf-8")


def write_modernbert_checkpoint(folder, *, seed: int = 0, hidden=64, layers=3, heads=2, intermediate=96,
                                max_positions=4096, local_attention=32, global_every=3, bias=False,
                                hidden_act="gelu", eps=1e-5, thetas=(160000.0, 10000.0), style="hub",
                                sentence_transformers: dict | None = None) -> Path:
    """A random ModernBERT folder (ModernBertModel tensors, byte-level BPE tokenizer).
    bias=True gives every linear and LayerNorm a bias (the Hub's models have none).
    style "hub": config keys as the Hub's files (global_attn_every_n_layers, global_rope_theta,
    local_rope_theta); "transformers5": layer_types and rope_parameters, as transformers 5 saves."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_modernbert_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    config = {"architectures": ["ModernBertModel"], "model_type": "modernbert", "vocab_size": vocab,
              "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": intermediate, "max_position_embeddings": max_positions,
              "hidden_activation": hidden_act, "norm_eps": eps, "norm_bias": bias, "attention_bias": bias,
              "mlp_bias": bias, "local_attention": local_attention, "pad_token_id": 3, "bos_token_id": 1,
              "cls_token_id": 1, "eos_token_id": 2, "sep_token_id": 2, "embedding_dropout": 0.0,
              "attention_dropout": 0.0, "mlp_dropout": 0.0, "classifier_pooling": "mean", "classifier_bias": bias,
              "classifier_activation": "gelu", "tie_word_embeddings": True}
    if style == "hub":
        config.update(global_attn_every_n_layers=global_every, global_rope_theta=thetas[0],
                      local_rope_theta=thetas[1])
    else:
        config.update(layer_types=["sliding_attention" if i % global_every else "full_attention"
                                   for i in range(layers)],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": thetas[0]},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": thetas[1]}})
    rng = np.random.default_rng(seed)

    def mat(*shape, gain=1.5):
        return (rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    def norm(name, tensors):
        tensors[name + ".weight"] = (1.0 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)
        if bias:
            tensors[name + ".bias"] = (0.1 * rng.standard_normal(hidden)).astype(np.float32)

    def linear(name, out, inp, tensors):
        tensors[name + ".weight"] = mat(out, inp)
        if bias:
            tensors[name + ".bias"] = (0.1 * rng.standard_normal(out)).astype(np.float32)

    tensors = {"embeddings.tok_embeddings.weight": rng.standard_normal((vocab, hidden)).astype(np.float32)}
    norm("embeddings.norm", tensors)
    for i in range(layers):
        if i:
            norm(f"layers.{i}.attn_norm", tensors)
        linear(f"layers.{i}.attn.Wqkv", 3 * hidden, hidden, tensors)
        linear(f"layers.{i}.attn.Wo", hidden, hidden, tensors)
        norm(f"layers.{i}.mlp_norm", tensors)
        linear(f"layers.{i}.mlp.Wi", 2 * intermediate, hidden, tensors)
        linear(f"layers.{i}.mlp.Wo", hidden, intermediate, tensors)
    norm("final_norm", tensors)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if sentence_transformers is not None:
        write_sentence_transformers_files(folder, **sentence_transformers)
    return folder


def write_unigram_tokenizer(folder: Path):
    """XLM-R-style tokenizer.json: a sentencepiece Unigram model with Metaspace pre-tokenisation
    (as the Hub's converted files have it: no whitespace splitting before the Metaspace)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    pieces = [(t, 0.0) for t in ROBERTA_SPECIAL]
    pieces += [("\u2581" + w, -3.0 - len(w) / 10) for w in WORDS]
    pieces += [(c, -8.0) for c in string.ascii_lowercase + string.digits + string.punctuation + "\u2581"]
    pieces.append(("<mask>", 0.0))
    tok = Tokenizer(Unigram(pieces, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens(ROBERTA_SPECIAL + ["<mask>"])
    tok.save(str(folder / "tokenizer.json"))
    _special_tokens_config(folder, "XLMRobertaTokenizer")


def _special_tokens_config(folder: Path, tokenizer_class: str):
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
        "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>",
    }), encoding="utf-8")


def write_encoder_checkpoint(folder, model_type: str, *, seed: int = 0, hidden=32, layers=2, heads=4,
                             intermediate=37, max_positions=64, hidden_act="gelu", eps=1e-5, init: str = "stress",
                             sentence_transformers: dict | None = None) -> Path:
    """A random RoBERTa / XLM-RoBERTa / CamemBERT / DistilBERT folder with the tokenizer its
    family ships (byte-level BPE, Unigram, Unigram, WordPiece). `max_positions` is the longest
    input; RoBERTa-style tables hold pad_token_id + 1 more rows, as on the Hub."""
    if model_type not in ENCODER_TYPES + ("mpnet",):
        raise ValueError(f"model_type must be one of {ENCODER_TYPES + ('mpnet',)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if model_type == "roberta":
        write_bpe_tokenizer(folder)
    elif model_type in ("distilbert", "mpnet"):
        write_wordpiece_tokenizer(folder, fixture_vocab())
    else:
        write_unigram_tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    bert = bert_config(hidden=hidden, layers=layers, heads=heads, intermediate=intermediate, hidden_act=hidden_act,
                       max_positions=max_positions + (0 if model_type == "distilbert" else 2), type_vocab=1,
                       vocab_size=len(vocab), eps=eps)
    tensors = random_bert_tensors(bert, seed=seed, init=init)
    if model_type == "distilbert":
        config = {"architectures": ["DistilBertModel"], "model_type": "distilbert", "vocab_size": bert["vocab_size"],
                  "dim": hidden, "hidden_dim": intermediate, "n_heads": heads, "n_layers": layers,
                  "max_position_embeddings": max_positions, "activation": hidden_act, "sinusoidal_pos_embds": False,
                  "dropout": 0.0, "attention_dropout": 0.0, "pad_token_id": 0}
        tensors = {distilbert_name(name): t for name, t in tensors.items()
                   if not name.startswith(("pooler.", "embeddings.token_type"))}
    elif model_type == "mpnet":
        config = {k: v for k, v in bert.items() if k not in ("type_vocab_size", "position_embedding_type")}
        config.update(architectures=["MPNetModel"], model_type="mpnet", pad_token_id=1, bos_token_id=0,
                      eos_token_id=2, relative_attention_num_buckets=MPNET_BUCKETS)
        tensors = {mpnet_name(name): t for name, t in tensors.items() if not name.startswith("embeddings.token_type")}
        rng = np.random.default_rng(seed + 1)
        tensors["encoder.relative_attention_bias.weight"] = rng.standard_normal((MPNET_BUCKETS, heads)).astype(np.float32)
    else:
        arch = {"roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel", "camembert": "CamembertModel"}
        config = dict(bert, architectures=[arch[model_type]], model_type=model_type, pad_token_id=1,
                      bos_token_id=0, eos_token_id=2)
        tensors = {"roberta." + name: t for name, t in tensors.items()} if model_type == "camembert" else tensors
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if sentence_transformers is not None:
        write_sentence_transformers_files(folder, **sentence_transformers)
    return folder


def add_classification_head(folder, *, num_labels: int = 1, seed: int = 0) -> Path:
    """Make the encoder in `folder` a ...ForSequenceClassification checkpoint (a cross-encoder):
    the family's head tensors (BERT: pooler + classifier; RoBERTa: classifier.dense + out_proj;
    DistilBERT: pre_classifier + classifier; ModernBERT: head.dense + head.norm, classifier, the
    encoder's tensors under "model."), random and large enough to spread the scores."""
    from safetensors.numpy import load_file
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    kind = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert",
            "distilbert": "DistilBert", "modernbert": "ModernBert"}[config["model_type"]]
    h = config.get("hidden_size", config.get("dim"))
    rng = np.random.default_rng(seed)

    def mat(*shape):
        return (rng.standard_normal(shape) * 2.0 / np.sqrt(shape[-1])).astype(np.float32)

    tensors = load_file(str(folder / "model.safetensors"))
    if kind == "ModernBert":
        tensors = {"model." + name: t for name, t in tensors.items()}
        tensors.update({"head.dense.weight": mat(h, h), "head.norm.weight": (1 + 0.2 * mat(h)).astype(np.float32),
                        "classifier.weight": mat(num_labels, h), "classifier.bias": mat(num_labels)})
        if config.get("classifier_bias"):
            tensors["head.dense.bias"] = mat(h)
        if config.get("norm_bias"):
            tensors["head.norm.bias"] = mat(h)
    else:
        names = {"Bert": ("pooler.dense", "classifier"), "DistilBert": ("pre_classifier", "classifier")}.get(
            kind, ("classifier.dense", "classifier.out_proj"))
        tensors.update({names[0] + ".weight": mat(h, h), names[0] + ".bias": mat(h),
                        names[1] + ".weight": mat(num_labels, h), names[1] + ".bias": mat(num_labels)})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.update(architectures=[f"{kind}ForSequenceClassification"],
                  id2label={str(i): f"LABEL_{i}" for i in range(num_labels)},
                  label2id={f"LABEL_{i}": i for i in range(num_labels)})
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def mpnet_name(name: str) -> str:
    """A BERT tensor name as MPNet stores it."""
    name = re.sub(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)",
                  lambda m: f"encoder.layer.{m.group(1)}.attention.attn.{m.group(2)[0]}", name)
    name = re.sub(r"^encoder\.layer\.(\d+)\.attention\.output\.dense", r"encoder.layer.\1.attention.attn.o", name)
    return re.sub(r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm", r"encoder.layer.\1.attention.LayerNorm",
                  name)


def distilbert_name(name: str) -> str:
    """A BERT tensor name as DistilBERT stores it."""
    for bert_part, distil_part in (
            (r"encoder\.layer\.(\d+)\.attention\.self\.query", r"transformer.layer.\1.attention.q_lin"),
            (r"encoder\.layer\.(\d+)\.attention\.self\.key", r"transformer.layer.\1.attention.k_lin"),
            (r"encoder\.layer\.(\d+)\.attention\.self\.value", r"transformer.layer.\1.attention.v_lin"),
            (r"encoder\.layer\.(\d+)\.attention\.output\.dense", r"transformer.layer.\1.attention.out_lin"),
            (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm", r"transformer.layer.\1.sa_layer_norm"),
            (r"encoder\.layer\.(\d+)\.intermediate\.dense", r"transformer.layer.\1.ffn.lin1"),
            (r"encoder\.layer\.(\d+)\.output\.dense", r"transformer.layer.\1.ffn.lin2"),
            (r"encoder\.layer\.(\d+)\.output\.LayerNorm", r"transformer.layer.\1.output_layer_norm")):
        name = re.sub("^" + bert_part, distil_part, name)
    return name


# ---------------------------------------------------------------- GPT-2

GPT2_EOS = "<|endoftext|>"


def write_byte_level_tokenizer(folder: Path) -> int:
    """tokenizer.json: GPT-2-style byte-level BPE over the 256 byte symbols (no merges) plus
    <|endoftext|>. Returns the vocabulary size (257; the eos token is the last id)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[GPT2_EOS] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([GPT2_EOS])
    tok.save(str(folder / "tokenizer.json"))
    return len(vocab)


def gpt2_config(*, n_embd=32, n_layer=2, n_head=4, n_positions=128, vocab_size=257, n_inner=None,
                activation="gelu_new", eps=1e-5, tie=True) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": n_positions,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_inner": n_inner,
        "activation_function": activation,
        "layer_norm_epsilon": eps,
        "bos_token_id": vocab_size - 1,
        "eos_token_id": vocab_size - 1,
        "tie_word_embeddings": tie,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    }


def random_gpt2_tensors(config: dict, *, seed: int = 0, prefix: str = "transformer.") -> dict:
    """HF-named float32 GPT-2 tensors (Conv1D weights [in, out]); lm_head.weight only when untied."""
    rng = np.random.default_rng(seed)
    e, v = config["n_embd"], config["vocab_size"]
    inner = config["n_inner"] or 4 * e

    def mat(*shape, std=None):
        std = std if std is not None else 1.0 / np.sqrt(shape[0])
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t = {"wte.weight": mat(v, e, std=0.5), "wpe.weight": mat(config["n_positions"], e, std=0.2),
         "ln_f.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32), "ln_f.bias": mat(e, std=0.1)}
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        t[p + "ln_1.weight"] = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
        t[p + "ln_1.bias"] = mat(e, std=0.1)
        t[p + "attn.c_attn.weight"] = mat(e, 3 * e, std=2.0 / np.sqrt(e))
        t[p + "attn.c_attn.bias"] = mat(3 * e, std=0.1)
        t[p + "attn.c_proj.weight"] = mat(e, e)
        t[p + "attn.c_proj.bias"] = mat(e, std=0.1)
        t[p + "ln_2.weight"] = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
        t[p + "ln_2.bias"] = mat(e, std=0.1)
        t[p + "mlp.c_fc.weight"] = mat(e, inner)
        t[p + "mlp.c_fc.bias"] = mat(inner, std=0.1)
        t[p + "mlp.c_proj.weight"] = mat(inner, e)
        t[p + "mlp.c_proj.bias"] = mat(e, std=0.1)
    out = {prefix + k: val for k, val in t.items()}
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = mat(v, e, std=0.5)
    return out


def write_gpt2_checkpoint(folder, *, seed: int = 0, **config_args) -> Path:
    """A random GPT-2 in `folder` (created): config.json, model.safetensors, tokenizer.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_level_tokenizer(folder)
    config = gpt2_config(vocab_size=vocab, **config_args)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(random_gpt2_tensors(config, seed=seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# ---------------------------------------------------------------- encoder-decoders

MARIAN_CORPUS = [" ".join(WORDS[i:i + 7]) for i in range(len(WORDS) - 7)] + ["hello world, the quick brown fox!"] * 3


def write_marian_tokenizer(folder: Path, *, vocab_size: int = 72, separate_vocabs: bool = False) -> tuple:
    """Marian's tokenizer files: source.spm / target.spm (one unigram sentencepiece model, trained on
    MARIAN_CORPUS) and vocab.json ("</s>" 0, "<unk>" 1, the model's pieces, "<pad>" last, two
    >>lang<< codes). With separate_vocabs (opus-mt-tc-big's format), target.spm is a model of its
    own (trained on the corpus upper-cased, of fewer pieces) and target_vocab.json numbers its pieces
    alike, so that the two vocabularies differ in size and in their pad token's id. Returns (the
    source's vocabulary, the target's)."""
    source = marian_pieces(MARIAN_CORPUS, vocab_size)
    (folder / "source.spm").write_bytes(source[0])
    vocab = marian_vocab(source[1], [">>deu<<", ">>fra<<"])
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    target_vocab = vocab
    if separate_vocabs:
        target = marian_pieces([line.upper() for line in MARIAN_CORPUS], vocab_size - 12)
        (folder / "target.spm").write_bytes(target[0])
        target_vocab = marian_vocab(target[1], [])
        (folder / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False))
    else:
        (folder / "target.spm").write_bytes(source[0])
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de",
                                                              "model_max_length": 512,
                                                              "separate_vocabs": separate_vocabs}))
    return vocab, target_vocab


def marian_pieces(corpus: list, vocab_size: int) -> tuple:
    """(a unigram sentencepiece model trained on `corpus`, its pieces)."""
    import io

    import sentencepiece
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model,
                                             vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
                                             minloglevel=2)
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    return model.getvalue(), [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def marian_vocab(pieces: list, codes: list) -> dict:
    """vocab.json as opus-mt numbers it: "</s>" 0, "<unk>" 1, the language codes, the pieces,
    "<pad>" last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in codes + [p for p in pieces if p not in ("<unk>", "<s>", "</s>")]:
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def write_marian_checkpoint(folder, *, seed: int = 0, d_model=32, layers=2, heads=4, ffn=37, max_positions=64,
                            activation="swish", generation: dict | None = None, separate_vocabs: bool = False) -> Path:
    """A random MarianMTModel folder in HF's format (opus-mt's settings: scaled embeddings, swish,
    the pad token as the decoder's start) with its sentencepiece tokenizer; weights scaled so that
    every sub-layer shows in the logits. separate_vocabs: a token table of its own for each side
    (share_encoder_decoder_embeddings false), the LM head tied to the decoder's."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, target_vocab = write_marian_tokenizer(folder, separate_vocabs=separate_vocabs)
    v, tv, pad = len(vocab), len(target_vocab), target_vocab["<pad>"]
    config = {"model_type": "marian", "architectures": ["MarianMTModel"], "vocab_size": v, "decoder_vocab_size": tv,
              "d_model": d_model, "encoder_layers": layers, "decoder_layers": layers,
              "encoder_attention_heads": heads, "decoder_attention_heads": heads, "encoder_ffn_dim": ffn,
              "decoder_ffn_dim": ffn, "activation_function": activation, "max_position_embeddings": max_positions,
              "scale_embedding": True, "share_encoder_decoder_embeddings": not separate_vocabs,
              "tie_word_embeddings": True, "pad_token_id": pad, "eos_token_id": 0, "decoder_start_token_id": pad,
              "forced_eos_token_id": 0, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
              "is_encoder_decoder": True}
    (folder / "config.json").write_text(json.dumps(config))
    gen = {"decoder_start_token_id": pad, "eos_token_id": 0, "pad_token_id": pad, "forced_eos_token_id": 0,
           "bad_words_ids": [[pad]], "renormalize_logits": True, "max_length": 24, "num_beams": 1}
    gen.update(generation or {})
    (folder / "generation_config.json").write_text(json.dumps(gen))
    rng = np.random.default_rng(seed)
    tables = ({"model.encoder.embed_tokens.weight": rng.normal(0, 1.0, (v, d_model)),
               "model.decoder.embed_tokens.weight": rng.normal(0, 1.0, (tv, d_model))} if separate_vocabs
              else {"model.shared.weight": rng.normal(0, 1.0, (v, d_model))})
    tensors = {**tables, "final_logits_bias": rng.normal(0, 0.3, (1, tv)), **_seq2seq_layers(rng, d_model, layers, ffn)}
    save_file({k: np.ascontiguousarray(a, np.float32) for k, a in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _seq2seq_layers(rng, d_model: int, layers: int, ffn: int) -> dict:
    """Every layer's tensors of a BART-style encoder-decoder."""
    tensors = {}
    for side in ("encoder", "decoder"):
        for i in range(layers):
            base = f"model.{side}.layers.{i}"
            attentions = ["self_attn"] + (["encoder_attn"] if side == "decoder" else [])
            for attention in attentions:
                for proj in ("q", "k", "v", "out"):
                    tensors[f"{base}.{attention}.{proj}_proj.weight"] = rng.normal(0, 0.4, (d_model, d_model))
                    tensors[f"{base}.{attention}.{proj}_proj.bias"] = rng.normal(0, 0.2, d_model)
            norms = ["self_attn_layer_norm", "final_layer_norm"] + (["encoder_attn_layer_norm"] if side == "decoder"
                                                                    else [])
            for norm in norms:
                _norm(tensors, f"{base}.{norm}", rng, d_model)
            tensors[f"{base}.fc1.weight"] = rng.normal(0, 0.4, (ffn, d_model))
            tensors[f"{base}.fc1.bias"] = rng.normal(0, 0.2, ffn)
            tensors[f"{base}.fc2.weight"] = rng.normal(0, 0.4, (d_model, ffn))
            tensors[f"{base}.fc2.bias"] = rng.normal(0, 0.2, d_model)
    return tensors


def _norm(tensors: dict, name: str, rng, d_model: int):
    tensors[f"{name}.weight"] = 1.0 + rng.normal(0, 0.2, d_model)
    tensors[f"{name}.bias"] = rng.normal(0, 0.2, d_model)


# family -> (model_type, tokenizer_class, language codes, activation, scale_embedding)
SEQ2SEQ_FIXTURES = {
    "bart": ("bart", "BartTokenizer", [], "gelu", False),
    "mbart": ("mbart", "MBart50Tokenizer", ["en_XX", "fr_XX", "de_DE"], "gelu", True),
    "nllb": ("m2m_100", "NllbTokenizer", ["eng_Latn", "fra_Latn", "deu_Latn"], "relu", True),
    "m2m100": ("m2m_100", "M2M100Tokenizer", [], "relu", True),  # its own sentencepiece files
}


def write_multilingual_tokenizer(folder: Path, tokenizer_class: str, codes: list) -> int:
    """An NLLB-style (BPE) or mBART-50-style (Unigram) tokenizer.json: sentencepiece pieces after
    <s> 0, <pad> 1, </s> 2, <unk> 3, then the language codes and <mask> as special tokens, with the
    Metaspace splitting HF's tokenizers build; tokenizer_config.json names the class, the codes and
    the first as the source language. Returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE, Unigram
    if tokenizer_class == "NllbTokenizer":
        tok = Tokenizer(BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=ROBERTA_SPECIAL, show_progress=False)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.train_from_iterator(MARIAN_CORPUS, trainer=trainer)
    else:
        pieces = [(t, 0.0) for t in ROBERTA_SPECIAL] + [("\u2581" + w, -3.0 - len(w) / 10) for w in WORDS]
        pieces += [(c, -8.0) for c in string.ascii_lowercase + string.digits + string.punctuation + "\u2581"]
        tok = Tokenizer(Unigram(pieces + [(c, 0.0) for c in codes + ["<mask>"]], unk_id=3))
        tok.normalizer = normalizers.Replace(Regex(r" {2,}"), " ")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(prepend_scheme="always", split=True)
    tok.add_special_tokens(ROBERTA_SPECIAL + codes + ["<mask>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "src_lang": codes[0], "extra_special_tokens": codes,
        "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "mask_token": "<mask>"}), encoding="utf-8")
    return tok.get_vocab_size()


def write_bart_family_checkpoint(folder, family: str, *, seed: int = 0, d_model=32, layers=2, heads=4, ffn=37,
                                 max_positions=64, generation: dict | None = None) -> Path:
    """A random BART, mBART-50, NLLB or M2M100 (model_type m2m_100) folder in HF's format with its
    tokenizer: BART's byte-level BPE, mBART-50's Unigram and NLLB's BPE with language codes,
    M2M100's sentencepiece model and vocab.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_type, tokenizer_class, codes, activation, scaled = SEQ2SEQ_FIXTURES[family]
    if family == "mbart":  # HF's MBart50Tokenizer numbers every mBART-50 code whatever the files say
        from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES
        codes = codes + [c for c in FAIRSEQ_LANGUAGE_CODES if c not in codes]
    if family == "m2m100":
        v = write_m2m100_tokenizer(folder)
    elif codes:
        v = write_multilingual_tokenizer(folder, tokenizer_class, codes)
    else:
        write_bpe_tokenizer(folder)
        (folder / "tokenizer_config.json").write_text(json.dumps({
            **json.loads((folder / "tokenizer_config.json").read_text()), "tokenizer_class": tokenizer_class}))
        from tokenizers import Tokenizer
        v = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    config = {"model_type": model_type, "vocab_size": v, "d_model": d_model, "encoder_layers": layers,
              "decoder_layers": layers, "encoder_attention_heads": heads, "decoder_attention_heads": heads,
              "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn, "activation_function": activation,
              "max_position_embeddings": max_positions, "scale_embedding": scaled, "tie_word_embeddings": True,
              "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
              "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "is_encoder_decoder": True}
    (folder / "config.json").write_text(json.dumps(config))
    gen = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2, "max_length": 24}
    if family == "bart":  # as bart-large-cnn's
        gen.update({"forced_bos_token_id": 0, "forced_eos_token_id": 2, "no_repeat_ngram_size": 3,
                    "length_penalty": 2.0, "num_beams": 4, "early_stopping": True, "min_length": 3})
    elif family == "mbart":
        gen["forced_eos_token_id"] = 2
    gen.update(generation or {})
    (folder / "generation_config.json").write_text(json.dumps(gen))
    rng = np.random.default_rng(seed)
    tensors = {"model.shared.weight": rng.normal(0, 1.0, (v, d_model)), **_seq2seq_layers(rng, d_model, layers, ffn)}
    for side in ("encoder", "decoder"):
        if model_type in ("bart", "mbart"):
            tensors[f"model.{side}.embed_positions.weight"] = rng.normal(0, 0.5, (max_positions + 2, d_model))
            _norm(tensors, f"model.{side}.layernorm_embedding", rng, d_model)
        if model_type in ("mbart", "m2m_100"):
            _norm(tensors, f"model.{side}.layer_norm", rng, d_model)
    if model_type != "m2m_100":
        tensors["final_logits_bias"] = rng.normal(0, 0.3, (1, v))
    save_file({k: np.ascontiguousarray(a, np.float32) for k, a in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def write_t5_tokenizer(folder: Path) -> int:
    """T5's tokenizer.json: a Unigram model with <pad> 0, </s> 1, <unk> 2, the pieces, then
    <extra_id_99> .. <extra_id_0>; whitespace then Metaspace splitting and $A </s>, as HF's
    T5Tokenizer builds them. Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    special = ["<pad>", "</s>", "<unk>"]
    extra = [f"<extra_id_{i}>" for i in range(99, -1, -1)]
    pieces = [(t, 0.0) for t in special] + [("\u2581" + w, -3.0 - len(w) / 10) for w in WORDS]
    pieces += [(c, -8.0) for c in string.ascii_lowercase + string.digits + string.punctuation + "\u2581"]
    tok = Tokenizer(Unigram(pieces + [(t, 0.0) for t in extra], unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(prepend_scheme="always", split=True)])
    tok.decoder = decoders.Metaspace(prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens(special + extra)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "extra_ids": 100}), encoding="utf-8")
    return tok.get_vocab_size()


def write_t5_checkpoint(folder, *, gated: bool, seed: int = 0, d_model=32, layers=2, heads=4, ffn=37,
                        buckets=8, max_distance=20, generation: dict | None = None, model_type: str = "t5",
                        d_kv: int | None = None) -> Path:
    """A random T5 (ReLU, tied head: t5-small's settings) or T5 v1.1 / flan-t5 (gated GELU,
    untied head) folder in HF's format with its tokenizer; few buckets and a short max_distance,
    so that the fixture's short texts reach the logarithmic buckets. model_type "mt5": mT5's
    config (its architecture is T5 v1.1's). d_kv: each head's width (None: d_model / heads; heads x
    d_kv need not be d_model, as in flan-t5-small)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d_kv = d_kv or d_model // heads
    width = heads * d_kv
    v = write_t5_tokenizer(folder) + 3  # the model's table larger than the tokenizer's, as t5's
    config = {"model_type": model_type, "architectures": [f"{model_type.upper()}ForConditionalGeneration"], "vocab_size": v,
              "d_model": d_model, "d_kv": d_kv, "d_ff": ffn, "num_layers": layers,
              "num_decoder_layers": layers, "num_heads": heads, "relative_attention_num_buckets": buckets,
              "relative_attention_max_distance": max_distance, "layer_norm_epsilon": 1e-6,
              "feed_forward_proj": "gated-gelu" if gated else "relu", "tie_word_embeddings": not gated,
              "dropout_rate": 0.0, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
              "is_encoder_decoder": True, "n_positions": 64}
    (folder / "config.json").write_text(json.dumps(config))
    gen = {"pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0, "max_length": 24}
    gen.update(generation or {})
    (folder / "generation_config.json").write_text(json.dumps(gen))
    rng = np.random.default_rng(seed)
    t = {"shared.weight": rng.normal(0, 1.0, (v, d_model))}
    inputs = ("wi_0", "wi_1") if gated else ("wi",)
    for side in ("encoder", "decoder"):
        t[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = rng.normal(0, 1.0, (buckets, heads))
        t[f"{side}.final_layer_norm.weight"] = 1.0 + rng.normal(0, 0.2, d_model)
        for i in range(layers):
            base = f"{side}.block.{i}.layer"
            attentions = ["0.SelfAttention"] + (["1.EncDecAttention"] if side == "decoder" else [])
            for attention in attentions:
                for proj in "qkvo":
                    t[f"{base}.{attention}.{proj}.weight"] = rng.normal(0, 0.4 / np.sqrt(d_kv) if proj == "q" else 0.4,
                                                                        (d_model, width) if proj == "o" else
                                                                        (width, d_model))
            ffn_at = 2 if side == "decoder" else 1
            for at in range(ffn_at + 1):
                t[f"{base}.{at}.layer_norm.weight"] = 1.0 + rng.normal(0, 0.2, d_model)
            for w in inputs:
                t[f"{base}.{ffn_at}.DenseReluDense.{w}.weight"] = rng.normal(0, 0.4, (ffn, d_model))
            t[f"{base}.{ffn_at}.DenseReluDense.wo.weight"] = rng.normal(0, 0.4, (d_model, ffn))
    if gated:
        t["lm_head.weight"] = rng.normal(0, 0.3, (v, d_model))
    save_file({k: np.ascontiguousarray(a, np.float32) for k, a in t.items()}, str(folder / "model.safetensors"))
    return folder


NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "MISC"]


def add_token_classification_head(folder, *, labels=NER_LABELS, seed: int = 0) -> Path:
    """Make the encoder in `folder` a ...ForTokenClassification checkpoint: classifier.weight and
    .bias over `labels` (id2label: BIO tags, and one label without a prefix), random and large
    enough that every label wins somewhere."""
    from safetensors.numpy import load_file
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    kind = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert",
            "distilbert": "DistilBert", "mpnet": "MPNet"}[config["model_type"]]
    h = config.get("hidden_size", config.get("dim"))
    rng = np.random.default_rng(seed)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if not k.startswith(("pooler.", "bert.pooler."))}
    tensors["classifier.weight"] = (rng.standard_normal((len(labels), h)) * 3.0 / np.sqrt(h)).astype(np.float32)
    tensors["classifier.bias"] = (rng.standard_normal(len(labels)) * 0.3).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.update(architectures=[f"{kind}ForTokenClassification"], id2label=dict(enumerate(labels)),
                  label2id={label: i for i, label in enumerate(labels)})
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def write_m2m100_tokenizer(folder: Path) -> int:
    """M2M100's own tokenizer files (no tokenizer.json): sentencepiece.bpe.model (a BPE model
    trained on MARIAN_CORPUS), vocab.json (<s> 0, <pad> 1, </s> 2, <unk> 3, the pieces) and
    tokenizer_config.json listing HF's 100 m2m100 language codes as additional special tokens,
    as facebook/m2m100_418M's files do. Returns the model's vocabulary size: the pieces, the
    codes and the 8 made-up words HF counts."""
    import io

    import sentencepiece
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(MARIAN_CORPUS), model_writer=model,
                                             vocab_size=90, model_type="bpe", character_coverage=1.0,
                                             minloglevel=2)
    (folder / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for piece in (processor.id_to_piece(i) for i in range(processor.get_piece_size())):
        vocab.setdefault(piece, len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    codes = [f"__{c}__" for c in FAIRSEQ_LANGUAGE_CODES["m2m100"]]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "M2M100Tokenizer", "language_codes": "m2m100", "src_lang": "en",
        "additional_special_tokens": codes, "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "num_madeup_words": 8}))
    return len(vocab) + len(codes) + 8
