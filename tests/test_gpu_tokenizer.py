"""The GPU tokenizer (kernels_cu/wordpiece.cu) and its NumPy twin against HF `tokenizers`: the same ids,
lengths and truncation flags for every text they do not hand to the CPU path, and, with that path,
the same TokenizedTexts as Tokenizer.encode. Tokenizers: the default model's (uncased BERT), a cased
BERT one, a multilingual one (CJK split, accents kept), MPNet's (<s> </s>, <mask> with lstrip) and
one with the remaining BertNormalizer flags off. The kernel is compared with the twin on a GPU."""

import json
import random

import numpy as np
import pytest

from ftengine import Encoder
from ftengine.backends import numpy_ops
from ftengine.encoder import default_model_path
from ftengine.errors import DeviceError, InputError
from ftengine.gpu_tokenizer import AUTO_MIN_TEXTS, GpuTokenizer, choose_tokenizer
from ftengine.tokenizer import Tokenizer
from ftengine.wordpiece import ON_CPU, TRUNCATED, _trie, build_tables, trie, unicode_tables, unsupported
from tests.tolerances import BATCHING_INVARIANCE_FP32

MAX_LENGTH = 24
SCALARS = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
# every White_Space character, the line and paragraph separators among them
SPACES = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
          0x205F, 0x3000]
# each a list of code points a random string draws from
POOLS = {
    "ascii": list(range(0x20, 0x7F)),
    "controls": [*range(0x00, 0x20), *range(0x7F, 0xA0), 0x200B, 0x200E, 0x200F, 0xFEFF, 0xFFFD],
    "combining": [*range(0x300, 0x370), *range(0x1AB0, 0x1AC0), *range(0x20D0, 0x20F0), 0x1D165, 0x1D16D, 0x8D4],
    "latin": list(range(0xC0, 0x250)),
    "private": [*range(0xE000, 0xE010), 0xF8FF, 0xF0000, 0x10FFFD],
    "emoji": [0x1F600, 0x1F468, 0x1F469, 0x1F467, 0x200D, 0xFE0F, 0x1F3FD, 0x2764, 0x1F1FA, 0x1F1F8],
    "rtl": [*range(0x5D0, 0x5EB), *range(0x620, 0x64B), 0x200F, 0x61C],
    "cjk": [*range(0x4E00, 0x4E40), *range(0x3040, 0x3060), *range(0xAC00, 0xAC10), 0x20000, 0xF900, 0x2F800],
    "spaces": SPACES,
    "any": SCALARS,
}


def _base():
    return json.loads((default_model_path() / "tokenizer.json").read_text(encoding="utf-8"))


def _with(data, **changes):
    out = json.loads(json.dumps(data))
    for path, value in changes.items():
        part, key = path.split("__")
        out[part][key] = value
    return out


