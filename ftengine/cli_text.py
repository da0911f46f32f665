"""The commands that write text: `generate` (GPT-2), `translate` (encoder-decoders) and `classify`
(sequence classification). Parse, call the library, print; cli.py registers them."""

from __future__ import annotations

import json
import sys
import time
from itertools import chain, islice

import click

from .backends import DEVICES
from .cli_support import close_engine, closes_on_failure, exits_when_stopped, fail, rate, text_option
from .encoder import DTYPES, ENCODER_DTYPES
from .errors import FtengineError, InputError, PromptError, TooLongError
from .records import INPUT_FORMATS, input_format, open_records
from .textio import iter_lines, source_name
from .token_classifier import STRATEGIES
from .writers import LineWriter, RecordWriter, check_writable


@click.command()
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
@click.option("--max-batch", type=int, default=None,
              help="Most sequences decoded at once; more prompts run in waves, results in input order. "
                   "Default: what half the free GPU memory holds (64 on the CPU), at most 256.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt, in input order.")
@click.option("--stream", is_flag=True, help="Print the text as it is generated (one prompt only).")
def generate(model_path, prompt, input_path, max_new_tokens, min_new_tokens, do_sample, temperature, top_k,
             top_p, repetition_penalty, seed, eos_token_id, no_repeat_ngram_size, num_beams, length_penalty,
             early_stopping, num_return_sequences, device, dtype, max_batch, as_json, stream):
    """Continue prompts with a GPT-2 model (greedy, sampled, or beam search)."""
    with exits_when_stopped(lead="\n"):  # a streamed text may be mid-line
        _generate(model_path, prompt, input_path, device, dtype, max_batch, as_json, stream,
                  dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=do_sample,
                       temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                       seed=seed, eos_token_id=eos_token_id, no_repeat_ngram_size=no_repeat_ngram_size,
                       num_beams=num_beams, length_penalty=length_penalty, num_return_sequences=num_return_sequences,
                       early_stopping={"true": True, "false": False, "never": "never"}[early_stopping]))


GENERATE_WINDOW = 1024  # prompts read, generated (in waves of --max-batch) and printed at a time


def _generate(model_path, prompt, input_path, device, dtype, max_batch, as_json, stream, options):
    from ftengine import Generator
    from .decoding.generate import check_prompts
    try:
        if (prompt is None) == (input_path is None):
            raise FtengineError("give exactly one of --prompt and --input")
        lines = iter([text_option(prompt, "--prompt", empty=True)] if prompt is not None else iter_lines(input_path))
        prompts = list(islice(lines, 2))  # the first two: whether there is one, and whether there are more
        if stream and (len(prompts) != 1 or as_json):
            raise FtengineError("--stream prints one prompt's text as it comes: give one prompt, without --json")
        if stream and options["num_beams"] > 1:
            raise FtengineError("--stream is for greedy and sampled generation; beam search (--num-beams) returns "
                                "its hypotheses at the end")
        gen = Generator.from_pretrained(model_path, device=device, dtype=dtype)
        params = gen.params(**options)  # every option, and a streamed prompt, checked before anything is printed
        if stream:
            check_prompts(gen.encode_prompts(prompts), params, gen.config.n_positions)
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
        if not prompts:
            raise InputError("no prompts to continue")
        lines, number = chain(prompts, lines), 1
        while window := list(islice(lines, GENERATE_WINDOW)):
            try:
                results = gen.generate(window, max_batch=max_batch, **options)
            except PromptError as e:  # named by its line, not by its place in the window
                raise e if input_path is None else \
                    InputError(f"{source_name(input_path)}, line {number + e.index}: the prompt {e.reason}") from None
            for r in results:
                click.echo(json.dumps(r.to_json(), ensure_ascii=False) if as_json else r.prompt + r.text)
            number += len(window)
    except FtengineError as e:
        fail(str(e))


CLASSIFY_WINDOW = 4096  # records classified at a time: only their labels are kept


