"""The encode engine: many threads and asyncio tasks on one Encoder, streams, failure isolation,
close(), and the Generator under threads. Every result is checked against the same call made
sequentially (CPU: within BATCHING_INVARIANCE_FP32)."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ftengine import DeviceError, Encoder, Generator, InputError
from ftengine.encoder import EncodeStats
from ftengine.engine import EncodeEngine, EncodeOptions
from ftengine.models.shapes import fit_count, fits
from ftengine.tokenizer import Tokenizer
from tests.tolerances import BATCHING_INVARIANCE_FP32, EMBEDDING_COSINE_LOWP, GPU_FP32_REL
from weights.fixtures import WORDS, write_bert_checkpoint, write_gpt2_checkpoint


def texts_for(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(0, 40)))) for _ in range(n)]


# call i of thread t: its texts and options (sizes 1..60, three pooling/normalize variants)
def call_args(t: int, i: int):
    texts = texts_for(100 * t + i, 1 + (7 * t + 13 * i) % 60)
    options = [{}, {"pooling": "cls,max", "normalize": False}, {"pooling": "mean", "normalize": True}][(t + i) % 3]
    return texts, options


@pytest.fixture(scope="module")
def encoder(st_model):
    with Encoder.from_pretrained(st_model, device="cpu") as enc:
        yield enc


def engine_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ftengine-") and t.is_alive()]


def in_threads(count: int, calls: int, fn) -> dict:
    """fn(t, i) for i in range(calls) in each of `count` threads started together: {(t, i): result}.
    Any exception in a thread fails the test."""
    got, errors = {}, []
    barrier = threading.Barrier(count)

    def worker(t):
        barrier.wait()
        try:
            for i in range(calls):
                got[t, i] = fn(t, i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    return got


def encode_call(encoder):
    return lambda t, i: encoder.encode(call_args(t, i)[0], **call_args(t, i)[1])


def test_eight_threads_twenty_calls_equal_sequential(encoder):
    expected = {(t, i): encode_call(encoder)(t, i) for t in range(8) for i in range(20)}
    got = in_threads(8, 20, encode_call(encoder))
    for key, ref in expected.items():
        assert got[key].shape == ref.shape
        assert np.abs(got[key] - ref).max(initial=0) <= BATCHING_INVARIANCE_FP32, key


def test_asyncio_gather_equals_sequential(encoder):
    calls = [call_args(9, i) for i in range(24)]
    expected = [encoder.encode(texts, **options) for texts, options in calls]

    async def main():
        return await asyncio.gather(*(encoder.encode_async(texts, **options) for texts, options in calls))

    for got, ref in zip(asyncio.run(main()), expected):
        assert np.abs(got - ref).max(initial=0) <= BATCHING_INVARIANCE_FP32


def test_submit_returns_a_future(encoder):
    texts = texts_for(5, 9)
    future = encoder.submit(texts, pooling="max")
    assert np.abs(future.result(timeout=60) - encoder.encode(texts, pooling="max")).max() <= BATCHING_INVARIANCE_FP32


def test_empty_inputs_answer_at_once(encoder):
    assert encoder.submit([]).result(timeout=10).shape == (0, encoder.dim)
    assert asyncio.run(encoder.encode_async([], pooling="cls,max")).shape == (0, 2 * encoder.dim)
    assert encoder.encode([]).shape == (0, encoder.dim)
    assert list(encoder.encode_stream([])) == []


def test_stream_equals_encode_in_input_order(encoder):
    texts = texts_for(11, 1000)
    stats = EncodeStats()
    chunks = list(encoder.encode_stream(iter(texts), window=128, stats=stats))
    assert [len(c) for c in chunks] == [128] * 7 + [104]
    got = np.concatenate(chunks)
    ref = encoder.encode(texts)
    assert np.abs(got - ref).max() <= BATCHING_INVARIANCE_FP32
    assert stats.lines == 1000 and stats.tokens == int(encoder.tokenizer.encode(texts).lengths.sum())


def test_stream_stopped_early_leaves_the_engine_usable(encoder):
    def endless():
        i = 0
        while True:
            i += 1
            yield f"the dog {i}"

    stream = encoder.encode_stream(endless(), window=50)
    first = next(stream)
    stream.close()  # cancels what was read ahead
    assert first.shape == (50, encoder.dim)
    assert encoder.encode(["the dog 1"]).shape == (1, encoder.dim)


def test_bad_request_fails_alone(encoder, st_model):
    good = [texts_for(20 + i, 30) for i in range(4)]
    bad = ["the dog", "a dog " * 40]  # text 2 is over max_length 48
    futures = [encoder.submit(good[0]), encoder.submit(bad, truncate=False), encoder.submit(good[1]),
               encoder.submit(good[2]), encoder.submit(good[3])]
    with pytest.raises(InputError, match="text 2 is longer than max_length 48 tokens"):
        futures[1].result(timeout=60)
    for f, texts in zip(futures[:1] + futures[2:], good):
        assert np.abs(f.result(timeout=60) - encoder.encode(texts)).max() <= BATCHING_INVARIANCE_FP32


def test_errors_name_texts_one_based(encoder):
    with pytest.raises(InputError, match="text 3 is a int, not a str"):
        encoder.encode(["a", "b", 7])
    stream = encoder.encode_stream(["x"] * 5 + [None], window=2)
    with pytest.raises(InputError, match="text 6 is a NoneType, not a str"):
        list(stream)
    with pytest.raises(InputError, match="texts must be a list of strings, not one string"):
        encoder.encode("one string")


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_tokens": 0}, "batch_tokens 0 must be at least max_length 48"),
    ({"batch_tokens": -5}, "batch_tokens -5 must be at least max_length 48"),
    ({"batch_tokens": 12.5}, "batch_tokens must be an integer, found 12.5"),
])
def test_bad_batch_tokens_are_refused(encoder, kwargs, message):
    with pytest.raises(InputError, match=message):
        encoder.encode(["hello"], **kwargs)


@pytest.mark.parametrize("max_length", [0, 1, 65])
def test_bad_max_length_is_refused(st_model, max_length):
    with pytest.raises(InputError, match=f"max_length {max_length} must be within 2..64"):
        Encoder.from_pretrained(st_model, device="cpu", max_length=max_length)


def test_huge_batch_tokens_sizes_buffers_to_the_work(encoder):
    """A budget of a billion tokens must not allocate for a billion tokens: buffers follow the work."""
    texts = texts_for(3, 20)
    got = encoder.encode(texts, batch_tokens=1_000_000_000)
    assert np.abs(got - encoder.encode(texts)).max() <= BATCHING_INVARIANCE_FP32


def taken_while_fits(layout: str, count: int, total: int, longest: int, lengths, limits: dict) -> int:
    """How many of `lengths`, one at a time in order, join a batch of `count` sequences of `total`
    tokens, the longest `longest`, while it `fits`; into an empty batch at least one."""
    taken = 0
    for x in lengths:
        if count and not fits(layout, count + 1, total + x, max(longest, x), **limits):
            break
        taken, count, total, longest = taken + 1, count + 1, total + x, max(longest, x)
    return taken


def greedy_batches(layout: str, lengths: list, limits: dict) -> list:
    """The batches (text count, tokens) of one request as the engine defines them: its texts
    longest first, each batch taking the next while it `fits`."""
    out, rest = [], sorted(lengths, reverse=True)
    while rest:
        k = taken_while_fits(layout, 0, 0, 0, rest, limits)
        out.append((k, sum(rest[:k])))
        rest = rest[k:]
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_fit_count_takes_texts_while_the_batch_fits(layout):
    rng = np.random.default_rng(7)
    for _ in range(2000):
        lengths = np.sort(rng.integers(1, 80, size=int(rng.integers(0, 40))))[::-1]
        count = int(rng.integers(0, 6))
        longest = int(rng.integers(1, 80)) if count else 0
        total = int(rng.integers(count, count * longest + 1)) if count else 0
        limits = dict(max_batch_tokens=int(rng.integers(64, 900)), max_seq_len=int(rng.integers(32, 90)))
        want = taken_while_fits(layout, count, total, longest, lengths.tolist(), limits)
        assert fit_count(layout, count, total, longest, lengths, **limits) == want, (lengths, count, total, longest)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_request_is_cut_into_full_batches_longest_first(tmp_path, layout):
    """Every batch takes the request's next-longest texts while the budget holds (the batches the
    engine observes, against the texts' lengths from the tokenizer)."""
    texts = texts_for(11, 300)
    folder = write_bert_checkpoint(tmp_path / "m", seed=2, hidden=64, heads=2)
    with Encoder.from_pretrained(folder, device="cpu", layout=layout) as enc:
        seen = []
        enc._engine.on_batch = lambda n, requests, tokens: seen.append((n, tokens))
        got = enc.encode(texts, batch_tokens=200)
        lengths = enc.tokenizer.encode(texts).lengths.tolist()
        assert seen == greedy_batches(layout, lengths, dict(max_batch_tokens=200, max_seq_len=enc.max_length))
        assert np.abs(got - enc.encode(texts)).max() <= BATCHING_INVARIANCE_FP32


