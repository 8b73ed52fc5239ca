"""A tokenizer test corpus of at least 2,000 lines, generated (no copied text of unclear licence):
Python's own standard-library sources (code), unicodedata-driven samples of many scripts (CJK,
Hangul, Indic, Arabic, combining marks in every order for NFC), emoji sequences, long whitespace
runs, numbers, contractions in every case, mixed scripts and control characters.

    python tools/tokenizer_corpus.py OUT.txt [--lines N] [--seed S]

Deterministic for a seed. tests/test_tokenizer_kinds.py imports ``corpus_lines``."""

from __future__ import annotations

import argparse
import os
import random
import unicodedata
from pathlib import Path

SCRIPTS = [(0x0041, 0x024F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0590, 0x05FF), (0x0600, 0x06FF),
           (0x0900, 0x097F), (0x0B80, 0x0BFF), (0x0E00, 0x0E7F), (0x1100, 0x11FF), (0x3040, 0x30FF),
           (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1D400, 0x1D7FF), (0x20000, 0x2A6DF)]
MARKS = [c for c in range(0x0300, 0x0370)] + [0x0591, 0x05B0, 0x064B, 0x0651, 0x093C, 0x094D, 0x0E48, 0x302A, 0x3099]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏿‍💻", "🇫🇷", "🇯🇵🇺🇸", "1️⃣", "❤️", "🧑🏻‍🤝‍🧑🏿", "🫠", "✌🏼"]
SPACES = [" ", "  ", "\t", "\u00a0", "\u3000", "\u2009", "\u200b", "\ufeff", "\x0b", "\x0c", "\x85", "\u2028"]
CONTROL = ["\x00", "\x01", "\x07", "\x1b", "\x1f", "\x7f", "\x9f"]
CONTRACTIONS = ["it's", "IT'S", "we'll", "WE'LL", "they'Re", "I'M", "don'T", "he'd", "HE'D", "you've", "YOU'VE",
                "'ſ", "O'Neil's", "rock'n'roll", "''s", "isn’t", "'tis", "'Twas", "'llama", "'ve'", "l'été"]
WORDS = ["the", "cache", "évincé", "naïve", "Straße", "déjà", "über", "Ωmega", "Кот", "猫", "東京", "한국어", "مرحبا",
         "שלום", "नमस्ते", "தமிழ்", "ไทย", "ＡＢＣ", "ﬁne", "Å", "Å", "é"]


def code_lines(rng: random.Random, n: int) -> list[str]:
    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py"))
    out: list[str] = []
    for path in rng.sample(files, min(len(files), 40)):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        start = rng.randrange(max(1, len(lines) - 30))
        out += lines[start:start + 30]
        if len(out) >= n:
            break
    return out[:n]


def script_line(rng: random.Random) -> str:
    words = []
    for _ in range(rng.randint(2, 10)):
        lo, hi = rng.choice(SCRIPTS)
        chars = []
        while len(chars) < rng.randint(1, 7):
            c = chr(rng.randint(lo, hi))
            if unicodedata.category(c) not in ("Cn", "Cs", "Co"):
                chars.append(c)
        words.append("".join(chars))
    return rng.choice([" ", "", "，", "、", " - "]).join(words)


def marks_line(rng: random.Random) -> str:
    """base letters with combining marks in random order, precomposed and decomposed forms:
    what NFC reorders and composes"""
    out = []
    for _ in range(rng.randint(2, 8)):
        base = rng.choice("aeiouAEIOUnNcCsSzZ" + "αωΑΩιυ" + "가각ᄀ" + "क")
        marks = "".join(chr(rng.choice(MARKS)) for _ in range(rng.randint(0, 4)))
        word = base + marks + rng.choice(["", "ᅡ", "ᆨ", "\u0301", "\u0327"])
        out.append(rng.choice([word, unicodedata.normalize("NFD", word), unicodedata.normalize("NFC", word)]))
    return " ".join(out)


def mixed_line(rng: random.Random) -> str:
    bits = WORDS + CONTRACTIONS + EMOJI + SPACES + CONTROL + [str(rng.randint(0, 10**9)), "3.14159", "1,000,000",
                                                              "0x1F", "٣٤٥", "१२३", "x" * 50, "!!!", "...", "\r\n"]
    return "".join(rng.choice(bits) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(3, 20)))


def whitespace_line(rng: random.Random) -> str:
    return (rng.choice(SPACES) * rng.randint(1, 60) + rng.choice(WORDS) + " " * rng.randint(0, 40)
            + rng.choice(["", "\n" * rng.randint(1, 5), "\t" * 8]) + rng.choice(WORDS))


def corpus_lines(n: int = 2400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    kinds = [script_line, marks_line, mixed_line, whitespace_line]
    lines = code_lines(rng, n // 4)
    while len(lines) < n:
        lines.append(rng.choice(kinds)(rng))
    rng.shuffle(lines)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lines", type=int, default=2400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lines = corpus_lines(args.lines, args.seed)
    # one line per corpus line; the lines themselves may hold \r, \x85 or \u2028 (they are kept)
    args.out.write_text("\n".join(lines), encoding="utf-8", newline="")
    print(f"{len(lines)} lines, {args.out.stat().st_size} bytes -> {args.out}")


if __name__ == "__main__":
    main()