def keyed_input_options(command):
    """--input-format, --text-field and --id-field: the records of classify and ner."""
    for option in reversed((
            click.option("--input-format", "input_format_name", type=click.Choice(INPUT_FORMATS), default=None,
                         help="Input format. Default: from the input's file name; text lines on stdin."),
            click.option("--text-field", "--text-column", "text_field", default=None,
                         help="The JSONL field or CSV/TSV/Parquet column holding the text. Default: text."),
            click.option("--id-field", "--id-column", "id_field", default=None,
                         help="A field or column carried to the output as each record's key (default: the line or "
                              "row number)."))):
        command = option(command)
    return command


def open_keyed_records(input_path, input_format_name, text_field, id_field, output, errors):
    """The records of keyed_input_options, the output checked writable first."""
    in_fmt = input_format(input_path, input_format_name)
    if in_fmt == "txt" and (text_field is not None or id_field is not None):
        raise InputError("--text-field and --id-field apply to jsonl, csv, tsv and parquet input; "
                         f"{input_path} is read as text lines (see --input-format)")
    check_writable(output)
    return open_records(input_path, in_fmt, text_field=text_field or "text", id_field=id_field, errors=errors)


@click.command()
@click.argument("input_path", metavar="[INPUT|-]", default="-")
@click.option("-o", "--output", default="-", show_default=True,
              help="Output file: .parquet, or JSON lines (a .jsonl name, or '-' for stdout): a record's key, then "
                   "its label and score (with --top-k > 1 its labels).")
