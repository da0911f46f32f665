"""The BERT encoder, written once against the ops interface.

Padded token layout: a batch of B sequences padded to S slots is (B*S, H), row b*S + s.
All activations live in one Workspace sized for (max_batch_tokens, max_seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checkpoint import BertWeights
from ..config import BertConfig
from ..errors import InputError
from ..tokenizer import POOLING_ORDER
from ..workspace import Workspace


@dataclass
class Batch:
    """Host-side inputs of one padded batch."""
    ids: np.ndarray          # (B, S) int32, padding = pad_token_id
    token_types: np.ndarray  # (B, S) int32
    lengths: np.ndarray      # (B,) int32, real tokens per sequence (>= 1)

    @property
    def shape(self):
        return self.ids.shape


def make_batch(token_lists, type_lists, *, pad_id: int) -> Batch:
    """Pad token id lists (one per sequence) to the longest."""
    b = len(token_lists)
    s = max(len(t) for t in token_lists)
    ids = np.full((b, s), pad_id, dtype=np.int32)
    types = np.zeros((b, s), dtype=np.int32)
    lengths = np.zeros((b,), dtype=np.int32)
    for i, (t, y) in enumerate(zip(token_lists, type_lists)):
        ids[i, :len(t)] = t
        types[i, :len(y)] = y
        lengths[i] = len(t)
    return Batch(ids, types, lengths)


class BertRunner:
    def __init__(self, config: BertConfig, weights: BertWeights, ops, *, dtype,
                 max_batch_tokens: int, max_seq_len: int):
        if max_seq_len > config.max_position_embeddings:
            raise InputError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        if max_batch_tokens < max_seq_len:
            raise InputError(f"batch_tokens {max_batch_tokens} must be at least max_length {max_seq_len}")
        self.config = config
        self.ops = ops
        self.dtype = np.dtype(dtype)
        self.max_batch_tokens = max_batch_tokens
        self.max_seq_len = max_seq_len
        up = lambda a: ops.to_device(a, self.dtype)  # noqa: E731
        self.word_emb = up(weights.word_emb)        # (V, H)
        self.pos_emb = up(weights.pos_emb)          # (P, H)
        self.type_emb = up(weights.type_emb)        # (TV, H)
        self.emb_ln = (up(weights.emb_ln_gamma), up(weights.emb_ln_beta))
        self.layers = [{k: up(v) for k, v in vars(layer).items()} for layer in weights.layers]

        c = config
        t, h, heads = max_batch_tokens, c.hidden_size, c.num_attention_heads
        act = self.dtype
        self.ws = Workspace(ops, {
            "ids": (t, np.int32),                      # (T,)
            "token_types": (t, np.int32),              # (T,)
            "positions": (t, np.int32),                # (T,)
            "lengths": (t, np.int32),                  # (B,), B <= T
            "hidden": (t * h, act),                    # (T, H)
            "qkv": (t * 3 * h, act),                   # (T, 3H)
            "q": (t * h, act),                         # (B*heads, S, D)
            "k": (t * h, act),                         # (B*heads, S, D)
            "v": (t * h, act),                         # (B*heads, S, D)
            "scores": (t * heads * max_seq_len, act),  # (B*heads, S, S), softmax in place
            "ctx": (t * h, act),                       # (B*heads, S, D)
            "merged": (t * h, act),                    # (T, H)
            "proj": (t * h, act),                      # (T, H)
            "attn_ln": (t * h, act),                   # (T, H)
            "inter": (t * c.intermediate_size, act),   # (T, I)
            "pooled": (t * len(POOLING_ORDER) * h, act),  # (B, modes*H)
        })

    def check(self, batch: Batch):
        """Validate a batch on the host before any kernel indexes memory with it."""
        b, s = batch.shape
        c = self.config
        if b * s > self.max_batch_tokens or s > self.max_seq_len:
            raise InputError(
                f"batch {b} x {s} exceeds this runner's limits (max_batch_tokens "
                f"{self.max_batch_tokens}, max_seq_len {self.max_seq_len})"
            )
        if batch.lengths.min(initial=1) < 1 or batch.lengths.max(initial=0) > s:
            raise InputError(f"sequence lengths must be within 1..{s}")
        bad = (batch.ids < 0) | (batch.ids >= c.vocab_size)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise InputError(f"token id {batch.ids[i, j]} (sequence {i}, position {j}) is outside the vocabulary 0..{c.vocab_size - 1}")
        bad = (batch.token_types < 0) | (batch.token_types >= c.type_vocab_size)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise InputError(f"token type {batch.token_types[i, j]} (sequence {i}) is outside 0..{c.type_vocab_size - 1}")

    def hidden_states(self, batch: Batch):
        """Last hidden states (B*S, H) on the backend's device (a workspace view)."""
        self.check(batch)
        ops, c, ws = self.ops, self.config, self.ws
        b, s = batch.shape
        t, h, heads = b * s, c.hidden_size, c.num_attention_heads
        d = c.head_dim
        positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
        inputs = {"ids": batch.ids, "token_types": batch.token_types, "positions": positions}
        for name, host in inputs.items():
            ops.copy_from_host(ws.view(name, (t,)), host.reshape(t))
        lengths = ws.view("lengths", (b,))
        ops.copy_from_host(lengths, batch.lengths)

        hidden = ws.view("hidden", (t, h))
        qkv = ws.view("qkv", (t, 3 * h))
        q, k, v = (ws.view(n, (b * heads, s, d)) for n in ("q", "k", "v"))
        scores = ws.view("scores", (b * heads, s, s))
        ctx = ws.view("ctx", (b * heads, s, d))
        merged = ws.view("merged", (t, h))
        proj = ws.view("proj", (t, h))
        attn_ln = ws.view("attn_ln", (t, h))
        inter = ws.view("inter", (t, c.intermediate_size))

        ops.embed_layernorm(hidden, ws.view("ids", (t,)), ws.view("token_types", (t,)),
                            ws.view("positions", (t,)), self.word_emb, self.pos_emb, self.type_emb,
                            *self.emb_ln, eps=c.layer_norm_eps)
        scale = 1.0 / float(np.sqrt(d))
        for w in self.layers:
            ops.matmul(qkv, hidden, w["qkv_weight"])
            ops.add_qkv_bias_split_heads(q, k, v, qkv, w["qkv_bias"], batch=b, seq=s, heads=heads)
            ops.batched_matmul(scores, q, k, transpose_b=True, alpha=scale)
            ops.masked_softmax(scores, scores, lengths, heads=heads)
            ops.batched_matmul(ctx, scores, v, transpose_b=False)
            ops.merge_heads(merged, ctx, batch=b, seq=s, heads=heads)
            ops.matmul(proj, merged, w["attn_out_weight"])
            ops.add_bias_residual_layernorm(attn_ln, proj, w["attn_out_bias"], hidden,
                                            w["attn_ln_gamma"], w["attn_ln_beta"], eps=c.layer_norm_eps)
            ops.matmul(inter, attn_ln, w["ffn_in_weight"])
            ops.add_bias_gelu(inter, inter, w["ffn_in_bias"], form=c.gelu)
            ops.matmul(proj, inter, w["ffn_out_weight"])
            ops.add_bias_residual_layernorm(hidden, proj, w["ffn_out_bias"], attn_ln,
                                            w["ffn_ln_gamma"], w["ffn_ln_beta"], eps=c.layer_norm_eps)
        return hidden

    def embed(self, batch: Batch, *, pooling: tuple, normalize: bool) -> np.ndarray:
        """Pooled (and optionally L2-normalised) embeddings, (B, len(pooling)*H) float32 on the host."""
        b, s = batch.shape
        hidden = self.hidden_states(batch)
        pooled = self.ws.view("pooled", (b, len(pooling) * self.config.hidden_size))
        self.ops.pool(pooled, hidden, self.ws.view("lengths", (b,)), seq=s, modes=pooling)
        if normalize:
            self.ops.l2_normalize(pooled, pooled)
        return self.ops.to_host(pooled).astype(np.float32)

