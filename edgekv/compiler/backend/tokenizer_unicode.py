"""Unicode data the native tokenizer needs, written into ``tokenizer.ekt`` as tables rather than
typed into C, and measured on HF tokenizers itself wherever its Unicode differs from Python's:

- NFC (section NFCT): canonical combining classes from ``unicodedata``; full canonical
  decompositions and the primary composites as HF tokenizers' NFD/NFC has them (its Rust
  unicode-normalization data is not Python 3.11's Unicode 14: U+11938 does not decompose there);
- the case-insensitive contractions of Qwen2's split regex (section CONT), as Oniguruma folds
  them ("'ſ" is a contraction, "'K" is not)."""

from __future__ import annotations

import itertools
import struct
import unicodedata
from functools import lru_cache

MAX_CODE_POINT = 0x10FFFF
HANGUL = range(0xAC00, 0xAC00 + 11172)
SEPARATOR = "\x01"  # a starter that neither decomposes nor composes


def _code_points() -> list[int]:
    return [c for c in range(MAX_CODE_POINT + 1) if not 0xD800 <= c < 0xE000 and chr(c) != SEPARATOR]


def _each(normalizer, chars: list[str]) -> list[str]:
    out = normalizer.normalize_str(SEPARATOR.join(chars)).split(SEPARATOR)
    assert len(out) == len(chars)
    return out


@lru_cache(maxsize=1)
def nfc_tables() -> dict:
    from tokenizers import normalizers

    cps = _code_points()
    nfd = dict(zip(cps, _each(normalizers.NFD(), [chr(c) for c in cps])))
    nfc = dict(zip(cps, _each(normalizers.NFC(), [chr(c) for c in cps])))
    ccc = []
    for c in cps:
        k = unicodedata.combining(chr(c))
        if k and ccc and ccc[-1][1] == c - 1 and ccc[-1][2] == k:
            ccc[-1] = (ccc[-1][0], c, k)
        elif k:
            ccc.append((c, c, k))
    decomp = {c: [ord(x) for x in d] for c, d in nfd.items() if d != chr(c) and c not in HANGUL}
    comp = []
    for c in decomp:
        parts = unicodedata.decomposition(chr(c)).split()
        if len(parts) == 2 and not parts[0].startswith("<") and nfc[c] == chr(c):
            comp.append((int(parts[0], 16), int(parts[1], 16), c))
    return {"ccc": ccc, "decomp": decomp, "comp": sorted(comp)}


def nfc_section() -> bytes:
    t = nfc_tables()
    flat_cps, entries = [], []
    for c in sorted(t["decomp"]):
        entries.append((c, len(flat_cps), len(t["decomp"][c])))
        flat_cps += t["decomp"][c]
    out = [struct.pack("<4I", len(t["ccc"]), len(entries), len(flat_cps), len(t["comp"]))]
    out += [struct.pack("<3I", *e) for e in t["ccc"]]
    out += [struct.pack("<3I", *e) for e in entries]
    out.append(struct.pack(f"<{len(flat_cps)}I", *flat_cps))
    out += [struct.pack("<3I", *e) for e in t["comp"]]
    return b"".join(out)


@lru_cache(maxsize=4)
def contractions(pattern: str) -> tuple[str, ...]:
    """Every string the pattern's contraction alternative matches: each letter's case variants,
    measured by splitting "'" + variant + "b" (a contraction ends its piece before the letter, where
    the letters alternative would run on)."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(pattern), "isolated")
    # candidates: ASCII and Latin letters (a non-letter ends the piece anyway)
    letters = {c: [chr(x) for x in range(0x80, 0x2B0) if chr(x).isalpha()] + [c, c.upper()] for c in "stremvld"}

    def matches(s: str) -> bool:
        return split.pre_tokenize_str(s + "b\x01")[0][0] == s

    found = []
    for word in ("s", "t", "re", "ve", "m", "ll", "d"):
        options = [[v for v in letters[ch] if matches("'" + word[:i] + v + word[i + 1:])] for i, ch in enumerate(word)]
        found += ["'" + "".join(p) for p in itertools.product(*options) if matches("'" + "".join(p))]
    return tuple(dict.fromkeys(found))


def contractions_section(pattern: str) -> bytes:
    items = [c.encode("utf-8") for c in contractions(pattern)]
    return struct.pack("<I", len(items)) + b"".join(struct.pack("<I", len(b)) + b for b in items)