def _mpnet(data):
    """MPNet's tokenizer.json: RobertaProcessing with <s> </s>, <mask> stripping the space before it."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for token in data["model"]["vocab"]:
        if not token.startswith("[") and token not in vocab:
            vocab[token] = len(vocab)
    vocab["<mask>"] = len(vocab)
    out = json.loads(json.dumps(data))
    out["model"].update(vocab=vocab, unk_token="<unk>")
    out["post_processor"] = {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0], "trim_offsets": True,
                             "add_prefix_space": False}
    out["added_tokens"] = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": t == "<mask>",
                            "rstrip": False, "normalized": False, "special": True}
                           for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")]
    return out


def _cased(data):
    out = _with(data, normalizer__lowercase=False)
    vocab = out["model"]["vocab"]
    for token in list(vocab)[1000:4000]:
        if token.isalpha() and token.capitalize() not in vocab:
            vocab[token.capitalize()] = len(vocab)
    return out


def _multilingual(data):
    """Lowercased, accents kept (strip_accents false), with accented words and CJK characters."""
    out = _with(data, normalizer__strip_accents=False)
    vocab = out["model"]["vocab"]
    for token in ["café", "naïve", "größe", "über", "élan", "##é", "##ü", "ñ", *map(chr, range(0x4E00, 0x5000))]:
        vocab.setdefault(token, len(vocab))
    return out


TOKENIZERS = {
    "uncased": _base,
    "cased": lambda: _cased(_base()),
    "multilingual": lambda: _multilingual(_base()),
    "mpnet": lambda: _mpnet(_base()),
    "flags_off": lambda: _with(_base(), normalizer__clean_text=False, normalizer__handle_chinese_chars=False,
                               normalizer__strip_accents=False),
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def case(request):
    from tokenizers import Tokenizer as HFTokenizer
    data = TOKENIZERS[request.param]()
    hf = HFTokenizer.from_str(json.dumps(data))
    hf.no_padding()
    hf.enable_truncation(max_length=MAX_LENGTH)
    return data, build_tables(data, max_length=MAX_LENGTH), hf


def _inputs(texts, *, cut=None):
    parts = [t if isinstance(t, bytes) else t.encode("utf-8") for t in texts]
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    stops = np.cumsum(sizes)
    cut = np.zeros(len(texts), np.uint8) if cut is None else np.asarray(cut, np.uint8)
    return np.frombuffer(b"".join(parts) or b"\0", np.uint8), stops - sizes, stops, cut


def _run(ops, tables, texts, *, cut=None):
    """(ids rows, lengths, flags) of `texts` (str or UTF-8 bytes) on `ops`, as host arrays."""
    text, starts, stops, cut = _inputs(texts, cut=cut)
    n = len(texts)
    ids = ops.empty((n, tables.max_length), np.int32)
    lengths = ops.empty((n,), np.int32)
    flags = ops.empty((n,), np.uint8)
    ops.wordpiece_tokenize(tables, ops.to_device(text), ops.to_device(starts), ops.to_device(stops),
                           ops.to_device(cut), ids, lengths, flags)
    return (np.array(ops.to_host(ids)), np.array(ops.to_host(lengths)), np.array(ops.to_host(flags)))


def _assert_hf(hf, texts, result, *, most_on_cpu: float):
    """Each text the tokenizer kept has HF's ids and truncation flag; at most `most_on_cpu` of them
    went to the CPU path."""
    ids, lengths, flags = result
    encodings = hf.encode_batch(texts)
    wrong = [i for i, e in enumerate(encodings) if not flags[i] & ON_CPU and
             (ids[i, :lengths[i]].tolist() != e.ids or bool(flags[i] & TRUNCATED) != bool(e.overflowing))]
    assert not wrong, [(texts[i][:40], ids[wrong[0], :lengths[wrong[0]]].tolist(), encodings[i].ids)
                       for i in wrong[:3]]
    assert np.count_nonzero(flags & ON_CPU) <= most_on_cpu * len(texts)


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    pools = list(POOLS.values())
    texts = []
    for _ in range(n):
        mixed = [rng.choice(pools) for _ in range(rng.randrange(1, 4))] + [POOLS["ascii"]]
        texts.append("".join(chr(rng.choice(rng.choice(mixed))) for _ in range(rng.randrange(0, 60))))
    return texts


def _realistic_lines(data, seed: int, n: int) -> list[str]:
    """Sentences of vocabulary words, capitalised, accented, with numbers and punctuation."""
    rng = random.Random(seed)
    words = [w for w in data["model"]["vocab"] if w.isalpha()]
    accents = str.maketrans("aeiounc", "áèîöüñç")
    lines = []
    for _ in range(n):
        out = []
        for _ in range(rng.randrange(1, 40)):
            w = rng.choice(words)
            w = w.capitalize() if rng.random() < 0.2 else w.upper() if rng.random() < 0.02 else w
            w = w.translate(accents) if rng.random() < 0.05 else w
            out.append(w + rng.choice(["", "", "", ",", ".", "!", "?", ";", "'s", ")", f" {rng.randrange(10 ** 4)}"]))
        lines.append(" ".join(out))
    return lines


# ------------------------------------------------------------ the twin against HF (CPU, CI)

def test_every_scalar_value_alone_and_in_a_word(case):
    data, tables, hf = case
    for texts in ([chr(c) for c in SCALARS], ["ab" + chr(c) + "cd" for c in SCALARS]):
        _assert_hf(hf, texts, _run(numpy_ops, tables, texts), most_on_cpu=1e-4)


def test_random_strings_over_all_planes(case):
    data, tables, hf = case
    texts = _random_texts(0, 20_000)
    _assert_hf(hf, texts, _run(numpy_ops, tables, texts), most_on_cpu=0.05)  # the marks NFD reorders


def test_word_lengths_empty_and_white_space_texts(case):
    data, tables, hf = case
    texts = ["", " ", "\t\n", "\u3000\u2028 ", "\x00\x01"]
    for n in (98, 99, 100, 101, 102):
        texts += ["a" * n, "Ab" * (n // 2) + "c" * (n % 2), "é" * n, "x " + "q" * n + " y", "中" * n]
    _assert_hf(hf, texts, _run(numpy_ops, tables, texts), most_on_cpu=0)


def test_realistic_lines(case):
    data, tables, hf = case
    texts = _realistic_lines(data, 1, 20_000)
    _assert_hf(hf, texts, _run(numpy_ops, tables, texts), most_on_cpu=0)


def test_added_tokens_in_text_go_to_the_cpu(case):
    data, tables, hf = case
    specials = [t["content"] for t in data["added_tokens"]]
    texts = [f"a {s} b" for s in specials] + [f"x{s.lower()}y" for s in specials]
    ids, lengths, flags = _run(numpy_ops, tables, texts)
    assert (flags[:len(specials)] == ON_CPU).all()


def _around_the_cut(data) -> list[bytes]:
    """Texts cut to max_length near an added token, a mark NFD reorders or a byte that is not UTF-8:
    before, at and after the point where the text is truncated (the checks stop a little after it)."""
    specials = [t["content"].encode() for t in data["added_tokens"]]
    inserts = [*specials, *(s.lower() for s in specials), *(s[:3] for s in specials),
               "\U0001D165".encode(), "x\u0301".encode(), b"\xff", b"\xe2\x82"]
    return [b"w " * k + glue + insert + b" tail" for k in range(MAX_LENGTH - 8, MAX_LENGTH + 4)
            for insert in inserts for glue in (b"", b"ab", b"'")]


def test_checks_near_the_truncation_point(case):
    data, tables, hf = case
    texts = [t.decode() for t in _around_the_cut(data) if b"\xff" not in t and b"\xe2\x82" not in t]
    _assert_hf(hf, texts, _run(numpy_ops, tables, texts), most_on_cpu=1)


@pytest.mark.parametrize("over", [1, 2, 3, 10, 100, 1000, 10_000])
def test_texts_longer_than_the_maximum(over):
    """Texts max_length + `over` tokens long, in words, in one long word, and in multi-byte
    characters, through the whole GPU tokenizer (twin ops): Tokenizer.encode's result."""
    cpu = Tokenizer(default_model_path(), max_length=MAX_LENGTH)
    gpu = GpuTokenizer(cpu, ops=numpy_ops)
    gpu.tables  # noqa: B018 - waits for them: calls before go to the CPU tokenizer
    n = MAX_LENGTH + over
    texts = ["word " * n, "the" + "##" * n, "日本 " * n, "naïve, " * n, "a" * (101 * n), " " * (1000 * n) + "x"]
    _assert_same(gpu.encode(texts), cpu.encode(texts))


