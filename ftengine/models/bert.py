"""The BERT encoder, written once against the ops interface, in two token layouts.

packed (default): only real tokens, (T_real, H), from the embedding lookup to pooling;
    sequence b owns rows cu_seqlens[b]..cu_seqlens[b+1] (offsets built on the device) and
    attention is one fused variable-length kernel. Needs head_dim 32, 64 or 128.
padded: B sequences padded to S slots, (B*S, H), row b*S + s; attention through batched
    GEMMs and a masked softmax (FasterTransformer v1). Any head_dim.
All activations live in one Workspace sized for (max_batch_tokens, max_seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..checkpoint import BertWeights
from ..config import BertConfig
from ..errors import InputError
from ..tokenizer import POOLING_ORDER
from ..workspace import Workspace

LAYOUTS = ("packed", "padded")
PACKED_HEAD_DIMS = (32, 64, 128)


@dataclass
class Batch:
    """Host-side inputs of B ragged sequences, their tokens back to back."""
    ids: np.ndarray          # (T,) int32
    token_types: np.ndarray  # (T,) int32
    lengths: np.ndarray      # (B,) int32

    @classmethod
    def from_lists(cls, ids, token_types) -> "Batch":
        """From one list (or array) of token ids and one of token types per sequence."""
        lengths = np.fromiter((len(x) for x in ids), np.int32, len(ids))
        type_lengths = np.fromiter((len(x) for x in token_types), np.int32, len(token_types))
        if not np.array_equal(lengths, type_lengths):
            raise InputError("every sequence needs as many token types as token ids")
        n = int(lengths.sum())
        return cls(np.fromiter(chain.from_iterable(ids), np.int32, n),
                   np.fromiter(chain.from_iterable(token_types), np.int32, n), lengths)

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    def split(self, rows: np.ndarray) -> list:
        """Per-sequence slices of a (T, ...) array laid out like `ids`."""
        return [rows[a:a + n] for a, n in zip(self.starts, self.lengths)]


def padded_arrays(batch: Batch, *, b: int, s: int, pad_id: int):
    """ids, token types (b, s) int32 and lengths (b,); sequences past the batch have length 1."""
    ids = np.full((b, s), pad_id, dtype=np.int32)
    types = np.zeros((b, s), dtype=np.int32)
    lengths = np.ones((b,), dtype=np.int32)
    n = len(batch.lengths)
    lengths[:n] = batch.lengths
    row = np.repeat(np.arange(n), batch.lengths)
    col = np.arange(len(batch.ids)) - np.repeat(batch.starts, batch.lengths)
    ids[row, col] = batch.ids
    types[row, col] = batch.token_types
    return ids, types, lengths


def check_layout(config: BertConfig, layout: str):
    if layout not in LAYOUTS:
        raise InputError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "packed" and config.head_dim not in PACKED_HEAD_DIMS:
        raise InputError(f"the packed layout needs head_dim in {PACKED_HEAD_DIMS}, this model has "
                         f"{config.head_dim}; use the padded layout")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def bucket_padded(b: int, s: int, *, max_seq_len: int, max_batch_tokens: int) -> tuple[int, int]:
    """The padded shape a (b, s) batch runs at: s up to a multiple of 16, b up to a power of two
    (multiples of 16 past 16), within the limits (b * s itself must fit them).
    Few distinct shapes -> few CUDA graphs."""
    s_pad = min(max_seq_len, _round_up(s, 16))
    if b * s_pad > max_batch_tokens:
        s_pad = s
    b_pad = 1 << (b - 1).bit_length() if b <= 16 else _round_up(b, 16)
    return max(b, min(b_pad, max_batch_tokens // s_pad)), s_pad


def bucket_packed(t: int, b: int, s: int, *, max_batch_tokens: int, max_seq_len: int) -> tuple[int, int, int]:
    """(tokens, sequences, longest) a packed batch runs at: tokens up to a multiple of 64 to
    512, then up a ladder of steps of about 19% (2^(1/4)); sequences up to a power of two;
    longest up to a multiple of 64 (the attention kernel's query tile)."""
    t_pad = _round_up(t, 64)
    if t_pad > 512:
        rung = 512
        while rung < t:
            rung = _round_up(int(rung * 2 ** 0.25), 64)
        t_pad = rung
    t_pad = min(t_pad, max_batch_tokens)
    b_pad = min(1 << (b - 1).bit_length(), max_batch_tokens)
    return t_pad, b_pad, min(_round_up(s, 64), max_seq_len)


class BertRunner:
    """BERT for fixed limits: weights uploaded once, every activation in one Workspace, each
    batch shape run as one captured graph on the CUDA backend (graphs=False: direct)."""

    def __init__(self, config: BertConfig, weights: BertWeights, ops, *, dtype: str,
                 max_batch_tokens: int, max_seq_len: int, layout: str = "packed", graphs: bool = True):
        if max_seq_len > config.max_position_embeddings:
            raise InputError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        if max_batch_tokens < max_seq_len:
            raise InputError(f"batch_tokens {max_batch_tokens} must be at least max_length {max_seq_len}")
        check_layout(config, layout)
        self.config = config
        self.ops = ops
        self.layout = layout
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
        table = {
            "inputs": (5 * t + 1, np.int32),           # ids, types, positions (T each), lengths (B), cu_seqlens (B+1)
            "hidden": (t * h, act),                    # (T, H)
            "qkv": (t * 3 * h, act),                   # (T, 3H)
            "ctx": (t * h, act),                       # (T, H): attention output, heads merged
            "proj": (t * h, act),                      # (T, H)
            "attn_ln": (t * h, act),                   # (T, H)
            "inter": (t * c.intermediate_size, act),   # (T, I)
            "pooled": (t * len(POOLING_ORDER) * h, np.float32),  # (B, modes*H), float32 on every backend
        }
        if layout == "padded":
            table.update({
                "q": (t * h, act),                         # (B*heads, S, D)
                "k": (t * h, act),                         # (B*heads, S, D)
                "v": (t * h, act),                         # (B*heads, S, D)
                "scores": (t * heads * max_seq_len, act),  # (B*heads, S, S), softmax in place
                "heads_out": (t * h, act),                 # (B*heads, S, D)
            })
        self.ws = Workspace(ops, table)
        # host staging for "inputs" (pinned on the CUDA backend): one copy per batch
        self.staging = ops.pinned_empty((5 * t + 1,), np.int32)

    # ------------------------------------------------------------ shapes and inputs

    def run_shape(self, batch: Batch) -> tuple:
        """The bucketed shape a batch runs at: (tokens, sequences, longest)."""
        lengths = batch.lengths
        b, s = len(lengths), int(lengths.max())
        if self.layout == "padded":
            bp, sp = bucket_padded(b, s, max_seq_len=self.max_seq_len, max_batch_tokens=self.max_batch_tokens)
            return bp * sp, bp, sp
        return bucket_packed(int(lengths.sum()), b, s, max_batch_tokens=self.max_batch_tokens,
                             max_seq_len=self.max_seq_len)

    def fits(self, count: int, total: int, longest: int) -> bool:
        """Whether `count` sequences of `total` tokens, the longest `longest`, fit one batch."""
        used = count * longest if self.layout == "padded" else total
        return used <= self.max_batch_tokens and longest <= self.max_seq_len

    def check(self, batch: Batch):
        """Validate a batch on the host before any kernel indexes memory with it."""
        c = self.config
        lengths = batch.lengths
        if len(lengths) == 0 or lengths.min() < 1:
            raise InputError("every sequence needs at least one token")
        if not self.fits(len(lengths), int(lengths.sum()), int(lengths.max())):
            raise InputError(
                f"batch of {len(lengths)} sequences, {int(lengths.sum())} tokens, longest {int(lengths.max())}, "
                f"exceeds this runner's limits (max_batch_tokens {self.max_batch_tokens}, max_seq_len {self.max_seq_len})"
            )
        for values, limit, what in ((batch.ids, c.vocab_size, "token id"), (batch.token_types, c.type_vocab_size, "token type")):
            bad = np.flatnonzero((values < 0) | (values >= limit))
            if bad.size:
                seq = int(np.searchsorted(batch.starts, bad[0], side="right")) - 1
                raise InputError(f"{what} {values[bad[0]]} (sequence {seq}, position {bad[0] - batch.starts[seq]}) "
                                 f"is outside 0..{limit - 1}")

    def _inputs(self, t: int, b: int):
        """Views of "inputs" for t tokens and b sequences: ids, types, positions (t each),
        lengths (b), cu_seqlens (b + 1)."""
        flat = self.ws.view("inputs", (3 * t + 2 * b + 1,))
        return flat[:t], flat[t:2 * t], flat[2 * t:3 * t], flat[3 * t:3 * t + b], flat[3 * t + b:]

    def _load_inputs(self, batch: Batch) -> tuple:
        """Check the batch, lay it out at its bucketed shape and copy it, in one transfer, into the
        fixed device buffer. Returns the shape (tokens, sequences, longest)."""
        self.check(batch)
        t, b, s = self.run_shape(batch)
        st = self.staging[:3 * t + b]
        ids, types, positions, lengths = st[:t], st[t:2 * t], st[2 * t:3 * t], st[3 * t:]
        ids.fill(self.config.pad_token_id)
        types.fill(0)
        if self.layout == "padded":
            pid, ptype, plen = padded_arrays(batch, b=b, s=s, pad_id=self.config.pad_token_id)
            ids[:] = pid.reshape(-1)
            types[:] = ptype.reshape(-1)
            positions[:] = np.tile(np.arange(s, dtype=np.int32), b)
            lengths[:] = plen
        else:
            n = len(batch.ids)
            ids[:n] = batch.ids
            types[:n] = batch.token_types
            lengths.fill(0)
            lengths[:len(batch.lengths)] = batch.lengths
        self.ops.copy_from_host(self.ws.view("inputs", (3 * t + b,)), st)
        return t, b, s

    # ------------------------------------------------------------ forward

    def _attention_padded(self, w, t: int, b: int, s: int):
        ops, c, ws = self.ops, self.config, self.ws
        heads, d = c.num_attention_heads, c.head_dim
        lengths = self._inputs(t, b)[3]
        qkv = ws.view("qkv", (t, 3 * c.hidden_size))
        q, k, v = (ws.view(n, (b * heads, s, d)) for n in ("q", "k", "v"))
        scores = ws.view("scores", (b * heads, s, s))
        heads_out = ws.view("heads_out", (b * heads, s, d))
        ctx = ws.view("ctx", (t, c.hidden_size))
        ops.add_qkv_bias_split_heads(q, k, v, qkv, w["qkv_bias"], batch=b, seq=s, heads=heads)
        ops.batched_matmul(scores, q, k, transpose_b=True, alpha=1.0 / float(np.sqrt(d)))
        ops.masked_softmax(scores, scores, lengths, heads=heads)
        ops.batched_matmul(heads_out, scores, v, transpose_b=False)
        ops.merge_heads(ctx, heads_out, batch=b, seq=s, heads=heads)
        return ctx

    def _attention_packed(self, w, t: int, b: int, s: int):
        c, ws = self.config, self.ws
        ctx = ws.view("ctx", (t, c.hidden_size))
        self.ops.varlen_attention(ctx, ws.view("qkv", (t, 3 * c.hidden_size)), w["qkv_bias"],
                                  self._inputs(t, b)[4], heads=c.num_attention_heads, max_seqlen=s)
        return ctx

    def _encoder_layers(self, t: int, b: int, s: int):
        """Embedding + all layers on the loaded inputs; hidden states end in ws "hidden"."""
        ops, c, ws = self.ops, self.config, self.ws
        h = c.hidden_size
        ids, token_types, positions, lengths, cu_seqlens = self._inputs(t, b)
        hidden = ws.view("hidden", (t, h))
        qkv = ws.view("qkv", (t, 3 * h))
        proj = ws.view("proj", (t, h))
        attn_ln = ws.view("attn_ln", (t, h))
        inter = ws.view("inter", (t, c.intermediate_size))
        if self.layout == "packed":
            ops.build_offsets(cu_seqlens, positions, lengths)
        attention = self._attention_packed if self.layout == "packed" else self._attention_padded
        ops.embed_layernorm(hidden, ids, token_types, positions, self.word_emb, self.pos_emb,
                            self.type_emb, *self.emb_ln, eps=c.layer_norm_eps)
        for w in self.layers:
            ops.matmul(qkv, hidden, w["qkv_weight"])
            ctx = attention(w, t, b, s)
            ops.matmul(proj, ctx, w["attn_out_weight"])
            ops.add_bias_residual_layernorm(attn_ln, proj, w["attn_out_bias"], hidden,
                                            w["attn_ln_gamma"], w["attn_ln_beta"], eps=c.layer_norm_eps)
            ops.matmul(inter, attn_ln, w["ffn_in_weight"])
            ops.add_bias_gelu(inter, inter, w["ffn_in_bias"], form=c.gelu)
            ops.matmul(proj, inter, w["ffn_out_weight"])
            ops.add_bias_residual_layernorm(hidden, proj, w["ffn_out_bias"], attn_ln,
                                            w["ffn_ln_gamma"], w["ffn_ln_beta"], eps=c.layer_norm_eps)

    def _pool(self, t: int, b: int, s: int, pooling: tuple, normalize: bool):
        h = self.config.hidden_size
        pooled = self.ws.view("pooled", (b, len(pooling) * h))
        hidden = self.ws.view("hidden", (t, h))
        _, _, _, lengths, cu_seqlens = self._inputs(t, b)
        if self.layout == "packed":
            self.ops.pool_packed(pooled, hidden, cu_seqlens, modes=pooling)
        else:
            self.ops.pool(pooled, hidden, lengths, seq=s, modes=pooling)
        if normalize:
            self.ops.l2_normalize(pooled, pooled)

    def hidden_states(self, batch: Batch) -> list:
        """Last hidden states as float32 host arrays, one (length, H) array per sequence."""
        t, b, s = self._load_inputs(batch)
        self.graphs.run(("hidden", t, b, s), lambda: self._encoder_layers(t, b, s))
        hidden = self.ops.to_host(self.ws.view("hidden", (t, self.config.hidden_size))).astype(np.float32)
        if self.layout == "padded":
            return [hidden[i * s:i * s + n] for i, n in enumerate(batch.lengths)]
        return batch.split(hidden)

    def embed(self, batch: Batch, *, pooling: tuple, normalize: bool) -> np.ndarray:
        """Pooled (and optionally L2-normalised) embeddings, (B, len(pooling)*H) float32 on the host."""
        t, b, s = self._load_inputs(batch)

        def forward():
            self._encoder_layers(t, b, s)
            self._pool(t, b, s, pooling, normalize)

        self.graphs.run(("embed", t, b, s, pooling, normalize), forward)
        pooled = self.ws.view("pooled", (b, len(pooling) * self.config.hidden_size))
        return self.ops.to_host(pooled)[:len(batch.lengths)].astype(np.float32)
