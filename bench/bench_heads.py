"""Encoder task heads end to end: ftengine's Classifier.predict and TokenClassifier.predict
against HF's text-classification and token-classification pipelines in the same run, texts in,
labels or entities out.

The model: the --model-src folder's config and WordPiece tokenizer (all-MiniLM-L6-v2's) at
BERT-base size (hidden 768, 12 layers, 12 heads, FFN 3072), random HF-style weights, with a random
three-label sequence classification head, then a random BIO token classification head over
weights/fixtures.NER_LABELS; fp16 on the GPU (--device cpu: fp32, a smoke run). Texts: 6 to 20
vocabulary words each (bench_serve.sentences). ftengine with its defaults (the classifier's
auto tokenizer; the token classifier tokenises on the CPU, for the offsets); HF's pipeline with
sdpa attention at each of --hf-batches, its best reported. Both sides' answers are compared in the run: the share of texts with the same top
label, and of texts with the same entities (group, word, start, end) under "simple"
aggregation.

Usage: python bench/bench_heads.py --model-src PATH --out bench/results [--texts 2048]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import warnings
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_encoder import median_ms  # noqa: E402
from bench.bench_pipeline import make_model  # noqa: E402
from bench.bench_serve import sentences  # noqa: E402
from weights.fixtures import add_classification_head, add_token_classification_head  # noqa: E402

BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
STRATEGY = "simple"


def checkpoints(src: Path, tmp: Path) -> dict:
    """{"classify": folder, "ner": folder}: the same random encoder with each head."""
    base = make_model(src, tmp / "base", BERT_BASE)
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (base / name).unlink(missing_ok=True)  # a ...For*Classification folder, not an embedder
    shutil.rmtree(base / "1_Pooling", ignore_errors=True)
    folders = {task: tmp / task for task in ("classify", "ner")}
    for folder in folders.values():
        shutil.copytree(base, folder)
    add_classification_head(folders["classify"], num_labels=3)
    add_token_classification_head(folders["ner"])
    return folders


def entity_keys(entities: list) -> list:
    return [(e["entity_group"], e["word"], int(e["start"]), int(e["end"])) for e in entities]


def ours(task: str, folder: Path, texts: list, device: str) -> tuple:
    """(ms for all texts, answers) of ftengine's predict."""
    from ftengine import Classifier, TokenClassifier
    if task == "classify":
        with Classifier.from_pretrained(folder, device=device) as model:
            run = lambda: model.predict(texts)  # noqa: E731
            return median_ms(run, warmup=1, repeat=3, sync=lambda: None), run()
    with TokenClassifier.from_pretrained(folder, device=device) as model:
        run = lambda: model.predict(texts, aggregation_strategy=STRATEGY)  # noqa: E731
        return median_ms(run, warmup=1, repeat=3, sync=lambda: None), run()


def hf(task: str, folder: Path, texts: list, device: str, batch: int) -> tuple:
    """(ms for all texts, answers) of HF's pipeline with `batch` texts a forward pass."""
    import torch
    import transformers
    cuda = device == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        options = dict(aggregation_strategy=STRATEGY) if task == "ner" else {}
        pipe = transformers.pipeline("text-classification" if task == "classify" else "token-classification",
                                     model=str(folder), device=0 if cuda else "cpu",
                                     dtype=torch.float16 if cuda else torch.float32,
                                     model_kwargs={"attn_implementation": "sdpa"}, **options)
        run = lambda: pipe(texts, batch_size=batch)  # noqa: E731
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        return median_ms(run, warmup=1, repeat=3, sync=sync), run()


def agreement(task: str, got: list, expected: list) -> float:
    """Share of texts whose answer is the same on both sides (classify: the top label; ner: the
    entities, scores aside)."""
    if task == "classify":
        same = [a["label"] == b["label"] for a, b in zip(got, expected)]
    else:
        same = [entity_keys(a) == entity_keys(b) for a, b in zip(got, expected)]
    return sum(same) / len(same)


def markdown(r: dict) -> str:
    entities = sum(c.get("entities", 0) for c in r["cases"])
    out = [f"# Encoder task heads end to end — {r['device']}, {r['date']}", "",
           f"{r['texts']:,} texts of 6 to 20 words; BERT-base-sized random checkpoint with all-MiniLM-L6-v2's "
           f"WordPiece tokenizer, {r['dtype']}; ftengine's `Classifier.predict` (top label) and "
           f"`TokenClassifier.predict` (aggregation \"{STRATEGY}\") against HF's text-classification and "
           "token-classification pipelines (sdpa) in the same run, texts in, answers out; median of 3 after a "
           "warm-up. Same answers: the share of texts whose top label (classify) or entities (group, word, "
           f"start, end) are the same on both sides (ftengine found {entities:,} entities). Versions: "
           + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".", "",
           "| task | ftengine texts/s | HF texts/s (best batch) | speed-up | same answers |",
           "|---|---|---|---|---|"]
    for c in r["cases"]:
        out.append(f"| {c['task']} | {c['ftengine_texts_per_s']:,} | {c['hf_texts_per_s']:,} ({c['hf_batch']}) | "
                   f"{c['speedup']}x | {c['same_answers']:.1%} |")
    return "\n".join(out + [""])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-src", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--hf-batches", type=lambda v: [int(x) for x in v.split(",")], default=[32, 128])
    parser.add_argument("--name", default="heads")
    args = parser.parse_args()
    import torch
    import transformers
    tmp = Path(tempfile.mkdtemp(prefix="ftengine-heads-"))
    folders = checkpoints(args.model_src, tmp)
    texts = sentences(folders["classify"] / "vocab.txt", args.texts)
    cases = []
    for task, folder in folders.items():
        ms, got = ours(task, folder, texts, args.device)
        hf_runs = {batch: hf(task, folder, texts, args.device, batch) for batch in args.hf_batches}
        best = min(hf_runs, key=lambda b: hf_runs[b][0])
        hf_ms, expected = hf_runs[best]
        row = {"task": task, "ftengine_ms": round(ms, 1), "ftengine_texts_per_s": round(len(texts) / ms * 1e3),
               "hf_batch": best, "hf_ms": round(hf_ms, 1), "hf_texts_per_s": round(len(texts) / hf_ms * 1e3),
               "hf_ms_by_batch": {b: round(v[0], 1) for b, v in hf_runs.items()},
               "speedup": round(hf_ms / ms, 1), "same_answers": agreement(task, got, expected)}
        if task == "ner":
            row["entities"] = sum(map(len, got))
        print(json.dumps(row), flush=True)
        cases.append(row)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "CPU"
    result = {"device": device, "date": date.today().isoformat(), "texts": len(texts),
              "dtype": "fp16" if args.device == "cuda" else "fp32",
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__}, "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
