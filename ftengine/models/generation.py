"""The generation state a decoder keeps on its device, and the steps that read and update it:
token choice (greedy, sampling) and beam selection on the device, HF `generate`'s semantics
(decoding/processors.py and decoding/beam.py are the references). A model family's runner (GPT-2,
the encoder-decoders) derives from GenerationRunner and supplies `prefill(rows)` (each row's
prompt through its layers, logits of its last token) and `_decode_launches(b, indirect)` (one
token per row from ws next_ids / next_pos); the loop (decoding/generate.py, decoding/beam.py)
drives every family the same way.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..decoding.beam import KEEP_MAX, NEG
from ..decoding.generate import MAX_EOS_IDS
from ..errors import InputError
from .bert import ids_below

BEAM_FLOATS = ("run_scores", "fin_scores")
BEAM_INTS = ("fin_len", "fin_flag", "next_ids", "next_pos")


def generation_table(ops, b: int, t: int, v: int, beam_slices: int) -> dict:
    """Workspace entries of the generation state for b sequences, t = b x L positions, a
    vocabulary of v tokens in beam_slices slices."""
    return {
        "logits": (b * v, np.float32),        # (B, V)
        "scores": (b * v, np.float32),        # (B, V): token choice scratch
        "choice": (b * ops.CHOICE_STATE_WORDS, np.uint64),  # (B, words): its state, zero between steps
        "seen": (b * v, np.uint8),            # (B, V): tokens fed so far (repetition penalty)
        "chosen": (b, np.int32),              # (B,)
        "eos": (MAX_EOS_IDS, np.int32),
        "seed": (2, np.uint32),               # the draw's seed, low and high words
        # generation state, updated on the device each step
        "step": (1, np.int32),                # tokens chosen so far
        "seq": (t, np.int32),                 # (B, L): prompt + generated tokens (beams: running)
        "lengths": (b, np.int32),
        "finished": (b, np.int32),
        "history": (t, np.int32),             # (steps, B): the token chosen per step and sequence
        "next_ids": (b, np.int32),            # the next decode step's tokens
        "next_pos": (b, np.int32),            # and positions
        # beam search: rows b * num_beams + j
        "indir": (t, np.int32),               # (B, L): the cache row holding position p of row r
        "fin_seq": (t, np.int32),             # (B, L): finished hypotheses
        "beam_scratch": (3 * t, np.int32),
        "run_scores": (b, np.float32), "fin_scores": (b, np.float32),
        "fin_len": (b, np.int32), "fin_flag": (b, np.int32),
        "flags": (3 * b, np.int32),           # per prompt: improvable, done, non-finite logits
        "starts": (b, np.int32),              # per prompt: its length
        "max_new": (1, np.int32),             # max_new_tokens (read by the beam selection)
        "stats": (2 * b * beam_slices, np.float32),  # (B, slices, 2): log-sum-exp partials
        "renorm": (2 * b * beam_slices, np.float32),  # (B, slices, 2): the same of the processed log-probs
        "keys": (b * beam_slices * KEEP_MAX, np.uint64),
        "banned": (v, np.int32),              # tokens beam search bans after the log-softmax
        "n_banned": (1, np.int32),
    }


class GenerationRunner:
    """Steps of greedy / sampled generation and of beam search over a runner's workspace `ws`
    (generation_table's entries), with `config.vocab_size`, `vocab` (the logits' row width: the
    vocabulary, or more where a runner pads it; the columns past it are never chosen), `max_batch`,
    `max_len`, `ops`, `graphs` (a GraphCache), `prefill(rows)` and
    `_decode_launches(b, indirect=False)`. beam_banned: the tokens beam search bans after its
    log-softmax, as HF's bad_words_ids processor does."""

    beam_banned: tuple = ()

    def _upload(self, name: str, values, dtype=np.int32):
        values = np.ascontiguousarray(values, dtype=dtype)
        self.ops.copy_from_host(self.ws.view(name, values.shape), values)

    def _check_ids(self, ids, vocab_size: int | None = None):
        """Refuse an id outside the vocabulary (the model's, or `vocab_size` ids)."""
        v = vocab_size or self.config.vocab_size
        if ids_below(ids, v):  # the search only for a bad id
            return
        bad = np.flatnonzero((ids < 0) | (ids >= v))
        raise InputError(f"token id {ids[bad[0]]} is outside the vocabulary 0..{v - 1}")

    def logits(self, n: int) -> np.ndarray:
        """The last step's logits of the first n sequences, (n, V) float32 on the host."""
        return self.ops.to_host(self.ws.view("logits", (n, self.vocab))).astype(np.float32)[:, :self.config.vocab_size]

    # ------------------------------------------------------------------ greedy and sampled generation

    def _before_step(self, step: int, params):
        """Run before step `step` is queued (0: before the prefill whose logits choose the first
        token): where a model sets inputs that change by step. Nothing by default."""

    def _next_step(self, params, *, first: bool = False):
        self._step = 0 if first else self._step + 1
        self._before_step(self._step, params)

    def _check_room(self, prompts, params):
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > self.max_len:
            raise InputError(f"a prompt of {longest} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                             f"this runner's max_len {self.max_len}")

    def _choose_and_append(self, b: int, params):
        ops, ws, v, length = self.ops, self.ws, self.vocab, self.max_len
        eos = ws.view("eos", (len(params.eos_token_ids),))
        seen = ws.view("seen", (self.max_batch, v))[:b]
        seq, lengths, step = ws.view("seq", (b, length)), ws.view("lengths", (b,)), ws.view("step", (1,))
        chosen = ws.view("chosen", (b,))
        ops.choose_tokens(chosen, ws.view("logits", (b, v)), seen, eos, step, scratch=ws.view("scores", (b, v)),
                          state=ws.view("choice", (b, ops.CHOICE_STATE_WORDS)), params=params,
                          seed=ws.view("seed", (2,)), seq=seq, lengths=lengths)
        ops.append_tokens(ws.view("history", (length, b)), seq, lengths, ws.view("next_ids", (b,)),
                          ws.view("next_pos", (b,)), ws.view("finished", (b,)), seen, step, chosen, eos)

    def _begin(self, rows: list, params) -> np.ndarray:
        """Prefill one sequence per row; upload the rows as the sequences so far (ws seq, returned
        as (rows, L)), the eos ids, the seed and step 0."""
        self.prefill(rows)
        seq = np.zeros((len(rows), self.max_len), np.int32)
        for i, p in enumerate(rows):
            seq[i, :len(p)] = p
        self._upload("seq", seq)
        self._upload("step", [0])
        if params.eos_token_ids:
            self._upload("eos", params.eos_token_ids)
        self._upload("seed", params.seed_words(), np.uint32)
        return seq

    def start(self, prompts: list, params):
        """Prefill the prompts and choose the first token of each (step 0). params: a
        GenerationParams from .checked()."""
        self._check_room(prompts, params)
        self._next_step(params, first=True)
        self._begin(prompts, params)
        self._upload("lengths", [len(p) for p in prompts])
        self._upload("finished", np.zeros(len(prompts)))
        self._choose_and_append(len(prompts), params)

    # A graph a step. A chunk's steps captured as one graph instead (2, 4 or 8 steps) measured about 1%
    # faster (H100, 2026-11-26, GPT-2 small fp16, ms a step, three rounds: greedy b1 0.292-0.293 ->
    # 0.290-0.291, top-k 40 b32 0.463-0.464 -> 0.456-0.464, beam 4 b1 0.370-0.372 -> 0.365-0.367), but
    # each (batch, graph_key) would then capture up to 15 steps on first use instead of one (about 5 ms
    # a step): not kept.
    def steps(self, b: int, count: int, params):
        """Queue `count` steps (decode the last chosen tokens, choose the next) for b sequences."""
        key = ("step", b, params.graph_key())
        for _ in range(count):
            self._next_step(params)
            self.graphs.run(key, lambda: (self._decode_launches(b), self._choose_and_append(b, params)))

    def fetch_history(self, b: int, first: int, last: int):
        """Queue a copy of the tokens chosen at steps first..last-1, (steps, b) int32, -2 for a
        sequence finished earlier, -1 for non-finite logits; returns a handle (.wait())."""
        return self.ops.copy_to_host_async(self.ws.view("history", (self.max_len, b))[first:last])

    # ------------------------------------------------------------------ beam search

    def beam_state(self, batch: int, num_beams: int) -> SimpleNamespace:
        r, ws, length, slices = batch * num_beams, self.ws, self.max_len, self.beam_slices
        views = {name: ws.view(name, (r,)) for name in BEAM_FLOATS + BEAM_INTS}
        views.update({name: ws.view(name, (r, length)) for name in ("seq", "indir", "fin_seq")})
        return SimpleNamespace(**views, scratch=ws.view("beam_scratch", (3 * r, length)),
                               flags=ws.view("flags", (batch, 3)), starts=ws.view("starts", (batch,)),
                               max_new=ws.view("max_new", (1,)), step=ws.view("step", (1,)),
                               stats=ws.view("stats", (r, slices, 2)), renorm=ws.view("renorm", (r, slices, 2)),
                               keys=ws.view("keys", (r * slices * KEEP_MAX,)), banned=ws.view("banned", (self.vocab,)),
                               n_banned=ws.view("n_banned", (1,)))

    def _beam_select(self, batch: int, params):
        logits = self.ws.view("logits", (batch * params.num_beams, self.vocab))
        eos = self.ws.view("eos", (len(params.eos_token_ids),))
        self.ops.beam_select(logits, self.beam_state(batch, params.num_beams), eos, params=params, batch=batch)

    def beam_start(self, prompts: list, params):
        """Prefill num_beams copies of each prompt, set up the beams, and take step 0."""
        nb, batch = params.num_beams, len(prompts)
        if batch * nb > self.max_batch:
            raise InputError(f"{batch} prompts x {nb} beams exceed this runner's {self.max_batch} sequences")
        self._check_room(prompts, params)
        self._next_step(params, first=True)
        seq = self._begin([p for p in prompts for _ in range(nb)], params)
        r, length = seq.shape
        scores = np.tile(np.array([0.0] + [NEG] * (nb - 1), np.float32), batch)  # identical beams: one counts
        state = {"indir": np.repeat(np.arange(r), length).reshape(r, length), "fin_seq": seq,
                 "fin_len": np.zeros(r), "fin_flag": np.zeros(r), "flags": np.tile([1, 0, 0], batch),
                 "starts": [len(p) for p in prompts], "max_new": [params.max_new_tokens]}
        banned = np.unique(np.asarray(self.beam_banned, np.int32))
        state.update({"n_banned": [len(banned)], "banned": banned})
        for name, values in state.items():
            self._upload(name, values)
        for name, values in (("run_scores", scores), ("fin_scores", np.full(r, NEG))):
            self._upload(name, values, np.float32)
        self._beam_select(batch, params)

    def beam_steps(self, batch: int, count: int, params):
        r, key = batch * params.num_beams, ("beam", batch, params.graph_key())
        for _ in range(count):
            self._next_step(params)
            self.graphs.run(key,
                            lambda: (self._decode_launches(r, indirect=True), self._beam_select(batch, params)))

    def fetch_beam_flags(self, batch: int):
        """Queue a copy of the per-prompt flags (batch, 3): improvable, done, non-finite logits."""
        return self.ops.copy_to_host_async(self.ws.view("flags", (batch, 3)))

    def beam_results(self, prompts: list, params) -> list:
        """[(new token ids, score)] per prompt, best first, params.num_return_sequences of them."""
        st = self.beam_state(len(prompts), params.num_beams)
        seqs, scores, lengths = (self.ops.to_host(a) for a in (st.fin_seq, st.fin_scores, st.fin_len))
        out = []
        for b, p in enumerate(prompts):
            rows = range(b * params.num_beams, b * params.num_beams + params.num_return_sequences)
            out.append([(seqs[r, len(p):len(p) + int(lengths[r])].astype(int).tolist(), float(scores[r]))
                        for r in rows])
        return out
