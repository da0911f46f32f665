"""The encoder-decoders' weight-name tables (checkpoint.py reads the files): HF names -> slots,
every tensor consumed or named as ignored, each layer's projections fused for the ops that read
them (self-attention Q, K, V as one (3E, E) product; cross-attention K, V projected from the
encoder's output once per source)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import SafetensorsFiles, _collect, _expected, _slots
from .config import LEARNED_POSITION_OFFSET, Seq2SeqConfig

_E = lambda c: (c.d_model,)  # noqa: E731
_EE = lambda c: (c.d_model, c.d_model)  # noqa: E731


def _attention_names(prefix: str, slot: str) -> dict:
    names = {}
    for proj in ("q", "k", "v", "out"):
        names[f"{prefix}.{proj}_proj.weight"] = (f"{slot}_{proj}_weight", _EE)
        names[f"{prefix}.{proj}_proj.bias"] = (f"{slot}_{proj}_bias", _E)
    return names


def _layer_names(side: str, ffn) -> dict:
    base = f"model.{side}.layers.{{i}}"
    names = {**_attention_names(f"{base}.self_attn", "self"),
             f"{base}.self_attn_layer_norm.weight": ("ln1_gamma", _E),
             f"{base}.self_attn_layer_norm.bias": ("ln1_beta", _E),
             f"{base}.fc1.weight": ("fc1_weight", lambda c: (ffn(c), c.d_model)),
             f"{base}.fc1.bias": ("fc1_bias", lambda c: (ffn(c),)),
             f"{base}.fc2.weight": ("fc2_weight", lambda c: (c.d_model, ffn(c))),
             f"{base}.fc2.bias": ("fc2_bias", _E),
             f"{base}.final_layer_norm.weight": ("ln3_gamma", _E),
             f"{base}.final_layer_norm.bias": ("ln3_beta", _E)}
    if side == "decoder":
        names.update(_attention_names(f"{base}.encoder_attn", "cross"))
        names[f"{base}.encoder_attn_layer_norm.weight"] = ("ln2_gamma", _E)
        names[f"{base}.encoder_attn_layer_norm.bias"] = ("ln2_beta", _E)
    return names


ENCODER_LAYER = _layer_names("encoder", lambda c: c.encoder_ffn)
DECODER_LAYER = _layer_names("decoder", lambda c: c.decoder_ffn)
SHARED = "model.shared.weight"
# Marian with separate vocabularies: the encoder's table (the source's) and the decoder's (the target's)
SIDE_TABLES = {"model.encoder.embed_tokens.weight": ("source_embed", lambda c: (c.source_vocab_size, c.d_model)),
               "model.decoder.embed_tokens.weight": ("embed", lambda c: (c.vocab_size, c.d_model))}
HEAD = "lm_head.weight"
_P = lambda c: (c.max_positions + (LEARNED_POSITION_OFFSET if c.positions == "learned" else 0), c.d_model)  # noqa: E731
# tensors a family may store: Marian's stored sinusoids, BART's learned positions
OPTIONAL = {"final_logits_bias": ("final_logits_bias", lambda c: (1, c.vocab_size)),
            "model.encoder.embed_positions.weight": ("encoder_positions", _P),
            "model.decoder.embed_positions.weight": ("decoder_positions", _P)}
# LayerNorms by the config's flags: after the embedding; at the end of each stack (pre-LayerNorm)
EMBEDDING_NORMS = {f"model.{side}.layernorm_embedding.{p}": (f"{side}_embedding_{slot}", _E)
                   for side in ("encoder", "decoder") for p, slot in (("weight", "gamma"), ("bias", "beta"))}
FINAL_NORMS = {f"model.{side}.layer_norm.{p}": (f"{side}_final_{slot}", _E)
               for side in ("encoder", "decoder") for p, slot in (("weight", "gamma"), ("bias", "beta"))}
# copies of the shared table that checkpoints also save (tied: the same values); M2M100's sinusoid buffers
SHARED_COPIES = re.compile(r"model\.(encoder|decoder)\.embed_tokens\.weight")
IGNORED = [re.compile(r"model\.(encoder|decoder)\.embed_positions\.(weights|_float_tensor)")]


@dataclass
class Seq2SeqWeights:
    embed: np.ndarray              # (V, E): the (target's) token table, x sqrt(E) where scale_embedding
    lm_head: np.ndarray            # (V, E)
    logits_bias: np.ndarray        # (V,) float32: final_logits_bias
    encoder_positions: np.ndarray  # (P, E): row i is source position i's
    decoder_positions: np.ndarray  # (P, E)
    encoder: list                  # per layer: {slot: array} (qkv_weight (3E, E), ...)
    decoder: list                  # per layer, with cross_q_weight (E, E), cross_kv_weight (3E, E: zeros, K, V)
    norms: dict                    # {encoder,decoder}_{embedding,final}_{gamma,beta} as the config has them
    source_embed: np.ndarray | None = None  # (V_source, E) as embed: separate vocabularies; None: embed


def sinusoidal_positions(n: int, dim: int) -> np.ndarray:
    """Marian's static positions (n, dim): sin of position / 10000^(2j / dim) in the first half of the
    features, cos in the second (not interleaved), as HF MarianSinusoidalPositionalEmbedding."""
    j = np.arange(dim)
    angles = np.arange(n)[:, None] / np.power(10000.0, 2 * (j // 2) / dim)[None, :]
    half = dim // 2 + dim % 2
    out = np.empty((n, dim), np.float32)
    out[:, :half] = np.sin(angles[:, 0::2])
    out[:, half:] = np.cos(angles[:, 1::2])
    return out


def fairseq_positions(n: int, dim: int, pad: int) -> np.ndarray:
    """M2M100 / NLLB's positions (n, dim) for source or target positions 0..n-1, which fairseq
    numbers from pad + 1: sin then cos of position x 10000^(-k / (dim/2 - 1)), computed in float32 as
    HF M2M100SinusoidalPositionalEmbedding computes them."""
    half = dim // 2
    rate = np.float32(math.log(10000) / (half - 1))
    freqs = np.exp(np.arange(half, dtype=np.float32) * -rate)
    angles = (np.arange(n, dtype=np.float32) + np.float32(pad + 1))[:, None] * freqs[None, :]
    out = np.zeros((n, dim), np.float32)
    out[:, :half], out[:, half:2 * half] = np.sin(angles), np.cos(angles)
    return out


# an attention's projections: T5 name, slot, shape (queries, keys and values of attention_width, which
# may not be d_model)
T5_ATTENTION = [(x, y, lambda c: (c.attention_width, c.d_model)) for x, y in (("q", "q"), ("k", "k"), ("v", "v"))]
T5_ATTENTION.append(("o", "out", lambda c: (c.d_model, c.attention_width)))


def _t5_layer_names(side: str, gated: bool) -> dict:
    """T5's names -> the slots of BART's layers (no biases: T5 has none)."""
    base = f"{side}.block.{{i}}.layer"
    attention = {f"{base}.0.SelfAttention.{x}.weight": (f"self_{y}_weight", shape)
                 for x, y, shape in T5_ATTENTION}
    ffn_at = 2 if side == "decoder" else 1
    names = {**attention, f"{base}.0.layer_norm.weight": ("ln1_gamma", _E),
             f"{base}.{ffn_at}.DenseReluDense.wo.weight": ("fc2_weight", lambda c: (c.d_model, c.decoder_ffn)),
             f"{base}.{ffn_at}.layer_norm.weight": ("ln3_gamma", _E)}
    inputs = ("wi_0", "wi_1") if gated else ("wi",)
    names.update({f"{base}.{ffn_at}.DenseReluDense.{w}.weight": (f"fc1_{w}", lambda c: (c.decoder_ffn, c.d_model))
                  for w in inputs})
    if side == "decoder":
        names.update({f"{base}.1.EncDecAttention.{x}.weight": (f"cross_{y}_weight", shape)
                      for x, y, shape in T5_ATTENTION})
        names[f"{base}.1.layer_norm.weight"] = ("ln2_gamma", _E)
    return names


def _t5_top_names(config: Seq2SeqConfig) -> dict:
    rel = lambda c: (c.relative_buckets, c.encoder_heads)  # noqa: E731
    names = {"shared.weight": ("embed", lambda c: (c.vocab_size, c.d_model)),
             "encoder.final_layer_norm.weight": ("encoder_final_gamma", _E),
             "decoder.final_layer_norm.weight": ("decoder_final_gamma", _E),
             "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": ("encoder_relative", rel),
             "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": ("decoder_relative", rel)}
    if not config.tie_word_embeddings:
        names[HEAD] = ("lm_head", lambda c: (c.vocab_size, c.d_model))
    return names


T5_IGNORED = [re.compile(p) for p in (r"(encoder|decoder)\.embed_tokens\.weight",)]


def _load_t5(model_dir: Path, config: Seq2SeqConfig) -> Seq2SeqWeights:
    """T5 / mT5 in the runner's slots: zero biases; RMS norms' (zero) betas; each attention's query
    scaled by sqrt(d_kv), which undoes the kernels' 1 / sqrt(d) (T5 does not scale its scores);
    tied heads scaled by d_model^-0.5 as T5 scales its decoder's output; the relative position
    biases (buckets, heads) as float32 in `norms`."""
    files = SafetensorsFiles(model_dir)
    ignored = list(T5_IGNORED)
    if config.tie_word_embeddings:
        ignored.append(re.compile(re.escape(HEAD)))
    encoder = _expected(_t5_top_names(config), _t5_layer_names("encoder", config.gated), config.encoder_layers, config)
    decoder = _expected({}, _t5_layer_names("decoder", config.gated), config.decoder_layers, config)
    what = f"a {config.model_type} model of {config.encoder_layers} + {config.decoder_layers} layers"
    arrays = _collect(Path(model_dir), files, {**encoder, **decoder}, ignored, lambda name: name, what)
    top, encoder_layers = _slots({k: v for k, v in arrays.items() if k in encoder}, encoder, config.encoder_layers)
    _, decoder_layers = _slots({k: v for k, v in arrays.items() if k in decoder}, decoder, config.decoder_layers)
    root = np.float32(math.sqrt(config.attention_width // config.encoder_heads))
    for layer in encoder_layers + decoder_layers:
        for prefix in ("self", "cross"):
            if f"{prefix}_q_weight" in layer:
                layer[f"{prefix}_q_weight"] = layer[f"{prefix}_q_weight"] * root
        inputs = [layer.pop(k) for k in ("fc1_wi_0", "fc1_wi_1", "fc1_wi") if k in layer]
        layer["fc1_weight"] = np.concatenate(inputs)
        for name in [k for k in layer if k.endswith("_weight") and k != "fc1_weight"] + ["fc1_weight"]:
            layer[name.replace("_weight", "_bias")] = np.zeros(layer[name].shape[0], np.float32)
        for norm in ("ln1", "ln2", "ln3"):
            if f"{norm}_gamma" in layer:
                layer[f"{norm}_beta"] = np.zeros(config.d_model, np.float32)
    norms = {k: v for k, v in top.items() if k.endswith("_gamma") or k.endswith("_relative")}
    norms.update({k.replace("_gamma", "_beta"): np.zeros(config.d_model, np.float32)
                  for k in list(norms) if k.endswith("_gamma")})
    table = top["embed"]
    head = top["lm_head"] if "lm_head" in top else table * np.float32(config.d_model ** -0.5)
    no_positions = np.zeros((config.max_positions, config.d_model), np.float32)
    return Seq2SeqWeights(embed=table, lm_head=head, logits_bias=np.zeros(config.vocab_size, np.float32),
                          encoder_positions=no_positions, decoder_positions=no_positions,
                          encoder=[_fuse(p) for p in encoder_layers], decoder=[_fuse(p) for p in decoder_layers],
                          norms=norms)


def load_seq2seq_weights(model_dir: Path, config: Seq2SeqConfig) -> Seq2SeqWeights:
    if config.positions == "relative":
        return _load_t5(model_dir, config)
    files = SafetensorsFiles(model_dir)
    stored = set(files.names())
    separate = config.source_vocab_size > 0
    top_names = dict(SIDE_TABLES) if separate else {SHARED: ("embed", lambda c: (c.vocab_size, c.d_model))}
    optional = dict(OPTIONAL)
    if config.positions == "learned":
        top_names.update({k: optional.pop(k) for k in list(optional) if "embed_positions" in k})
    top_names.update({name: slot for name, slot in optional.items() if name in stored})
    if config.layernorm_embedding:
        top_names.update(EMBEDDING_NORMS)
    if config.pre_norm:
        top_names.update(FINAL_NORMS)
    ignored = IGNORED + ([] if separate else [SHARED_COPIES])
    if HEAD in stored and not config.tie_word_embeddings:
        top_names[HEAD] = ("lm_head", lambda c: (c.vocab_size, c.d_model))
    elif HEAD in stored:
        ignored.append(re.compile(re.escape(HEAD)))
    encoder = _expected(top_names, ENCODER_LAYER, config.encoder_layers, config)
    decoder = _expected({}, DECODER_LAYER, config.decoder_layers, config)
    expected = {**encoder, **decoder}
    what = f"a {config.model_type} model of {config.encoder_layers} + {config.decoder_layers} layers"
    arrays = _collect(Path(model_dir), files, expected, ignored, lambda name: name, what)
    top, encoder_layers = _slots({k: v for k, v in arrays.items() if k in encoder}, encoder, config.encoder_layers)
    _, decoder_layers = _slots({k: v for k, v in arrays.items() if k in decoder}, decoder, config.decoder_layers)
    table = top["embed"]
    scale = np.float32(math.sqrt(config.d_model)) if config.scale_embedding else np.float32(1.0)
    if config.positions == "fairseq":
        positions = fairseq_positions(config.max_positions, config.d_model, config.pad_token_id)
    else:
        positions = sinusoidal_positions(config.max_positions, config.d_model)
    skip = LEARNED_POSITION_OFFSET if config.positions == "learned" else 0
    return Seq2SeqWeights(
        embed=table * scale, lm_head=top.get("lm_head", table),
        logits_bias=top["final_logits_bias"].reshape(-1) if "final_logits_bias" in top
        else np.zeros(config.vocab_size, np.float32),
        encoder_positions=top["encoder_positions"][skip:] if "encoder_positions" in top else positions,
        decoder_positions=top["decoder_positions"][skip:] if "decoder_positions" in top else positions,
        encoder=[_fuse(p) for p in encoder_layers], decoder=[_fuse(p) for p in decoder_layers],
        norms={k: v for k, v in top.items() if "_embedding_" in k or "_final_" in k},
        source_embed=top["source_embed"] * scale if separate else None)


def _fuse(p: dict) -> dict:
    """A layer's slots as the runner reads them: Q, K, V fused; the cross-attention's query as it is
    (cached_attention reads queries alone), its keys and values padded to the (3A, E) layout
    write_kv_cache reads (A the attention's width; Q rows zero)."""
    out = {"qkv_weight": np.concatenate([p.pop(f"self_{x}_weight") for x in "qkv"]),
           "qkv_bias": np.concatenate([p.pop(f"self_{x}_bias") for x in "qkv"]),
           "attn_out_weight": p.pop("self_out_weight"), "attn_out_bias": p.pop("self_out_bias")}
    if "cross_q_weight" in p:
        zeros_w, zeros_b = np.zeros_like(p["cross_q_weight"]), np.zeros_like(p["cross_q_bias"])
        out["cross_q_weight"], out["cross_q_bias"] = p.pop("cross_q_weight"), p.pop("cross_q_bias")
        out["cross_kv_weight"] = np.concatenate([zeros_w, p.pop("cross_k_weight"), p.pop("cross_v_weight")])
        out["cross_kv_bias"] = np.concatenate([zeros_b, p.pop("cross_k_bias"), p.pop("cross_v_bias")])
        out["cross_out_weight"], out["cross_out_bias"] = p.pop("cross_out_weight"), p.pop("cross_out_bias")
    out.update(p)
    return out
