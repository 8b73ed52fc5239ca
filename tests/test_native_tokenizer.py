"""The native runtime's tokenizer (runtime/src/tokenizer.c, through its public C API) against
HF tokenizers: same ids on ~1 MB of mixed text and on random text, same chat encoding, a
streaming UTF-8 decoder that loses nothing, a reader that refuses every damaged file with a
message, and an exporter that refuses what the runtime cannot reproduce.

Two tokenizers: a small byte-level BPE trained here ("toy": no download, with the odd cases of
SmolLM2 — bytes without a token, overlapping and normalized added tokens) and SmolLM2's own
(marked realmodel: skipped when the model cannot be had)."""

from __future__ import annotations

import os
import random
import struct
import sys
import time
import unicodedata
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekv.compiler.backend.tokenizer_file import (
    UnsupportedTokenizer,
    build_tokenizer_file,
    byte_to_char,
    gpt2_classes,
    pack_sections,
    write_tokenizer_file,
)
from edgekv.corpus import natural_text

EKV_ERR_IO, EKV_ERR_FORMAT, EKV_ERR_INVALID_ARG = 1, 2, 4
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOY_MISSING_BYTES = (0x04, 0x06, 0x1D)  # no token, as in SmolLM2: they become <unk>, fused


# ------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def native_lib():
    from edgekv.runtime.native import NativeRuntimeMissing, load_library

    try:
        return load_library()
    except NativeRuntimeMissing as exc:
        pytest.skip(str(exc))