def _assert_same(got, want):
    for field in ("ids", "type_ids", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_the_gpu_tokenizer_gives_tokenizer_encode(tmp_path):
    """Kept texts, texts handed to the CPU (added tokens, a mark NFD reorders, a lone surrogate in the
    batch) and the folder's do_lower_case, spliced in order: Tokenizer.encode's TokenizedTexts."""
    texts = _random_texts(2, 2000) + ["hello [MASK] there", "x\U0001D16D\U0001D165", "", "Ünïcödé ΣΑΣ"]
    for lowercase in (False, True):
        cpu = Tokenizer(default_model_path(), max_length=MAX_LENGTH, lowercase_text=lowercase)
        gpu = GpuTokenizer(cpu, ops=numpy_ops)
        gpu.tables  # noqa: B018 - waits for them: calls before go to the CPU tokenizer
        _assert_same(gpu.encode(texts), cpu.encode(texts))
        pairs = list(zip(texts, reversed(texts)))
        _assert_same(gpu.encode_pairs(pairs), cpu.encode_pairs(pairs))
    with pytest.raises(InputError, match="text 3"):
        gpu.encode(["a", "b", "bad \ud800"])
    with pytest.raises(InputError, match="pair 2"):
        gpu.encode_pairs([("a", "b"), ("c", "bad \ud800")])
    with pytest.raises(InputError, match="pair 1 must be two strings"):
        gpu.encode_pairs([("a",)])


def test_only_the_texts_it_hands_back_go_to_the_cpu_tokenizer():
    cpu = Tokenizer(default_model_path(), max_length=MAX_LENGTH)
    calls, encode = [], cpu.encode
    cpu.encode = lambda texts, first=1: calls.append(list(texts)) or encode(texts, first=first)
    gpu = GpuTokenizer(cpu, ops=numpy_ops)
    gpu.tables  # noqa: B018
    gpu.encode(["plain text", "more of it, with punctuation!"])
    gpu.encode(["a [MASK] b", "plain"])
    assert calls == [["a [MASK] b"]]


def test_auto_tokenises_small_calls_on_the_cpu():
    """tokenizer="auto" hands a call of fewer than AUTO_MIN_TEXTS texts or pairs to the CPU tokenizer
    (faster there) and a larger one to the device; "gpu" puts every call on the device. (Lines the
    kernel takes whole: none is handed back.)"""
    cpu = Tokenizer(default_model_path(), max_length=256)
    calls = []
    for method in ("encode", "encode_pairs"):
        original = getattr(cpu, method)
        setattr(cpu, method, lambda inputs, first=1, _f=original, _m=method: calls.append((_m, len(inputs)))
                or _f(inputs, first=first))
    auto = choose_tokenizer(cpu, "auto", ops=numpy_ops, device="cuda")
    gpu = choose_tokenizer(cpu, "gpu", ops=numpy_ops, device="cuda")
    auto.tables, gpu.tables  # noqa: B018
    texts = _realistic_lines(_base(), 40, AUTO_MIN_TEXTS)
    pairs = list(zip(texts, reversed(texts)))
    for tokenizer in (auto, gpu):
        _assert_same(tokenizer.encode(texts[:-1]), Tokenizer.encode(cpu, texts[:-1]))
        _assert_same(tokenizer.encode_pairs(pairs[:-1]), Tokenizer.encode_pairs(cpu, pairs[:-1]))
        _assert_same(tokenizer.encode(texts), Tokenizer.encode(cpu, texts))
        _assert_same(tokenizer.encode_pairs(pairs), Tokenizer.encode_pairs(cpu, pairs))
    assert calls == [("encode", AUTO_MIN_TEXTS - 1), ("encode_pairs", AUTO_MIN_TEXTS - 1)]


def _pairs(data, seed: int, n: int) -> list:
    """Pairs of random strings, realistic lines, empty texts and long ones (one text of a pair or
    both over the room the special tokens leave, and ties), so that every case of the longest-first
    cut occurs."""
    rng = random.Random(seed)
    texts = _random_texts(seed, n) + _realistic_lines(data, seed + 1, n)
    texts += ["", " ", "[MASK]", *("word " * k for k in (9, 10, 11, 20, 21, 22, 40)), "日本 " * 30]
    return [(rng.choice(texts), rng.choice(texts)) for _ in range(n)]


@pytest.mark.parametrize("max_length", [MAX_LENGTH, MAX_LENGTH + 1])
def test_pairs_match_hf(case, max_length, tmp_path):
    """encode_pairs: HF's ids, type ids and truncation for pairs joined by the post-processor and cut
    longest-first, at an odd and an even room for the texts (both texts over an odd one go to the CPU)."""
    data, _, _ = case
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    cpu = Tokenizer(tmp_path, max_length=max_length)
    gpu = GpuTokenizer(cpu, ops=numpy_ops)
    gpu.tables  # noqa: B018 - waits for them: calls before go to the CPU tokenizer
    pairs = _pairs(data, max_length, 3000)
    got = gpu.encode_pairs(pairs)
    _assert_same(got, cpu.encode_pairs(pairs))
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer.from_str(json.dumps(data))
    hf.no_padding()
    hf.enable_truncation(max_length=max_length)
    encodings = hf.encode_batch(pairs)
    assert got.ids.tolist() == [i for e in encodings for i in e.ids]
    assert got.type_ids.tolist() == [t for e in encodings for t in e.type_ids]
    assert got.truncated.tolist() == [bool(e.overflowing) for e in encodings]


def _file_lines(data) -> bytes:
    lines = _random_texts(30, 400) + _realistic_lines(data, 31, 400)
    raw = [t.encode("utf-8", "surrogatepass") for t in lines if "\n" not in t and "\r" not in t]
    raw += [b"crlf line\r", b"w " * 5000, "日本 ".encode() * 3000 + b"\xff", b"bad \xc3( byte", b"[MASK] here", b""]
    return "\ufeffthe first line has a BOM\n".encode() + b"\n".join(raw) + b"\n"


def test_undecoded_lines_give_the_decoded_lines_tokens(tmp_path):
    """A text file's lines, undecoded (RawLines windows, as `encode` reads a file for the GPU
    tokenizer): the tokens of its lines decoded (--errors replace), BOM, invalid bytes (also past
    the cut of a long line), carriage returns and all; with --errors strict, the first invalid line
    is named."""
    from ftengine.textio import RawLines
    path = tmp_path / "in.txt"
    path.write_bytes(_file_lines(_base()))
    cpu = Tokenizer(default_model_path(), max_length=MAX_LENGTH)
    gpu = GpuTokenizer(cpu, ops=numpy_ops)
    gpu.tables  # noqa: B018
    for window in RawLines(str(path), errors="replace").windows(256):
        _assert_same(gpu.encode(window, first=window.first), cpu.encode(window.decoded(), first=window.first))
    with pytest.raises(InputError, match=r"in.txt, line \d+: invalid UTF-8"):
        for window in RawLines(str(path)).windows(256):
            gpu.encode(window, first=window.first)


def test_the_encoder_takes_a_files_lines_undecoded(tmp_path):
    """encode_stream of a text file (RawLines) with a GPU tokenizer (here on the twin ops): the
    windows go to the engine undecoded, and give the embeddings of the same lines decoded."""
    from ftengine.textio import RawLines
    path = tmp_path / "in.txt"
    path.write_bytes(_file_lines(_base()).replace(b"\xff", b"").replace(b"\xc3(", b"("))
    with Encoder.from_pretrained(None, device="cpu", max_length=MAX_LENGTH) as encoder:
        gpu = GpuTokenizer(encoder.tokenizer, ops=numpy_ops)
        gpu.tables  # noqa: B018
        encoder.tokenizer = encoder._engine.tokenizer = gpu
        seen, encode = [], gpu.encode
        gpu.encode = lambda texts, first=1: seen.append(type(texts).__name__) or encode(texts, first=first)
        got = np.concatenate(list(encoder.encode_stream(RawLines(str(path)), window=300)))
        assert set(seen) == {"RawTexts"}
        want = np.concatenate(list(encoder.encode_stream(list(RawLines(str(path))), window=300)))
    np.testing.assert_array_equal(got, want)


def test_calls_from_several_threads_at_once():
    from concurrent.futures import ThreadPoolExecutor
    cpu = Tokenizer(default_model_path(), max_length=MAX_LENGTH)
    gpu = GpuTokenizer(cpu, ops=numpy_ops)
    gpu.tables  # noqa: B018
    groups = [_random_texts(10 + i, 300) + ["a [MASK] b"] for i in range(8)]
    pairs = [_pairs(_base(), 20 + i, 300) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(gpu.encode, groups))
        pair_results = list(pool.map(gpu.encode_pairs, pairs))
    for texts, got in zip(groups, results):
        _assert_same(got, cpu.encode(texts))
    for group, got in zip(pairs, pair_results):
        _assert_same(got, cpu.encode_pairs(group))


def test_what_the_gpu_tokenizer_covers(tmp_path):
    from weights.fixtures import write_bpe_tokenizer, write_unigram_tokenizer
    assert unsupported(_base()) is None and unsupported(_mpnet(_base())) is None
    for write, reason in ((write_bpe_tokenizer, "not BertNormalizer"), (write_unigram_tokenizer, "not BertNormalizer")):
        folder = tmp_path / write.__name__
        folder.mkdir()
        write(folder)
        assert reason in unsupported(json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")))
    assert "pre-tokenizer" in unsupported(_with(_base(), pre_tokenizer__type="Whitespace"))
    assert "type id" in unsupported(_with(_base(), post_processor__single=[{"Sequence": {"id": "A", "type_id": 1}}]))
    cpu = Tokenizer(default_model_path(), max_length=MAX_LENGTH)
    assert choose_tokenizer(cpu, "auto", ops=numpy_ops, device="cpu") is cpu
    assert choose_tokenizer(cpu, "cpu", ops=numpy_ops, device="cuda") is cpu
    with pytest.raises(DeviceError, match="needs the CUDA backend"):
        choose_tokenizer(cpu, "gpu", ops=numpy_ops, device="cpu")
    with pytest.raises(InputError, match="tokenizer must be one of auto, gpu, cpu"):
        Encoder.from_pretrained(None, device="cpu", tokenizer="fast")
    from click.testing import CliRunner
    from ftengine.cli import main
    (tmp_path / "in.txt").write_text("a line\n")
    result = CliRunner().invoke(main, ["encode", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.npy"),
                                       "--device", "cpu", "--tokenizer", "gpu"])
    assert result.exit_code != 0 and "tokenizer='gpu' needs the CUDA backend" in result.output
    assert not (tmp_path / "out.npy").exists()


def test_unicode_tables_are_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = dict(_base()["normalizer"], lowercase=False)
    first = unicode_tables(cfg)
    assert len(list((tmp_path / "ftengine").glob("wordpiece_*.npz"))) == 1
    second = unicode_tables(cfg)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)



def test_the_vocabulary_trie_is_kept_on_disk_per_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    vocab = json.loads(default_model_path().joinpath("tokenizer.json").read_text())["model"]["vocab"]
    other = {token: i for i, token in enumerate(["[UNK]", "un", "##able", "##s", "a", "##b"])}
    for words in (vocab, other, vocab):  # the third from the file the first wrote
        for got, want in zip(trie(words, "##"), _trie(words, "##")):
            np.testing.assert_array_equal(got, want)
    files = sorted((tmp_path / "ftengine").glob("wordpiece_trie_*.npz"))
    assert len(files) == 2
    for f in files:
        f.write_bytes(b"not an npz")  # a damaged file is built again and replaced
    for got, want in zip(trie(other, "##"), _trie(other, "##")):
        np.testing.assert_array_equal(got, want)
    assert len(trie(vocab, "##")[0]) == len(_trie(vocab, "##")[0])


def test_texts_are_cut_after_spaces_only_where_no_word_or_added_token_spans_one():
    """The kernel walks a text in segments cut after spaces only where that cannot change its pieces:
    in every configuration above, not once an added token's text holds a space."""
    from ftengine.backends.cuda.wordpiece import _splits_at_spaces
    for name, make in TOKENIZERS.items():
        assert _splits_at_spaces(build_tables(make(), max_length=MAX_LENGTH)), name
    data = _base()
    data["added_tokens"].append({"id": 1, "content": "new york", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": True, "special": False})
    assert not _splits_at_spaces(build_tables(data, max_length=MAX_LENGTH))


# ------------------------------------------------------------ the kernel against its twin (GPU)

def _assert_twins(tables, texts, *, cut=None):
    from ftengine.backends.cuda import ops as cuda_ops
    want = _run(numpy_ops, tables, texts, cut=cut)
    got = _run(cuda_ops, tables, texts, cut=cut)
    np.testing.assert_array_equal(got[1], want[1], err_msg="lengths")
    np.testing.assert_array_equal(got[2], want[2], err_msg="flags")
    rows = np.arange(tables.max_length)[None, :] < want[1][:, None]
    np.testing.assert_array_equal(got[0][rows], want[0][rows], err_msg="ids")


@pytest.mark.gpu
def test_kernel_matches_its_twin(case):
    data, tables, hf = case
    _assert_twins(tables, [chr(c) for c in SCALARS])
    _assert_twins(tables, ["ab" + chr(c) + "cd" for c in SCALARS])
    texts = _random_texts(3, 50_000) + _realistic_lines(data, 4, 50_000)
    _assert_twins(tables, texts)
    _assert_twins(tables, texts, cut=np.arange(len(texts)) % 3 == 0)
    rng = np.random.default_rng(5)
    garbage = [rng.integers(0, 256, rng.integers(0, 40), dtype=np.uint8).tobytes() for _ in range(20_000)]
    _assert_twins(tables, garbage + [b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"ab\xe2\x82"])
    near = _around_the_cut(data)
    _assert_twins(tables, near)
    _assert_twins(tables, near, cut=np.ones(len(near), bool))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [(1, 1), (3, 1), (32, 1), (1, 32), (2, 16), (4, 8), (3, 2)])
def test_any_warp_layout_gives_the_same_results(case, layout, monkeypatch):
    """A warp takes 1-32 texts, each cut after spaces into segments of a lane each (1-32) where the
    texts are few, by the call's size; here each layout on the texts of every check above, in calls
    whose texts do not fill their last block."""
    from ftengine.backends.cuda import wordpiece as cuda_wordpiece
    data, tables, hf = case
    monkeypatch.setattr(cuda_wordpiece, "warp_layout", lambda n, splits: layout if splits else (layout[0], 1))
    texts = _random_texts(7, 1_001) + _realistic_lines(data, 8, 1_000)
    _assert_twins(tables, texts)
    _assert_twins(tables, texts, cut=np.arange(len(texts)) % 3 == 0)
    _assert_twins(tables, ["ab " + chr(c) + " cd" for c in SCALARS[::53]])
    near = _around_the_cut(data)
    _assert_twins(tables, near)
    _assert_twins(tables, near, cut=np.ones(len(near), bool))
    long = [text for n in (*range(MAX_LENGTH - 3, MAX_LENGTH + 3), 100) for text in
            ("word " * n, "日本 " * n, "naïve, " * n, "a" * (101 * n), " " * (40 * n) + "x", "x" + " " * (40 * n))]
    _assert_twins(tables, long)
    _assert_twins(tables, long, cut=np.ones(len(long), bool))


@pytest.mark.gpu
@pytest.mark.parametrize("max_length", [256, 257])
def test_pairs_on_the_gpu(max_length):
    """encode_pairs on the device: Tokenizer.encode_pairs's ids, type ids and flags for realistic
    pairs (a short query and a longer passage, and two long texts), at an odd and an even room."""
    from ftengine.backends.cuda import ops as cuda_ops
    data = _base()
    cpu = Tokenizer(default_model_path(), max_length=max_length)
    gpu = GpuTokenizer(cpu, ops=cuda_ops)
    gpu.tables  # noqa: B018
    queries, passages = _realistic_lines(data, 12, 20_000), _realistic_lines(data, 13, 20_000)
    long = [" ".join(passages[i:i + 12]) for i in range(0, 20_000, 12)]
    for pairs in (list(zip(queries, passages)), list(zip(long, long[1:])), _pairs(data, 14, 20_000)):
        _assert_same(gpu.encode_pairs(pairs), cpu.encode_pairs(pairs))


@pytest.mark.gpu
def test_a_million_lines_on_the_gpu():
    from ftengine.backends.cuda import ops as cuda_ops
    data = _base()
    cpu = Tokenizer(default_model_path(), max_length=256)
    gpu = GpuTokenizer(cpu, ops=cuda_ops)
    gpu.tables  # noqa: B018
    texts = _realistic_lines(data, 6, 1_000_000)
    for at in range(0, len(texts), 100_000):
        _assert_same(gpu.encode(texts[at:at + 100_000]), cpu.encode(texts[at:at + 100_000]))


@pytest.mark.gpu
def test_encoder_calls_from_several_threads_with_the_gpu_tokenizer():
    from concurrent.futures import ThreadPoolExecutor
    groups = [_realistic_lines(_base(), 20 + i, 500) + ["hello [MASK]"] for i in range(8)]
    with Encoder.from_pretrained(None, device="cuda", dtype="fp32", tokenizer="cpu") as cpu, \
            Encoder.from_pretrained(None, device="cuda", dtype="fp32", tokenizer="gpu") as gpu:
        gpu.tokenizer.tables  # noqa: B018
        want = [cpu.encode(texts) for texts in groups]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(gpu.encode, groups))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=BATCHING_INVARIANCE_FP32)  # other batches, same ids


