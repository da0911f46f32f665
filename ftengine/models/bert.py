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


def bucket_shape(b: int, s: int, *, max_seq_len: int, max_batch_tokens: int) -> tuple[int, int]:
    """The padded shape a (b, s) batch runs at: s up to a multiple of 16, b up to a power of two
    (multiples of 16 past 16), within the limits (b * s itself must fit them).
    Few distinct shapes -> few CUDA graphs."""
    s_pad = min(max_seq_len, -(-s // 16) * 16)
    if b * s_pad > max_batch_tokens:
        s_pad = s
    b_pad = 1 << (b - 1).bit_length() if b <= 16 else -(-b // 16) * 16
    b_pad = max(b, min(b_pad, max_batch_tokens // s_pad))
    return b_pad, s_pad


class BertRunner:
    """BERT for fixed limits: weights uploaded once, every activation in one Workspace, each
    padded batch shape run as one captured graph on the CUDA backend (graphs=False: direct)."""

    def __init__(self, config: BertConfig, weights: BertWeights, ops, *, dtype: str,
                 max_batch_tokens: int, max_seq_len: int, graphs: bool = True):
        if max_seq_len > config.max_position_embeddings:
            raise InputError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        if max_batch_tokens < max_seq_len:
            raise InputError(f"batch_tokens {max_batch_tokens} must be at least max_length {max_seq_len}")
        self.config = config
        self.ops = ops
        self.dtype = ops.storage_dtype(dtype)
        self.max_batch_tokens = max_batch_tokens
        self.max_seq_len = max_seq_len
        self.graphs = ops.GraphCache(enabled=graphs)
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
            "inputs": (4 * t, np.int32),               # ids, token types, positions (T each), lengths (B)
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
            "pooled": (t * len(POOLING_ORDER) * h, np.float32),  # (B, modes*H), float32 on every backend
        })
        # host staging for "inputs" (pinned on the CUDA backend): one copy per batch
        self.staging = ops.pinned_empty((4 * t,), np.int32)

    def padded_shape(self, b: int, s: int) -> tuple[int, int]:
        return bucket_shape(b, s, max_seq_len=self.max_seq_len, max_batch_tokens=self.max_batch_tokens)

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

    def _inputs(self, b: int, s: int):
        """Views of the "inputs" entry for a (b, s) batch: ids, token types, positions (b*s each), lengths (b)."""
        t = b * s
        flat = self.ws.view("inputs", (3 * t + b,))
        return flat[:t], flat[t:2 * t], flat[2 * t:3 * t], flat[3 * t:]

    def _load_inputs(self, batch: Batch) -> tuple[int, int]:
        """Check the batch, pad it to its bucket shape and copy it, in one transfer, into the
        fixed device buffer. Padding sequences get length 1 so every kernel stays on its normal path."""
        self.check(batch)
        b, s = batch.shape
        bp, sp = self.padded_shape(b, s)
        t = bp * sp
        st = self.staging[:3 * t + bp]
        ids, types, positions = (st[i * t:(i + 1) * t].reshape(bp, sp) for i in range(3))
        lengths = st[3 * t:]
        ids.fill(self.config.pad_token_id)
        types.fill(0)
        ids[:b, :s] = batch.ids
        types[:b, :s] = batch.token_types
        positions[:] = np.arange(sp, dtype=np.int32)
        lengths.fill(1)
        lengths[:b] = batch.lengths
        self.ops.copy_from_host(self.ws.view("inputs", (3 * t + bp,)), st)
        return bp, sp

    def _encoder_layers(self, b: int, s: int):
        """Embedding + all layers on the loaded inputs; hidden states end in ws "hidden"."""
        ops, c, ws = self.ops, self.config, self.ws
        t, h, heads = b * s, c.hidden_size, c.num_attention_heads
        d = c.head_dim
        ids, token_types, positions, lengths = self._inputs(b, s)
        hidden = ws.view("hidden", (t, h))
        qkv = ws.view("qkv", (t, 3 * h))
        q, k, v = (ws.view(n, (b * heads, s, d)) for n in ("q", "k", "v"))
        scores = ws.view("scores", (b * heads, s, s))
        ctx = ws.view("ctx", (b * heads, s, d))
        merged = ws.view("merged", (t, h))
        proj = ws.view("proj", (t, h))
        attn_ln = ws.view("attn_ln", (t, h))
        inter = ws.view("inter", (t, c.intermediate_size))

        ops.embed_layernorm(hidden, ids, token_types, positions, self.word_emb, self.pos_emb,
                            self.type_emb, *self.emb_ln, eps=c.layer_norm_eps)
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

    def _pool(self, b: int, s: int, pooling: tuple, normalize: bool):
        h = self.config.hidden_size
        pooled = self.ws.view("pooled", (b, len(pooling) * h))
        self.ops.pool(pooled, self.ws.view("hidden", (b * s, h)), self._inputs(b, s)[3],
                      seq=s, modes=pooling)
        if normalize:
            self.ops.l2_normalize(pooled, pooled)

    def hidden_states(self, batch: Batch) -> np.ndarray:
        """Last hidden states (B, S, H) as float32 on the host (padding positions included)."""
        b, s = batch.shape
        bp, sp = self._load_inputs(batch)
        self.graphs.run(("hidden", bp, sp), lambda: self._encoder_layers(bp, sp))
        hidden = self.ops.to_host(self.ws.view("hidden", (bp, sp, self.config.hidden_size)))
        return hidden[:b, :s].astype(np.float32)

    def embed(self, batch: Batch, *, pooling: tuple, normalize: bool) -> np.ndarray:
        """Pooled (and optionally L2-normalised) embeddings, (B, len(pooling)*H) float32 on the host."""
        b, _ = batch.shape
        bp, sp = self._load_inputs(batch)

        def forward():
            self._encoder_layers(bp, sp)
            self._pool(bp, sp, pooling, normalize)

        self.graphs.run(("embed", bp, sp, pooling, normalize), forward)
        pooled = self.ws.view("pooled", (bp, len(pooling) * self.config.hidden_size))
        return self.ops.to_host(pooled)[:b].astype(np.float32)