def _toy_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Sequence([])
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    chars = byte_to_char()
    alphabet = [c for b, c in chars.items() if b not in TOY_MISSING_BYTES]
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False, initial_alphabet=alphabet,
                                  special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    corpus = natural_text()[:60_000] + _unicode_text(random.Random(1), 8_000) + _emoji_text(random.Random(2), 200)
    tk.train_from_iterator(corpus.splitlines(), trainer)
    # overlapping specials ("<|im" inside "<|im_start|>"), a special the model vocabulary lacks,
    # and a normalized non-special one, matched only where no raw one is
    tk.add_tokens([AddedToken("<|im", special=True, normalized=False),
                   AddedToken("\u2581<PRE>", special=True, normalized=False),
                   AddedToken("hello world", special=False, normalized=True),
                   AddedToken("start", special=False, normalized=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", unk_token="<unk>")
    tok.chat_template = CHATML
    assert all(chars[b] not in tk.get_vocab() for b in TOY_MISSING_BYTES)
    return tok


@pytest.fixture(scope="session")
def toy_tok():
    return _toy_tokenizer()


def _smol_tokenizer():
    from rich.console import Console
    from transformers import AutoTokenizer

    from edgekv.models import load_model
    from edgekv.models.errors import ModelError
    from edgekv.models.loader import converted_dir, quiet_transformers
    from edgekv.models.sources import resolve

    quiet_transformers()
    try:
        src = resolve("smollm2-135m", Console(stderr=True))
        folder = converted_dir(src.path)
        if not (folder / "edgekv.json").is_file():
            load_model("smollm2-135m")  # converts the GGUF once
    except ModelError as exc:
        pytest.skip(f"SmolLM2 cannot be had here: {exc}")
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="session")
def smol_tok():
    return _smol_tokenizer()


@pytest.fixture(scope="session")
def tok_files(tmp_path_factory):
    """path of each tokenizer's exported file, written once per session"""
    made: dict[str, Path] = {}

    def get(name: str, tok) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp("ekt") / f"{name}.ekt"
            info = write_tokenizer_file(tok, made[name])
            assert info["size"] == made[name].stat().st_size and info["format_version"] == "1.0"
        return made[name]

    return get


@pytest.fixture(params=["toy", pytest.param("smol", marks=pytest.mark.realmodel)], scope="session")
def pair(request, native_lib, tok_files):
    """(HF tokenizer, NativeTokenizer over its exported file, name)"""
    from edgekv.runtime.native_tokenizer import NativeTokenizer

    hf = request.getfixturevalue("toy_tok" if request.param == "toy" else "smol_tok")
    return hf, NativeTokenizer(tok_files(request.param, hf)), request.param


@pytest.fixture(scope="session")
def toy_file_bytes(toy_tok, tok_files):
    return tok_files("toy", toy_tok).read_bytes()


# ------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------
UNICODE_BLOCKS = [  # (first, last): scripts, marks, digits of other scripts, symbols
    (0x00A0, 0x024F), (0x0300, 0x036F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0530, 0x058F), (0x0590, 0x05FF),
    (0x0600, 0x06FF), (0x0900, 0x097F), (0x0980, 0x09FF), (0x0B80, 0x0BFF), (0x0E00, 0x0E7F), (0x0E80, 0x0EFF),
    (0x0F00, 0x0FFF), (0x10A0, 0x10FF), (0x1100, 0x11FF), (0x1200, 0x137F), (0x13A0, 0x13FF), (0x1780, 0x17FF),
    (0x1800, 0x18AF), (0x1AB0, 0x1AFF), (0x2000, 0x206F), (0x2070, 0x209F), (0x20A0, 0x20CF), (0x2100, 0x214F),
    (0x2150, 0x218F), (0x2190, 0x21FF), (0x2200, 0x22FF), (0x2460, 0x24FF), (0x2500, 0x257F), (0x3000, 0x303F),
    (0x3040, 0x309F), (0x30A0, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFB00, 0xFDFF), (0xFE00, 0xFE0F),
    (0xFF00, 0xFFEF), (0xFFF0, 0xFFFF), (0x10100, 0x1013F), (0x1D400, 0x1D7FF), (0x1F300, 0x1F6FF),
    (0x20000, 0x2A6DF), (0xE0000, 0xE007F), (0xF0000, 0xF00FF), (0x10FFF0, 0x10FFFF),
]
# assigned after Unicode 14 (Python 3.11's unicodedata), so only the regex engine knows their class:
# Kawi, Cyrillic Extended-D, Nag Mundari, Kaktovik numerals, CJK Extension H
NEWER_BLOCKS = [(0x11F00, 0x11F5F), (0x1E030, 0x1E08F), (0x1E4D0, 0x1E4FF), (0x1D2C0, 0x1D2DF), (0x31350, 0x323AF)]
DIGIT_BLOCKS = [(0x0030, 0x0039), (0x0660, 0x0669), (0x06F0, 0x06F9), (0x0966, 0x096F), (0x09E6, 0x09EF),
                (0x0BE6, 0x0BEF), (0x0E50, 0x0E59), (0x0ED0, 0x0ED9), (0x0F20, 0x0F29), (0x1040, 0x1049),
                (0x17E0, 0x17E9), (0x1810, 0x1819), (0xFF10, 0xFF19), (0x104A0, 0x104A9), (0x1D7CE, 0x1D7FF)]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏿‍💻", "🇫🇷", "🇯🇵🇺🇸", "1️⃣", "❤️", "🧑🏻‍🤝‍🧑🏿", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "🤷‍♀️",
         "☺︎", "✌🏼", "🫠"]
ODD_SPACE = ["\u00a0", "\u2028", "\u2029", "\u3000", "\u1680", "\u2000", "\u2007", "\u200a", "\u202f", "\u205f",
             "\x85", "\x0b", "\x0c", "\x1c", "\x1f", "\u200b", "\ufeff", "\t", "\r\n", "\n\n\n", " " * 7, "\t \t"]
CONTRACTIONS = ["it's", "we'll", "they'RE", "I'M", "don't", "'S", "'LL", "he'd", "you've", "''s", "'", " 's",
                "O'Neil's", "rock'n'roll", "'re'", "isn’t", "'d'd", "'m'",
                # a contraction is lower-case and ends the piece even inside a word
                "'Sam's", "'Tis", "'THE", "'Dear", "'tis", "'state", "'mmm", "'reading", "'llama", "'very", "'dear"]


def _specials(tok) -> list[str]:
    return [t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()]


def _unicode_text(rng: random.Random, n_words: int) -> str:
    pools = []
    for lo, hi in UNICODE_BLOCKS:
        chars = [chr(c) for c in range(lo, hi + 1) if unicodedata.category(chr(c)) != "Cs"]
        pools.append(rng.sample(chars, min(len(chars), 300)))
    pools += [[chr(c) for c in range(lo, hi + 1)] for lo, hi in NEWER_BLOCKS]
    digits = [chr(c) for lo, hi in DIGIT_BLOCKS for c in range(lo, hi + 1) if unicodedata.category(chr(c)) == "Nd"]
    pools.append(digits)  # digits of every script
    seps = [" ", "  ", "\n", ", ", ". ", " - ", "\u3000", "\u00a0"]
    words = []
    for _ in range(n_words):
        pool = rng.choice(pools)
        words.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))) + rng.choice(seps))
    return "".join(words)


def _emoji_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(EMOJI) + rng.choice(["", " ", "x", "\n", " word ", "猫"]) for _ in range(n))


def _whitespace_text(rng: random.Random, n: int) -> str:
    bits = ODD_SPACE + ["word", "Word", "42", "!", "猫", " x", "\t\t", "  \n  ", " " * 40, "\n" * 12]
    return "".join(rng.choice(bits) for _ in range(n))