def test_nan_weight_is_reported_not_returned(tmp_path):
    folder = write_bert_checkpoint(tmp_path / "nan", seed=4)
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(k for k in tensors if "layer.1.output.dense.weight" in k)
    tensors[name][0, 0] = np.nan
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with Encoder.from_pretrained(folder, device="cpu") as enc:
        with pytest.raises(InputError, match=r"the embedding of text 1 is not finite \(NaN or inf\)"):
            enc.encode(["hello world", "the dog"])
        assert not enc._engine.closed  # a model problem, not a broken engine


@pytest.mark.parametrize("batch_tokens", [None, 8])
def test_a_non_finite_embedding_names_its_own_text(tmp_path, batch_tokens):
    """Only texts with the word whose embedding row is NaN fail; the error names the first of
    them, whether the request goes into a batch whole, as it came, or cut up longest first."""
    folder = write_bert_checkpoint(tmp_path / "nan", seed=4)
    texts = ["hello world", "the cat sat", "the dog", "a bird sang today", "dog"]
    with Encoder.from_pretrained(folder, device="cpu") as enc:
        word = int(enc.tokenizer.encode(["dog"]).ids[1])
        tensors = load_file(str(folder / "model.safetensors"))
        name = next(k for k in tensors if "word_embeddings.weight" in k)
        tensors[name][word] = np.nan
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with Encoder.from_pretrained(folder, device="cpu", max_length=8) as enc:
        with pytest.raises(InputError, match=r"the embedding of text 3 is not finite"):
            enc.encode(texts, batch_tokens=batch_tokens)
        assert np.isfinite(enc.encode(texts[:2] + texts[3:4], batch_tokens=batch_tokens)).all()


