"""The encoder-decoders (Marian, BART, mBART, M2M100 / NLLB, T5), written once against the ops
interface: an encoder pass over the sources, each decoder layer's cross-attention keys and values
projected once per source, then GPT-2's generation steps (models/generation.py) over the decoder.

Marian and BART put each LayerNorm after its residual sum (hidden = LN(hidden + f(hidden))); mBART,
M2M100 and T5 before (hidden += f(LN(hidden)), a last LayerNorm per stack), written as GPT-2 writes
it: each product adds into hidden and leaves the next LayerNorm's output in `normed`. T5's norms
are RMS norms, and its self-attention scores get a bias by relative position bucket (one table a
stack; bidirectional buckets in the encoder, causal in the decoder).

Tokens are rows, as in GPT-2. The sources are packed back to back (no padding) through the
encoder and the fused variable-length attention. Their memory lives in a per-layer cache of
(sources, heads, S, D), which decoder row r reads through its source index: a source's beams
share its memory, nothing is copied per beam. The decoder's self-attention keeps a KV cache per
row; cross-attention is cached_attention over the memory up to the source's last position.
"""

from __future__ import annotations

import numpy as np

from ..config import Seq2SeqConfig
from ..decoding.beam import CANDIDATE_CHUNK, NEG
from ..errors import ConfigError, InputError
from ..seq2seq_checkpoint import Seq2SeqWeights
from ..workspace import Workspace
from .bert import PACKED_HEAD_DIMS, relative_position_buckets
from .shapes import bucket_packed, round_up
from .generation import GenerationRunner, generation_table

# compiled when the runner is built (beam search is translation's default); sampling's one-kernel
# choice on sm_90 (sampling_cluster.cu) compiles at its first launch
KERNEL_FILES = ("embedding.cu", "layernorm.cu", "decoder.cu", "sampling.cu", "beam.cu", "gemv.cu", "attention_varlen.cu",
                "activation.cu")
VOCAB_ALIGN = 64  # the logits' row width: a multiple of this
# a layer's weights in the order its launches read them, which the layer before asks the L2 for
PREFETCHED = ("qkv_weight", "attn_out_weight", "cross_q_weight", "cross_out_weight", "fc1_weight", "fc2_weight")