def _code_text(limit: int) -> str:
    root = Path(os.__file__).parent
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        size += len(text.encode())
        if size >= limit:
            break
    return "".join(out)


def _random_text(rng: random.Random, n: int, specials: list[str]) -> str:
    pool = (list("abcXYZ019 '\t\n.,;!?-_()[]{}<>|") + ODD_SPACE + ["s", "t", "re", "ve", "m", "ll", "d", "S", "LL"]
            + ["猫", "é", "e\u0301", "한", "ㅎ", "٣", "๓", "Ⅻ", "½", "𝟘", "😀", "🏽", "\u200d", "\ufe0f"] + specials)
    out = []
    for _ in range(n):
        if rng.random() < 0.1:
            c = rng.randrange(0x110000)
            out.append(chr(c) if not 0xD800 <= c < 0xE000 else "?")
        else:
            out.append(rng.choice(pool))
    return "".join(out)


def mixed_text(tok, min_bytes: int, seed: int = 0) -> dict[str, str]:
    """Named parts, together at least min_bytes of UTF-8; code fills what the others leave."""
    return dict(_mixed_text(tuple(_specials(tok)), min_bytes, seed))


@lru_cache(maxsize=4)
def _mixed_text(specials: tuple[str, ...], min_bytes: int, seed: int) -> tuple[tuple[str, str], ...]:
    rng = random.Random(seed)
    specials = list(specials)
    parts = {
        "prose": natural_text(),
        "unicode": _unicode_text(rng, 12_000),
        "emoji": _emoji_text(rng, 3_000),
        "whitespace": _whitespace_text(rng, 6_000),
        "contractions": " ".join(rng.choice(CONTRACTIONS) for _ in range(3_000)),
        "specials": "".join(rng.choice(specials + ["<|im_", "<|im_start|", "start", "x", " ", "\n", "hello world",
                                                   "Hello world", "<", "|>"]) for _ in range(4_000)),
        "random": _random_text(rng, 60_000, specials),
    }
    have = sum(len(p.encode()) for p in parts.values())
    parts["code"] = _code_text(max(min_bytes - have, 50_000))
    return tuple(parts.items())


