"""Encoder-decoder benchmark: ftengine (CUDA) against HF `generate` in the same process.

Three models' shapes with HF's random initialisation, each saved once and loaded by both:
Marian-base (opus-mt-en-de: d_model 512, 6 + 6 post-LayerNorm layers, 8 heads, FFN 2,048, swish,
a 58,101-token vocabulary), NLLB-200-distilled-600M (M2M100: d_model 1,024, 12 + 12
pre-LayerNorm layers, 16 heads, FFN 4,096, ReLU, a 256,206-token vocabulary) and t5-base (d_model
768, 12 + 12 RMS-norm layers, 12 heads, relative position biases, FFN 3,072, ReLU, 32,128
tokens, tied head); fp16; 32-token sources of random ids, 64 new tokens (min_new_tokens 64 on both sides, so that
both generate exactly as many); batch 1 and 32; greedy and beam 4. ftengine is timed from token
ids in (the encoder pass, the memory's projection, the prefill and every step) to the chosen ids
on the host; HF from input ids on the GPU to its output ids (sdpa attention). Median of repeats
after warm-up. Reported: ms per step (a new token of every sequence), generated tokens/s, and the
encoder pass alone. ftengine is timed twice: first in a child process that never imports torch
("alone": as a service without PyTorch runs it), then in this process after HF's model is on the
GPU ("beside torch"; bench_decoder.py's docstring measured such a process's steps slower).

Usage: python bench/bench_seq2seq.py --out bench/results [--models marian-base,nllb-600m,t5-base]
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
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftengine.backends.cuda import ops as cuda_ops  # noqa: E402
from ftengine.config import load_seq2seq_config  # noqa: E402
from ftengine.decoding.beam import beam_search  # noqa: E402
from ftengine.decoding.generate import GenerationParams, stream_tokens  # noqa: E402
from ftengine.models.seq2seq import Seq2SeqRunner  # noqa: E402
from ftengine.seq2seq_checkpoint import load_seq2seq_weights  # noqa: E402
from bench.bench_decoder import timed  # noqa: E402

SOURCE, NEW = 32, 64
CASES = [("greedy", 1), ("greedy", 32), ("beam 4", 1), ("beam 4", 32)]
MARIAN_BASE = dict(vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                   decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish",
                   max_position_embeddings=512, scale_embedding=True, pad_token_id=58100, eos_token_id=0,
                   decoder_start_token_id=58100)
NLLB_600M = dict(vocab_size=256206, d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                 decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, activation_function="relu",
                 max_position_embeddings=1024, scale_embedding=True, pad_token_id=1, eos_token_id=2, bos_token_id=0,
                 decoder_start_token_id=2)
T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12,
               relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
               tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
MODELS = {"marian-base": ("MarianConfig", "MarianMTModel", MARIAN_BASE),
          "nllb-600m": ("M2M100Config", "M2M100ForConditionalGeneration", NLLB_600M),
          "t5-base": ("T5Config", "T5ForConditionalGeneration", T5_BASE)}
TARGETS = {("marian-base", "greedy", 1): "<= 0.2 ms/token", ("marian-base", "beam 4", 32): ">= 50,000 tokens/s"}


def save_model(name: str, folder: Path):
    import torch
    import transformers
    config_class, model_class, shapes = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**shapes))
    model.half().save_pretrained(str(folder))


def seq2seq_generation(folder: Path, sources: list, beams: int, ops, dtype: str) -> tuple:
    """(the runner, a call generating NEW tokens for each source from its ids: the encoder pass,
    the memory, the prefill and every step) on `ops` in `dtype`; greedy, or beam search."""
    config = load_seq2seq_config(folder)
    runner = Seq2SeqRunner(config, load_seq2seq_weights(folder, config), ops, dtype=dtype,
                           max_batch=len(sources) * beams, max_len=128, max_source=64)
    params = GenerationParams(max_new_tokens=NEW, min_new_tokens=NEW, eos_token_ids=(config.eos_token_id,),
                              num_beams=beams).checked(vocab_size=config.vocab_size)
    prompts = [[config.decoder_start_token_id] for _ in sources]

    def generate():
        runner.encode(sources, copies=beams)
        if beams > 1:
            return beam_search(runner, prompts, params)
        return list(stream_tokens(runner, prompts, params))
    return runner, generate


def ours(folder: Path, sources: list, beams: int) -> dict:
    runner, generate = seq2seq_generation(folder, sources, beams, cuda_ops, "fp16")
    generate()
    ms = timed(generate, repeat=5)
    encode_ms = timed(lambda: runner.encode(sources, copies=beams), repeat=5)
    return {"ms": ms, "encode_ms": encode_ms}


def theirs(model, sources: list, beams: int) -> float:
    import torch
    ids = torch.tensor(sources, device="cuda")

    def generate():
        with torch.no_grad():
            model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=beams, do_sample=False)
    generate()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def alone(folder: Path) -> list:
    """ours() for every case's sources (folder / sources.json), in a process without torch."""
    cases = json.loads((folder / "sources.json").read_text())
    return [ours(folder, sources, beams) for sources, beams in cases]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--alone", metavar="FOLDER", help=argparse.SUPPRESS)  # the child process of bench_model
    args = p.parse_args()
    if args.alone:
        print(json.dumps(alone(Path(args.alone))))
        return
    import cupy
    import torch
    import transformers
    rng = np.random.default_rng(0)
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            rows += bench_model(name, Path(tmp) / name, rng)
    write_results(rows, Path(args.out), cupy, torch, transformers)


