"""Decoder benchmark: ftengine GPT-2 generation (CUDA) against HuggingFace `generate` in the
same process, GPT-2 small (HF GPT2Config defaults, HF random initialisation), fp16.

Per case: prompt 32 tokens, 128 new tokens (min_new_tokens = max_new_tokens on both sides so
both do the same number of steps). ms per step = (generation time - prefill time) / steps for
ftengine; HF's = its whole `generate` time / new tokens. Also prefill times, the GPU time per op
of a prefill and of a decode step (batch 1 and 32), the token choice alone, and the greedy
batch-1 step against the weight-read floor.

ftengine's cases run after HF's earlier cases in the same process. On the H100 (2026-11-24),
once any kernel has run on a CUDA stream other than ftengine's (torch's, or CuPy's default
stream: 10 elementwise launches suffice), a GPT-2 small batch-32 step replayed from its graph
takes about 17 us longer for the rest of the process (0.464 -> 0.481 ms top-k steps back to
back; not the clocks, the stack limit, the cache configuration, allocations, or kernels on
ftengine's own stream); the figures here include that. Measured again on 2026-11-26 (H100, greedy
batch 32 generations, ms a step, each in a fresh process): a kernel on torch's stream or on another
CuPy stream changed nothing (0.447-0.451 before and after), while torch holding a filled 20 GB
tensor made it 0.461 for a runner built before and 0.467 for one built after, and HF's model after
its generate 0.465 and 0.484; in a second run a 700 MB CuPy block that no runner used, allocated
after the first runners, did the same for the runners built after it (0.447 -> 0.464-0.465), and
a runner's weights moved into one block changed nothing; in a third run CuPy blocks of 64 MB to
4 GB allocated next to an existing runner (held, then freed) left its steps at 0.442-0.443. So
what slows a step is where a runner built after other allocations lands, or torch's activity, not
memory held as such; why is still not established. Ten runners alive at once in a fresh process
(about 0.55 GB each, built one after another) all took 0.443-0.453 ms a greedy batch-32 step, the
last built as fast as the first (H100, 2026-11-26): other runners' buffers allocated before a
runner did not slow it, where the 700 MB block above did. The table's "alone" column times the
same cases first, in a child process that never imports torch (--steps-alone), as a service
without PyTorch runs them. Every timing holds Python's garbage collector off (collector_held).

Usage: python bench/bench_decoder.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftengine.backends.cuda import ops as cuda_ops  # noqa: E402
from ftengine.checkpoint import load_gpt2_weights  # noqa: E402
from ftengine.config import load_gpt2_config  # noqa: E402
from ftengine.decoding.beam import beam_search  # noqa: E402
from ftengine.decoding.generate import GenerationParams, stream_tokens  # noqa: E402
from ftengine.models.gpt2 import GPT2Runner  # noqa: E402
from bench.bench_encoder import RecordedOps, collector_held, graph_ms  # noqa: E402

CASES = [("greedy", 1, {}), ("greedy", 32, {}), ("topk", 32, {"do_sample": True, "top_k": 40}),
         ("topp", 32, {"do_sample": True, "top_p": 0.9}), ("beam", 1, {"num_beams": 4}),
         ("beam", 32, {"num_beams": 4})]
TARGETS = {("greedy", 1): 0.15, ("topk", 32): 0.45, ("topp", 32): 0.5, ("beam", 1): 0.3}
PREFILL_TARGETS = {(1, 512): 0.4, (32, 128): 1.6}
PREFILL_OPS = ("matmul", "matmul_bias_gelu", "matmul_residual_layernorm", "embed_positions", "layernorm",
               "residual_layernorm", "write_kv_cache", "varlen_attention", "gather_rows", "mark_seen")
DECODE_OPS = ("matmul", "matmul_bias_gelu", "matmul_residual_layernorm", "embed_positions", "layernorm",
              "decode_attention")
PROMPT, NEW = 32, 128
DECODE_CACHED = PROMPT + NEW // 2  # the decode-step breakdown: positions in the cache, mid-generation
CHOICE_MODES = [("greedy", {}), ("sample", {"do_sample": True}), ("top-k 40", {"do_sample": True, "top_k": 40}),
                ("top-p 0.9", {"do_sample": True, "top_p": 0.9}),
                ("top-k 50 + top-p 0.9", {"do_sample": True, "top_k": 50, "top_p": 0.9})]


def save_gpt2_small(folder: Path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(str(folder), safe_serialization=True)


def timed(fn, repeat=3):
    times = []
    with collector_held():
        for _ in range(repeat):
            cuda_ops.synchronize()
            t0 = time.perf_counter()
            fn()
            cuda_ops.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def prefill_breakdown(config, weights, prompts) -> dict:
    """GPU time per op of one prefill: each recorded op call replayed alone from a graph."""
    recorded = RecordedOps(cuda_ops, PREFILL_OPS)
    runner = GPT2Runner(config, weights, recorded, dtype="fp16", max_batch=len(prompts), max_len=len(prompts[0]),
                        graphs=False)
    runner.prefill(prompts)
    return replayed_ops(recorded.calls)


def decode_breakdown(config, weights, prompts) -> dict:
    """GPU time per op of one decode step after the prompts (their positions in the KV cache):
    each recorded op call replayed alone from a graph."""
    recorded = RecordedOps(cuda_ops, DECODE_OPS)
    cached = len(prompts[0])
    runner = GPT2Runner(config, weights, recorded, dtype="fp16", max_batch=len(prompts), max_len=cached + 1,
                        graphs=False)
    runner.prefill(prompts)
    recorded.calls.clear()
    runner.decode([row[-1] for row in prompts], [cached] * len(prompts))
    return replayed_ops(recorded.calls)


def replayed_ops(calls) -> dict:
    """Per op label: its calls and their GPU time, each call replayed alone from a graph."""
    total, count = defaultdict(float), defaultdict(int)
    for label, fn, args, kwargs in calls:
        total[label] += graph_ms(lambda: fn(*args, **kwargs))
        count[label] += 1
    ops = [{"op": k, "calls": count[k], "ms": round(v, 4)} for k, v in sorted(total.items(), key=lambda kv: -kv[1])]
    return {"ops": ops, "ops_sum_ms": round(sum(total.values()), 4)}


def choice_alone(vocab_size: int, rng) -> list:
    """GPU time of the token choice alone (choose_tokens' kernels replayed from a graph) on random
    float32 logits of GPT-2's vocabulary, per batch and mode: sampling on each path, the kernels
    over vocabulary slices (what GPUs before sm_90 run) and the one-kernel cluster per row (sm_90+)."""
    from ftengine.backends.cuda.ops import choice_slices, sample_clusters
    ctx = cuda_ops.context()
    native = ctx.clusters
    paths = {"slices": False, "cluster": True} if native else {"slices": False}
    rows = []
    for b in (1, 32):
        logits = cuda_ops.to_device((rng.standard_normal((b, vocab_size)) * 2).astype(np.float32))
        seen = cuda_ops.to_device(np.zeros((b, vocab_size), np.uint8))
        eos, step = cuda_ops.to_device(np.array([50256], np.int32)), cuda_ops.to_device(np.array([0], np.int32))
        out, scratch = cuda_ops.empty((b,), np.int32), cuda_ops.empty((b, vocab_size), np.float32)
        state = cuda_ops.to_device(np.zeros((b, cuda_ops.CHOICE_STATE_WORDS), np.uint64))
        for label, options in CHOICE_MODES:
            params = GenerationParams(max_new_tokens=1, seed=1, **options).checked(vocab_size=vocab_size)
            seed = cuda_ops.to_device(params.seed_words())
            row = {"batch": b, "mode": label, "blocks_per_row": choice_slices(b, vocab_size)[0]}
            for path, clusters in paths.items():
                if not params.do_sample and clusters:
                    continue  # greedy has one path
                ctx.clusters = clusters
                try:
                    ms = graph_ms(lambda: cuda_ops.choose_tokens(out, logits, seen, eos, step, scratch=scratch,
                                                                 state=state, params=params, seed=seed))
                finally:
                    ctx.clusters = native
                row[f"{path}_us"] = round(ms * 1e3, 1)
            if "cluster_us" in row:
                row["cluster_blocks_per_row"] = sample_clusters(vocab_size)[0]
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def ftengine_step(config, weights, mode: str, batch: int, options: dict, prompts: list) -> tuple[float, float]:
    """(ms a step, ms of the prefill and first choice) of one case's generation on a new runner."""
    beams = options.get("num_beams", 1)
    runner = GPT2Runner(config, weights, cuda_ops, dtype="fp16", max_batch=batch * beams, max_len=PROMPT + NEW)
    params = GenerationParams(max_new_tokens=NEW, min_new_tokens=NEW, seed=1, eos_token_ids=(50256,),
                              **options).checked(vocab_size=config.vocab_size)
    if beams > 1:
        total = timed(lambda: beam_search(runner, prompts, params))
        prefill = timed(lambda: runner.beam_start(prompts, params))
    else:
        total = timed(lambda: list(stream_tokens(runner, prompts, params)))
        prefill = timed(lambda: runner.start(prompts, params))
    return (total - prefill) / (NEW - 1), prefill


def case_prompts(rng, vocab_size: int, batch: int) -> list:
    return rng.integers(0, vocab_size - 1, (batch, PROMPT)).tolist()


def steps_alone(folder: Path) -> list:
    """ftengine's ms a step for each of CASES (the same prompts as main's), in a process that has not
    imported torch: as a service without PyTorch runs them."""
    config = load_gpt2_config(folder)
    weights = load_gpt2_weights(folder, config)
    rng = np.random.default_rng(0)
    return [round(ftengine_step(config, weights, mode, batch, options,
                                case_prompts(rng, config.vocab_size, batch))[0], 4) for mode, batch, options in CASES]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--steps-alone", metavar="FOLDER", help=argparse.SUPPRESS)  # the child process of main
    args = p.parse_args()
    if args.steps_alone:
        print(json.dumps(steps_alone(Path(args.steps_alone))))
        return
    import torch
    from transformers import GPT2LMHeadModel
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2"
        save_gpt2_small(folder)
        child = subprocess.run([sys.executable, __file__, "--steps-alone", str(folder)], capture_output=True,
                               text=True, check=True)
        alone = json.loads(child.stdout.splitlines()[-1])
        config = load_gpt2_config(folder)
        weights = load_gpt2_weights(folder, config)
        hf = GPT2LMHeadModel.from_pretrained(str(folder)).half().cuda().eval()
        rng = np.random.default_rng(0)
        for (mode, batch, options), ft_alone in zip(CASES, alone):
            beams = options.get("num_beams", 1)
            prompts = case_prompts(rng, config.vocab_size, batch)
            ft_step, prefill = ftengine_step(config, weights, mode, batch, options, prompts)
            ids = torch.tensor(prompts).cuda()
            hf_kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=50256,
                             attention_mask=torch.ones_like(ids), **options)

            def run_hf():
                with torch.no_grad():
                    hf.generate(ids, **hf_kwargs)
            run_hf()
            hf_total = timed(run_hf, repeat=2)
            row = {"model": "gpt2", "dtype": "fp16", "mode": mode, "batch": batch, "beams": beams, "prompt": PROMPT,
                   "new_tokens": NEW, "ftengine_ms_per_step": round(ft_step, 4),
                   "ftengine_alone_ms_per_step": ft_alone, "ftengine_prefill_ms": round(prefill, 3),
                   "hf_ms_per_step": round(hf_total / NEW, 4), "speedup": round(hf_total / NEW / ft_step, 1),
                   "target_ms_per_step": TARGETS.get((mode, batch))}
            rows.append(row)
            print(json.dumps(row), flush=True)
        prefill_rows = []
        for b, s in ((1, 512), (32, 128)):
            runner = GPT2Runner(config, weights, cuda_ops, dtype="fp16", max_batch=b, max_len=s)
            prompts = rng.integers(0, config.vocab_size - 1, (b, s)).tolist()
            runner.prefill(prompts)
            graphed = timed(lambda: runner.prefill(prompts), repeat=20)
            runner.prefill_graphs.enabled = False
            direct = timed(lambda: runner.prefill(prompts), repeat=20)
            prefill_rows.append({"batch": b, "prompt": s, "ftengine_prefill_ms": round(graphed, 3),
                                 "direct_launches_ms": round(direct, 3), "target_ms": PREFILL_TARGETS[(b, s)],
                                 **prefill_breakdown(config, weights, prompts)})
            print(json.dumps(prefill_rows[-1]), flush=True)
        decode_rows = []
        for b in (1, 32):
            prompts = rng.integers(0, config.vocab_size - 1, (b, DECODE_CACHED)).tolist()
            decode_rows.append({"batch": b, "cached_positions": DECODE_CACHED,
                                **decode_breakdown(config, weights, prompts)})
            print(json.dumps(decode_rows[-1]), flush=True)
        choice_rows = choice_alone(config.vocab_size, rng)
    weight_bytes = sum(a.nbytes for a in [weights.wte, weights.wpe] + [x for l in weights.layers for x in vars(l).values()]) // 2
    floor_ms = weight_bytes / 3.0e12 * 1e3
    import cupy
    import transformers
    result = {"device": cuda_ops.context().device_name, "date": date.today().isoformat(),
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "numpy": np.__version__},
              "rows": rows, "prefill": prefill_rows, "decode_steps": decode_rows, "token_choice": choice_rows,
              "weight_read_floor": {"fp16_weight_bytes": int(weight_bytes), "ms_at_3TBps": round(floor_ms, 4)}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decoder.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Decoder benchmark — {result['device']}, {result['date']}", "",
             f"GPT-2 small (HF defaults, random weights), fp16, prompt {PROMPT}, {NEW} new tokens. "
             "Each step (decode, token choice or beam selection, bookkeeping) is one CUDA graph reading and updating "
             "its state in device memory; graphs run back to back, and the host reads the chosen tokens (beam "
             "search: the done flags) once per chunk of up to 8 steps while the next chunk runs. "
             "ms/step = (whole generation - prefill and first choice) / 127.", "",
             "ftengine ms/step: in this process, after HF's earlier cases (the speed-up's figure); alone: the same "
             "cases first, in a process that never imported torch (as a service without PyTorch runs them).", "",
             "| mode | batch | beams | ftengine ms/step | ftengine alone ms/step | HF ms/step | speed-up | "
             "target ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['batch']} | {r['beams']} | {r['ftengine_ms_per_step']:.3f} | "
                     f"{r['ftengine_alone_ms_per_step']:.3f} | {r['hf_ms_per_step']:.2f} | {r['speedup']}x | "
                     f"{r['target_ms_per_step'] or '-'} |")
    lines += ["", "Prefill (prompt tokens through the layers, the last token's logits): replayed from a graph per "
              "bucketed shape (tokens, prompts, longest), and with the same launches made directly from Python.", "",
              "| prefill | ftengine ms | direct launches ms | GPU time in ops ms | target ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} x {r['prompt']} | {r['ftengine_prefill_ms']:.3f} | {r['direct_launches_ms']:.3f} | "
              f"{r['ops_sum_ms']:.3f} | {r['target_ms']} |" for r in prefill_rows]
    for r in prefill_rows:
        lines += ["", f"GPU time per op, prefill {r['batch']} x {r['prompt']} fp16 (each op call replayed alone from "
                      "a graph):", "", "| op | calls | ms |", "|---|---|---|"]
        lines += [f"| {o['op']} | {o['calls']} | {o['ms']:.3f} |" for o in r["ops"]]
    for r in decode_rows:
        lines += ["", f"GPU time per op, one decode step at batch {r['batch']} with {r['cached_positions']} positions "
                      f"cached, fp16 (each op call replayed alone from a graph; the token choice apart, below): "
                      f"{r['ops_sum_ms']:.3f} ms in ops", "", "| op | calls | ms |", "|---|---|---|"]
        lines += [f"| {o['op']} | {o['calls']} | {o['ms']:.3f} |" for o in r["ops"]]
    lines += ["", "Token choice alone (the processors, top-k / top-p selects and the seeded draw), GPU time replayed "
              "from a graph, random float32 logits. Sliced kernels: each row's vocabulary split over several blocks, "
              "a kernel per step of the choice (GPUs before sm_90; greedy everywhere). One cluster kernel (sm_90+, "
              "sampling): a thread-block cluster per row, all steps in one kernel:", "",
              "| batch | mode | sliced: blocks per row | sliced us | cluster: blocks per row | cluster us |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['mode']} | {r['blocks_per_row']} | {r['slices_us']:.1f} | "
              f"{r.get('cluster_blocks_per_row', '-')} | {r.get('cluster_us', '-')} |" for r in choice_rows]
    lines += ["", f"Weight-read floor of a greedy batch-1 step: {weight_bytes / 1e6:.0f} MB of fp16 weights, "
              f"{floor_ms:.3f} ms at 3 TB/s."]
    (out / "decoder.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