def hf_ids(tok, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def assert_same_ids(native: list[int], expected: list[int], text: str, tok, label: str) -> None:
    if native == expected:
        return
    i = next((k for k, (a, b) in enumerate(zip(native, expected)) if a != b), min(len(native), len(expected)))
    offsets = tok(text, return_offsets_mapping=True)["offset_mapping"]
    at = offsets[min(i, len(offsets) - 1)][0] if offsets else 0
    pytest.fail(f"{label}: {len(text.encode())} bytes, native {len(native)} ids vs HF {len(expected)}; first "
                f"difference at id {i} (text offset {at}: {text[max(0, at - 30):at + 30]!r}): native "
                f"{native[max(0, i - 2):i + 4]} vs HF {expected[max(0, i - 2):i + 4]}")


# ------------------------------------------------------------------------------------------
# (a) ids equal HF on ~1 MB of mixed text, and on pathological text
# ------------------------------------------------------------------------------------------
def test_ids_equal_hf_on_a_megabyte_of_mixed_text(pair):
    hf, native, name = pair
    parts = mixed_text(hf, 1_000_000)
    text = "".join(parts.values())
    size = len(text.encode())
    assert size >= 1_000_000
    for kind, part in parts.items():
        assert_same_ids(native.encode(part), hf_ids(hf, part), part, hf, f"{name}/{kind}")
    t0 = time.perf_counter()
    ids = native.encode(text)
    t_native = time.perf_counter() - t0
    t0 = time.perf_counter()
    expected = hf_ids(hf, text)
    t_hf = time.perf_counter() - t0
    assert_same_ids(ids, expected, text, hf, f"{name}/all")
    sizes = ", ".join(f"{k} {len(p.encode()) / 1e3:.0f} KB" for k, p in parts.items())
    print(f"\n{name}: {size / 1e6:.2f} MB ({sizes}) -> {len(ids)} ids; native {size / 1e6 / t_native:.1f} MB/s, "
          f"HF {size / 1e6 / t_hf:.1f} MB/s", file=sys.stderr)


@pytest.mark.parametrize("kind", ["letters", "mixed_word", "spaces", "spaces_then_word", "digits", "cjk", "newlines",
                                  "punctuation", "emoji", "apostrophes"])
def test_pathological_text_is_fast_and_exact(pair, kind):
    hf, native, name = pair
    rng = random.Random(3)
    text = {
        "letters": "a" * 100_000,
        "mixed_word": "".join(rng.choice("abcdefghij") for _ in range(100_000)),
        "spaces": " " * 50_000,
        "spaces_then_word": " " * 50_000 + "word",
        "digits": "".join(rng.choice("0123456789") for _ in range(100_000)),
        "cjk": "猫" * 50_000,
        "newlines": "\n" * 50_000,
        "punctuation": "!?" * 50_000,
        "emoji": "😀🏽" * 20_000,
        "apostrophes": "'s" * 50_000,
    }[kind]
    t0 = time.perf_counter()
    ids = native.encode(text)
    elapsed = time.perf_counter() - t0
    assert_same_ids(ids, hf_ids(hf, text), text, hf, f"{name}/{kind}")
    assert elapsed < 1.0, f"{kind}: {elapsed:.2f} s for {len(text.encode())} bytes (quadratic BPE?)"


def test_small_cases(pair):
    hf, native, name = pair
    cases = ["", " ", "  ", "a", " a", "a ", "\n", " \n", "\n ", "x  y", "x \ty", "x\t y", "it's", "IT'S", "'s'",
             "\x04", "a\x04\x06b", "\x04\x04 \x04", "<|im_start|><|im_end|>", "<|im_startx", "<|im", "▁<PRE>",
             " <|im_end|> ", "hello world", "ahello worldb", "<|im_start|>start", "e\u0301", "\u3000\u3000x",
             "1 2  3", "½⅓", "𝟘𝟙", "'Sam 'The 'state 'llama 'very 'dear 'mmm", "\U0001E030\U0001E031 \U00031350",
             "\U0010FFFF", "\ufffe\uffff"]
    for text in cases:
        assert_same_ids(native.encode(text), hf_ids(hf, text), text, hf, f"{name}/{text!r}")


def _stray_bytes_oracle(hf, raw: bytes) -> list[int]:
    """The documented handling of invalid UTF-8, built from HF's own parts: split as if each
    stray byte were U+FFFD (class "other"), then BPE over each piece's raw bytes."""
    escaped = raw.decode("utf-8", "surrogateescape")  # one lone surrogate per stray byte
    shown = "".join("\ufffd" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in escaped)
    chars, ids = byte_to_char(), []
    for _, (a, b) in hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(shown):
        piece = escaped[a:b].encode("utf-8", "surrogateescape")
        ids += [t.id for t in hf.backend_tokenizer.model.tokenize("".join(chars[x] for x in piece))]
    return ids


def test_invalid_utf8_never_fails_and_keeps_its_bytes(pair):
    """HF never sees invalid UTF-8 (Python strings are valid). The runtime keeps each stray byte
    as itself, split like U+FFFD (class 'other')."""
    hf, native, name = pair
    assert native.encode_bytes("猫 a".encode()) == hf_ids(hf, "猫 a")
    fixed = [b"ab \xe7\x8c x\xff\xfe!\xc3", b"word\xffword", b" \x80abc", b"\xed\xa0\x80 \xc0\xaf1\xf4\x90",
             b"\xe7\x8c\xab\xe7\x8c", b"it\xff's", b"\xff 's"]
    rng = random.Random(5)
    randoms = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(300)]
    mixed = [rng.choice(["猫 ", "x", " ", "'s", "42"]).encode() + r + b"!" for r in randoms[:100]]
    for raw in fixed + randoms + mixed:
        ids = native.encode_bytes(raw)
        assert ids == _stray_bytes_oracle(hf, raw), raw
        try:
            assert ids == hf_ids(hf, raw.decode("utf-8")), raw
        except UnicodeDecodeError:
            pass


# ------------------------------------------------------------------------------------------
# (b) chat, decoding, stop ids
# ------------------------------------------------------------------------------------------
def _chat_ids(hf, text: str) -> list[int]:
    ids = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("text", ["Hello!", " leading space", "\nnewline first", "trailing spaces   ", "",
                                  "a<|im_end|>b", "猫 😀 'S", "x" * 3000])
def test_chat_encoding_equals_apply_chat_template(pair, text):
    hf, native, _ = pair
    assert native.has_chat_template
    assert native.encode_chat(text) == _chat_ids(hf, text)


def test_stop_ids_vocab_and_special_flags(pair):
    hf, native, _ = pair
    assert native.stop_ids() == [hf.eos_token_id]
    assert native.vocab_size == len(hf)
    specials = {i for i, t in hf.backend_tokenizer.get_added_tokens_decoder().items() if t.special}
    assert specials and all(native.is_special(i) for i in specials)
    assert not native.is_special(hf.convert_tokens_to_ids("a"))
    with pytest.raises(KeyError):
        native.token_bytes(native.vocab_size)
    with pytest.raises(KeyError):
        native.token_bytes(-1)