def bench_model(name: str, folder: Path, rng) -> list:
    import torch
    import transformers
    shapes = MODELS[name][2]
    save_model(name, folder)
    cases = []
    for mode, batch in CASES:
        # ids clear of the specials, eos last
        sources = rng.integers(4, shapes["vocab_size"] - 1, (batch, SOURCE)).tolist()
        for s in sources:
            s[-1] = shapes["eos_token_id"]
        cases.append((sources, 4 if mode.startswith("beam") else 1))
    (folder / "sources.json").write_text(json.dumps(cases))
    child = subprocess.run([sys.executable, __file__, "--alone", str(folder)], capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"the ftengine-alone child failed: {child.stderr[-2000:]}")
    found_alone = json.loads(child.stdout.splitlines()[-1])
    model = getattr(transformers, MODELS[name][1]).from_pretrained(folder, dtype=torch.float16,
                                                                   attn_implementation="sdpa").cuda().eval()
    rows = []
    for (mode, batch), (sources, beams), solo in zip(CASES, cases, found_alone):
        found = ours(folder, sources, beams)
        hf_ms = theirs(model, sources, beams)
        row = {"model": name, "mode": mode, "batch": batch, "source": SOURCE, "new_tokens": NEW,
               "ftengine_alone_ms_per_step": round(solo["ms"] / NEW, 4),
               "ftengine_alone_tokens_per_s": round(batch * NEW / solo["ms"] * 1e3),
               "ftengine_ms_per_step": round(found["ms"] / NEW, 4),
               "ftengine_tokens_per_s": round(batch * NEW / found["ms"] * 1e3),
               "ftengine_encode_ms": round(solo["encode_ms"], 4),
               "hf_ms_per_step": round(hf_ms / NEW, 4), "hf_tokens_per_s": round(batch * NEW / hf_ms * 1e3),
               "speedup_alone": round(hf_ms / solo["ms"], 1), "speedup": round(hf_ms / found["ms"], 1),
               "target": TARGETS.get((name, mode, batch), "")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    del model
    torch.cuda.empty_cache()
    return rows


def write_results(rows: list, out: Path, cupy, torch, transformers):
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    result = {"device": device, "date": date.today().isoformat(), "rows": rows,
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "seq2seq.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Encoder-decoder benchmark — {device}, {result['date']}", "",
             "Marian-base (opus-mt-en-de), NLLB-200-distilled-600M and t5-base shapes, HF random initialisation, "
             "fp16; "
             "32-token sources, 64 new tokens "
             "(min_new_tokens 64 on both sides). ftengine: token ids in -> chosen ids on the host (encoder, memory, "
             "prefill, steps), alone = in a process without torch, as a service runs it; beside torch = in the "
             "process that holds HF's model; HF `generate` with sdpa, inputs on the GPU. ms per step = whole "
             "generation / 64; tokens/s = batch x 64 / whole generation; speed-up = HF's time / ftengine's "
             "(alone, beside torch).", "",
             "| model | mode | batch | ftengine ms/step alone | tokens/s alone | ms/step beside torch "
             "| encoder ms | HF ms/step | HF tokens/s | speed-up | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['ftengine_alone_ms_per_step']} | "
                     f"{r['ftengine_alone_tokens_per_s']:,} | {r['ftengine_ms_per_step']} | {r['ftengine_encode_ms']} | "
                     f"{r['hf_ms_per_step']} | {r['hf_tokens_per_s']:,} | {r['speedup_alone']}x, {r['speedup']}x | "
                     f"{r['target']} |")
    (out / "seq2seq.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
