"""Translation end to end, texts in and texts out: ftengine's Translator against HF (MarianTokenizer,
`generate`, `batch_decode`) in the same run, on the same folder.

The folder is bench_seq2seq.py's Marian-base (opus-mt-en-de's shapes, HF's random initialisation,
fp16) with Marian's tokenizer files: a unigram sentencepiece model of SPM_PIECES pieces trained on
a synthetic corpus, and a vocab.json of the model's 58,101 entries (the pieces, then filler
entries, "<pad>" last, as opus-mt numbers them). Sources of about 32 tokens, 64 new tokens
(min_new_tokens 64 on both sides); greedy at batch 1 and beam 4 at batch 32 (issue 53's
end-to-end target: at least 50,000 generated tokens/s). ftengine runs in a child process that
never imports torch, as a service runs it; both are timed from the texts to the translated texts,
the median of repeats after a warm-up; the share of ftengine's time spent on its tokenizer's two
ends (sources to ids, ids to text) is reported beside.

Usage: python bench/bench_translate.py --out bench/results
       python bench/bench_translate.py --tiny --device cpu --out /tmp/t   (a quick check of the script)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_encoder import median_ms  # noqa: E402
from bench.bench_seq2seq import MARIAN_BASE, NEW, SOURCE  # noqa: E402
from weights.fixtures import marian_pieces, marian_vocab  # noqa: E402

SPM_PIECES = 8000
CASES = [("greedy", 1), ("beam 4", 32)]
TARGETS = {("beam 4", 32): ">= 50,000 tokens/s"}
TINY = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128)


def corpus(rng, lines: int = 20_000) -> list:
    """Sentences of pseudo-words (syllables joined), drawn with a Zipf-like skew, so that a
    sentencepiece model of SPM_PIECES pieces can be trained on them."""
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = ["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(30_000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    return [" ".join(rng.choice(words, rng.integers(6, 20), p=weights)) for _ in range(lines)]


def save_folder(folder: Path, shapes: dict, rng) -> list:
    """The model and its tokenizer files in `folder`; returns the corpus."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(**shapes))
    model.half().save_pretrained(str(folder))
    lines = corpus(rng)
    spm, pieces = marian_pieces(lines, SPM_PIECES)
    (folder / "source.spm").write_bytes(spm)
    (folder / "target.spm").write_bytes(spm)
    vocab = marian_vocab(pieces, [])
    del vocab["<pad>"]  # filler entries up to the model's vocabulary, then "<pad>" last again
    vocab.update({f"\u2581filler{i}": i for i in range(len(vocab), shapes["vocab_size"] - 1)})
    vocab["<pad>"] = len(vocab)
    if len(vocab) != shapes["vocab_size"] or vocab["<pad>"] != shapes["pad_token_id"]:
        raise SystemExit(f"vocab.json has {len(vocab)} entries, the model {shapes['vocab_size']}")
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de",
                                                              "model_max_length": 512, "separate_vocabs": False}))
    return lines


def sources(folder: Path, lines: list, count: int) -> list:
    """`count` texts of about SOURCE tokens (the eos included) under the folder's tokenizer."""
    from ftengine.config import load_seq2seq_config
    from ftengine.seq2seq_text import load_text
    text = load_text(folder, load_seq2seq_config(folder).model_type)
    words = (w for line in lines for w in line.split())
    found = []
    while len(found) < count:
        kept = [next(words)]
        for word in words:
            if len(text.encode(" ".join(kept + [word]))) > SOURCE:
                break
            kept.append(word)
        found.append(" ".join(kept))
    return found


