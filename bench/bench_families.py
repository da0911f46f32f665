"""Encoder families on the GPU: ftengine against HF transformers in the same run, one row per
family at BERT-base size (hidden 768, 12 layers, 12 heads, FFN 3072; ModernBERT-base's own
shape: 22 layers, GeGLU FFN 1152, local window 128), 32 x 128 tokens, fp16, plus ModernBERT at
8 x 2048 (where its local layers matter).

Each family's checkpoint is random (HF-like initialisation) in its own HF format, written by
the test fixtures (its own config keys, weight names and tokenizer kind); ftengine runs its
packed layout with mean pooling and normalisation, HF its AutoModel with sdpa attention (eager
for MPNet, which has no sdpa path).

Usage: python bench/bench_families.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_encoder import median_ms  # noqa: E402
from ftengine.checkpoint import load_bert_weights  # noqa: E402
from ftengine.config import load_bert_config  # noqa: E402
from ftengine.models.bert import Batch, BertRunner  # noqa: E402
from weights.fixtures import (ENCODER_TYPES, write_bert_checkpoint, write_encoder_checkpoint,  # noqa: E402
                               write_modernbert_checkpoint)

BATCH, SEQ = 32, 128
BASE = dict(hidden=768, layers=12, heads=12, intermediate=3072, max_positions=512, init="hf")
MODERNBERT_BASE = dict(hidden=768, layers=22, heads=12, intermediate=1152, max_positions=8192, local_attention=128)


def write_checkpoint(model_type: str, folder: Path) -> Path:
    if model_type == "bert":
        return write_bert_checkpoint(folder, seed=1, **BASE)
    if model_type == "modernbert":
        return write_modernbert_checkpoint(folder, seed=1, **MODERNBERT_BASE)
    return write_encoder_checkpoint(folder, model_type, seed=1, **BASE)


def time_family(model_type: str, folder: Path, batch_size: int = BATCH, seq: int = SEQ) -> dict:
    import torch
    from transformers import AutoModel
    from ftengine.backends.cuda import ops
    config = load_bert_config(folder)
    layout = "packed"
    runner = BertRunner(config, load_bert_weights(folder, config), ops, dtype="fp16",
                        max_batch_tokens=batch_size * seq, max_seq_len=seq, layout=layout)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size - 1, (batch_size, seq))
    ids = np.where(ids >= config.pad_token_id, ids + 1, ids)  # no pad ids inside the sequences
    batch = Batch.from_lists(ids.tolist(), np.zeros_like(ids).tolist())
    ours = median_ms(lambda: runner.embed(batch, pooling=("mean",), normalize=True), sync=ops.synchronize)
    attention = "eager" if model_type == "mpnet" else "sdpa"  # HF's MPNet has no sdpa path
    model = AutoModel.from_pretrained(str(folder), attn_implementation=attention).to(torch.float16).cuda().eval()
    t_ids = torch.from_numpy(ids).cuda()
    mask = torch.ones_like(t_ids)

    def hf():
        with torch.no_grad():
            model(input_ids=t_ids, attention_mask=mask)
    theirs = median_ms(hf, sync=torch.cuda.synchronize, repeat=20)
    return {"model_type": model_type, "family": config.family, "layout": layout, "batch": batch_size, "seq": seq,
            "dtype": "fp16",
            "ftengine_ms": round(ours, 4), "hf_ms": round(theirs, 4), "hf_attention": attention,
            "speedup": round(theirs / ours, 2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import cupy
    import torch
    import transformers
    tmp = Path(tempfile.mkdtemp(prefix="ftengine-families-"))
    rows = []
    for model_type in ("bert",) + ENCODER_TYPES + ("mpnet", "modernbert"):
        rows.append(time_family(model_type, write_checkpoint(model_type, tmp / model_type)))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(time_family("modernbert", tmp / "modernbert", 8, 2048))
    print(json.dumps(rows[-1]), flush=True)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    result = {"device": props["name"].decode(), "date": date.today().isoformat(),
              "versions": {"python": platform.python_version(), "cupy": cupy.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "families.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Encoder families — {result['device']}, {result['date']}", "",
             "BERT-base-sized random checkpoints (ModernBERT: ModernBERT-base's shape), fp16; ftengine (mean "
             "pooling, normalised; packed layout) vs HF AutoModel (sdpa; eager for MPNet, which has no sdpa path) in "
             "the same run; median of 30 (HF: 20). Versions: "
             + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + ".", "",
             "| model_type | batch x seq | layout | ftengine ms | HF ms (attention) | speed-up |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['model_type']} | {r['batch']} x {r['seq']} | {r['layout']} | {r['ftengine_ms']} | {r['hf_ms']} "
              f"({r['hf_attention']}) | {r['speedup']}x |" for r in rows]
    (args.out / "families.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