def test_every_token_decodes_as_hf(pair):
    hf, native, name = pair
    backend = hf.backend_tokenizer
    for i in range(native.vocab_size):
        assert native.token_bytes(i).decode("utf-8", "replace") == backend.decode([i], skip_special_tokens=False), i
    text = "".join(mixed_text(hf, 0).values())[:200_000]
    ids = hf_ids(hf, text)
    for skip in (False, True):
        assert native.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)


# ------------------------------------------------------------------------------------------
# (c) streaming UTF-8
# ------------------------------------------------------------------------------------------
def test_streaming_token_bytes_reproduces_decode(pair, native_lib):
    from edgekv.runtime.native_tokenizer import Utf8Stream

    hf, native, _ = pair
    text = "猫が好き 😀👍🏽 🇫🇷 — 한국어 naïve 猫猫猫 👨‍👩‍👧‍👦 end"
    ids = hf_ids(hf, text)
    stream, pieces, held_back = Utf8Stream(), [], 0
    for i in ids:
        raw = native.token_bytes(i)
        out = stream.push(raw)
        held_back += out.encode() != raw  # a token that ends inside a character
        pieces.append(out)
    pieces.append(stream.flush())
    assert "".join(pieces) == hf.decode(ids) == text
    assert held_back > 0, "no token split a character: the test shows nothing about holding back"


MALFORMED = [b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf0\x90\x80A", b"\xc0\xaf", b"\x80\xbf",
             b"\xf8\x88\x80\x80\x80", b"\xe7\x8c", b"\xf0\x9f\x98", b"\xc3", b"\xff\xfe", b"\xe1\x80\xe2\x82\xac"]


def _stream_decode(chunks: list[bytes]) -> str:
    from edgekv.runtime.native_tokenizer import Utf8Stream

    stream = Utf8Stream()
    return "".join(stream.push(c) for c in chunks) + stream.flush()


@pytest.mark.parametrize("raw", MALFORMED)
def test_stream_replaces_like_python(native_lib, raw):
    data = b"a" + raw + b"z" + raw
    for cut in range(len(data) + 1):
        assert _stream_decode([data[:cut], data[cut:]]) == data.decode("utf-8", "replace"), (raw, cut)
    assert _stream_decode([bytes([b]) for b in data]) == data.decode("utf-8", "replace")
    assert _stream_decode([raw]) == raw.decode("utf-8", "replace")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=40) | st.text(max_size=12).map(lambda s: s.encode()),
       cuts=st.lists(st.integers(0, 40), max_size=6))
def test_stream_any_split_equals_python_decode(native_lib, data, cuts):
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]
    assert _stream_decode(chunks) == data.decode("utf-8", "replace")


# ------------------------------------------------------------------------------------------
# (d) random text
# ------------------------------------------------------------------------------------------
def _text_strategy(extra: list[str]):
    return st.text() | st.lists(st.text(max_size=4) | st.sampled_from(extra)).map("".join)


