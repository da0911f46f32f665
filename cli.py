"""The `ftengine` command line: parse, call the library, print. No model logic here."""

from __future__ import annotations

import json
import sys

import click

from ftengine import Encoder, FtengineError
from ftengine.backends import DEVICES
from ftengine.encoder import DTYPES
from ftengine.textio import FORMATS, check_writable, output_format, read_lines, write_embeddings


def _fail(message: str):
    click.echo(f"ftengine: error: {message}", err=True)
    sys.exit(1)


@click.group()
@click.version_option(package_name="ftengine")
def main():
    """ftengine: transformer inference on raw CUDA kernels (NumPy reference on the CPU)."""


@main.command()
@click.argument("input_path", metavar="[INPUT|-]", default="-")
@click.option("-o", "--output", default="-", show_default=True,
              help="Output file (.npy or .jsonl); '-' writes JSONL to stdout.")
@click.option("--model", "model_path", default=None,
              help="Model folder (HF/sentence-transformers). Default: the installed all-MiniLM-L6-v2.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Compute precision. Default: fp16 on the GPU, fp32 on the CPU.")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=None,
              help="Token budget per batch: real tokens (packed layout) or batch size x longest "
                   "(padded). Default: 16384 on the GPU, 4096 on the CPU.")
@click.option("--max-length", type=click.IntRange(min=2), default=None,
              help="Longest tokenised text; longer texts are truncated. Default: the model folder's.")
@click.option("--pooling", default=None,
              help="cls, mean, max, mean_sqrt_len, lasttoken, or several joined by commas. Default: the model folder's.")
@click.option("--normalize/--no-normalize", default=None,
              help="L2-normalise embeddings. Default: the model folder's (Normalize module).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format. Default: from the output's file name; JSONL on stdout.")
@click.option("--errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True,
              help="Invalid UTF-8: fail naming the line, or replace with U+FFFD.")
@click.option("--truncate/--no-truncate", default=True, show_default=True,
              help="Truncate over-long lines (counted in the summary) or fail naming the line.")
@click.option("--layout", type=click.Choice(["auto", "packed", "padded"]), default="auto", show_default=True,
              help="packed: padding-free with fused attention; padded: batched-GEMM attention. "
                   "auto: packed when the model's head size is 32, 64 or 128.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="Replay each batch shape as a captured CUDA graph (off: direct launches, for debugging).")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary.")
def encode(input_path, output, model_path, device, dtype, batch_tokens, max_length, pooling,
           normalize, fmt, errors, truncate, layout, cuda_graphs, quiet):
    """Embed each line of INPUT (a UTF-8 text file, or '-' for stdin): one row per line, in order."""
    try:
        fmt = output_format(output, fmt)
        check_writable(output)
        lines = read_lines(input_path, errors=errors)
        encoder = Encoder.from_pretrained(model_path, device=device, dtype=dtype, max_length=max_length,
                                          cuda_graphs=cuda_graphs, layout=layout)
        show_bar = not quiet and sys.stderr.isatty()
        from tqdm import tqdm
        with tqdm(total=len(lines), unit="line", disable=not show_bar, file=sys.stderr) as bar:
            embeddings, stats = encoder.encode_with_stats(
                lines, batch_tokens=batch_tokens, pooling=pooling, normalize=normalize,
                truncate=truncate, progress=bar.update)
        write_embeddings(output, fmt, embeddings)
    except FtengineError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        click.echo("ftengine: interrupted", err=True)
        sys.exit(130)
    if not quiet:
        rate = stats.lines / stats.seconds if stats.seconds > 0 else 0.0
        click.echo(
            f"ftengine: {stats.lines} lines, {stats.tokens} tokens, {stats.truncated} truncated, "
            f"{embeddings.shape[1]}-dim on {encoder.device} ({encoder.dtype}), "
            f"{stats.seconds:.2f} s, {rate:.0f} lines/s -> {'stdout' if output == '-' else output}",
            err=True,
        )


@main.command()
@click.option("--model", "model_path", required=True, help="GPT-2 checkpoint folder (config.json, *.safetensors, tokenizer.json).")
@click.option("--prompt", default=None, help="One prompt.")
@click.option("--input", "input_path", default=None, help="A UTF-8 file with one prompt per line ('-' for stdin).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--min-new-tokens", type=int, default=0, show_default=True)
@click.option("--do-sample", is_flag=True, help="Sample (temperature, top-k, top-p) instead of greedy decoding.")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: off; above the vocabulary: every token.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed of the counter-based RNG: the same seed gives the same tokens.")
@click.option("--eos-token-id", type=int, default=None, help="Token that ends a sequence (default: the model's).")
@click.option("--no-repeat-ngram-size", type=int, default=0, show_default=True, help="Ban repeating n-grams (0: off).")
@click.option("--num-beams", type=int, default=1, show_default=True, help="Beam search with this many beams (1: off).")
@click.option("--length-penalty", type=float, default=1.0, show_default=True,
              help="Beam score = sum of log-probs / length ** length_penalty.")
@click.option("--early-stopping", type=click.Choice(["true", "false", "never"]), default="false", show_default=True,
              help="Beam search stopping rule, as HF generate.")
@click.option("--num-return-sequences", type=int, default=1, show_default=True,
              help="Hypotheses per prompt in --json candidates (at most --num-beams).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt, in input order.")
@click.option("--stream", is_flag=True, help="Print the text as it is generated (one prompt only).")
def generate(model_path, prompt, input_path, max_new_tokens, min_new_tokens, do_sample, temperature, top_k,
             top_p, repetition_penalty, seed, eos_token_id, no_repeat_ngram_size, num_beams, length_penalty,
             early_stopping, num_return_sequences, device, dtype, as_json, stream):
    """Continue prompts with a GPT-2 model (greedy, sampled, or beam search)."""
    from ftengine import Generator
    options = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=do_sample,
                   temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                   seed=seed, eos_token_id=eos_token_id, no_repeat_ngram_size=no_repeat_ngram_size)
    if num_beams > 1 or num_return_sequences > 1:
        options.update(num_beams=num_beams, length_penalty=length_penalty, num_return_sequences=num_return_sequences,
                       early_stopping={"true": True, "false": False, "never": "never"}[early_stopping])
    try:
        if (prompt is None) == (input_path is None):
            raise FtengineError("give exactly one of --prompt and --input")
        prompts = [prompt] if prompt is not None else read_lines(input_path)
        if stream and (len(prompts) != 1 or as_json):
            raise FtengineError("--stream prints one prompt's text as it comes: give one prompt, without --json")
        gen = Generator.from_pretrained(model_path, device=device, dtype=dtype)
        if stream:
            ids, shown = [], ""
            click.echo(prompts[0], nl=False)
            for step in gen.stream(prompts, **options):
                ids += [token for _, token in step]
                text = gen.decode(ids)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    click.echo(text[len(shown):], nl=False)
                    shown = text
            click.echo(gen.decode(ids)[len(shown):])
            return
        results = gen.generate(prompts, **options)
    except FtengineError as e:
        _fail(str(e))
    for r in results:
        click.echo(json.dumps(r.to_json(), ensure_ascii=False) if as_json else r.prompt + r.text)


if __name__ == "__main__":
    main()
