"""Model configurations, built key by key from a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

# model_type -> encoder family: each family is the BERT layer stack with its own config keys,
# weight names and position numbering
ENCODER_FAMILIES = {
    "bert": "bert",
    "roberta": "roberta",
    "xlm-roberta": "roberta",
    "camembert": "roberta",
    "distilbert": "distilbert",
    "mpnet": "mpnet",
    "modernbert": "modernbert",
}
SUPPORTED_BERT_TYPES = tuple(ENCODER_FAMILIES)
# hidden_act value -> the GELU form the ops implement
GELU_FORMS = {
    "gelu": "erf",
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
}
SUPPORTED_POSITION_TYPES = ("absolute",)
# ModernBERT's classifier_pooling values -> the pooling mode its ...ForSequenceClassification uses
CLASSIFIER_POOLING = {"cls": "cls", "mean": "mean"}
# its classifier_activation values -> the head activation (ops.dense)
CLASSIFIER_ACTIVATIONS = {"gelu": "gelu", "tanh": "tanh", "relu": "relu"}


def read_json(path: Path, what: str) -> dict:
    """Parse a JSON object from `path`, naming the file in every error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


HEAD_ARCHITECTURES = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification"}
HEAD_TASKS = {"sequence": "classify / rerank", "token": "ner"}


def head_architecture(data: dict, head: str) -> str | None:
    """The first architecture config.json (`data`) names with classification head `head`
    ("sequence": ...ForSequenceClassification, "token": ...ForTokenClassification), or None."""
    return next((str(a) for a in data.get("architectures") or () if str(a).endswith(HEAD_ARCHITECTURES[head])), None)


def check_head_architecture(path, data: dict, head: str):
    """Refuse a checkpoint whose config.json names the other classification head in its
    architectures: head "sequence" (classify, rerank) or "token" (ner). Both heads are a
    `classifier` of the same shape in BERT-family checkpoints, so the wrong one would run on the
    wrong outputs without a word. No architectures named: nothing to check."""
    other = "token" if head == "sequence" else "sequence"
    named = head_architecture(data, other)
    if named:
        raise ConfigError(f"{path}: config.json names {named}, a {other}-classification model "
                          f"({HEAD_TASKS[other]}); {HEAD_TASKS[head]} needs a ...{HEAD_ARCHITECTURES[head]} checkpoint")


