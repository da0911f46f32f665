"""safetensors checkpoints -> host float32 arrays, through one explicit name table per architecture.

Every tensor in the files is either consumed by a slot or matched by an ignore pattern;
every slot must be filled; every shape is checked against the config before use.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import BertConfig
from .errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


# ---------------------------------------------------------------- reading files

class SafetensorsFiles:
    """The tensors of one model folder: name -> file, from an index, one file, or every file."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            self._read_index(index)
        else:
            single = self.model_dir / SINGLE_FILE
            files = [single] if single.is_file() else sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                hint = ""
                if (self.model_dir / "pytorch_model.bin").exists():
                    hint = " (pytorch_model.bin is a pickle and is never loaded; save the model as safetensors)"
                raise CheckpointError(f"no *.safetensors weights in {self.model_dir}{hint}")
            for f in files:
                for name in self._open(f).keys():
                    if name in self.where:
                        raise CheckpointError(
                            f"tensor {name!r} is stored twice: in {self.where[name]} and {f}"
                        )
                    self.where[name] = f

    def _read_index(self, index: Path):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        root = self.model_dir.resolve()
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(f"{index}: tensor {name!r} has no shard file name")
            path = (self.model_dir / shard).resolve()
            if path.parent != root or Path(shard).is_absolute():
                raise CheckpointError(
                    f"{index}: shard {shard!r} for tensor {name!r} is outside the model folder {self.model_dir}"
                )
            if not path.is_file():
                raise CheckpointError(f"{index}: shard file {path} (for tensor {name!r}) is missing")
            self.where[name] = path
        for path in sorted(set(self.where.values())):
            stored = set(self._open(path).keys())
            listed = {n for n, p in self.where.items() if p == path}
            absent = sorted(listed - stored)
            if absent:
                raise CheckpointError(
                    f"{path}: tensors listed in {INDEX_FILE} are not in the file: {', '.join(absent[:10])}"
                )

    def _open(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self.where)

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        sl = self._open(self.where[name]).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def float32(self, name: str) -> np.ndarray:
        """The tensor widened to float32 (bf16 words are widened by hand: NumPy has no bfloat16)."""
        path = self.where[name]
        shape, dtype = self.shape_and_dtype(name)
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}; expected one of {', '.join(FLOAT_DTYPES)}")
        try:
            if dtype == "BF16":
                words = _raw_tensor_bytes(path, name).view(np.uint16).astype(np.uint32)
                return (words << 16).view(np.float32).reshape(shape)
            return np.ascontiguousarray(self._open(path).get_tensor(name), dtype=np.float32)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None


