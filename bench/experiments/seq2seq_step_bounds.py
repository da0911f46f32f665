"""Upper bounds for fusing a decode step's attention with its output product (issue 53): whole
generations of bench_seq2seq's batch-1 cases (greedy and beam 4, 32-token sources, 64 new tokens,
fp16), ms a step, with kinds of kernels left out of every decoder layer:

    as is       the step as it runs
    no output   the self- and cross-attention output products left out: their residual + LayerNorm
                reads the attention's output in the product's place
    no attention  the self- and cross-attention kernels left out
    neither     both left out

The numbers are wrong without them and the tokens meaningless; the launches are otherwise the
step's own, graphs included. What a fused attention + output product could save is at most
"as is" - "no output", and nothing fused can make the step faster than "neither".

    PYTHONPATH=. python3 bench/experiments/seq2seq_step_bounds.py [--models marian-base,nllb-600m]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.bench_decoder import timed  # noqa: E402
from bench.bench_seq2seq import MODELS, NEW, SOURCE, save_model, seq2seq_generation  # noqa: E402
from ftengine.backends.cuda import ops as cuda_ops  # noqa: E402

VARIANTS = {"as is": (False, False), "no output": (True, False), "no attention": (False, True),
            "neither": (True, True)}


class LeftOut:
    """The CUDA ops with the attention kernels, or the products of the weights in `outputs`, left out."""

    def __init__(self, outputs: bool, attention: bool):
        self.outputs, self.attention, self.weights = outputs, attention, set()

    def __getattr__(self, name):
        if self.attention and name in ("cached_attention", "decode_attention"):
            return lambda *args, **kwargs: None
        if self.outputs and name == "norm_product":
            def norm_product(product, partials, x, weight):
                return x if weight.data.ptr in self.weights else cuda_ops.norm_product(product, partials, x, weight)
            return norm_product
        return getattr(cuda_ops, name)


def step_ms(folder: Path, sources: list, beams: int, outputs: bool, attention: bool) -> float:
    ops = LeftOut(outputs, attention)
    runner, generate = seq2seq_generation(folder, sources, beams, ops, "fp16")
    ops.weights = {w[k].data.ptr for w in runner.decoder for k in ("attn_out_weight", "cross_out_weight")}
    generate()
    return timed(generate, repeat=5) / NEW


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="marian-base,nllb-600m")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print("| model | variant | greedy, batch 1 (ms a step) | beam 4, batch 1 |")
    print("|---|---|---|---|")
    for name in args.models.split(","):
        shapes = MODELS[name][2]
        source = rng.integers(4, shapes["vocab_size"] - 1, SOURCE).tolist()
        source[-1] = shapes["eos_token_id"]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / name
            save_model(name, folder)
            for round_ in range(2):
                for label, (outputs, attention) in VARIANTS.items():
                    cells = [step_ms(folder, [source], beams, outputs, attention) for beams in (1, 4)]
                    print(f"| {name} (round {round_ + 1}) | {label} | {cells[0]:.4f} | {cells[1]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