class _Keys:
    """Typed access to config.json values; every error names the file and the key."""

    def __init__(self, data: dict, path: Path):
        self.data = data
        self.path = path

    def _check(self, key, value, kind):
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(
                f"{self.path}: key {key!r} must be {kind.__name__}, found {value!r}"
            )
        return value

    def required(self, key, kind):
        if key not in self.data:
            raise ConfigError(f"{self.path}: required key {key!r} is missing")
        return self._check(key, self.data[key], kind)

    def optional(self, key, kind, default):
        value = self.data.get(key)
        return default if value is None else self._check(key, value, kind)

    def positive_float(self, key, default):
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{self.path}: key {key!r} must be a number > 0, found {value!r}")
        return float(value)

    def width_and_heads(self, width_key: str, heads_key: str) -> tuple[int, int]:
        width, heads = self.positive(width_key), self.positive(heads_key)
        if width % heads:
            raise ConfigError(f"{self.path}: {width_key} {width} is not divisible by {heads_key} {heads}")
        return width, heads

    def positive(self, key):
        return self.at_least(key, 1)

    def at_least(self, key, minimum: int, default: int | None = None) -> int:
        """An int >= minimum; required when default is None."""
        value = self.required(key, int) if default is None else self.optional(key, int, default)
        if value < minimum:
            raise ConfigError(f"{self.path}: key {key!r} must be >= {minimum}, found {value}")
        return value

    def one_of(self, key, choices, default: str | None = None) -> str:
        """A string among `choices`; required when default is None."""
        value = self.required(key, str) if default is None else self.optional(key, str, default)
        if value not in choices:
            raise ConfigError(f"{self.path}: {key} {value!r} is not supported; supported: {', '.join(choices)}")
        return value


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int                # 30522
    hidden_size: int               # 768 (384 for all-MiniLM-L6-v2)
    num_hidden_layers: int         # 12
    num_attention_heads: int       # 12
    intermediate_size: int         # 3072
    max_position_embeddings: int   # 512
    type_vocab_size: int           # 2
    layer_norm_eps: float          # 1e-12
    gelu: str                      # "erf" or "tanh", from hidden_act
    pad_token_id: int              # 0
    family: str = "bert"           # a value of ENCODER_FAMILIES
    # RoBERTa numbers positions from pad_token_id + 1: token i reads row i + position_offset of
    # the stored table, which has max_position_embeddings + position_offset rows
    position_offset: int = 0
    # MPNet: buckets of the relative position bias added to every layer's attention scores (0: none)
    relative_buckets: int = 0
    # ModernBERT: pre-LayerNorm layers with a GeGLU MLP, rotary positions (theta of the global
    # and of the local layers), layer i local (sliding window) where local_layers[i]: query q sees
    # keys k with |k - q| <= window; which linears and LayerNorms have a bias; the
    # ...ForSequenceClassification head's pooling, activation and dense bias
    rotary_theta: tuple = ()
    local_layers: tuple = ()
    window: int = 0
    attention_bias: bool = True
    mlp_bias: bool = True
    norm_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_activation: str = "tanh"
    classifier_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict, path: Path) -> "BertConfig":
        keys = _Keys(data, path)
        model_type = keys.required("model_type", str)
        if model_type not in ENCODER_FAMILIES:
            raise ConfigError(
                f"{path}: model_type {model_type!r} is not supported by the encoder; "
                f"supported: {', '.join(SUPPORTED_BERT_TYPES)}"
            )
        family = ENCODER_FAMILIES[model_type]
        if family == "distilbert":
            return cls._distilbert(keys, path)
        if family == "modernbert":
            return cls._modernbert(keys, path)
        act = keys.one_of("hidden_act", GELU_FORMS)
        keys.one_of("position_embedding_type", SUPPORTED_POSITION_TYPES, "absolute")
        hidden, heads = keys.width_and_heads("hidden_size", "num_attention_heads")
        eps = keys.positive_float("layer_norm_eps", 1e-12)
        numbered_from_pad = family in ("roberta", "mpnet")
        pad = keys.optional("pad_token_id", int, 1 if numbered_from_pad else 0)
        offset = pad + 1 if numbered_from_pad else 0
        positions = keys.positive("max_position_embeddings")
        if positions <= offset + 1:
            raise ConfigError(f"{path}: max_position_embeddings {positions} leaves no positions after the "
                              f"first {offset} (RoBERTa numbers positions from pad_token_id + 1 = {offset})")
        return cls(
            vocab_size=keys.positive("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=keys.positive("num_hidden_layers"),
            num_attention_heads=heads,
            intermediate_size=keys.positive("intermediate_size"),
            max_position_embeddings=positions - offset,
            type_vocab_size=1 if family == "mpnet" else keys.optional("type_vocab_size", int,
                                                                      1 if family == "roberta" else 2),
            layer_norm_eps=eps,
            gelu=GELU_FORMS[act],
            pad_token_id=pad,
            family=family,
            position_offset=offset,
            relative_buckets=keys.positive("relative_attention_num_buckets") if family == "mpnet" else 0,
        )

    @classmethod
    def _distilbert(cls, keys: _Keys, path: Path) -> "BertConfig":
        """DistilBERT's own keys (dim, hidden_dim, n_heads, n_layers, activation); no token
        types; LayerNorm eps fixed at 1e-12 by its modelling code."""
        if keys.data.get("sinusoidal_pos_embds"):
            raise ConfigError(f"{path}: sinusoidal_pos_embds=true is not supported (learned positions only)")
        act = keys.one_of("activation", GELU_FORMS, "gelu")
        hidden, heads = keys.width_and_heads("dim", "n_heads")
        return cls(
            vocab_size=keys.positive("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=keys.positive("n_layers"),
            num_attention_heads=heads,
            intermediate_size=keys.positive("hidden_dim"),
            max_position_embeddings=keys.positive("max_position_embeddings"),
            type_vocab_size=1,
            layer_norm_eps=1e-12,
            gelu=GELU_FORMS[act],
            pad_token_id=keys.optional("pad_token_id", int, 0),
            family="distilbert",
        )

    @classmethod
    def _modernbert(cls, keys: _Keys, path: Path) -> "BertConfig":
        """ModernBERT's keys as the Hub's config.json files have them (global_attn_every_n_layers,
        local_attention, global_rope_theta / local_rope_theta), or as transformers 5 saves them
        (layer_types, rope_parameters); HF's defaults for absent keys."""
        data = keys.data
        act = keys.one_of("hidden_activation", GELU_FORMS, "gelu")
        hidden, heads = keys.width_and_heads("hidden_size", "num_attention_heads")
        layers = keys.positive("num_hidden_layers")
        if data.get("rope_scaling") is not None:
            raise ConfigError(f"{path}: rope_scaling is not supported (default rotary embeddings only)")
        types = data.get("layer_types")
        if types is None:
            every = keys.at_least("global_attn_every_n_layers", 1, 3)
            types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
        layer_kinds = ("full_attention", "sliding_attention")
        if not isinstance(types, list) or len(types) != layers or any(t not in layer_kinds for t in types):
            raise ConfigError(f"{path}: key 'layer_types' must list {layers} of {', '.join(layer_kinds)}, "
                              f"found {types!r}")
        theta = {"full_attention": keys.positive_float("global_rope_theta", 160000.0),
                 "sliding_attention": keys.positive_float("local_rope_theta", 10000.0)}
        rope = keys.optional("rope_parameters", dict, {})
        for kind, params in rope.items():
            if kind not in layer_kinds or not isinstance(params, dict):
                raise ConfigError(f"{path}: rope_parameters[{kind!r}] is not supported; supported: "
                                  f"{', '.join(layer_kinds)}, each an object")
            if params.get("rope_type", "default") != "default":
                raise ConfigError(f"{path}: rope_parameters[{kind!r}] rope_type {params['rope_type']!r} is not "
                                  f"supported; supported: default")
            value = params.get("rope_theta", theta[kind])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{path}: rope_parameters[{kind!r}] rope_theta must be a number > 0, found {value!r}")
            theta[kind] = float(value)
        local = keys.at_least("local_attention", 2, 128)
        pooling = keys.one_of("classifier_pooling", CLASSIFIER_POOLING, "cls")
        head_act = keys.one_of("classifier_activation", CLASSIFIER_ACTIVATIONS, "gelu")
        positions = keys.at_least("max_position_embeddings", 2, 8192)
        flags = {k: keys.optional(k, bool, False) for k in ("attention_bias", "mlp_bias", "norm_bias",
                                                             "classifier_bias")}
        return cls(
            vocab_size=keys.positive("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=keys.positive("intermediate_size"),
            max_position_embeddings=positions,
            type_vocab_size=1,
            layer_norm_eps=keys.positive_float("norm_eps", 1e-5),
            gelu=GELU_FORMS[act],
            pad_token_id=keys.optional("pad_token_id", int, 50283),
            family="modernbert",
            rotary_theta=(theta["full_attention"], theta["sliding_attention"]),
            local_layers=tuple(t == "sliding_attention" for t in types),
            window=local // 2,
            classifier_pooling=CLASSIFIER_POOLING[pooling],
            classifier_activation=CLASSIFIER_ACTIVATIONS[head_act],
            **flags,
        )


def load_bert_config(model_dir: Path) -> BertConfig:
    path = Path(model_dir) / "config.json"
    return BertConfig.from_dict(read_json(path, "model config"), path)


SUPPORTED_GPT2_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int                # 50257
    n_positions: int               # 1024
    n_embd: int                    # 768
    n_layer: int                   # 12
    n_head: int                    # 12
    n_inner: int                   # 3072 (config null -> 4 * n_embd)
    gelu: str                      # "tanh" for gelu_new
    layer_norm_epsilon: float      # 1e-5
    tie_word_embeddings: bool      # True: lm_head shares wte
    bos_token_id: int | None       # 50256
    eos_token_ids: tuple           # (50256,): any of them ends a sequence
    pad_token_id: int | None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_dict(cls, data: dict, path: Path, generation: dict | None = None) -> "GPT2Config":
        keys = _Keys(data, path)
        model_type = keys.required("model_type", str)
        if model_type != "gpt2":
            raise ConfigError(f"{path}: model_type {model_type!r} is not supported by the generator; supported: gpt2")
        act = keys.one_of("activation_function", SUPPORTED_GPT2_ACTIVATIONS, "gelu_new")
        for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if data.get(flag):
                raise ConfigError(f"{path}: {flag}=true is not supported")
        if data.get("scale_attn_weights") is False:
            raise ConfigError(f"{path}: scale_attn_weights=false is not supported")
        n_embd, n_head = keys.width_and_heads("n_embd", "n_head")
        inner = data.get("n_inner")
        if inner is not None and (not isinstance(inner, int) or isinstance(inner, bool) or inner < 1):
            raise ConfigError(f"{path}: key 'n_inner' must be a positive int or null, found {inner!r}")
        ids = {}
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = (generation or {}).get(name, data.get(name))
            values = value if isinstance(value, list) else ([] if value is None else [value])
            if name != "eos_token_id" and len(values) > 1:
                raise ConfigError(f"{path}: {name} must be one int, found {value!r}")
            for v in values:
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ConfigError(f"{path}: {name} must be a non-negative int, found {value!r}")
            ids[name] = tuple(values)
        ids["eos_token_ids"] = ids.pop("eos_token_id")
        ids["bos_token_id"] = ids["bos_token_id"][0] if ids["bos_token_id"] else None
        ids["pad_token_id"] = ids["pad_token_id"][0] if ids["pad_token_id"] else None
        return cls(
            vocab_size=keys.positive("vocab_size"),
            n_positions=keys.positive("n_positions"),
            n_embd=n_embd,
            n_layer=keys.positive("n_layer"),
            n_head=n_head,
            n_inner=inner or 4 * n_embd,
            gelu=SUPPORTED_GPT2_ACTIVATIONS[act],
            layer_norm_epsilon=keys.positive_float("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
            **ids,
        )


def load_gpt2_config(model_dir: Path) -> GPT2Config:
    path = Path(model_dir) / "config.json"
    gen_path = Path(model_dir) / "generation_config.json"
    generation = read_json(gen_path, "generation config") if gen_path.is_file() else None
    return GPT2Config.from_dict(read_json(path, "model config"), path, generation)


# encoder-decoder activation_function -> the feed-forward's activation (add_bias_act / erf GELU)
SEQ2SEQ_ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}
# model_type -> (pre-LayerNorm layers with a final LayerNorm per stack, LayerNorm after the
# embedding, positions: "sinusoidal" (Marian's), "fairseq" (sinusoids offset past the pad id) or
# "learned" (offset by 2, BART's))
SEQ2SEQ_FAMILIES = {"marian": (False, False, "sinusoidal"), "bart": (False, True, "learned"),
                    "mbart": (True, True, "learned"), "m2m_100": (True, False, "fairseq"),
                    "t5": (True, False, "relative"), "mt5": (True, False, "relative")}
T5_FEED_FORWARD = {"relu": ("relu", False), "gated-gelu": ("gelu_tanh", True)}  # -> (activation, gated)
T5_DEFAULT_LENGTH = 512  # T5 has no position table; its tokenizers' model_max_length
LEARNED_POSITION_OFFSET = 2
# generation_config.json fields the encoder-decoders use, read as the defaults of each call
GENERATION_FIELDS = ("num_beams", "max_length", "max_new_tokens", "min_length", "min_new_tokens", "length_penalty",
                     "no_repeat_ngram_size", "early_stopping", "repetition_penalty", "do_sample", "temperature",
                     "top_k", "top_p", "num_return_sequences", "bad_words_ids", "forced_bos_token_id",
                     "forced_eos_token_id", "renormalize_logits")


@dataclass(frozen=True)
class Seq2SeqConfig:
    model_type: str                # "marian" (Helsinki-NLP opus-mt-*), "bart", "mbart", "m2m_100" (and NLLB)
    vocab_size: int                # 58101 (opus-mt-en-de): the target's vocabulary (the LM head's rows)
    d_model: int                   # 512
    encoder_layers: int            # 6
    decoder_layers: int            # 6
    encoder_heads: int             # 8
    decoder_heads: int             # 8
    encoder_ffn: int               # 2048
    decoder_ffn: int               # 2048
    activation: str                # "silu" (Marian's swish), "relu", "gelu" (erf) or "gelu_tanh" (T5's gelu_new)
    max_positions: int             # 512: the longest source and target
    scale_embedding: bool          # True: token embeddings x sqrt(d_model)
    layer_norm_eps: float          # 1e-5 (torch.nn.LayerNorm's default)
    tie_word_embeddings: bool      # True: the LM head is the shared embedding table
    pad_token_id: int              # 58100
    eos_token_id: int              # 0
    decoder_start_token_id: int    # 58100 (the pad token)
    pre_norm: bool                 # False: LayerNorm after each residual (Marian, BART); True: before, and at the end
    layernorm_embedding: bool      # True: a LayerNorm right after token + position embeddings (BART, mBART)
    positions: str                 # "sinusoidal", "fairseq", "learned" or "relative" (T5: SEQ2SEQ_FAMILIES)
    generation: dict               # generation_config.json's GENERATION_FIELDS, e.g. {"num_beams": 4}
    gated: bool = False            # T5 v1.1 / flan-t5: act(wi_0 x) * (wi_1 x)
    rms_norm: bool = False         # T5: RMS norms without bias
    relative_buckets: int = 0      # T5: relative position buckets of the attention's bias (0: none)
    relative_max_distance: int = 128
    source_vocab_size: int = 0     # Marian with separate vocabularies: the source's (encoder's table); 0: shared
    attention_dim: int = 0         # T5: num_heads x d_kv where not d_model (flan-t5-small: 6 x 64 of 512); 0: d_model

    @property
    def n_positions(self) -> int:  # the target's room, as the generation loop checks it
        return self.max_positions

    @property
    def attention_width(self) -> int:  # the attention's queries, keys, values and context a row
        return self.attention_dim or self.d_model

    @classmethod
    def from_dict(cls, data: dict, path: Path, generation: dict | None = None) -> "Seq2SeqConfig":
        keys = _Keys(data, path)
        model_type = keys.required("model_type", str)
        if model_type not in SEQ2SEQ_FAMILIES:
            raise ConfigError(f"{path}: model_type {model_type!r} is not supported by the translator; supported: "
                              f"{', '.join(SEQ2SEQ_FAMILIES)}")
        separate = data.get("share_encoder_decoder_embeddings") is False
        if separate and model_type != "marian":
            raise ConfigError(f"{path}: separate source and target vocabularies (share_encoder_decoder_embeddings "
                              f"false) are supported for Marian only, not {model_type}")
        if model_type == "marian" and (data.get("normalize_before") or data.get("add_final_layer_norm")):
            raise ConfigError(f"{path}: pre-LayerNorm Marian variants (normalize_before) are not supported")
        shape = _t5_shape(keys) if model_type in ("t5", "mt5") else _bart_shape(keys, data)
        ids = {name: keys.at_least(name, 0) for name in ("pad_token_id", "eos_token_id")}
        start = (generation or {}).get("decoder_start_token_id", data.get("decoder_start_token_id"))
        if start is None:  # HF generate starts with the bos token then; Marian's start is its pad
            start = data.get("bos_token_id", ids["pad_token_id"]) if model_type != "marian" else ids["pad_token_id"]
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ConfigError(f"{path}: decoder_start_token_id must be a non-negative int, found {start!r}")
        # HF reads the generation defaults from config.json where generation_config.json is absent
        defaults = {k: v for k, v in (data if generation is None else generation).items()
                    if k in GENERATION_FIELDS and v is not None}
        source = keys.positive("vocab_size")
        return cls(
            model_type=model_type,
            # HF's vocab_size is the source's; a separate target's is decoder_vocab_size
            vocab_size=keys.positive("decoder_vocab_size") if separate else source,
            source_vocab_size=source if separate else 0,
            **shape,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
            decoder_start_token_id=start,
            pre_norm=SEQ2SEQ_FAMILIES[model_type][0],
            layernorm_embedding=SEQ2SEQ_FAMILIES[model_type][1],
            positions=SEQ2SEQ_FAMILIES[model_type][2],
            generation=defaults,
            **ids,
        )


def _bart_shape(keys: _Keys, data: dict) -> dict:
    """The layer shapes of Marian, BART, mBART and M2M100 configs."""
    d_model, encoder_heads = keys.width_and_heads("d_model", "encoder_attention_heads")
    _, decoder_heads = keys.width_and_heads("d_model", "decoder_attention_heads")
    act = keys.one_of("activation_function", tuple(SEQ2SEQ_ACTIVATIONS), "gelu")
    return dict(d_model=d_model, encoder_layers=keys.positive("encoder_layers"),
                decoder_layers=keys.positive("decoder_layers"), encoder_heads=encoder_heads,
                decoder_heads=decoder_heads, encoder_ffn=keys.positive("encoder_ffn_dim"),
                decoder_ffn=keys.positive("decoder_ffn_dim"), activation=SEQ2SEQ_ACTIVATIONS[act],
                max_positions=keys.positive("max_position_embeddings"),
                scale_embedding=bool(data.get("scale_embedding", False)), layer_norm_eps=1e-5)


def _t5_shape(keys: _Keys) -> dict:
    """T5 / mT5's: heads of d_kv features (together as wide as d_model or not), RMS norms, relative
    position buckets."""
    d_model, heads = keys.positive("d_model"), keys.positive("num_heads")
    width = keys.positive("d_kv") * heads
    proj = keys.one_of("feed_forward_proj", tuple(T5_FEED_FORWARD), "relu")
    layers = keys.positive("num_layers")
    return dict(d_model=d_model, encoder_layers=layers, decoder_layers=keys.at_least("num_decoder_layers", 1, layers),
                encoder_heads=heads, decoder_heads=heads, encoder_ffn=keys.positive("d_ff"),
                decoder_ffn=keys.positive("d_ff"), activation=T5_FEED_FORWARD[proj][0],
                gated=T5_FEED_FORWARD[proj][1], max_positions=keys.at_least("n_positions", 1, T5_DEFAULT_LENGTH),
                scale_embedding=False, layer_norm_eps=keys.positive_float("layer_norm_epsilon", 1e-6),
                rms_norm=True, relative_buckets=keys.at_least("relative_attention_num_buckets", 2, 32),
                relative_max_distance=keys.at_least("relative_attention_max_distance", 2, 128),
                attention_dim=0 if width == d_model else width)


def load_seq2seq_config(model_dir: Path) -> Seq2SeqConfig:
    path = Path(model_dir) / "config.json"
    gen_path = Path(model_dir) / "generation_config.json"
    generation = read_json(gen_path, "generation config") if gen_path.is_file() else None
    return Seq2SeqConfig.from_dict(read_json(path, "model config"), path, generation)