def _raw_tensor_bytes(path: Path, name: str) -> np.ndarray:
    """The stored bytes of one tensor, located through the file's JSON header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        begin, end = header[name]["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    if len(data) != end - begin:
        raise CheckpointError(f"{path}: file is truncated inside tensor {name!r}")
    return np.frombuffer(data, dtype=np.uint8)


# ---------------------------------------------------------------- BERT name table

def _h(c) -> tuple:
    return (c.hidden_size,)


def _hh(c) -> tuple:
    return (c.hidden_size, c.hidden_size)


# The name tables: HF name (after an optional "bert." prefix) -> (slot, shape as a function of the
# config). The token and position tables and the LayerNorm after them, as BERT, DistilBERT and MPNet
# name them (DistilBERT's and BERT's positions have no offset: RoBERTa's and MPNet's count from the
# padding id).
_TOKENS_POSITIONS = {
    "embeddings.word_embeddings.weight": ("word_emb", lambda c: (c.vocab_size, c.hidden_size)),
    "embeddings.position_embeddings.weight": ("pos_emb", lambda c: (c.max_position_embeddings + c.position_offset,
                                                                     c.hidden_size)),
}
_EMBEDDING_NORM = {"embeddings.LayerNorm.weight": ("emb_ln_gamma", _h),
                   "embeddings.LayerNorm.bias": ("emb_ln_beta", _h)}
BERT_EMBEDDING_NAMES = {**_TOKENS_POSITIONS,
                        "embeddings.token_type_embeddings.weight": ("type_emb", lambda c: (c.type_vocab_size,
                                                                                            c.hidden_size)),
                        **_EMBEDDING_NORM}


# a BERT-style layer's eight modules, in the order the families' name lists below give them: their
# weight and bias slots, and the shapes of those as functions of the config
_BERT_LAYER_MODULES = (
    ("q_weight", "q_bias", _hh, _h), ("k_weight", "k_bias", _hh, _h), ("v_weight", "v_bias", _hh, _h),
    ("attn_out_weight", "attn_out_bias", _hh, _h), ("attn_ln_gamma", "attn_ln_beta", _h, _h),
    ("ffn_in_weight", "ffn_in_bias", lambda c: (c.intermediate_size, c.hidden_size), lambda c: (c.intermediate_size,)),
    ("ffn_out_weight", "ffn_out_bias", lambda c: (c.hidden_size, c.intermediate_size), _h),
    ("ffn_ln_gamma", "ffn_ln_beta", _h, _h),
)


def _bert_layer_names(prefix: str, modules) -> dict:
    """HF name -> (slot, shape) of a BERT-style layer whose modules (_BERT_LAYER_MODULES' order) are
    named prefix + module, each with a .weight and a .bias."""
    return {f"{prefix}{module}.{part}": (slot, shape) for module, (weight, bias, weight_shape, bias_shape)
            in zip(modules, _BERT_LAYER_MODULES, strict=True)
            for part, slot, shape in (("weight", weight, weight_shape), ("bias", bias, bias_shape))}


BERT_LAYER_NAMES = _bert_layer_names("encoder.layer.{i}.", (
    "attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
    "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"))
# Tensors that are in BERT / RoBERTa checkpoints but not used by the encoder: buffers, the
# pooler, and the heads of ...ForPreTraining / MaskedLM / SequenceClassification / QA / ...
BERT_IGNORED = [re.compile(p) for p in (
    r"(bert\.|roberta\.)?embeddings\.(position_ids|token_type_ids)",
    r"(bert\.|roberta\.)?pooler\..+",
    r"cls\..+",
    r"lm_head\..+",
    r"classifier\..+",
    r"qa_outputs\..+",
)]

# DistilBERT: the same layer with its own names; no token-type table (a zero row stands in)
DISTILBERT_EMBEDDING_NAMES = {**_TOKENS_POSITIONS, **_EMBEDDING_NORM}
DISTILBERT_LAYER_NAMES = _bert_layer_names("transformer.layer.{i}.", (
    "attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "sa_layer_norm", "ffn.lin1",
    "ffn.lin2", "output_layer_norm"))
DISTILBERT_IGNORED = [re.compile(p) for p in (
    r"(distilbert\.)?embeddings\.position_ids",
    r"vocab_(transform|layer_norm|projector)\..+",
    r"pre_classifier\..+",
    r"classifier\..+",
    r"qa_outputs\..+",
)]
# MPNet: BERT's layer under other names, no token types, one relative-position bias table
MPNET_EMBEDDING_NAMES = {
    **_TOKENS_POSITIONS, **_EMBEDDING_NORM,
    "encoder.relative_attention_bias.weight": ("rel_bias", lambda c: (c.relative_buckets, c.num_attention_heads)),
}
MPNET_LAYER_NAMES = _bert_layer_names("encoder.layer.{i}.", (
    "attention.attn.q", "attention.attn.k", "attention.attn.v", "attention.attn.o", "attention.LayerNorm",
    "intermediate.dense", "output.dense", "output.LayerNorm"))
MPNET_IGNORED = [re.compile(p) for p in (
    r"(mpnet\.)?embeddings\.position_ids",
    r"(mpnet\.)?pooler\..+",
    r"lm_head\..+",
    r"classifier\..+",
)]
# ModernBERT: pre-LayerNorm layers (layer 0 has no attention norm), fused Wqkv, GeGLU Wi (2I rows:
# input half, then gate half), no position or type tables, a final norm; biases only where the
# config says (absent ones are zeros in the slots). Slots as BERT's, plus final_ln; attn_ln is
# the norm before attention, ffn_ln the norm before the MLP.
MODERNBERT_EMBEDDING_NAMES = {
    "embeddings.tok_embeddings.weight": ("word_emb", lambda c: (c.vocab_size, c.hidden_size)),
    "embeddings.norm.weight": ("emb_ln_gamma", lambda c: (c.hidden_size,)),
    "final_norm.weight": ("final_ln_gamma", lambda c: (c.hidden_size,)),
}
MODERNBERT_EMBEDDING_BIASES = {
    "embeddings.norm.bias": ("emb_ln_beta", lambda c: (c.hidden_size,)),
    "final_norm.bias": ("final_ln_beta", lambda c: (c.hidden_size,)),
}
MODERNBERT_LAYER_NAMES = {
    "layers.{i}.attn_norm.weight": ("attn_ln_gamma", lambda c: (c.hidden_size,)),
    "layers.{i}.attn.Wqkv.weight": ("qkv_weight", lambda c: (3 * c.hidden_size, c.hidden_size)),
    "layers.{i}.attn.Wo.weight": ("attn_out_weight", lambda c: (c.hidden_size, c.hidden_size)),
    "layers.{i}.mlp_norm.weight": ("ffn_ln_gamma", lambda c: (c.hidden_size,)),
    "layers.{i}.mlp.Wi.weight": ("ffn_in_weight", lambda c: (2 * c.intermediate_size, c.hidden_size)),
    "layers.{i}.mlp.Wo.weight": ("ffn_out_weight", lambda c: (c.hidden_size, c.intermediate_size)),
}
# config flag -> the layer biases it adds
MODERNBERT_LAYER_BIASES = {
    "attention_bias": {
        "layers.{i}.attn.Wqkv.bias": ("qkv_bias", lambda c: (3 * c.hidden_size,)),
        "layers.{i}.attn.Wo.bias": ("attn_out_bias", lambda c: (c.hidden_size,)),
    },
    "mlp_bias": {
        "layers.{i}.mlp.Wi.bias": ("ffn_in_bias", lambda c: (2 * c.intermediate_size,)),
        "layers.{i}.mlp.Wo.bias": ("ffn_out_bias", lambda c: (c.hidden_size,)),
    },
    "norm_bias": {
        "layers.{i}.attn_norm.bias": ("attn_ln_beta", lambda c: (c.hidden_size,)),
        "layers.{i}.mlp_norm.bias": ("ffn_ln_beta", lambda c: (c.hidden_size,)),
    },
}
MODERNBERT_IGNORED = [re.compile(p) for p in (r"head\..+", r"decoder\..+", r"classifier\..+")]
FAMILY_NAMES = {"bert": "BERT", "roberta": "RoBERTa", "distilbert": "DistilBERT", "mpnet": "MPNet",
                "modernbert": "ModernBERT"}
# family -> (embedding names, layer names, ignored patterns, the prefix a task model adds)
ENCODER_NAME_TABLES = {
    "bert": (BERT_EMBEDDING_NAMES, BERT_LAYER_NAMES, BERT_IGNORED, "bert."),
    "roberta": (BERT_EMBEDDING_NAMES, BERT_LAYER_NAMES, BERT_IGNORED, "roberta."),
    "distilbert": (DISTILBERT_EMBEDDING_NAMES, DISTILBERT_LAYER_NAMES, DISTILBERT_IGNORED, "distilbert."),
    "mpnet": (MPNET_EMBEDDING_NAMES, MPNET_LAYER_NAMES, MPNET_IGNORED, "mpnet."),
    "modernbert": (MODERNBERT_EMBEDDING_NAMES, MODERNBERT_LAYER_NAMES, MODERNBERT_IGNORED, "model."),
}
# Checkpoints converted from TensorFlow name LayerNorm parameters gamma/beta.
_LEGACY_LN = re.compile(r"LayerNorm\.(gamma|beta)$")


@dataclass
class BertLayerWeights:
    qkv_weight: np.ndarray       # (3H, H): query, key, value rows stacked
    qkv_bias: np.ndarray         # (3H,)
    attn_out_weight: np.ndarray  # (H, H)
    attn_out_bias: np.ndarray    # (H,)
    attn_ln_gamma: np.ndarray    # (H,)
    attn_ln_beta: np.ndarray     # (H,)
    ffn_in_weight: np.ndarray    # (I, H)
    ffn_in_bias: np.ndarray      # (I,)
    ffn_out_weight: np.ndarray   # (H, I)
    ffn_out_bias: np.ndarray     # (H,)
    ffn_ln_gamma: np.ndarray     # (H,)
    ffn_ln_beta: np.ndarray      # (H,)


@dataclass
class BertWeights:
    word_emb: np.ndarray      # (V, H)
    pos_emb: np.ndarray       # (P, H)
    type_emb: np.ndarray      # (TV, H)
    emb_ln_gamma: np.ndarray  # (H,)
    emb_ln_beta: np.ndarray   # (H,)
    layers: list              # num_hidden_layers x BertLayerWeights
    rel_bias: np.ndarray | None = None  # (buckets, heads): MPNet's relative position bias
    final_ln_gamma: np.ndarray | None = None  # (H,): ModernBERT's final norm
    final_ln_beta: np.ndarray | None = None   # (H,)


def _canonical(name: str, prefix: str) -> str:
    name = name[len(prefix):] if name.startswith(prefix) else name
    return _LEGACY_LN.sub(lambda m: "LayerNorm." + {"gamma": "weight", "beta": "bias"}[m.group(1)], name)


def _collect(model_dir: Path, files: SafetensorsFiles, expected: dict, ignored: list, canonical, what: str) -> dict:
    """Match every stored tensor to a slot of `expected` (canonical name -> (layer or None, slot,
    shape)) or to an ignore pattern; report unexpected, missing and wrong-shape tensors, each
    kind in one error; return {canonical name: float32 array}."""
    found = {}  # canonical name -> stored name
    unexpected = []
    for stored in files.names():
        if any(p.fullmatch(stored) for p in ignored):
            continue
        name = canonical(stored)
        if name not in expected:
            unexpected.append(stored)
        elif name in found:
            raise CheckpointError(f"{model_dir}: tensors {found[name]!r} and {stored!r} both fill {name!r}")
        else:
            found[name] = stored
    if unexpected:
        raise CheckpointError(
            f"{model_dir}: {len(unexpected)} unexpected tensor(s) for {what}: {', '.join(sorted(unexpected)[:20])}"
        )
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(f"{model_dir}: {len(missing)} tensor(s) missing: {', '.join(missing[:20])}")
    wrong = []
    for name, stored in found.items():
        shape, _ = files.shape_and_dtype(stored)
        if shape != expected[name][2]:
            wrong.append(f"{stored} is {list(shape)}, config says {list(expected[name][2])}")
    if wrong:
        raise CheckpointError(f"{model_dir}: tensor shapes do not match config.json: " + "; ".join(wrong[:10]))
    return {name: files.float32(stored) for name, stored in found.items()}


def _expected(embedding_names: dict, layer_names: dict, layers: int, config) -> dict:
    expected = {name: (None, slot, shape(config)) for name, (slot, shape) in embedding_names.items()}
    for i in range(layers):
        for template, (slot, shape) in layer_names.items():
            expected[template.format(i=i)] = (i, slot, shape(config))
    return expected


def _slots(arrays: dict, expected: dict, layers: int) -> tuple[dict, list]:
    top, per_layer = {}, [{} for _ in range(layers)]
    for name, array in arrays.items():
        layer, slot, _ = expected[name]
        (top if layer is None else per_layer[layer])[slot] = array
    return top, per_layer


def _modernbert_tables(config: BertConfig) -> tuple[dict, dict]:
    """ModernBERT's embedding and layer names with the biases its config has."""
    embedding_names, layer_names = dict(MODERNBERT_EMBEDDING_NAMES), dict(MODERNBERT_LAYER_NAMES)
    if config.norm_bias:
        embedding_names.update(MODERNBERT_EMBEDDING_BIASES)
    for flag, names in MODERNBERT_LAYER_BIASES.items():
        if getattr(config, flag):
            layer_names.update(names)
    return embedding_names, layer_names


def load_bert_weights(model_dir: Path, config: BertConfig) -> BertWeights:
    """The weights of any encoder family (config.family), in BERT's slots."""
    embedding_names, layer_names, ignored, prefix = ENCODER_NAME_TABLES[config.family]
    if config.family == "modernbert":
        return _load_modernbert(model_dir, config, ignored, prefix)
    expected = _expected(embedding_names, layer_names, config.num_hidden_layers, config)
    arrays = _collect(model_dir, SafetensorsFiles(model_dir), expected, ignored,
                      lambda name: _canonical(name, prefix),
                      f"a {FAMILY_NAMES[config.family]} with {config.num_hidden_layers} layers")
    top, layers = _slots(arrays, expected, config.num_hidden_layers)
    top.setdefault("type_emb", np.zeros((config.type_vocab_size, config.hidden_size), np.float32))
    return BertWeights(layers=[_fuse_layer(parts) for parts in layers], **top)


def _load_modernbert(model_dir: Path, config: BertConfig, ignored: list, prefix: str) -> BertWeights:
    embedding_names, layer_names = _modernbert_tables(config)
    expected = _expected(embedding_names, layer_names, config.num_hidden_layers, config)
    for name in ("layers.0.attn_norm.weight", "layers.0.attn_norm.bias"):  # layer 0 attends to the embeddings
        expected.pop(name, None)
    arrays = _collect(model_dir, SafetensorsFiles(model_dir), expected, ignored,
                      lambda name: _canonical(name, prefix),
                      f"a ModernBERT with {config.num_hidden_layers} layers")
    top, layers = _slots(arrays, expected, config.num_hidden_layers)
    h, i = config.hidden_size, config.intermediate_size
    zeros = lambda n: np.zeros((n,), np.float32)  # noqa: E731
    absent = {"qkv_bias": zeros(3 * h), "attn_out_bias": zeros(h), "ffn_in_bias": zeros(2 * i),
              "ffn_out_bias": zeros(h), "attn_ln_beta": zeros(h), "ffn_ln_beta": zeros(h),
              "attn_ln_gamma": np.ones((h,), np.float32)}
    for parts in layers:
        for slot, value in absent.items():
            parts.setdefault(slot, value)
    top.setdefault("emb_ln_beta", zeros(h))
    top.setdefault("final_ln_beta", zeros(h))
    # no position or type tables: one zero row each, read by every token
    top["pos_emb"] = top["type_emb"] = np.zeros((1, h), np.float32)
    return BertWeights(layers=[BertLayerWeights(**parts) for parts in layers], **top)


def _fuse_layer(p: dict) -> BertLayerWeights:
    return BertLayerWeights(
        qkv_weight=np.concatenate([p.pop("q_weight"), p.pop("k_weight"), p.pop("v_weight")], axis=0),
        qkv_bias=np.concatenate([p.pop("q_bias"), p.pop("k_bias"), p.pop("v_bias")], axis=0),
        **p,
    )


# ---------------------------------------------------------------- heads after pooling

@dataclass
class HeadLayer:
    """One float32 layer applied to the pooled vector: activation(x @ weight^T + bias), then
    LayerNorm(gamma, beta, eps) where `norm` has them."""
    weight: np.ndarray  # (out, in)
    bias: np.ndarray    # (out,): zeros for a layer without bias
    activation: str     # "identity", "tanh", "relu" or "gelu"
    norm: tuple = ()    # (gamma (out,), beta (out,), eps): ModernBERT's head norm


def load_dense_module(module) -> HeadLayer:
    """A sentence-transformers Dense module's weights (linear.weight, linear.bias) from its folder."""
    expected = {"linear.weight": (None, "weight", (module.out_features, module.in_features))}
    if module.bias:
        expected["linear.bias"] = (None, "bias", (module.out_features,))
    arrays = _collect(module.path, SafetensorsFiles(module.path), expected, [], lambda name: name,
                      f"a Dense module ({module.in_features} -> {module.out_features})")
    bias = arrays.get("linear.bias", np.zeros(module.out_features, np.float32))
    return HeadLayer(arrays["linear.weight"], bias, module.activation)


# family -> the ...ForSequenceClassification head on the first token: (tensor name, activation)
CLASSIFIER_HEADS = {
    "bert": (("pooler.dense", "tanh"), ("classifier", "identity")),
    "roberta": (("classifier.dense", "tanh"), ("classifier.out_proj", "identity")),
    "distilbert": (("pre_classifier", "relu"), ("classifier", "identity")),
    "mpnet": (("classifier.dense", "tanh"), ("classifier.out_proj", "identity")),
}


def load_classification_head(model_dir: Path, config: BertConfig) -> tuple:
    """The HeadLayers of a sequence-classification checkpoint (BERT: pooler + classifier;
    RoBERTa: classifier.dense + out_proj; DistilBERT: pre_classifier + classifier; ModernBERT:
    head.dense + head.norm, classifier)."""
    files = SafetensorsFiles(model_dir)
    if config.family == "modernbert":
        return _modernbert_head(model_dir, files, config)
    stored = set(files.names())
    prefix = ENCODER_NAME_TABLES[config.family][3]
    layers, width = [], config.hidden_size
    for base, activation in CLASSIFIER_HEADS[config.family]:
        name = next((n for n in (base, prefix + base) if n + ".weight" in stored and n + ".bias" in stored), None)
        if name is None:
            raise CheckpointError(f"{model_dir}: {base}.weight / {base}.bias are missing: not a "
                                  f"{FAMILY_NAMES[config.family]} sequence-classification (cross-encoder) checkpoint")
        weight, bias = files.float32(name + ".weight"), files.float32(name + ".bias")
        if weight.ndim != 2 or weight.shape[1] != width or bias.shape != (weight.shape[0],):
            raise CheckpointError(f"{model_dir}: {name}.weight is {list(weight.shape)} and {name}.bias "
                                  f"{list(bias.shape)}; expected [N, {width}] and [N]")
        layers.append(HeadLayer(weight, bias, activation))
        width = weight.shape[0]
    return tuple(layers)


def _modernbert_head(model_dir: Path, files: SafetensorsFiles, config: BertConfig) -> tuple:
    h = config.hidden_size
    stored = set(files.names())
    labels = files.shape_and_dtype("classifier.weight")[0][0] if "classifier.weight" in stored else 1
    expected = {"head.dense.weight": (None, "dense_w", (h, h)), "head.norm.weight": (None, "gamma", (h,)),
                "classifier.weight": (None, "out_w", (labels, h)), "classifier.bias": (None, "out_b", (labels,))}
    if config.classifier_bias:
        expected["head.dense.bias"] = (None, "dense_b", (h,))
    if config.norm_bias:
        expected["head.norm.bias"] = (None, "beta", (h,))
    missing = [n for n in expected if n not in stored]
    if missing:
        raise CheckpointError(f"{model_dir}: {', '.join(missing)} missing: not a ModernBERT sequence-classification "
                              f"(cross-encoder) checkpoint")
    # the encoder's tensors (every name outside head. and classifier.) are the encoder loader's
    encoder_part = [re.compile(r"(?!head\.|classifier\.).*")]
    arrays = _collect(model_dir, files, expected, encoder_part, lambda name: name, "a ModernBERT classification head")
    zeros = np.zeros((h,), np.float32)
    norm = (arrays["head.norm.weight"], arrays.get("head.norm.bias", zeros), config.layer_norm_eps)
    return (HeadLayer(arrays["head.dense.weight"], arrays.get("head.dense.bias", zeros),
                      config.classifier_activation, norm),
            HeadLayer(arrays["classifier.weight"], arrays["classifier.bias"], "identity"))


# ---------------------------------------------------------------- GPT-2 name table

# HF name (after an optional "transformer." prefix) -> (slot, shape). Conv1D weights are stored
# [in, out]; they are transposed to the (out, in) layout of ops.matmul after loading.
GPT2_EMBEDDING_NAMES = {
    "wte.weight": ("wte", lambda c: (c.vocab_size, c.n_embd)),
    "wpe.weight": ("wpe", lambda c: (c.n_positions, c.n_embd)),
    "ln_f.weight": ("ln_f_gamma", lambda c: (c.n_embd,)),
    "ln_f.bias": ("ln_f_beta", lambda c: (c.n_embd,)),
}
GPT2_LM_HEAD = "lm_head.weight"
GPT2_LAYER_NAMES = {
    "h.{i}.ln_1.weight": ("ln1_gamma", lambda c: (c.n_embd,)),
    "h.{i}.ln_1.bias": ("ln1_beta", lambda c: (c.n_embd,)),
    "h.{i}.attn.c_attn.weight": ("qkv_weight", lambda c: (c.n_embd, 3 * c.n_embd)),
    "h.{i}.attn.c_attn.bias": ("qkv_bias", lambda c: (3 * c.n_embd,)),
    "h.{i}.attn.c_proj.weight": ("attn_out_weight", lambda c: (c.n_embd, c.n_embd)),
    "h.{i}.attn.c_proj.bias": ("attn_out_bias", lambda c: (c.n_embd,)),
    "h.{i}.ln_2.weight": ("ln2_gamma", lambda c: (c.n_embd,)),
    "h.{i}.ln_2.bias": ("ln2_beta", lambda c: (c.n_embd,)),
    "h.{i}.mlp.c_fc.weight": ("fc_weight", lambda c: (c.n_embd, c.n_inner)),
    "h.{i}.mlp.c_fc.bias": ("fc_bias", lambda c: (c.n_inner,)),
    "h.{i}.mlp.c_proj.weight": ("proj_weight", lambda c: (c.n_inner, c.n_embd)),
    "h.{i}.mlp.c_proj.bias": ("proj_bias", lambda c: (c.n_embd,)),
}
GPT2_TRANSPOSED = ("qkv_weight", "attn_out_weight", "fc_weight", "proj_weight")
# causal-mask buffers that old checkpoints saved with the weights
GPT2_IGNORED = [re.compile(p) for p in (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",)]
GPT2_PREFIX = "transformer."


@dataclass
class GPT2LayerWeights:
    ln1_gamma: np.ndarray        # (E,)
    ln1_beta: np.ndarray         # (E,)
    qkv_weight: np.ndarray       # (3E, E)
    qkv_bias: np.ndarray         # (3E,)
    attn_out_weight: np.ndarray  # (E, E)
    attn_out_bias: np.ndarray    # (E,)
    ln2_gamma: np.ndarray        # (E,)
    ln2_beta: np.ndarray         # (E,)
    fc_weight: np.ndarray        # (I, E)
    fc_bias: np.ndarray          # (I,)
    proj_weight: np.ndarray      # (E, I)
    proj_bias: np.ndarray        # (E,)


@dataclass
class GPT2Weights:
    wte: np.ndarray         # (V, E)
    wpe: np.ndarray         # (P, E)
    ln_f_gamma: np.ndarray  # (E,)
    ln_f_beta: np.ndarray   # (E,)
    lm_head: np.ndarray     # (V, E): wte itself when tied
    layers: list            # n_layer x GPT2LayerWeights


def load_gpt2_weights(model_dir: Path, config, *, views: bool = False) -> GPT2Weights:
    """The checkpoint's weights as float32 host arrays, the Conv1D matrices (GPT2_TRANSPOSED) laid out
    as (out, in): contiguous copies, or with views=True transposed views of the stored ones, for a
    backend that lays them out as it uploads them (CUDA's to_device, on the device)."""
    files = SafetensorsFiles(model_dir)
    has_head = GPT2_LM_HEAD in files.names()
    names = dict(GPT2_EMBEDDING_NAMES)
    if has_head:
        names[GPT2_LM_HEAD] = ("lm_head", lambda c: (c.vocab_size, c.n_embd))
    elif not config.tie_word_embeddings:
        raise CheckpointError(f"{model_dir}: {GPT2_LM_HEAD} is missing and tie_word_embeddings is false")
    expected = _expected(names, GPT2_LAYER_NAMES, config.n_layer, config)

    def canonical(name):
        return name[len(GPT2_PREFIX):] if name.startswith(GPT2_PREFIX) else name

    arrays = _collect(model_dir, files, expected, GPT2_IGNORED, canonical, f"a GPT-2 with {config.n_layer} layers")
    top, layers = _slots(arrays, expected, config.n_layer)
    if not has_head:
        top["lm_head"] = top["wte"]
    for parts in layers:
        for slot in GPT2_TRANSPOSED:
            parts[slot] = parts[slot].T if views else np.ascontiguousarray(parts[slot].T)
    return GPT2Weights(layers=[GPT2LayerWeights(**parts) for parts in layers], **top)
