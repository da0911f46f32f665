"""GPT-2, written once against the ops interface: prefill and decode steps over a KV cache.

Tokens are rows (T, E). Prefill packs every prompt's tokens back to back; a decode step has one
token per sequence. Each token carries its sequence index and position, so one prompt gives
the same logits alone or in a batch of prompts of other lengths (no padding anywhere).

Generation keeps its per-step state on the device (step counter, sequences, lengths, finished
flags, the tokens to feed next): a step (decode, token choice, bookkeeping) reads and updates it
with kernels, so steps are replayed as CUDA graphs back to back and the host only reads the
chosen tokens (or beam flags) every few steps.
"""

from __future__ import annotations

from array import array
from itertools import chain
import numpy as np

from ..checkpoint import GPT2Weights
from ..config import GPT2Config
from ..decoding.beam import CANDIDATE_CHUNK
from ..errors import InputError
from ..workspace import Workspace
from .bert import PACKED_HEAD_DIMS
from .shapes import bucket_packed
from .generation import GenerationRunner, generation_table


# the kernel sources the decoder launches, compiled in parallel when a runner is built; sampling's
# one-kernel choice on sm_90 (sampling_cluster.cu) and beam search (beam.cu) compile at their first
# launch instead, so that a greedy run never waits for them
KERNEL_FILES = ("decoder.cu", "sampling.cu", "gemv.cu", "attention_varlen.cu", "activation.cu")


def prepare_kernels(config: GPT2Config, ops, dtype: str):
    """Compile (or load) the kernels a runner of this model launches (ops.prepare_kernels)."""
    ops.prepare_kernels(KERNEL_FILES, dtype, head_dims=(config.head_dim,), gelu_product=config.gelu,
                        rows=(config.n_embd, config.head_dim, config.n_inner))


def _flat_ids(prompts, total: int) -> np.ndarray:
    """The prompts' token ids back to back, int64: from lists of Python ints through array's
    fromlist (H100 host, 32 x 128 tokens: 62 us against 98 for np.fromiter), else np.fromiter."""
    if all(type(p) is list for p in prompts):
        flat = array("q")
        try:
            for p in prompts:
                flat.fromlist(p)
        except (TypeError, OverflowError):
            pass  # not all Python ints in range: np.fromiter converts them or names the problem
        else:
            return np.frombuffer(flat, np.int64)
    return np.fromiter(chain.from_iterable(prompts), np.int64, total)


