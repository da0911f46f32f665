"""GPT-2, written once against the ops interface: prefill and decode steps over a KV cache.

Tokens are rows (T, E). Prefill packs every prompt's tokens back to back; a decode step has one
token per sequence. Each token carries its sequence index and position, so one prompt gives
the same logits alone or in a batch of prompts of other lengths (no padding anywhere).
"""

from __future__ import annotations

import numpy as np

from ..checkpoint import GPT2Weights
from ..config import GPT2Config
from ..decoding.generate import MAX_EOS_IDS
from ..errors import InputError
from ..workspace import Workspace


class GPT2Runner:
    """Weights uploaded once; KV cache (n_layer x (B, heads, L, D)) and every activation in one
    Workspace sized for max_batch sequences of up to max_len tokens."""

    def __init__(self, config: GPT2Config, weights: GPT2Weights, ops, *, dtype: str, max_batch: int,
                 max_len: int, graphs: bool = True):
        if max_len > config.n_positions:
            raise InputError(f"max_len {max_len} exceeds the model's n_positions {config.n_positions}")
        self.config, self.ops = config, ops
        self.dtype = ops.storage_dtype(dtype)
        self.max_batch, self.max_len = max_batch, max_len
        self.graphs = ops.GraphCache(enabled=graphs)  # decode steps, one graph per batch size
        up = lambda a: ops.to_device(a, self.dtype)  # noqa: E731
        self.wte, self.wpe = up(weights.wte), up(weights.wpe)           # (V, E), (P, E)
        self.lm_head = self.wte if weights.lm_head is weights.wte else up(weights.lm_head)
        self.ln_f = (up(weights.ln_f_gamma), up(weights.ln_f_beta))
        self.layers = [{k: up(v) for k, v in vars(layer).items()} for layer in weights.layers]
        c = config
        t = max_batch * max_len  # a prefill may hold every sequence's whole prompt
        e, d = c.n_embd, c.head_dim
        cache = max_batch * c.n_head * max_len * d
        table = {f"{kind}{i}": (cache, self.dtype) for i in range(c.n_layer) for kind in ("k", "v")}
        table.update({
            "tokens": (3 * t, np.int32),          # ids, sequence index, position (T each)
            "hidden": (t * e, self.dtype),        # (T, E)
            "normed": (t * e, self.dtype),        # (T, E)
            "qkv": (t * 3 * e, self.dtype),       # (T, 3E)
            "ctx": (t * e, self.dtype),           # (T, E)
            "proj": (t * e, self.dtype),          # (T, E)
            "inter": (t * c.n_inner, self.dtype),  # (T, I)
            "last": (max_batch * e, self.dtype),  # (B, E): the rows whose logits are wanted
            "rows": (max_batch, np.int32),        # (B,)
            "logits": (max_batch * c.vocab_size, np.float32),  # (B, V)
            "scores": (max_batch * c.vocab_size, np.float32),  # (B, V): token choice scratch
            "seen": (max_batch * c.vocab_size, np.uint8),     # (B, V): tokens fed so far (repetition penalty)
            "chosen": (max_batch, np.int32),                  # (B,)
            "eos": (MAX_EOS_IDS, np.int32),
        })
        self.ws = Workspace(ops, table)
        self.staging = ops.pinned_empty((3 * t + max_batch + MAX_EOS_IDS,), np.int32)

    def _caches(self, i: int):
        c = self.config
        shape = (self.max_batch, c.n_head, self.max_len, c.head_dim)
        return self.ws.view(f"k{i}", shape), self.ws.view(f"v{i}", shape)

    def _forward(self, ids, seq_ids, positions, rows, *, graph_key=None):
        """Run tokens (ids, sequence index, position per token) through the model, writing their
        keys and values into the cache and marking them seen; the logits of the tokens at `rows`
        stay on the device (ws "logits"). With a graph_key the launches are captured once and
        replayed (the inputs live in device buffers, so a replay reads each step's tokens)."""
        c = self.config
        t, n = len(ids), len(rows)
        bad = np.flatnonzero((ids < 0) | (ids >= c.vocab_size))
        if bad.size:
            raise InputError(f"token id {ids[bad[0]]} is outside the vocabulary 0..{c.vocab_size - 1}")
        st = self.staging[:3 * t + n]
        st[:t], st[t:2 * t], st[2 * t:3 * t], st[3 * t:] = ids, seq_ids, positions, rows
        self.ops.copy_from_host(self.ws.view("tokens", (3 * t,)), st[:3 * t])
        self.ops.copy_from_host(self.ws.view("rows", (n,)), st[3 * t:])
        if graph_key is None:
            self._launches(t, n)
        else:
            self.graphs.run(graph_key, lambda: self._launches(t, n))

    def _launches(self, t: int, n: int):
        ops, c, ws = self.ops, self.config, self.ws
        e = c.n_embd
        tokens = ws.view("tokens", (3 * t,))
        d_ids, d_seq, d_pos = tokens[:t], tokens[t:2 * t], tokens[2 * t:]
        ops.mark_seen(ws.view("seen", (self.max_batch, c.vocab_size)), d_ids, d_seq)
        hidden, normed = ws.view("hidden", (t, e)), ws.view("normed", (t, e))
        qkv, ctx, proj = ws.view("qkv", (t, 3 * e)), ws.view("ctx", (t, e)), ws.view("proj", (t, e))
        inter = ws.view("inter", (t, c.n_inner))
        ops.embed_positions(hidden, d_ids, d_pos, self.wte, self.wpe)
        for i, w in enumerate(self.layers):
            k_cache, v_cache = self._caches(i)
            ops.layernorm(normed, hidden, w["ln1_gamma"], w["ln1_beta"], eps=c.layer_norm_epsilon)
            ops.matmul(qkv, normed, w["qkv_weight"])
            ops.write_kv_cache(k_cache, v_cache, qkv, w["qkv_bias"], d_seq, d_pos, heads=c.n_head)
            ops.cached_attention(ctx, qkv, w["qkv_bias"], k_cache, v_cache, d_seq, d_pos, heads=c.n_head)
            ops.matmul(proj, ctx, w["attn_out_weight"])
            ops.add_bias_residual(hidden, proj, w["attn_out_bias"], hidden)
            ops.layernorm(normed, hidden, w["ln2_gamma"], w["ln2_beta"], eps=c.layer_norm_epsilon)
            ops.matmul(inter, normed, w["fc_weight"])
            ops.add_bias_gelu(inter, inter, w["fc_bias"], form=c.gelu)
            ops.matmul(proj, inter, w["proj_weight"])
            ops.add_bias_residual(hidden, proj, w["proj_bias"], hidden)
        last = ws.view("last", (n, e))
        ops.gather_rows(last, hidden, ws.view("rows", (n,)))
        ops.layernorm(last, last, *self.ln_f, eps=c.layer_norm_epsilon)
        ops.matmul(ws.view("logits", (n, c.vocab_size)), last, self.lm_head)

    def prefill(self, prompts: list):
        """All prompt tokens through the layers (cache rows 0..len-1 of sequence b for prompt b);
        leaves the logits of each prompt's last token on the device (see logits, choose)."""
        if not 1 <= len(prompts) <= self.max_batch:
            raise InputError(f"{len(prompts)} prompts; this runner takes 1..{self.max_batch}")
        lengths = np.array([len(p) for p in prompts])
        if lengths.min() < 1:
            raise InputError("every prompt needs at least one token")
        if lengths.max() > self.max_len:
            raise InputError(f"a prompt of {lengths.max()} tokens exceeds this runner's max_len {self.max_len}")
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        seq_ids = np.repeat(np.arange(len(prompts)), lengths)
        positions = np.concatenate([np.arange(n) for n in lengths])
        self.ops.zero(self.ws.view("seen", (self.max_batch * self.config.vocab_size,)))
        self._forward(ids, seq_ids, positions, np.cumsum(lengths) - 1)

    def logits(self, n: int) -> np.ndarray:
        """The last step's logits of the first n sequences, (n, V) float32 on the host."""
        return self.ops.to_host(self.ws.view("logits", (n, self.config.vocab_size))).astype(np.float32)

    def choose(self, n: int, step: int, params, histories=None) -> np.ndarray:
        """The next token of each of the first n sequences from the last step's logits, chosen on
        the backend's device (HF processors; -1 where a logit is not finite), as host int32 (n,).
        params: a GenerationParams from .checked() (which bounds the eos ids to MAX_EOS_IDS)."""
        c = self.config
        eos = np.asarray(params.eos_token_ids, dtype=np.int32)
        d_eos = self.ws.view("eos", (len(eos),))
        if len(eos):
            st = self.staging[-MAX_EOS_IDS:][:len(eos)]
            st[:] = eos
            self.ops.copy_from_host(d_eos, st)
        chosen = self.ws.view("chosen", (n,))
        self.ops.choose_tokens(chosen, self.ws.view("logits", (n, c.vocab_size)),
                               self.ws.view("seen", (self.max_batch, c.vocab_size))[:n], d_eos,
                               scratch=self.ws.view("scores", (n, c.vocab_size)), step=step, params=params,
                               histories=histories)
        return self.ops.to_host(chosen).astype(np.int64)

    def reorder(self, parents):
        """Beam search: sequence i continues from sequence parents[i]: reorder every layer's cache."""
        for i in range(self.config.n_layer):
            self.ops.reorder_cache(*self._caches(i), np.asarray(parents))

    def decode(self, tokens: np.ndarray, positions: np.ndarray):
        """One new token per sequence b (tokens[b] at positions[b]); logits stay on the device."""
        if np.asarray(positions).max() >= self.max_len:
            raise InputError(f"position {int(np.max(positions))} is past this runner's max_len {self.max_len}")
        b = len(tokens)
        self._forward(np.asarray(tokens, np.int64), np.arange(b), np.asarray(positions), np.arange(b),
                      graph_key=("decode", b))
