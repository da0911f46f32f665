"""Encoder benchmark: ftengine (CUDA) against HuggingFace BertModel in the same process.

BERT-base with HF BertConfig defaults and HF's random initialisation (saved once, loaded by
both), full-length padded batches, fp16 and fp32. ftengine is timed end to end per batch
(host token ids in, pooled embeddings back on the host); HF is timed on its forward pass
with inputs already on the GPU. Median of repeats after warm-up, synchronised timing.

Also: a per-op GPU time breakdown of one ftengine forward pass, and `Encoder.encode`
throughput on a synthetic file with all-MiniLM-L6-v2-shaped weights against
sentence-transformers on the same GPU.

Usage: python bench/bench_encoder.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftengine import Encoder  # noqa: E402
from ftengine.backends.cuda import ops as cuda_ops  # noqa: E402
from ftengine.checkpoint import load_bert_weights  # noqa: E402
from ftengine.config import load_bert_config  # noqa: E402
from ftengine.models.bert import BertRunner, make_batch  # noqa: E402
from weights.fixtures import WORDS, write_bert_checkpoint  # noqa: E402

SHAPES = [(1, 128), (32, 128), (256, 128), (64, 512)]
TARGETS_FP16 = {(1, 128): 0.4, (32, 128): 1.6, (256, 128): 11.0}


def median_ms(fn, *, warmup=5, repeat=30, sync):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def save_hf_bert_base(folder: Path):
    import torch
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    model = BertModel(BertConfig(), add_pooling_layer=False)
    model.save_pretrained(str(folder), safe_serialization=True)


def hf_models(folder, dtype):
    import torch
    from transformers import BertModel
    td = {"fp16": torch.float16, "fp32": torch.float32}[dtype]
    out = {}
    for impl in ("sdpa", "eager"):
        m = BertModel.from_pretrained(str(folder), attn_implementation=impl, add_pooling_layer=False)
        out[impl] = m.to(td).cuda().eval()
    return out


def time_shapes(folder, rows):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    config = load_bert_config(folder)
    weights = load_bert_weights(folder, config)
    rng = np.random.default_rng(0)
    for dtype in ("fp16", "fp32"):
        models = hf_models(folder, dtype)
        runners = {}
        for b, s in SHAPES:
            key = s
            if key not in runners:
                runners[key] = BertRunner(config, weights, cuda_ops, dtype=dtype,
                                          max_batch_tokens=max(bb * ss for bb, ss in SHAPES if ss == s),
                                          max_seq_len=s)
            runner = runners[key]
            ids = rng.integers(1000, config.vocab_size, (b, s)).astype(np.int32)
            batch = make_batch(ids.tolist(), np.zeros((b, s), np.int32).tolist(), pad_id=0)
            ft = median_ms(lambda: runner.embed(batch, pooling=("mean",), normalize=True),
                           sync=cuda_ops.synchronize)
            t_ids = torch.from_numpy(ids.astype(np.int64)).cuda()
            t_mask = torch.ones_like(t_ids)
            hf = {}
            for impl, m in models.items():
                def run(m=m):
                    with torch.no_grad():
                        m(input_ids=t_ids, attention_mask=t_mask)
                hf[impl] = median_ms(run, sync=torch.cuda.synchronize, repeat=20)
            row = {"model": "bert-base", "dtype": dtype, "batch": b, "seq": s, "lengths": "full",
                   "ftengine_ms": round(ft, 4), "hf_sdpa_ms": round(hf["sdpa"], 4),
                   "hf_eager_ms": round(hf["eager"], 4), "speedup_vs_sdpa": round(hf["sdpa"] / ft, 2)}
            if dtype == "fp16" and (b, s) in TARGETS_FP16:
                row["target_ms"] = TARGETS_FP16[(b, s)]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del models, runners


OP_NAMES = ("matmul", "batched_matmul", "embed_layernorm", "add_qkv_bias_split_heads", "masked_softmax",
            "merge_heads", "add_bias_residual_layernorm", "add_bias_gelu", "pool", "l2_normalize")


class RecordedOps:
    """The CUDA ops module, also recording every op call (label, function, arguments)."""

    def __init__(self, ops):
        self._ops = ops
        self.calls = []

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name not in OP_NAMES:
            return fn

        def recorded(*args, **kwargs):
            label = name
            if name == "matmul":
                label = f"matmul {args[1].shape[1]}->{args[2].shape[0]}"
            elif name == "batched_matmul":
                label = "batched_matmul QK^T" if kwargs.get("transpose_b") else "batched_matmul PV"
            self.calls.append((label, fn, args, kwargs))
            fn(*args, **kwargs)
        return recorded


def breakdown(folder, b, s, dtype="fp16", repeat=20):
    """GPU time per op of one forward pass: each recorded op call is captured `repeat` times
    into a graph of its own and timed with CUDA events around the replay (launch cost ~0)."""
    import cupy
    config = load_bert_config(folder)
    recorded = RecordedOps(cuda_ops)
    runner = BertRunner(config, load_bert_weights(folder, config), recorded, dtype=dtype,
                        max_batch_tokens=b * s, max_seq_len=s, graphs=False)
    ids = np.random.default_rng(1).integers(1000, config.vocab_size, (b, s)).tolist()
    batch = make_batch(ids, [[0] * s] * b, pad_id=0)
    runner.embed(batch, pooling=("mean",), normalize=True)
    stream = cuda_ops.context().stream
    total, count = defaultdict(float), defaultdict(int)
    for label, fn, args, kwargs in recorded.calls:
        stream.begin_capture()
        for _ in range(repeat):
            fn(*args, **kwargs)
        graph = stream.end_capture()
        graph.launch(stream=stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream=stream)
        end.record(stream)
        end.synchronize()
        total[label] += cupy.cuda.get_elapsed_time(start, end) / repeat
        count[label] += 1
    runner.graphs.enabled = True
    whole = median_ms(lambda: runner.embed(batch, pooling=("mean",), normalize=True), sync=cuda_ops.synchronize)
    rows = [{"op": k, "calls": count[k], "ms": round(v, 4)} for k, v in sorted(total.items(), key=lambda kv: -kv[1])]
    return {"model": "bert-base", "dtype": dtype, "batch": b, "seq": s, "ops": rows,
            "sum_ms": round(sum(total.values()), 4), "end_to_end_ms": round(whole, 4)}


def synthetic_lines(n, rng):
    lengths = np.clip(rng.lognormal(mean=2.8, sigma=0.6, size=n), 1, 200).astype(int)
    return [" ".join(rng.choice(WORDS, k)) for k in lengths]


def throughput(tmp: Path):
    import torch
    from sentence_transformers import SentenceTransformer
    folder = write_bert_checkpoint(
        tmp / "minilm", seed=3, hidden=384, layers=6, heads=12, intermediate=1536, max_positions=512,
        sentence_transformers={"pooling": {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True},
                               "normalize": True, "max_seq_length": 256})
    lines = synthetic_lines(50_000, np.random.default_rng(2))
    out = []
    enc = Encoder.from_pretrained(folder, device="cuda", dtype="fp16")
    enc.encode(lines[:2000])
    t0 = time.perf_counter()
    _, stats = enc.encode_with_stats(lines)
    ft_s = time.perf_counter() - t0
    out.append({"engine": "ftengine fp16", "lines": len(lines), "tokens": stats.tokens,
                "seconds": round(ft_s, 3), "lines_per_s": round(len(lines) / ft_s), "tokens_per_s": round(stats.tokens / ft_s)})
    for label, half in (("sentence-transformers fp32", False), ("sentence-transformers fp16", True)):
        st = SentenceTransformer(str(folder), device="cuda")
        if half:
            st = st.half()
        st.encode(lines[:2000], batch_size=128)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st.encode(lines, batch_size=128)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        out.append({"engine": label + " (batch_size 128)", "lines": len(lines), "tokens": stats.tokens,
                    "seconds": round(s, 3), "lines_per_s": round(len(lines) / s), "tokens_per_s": round(stats.tokens / s)})
    for row in out:
        print(json.dumps(row), flush=True)
    return out


def versions():
    import cupy
    import torch
    import transformers
    return {"python": platform.python_version(), "cupy": cupy.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion()}


def markdown(result) -> str:
    lines = [f"# Encoder benchmark — {result['device']}, {result['date']}", "",
             "BERT-base (HF BertConfig defaults, random weights), full-length padded batches. "
             "ftengine: host ids in -> pooled embeddings on the host; HF: forward with inputs on the GPU.", "",
             "| dtype | batch x seq | ftengine ms | HF sdpa ms | HF eager ms | speed-up vs sdpa | target |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['batch']} x {r['seq']} | {r['ftengine_ms']:.3f} | {r['hf_sdpa_ms']:.3f} | "
                     f"{r['hf_eager_ms']:.3f} | {r['speedup_vs_sdpa']:.1f}x | {r.get('target_ms', '')} |")
    for bd in result["breakdown"]:
        lines += ["", f"GPU time per op, one forward pass, {bd['batch']} x {bd['seq']} {bd['dtype']} (each op call "
                  f"replayed alone from a graph): {bd['sum_ms']:.3f} ms in ops; end to end {bd['end_to_end_ms']:.3f} ms "
                  "(graph replay + input copy + result copy back)",
                  "", "| op | calls | ms | share |", "|---|---|---|---|"]
        for r in bd["ops"]:
            lines.append(f"| {r['op']} | {r['calls']} | {r['ms']:.3f} | {100 * r['ms'] / bd['sum_ms']:.1f}% |")
    lines += ["", "`Encoder.encode` on 50,000 synthetic lines (all-MiniLM-L6-v2 shape, random weights):", "",
              "| engine | lines/s | tokens/s | seconds |", "|---|---|---|---|"]
    for r in result["throughput"]:
        lines.append(f"| {r['engine']} | {r['lines_per_s']} | {r['tokens_per_s']} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    result = {"device": cuda_ops.context().device_name, "date": date.today().isoformat(),
              "versions": versions(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bert-base"
        save_hf_bert_base(folder)
        time_shapes(folder, result["rows"])
        result["breakdown"] = [breakdown(folder, 1, 128), breakdown(folder, 32, 128)]
        result["throughput"] = throughput(Path(tmp))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "encoder.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "encoder.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