@click.option("--model", "model_path", required=True, help="...ForSequenceClassification folder or Hub id.")
@keyed_input_options
@click.option("--top-k", type=click.IntRange(min=1), default=1, show_default=True,
              help="Labels per record, best first: 1 writes {label, score}, more a list under labels.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(ENCODER_DTYPES), default=None)
@click.option("--max-length", type=click.IntRange(min=2), default=None, help="Longest text in tokens (longer: cut).")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=None)
@click.option("--errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True)
@click.option("--quiet", is_flag=True, help="No progress bar and no summary.")
def classify(input_path, output, model_path, input_format_name, text_field, id_field, top_k, device, dtype, max_length,
             batch_tokens, errors, quiet):
    """Classify each record of INPUT (text lines, or the text field of a JSONL, CSV, TSV or Parquet
    file) with a sequence-classification model, as HF's text-classification pipeline does; one
    JSON line or Parquet row a record, in order, as the work goes."""
    from .classifier import Classifier
    classifier = None
    with closes_on_failure(lambda: close_engine(classifier)):
        records = open_keyed_records(input_path, input_format_name, text_field, id_field, output, errors)
        classifier = Classifier.from_pretrained(model_path, device=device, dtype=dtype, max_length=max_length)
        start, lines = time.perf_counter(), 0
        from tqdm import tqdm
        with tqdm(unit="line", disable=quiet or not sys.stderr.isatty(), file=sys.stderr) as bar, \
                RecordWriter(output, "parquet" if output.lower().endswith(".parquet") else "jsonl") as writer:
            for keys, window in records.windows(CLASSIFY_WINDOW):
                found = classifier.predict(window, top_k=top_k, batch_tokens=batch_tokens)
                writer.write_records([{records.key_name: key, **(f if top_k == 1 else {"labels": f})}
                                      for key, f in zip(keys, found)])
                lines += len(window)
                bar.update(len(window))
        seconds = time.perf_counter() - start
        classifier.close()
    if not quiet:
        click.echo(f"ftengine: {lines} lines, on {classifier.device} ({classifier.dtype}), {seconds:.2f} s, "
                   f"{rate(lines, seconds)} lines/s -> {'stdout' if output == '-' else output}", err=True)


@click.command()
@click.argument("input_path", metavar="[INPUT|-]", default="-")
@click.option("-o", "--output", default="-", show_default=True,
              help="Output file: .parquet, or JSON lines (a .jsonl name, or '-' for stdout): a record's key, then "
                   "its entities.")
@click.option("--model", "model_path", required=True, help="...ForTokenClassification folder or Hub id.")
@keyed_input_options
@click.option("--aggregation-strategy", type=click.Choice(STRATEGIES), default="simple", show_default=True,
              help="As HF's token-classification pipeline: none (every token), simple (adjacent tokens of one "
                   "entity), first / average / max (whole words first).")
@click.option("--stride", type=click.IntRange(min=0), default=None,
              help="Long texts in windows of the model's length overlapping by this many tokens (default: cut).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None)
@click.option("--max-length", type=click.IntRange(min=2), default=None, help="Longest text in tokens (longer: cut).")
@click.option("--errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True)
@click.option("--quiet", is_flag=True, help="No progress bar and no summary.")
def ner(input_path, output, model_path, input_format_name, text_field, id_field, aggregation_strategy, stride, device,
        dtype, max_length, errors, quiet):
    """Find the entities of each record of INPUT (text lines, or the text field of a JSONL, CSV,
    TSV or Parquet file) with a token-classification model, as HF's token-classification
    pipeline does; one JSON line or Parquet row a record ({key, "entities": [...]}), in order."""
    from .token_classifier import TokenClassifier
    model = None
    with closes_on_failure(lambda: model is not None and model.close()):
        records = open_keyed_records(input_path, input_format_name, text_field, id_field, output, errors)
        model = TokenClassifier.from_pretrained(model_path, device=device, dtype=dtype, max_length=max_length)
        model.predict([], aggregation_strategy=aggregation_strategy, stride=stride)  # options checked before reading
        start, lines, found = time.perf_counter(), 0, 0
        from tqdm import tqdm
        with tqdm(unit="line", disable=quiet or not sys.stderr.isatty(), file=sys.stderr) as bar, \
                RecordWriter(output, "parquet" if output.lower().endswith(".parquet") else "jsonl") as writer:
            for keys, window in records.windows(CLASSIFY_WINDOW):
                entities = model.predict(window, aggregation_strategy=aggregation_strategy, stride=stride)
                writer.write_records([{records.key_name: key, "entities": e} for key, e in zip(keys, entities)])
                lines += len(window)
                found += sum(map(len, entities))
                bar.update(len(window))
        seconds = time.perf_counter() - start
        model.close()
    if not quiet:
        click.echo(f"ftengine: {lines} lines, {found} entities, on {model.device} ({model.dtype}), {seconds:.2f} s, "
                   f"{rate(lines, seconds)} lines/s -> {'stdout' if output == '-' else output}", err=True)

TRANSLATE_WINDOW = 512  # sources read, translated (sorted by length into batches) and written at a time


@click.command()
@click.argument("input_path", metavar="[INPUT|-]", default="-")
@click.option("-o", "--output", default="-", show_default=True,
              help="Output file: one translation a line, or with --json (or a .jsonl name) one JSON object a "
                   "source, or a .parquet file of those objects' fields a row; '-' writes to stdout.")
@click.option("--model", "model_path", required=True,
              help="Encoder-decoder checkpoint folder or Hub id (Marian / opus-mt, BART, mBART, M2M100 / NLLB).")
@click.option("--input-format", "input_format_name", type=click.Choice(INPUT_FORMATS), default=None,
              help="Input format. Default: from the input's file name; text lines on stdin.")
@click.option("--text-field", "--text-column", "text_field", default=None,
              help="The JSONL field or CSV/TSV/Parquet column holding the source text. Default: text.")
@click.option("--src-lang", default=None,
              help="The source language of a multilingual model, as its tokenizer spells it (eng_Latn, en_XX).")
@click.option("--tgt-lang", default=None,
              help="The target language: NLLB's fra_Latn, mBART's fr_XX, a multilingual Marian model's >>fra<< as fra.")
@click.option("--num-beams", type=click.IntRange(min=1), default=None, help="Beam search width (default: the model's).")
@click.option("--num-return-sequences", type=click.IntRange(min=1), default=None,
              help="Hypotheses per source in --json candidates (at most --num-beams).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Most tokens generated per source (default: the model's max_length less the start token).")
@click.option("--min-new-tokens", type=click.IntRange(min=0), default=None)
@click.option("--length-penalty", type=float, default=None)
@click.option("--early-stopping", type=click.Choice(["true", "false", "never"]), default=None)
@click.option("--no-repeat-ngram-size", type=click.IntRange(min=0), default=None)
@click.option("--repetition-penalty", type=float, default=None)
@click.option("--do-sample", is_flag=True, default=None, help="Sample instead of greedy decoding or beam search.")
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--seed", type=int, default=None, help="Seed of the counter-based RNG (sampling).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per source (also chosen by a .jsonl output).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None)
@click.option("--max-batch", type=click.IntRange(min=1), default=None,
              help="Most decoder rows (sources x beams) translated at once.")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=None,
              help="Most source tokens x beams translated at once (CTranslate2's batch_type tokens).")
@click.option("--errors", type=click.Choice(["strict", "replace"]), default="strict", show_default=True,
              help="Text that is not valid UTF-8 / Unicode: fail naming the line, or replace with U+FFFD.")
@click.option("--truncate/--no-truncate", default=True, show_default=True,
              help="Cut sources longer than the model takes, or fail naming the source.")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary.")
def translate(input_path, output, model_path, input_format_name, text_field, src_lang, tgt_lang, num_beams,
              num_return_sequences, max_new_tokens, min_new_tokens, length_penalty, early_stopping,
              no_repeat_ngram_size, repetition_penalty, do_sample, top_k, top_p, temperature, seed, as_json, device,
              dtype, max_batch, max_batch_tokens, errors, truncate, quiet):
    """Translate each record of INPUT (text lines, or the text field of a JSONL, CSV, TSV or Parquet
    file) with an encoder-decoder model: one output per record, in order, as the work goes."""
    from .translator import Translator
    options = dict(num_beams=num_beams, num_return_sequences=num_return_sequences, max_new_tokens=max_new_tokens,
                   min_new_tokens=min_new_tokens, length_penalty=length_penalty,
                   no_repeat_ngram_size=no_repeat_ngram_size,
                   repetition_penalty=repetition_penalty, do_sample=do_sample, top_k=top_k, top_p=top_p,
                   temperature=temperature, seed=seed,
                   early_stopping=None if early_stopping is None else
                   {"true": True, "false": False, "never": "never"}[early_stopping])
    translator = None
    with closes_on_failure(lambda: translator is not None and translator.close()):
        in_fmt = input_format(input_path, input_format_name)
        if in_fmt == "txt" and text_field is not None:
            raise InputError(f"--text-field applies to jsonl, csv, tsv and parquet input; {input_path} is read "
                             "as text lines (see --input-format)")
        parquet = output.lower().endswith(".parquet")
        as_json = as_json or parquet or output.lower().endswith(".jsonl")
        check_writable(output)
        records = open_records(input_path, in_fmt, text_field=text_field or "text", errors=errors)
        translator = Translator.from_pretrained(model_path, device=device, dtype=dtype)
        translator.check_languages(src_lang, tgt_lang, ("--src-lang", "--tgt-lang"))
        translator.params(tgt_lang, **options)  # every option checked before the first source is read
        start, lines, tokens = time.perf_counter(), 0, 0
        from tqdm import tqdm
        with tqdm(unit="line", disable=quiet or not sys.stderr.isatty(), file=sys.stderr) as bar, \
                (RecordWriter(output, "parquet") if parquet else LineWriter(output)) as writer:
            for keys, window in records.windows(TRANSLATE_WINDOW):
                try:
                    results = translator.translate(window, src_lang=src_lang, tgt_lang=tgt_lang, max_batch=max_batch,
                                                   max_batch_tokens=max_batch_tokens, truncate=truncate, **options)
                except TooLongError as e:  # named by its record, not by its place in the window
                    raise InputError(f"{source_name(input_path)}, {records.key_name} "
                                     f"{keys[e.index]}: the source has {e.length} tokens, more than the model's "
                                     f"{e.max_length} (drop --no-truncate to cut it)") from None
                rows = [{records.key_name: key, **r.to_json()} for key, r in zip(keys, results)] if as_json else None
                if parquet:
                    writer.write_records(rows)
                else:
                    writer.write_lines([json.dumps(row, ensure_ascii=False) for row in rows] if as_json
                                       else [r.text.replace("\n", " ") for r in results])
                lines += len(window)
                tokens += sum(len(c.token_ids) for r in results for c in r.candidates[:1])
                bar.update(len(window))
        seconds = time.perf_counter() - start
        translator.close()
    if not quiet:
        click.echo(f"ftengine: {lines} lines, {tokens} tokens generated, on {translator.device} ({translator.dtype}), "
                   f"{seconds:.2f} s, {rate(lines, seconds)} lines/s, {rate(tokens, seconds)} tokens/s "
                   f"-> {'stdout' if output == '-' else output}", err=True)