class Seq2SeqRunner(GenerationRunner):
    """Weights uploaded once; the sources' memory, the decoder's KV cache, the generation state and
    every activation in one Workspace, for max_batch decoder rows (sources x beams) of up to max_len
    target positions and max_batch sources of up to max_source tokens."""

    def __init__(self, config: Seq2SeqConfig, weights: Seq2SeqWeights, ops, *, dtype: str, max_batch: int,
                 max_len: int, max_source: int, graphs: bool = True):
        for what, length in (("max_len", max_len), ("max_source", max_source)):
            if length > config.max_positions:
                raise InputError(f"{what} {length} exceeds the model's max_position_embeddings {config.max_positions}")
        c = self.config = config
        self.ops = ops
        a = c.attention_width
        if ops.name == "cuda" and a // c.encoder_heads not in PACKED_HEAD_DIMS:
            raise ConfigError(f"the CUDA encoder takes head sizes {PACKED_HEAD_DIMS} (the fused attention's); "
                              f"this model's is {a // c.encoder_heads}")
        self.dtype = ops.storage_dtype(dtype)
        self.max_batch, self.max_len, self.max_source = max_batch, max_len, max_source
        gelu = "erf" if c.activation == "gelu" else None
        ops.prepare_kernels(KERNEL_FILES, dtype, head_dims=(a // c.encoder_heads,),
                            general=(bool(c.relative_buckets),), gelu_product=gelu, ln_product=True,
                            rows=(c.d_model, a, a // c.encoder_heads, a // c.decoder_heads, c.encoder_ffn,
                                  c.decoder_ffn), norm_product=(c.d_model, not c.pre_norm))
        self.graphs = ops.GraphCache(enabled=graphs)  # decode steps: kind, rows, GenerationParams.graph_key
        self.encoder_graphs = ops.GraphCache(enabled=graphs)  # encoder passes: their bucketed shape
        self.bucketed = ops.name == "cuda"  # few shapes, few graphs; the NumPy backend runs the real one
        up = lambda a: ops.to_device(a, self.dtype)  # noqa: E731
        # the logits' rows padded to VOCAB_ALIGN columns (zero head rows, a -1e9 bias: never chosen), which
        # cuBLASLt's products at many rows need (measurements: docs/gpu-internals.md, seq2seq.py VOCAB_ALIGN)
        self.vocab = round_up(c.vocab_size, VOCAB_ALIGN)
        head = np.pad(weights.lm_head, ((0, self.vocab - c.vocab_size), (0, 0)))
        self.embed, self.lm_head = up(weights.embed), up(head)   # (V, E), (vocab, E)
        # the encoder's token table: the same as the decoder's unless the vocabularies are separate
        self.source_embed = self.embed if weights.source_embed is None else up(weights.source_embed)
        self.encoder_positions, self.decoder_positions = up(weights.encoder_positions), up(weights.decoder_positions)
        self.encoder = [{k: up(v) for k, v in layer.items()} for layer in weights.encoder]
        self.decoder = [{k: up(v) for k, v in layer.items()} for layer in weights.decoder]
        norms = {k: up(v) for k, v in weights.norms.items() if not k.endswith("_relative")}
        self.relative = {}  # side -> (float32 table (buckets, heads), buckets by k - q, max length): T5
        if c.relative_buckets:
            for side in ("encoder", "decoder"):
                buckets = relative_position_buckets(c.max_positions, c.relative_buckets, c.relative_max_distance,
                                                    causal=side == "decoder")
                self.relative[side] = (ops.to_device(weights.norms[f"{side}_relative"], np.float32),
                                       ops.to_device(buckets), c.max_positions)
        self.norms = {side: self._norm_chain(side, layers, norms)
                      for side, layers in (("encoder", self.encoder), ("decoder", self.decoder))}
        self.embedding_norms = {side: (norms[f"{side}_embedding_gamma"], norms[f"{side}_embedding_beta"])
                                for side in ("encoder", "decoder") if c.layernorm_embedding}
        self.out = "normed" if c.pre_norm else "hidden"  # the stacks' output, which products read
        # M2M100 / NLLB: HF numbers positions around the pad token, which has none (_table_positions)
        self.unplaced = c.pad_token_id if c.positions == "fairseq" else -1
        b, e, v = max_batch, c.d_model, self.vocab
        src = rows = max_batch * max_source  # encoder rows, more than a decode step's
        ffn = max(c.encoder_ffn, c.decoder_ffn)
        self.beam_slices = -(-v // CANDIDATE_CHUNK)
        self.partials_size = max(1, ops.partials_size(rows, e))
        heads, d = c.decoder_heads, a // c.decoder_heads
        cache, memory = b * heads * max_len * d, b * heads * max_source * d
        table = {f"{kind}{i}": (cache, self.dtype) for i in range(c.decoder_layers) for kind in ("k", "v")}
        table.update({f"mem_{kind}{i}": (memory, self.dtype) for i in range(c.decoder_layers) for kind in ("k", "v")})
        table.update({
            # sources: ids, positions, source index, position-table rows (T each), offsets (B + 1)
            "source_inputs": (4 * src + b + 1, np.int32),
            "prefill_inputs": (2 * b, np.int32),  # the decoder's first tokens and their rows (B each)
            "mem_rows": (b, np.int32),           # (B,): each decoder row's source
            "mem_last": (b, np.int32),           # (B,): its source's last position
            "hidden": (rows * e, self.dtype),    # (T, E)
            "hidden_alt": (ops.NORM_PROLOGUE_ROWS * e, self.dtype),  # the residual stream's other buffer (_Residuals)
            "normed": (rows * e if c.pre_norm else 0, self.dtype),  # (T, E): pre-LayerNorm's LN(hidden)
            "qkv": (rows * 3 * a, self.dtype),   # (T, 3A): A the attention's width (d_model but for some T5s)
            "ctx": (rows * a, self.dtype),       # (T, A)
            "proj": (rows * e, self.dtype),      # (T, E)
            "partials": (self.partials_size, np.float32),
            "inter": (rows * ffn, self.dtype),   # (T, F)
            "gate": (rows * 2 * ffn if c.gated else 0, self.dtype),  # (T, 2F): T5's two inputs of a gated FFN
            "logits_bias": (v, np.float32),      # (V,): final_logits_bias + banned tokens
        })
        table.update(generation_table(ops, b, b * max_len, v, self.beam_slices))
        self.ws = Workspace(ops, table)
        ops.zero(self.ws.view("choice", (b * ops.CHOICE_STATE_WORDS,)))
        self._bias = np.concatenate([weights.logits_bias.astype(np.float32),
                                     np.full(self.vocab - c.vocab_size, NEG, np.float32)])
        self.set_constraints(banned=(), forced_bos=None, forced_eos=None)
        self._mem_rows = self._mem_last = np.zeros(0, np.int64)  # host copies of ws mem_rows / mem_last

    def set_constraints(self, *, banned, forced_bos, forced_eos):
        """Tokens the decoder never chooses (generation's single-token bad_words_ids), the token forced
        first (forced_bos_token_id) and the one forced at the last step (forced_eos_token_id; None:
        none), as biases on the logits after final_logits_bias: NEG on a banned token, and on every
        token but the forced one at its step. The forced token's log-probability is then 0, as HF
        sets it; at a step both force, eos wins as in HF's processor order. Beam search bans its
        tokens after the log-softmax instead (beam_banned), as HF does: a bias would take their
        probability out of the other tokens' log-probabilities, which HF keeps unless it renormalises."""
        self.beam_banned = tuple(banned)
        self._biases = {}
        for beams in (False, True):
            base = self._bias.copy()
            if not beams:
                base[list(banned)] += NEG
            forced = {}
            for step, token in (("first", forced_bos), ("last", forced_eos)):
                if token is not None:
                    forced[step] = base + NEG
                    forced[step][token] = base[token]
            self._biases[beams] = (base, forced)
        self._bias_now = self._biases[False][0]
        self._upload("logits_bias", self._bias_now, np.float32)

    def _before_step(self, step: int, params):
        """Each step's logits bias (forced first, forced last or the plain one), uploaded in order
        with the steps where it changes."""
        plain, forced = self._biases[params.num_beams > 1]
        if step == params.max_new_tokens - 1 and "last" in forced:
            bias = forced["last"]
        elif step == 0 and "first" in forced:
            bias = forced["first"]
        else:
            bias = plain
        if bias is not self._bias_now:
            self._upload("logits_bias", bias, np.float32)
            self._bias_now = bias

    def _caches(self, i: int):
        c = self.config
        shape = (self.max_batch, c.decoder_heads, self.max_len, c.attention_width // c.decoder_heads)
        return self.ws.view(f"k{i}", shape), self.ws.view(f"v{i}", shape)

    def _memory(self, i: int):
        c = self.config
        shape = (self.max_batch, c.decoder_heads, self.max_source, c.attention_width // c.decoder_heads)
        return self.ws.view(f"mem_k{i}", shape), self.ws.view(f"mem_v{i}", shape)

    # ------------------------------------------------------------------ the encoder

    def encode(self, sources: list, *, copies: int = 1):
        """The sources (token id lists) through the encoder; each decoder layer's cross-attention
        keys and values of them into its memory. Decoder row r then reads source r // copies. On
        the CUDA backend the pass runs at a bucketed shape (shapes.bucket_packed: tokens past the
        sources belong to none and write no memory), one captured graph per shape."""
        c = self.config
        n = len(sources)
        if not 1 <= n * copies <= self.max_batch:
            raise InputError(f"{n} sources x {copies} rows exceed this runner's {self.max_batch} rows")
        sizes = np.array([len(s) for s in sources])
        if sizes.min() < 1 or sizes.max() > self.max_source:
            raise InputError(f"a source of {int(sizes.min() if sizes.min() < 1 else sizes.max())} tokens: this runner "
                             f"takes 1..{self.max_source}")
        ids = np.fromiter((t for s in sources for t in s), np.int64, int(sizes.sum()))
        self._check_ids(ids, c.source_vocab_size)
        real, longest = len(ids), int(sizes.max())
        t, b, s = real, n, longest
        if self.bucketed:
            t, b, s = bucket_packed(real, n, longest, max_batch_tokens=self.max_batch * self.max_source,
                                    max_seq_len=self.max_source)
            b = min(b, self.max_batch)
        ends = np.cumsum(sizes)
        inputs = np.zeros(4 * t + b + 1, np.int32)
        inputs[:real] = ids
        inputs[t:t + real] = np.arange(real) - np.repeat(ends - sizes, sizes)
        inputs[2 * t:3 * t] = -1  # the source of each token; -1: bucket padding, which writes no memory
        inputs[2 * t:2 * t + real] = np.repeat(np.arange(n), sizes)
        inputs[3 * t:3 * t + real] = self._table_positions(ids, sizes, inputs[t:t + real])
        inputs[4 * t + 1:4 * t + n + 1] = ends
        inputs[4 * t + n + 1:] = real
        self._upload("source_inputs", inputs)
        self.encoder_graphs.run(("encode", t, b, s), lambda: self._encoder_launches(t, b, s))
        self._mem_rows = np.arange(n * copies) // copies
        self._mem_last = sizes[self._mem_rows] - 1
        self._upload("mem_rows", self._mem_rows)
        self._upload("mem_last", self._mem_last)

    def _encoder_launches(self, t: int, b: int, longest: int):
        """The encoder over t packed tokens of b sources (ws source_inputs), the longest at most
        `longest`; then each decoder layer's memory of them."""
        ops, c, ws = self.ops, self.config, self.ws
        d_in = ws.view("source_inputs", (4 * t + b + 1,))
        d_ids, d_pos, d_seq, d_rows, cu_seqlens = (d_in[:t], d_in[t:2 * t], d_in[2 * t:3 * t], d_in[3 * t:4 * t],
                                                   d_in[4 * t:])
        self._embed(t, "encoder", d_ids, d_rows, self.encoder_positions)

        def attend(i, qkv, ctx):
            ops.varlen_attention(ctx, qkv, self.encoder[i]["qkv_bias"], cu_seqlens, heads=c.encoder_heads,
                                 max_seqlen=longest, rel_bias=self.relative.get("encoder"))
        memory = self._stack(t, "encoder", attend)
        qkv = ws.view("qkv", (t, 3 * c.attention_width))
        for i, w in enumerate(self.decoder):  # each layer's memory: keys and values of the encoder's output
            ops.matmul(qkv, memory, w["cross_kv_weight"])
            ops.write_kv_cache(*self._memory(i), qkv, w["cross_kv_bias"], d_seq, d_pos, heads=c.decoder_heads)

    def _table_positions(self, ids: np.ndarray, sizes: np.ndarray, places: np.ndarray) -> np.ndarray:
        """Each token's row of the position table: its place in its sequence, or M2M100 / NLLB's
        count of the tokens up to it that are not pad (HF's create_position_ids_from_input_ids: a pad
        takes none, embed_positions' `unplaced`, and the tokens after it do not count it)."""
        if self.unplaced < 0:
            return places
        real = ids != self.unplaced
        counts = np.cumsum(real)
        before = np.repeat(np.concatenate([[0], counts])[np.cumsum(sizes) - sizes], sizes)
        return np.where(real, counts - before - 1, 0)

    # ------------------------------------------------------------------ layers

    def _norm_chain(self, side: str, layers: list, norms: dict) -> list:
        """The (gamma, beta) of each sub-layer in order (self-attention, cross-attention, feed-forward
        per layer). Post-LayerNorm: the norm after each sub-layer. Pre-LayerNorm: the norm before
        each, then the stack's final one (one more entry)."""
        kinds = ("ln1", "ln2", "ln3") if side == "decoder" else ("ln1", "ln3")
        chain = [(w[f"{k}_gamma"], w[f"{k}_beta"]) for w in layers for k in kinds]
        if self.config.pre_norm:
            chain.append((norms[f"{side}_final_gamma"], norms[f"{side}_final_beta"]))
        return chain

    def _embed(self, t: int, side: str, ids, positions, table):
        """hidden = the t rows' token + position embeddings (LayerNorm'd where the family does);
        pre-LayerNorm: normed = the first sub-layer's LayerNorm of them."""
        ops, ws, e, eps = self.ops, self.ws, self.config.d_model, self.config.layer_norm_eps
        hidden = ws.view("hidden", (t, e))
        tokens = self.source_embed if side == "encoder" else self.embed
        if side in self.embedding_norms:
            summed = ws.view("proj", (t, e))
            ops.embed_positions(summed, ids, positions, tokens, table, unplaced=self.unplaced)
            ops.layernorm(hidden, summed, *self.embedding_norms[side], eps=eps)
        else:
            ops.embed_positions(hidden, ids, positions, tokens, table, unplaced=self.unplaced)
        if self.config.pre_norm:
            ops.layernorm(ws.view("normed", (t, e)), hidden, *self.norms[side][0], eps=eps, rms=self.config.rms_norm)

    def _stack(self, t: int, side: str, attend_self, attend_cross=None):
        """A stack's layers over t rows, from _embed's output; returns the view its output ends in
        (ws[self.out], or for post-LayerNorm stacks perhaps the residual stream's other buffer)."""
        ops, c, ws = self.ops, self.config, self.ws
        a = c.attention_width
        qkv, ctx = ws.view("qkv", (t, 3 * a)), ws.view("ctx", (t, a))
        stream = _Residuals(self, t)
        chain = iter(self.norms[side][1:] if c.pre_norm else self.norms[side])
        ffn = c.decoder_ffn if side == "decoder" else c.encoder_ffn
        inter, queries = ws.view("inter", (t, ffn)), ws.view("qkv", (t, a))
        layers = self.decoder if side == "decoder" else self.encoder
        for i, w in enumerate(layers):
            if i + 1 < len(layers):  # the next layer's weights, while this one runs (where prefetch_l2 says)
                ops.prefetch_l2([layers[i + 1][k] for k in PREFETCHED if k in layers[i + 1]], rows=t)
            stream.product(qkv, w["qkv_weight"])
            attend_self(i, qkv, ctx)
            stream.residual(ctx, w["attn_out_weight"], w["attn_out_bias"], next(chain))
            if attend_cross is not None:
                stream.product(queries, w["cross_q_weight"])
                attend_cross(i, queries, ctx)
                stream.residual(ctx, w["cross_out_weight"], w["cross_out_bias"], next(chain))
            if c.gated:
                gate = ws.view("gate", (t, 2 * ffn))
                stream.product(gate, w["fc1_weight"])
                ops.gated_gelu(inter, gate, w["fc1_bias"], form="tanh")
            else:
                stream.product(inter, w["fc1_weight"], w["fc1_bias"], act=c.activation)
            stream.residual(inter, w["fc2_weight"], w["fc2_bias"], next(chain))
        return stream.settle()

    def _decoder_layers(self, t: int, attend_self, mem_seq, mem_last):
        """The decoder's layers over t rows (from _embed), returning the view of their output;
        cross-attention of row j over the memory of source mem_seq[j], positions 0..mem_last[j]."""
        def attend_cross(i, qkv, ctx):
            self.ops.cached_attention(ctx, qkv, self.decoder[i]["cross_q_bias"], *self._memory(i), mem_seq, mem_last,
                                      heads=self.config.decoder_heads)
        return self._stack(t, "decoder", attend_self, attend_cross)

    def _logits(self, rows: int, hidden):
        ops, ws, v = self.ops, self.ws, self.vocab
        logits = ws.view("logits", (rows, v))
        ops.matmul_bias_act(logits, hidden, self.lm_head, ws.view("logits_bias", (v,)), act="identity")

    # ------------------------------------------------------------------ GenerationRunner's passes

    def prefill(self, prompts: list):
        """The decoder's prompts, one token a row (the start token; row r reads the source encode()
        gave it), as a decode step at position 0 (a graph per row count); leaves each row's logits
        on the device."""
        ops, ws = self.ops, self.ws
        n = len(prompts)
        if n != len(self._mem_rows):
            raise InputError(f"{n} decoder rows for {len(self._mem_rows)} encoded rows")
        if any(len(p) != 1 for p in prompts):
            raise InputError("a decoder prompt is one token: the decoder's start token")
        ids = np.array([p[0] for p in prompts], np.int64)
        self._check_ids(ids)
        self._upload("prefill_inputs", np.concatenate([ids, np.arange(n)]))
        d_in = ws.view("prefill_inputs", (2 * n,))
        seen = ws.view("seen", (self.max_batch, self.vocab))
        ops.zero(seen)
        ops.mark_seen(seen, d_in[:n], d_in[n:])
        self._upload("next_ids", ids)
        self._upload("next_pos", np.zeros(n))
        self.graphs.run(("first", n), lambda: self._decode_launches(n))

    def _decode_launches(self, b: int, indirect: bool = False):
        """One token per row from ws next_ids / next_pos; logits of all b rows."""
        ops, c, ws = self.ops, self.config, self.ws
        ids, pos = ws.view("next_ids", (b,)), ws.view("next_pos", (b,))
        indir = ws.view("indir", (b, self.max_len)) if indirect else None
        self._embed(b, "decoder", ids, pos, self.decoder_positions)

        def attend(i, qkv, ctx):
            ops.decode_attention(ctx, qkv, self.decoder[i]["qkv_bias"], *self._caches(i), pos, indir,
                                 heads=c.decoder_heads, rel_bias=self.relative.get("decoder"))
        self._logits(b, self._decoder_layers(b, attend, ws.view("mem_rows", (b,)), ws.view("mem_last", (b,))))


class _Residuals:
    """A stack's residual stream over t rows: the buffer that holds it, and the products' input.
    Past ops.NORM_PROLOGUE_ROWS rows, each residual + LayerNorm runs with the product before it
    (matmul_residual_layernorm, matmul_bias_residual_layernorm). Up to that many (a decode step) it
    is left pending and runs with the product after it (norm_matmul: on the GPU in that product's
    kernel), which may move the stream to the other of two buffers: the product's blocks read the
    old one while one of them writes the new."""

    def __init__(self, runner: Seq2SeqRunner, t: int):
        self.runner, self.t = runner, t
        ws, e = runner.ws, runner.config.d_model
        self.hidden, self.x = ws.view("hidden", (t, e)), ws.view(runner.out, (t, e))
        self.deferred = t <= runner.ops.NORM_PROLOGUE_ROWS
        self.spare = ws.view("hidden_alt", (t, e)) if self.deferred else None
        self.pending = None

    def product(self, out, weight, bias=None, *, act=None):
        """out = x @ weight^T (act None), or act(... + bias): GELU (erf) for "gelu", else
        matmul_bias_act's."""
        ops = self.runner.ops
        if self.pending is not None:
            before = self.hidden
            self.hidden = ops.norm_matmul(out, weight, bias, act=act, hidden=before, hidden_out=self.spare,
                                          **self.pending)
            if self.hidden is not before:
                self.spare = before
            if self.pending["post"]:
                self.x = self.hidden
            self.pending = None
        else:
            ops.matmul_act(out, self.x, weight, bias, act=act)

    def residual(self, x, weight, bias, norm):
        """The stream gets x @ weight^T + bias added; post-LayerNorm: stream = norm(that sum); pre:
        the next product's input = norm(stream)."""
        r = self.runner
        ops, ws, c = r.ops, r.ws, r.config
        e, t = c.d_model, self.t
        product, partials = ws.view("proj", (t, e)), ws.view("partials", (r.partials_size,))
        if self.deferred:
            self.pending = dict(parts=ops.norm_product(product, partials, x, weight), res_bias=bias, gamma=norm[0],
                                beta=norm[1], normed=self.x if c.pre_norm else None, eps=c.layer_norm_eps,
                                rms=c.rms_norm, post=not c.pre_norm)
        elif c.pre_norm:
            ops.matmul_residual_layernorm(self.hidden, self.x, x, weight, bias, *norm, eps=c.layer_norm_eps,
                                          product=product, partials=partials, rms=c.rms_norm)
        else:
            ops.matmul_bias_residual_layernorm(self.hidden, x, weight, bias, self.hidden, *norm,
                                               eps=c.layer_norm_eps, product=product, partials=partials)
            self.x = self.hidden

    def settle(self):
        """Runs the pending residual + LayerNorm, if any, where the stream is; returns the stack's
        output (pre-LayerNorm: normed; post: the stream)."""
        p = self.pending
        if p is not None:
            ops = self.runner.ops
            if p["post"]:
                ops.add_bias_residual_layernorm(self.hidden, p["parts"], p["res_bias"], self.hidden, p["gamma"],
                                                p["beta"], eps=p["eps"])
                self.x = self.hidden
            else:
                ops.residual_layernorm(self.hidden, p["normed"], p["parts"], p["res_bias"], p["gamma"], p["beta"],
                                       eps=p["eps"], rms=p["rms"])
            self.pending = None
        return self.x