@pytest.mark.gpu
def test_encode_cli_reads_a_file_undecoded_for_the_gpu_tokenizer(tmp_path, monkeypatch):
    """`ftengine encode FILE` with the GPU tokenizer (the file's lines undecoded to the device)
    and with HF tokenizers: the same embeddings, bit for bit, and the same summary counts."""
    from click.testing import CliRunner
    from ftengine.cli import main
    encode = GpuTokenizer.encode

    def ready_then_encode(self, texts, *, first=1):  # not the CPU tokenizer of a cold start
        self.tables  # noqa: B018
        return encode(self, texts, first=first)
    monkeypatch.setattr(GpuTokenizer, "encode", ready_then_encode)
    path = tmp_path / "in.txt"
    path.write_bytes(_file_lines(_base()).replace(b"\xff", b"").replace(b"\xc3(", b"("))
    out = {}
    for tokenizer in ("cpu", "gpu"):
        result = CliRunner().invoke(main, ["encode", str(path), "-o", str(tmp_path / f"{tokenizer}.npy"), "--dtype",
                                           "fp32", "--tokenizer", tokenizer])
        assert result.exit_code == 0, result.output
        out[tokenizer] = (np.load(tmp_path / f"{tokenizer}.npy"), result.output.split(" tokens, ")[0])
    np.testing.assert_array_equal(out["gpu"][0], out["cpu"][0])
    assert out["gpu"][1] == out["cpu"][1]


@pytest.mark.gpu
def test_encoder_with_the_gpu_tokenizer():
    texts = _realistic_lines(_base(), 7, 3000) + ["", "hello [MASK]", "word " * 400, "東京は日本の首都です。"]
    with Encoder.from_pretrained(None, device="cuda", dtype="fp32", tokenizer="cpu") as cpu, \
            Encoder.from_pretrained(None, device="cuda", dtype="fp32", tokenizer="gpu") as gpu:
        assert isinstance(gpu.tokenizer, GpuTokenizer)
        gpu.tokenizer.tables  # noqa: B018
        want, want_stats = cpu.encode_with_stats(texts)
        got, got_stats = gpu.encode_with_stats(texts)
    np.testing.assert_array_equal(got, want)
    assert (got_stats.tokens, got_stats.truncated) == (want_stats.tokens, want_stats.truncated)