def _property_check(pair, n: int) -> None:
    hf, native, name = pair
    extra = _specials(hf) + ODD_SPACE + CONTRACTIONS + EMOJI + ["hello world", "<|im_", " "]

    @settings(max_examples=n, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(text=_text_strategy(extra))
    def check(text):
        assert_same_ids(native.encode(text), hf_ids(hf, text), text, hf, f"{name}/hypothesis")

    check()


def test_random_text_equals_hf(pair):
    _property_check(pair, 200)


@pytest.mark.slow
def test_random_text_equals_hf_long(pair):
    _property_check(pair, 5000)


@pytest.mark.slow
def test_ids_equal_hf_on_eight_megabytes(pair):
    hf, native, name = pair
    for seed in range(8):
        parts = mixed_text(hf, 1_000_000, seed=seed)
        parts["code"] = parts["code"][seed * 10_000:]
        text = "".join(parts.values())
        assert_same_ids(native.encode(text), hf_ids(hf, text), text, hf, f"{name}/seed {seed}")


# ------------------------------------------------------------------------------------------
# (e) damaged files
# ------------------------------------------------------------------------------------------
def _sections(data: bytes) -> list[tuple[bytes, bytes]]:
    count = struct.unpack_from("<I", data, 16)[0]
    out = []
    for i in range(count):
        tag, off, size, _ = struct.unpack_from("<4sIII", data, 32 + 16 * i)
        out.append((tag, data[off:off + size]))
    return out


def _open_error(native_lib, data: bytes):
    from edgekv.runtime.native_tokenizer import NativeTokenizer, NativeTokenizerError

    try:
        NativeTokenizer(data=data).close()
    except NativeTokenizerError as exc:
        return exc
    return None


def test_file_round_trips_through_pack_sections(toy_file_bytes):
    assert pack_sections(_sections(toy_file_bytes)) == toy_file_bytes


def test_every_truncation_and_byte_flip_is_refused(native_lib, toy_file_bytes):
    data = toy_file_bytes
    rng = random.Random(7)
    cuts = sorted({0, 1, 31, 32, 33, len(data) - 1, *(rng.randrange(len(data)) for _ in range(200))})
    for cut in cuts:
        err = _open_error(native_lib, data[:cut])
        assert err is not None and err.status == EKV_ERR_FORMAT, cut
        assert "recompile" in str(err) and ("truncated" in str(err) or "short" in str(err)), (cut, str(err))
    # every byte is under a checksum (header CRC, section CRCs, no gaps): no flip goes unnoticed
    header_len = struct.unpack_from("<I", data, 12)[0]
    positions = [*range(header_len), *(rng.randrange(len(data)) for _ in range(300))]
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        err = _open_error(native_lib, bytes(bad))
        assert err is not None and err.status == EKV_ERR_FORMAT, pos
        assert "recompile" in str(err) or "not an edgekv tokenizer" in str(err), (pos, str(err))
    assert _open_error(native_lib, data + b"\0") is not None


def test_damage_under_valid_checksums_is_refused_or_harmless(native_lib, toy_file_bytes):
    """Flips inside sections with the checksums recomputed reach the section validators: each
    file opens with a message or opens to a tokenizer whose ids stay in range."""
    from edgekv.runtime.native_tokenizer import NativeTokenizer, NativeTokenizerError

    sections = _sections(toy_file_bytes)
    rng = random.Random(11)
    refused = 0
    for trial in range(400):
        k = rng.randrange(len(sections))
        tag, body = sections[k]
        if not body:
            continue
        bad = bytearray(body)
        for _ in range(rng.choice([1, 1, 2, 4])):
            # mostly the counts and offsets at the start, where damage matters most
            pos = rng.randrange(min(len(bad), 64)) if rng.random() < 0.5 else rng.randrange(len(bad))
            bad[pos] = rng.choice([0, 0xFF, bad[pos] ^ (1 << rng.randrange(8)), rng.randrange(256)])
        data = pack_sections(sections[:k] + [(tag, bytes(bad))] + sections[k + 1:])
        try:
            tok = NativeTokenizer(data=data)
        except NativeTokenizerError as exc:
            assert exc.status == EKV_ERR_FORMAT and "recompile" in str(exc), str(exc)
            refused += 1
            continue
        for text in ["Hello world, it's 猫 😀 <|im_start|>x\x04\n\n  42", "a" * 300]:
            ids = tok.encode(text)
            assert all(0 <= i < tok.vocab_size for i in ids)
            b"".join(tok.token_bytes(i) for i in ids)
        tok.close()
    assert refused > 100


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:8] + struct.pack("<H", 2) + d[10:], "format 2.0 is not readable"),
    (lambda d: b"GGUF" + d[4:], "bad magic"),
    (lambda d: b"", "too short"),
])
def test_header_damage_messages(native_lib, toy_file_bytes, damage, message):
    err = _open_error(native_lib, damage(toy_file_bytes))
    assert err is not None and message in str(err), str(err)


def _replace_section(data: bytes, tag: bytes, body: bytes) -> bytes:
    return pack_sections([(t, body if t == tag else b) for t, b in _sections(data)])


def test_section_content_damage_messages(native_lib, toy_file_bytes):
    data = toy_file_bytes
    sections = dict(_sections(data))
    merges = bytearray(sections[b"MERG"])
    struct.pack_into("<I", merges, 4, 10**6)  # first merge's left id out of range
    vocab = bytearray(sections[b"VOCB"])
    struct.pack_into("<I", vocab, 8 + 4 * 5, 0xFFFF)  # an offset past the bytes
    chat = struct.pack("<II", 0, 5) + b"abcde" + struct.pack("<I", 0)  # no chat, yet a prefix
    cases = [
        (b"MERG", bytes(merges), "merge part id 1000000 is not a token"),
        (b"MERG", sections[b"MERG"][:-4], "merges section truncated"),
        (b"MERG", struct.pack("<I", 0xFFFFFFF) + sections[b"MERG"][4:], "merges section truncated"),
        (b"VOCB", bytes(vocab), "vocabulary section: offset"),
        (b"CONF", struct.pack("<5I", 7, 0, 1, 0, 0), "not ones this runtime implements"),
        (b"CHAT", chat, "chat template section: flag 0 with 5 + 0 bytes"),
        (b"STOP", struct.pack("<II", 1, 10**7), "stop id 10000000 is not a token"),
        (b"UCLS", struct.pack("<5I", 1, 0, 0, 0x61, 0x110000), "range U+0061..U+110000"),
        (b"ADDT", sections[b"ADDT"] + b"x", "after its end"),
    ]
    for tag, body, message in cases:
        err = _open_error(native_lib, _replace_section(data, tag, body))
        assert err is not None and err.status == EKV_ERR_FORMAT and message in str(err), (tag, str(err))
    missing = pack_sections([(t, b) for t, b in _sections(data) if t != b"STOP"])
    assert "stop ids section (STOP) is missing" in str(_open_error(native_lib, missing))
    # a later minor version's extra section is skipped
    extra = pack_sections(_sections(data) + [(b"NEWS", b"anything")])
    assert _open_error(native_lib, extra) is None


