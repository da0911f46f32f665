"""The BERT encoder, written once against the ops interface, in two token layouts; the other
families are deltas on it (RoBERTa / DistilBERT: names and positions; MPNet: a relative position
bias inside attention; ModernBERT: pre-LayerNorm layers, rotary positions, GeGLU, local windows).

packed (default): only real tokens, (T_real, H), from the embedding lookup to pooling;
    sequence b owns rows cu_seqlens[b]..cu_seqlens[b+1] and attention is one fused
    variable-length kernel. Needs head_dim 32, 64 or 128.
padded: B sequences padded to S slots, (B*S, H), row b*S + s; attention through batched
    GEMMs and a masked softmax (FasterTransformer v1). Any head_dim.
All activations live in one Workspace sized for (max_batch_tokens, max_seq_len).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..checkpoint import BertWeights
from ..config import BertConfig
from ..errors import ConfigError, DeviceError, InputError
from ..tokenizer import POOLING_ORDER
from ..workspace import Workspace
from .shapes import fits, round_up, run_shape

LAYOUTS = ("packed", "padded")
PACKED_HEAD_DIMS = (32, 64, 128)
# the kernel sources each layout launches (compiled in parallel when a runner is built)
KERNEL_FILES = {
    "packed": ("embedding.cu", "layernorm.cu", "activation.cu", "attention_varlen.cu", "pooling.cu"),
    "padded": ("embedding.cu", "layernorm.cu", "activation.cu", "attention.cu", "pooling.cu"),
}
# ModernBERT's rotary embeddings and its pre-LayerNorm kernels (shared with GPT-2)
MODERNBERT_FILES = ("rotary.cu", "decoder.cu")
# token_head's labels are padded to a multiple of this: float32 logits rows of whole 32-byte units, as
# cuBLASLt's plans favour (seq2seq.py VOCAB_ALIGN measured unaligned rows slow)
LABEL_ALIGN = 8
# dtype fp8: the products that read a LayerNorm's or the GELU's output take e4m3 operands (weights
# scaled per output channel once at load, activations per token by the kernel that writes them);
# the attention output projection, whose input the attention kernel writes, stays fp16
FP8_WEIGHTS = ("qkv_weight", "ffn_in_weight", "ffn_out_weight")
FP8_FILES = ("fp8.cu",)


def check_fp8(config: BertConfig):
    """Refuse dtype fp8 for a model whose layers it does not cover."""
    if config.family == "modernbert":
        raise ConfigError("dtype fp8 covers the BERT-layout encoders (BERT, RoBERTa, DistilBERT, MPNet); "
                          "ModernBERT runs in fp32, fp16 or bf16")
    odd = [f"{name} {size}" for name, size in (("hidden_size", config.hidden_size),
                                               ("intermediate_size", config.intermediate_size)) if size % 16]
    if odd:
        raise ConfigError(f"dtype fp8 needs hidden_size and intermediate_size divisible by 16 (the rows of cuBLASLt's "
                          f"FP8 operands); this model has {', '.join(odd)}")


def prepare_kernels(config: BertConfig, ops, dtype: str, layout: str):
    """Compile (or load) the kernels a runner of this model launches (ops.prepare_kernels): its
    layout's files, ModernBERT's and fp8's where they apply; the wgmma products for the runners
    whose layers end in them (neither fp8 nor ModernBERT)."""
    modern, fp8 = config.family == "modernbert", dtype == "fp8"
    # ModernBERT's local layers attend within windows, MPNet's layers with a relative bias
    general = tuple(sorted(set(config.local_layers))) if modern else (bool(config.relative_buckets),)
    ops.prepare_kernels(KERNEL_FILES[layout] + (MODERNBERT_FILES if modern else ()) + (FP8_FILES if fp8 else ()), dtype,
                        head_dims=(config.head_dim,), general=general,
                        gelu_product=None if fp8 or modern else config.gelu, ln_product=not (fp8 or modern),
                        rows=(config.hidden_size, config.head_dim, config.intermediate_size))


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

    @classmethod
    def gather(cls, ids: np.ndarray, token_types: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> "Batch":
        """The sequences at starts[i]..starts[i] + lengths[i] of flat id / type arrays, back to back."""
        lengths = np.asarray(lengths, dtype=np.int32)
        ends = np.cumsum(lengths, dtype=np.int64)
        index = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)
        return cls(ids[index], token_types[index], lengths)

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    def split(self, rows: np.ndarray) -> list:
        """Per-sequence slices of a (T, ...) array laid out like `ids`."""
        return [rows[a:a + n] for a, n in zip(self.starts, self.lengths)]


def position_ids(batch: Batch, config: BertConfig, starts=None) -> np.ndarray:
    """(T,) int32: the position-table row of every token. Token i of a sequence reads row
    i + position_offset; RoBERTa and MPNet number positions as transformers does, from the ids: a
    pad id inside a sequence (a text holding the literal pad token) reads row pad_token_id and
    is not counted. starts: batch.starts where the caller has them."""
    starts = batch.starts if starts is None else starts
    within = np.arange(len(batch.ids), dtype=np.int32)
    if len(starts) > 1:
        within -= np.repeat(np.asarray(starts, dtype=np.int32), batch.lengths)
    if not config.position_offset:
        return within
    counted = batch.ids != config.pad_token_id
    if counted.all():
        return within + np.int32(config.position_offset)
    running = np.cumsum(counted)
    before = np.repeat(running[starts] - counted[starts], batch.lengths)  # counted before each sequence
    return np.where(counted, running - before + config.pad_token_id, config.pad_token_id).astype(np.int32)


def padded_grid(values: np.ndarray, batch: Batch, *, b: int, s: int, fill: int) -> np.ndarray:
    """(b, s) int32: each sequence's per-token `values` (laid out like batch.ids) from slot 0,
    `fill` in the padding slots."""
    grid = np.full((b, s), fill, dtype=np.int32)
    row = np.repeat(np.arange(len(batch.lengths)), batch.lengths)
    col = np.arange(len(batch.ids)) - np.repeat(batch.starts, batch.lengths)
    grid[row, col] = values
    return grid


def padded_arrays(batch: Batch, *, b: int, s: int, pad_id: int):
    """ids, token types (b, s) int32 and lengths (b,); sequences past the batch have length 1."""
    lengths = np.ones((b,), dtype=np.int32)
    lengths[:len(batch.lengths)] = batch.lengths
    return (padded_grid(batch.ids, batch, b=b, s=s, fill=pad_id),
            padded_grid(batch.token_types, batch, b=b, s=s, fill=0), lengths)


def relative_position_buckets(max_len: int, num_buckets: int, max_distance: int = 128, *,
                              causal: bool = False) -> np.ndarray:
    """The bucket of each relative position k - q, for k - q = -(max_len-1)..max_len-1 (index
    k - q + max_len - 1), as HF's T5 / MPNet bucketing computes it (in float32, as torch does):
    bidirectional (the encoders: half the buckets for keys after the query), exact below a
    quarter of the buckets, logarithmic up to max_distance; causal (T5's decoder): keys at or
    before the query only, exact below half the buckets."""
    rel = np.arange(-(max_len - 1), max_len, dtype=np.int64)
    if causal:
        ret, n, half = np.zeros_like(rel), np.maximum(-rel, 0), num_buckets
    else:
        half = num_buckets // 2
        ret = (rel > 0).astype(np.int64) * half
        n = np.abs(rel)
    max_exact = half // 2
    scaled = (np.log(np.maximum(n, 1).astype(np.float32) / np.float32(max_exact))
              / np.float32(np.log(max_distance / max_exact)) * np.float32(half - max_exact))
    large = np.minimum(max_exact + scaled.astype(np.int64), half - 1)
    return (ret + np.where(n < max_exact, n, large)).astype(np.int32)


def rotary_tables(max_len: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (max_len, head_dim / 2) float32 of position p times each rotary frequency
    1 / theta^(2i / D), in float32 as HF computes them (the power correctly rounded)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float64(np.float32(theta)) ** exponents.astype(np.float64)).astype(np.float32)
    angles = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def check_layout(config: BertConfig, layout: str):
    if layout not in LAYOUTS:
        raise InputError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "packed" and config.head_dim not in PACKED_HEAD_DIMS:
        raise InputError(f"the packed layout needs head_dim in {PACKED_HEAD_DIMS}, this model has "
                         f"{config.head_dim}; use the padded layout")


def ids_below(values: np.ndarray, limit: int) -> bool:
    """Whether every value lies in 0..limit - 1: one reduction over signed integers (a negative
    one read as unsigned is past any limit), two over others."""
    if values.size == 0:
        return True
    if values.dtype.kind == "i":
        return int(values.view(np.dtype(f"u{values.dtype.itemsize}")).max()) < limit
    return bool(values.min() >= 0 and values.max() < limit)


class BertRunner:
    """BERT for fixed limits: weights uploaded once, every activation in one Workspace, each
    batch shape run as one captured graph on the CUDA backend (graphs=False: direct)."""

    def __init__(self, config: BertConfig, weights: BertWeights, ops, *, dtype: str,
                 max_batch_tokens: int, max_seq_len: int, layout: str = "packed", graphs: bool = True,
                 head: tuple = (), token_head: tuple = ()):
        if max_seq_len > config.max_position_embeddings:
            raise InputError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        check_layout(config, layout)
        self.config = config
        self.ops = ops
        self.layout = layout
        self.fp8 = dtype == "fp8"
        if self.fp8:
            check_fp8(config)
            ops.check_fp8()
        self.dtype = ops.storage_dtype(dtype)
        self.max_seq_len = max_seq_len
        self.modern = config.family == "modernbert"
        prepare_kernels(config, ops, dtype, layout)
        up = lambda a: ops.to_device(a, self.dtype)  # noqa: E731
        self.word_emb = up(weights.word_emb)        # (V, H)
        self.pos_emb = up(weights.pos_emb)          # (P, H)
        self.type_emb = up(weights.type_emb)        # (TV, H)
        self.emb_ln = (up(weights.emb_ln_gamma), up(weights.emb_ln_beta))
        self.layers = [{k: up(v) for k, v in vars(layer).items()} for layer in weights.layers]
        if self.fp8:  # (e4m3 rows, their scales) in place of those weights
            for layer in self.layers:
                for name in FP8_WEIGHTS:
                    layer[name] = self._quantized(layer[name])
        # float32 layers after pooling (sentence-transformers Dense modules), in every dtype
        f32 = lambda a: ops.to_device(np.asarray(a, np.float32), np.float32)  # noqa: E731
        self.head = [(f32(layer.weight), f32(layer.bias), layer.activation,
                      (f32(layer.norm[0]), f32(layer.norm[1]), layer.norm[2]) if layer.norm else ())
                     for layer in head]
        # a token-classification head (weight (labels, H), bias): token_logits runs it on every token,
        # its labels padded to LABEL_ALIGN rows (zero weights; the padding's logits are never read)
        self.token_labels, self.token_head = 0, None
        if token_head:
            weight, bias = (np.asarray(a, np.float32) for a in token_head)
            self.token_labels = len(bias)
            pad = round_up(self.token_labels, LABEL_ALIGN) - self.token_labels
            self.token_head = (up(np.pad(weight, ((0, pad), (0, 0)))), f32(np.pad(bias, (0, pad))))
        self.rel_bias = None
        if config.relative_buckets:  # MPNet: bias table (buckets, heads) and each relative position's bucket
            self.rel_bias = (f32(weights.rel_bias),
                             ops.to_device(relative_position_buckets(max_seq_len, config.relative_buckets)),
                             max_seq_len)
        if self.modern:  # cos / sin tables of the global and the local layers, a zero QKV bias, the final norm
            self.rotary = [tuple(f32(x) for x in rotary_tables(max_seq_len, config.head_dim, theta))
                           for theta in config.rotary_theta]
            self.no_qkv_bias = up(np.zeros(3 * config.hidden_size, np.float32))
            self.final_ln = (up(weights.final_ln_gamma), up(weights.final_ln_beta))
        self._graphs_enabled = graphs
        self.resize(max_batch_tokens)

    def _quantized(self, weight) -> tuple:
        q = self.ops.empty(weight.shape, np.uint8)
        scales = self.ops.empty((weight.shape[0],), np.float32)
        self.ops.quantize_rows(q, scales, weight)
        return q, scales

    def workspace_table(self, max_batch_tokens: int) -> dict:
        """Every activation buffer for batches of up to `max_batch_tokens` tokens."""
        c = self.config
        t, h, heads = max_batch_tokens, c.hidden_size, c.num_attention_heads
        act = self.dtype
        table = {
            "inputs": (5 * t + 1, np.int32),           # ids, types, positions (T each), lengths (B), cu_seqlens (B+1)
            "hidden": (t * h, act),                    # (T, H)
            "qkv": (t * 3 * h, act),                   # (T, 3H)
            "ctx": (t * h, act),                       # (T, H): attention output, heads merged
            "proj": (t * h, act),                      # (T, H)
            "attn_ln": (t * h, act),                   # (T, H)
            "inter": (t * c.intermediate_size * (2 if self.modern else 1), act),  # (T, I), GeGLU: (T, 2I)
            "pooled": (t * len(POOLING_ORDER) * h, np.float32),  # (B, modes*H), float32 on every backend
            "partials": (max(1, self.ops.partials_size(t, h)), np.float32),  # a split product's sums (ops.py)
        }
        if self.modern:
            table["gated"] = (t * c.intermediate_size, act)  # (T, I): the GeGLU's output
        if self.fp8:  # e4m3 product inputs and their per-token scales
            table.update({"x8": (t * h, np.uint8), "x_scales": (t, np.float32),
                          "inter8": (t * c.intermediate_size, np.uint8), "inter_scales": (t, np.float32)})
        if self.token_head is not None:  # (T, padded labels): token_logits' output
            table["token_logits"] = (t * self.token_head[1].shape[0], np.float32)
        if self.head:  # the head's layers, ping-ponging between two (B, widest layer) buffers
            widest = max(layer[0].shape[0] for layer in self.head)
            table.update({"head_a": (t * widest, np.float32), "head_b": (t * widest, np.float32)})
        if self.layout == "padded":
            table.update({
                "q": (t * h, act),                         # (B*heads, S, D)
                "k": (t * h, act),                         # (B*heads, S, D)
                "v": (t * h, act),                         # (B*heads, S, D)
                "scores": (t * heads * self.max_seq_len, act),  # (B*heads, S, S), softmax in place
                "heads_out": (t * h, act),                 # (B*heads, S, D)
            })
        return table

    def resize(self, max_batch_tokens: int):
        """(Re)allocate the workspace for batches of up to `max_batch_tokens` tokens. The weights
        stay; captured graphs are dropped. A size that cannot be allocated is a clear error."""
        if max_batch_tokens < self.max_seq_len:
            raise InputError(f"batch_tokens {max_batch_tokens} must be at least max_length {self.max_seq_len}")
        for pending in getattr(self, "_in_flight", ()):
            pending.wait()  # batches on the device still read the old buffers
        self.ws = self.graphs = self.staging = None  # free the old buffers first
        self._in_flight = deque()
        # per staging slot: its host side (timer events, the results' buffer) and the batch using it
        self._host_slots = [self.ops.HostSlot(), self.ops.HostSlot()]
        self._slot_batches = [None, None]
        table = self.workspace_table(max_batch_tokens)
        try:
            self.ws = Workspace(self.ops, table)
            # host staging for "inputs" (pinned on the CUDA backend) in two slots: the host fills
            # one while the copy from the other may still be in flight
            self.staging = self.ops.pinned_empty((2, 5 * max_batch_tokens + 1), np.int32)
        except MemoryError:
            self.ws = None
            gib = Workspace.bytes_for(table) / 2 ** 30
            raise DeviceError(f"batch_tokens {max_batch_tokens} needs {gib:.1f} GiB of activation buffers, more "
                              f"than the {self.ops.name} backend could allocate; use a smaller batch_tokens") from None
        self.max_batch_tokens = max_batch_tokens
        self.graphs = self.ops.GraphCache(enabled=self._graphs_enabled)
        self._slot = 0

    # ------------------------------------------------------------ shapes and inputs

    def run_shape(self, batch: Batch, totals: tuple = ()) -> tuple:
        """The bucketed shape a batch runs at: (tokens, sequences, longest); totals: the batch's
        (tokens, longest) where the caller has them (check returns them)."""
        return run_shape(self.layout, batch.lengths, max_batch_tokens=self.max_batch_tokens,
                         max_seq_len=self.max_seq_len, totals=totals)

    def fits(self, count: int, total: int, longest: int) -> bool:
        """Whether `count` sequences of `total` tokens, the longest `longest`, fit one batch."""
        return fits(self.layout, count, total, longest, max_batch_tokens=self.max_batch_tokens,
                    max_seq_len=self.max_seq_len)

    def check(self, batch: Batch) -> tuple:
        """Validate a batch on the host before any kernel indexes memory with it. Returns its
        (tokens, longest)."""
        c = self.config
        lengths = batch.lengths
        if len(lengths) <= 64:  # a few sequences: Python's reductions cost less than NumPy's calls
            values = lengths.tolist()
            shortest, longest, total = min(values, default=0), max(values, default=0), sum(values)
        else:
            shortest, longest, total = int(lengths.min()), int(lengths.max()), int(lengths.sum())
        if len(lengths) == 0 or shortest < 1:
            raise InputError("every sequence needs at least one token")
        if not self.fits(len(lengths), total, longest):
            raise InputError(
                f"batch of {len(lengths)} sequences, {total} tokens, longest {longest}, "
                f"exceeds this runner's limits (max_batch_tokens {self.max_batch_tokens}, max_seq_len {self.max_seq_len})"
            )
        for values, limit, what in ((batch.ids, c.vocab_size, "token id"), (batch.token_types, c.type_vocab_size, "token type")):
            if ids_below(values, limit):  # the search only on a bad batch
                continue
            bad = np.flatnonzero((values < 0) | (values >= limit))
            if bad.size:
                seq = int(np.searchsorted(batch.starts, bad[0], side="right")) - 1
                raise InputError(f"{what} {values[bad[0]]} (sequence {seq}, position {bad[0] - batch.starts[seq]}) "
                                 f"is outside 0..{limit - 1}")
        return total, longest

    def _inputs(self, t: int, b: int):
        """Views of "inputs" for t tokens and b sequences: ids, types, positions (t each),
        lengths (b), cu_seqlens (b + 1)."""
        flat = self.ws.view("inputs", (3 * t + 2 * b + 1,))
        return flat[:t], flat[t:2 * t], flat[2 * t:3 * t], flat[3 * t:3 * t + b], flat[3 * t + b:]

    def _load_inputs(self, batch: Batch) -> tuple:
        """Check the batch, lay it out at its bucketed shape (ids, token types, position rows,
        lengths, offsets) and copy it, in one transfer, into the fixed device buffer. Returns
        the shape (tokens, sequences, longest)."""
        totals = self.check(batch)
        t, b, s = self.run_shape(batch, totals)
        st = self.staging[self._slot, :3 * t + 2 * b + 1]
        self._slot ^= 1
        ids, types, positions, lengths, cu_seqlens = (st[:t], st[t:2 * t], st[2 * t:3 * t], st[3 * t:3 * t + b],
                                                      st[3 * t + b:])
        first = self.config.position_offset
        cu_seqlens[0] = 0
        if self.layout == "padded":
            pid, ptype, plen = padded_arrays(batch, b=b, s=s, pad_id=self.config.pad_token_id)
            ppos = padded_grid(position_ids(batch, self.config), batch, b=b, s=s, fill=first)
            ids[:], types[:], positions[:] = pid.reshape(-1), ptype.reshape(-1), ppos.reshape(-1)
            lengths[:] = plen
            np.cumsum(lengths, out=cu_seqlens[1:])
        else:  # tokens past the last sequence (batch padding): pad ids, type 0, the first position row;
            # positions from the sequences' offsets
            n, count = totals[0], len(batch.lengths)
            ids[:n], types[:n], lengths[:count] = batch.ids, batch.token_types, batch.lengths
            if n < t:
                ids[n:], types[n:], positions[n:] = self.config.pad_token_id, 0, first
            if count < b:
                lengths[count:] = 0
            np.cumsum(lengths, out=cu_seqlens[1:])
            positions[:n] = position_ids(batch, self.config, starts=cu_seqlens[:count])
        self.ops.copy_from_host(self.ws.view("inputs", (3 * t + 2 * b + 1,)), st)
        return t, b, s

    # ------------------------------------------------------------ forward

    def _attention_padded(self, w, t: int, b: int, s: int, window: int = 0):
        ops, c, ws = self.ops, self.config, self.ws
        heads, d = c.num_attention_heads, c.head_dim
        lengths = self._inputs(t, b)[3]
        qkv = ws.view("qkv", (t, 3 * c.hidden_size))
        q, k, v = (ws.view(n, (b * heads, s, d)) for n in ("q", "k", "v"))
        scores = ws.view("scores", (b * heads, s, s))
        heads_out = ws.view("heads_out", (b * heads, s, d))
        ctx = ws.view("ctx", (t, c.hidden_size))
        ops.add_qkv_bias_split_heads(q, k, v, qkv, self.no_qkv_bias if self.modern else w["qkv_bias"],
                                     batch=b, seq=s, heads=heads)
        ops.batched_matmul(scores, q, k, transpose_b=True, alpha=1.0 / float(np.sqrt(d)))
        if self.rel_bias is not None:
            table, buckets, max_len = self.rel_bias
            ops.add_relative_bias(scores, table, buckets, heads=heads, max_len=max_len)
        ops.masked_softmax(scores, scores, lengths, heads=heads, window=window)
        ops.batched_matmul(heads_out, scores, v, transpose_b=False)
        ops.merge_heads(ctx, heads_out, batch=b, seq=s, heads=heads)
        return ctx

    def _attention_packed(self, w, t: int, b: int, s: int, window: int = 0):
        c, ws = self.config, self.ws
        ctx = ws.view("ctx", (t, c.hidden_size))
        self.ops.varlen_attention(ctx, ws.view("qkv", (t, 3 * c.hidden_size)),
                                  self.no_qkv_bias if self.modern else w["qkv_bias"], self._inputs(t, b)[4],
                                  heads=c.num_attention_heads, max_seqlen=s, window=window, rel_bias=self.rel_bias)
        return ctx

    def _encoder_layers(self, t: int, b: int, s: int):
        """Embedding + all layers on the loaded inputs; hidden states end in ws "hidden"."""
        if self.modern:
            self._modernbert_layers(t, b, s)
            return
        ops, c, ws = self.ops, self.config, self.ws
        h = c.hidden_size
        ids, token_types, positions = self._inputs(t, b)[:3]
        hidden = ws.view("hidden", (t, h))
        qkv = ws.view("qkv", (t, 3 * h))
        proj = ws.view("proj", (t, h))
        attn_ln = ws.view("attn_ln", (t, h))
        inter = ws.view("inter", (t, c.intermediate_size))
        attention = self._attention_packed if self.layout == "packed" else self._attention_padded
        partials = ws.view("partials", (ws.size("partials"),))
        eps, fp8 = c.layer_norm_eps, self.fp8
        ops.embed_layernorm(hidden, ids, token_types, positions, self.word_emb, self.pos_emb,
                            self.type_emb, *self.emb_ln, eps=eps)
        if fp8:  # e4m3 rows for the products: x8 holds the hidden states', then the attention LayerNorm's
            x8, x_scales = ws.view("x8", (t, h)), ws.view("x_scales", (t,))
            inter8, inter_scales = ws.view("inter8", (t, c.intermediate_size)), ws.view("inter_scales", (t,))
            ops.quantize_rows(x8, x_scales, hidden)

        def layernorm(out, x, bias, residual, gamma, beta, quantize: bool):
            """add_bias_residual_layernorm; quantize: its output also as e4m3 rows into x8."""
            if quantize:
                ops.add_bias_residual_layernorm_quantize(out, x8, x_scales, x, bias, residual, gamma, beta, eps=eps)
            else:
                ops.add_bias_residual_layernorm(out, x, bias, residual, gamma, beta, eps=eps)

        for i, w in enumerate(self.layers):
            after = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if after and not fp8:  # (fp8 weights are (e4m3, scales) pairs: not measured)
                ops.prefetch_l2([after[k] for k in ("qkv_weight", "attn_out_weight", "ffn_in_weight",
                                                    "ffn_out_weight")], rows=t)
            if fp8:
                ops.matmul_fp8(qkv, x8, x_scales, *w["qkv_weight"])
            else:
                ops.matmul(qkv, hidden, w["qkv_weight"])
            ctx = attention(w, t, b, s)
            if fp8:  # the output projection in fp16, its LayerNorm's output also as e4m3 rows
                ops.matmul(proj, ctx, w["attn_out_weight"])
                layernorm(attn_ln, proj, w["attn_out_bias"], hidden, w["attn_ln_gamma"], w["attn_ln_beta"], True)
            else:
                ops.matmul_bias_residual_layernorm(attn_ln, ctx, w["attn_out_weight"], w["attn_out_bias"], hidden,
                                                   w["attn_ln_gamma"], w["attn_ln_beta"], eps=eps, product=proj,
                                                   partials=partials)
            if fp8:  # the bias + GELU writes e4m3 rows only
                ops.matmul_fp8(inter, x8, x_scales, *w["ffn_in_weight"])
                ops.add_bias_gelu_quantize(inter8, inter_scales, inter, w["ffn_in_bias"], form=c.gelu)
                ops.matmul_fp8(proj, inter8, inter_scales, *w["ffn_out_weight"])
                layernorm(hidden, proj, w["ffn_out_bias"], attn_ln, w["ffn_ln_gamma"], w["ffn_ln_beta"],
                          i + 1 < len(self.layers))
            else:
                ops.matmul_bias_gelu(inter, attn_ln, w["ffn_in_weight"], w["ffn_in_bias"], form=c.gelu)
                ops.matmul_bias_residual_layernorm(hidden, inter, w["ffn_out_weight"], w["ffn_out_bias"], attn_ln,
                                                   w["ffn_ln_gamma"], w["ffn_ln_beta"], eps=eps, product=proj,
                                                   partials=partials)

    def _modernbert_layers(self, t: int, b: int, s: int):
        """ModernBERT: embedding norm, then pre-LayerNorm layers (rotary positions, global or
        sliding-window attention, GeGLU MLP), then the final norm, into ws "hidden". Each
        residual add is fused with the LayerNorm after it."""
        ops, c, ws = self.ops, self.config, self.ws
        h = c.hidden_size
        ids, token_types, positions = self._inputs(t, b)[:3]
        hidden = ws.view("hidden", (t, h))
        normed = ws.view("attn_ln", (t, h))
        qkv = ws.view("qkv", (t, 3 * h))
        proj = ws.view("proj", (t, h))
        inter = ws.view("inter", (t, 2 * c.intermediate_size))
        gated = ws.view("gated", (t, c.intermediate_size))
        attention = self._attention_packed if self.layout == "packed" else self._attention_padded
        # no position or type tables: every token reads their one zero row (token type 0)
        ops.embed_layernorm(hidden, ids, token_types, token_types, self.word_emb, self.pos_emb,
                            self.type_emb, *self.emb_ln, eps=c.layer_norm_eps)
        x = hidden  # layer 0 attends to the embeddings themselves
        for i, w in enumerate(self.layers):
            local = c.local_layers[i]
            ops.matmul(qkv, x, w["qkv_weight"])
            ops.rotary_qkv(qkv, w["qkv_bias"], positions, *self.rotary[local], heads=c.num_attention_heads)
            ctx = attention(w, t, b, s, c.window if local else 0)
            ops.matmul(proj, ctx, w["attn_out_weight"])
            ops.residual_layernorm(hidden, normed, proj, w["attn_out_bias"], w["ffn_ln_gamma"], w["ffn_ln_beta"],
                                   eps=c.layer_norm_eps)
            ops.matmul(inter, normed, w["ffn_in_weight"])
            ops.gated_gelu(gated, inter, w["ffn_in_bias"], form=c.gelu)
            ops.matmul(proj, gated, w["ffn_out_weight"])
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                ops.residual_layernorm(hidden, normed, proj, w["ffn_out_bias"], nxt["attn_ln_gamma"],
                                       nxt["attn_ln_beta"], eps=c.layer_norm_eps)
                x = normed
            else:
                ops.add_bias_residual_layernorm(hidden, proj, w["ffn_out_bias"], hidden, *self.final_ln,
                                                eps=c.layer_norm_eps)

    def _output(self, b: int, pooling: tuple):
        """The (B, dim) float32 buffer a batch's embeddings end in: the pooled vectors, or the
        last head layer's output."""
        if not self.head:
            return self.ws.view("pooled", (b, len(pooling) * self.config.hidden_size))
        return self.ws.view("head_b" if len(self.head) % 2 == 0 else "head_a", (b, self.head[-1][0].shape[0]))

    def _pool(self, t: int, b: int, s: int, pooling: tuple, normalize: bool, skip: int):
        h = self.config.hidden_size
        pooled = self.ws.view("pooled", (b, len(pooling) * h))
        hidden = self.ws.view("hidden", (t, h))
        _, _, _, lengths, cu_seqlens = self._inputs(t, b)
        if self.layout == "packed":
            self.ops.pool_packed(pooled, hidden, cu_seqlens, modes=pooling, skip=skip)
        else:
            self.ops.pool(pooled, hidden, lengths, seq=s, modes=pooling, skip=skip)
        x = pooled
        for i, (weight, bias, activation, norm) in enumerate(self.head):
            out = self.ws.view("head_b" if i % 2 else "head_a", (b, weight.shape[0]))
            self.ops.dense(out, x, weight, bias, activation=activation, norm=norm)
            x = out
        if normalize:
            self.ops.l2_normalize(x, x)

    def hidden_states(self, batch: Batch) -> list:
        """Last hidden states as float32 host arrays, one (length, H) array per sequence."""
        t, b, s = self._load_alone(batch)
        self.graphs.run(("hidden", t, b, s), lambda: self._encoder_layers(t, b, s))
        return self._per_sequence(
            self.ops.to_host(self.ws.view("hidden", (t, self.config.hidden_size))).astype(np.float32), batch, s)

    def _load_alone(self, batch: Batch) -> tuple:
        """_load_inputs for a pass whose result is read at once (hidden states, token logits): the
        batches in flight finish first, since it loads through a staging slot they may still use."""
        while self._in_flight:
            self._in_flight.popleft().wait()
        return self._load_inputs(batch)

    def _per_sequence(self, rows: np.ndarray, batch: Batch, s: int) -> list:
        """A pass's token rows (at its bucketed shape, longest s) as one array per sequence."""
        if self.layout == "padded":
            return [rows[i * s:i * s + n] for i, n in enumerate(batch.lengths)]
        return batch.split(rows)

    def token_logits(self, batch: Batch) -> list:
        """The token head's logits (token_head) of every token, one (length, labels) float32 host
        array per sequence: the head runs on the device after the last layer, in the pass's graph,
        so that only the labels' logits come back."""
        if self.token_head is None:
            raise InputError("this runner has no token head")
        t, b, s = self._load_alone(batch)
        weight, bias = self.token_head
        logits = self.ws.view("token_logits", (t, bias.shape[0]))

        def forward():
            self._encoder_layers(t, b, s)
            self.ops.matmul_bias_act(logits, self.ws.view("hidden", (t, self.config.hidden_size)), weight, bias,
                                     act="identity")
        self.graphs.run(("tokens", t, b, s), forward)
        return self._per_sequence(self.ops.to_host(logits)[:, :self.token_labels], batch, s)

    def submit(self, batch: Batch, *, pooling: tuple, normalize: bool, skip: int = 0) -> "PendingEmbeddings":
        """Queue one batch on the device and return at once; .wait() gives its pooled (and
        optionally L2-normalised) embeddings, (B, len(pooling)*H) float32 on the host. skip:
        each sequence's first tokens (a prompt's) left out of pooling. At most two batches are
        in flight: a third waits for the oldest (its staging slot is reused)."""
        if self.head and len(pooling) * self.config.hidden_size != self.head[0][0].shape[1]:
            raise InputError(f"pooling {','.join(pooling)} gives {len(pooling) * self.config.hidden_size} values; "
                             f"the model's Dense module takes {self.head[0][0].shape[1]}")
        if len(self._in_flight) == 2:
            self._in_flight.popleft().wait()
        slot = self._slot
        if self._slot_batches[slot] is not None:  # done already, unless a batch failed between its load and here
            self._slot_batches[slot].wait()
        host = self._host_slots[slot]
        timer = self.ops.DeviceTimer(host.events)
        t, b, s = self._load_inputs(batch)

        def forward():
            self._encoder_layers(t, b, s)
            self._pool(t, b, s, pooling, normalize, skip)

        self.graphs.run(("embed", t, b, s, pooling, normalize, skip), forward)
        timer.stop()
        pending = PendingEmbeddings(self.ops.copy_to_host_async(self._output(b, pooling), host), len(batch.lengths),
                                    timer)
        self._in_flight.append(pending)
        self._slot_batches[slot] = pending
        return pending

    def embed(self, batch: Batch, *, pooling: tuple, normalize: bool, skip: int = 0) -> np.ndarray:
        """Pooled (and optionally L2-normalised) embeddings, (B, len(pooling)*H) float32 on the host."""
        return self.submit(batch, pooling=pooling, normalize=normalize, skip=skip).wait()


class PendingEmbeddings:
    """A batch's embeddings on their way to the host; after wait(), `device_seconds` is the
    device time of its input copy and forward pass."""

    def __init__(self, copy, rows: int, timer):
        self._copy = copy
        self._rows = rows
        self._timer = timer
        self._result = None
        self.device_seconds = 0.0

    def wait(self) -> np.ndarray:
        if self._result is None:
            host = self._copy.wait()[:self._rows]
            if host.dtype == np.uint16:  # bf16 words
                host = (host.astype(np.uint32) << 16).view(np.float32)
            self._result = host.astype(np.float32, copy=False)
            self.device_seconds = self._timer.seconds()
        return self._result
