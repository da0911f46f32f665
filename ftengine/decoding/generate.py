"""The generation loop: prefill, then one decode step per new token; the runner chooses each
token on its device with HF `generate` semantics (decoding/processors.py is the reference) and
keeps the step state there, so the host only reads tokens back every few steps."""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InputError, PromptError

MAX_EOS_IDS = 16  # eos ids one generation may name (the runner's device buffer holds this many)
CHUNK_STEPS = 8   # steps queued on the device between two reads of the chosen tokens (at most)


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple = ()
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    renormalize_logits: bool = False  # beam search: a log-softmax after the processors (HF's)

    def checked(self, *, vocab_size: int) -> "GenerationParams":
        """Validate; top_k above the vocabulary is clamped to it (keeps every token, as HF does);
        a sampling run without a seed gets a random one."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InputError(f"min_new_tokens must be within 0..max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_new_tokens}")
        if not 0 < self.temperature < math.inf:
            if self.do_sample:
                raise InputError(f"temperature must be a finite number > 0, got {self.temperature}; for "
                                 "deterministic output use greedy decoding (no do_sample)")
            raise InputError(f"temperature {self.temperature} is not a finite number > 0, and it applies to "
                             "sampling only (do_sample): greedy decoding always takes the most likely token, so "
                             "leave temperature out")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InputError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not math.isfinite(self.length_penalty):
            raise InputError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise InputError(f"no_repeat_ngram_size must be >= 0 (0 turns it off), got {self.no_repeat_ngram_size}")
        if not 1 <= self.num_beams <= vocab_size:
            raise InputError(f"num_beams must be within 1..{vocab_size} (the vocabulary), got {self.num_beams}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise InputError(f"num_return_sequences must be within 1..num_beams ({self.num_beams}), "
                             f"got {self.num_return_sequences}")
        if self.num_beams > 1 and self.do_sample:
            raise InputError("beam sampling is not supported: use num_beams=1 with do_sample, or beams without it")
        if not isinstance(self.renormalize_logits, bool):
            raise InputError(f"renormalize_logits must be true or false, got {self.renormalize_logits!r}")
        if self.early_stopping not in (True, False, "never"):
            raise InputError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if len(self.eos_token_ids) > MAX_EOS_IDS:
            raise InputError(f"at most {MAX_EOS_IDS} eos token ids, got {len(self.eos_token_ids)}")
        for e in self.eos_token_ids:
            if not 0 <= e < vocab_size:
                raise InputError(f"eos token id {e} is outside the vocabulary 0..{vocab_size - 1}")
        seed = self.seed
        if self.do_sample and seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        if seed is not None and not 0 <= seed < 2 ** 64:
            raise InputError(f"seed must be within 0..2^64-1, got {seed}")
        return replace(self, top_k=min(self.top_k, vocab_size), seed=seed)

    def seed_words(self) -> np.ndarray:
        """The seed as the draw reads it on the device: (2,) uint32, low word then high (0 without one)."""
        seed = self.seed or 0
        return np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)

    def graph_key(self) -> "GenerationParams":
        """These parameters as a captured decode step takes them, to key its graph by: the seed, the
        eos ids and max_new_tokens (which beam search's selection reads) reach the step through
        device memory, uploaded as each generation starts, so only the number of eos ids counts.
        Generations that differ only there or in num_return_sequences (and every sampling call
        without a seed: it draws a new one) replay one step graph instead of capturing their own;
        renormalize_logits counts only where beams read it."""
        return replace(self, seed=None, eos_token_ids=(0,) * len(self.eos_token_ids), num_return_sequences=1,
                       max_new_tokens=0, renormalize_logits=self.renormalize_logits and self.num_beams > 1)


def check_prompts(prompts: list, params: GenerationParams, n_positions: int):
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise PromptError(i, "is empty: GPT-2 needs at least one prompt token")
        if len(p) + params.max_new_tokens > n_positions:
            raise PromptError(i, f"has {len(p)} tokens; with max_new_tokens {params.max_new_tokens} that is beyond "
                                 f"the model's n_positions {n_positions}")


def check_max_batch(max_batch, params: GenerationParams) -> int:
    """A call's max_batch (decoder rows at once): an integer of at least num_beams."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < params.num_beams:
        raise InputError(f"max_batch must be an integer >= num_beams ({params.num_beams}), got {max_batch!r}")
    return max_batch


def pipelined(total: int, run_steps, fetch):
    """The host side of a generation whose step 0 is queued: queue the other steps in chunks of
    1, 2, 4 ... CHUNK_STEPS, always one chunk ahead, and yield each chunk's result
    (fetch(first step, last step + 1).wait()) while the next chunk runs on the device. Closing
    the generator stops the queueing."""
    pending = deque([fetch(0, 1)])
    queued, chunk = 1, 1
    while pending:
        if queued < total and len(pending) < 2:
            chunk = min(2 * chunk, CHUNK_STEPS, total - queued)
            run_steps(chunk)
            pending.append(fetch(queued, queued + chunk))
            queued += chunk
        yield pending.popleft().wait()


def stream_tokens(runner, prompts: list, params: GenerationParams):
    """Yield, after each step, the list of (sequence index, new token) of the sequences still
    running at that step. A sequence stops after an eos token (which is yielded) or after
    max_new_tokens. The steps run on the device one chunk ahead of the host: the host reads the
    chosen tokens of a chunk while the next chunk runs, and stops queueing once all are finished."""
    check_prompts(prompts, params, runner.config.n_positions)
    b, total = len(prompts), params.max_new_tokens
    eos = set(params.eos_token_ids)
    running = np.ones(b, dtype=bool)
    runner.start(prompts, params)
    step = 0
    for rows in pipelined(total, lambda n: runner.steps(b, n, params),
                          lambda first, last: runner.fetch_history(b, first, last)):
        for row in rows:
            step += 1
            live = np.flatnonzero(running)
            bad = live[row[live] < 0]
            if bad.size:
                raise InputError(f"non-finite logits (NaN or inf) for prompt {bad[0] + 1} at step {step}; "
                                 "the model or its weights produce invalid values")
            yield [(int(i), int(row[i])) for i in live]
            running[live] = [int(row[i]) not in eos for i in live]
            if not running.any():
                return