def ours(folder: Path, device: str, repeat: int) -> list:
    """Per case: the whole call's ms and its tokenizer ends' ms, in this process (no torch)."""
    from ftengine import Translator
    cases = json.loads((folder / "cases.json").read_text())
    rows = []
    with_dtype = {"dtype": "fp16"} if device == "cuda" else {}
    translator = Translator.from_pretrained(folder, device=device, **with_dtype)
    for texts, beams in cases:
        options = dict(num_beams=beams, max_new_tokens=NEW, min_new_tokens=NEW)
        outputs = [r.token_ids for r in translator.translate(texts, **options)]
        # results come back on the host: the calls are synchronous
        ms = median_ms(lambda: translator.translate(texts, **options), warmup=1, repeat=repeat, sync=lambda: None)
        ends = median_ms(lambda: (translator.encode_sources(texts), [translator.text.decode(t) for t in outputs]),
                         warmup=1, repeat=repeat, sync=lambda: None)
        rows.append({"ms": ms, "tokenizer_ms": ends, "new_tokens": sum(len(t) for t in outputs)})
    return rows


def theirs(folder: Path, texts: list, beams: int, device: str, repeat: int) -> float:
    import torch
    import transformers
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(folder))
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = transformers.MarianMTModel.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()

    def translate():
        batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=beams, do_sample=False)
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    return median_ms(translate, warmup=1, repeat=repeat,
                     sync=torch.cuda.synchronize if device == "cuda" else lambda: None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a small model of Marian-base's vocabulary: a check of the script")
    p.add_argument("--alone", metavar="FOLDER", help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    repeat = 1 if args.tiny else 5
    if args.alone:
        print(json.dumps(ours(Path(args.alone), args.device, repeat)))
        return
    shapes = {**MARIAN_BASE, **(TINY if args.tiny else {})}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "marian-base"
        lines = save_folder(folder, shapes, rng)
        texts = sources(folder, lines, max(b for _, b in CASES))
        cases = [(texts[:batch], 4 if mode.startswith("beam") else 1) for mode, batch in CASES]
        (folder / "cases.json").write_text(json.dumps(cases))
        child = subprocess.run([sys.executable, __file__, "--alone", str(folder), "--device", args.device]
                               + (["--tiny"] if args.tiny else []), capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"the ftengine child failed: {child.stderr[-2000:]}")
        found = json.loads(child.stdout.splitlines()[-1])
        rows = []
        for (mode, batch), (chunk, beams), row in zip(CASES, cases, found):
            hf_ms = theirs(folder, chunk, beams, args.device, repeat)
            rows.append({"model": "marian-base" + (" (tiny)" if args.tiny else ""), "mode": mode, "batch": batch,
                         "new_tokens": NEW, "ftengine_ms": round(row["ms"], 3),
                         "ftengine_tokens_per_s": round(batch * NEW / row["ms"] * 1e3),
                         "ftengine_tokenizer_ms": round(row["tokenizer_ms"], 3),
                         "hf_ms": round(hf_ms, 3), "hf_tokens_per_s": round(batch * NEW / hf_ms * 1e3),
                         "speedup": round(hf_ms / row["ms"], 1), "target": TARGETS.get((mode, batch), "")})
            print(json.dumps(rows[-1]), flush=True)
    write_results(rows, Path(args.out), args.device)


def write_results(rows: list, out: Path, device: str):
    import torch
    import transformers
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    meta = {"date": date.today().isoformat(), "device": gpu, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
    (out / "translate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# Translation end to end, texts in and out — {gpu}, {meta['date']}", "",
             f"Marian-base (opus-mt-en-de's shapes, HF random initialisation, fp16 on the GPU) with a sentencepiece "
             f"tokenizer of {SPM_PIECES:,} pieces in Marian's format; sources of about {SOURCE} tokens, {NEW} new "
             "tokens (min_new_tokens on both sides). ftengine: Translator.translate in a process without torch; HF: "
             "MarianTokenizer, generate (sdpa) and batch_decode. Each from the texts to the translated texts, the "
             "median of repeats after a warm-up; tokens/s = batch x new tokens / that time; tokenizer ms: ftengine's "
             "sources to ids and ids to texts alone.", "",
             "| model | mode | batch | ftengine ms | tokens/s | of which tokenizer ms | HF ms | HF tokens/s | speed-up "
             "| target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['ftengine_ms']} | "
                     f"{r['ftengine_tokens_per_s']:,} | {r['ftengine_tokenizer_ms']} | {r['hf_ms']} | "
                     f"{r['hf_tokens_per_s']:,} | {r['speedup']}x | {r['target']} |")
    (out / "translate.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