def test_close_stops_threads_and_refuses_work(st_model):
    before = len(engine_threads())
    enc = Encoder.from_pretrained(st_model, device="cpu")
    enc.encode(["hello"])
    assert len(engine_threads()) == before + 2  # tokenizer + worker
    enc.close()
    enc.close()  # idempotent
    assert len(engine_threads()) == before
    with pytest.raises(InputError, match="this encoder is closed"):
        enc.encode(["hello"])
    with Encoder.from_pretrained(st_model, device="cpu") as enc2:
        enc2.encode(["hello"])
    assert len(engine_threads()) == before


def test_dropped_encoder_stops_its_threads(st_model):
    import gc
    before = len(engine_threads())
    enc = Encoder.from_pretrained(st_model, device="cpu")
    enc.encode(["hello"])
    del enc
    gc.collect()
    deadline = time.monotonic() + 30
    while len(engine_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine_threads()) == before


def test_device_failure_fails_everything_once_and_refuses_more(st_model):
    """A runner that cannot be built (what a lost CUDA context looks like to the engine):
    every waiting request gets one clear DeviceError, new work is refused, nothing hangs."""
    submitted = threading.Event()

    def broken_runner(**_):
        submitted.wait(60)  # fails once every request is queued (else a late submit is refused at once)
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    engine = EncodeEngine(tokenizer=Tokenizer(st_model, max_length=48), make_runner=broken_runner,
                          layout="padded", max_length=48, output_dim=lambda modes: 32 * len(modes), vocab_size=200,
                          type_vocab_size=2)
    options = EncodeOptions(("mean",), True, 4096)
    futures = [engine.submit(texts_for(i, 10), options) for i in range(5)]
    submitted.set()
    for f in futures:
        with pytest.raises(DeviceError, match="the encoder failed and cannot be used any more: "
                                              "RuntimeError: cudaErrorIllegalAddress"):
            f.result(timeout=60)
    with pytest.raises(DeviceError, match="cannot be used any more"):
        engine.submit(["hello"], options)
    engine.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ftengine-") and t.is_alive()
                and t in engine._threads]


def test_vocabulary_mismatch_is_caught_before_any_kernel(tmp_path):
    folder = write_bert_checkpoint(tmp_path / "small_vocab", seed=5, vocab_size=60)
    with Encoder.from_pretrained(folder, device="cpu") as enc:
        ok = enc.submit(["the of and"])   # ids < 60
        with pytest.raises(InputError, match=r"text 2: token id \d+ is outside 0..59 \(the tokenizer and "
                                             r"the model's config.json disagree\)"):
            enc.encode(["the", "zebra"])
        assert ok.result(timeout=60).shape == (1, 32)


# ---------------------------------------------------------------- Generator

@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return Generator.from_pretrained(write_gpt2_checkpoint(tmp_path_factory.mktemp("gpt2eng"), seed=3),
                                     device="cpu")