class GPT2Runner(GenerationRunner):
    """Weights uploaded once; KV cache (n_layer x (B, heads, L, D)), generation state and every
    activation in one Workspace sized for max_batch sequences of up to max_len tokens."""

    def __init__(self, config: GPT2Config, weights: GPT2Weights, ops, *, dtype: str, max_batch: int,
                 max_len: int, graphs: bool = True):
        if max_len > config.n_positions:
            raise InputError(f"max_len {max_len} exceeds the model's n_positions {config.n_positions}")
        self.config, self.ops = config, ops
        self.dtype = ops.storage_dtype(dtype)
        self.max_batch, self.max_len = max_batch, max_len
        prepare_kernels(config, ops, dtype)
        self.graphs = ops.GraphCache(enabled=graphs)  # decode steps: kind, batch, GenerationParams.graph_key
        # prefills, keyed by their bucketed shape (tokens, prompts, longest): a prompt batch of a shape
        # seen before replays a graph instead of ~110 launches from Python
        self.prefill_graphs = ops.GraphCache(enabled=graphs)
        # pad prefills to shared shapes where they are captured (the fused attention's head sizes); so
        # too without graphs, whose launches then compute the same bits (the products' algorithms
        # depend on the padded row count)
        self.bucket_prefill = ops.name == "cuda" and config.head_dim in PACKED_HEAD_DIMS
        up = lambda a: ops.to_device(a, self.dtype)  # noqa: E731
        self.wte, self.wpe = up(weights.wte), up(weights.wpe)           # (V, E), (P, E)
        self.lm_head = self.wte if weights.lm_head is weights.wte else up(weights.lm_head)
        self.ln_f = (up(weights.ln_f_gamma), up(weights.ln_f_beta))
        self.layers = [{k: up(v) for k, v in vars(layer).items()} for layer in weights.layers]
        c = config
        b, t = max_batch, max_batch * max_len  # a prefill may hold every sequence's whole prompt
        e, v = c.n_embd, c.vocab_size
        self.vocab = v
        cache = b * c.n_head * max_len * c.head_dim
        self.beam_slices = -(-v // CANDIDATE_CHUNK)  # a beam step's vocabulary slices (ops.py beam_select)
        self.partials_size = max(1, ops.partials_size(t, e))  # a prefill's rows too
        table = {f"{kind}{i}": (cache, self.dtype) for i in range(c.n_layer) for kind in ("k", "v")}
        table.update({
            # prefill: ids, sequence index (-1: padding), position (T each), each prompt's last row (B),
            # prompt offsets (B + 1)
            "prefill_inputs": (3 * t + 2 * b + 1, np.int32),
            "hidden": (t * e, self.dtype),        # (T, E)
            "normed": (t * e, self.dtype),        # (T, E)
            "qkv": (t * 3 * e, self.dtype),       # (T, 3E)
            "ctx": (t * e, self.dtype),           # (T, E)
            "proj": (t * e, self.dtype),          # (T, E)
            "partials": (self.partials_size, np.float32),  # a split product's partial sums (ops.py)
            "inter": (t * c.n_inner, self.dtype),  # (T, I)
            "last": (b * e, self.dtype),          # (B, E): the rows whose logits are wanted
        })
        table.update(generation_table(ops, b, t, v, self.beam_slices))
        self.ws = Workspace(ops, table)
        ops.zero(self.ws.view("choice", (b * ops.CHOICE_STATE_WORDS,)))
        # the prefill's inputs are laid out in one of two page-locked host buffers in turn, each
        # reused once its last copy to the device has run
        self._prefill_slots, self._prefill_slot = [ops.HostSlot(), ops.HostSlot()], 0

    def _caches(self, i: int):
        c = self.config
        shape = (self.max_batch, c.n_head, self.max_len, c.head_dim)
        return self.ws.view(f"k{i}", shape), self.ws.view(f"v{i}", shape)

    # ------------------------------------------------------------------ forward passes

    def _layers(self, t: int, attend):
        """The blocks over t token rows (ws hidden, from the embedding); normed ends as ln_f(hidden).
        attend(i, qkv, ctx): layer i's attention, writing the KV cache."""
        ops, c, ws = self.ops, self.config, self.ws
        e = c.n_embd
        hidden, normed = ws.view("hidden", (t, e)), ws.view("normed", (t, e))
        qkv, ctx, proj = ws.view("qkv", (t, 3 * e)), ws.view("ctx", (t, e)), ws.view("proj", (t, e))
        inter = ws.view("inter", (t, c.n_inner))
        partials = ws.view("partials", (self.partials_size,))
        eps = c.layer_norm_epsilon
        ops.layernorm(normed, hidden, self.layers[0]["ln1_gamma"], self.layers[0]["ln1_beta"], eps=eps)
        for i, w in enumerate(self.layers):
            after = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if after:
                ops.prefetch_l2([after[k] for k in ("qkv_weight", "attn_out_weight", "fc_weight", "proj_weight")],
                                rows=t)
            ops.join_beside()  # the layer before's cache writes (a prefill's, beside) read qkv
            ops.matmul(qkv, normed, w["qkv_weight"])
            attend(i, qkv, ctx)
            ops.matmul_residual_layernorm(hidden, normed, ctx, w["attn_out_weight"], w["attn_out_bias"], w["ln2_gamma"],
                                          w["ln2_beta"], eps=eps, product=proj, partials=partials)
            ops.matmul_bias_gelu(inter, normed, w["fc_weight"], w["fc_bias"], form=c.gelu)
            gamma, beta = (after["ln1_gamma"], after["ln1_beta"]) if after else self.ln_f
            ops.matmul_residual_layernorm(hidden, normed, inter, w["proj_weight"], w["proj_bias"], gamma, beta, eps=eps,
                                          product=proj, partials=partials)

    @staticmethod
    def _split_prefill_inputs(flat, t: int, n: int) -> tuple:
        """A prefill's inputs (3t + 2n + 1,) for t tokens and n prompts as ids, sequence indices,
        positions (t each), last rows (n), offsets (n + 1)."""
        return flat[:t], flat[t:2 * t], flat[2 * t:3 * t], flat[3 * t:3 * t + n], flat[3 * t + n:]

    def _prefill_launches(self, t: int, n: int, max_len: int):
        ops, c, ws = self.ops, self.config, self.ws
        d_ids, d_seq, d_pos, rows, cu_seqlens = self._split_prefill_inputs(
            ws.view("prefill_inputs", (3 * t + 2 * n + 1,)), t, n)
        seen = ws.view("seen", (self.max_batch, c.vocab_size))
        ops.zero(seen)
        ops.mark_seen(seen, d_ids, d_seq)
        ops.embed_positions(ws.view("hidden", (t, c.n_embd)), d_ids, d_pos, self.wte, self.wpe)

        def attend(i, qkv, ctx):
            k_cache, v_cache = self._caches(i)
            bias = self.layers[i]["qkv_bias"]
            packed = c.head_dim in PACKED_HEAD_DIMS  # the fused attention reads qkv, not the caches
            ops.write_kv_cache(k_cache, v_cache, qkv, bias, d_seq, d_pos, heads=c.n_head, beside=packed)
            if packed:
                ops.varlen_attention(ctx, qkv, bias, cu_seqlens, heads=c.n_head, max_seqlen=max_len, causal=True)
            else:
                ops.cached_attention(ctx, qkv, bias, k_cache, v_cache, d_seq, d_pos, heads=c.n_head)
        self._layers(t, attend)
        last = ws.view("last", (n, c.n_embd))
        ops.gather_rows(last, ws.view("normed", (t, c.n_embd)), rows)
        ops.matmul(ws.view("logits", (n, c.vocab_size)), last, self.lm_head)

    def _decode_launches(self, b: int, indirect: bool = False):
        """One token per sequence from ws next_ids / next_pos; logits of all b rows."""
        ops, c, ws = self.ops, self.config, self.ws
        ids, pos = ws.view("next_ids", (b,)), ws.view("next_pos", (b,))
        indir = ws.view("indir", (b, self.max_len)) if indirect else None
        ops.prefetch_kv(*self._caches(0), pos)
        ops.embed_positions(ws.view("hidden", (b, c.n_embd)), ids, pos, self.wte, self.wpe)

        def attend(i, qkv, ctx):
            k_cache, v_cache = self._caches(i)
            ops.decode_attention(ctx, qkv, self.layers[i]["qkv_bias"], k_cache, v_cache, pos, indir, heads=c.n_head)
            if i + 1 < c.n_layer:  # the next layer's keys and values, while this layer's products run
                ops.prefetch_kv(*self._caches(i + 1), pos)
        self._layers(b, attend)
        ops.matmul(ws.view("logits", (b, c.vocab_size)), ws.view("normed", (b, c.n_embd)), self.lm_head)

    def prefill(self, prompts: list):
        """All prompt tokens through the layers (cache rows 0..len-1 of sequence b for prompt b);
        leaves the logits of each prompt's last token on the device (see logits)."""
        if not 1 <= len(prompts) <= self.max_batch:
            raise InputError(f"{len(prompts)} prompts; this runner takes 1..{self.max_batch}")
        sizes = [len(p) for p in prompts]
        shortest, longest, real, count = min(sizes), max(sizes), sum(sizes), len(prompts)
        if shortest < 1:
            raise InputError("every prompt needs at least one token")
        if longest > self.max_len:
            raise InputError(f"a prompt of {longest} tokens exceeds this runner's max_len {self.max_len}")
        ids = _flat_ids(prompts, real)
        self._check_ids(ids)
        t, n, s = real, count, longest
        if self.bucket_prefill:  # padding tokens (sequence -1: no cache row, nothing seen) and empty prompts
            t, n, s = bucket_packed(real, count, longest, max_batch_tokens=self.max_batch * self.max_len,
                                    max_seq_len=self.max_len)
            n = min(n, self.max_batch)
        lengths = np.array(sizes)
        ends = np.cumsum(lengths)
        slot = self._prefill_slots[self._prefill_slot]
        self._prefill_slot ^= 1
        slot.wait()  # the copy from its buffer two prefills ago has run
        inputs = slot.array((3 * t + 2 * n + 1,), np.int32)
        d_ids, d_seq, d_pos, rows, cu_seqlens = self._split_prefill_inputs(inputs, t, n)
        d_ids[:real], d_ids[real:] = ids, 0
        d_seq[:real], d_seq[real:] = np.repeat(np.arange(count), lengths), -1
        d_pos[:real], d_pos[real:] = np.arange(real) - np.repeat(ends - lengths, lengths), 0
        rows[:count], rows[count:] = ends - 1, 0
        cu_seqlens[0], cu_seqlens[1:count + 1], cu_seqlens[count + 1:] = 0, ends, real
        self.ops.copy_from_host(self.ws.view("prefill_inputs", inputs.shape), inputs)
        slot.record()
        self.prefill_graphs.run((t, n, s), lambda: self._prefill_launches(t, n, s))

    def decode(self, tokens, positions):
        """One new token per sequence b (tokens[b] at positions[b]), fed from the host; logits stay
        on the device (see logits)."""
        tokens, positions = np.asarray(tokens, np.int64), np.asarray(positions, np.int64)
        if positions.max() >= self.max_len:
            raise InputError(f"position {int(positions.max())} is past this runner's max_len {self.max_len}")
        self._check_ids(tokens)
        b = len(tokens)
        self._upload("next_ids", tokens)
        self._upload("next_pos", positions)
        self.graphs.run(("decode", b), lambda: self._decode_launches(b))