def test_open_path_errors(native_lib, tmp_path, toy_file_bytes):
    from edgekv.runtime.native_tokenizer import NativeTokenizer, NativeTokenizerError

    missing = tmp_path / "nope.ekt"
    with pytest.raises(NativeTokenizerError, match="nope.ekt: cannot open") as info:
        NativeTokenizer(missing)
    assert info.value.status == EKV_ERR_IO
    cut = tmp_path / "tokenizer.ekt"
    cut.write_bytes(toy_file_bytes[:len(toy_file_bytes) // 2])
    with pytest.raises(NativeTokenizerError, match=r"tokenizer.ekt: .* truncated .*recompile") as info:
        NativeTokenizer(cut)
    assert info.value.status == EKV_ERR_FORMAT


# ------------------------------------------------------------------------------------------
# (f) what the exporter refuses
# ------------------------------------------------------------------------------------------
def _wrap(tk):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tk)


def _byte_bpe(missing=(), unk=None, **model_kwargs):
    """A byte-level BPE with one merge ("ab"), and without the tokens of the `missing` bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = byte_to_char()
    vocab = {c: b for b, c in chars.items() if b not in missing}
    vocab["ab"] = 256
    if unk is not None:
        vocab[unk] = 257
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token=unk, **model_kwargs))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return tk


def _refusals():
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

    def wordpiece():
        tk = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        return tk

    def digits():
        tk = _byte_bpe()
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
        return tk

    def nfc():
        tk = _byte_bpe()
        tk.normalizer = normalizers.NFC()
        return tk

    def llama3_split():
        tk = _byte_bpe()
        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3's
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return tk

    def prefix_space():
        tk = _byte_bpe()
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        return tk

    def lstrip():
        tk = _byte_bpe()
        tk.add_special_tokens([AddedToken("<mask>", lstrip=True)])
        return tk

    def bos():
        tk = _byte_bpe()
        tk.add_special_tokens(["<s>"])
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256 + 1)])
        return tk

    return {
        "WordPiece": (wordpiece, "model 'WordPiece' is not supported"),
        "Digits": (digits, "Digits"),
        "NFC": (nfc, "normalizer NFC is not supported"),
        "Split regex": (llama3_split, "Split("),
        "prefix space": (prefix_space, "add_prefix_space=True"),
        "ignore_merges": (lambda: _byte_bpe(ignore_merges=True), "ignore_merges"),
        "dropout": (lambda: _byte_bpe(dropout=0.5), "dropout"),
        "lstrip": (lstrip, "lstrip=True"),
        "TemplateProcessing": (bos, "TemplateProcessing"),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_exporter_refuses_what_the_runtime_cannot_reproduce(tmp_path, case):
    build, message = _refusals()[case]
    tok = _wrap(build())
    with pytest.raises(UnsupportedTokenizer, match=None) as info:
        write_tokenizer_file(tok, tmp_path / "t.ekt")
    assert message in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)  # build.py records ValueError as "not written"
    assert not (tmp_path / "t.ekt").exists()


def test_exporter_accepts_a_plain_byte_bpe_and_refuses_a_slow_tokenizer():
    data, info = build_tokenizer_file(_wrap(_byte_bpe()))
    assert data[:8] == b"EKVTOKN\0" and info["merges"] == 1 and info["chat_template"] is False
    assert "no chat template" in info["chat_template_note"]

    class Slow:
        pass

    with pytest.raises(UnsupportedTokenizer, match="not backed by HF tokenizers"):
        build_tokenizer_file(Slow())


def test_chat_template_that_trims_content_is_not_exported():
    tok = _wrap(_byte_bpe())
    tok.chat_template = "{% for m in messages %}<{{ m['content'] | trim }}>{% endfor %}"
    _, info = build_tokenizer_file(tok)
    assert info["chat_template"] is False and "changes the user content" in info["chat_template_note"]


def test_character_classes_differ_from_unicodedata_only_where_expected():
    """The classes come from the regex engine itself. Against Python's unicodedata they differ
    only in \\s (U+001C..U+001F are str.isspace() but not Oniguruma's \\s) and on code points
    newer than Python's Unicode version."""
    classes = gpt2_classes()
    owner = {}
    for kind, ranges in classes.items():
        for lo, hi in ranges:
            for c in range(lo, hi + 1):
                owner[c] = kind
    for c in range(0x110000):
        if 0xD800 <= c < 0xE000:
            continue
        cat = unicodedata.category(chr(c))
        expect = ("letter" if cat[0] == "L" else "number" if cat[0] == "N" else
                  "space" if chr(c).isspace() else "other")
        got = owner.get(c, "other")
        if got != expect:
            assert (0x1C <= c <= 0x1F and got == "other") or (cat == "Cn" and expect == "other"), (hex(c), got, expect)
    assert owner[0x1E030] == "letter"  # Cyrillic Extended-D: Unicode 15, Cn to Python 3.11
    assert owner[0x85] == owner[0xA0] == owner[0x3000] == "space" and 0x200B not in owner


# ------------------------------------------------------------------------------------------
# The C API's contracts, and bytes without a token
# ------------------------------------------------------------------------------------------
def test_encode_sizes_with_cap_zero_and_fills_a_short_buffer(pair, native_lib):
    import ctypes

    hf, native, _ = pair
    raw = "Sizing the buffer: call once with cap 0. 猫".encode()
    count = ctypes.c_size_t()
    assert native_lib.ekv_tokenizer_encode(native._h, raw, len(raw), None, 0, ctypes.byref(count)) == 0
    expected = native.encode(raw.decode())
    assert count.value == len(expected) > 4
    buf = (ctypes.c_int32 * 4)(*([-7] * 4))
    assert native_lib.ekv_tokenizer_encode(native._h, raw, len(raw), buf, 3, ctypes.byref(count)) == 0
    assert count.value == len(expected) and buf[:3] == expected[:3] and buf[3] == -7
    status = native_lib.ekv_tokenizer_encode(native._h, raw, len(raw), None, 3, ctypes.byref(count))
    assert status == EKV_ERR_INVALID_ARG


def test_encode_chat_without_a_template_is_refused(native_lib):
    from edgekv.runtime.native_tokenizer import NativeTokenizer, NativeTokenizerError

    data, _ = build_tokenizer_file(_wrap(_byte_bpe()))
    tok = NativeTokenizer(data=data)
    assert not tok.has_chat_template and tok.stop_ids() == []
    with pytest.raises(NativeTokenizerError, match="no chat template") as info:
        tok.encode_chat("hi")
    assert info.value.status == EKV_ERR_INVALID_ARG
    assert tok.encode("abab") == [256, 256]


@pytest.mark.parametrize("unk, fuse", [("<unk>", True), ("<unk>", False), (None, False)])
def test_bytes_without_a_token_as_hf(native_lib, unk, fuse):
    """HF turns a byte whose symbol is not in the vocabulary into the unknown token (one per run
    with fuse_unk), or drops it when there is no unknown token."""
    from edgekv.runtime.native_tokenizer import NativeTokenizer

    hf = _wrap(_byte_bpe(missing=(0x04, 0x06, 0xC3), unk=unk, fuse_unk=fuse))  # 0xC3: "ÿ" is C3 BF
    data, _ = build_tokenizer_file(hf)
    tok = NativeTokenizer(data=data)
    for text in ["\x04", "\x04\x06", "a\x04\x04b", "ab\x04ab\x06\x06 \x04", "\x04ab\x04", " \x04x", "ÿ", "aÿb"]:
        assert tok.encode(text) == hf_ids(hf, text), text


def test_document_and_question_parts_match_python(native_lib, toy_tok, tmp_path):
    """The native tokenizer's document / question parts are exactly edgekv.models.chat's, with
    and without the chat template (the two halves a saved document cache is split at)."""
    from edgekv.compiler.backend.tokenizer_file import write_tokenizer_file
    from edgekv.models.chat import encode_document, encode_question
    from edgekv.runtime.native_tokenizer import NativeTokenizer

    write_tokenizer_file(toy_tok, tmp_path / "t.ekt")
    nat = NativeTokenizer(tmp_path / "t.ekt")
    doc = "The door code is 40917.\n\nSome text, 猫 and 😀 and more. "
    for chat in (False, True):
        assert nat.encode_part(doc, chat=chat, part="document") == encode_document(toy_tok, doc, chat)
        assert nat.encode_part("What is the door code?", chat=chat, part="question") == \
            encode_question(toy_tok, "What is the door code?", chat)
    assert nat.encode_part(doc, chat=True, part="whole") == nat.encode_chat(doc)