def gen_args(t: int, i: int):
    prompts = [f"hello {t} {i}", "the quick brown fox", "a third prompt"][: 1 + (t + i) % 3]
    options = [dict(), dict(do_sample=True, seed=t * 10 + i, top_k=20), dict(num_beams=3),
               dict(max_batch=1), dict(num_beams=2, max_batch=2)][(t + i) % 5]  # the last two: one prompt a wave
    return prompts, dict(max_new_tokens=4 + i % 3, **options)


def test_generator_four_threads_equal_sequential(gpt2):
    def run(t, i):
        prompts, options = gen_args(t, i)
        return [json.dumps(r.to_json()) for r in gpt2.generate(prompts, **options)]

    expected = {(t, i): run(t, i) for t in range(4) for i in range(5)}
    assert in_threads(4, 5, run) == expected


def test_generator_stream_holds_other_callers_off(gpt2):
    expected = gpt2.generate(["hello"], max_new_tokens=6)[0].token_ids
    other = {}
    stream = gpt2.stream(["hello"], max_new_tokens=6)
    first = next(stream)
    th = threading.Thread(target=lambda: other.setdefault("r", gpt2.generate(["the dog"], max_new_tokens=3)))
    th.start()
    rest = [token for step in stream for _, token in step]
    th.join(timeout=60)
    assert [first[0][1]] + rest == expected
    assert other["r"][0].token_ids == gpt2.generate(["the dog"], max_new_tokens=3)[0].token_ids


# ---------------------------------------------------------------- the same on the GPU

def _close_enough(got: np.ndarray, ref: np.ndarray, dtype: str) -> bool:
    """Within today's GPU parity tolerances: fp32 max abs, fp16/bf16 pooled cosine (normalised rows)."""
    if dtype == "fp32":
        return np.abs(got - ref).max(initial=0) <= GPU_FP32_REL
    norm = np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1)
    return bool((((got * ref).sum(1) / np.maximum(norm, 1e-30)) >= EMBEDDING_COSINE_LOWP).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_gpu_eight_threads_equal_sequential(st_model, dtype):
    with Encoder.from_pretrained(st_model, device="cuda", dtype=dtype) as enc:
        expected = {(t, i): encode_call(enc)(t, i) for t in range(8) for i in range(20)}
        got = in_threads(8, 20, encode_call(enc))
    for key, ref in expected.items():
        assert _close_enough(got[key], ref, dtype), key


@pytest.mark.gpu
def test_gpu_two_encoders_and_a_generator_at_once(st_model, tmp_path):
    """Each engine and the Generator drive the GPU from their own thread and stream: run together,
    each gives what it gives alone (a graph captured on one stream never swallows another's work)."""
    gpt2_path = write_gpt2_checkpoint(tmp_path / "gpt2", seed=3)
    other = write_bert_checkpoint(tmp_path / "other", seed=9, hidden=64, heads=2, intermediate=96)
    a = Encoder.from_pretrained(st_model, device="cuda", dtype="fp32")
    b = Encoder.from_pretrained(other, device="cuda", dtype="fp32")
    g = Generator.from_pretrained(gpt2_path, device="cuda", dtype="fp32")
    texts = [texts_for(40 + i, 50) for i in range(6)]
    ref_a = [a.encode(t) for t in texts]
    ref_b = [b.encode(t) for t in texts]
    ref_g = [g.generate([f"hello {i}"], max_new_tokens=8)[0].token_ids for i in range(6)]
    got, errors = {}, []

    def run(name, fn):
        try:
            got[name] = [fn(i) for i in range(6)]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=("a", lambda i: a.encode(texts[i]))),
               threading.Thread(target=run, args=("b", lambda i: b.encode(texts[i]))),
               threading.Thread(target=run, args=("g", lambda i: g.generate([f"hello {i}"], max_new_tokens=8)[0]
                                                  .token_ids))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    a.close()
    b.close()
    g.close()
    assert not errors, errors
    assert all(_close_enough(x, y, "fp32") for x, y in zip(got["a"], ref_a))
    assert all(_close_enough(x, y, "fp32") for x, y in zip(got["b"], ref_b))
    assert got["g"] == ref_g


@pytest.mark.gpu
def test_gpu_generator_four_threads_equal_sequential(tmp_path):
    g = Generator.from_pretrained(write_gpt2_checkpoint(tmp_path / "gpt2", seed=3), device="cuda", dtype="fp32")

    def run(t, i):
        prompts, options = gen_args(t, i)
        return [r.token_ids for r in g.generate(prompts, **options)]

    expected = {(t, i): run(t, i) for t in range(4) for i in range(5)}
    assert in_threads(4, 5, run) == expected

