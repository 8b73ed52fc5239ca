"""``tokenizer.ekt``: an HF byte-level BPE tokenizer as one compact binary file that the native
runtime (``runtime/src/tokenizer.c``) reads without a general parser.

The native tokenizer must give exactly the ids ``tokenizer(text)["input_ids"]`` gives, so this
exporter only writes what the C side reproduces and refuses (``UnsupportedTokenizer``, a
``ValueError``) anything else, naming it: a normalizer other than the empty one, a pre-tokenizer
other than ``ByteLevel(add_prefix_space=False, use_regex=True)`` (the GPT-2 split regex), a model
other than plain BPE, added tokens with lstrip/rstrip/single_word, a post-processor or a
transformers wrapper that adds tokens around the text.

Layout, little-endian, version 1.0 (the C header comment of tokenizer.c repeats it)::

    header (32 bytes)
      0   8   magic b"EKVTOKN\\0"
      8   u16 major version (a reader refuses another major)
      10  u16 minor version (a newer minor only adds sections; a reader skips tags it does not know)
      12  u32 header_len = 32 + 16 × section_count
      16  u32 section_count (1 ≤ count ≤ 64)
      20  u32 file_len: the whole file's size in bytes
      24  u32 header_crc: CRC-32 (zlib.crc32) of bytes [0, header_len) with these 4 bytes as zero
      28  u32 reserved, 0
    section table at 32: section_count × 16 bytes
      +0  4s  tag (4 ASCII bytes)
      +4  u32 offset from the start of the file
      +8  u32 size in bytes
      +12 u32 crc32 of the section's bytes
    The sections follow in table order with no gaps: the first at header_len, each at the end of
    the one before, the last ending at file_len. So every byte is under a checksum; integers are
    read byte by byte, so nothing needs alignment.

    CONF (20 bytes): u32 pre_tokenizer (1 = GPT-2 byte-level split regex, no prefix space),
         u32 normalizer (0 = none), u32 model (1 = byte-level BPE, merges always applied),
         u32 flags (bit 0 fuse_unk: a run of bytes without a token is one unknown token),
         u32 unk_id (0xFFFFFFFF: none, such bytes are dropped, as HF does without an unk token)
    VOCB: u32 n_ids, u32 blob_len, u32 offsets[n_ids + 1] (offsets[0] = 0, non-decreasing,
         offsets[n_ids] = blob_len), u8 flags[n_ids] (bit 0 the id has a token, bit 1 special:
         skipped when decoding for display, bit 2 an added token), then blob_len bytes: id i's
         raw bytes are blob[offsets[i] .. offsets[i+1]) — what HF's ByteLevel decoder gives for
         the token (an added token's own UTF-8 text unless all its characters are byte-level
         symbols). An id with no token has flags 0 and no bytes.
    BYTE: u32 id[256]: the token of each single byte (BPE starts from these); 0xFFFFFFFF for a
         byte whose byte-level symbol is not in the vocabulary (SmolLM2 lacks 21: 0x04, 0xC0,
         0xF5.., ...): it becomes the unknown token
    MERG: u32 count, then count × (u32 left, u32 right, u32 merged) in priority order (the index
         is the rank: lower merges first); every (left, right) pair appears once
    ADDT: u32 count, then per added token: u32 id, u32 flags (bit 0 special, bit 1 normalized:
         matched after the non-normalized ones, in what they left), u32 len, len bytes: the text
         matched in the input (its UTF-8 content)
    UCLS: u32 n_letter, u32 n_number, u32 n_space, then (n_letter + n_number + n_space) ×
         (u32 first, u32 last) code-point ranges, each list sorted and non-overlapping, the lists
         disjoint: the regex's \\p{L}, \\p{N} and \\s as HF tokenizers' regex engine (Oniguruma)
         has them; every other code point is "other"
    CHAT: u32 has_chat (0/1), u32 prefix_len, prefix bytes, u32 suffix_len, suffix bytes: one
         user turn with the generation prompt is prefix + text + suffix (both empty when 0)
    STOP: u32 count, count × u32 ids generation stops at (the tokenizer's eos_token_id)

Version 1.1 adds tokenizer kinds (``tokenizer_kinds.py`` says which tokenizer.json is which) and
three sections, present when CONF needs them (a 1.0 reader refuses such CONF values by name):

    CONF pre_tokenizer 2 = Qwen2's split regex, then ByteLevel without its regex; 0 = none
         normalizer 1 = NFC (tables in NFCT); 2 = Replace(" ", "▁") (SentencePiece)
         model 2 = Unigram (pieces in UNIG; MERG is empty)
    NFCT: u32 n_ccc, u32 n_decomp, u32 n_decomp_cps, u32 n_comp, then n_ccc × (u32 first, u32 last,
         u32 class) non-zero canonical combining classes, n_decomp × (u32 cp, u32 offset, u32 len)
         full canonical decompositions (sorted by cp) into n_decomp_cps × u32 code points, n_comp ×
         (u32 first, u32 second, u32 composite) primary composites sorted by pair; Hangul syllables
         are arithmetic and absent. Measured on HF tokenizers' own NFD/NFC (``tokenizer_unicode.py``)
    CONT: u32 count, then per contraction u32 len + its UTF-8 bytes: every string the regex's
         case-insensitive ``(?i:'s|'t|'re|'ve|'m|'ll|'d)`` matches, measured ('ſ' folds to 's')
    UNIG: u32 n, u32 blob_len, u32 flags (bit 0 byte_fallback, bit 1 fuse_unk), u32 unk_id,
         f64 min_score, then n × (u32 offset, u32 len, u32 id, f64 score) sorted bytewise by the
         piece's text (each text once: the id HF's token_to_ids keeps), then the blob of texts
         (normalized form: "▁" for a space). BYTE then holds the <0xXX> byte-fallback tokens.

Version 1.2 adds the sentencepiece_bpe kind (Gemma 3's tokenizer as edgekv rebuilds it):

    CONF pre_tokenizer 0, normalizer 2, model 3 = BPE over characters with byte fallback: a span's
         characters start as their single-character pieces (CHRS), a character without one as its
         bytes' <0xXX> tokens (BYTE), then MERG merges them as for the byte-level BPE
    CHRS: u32 count, then count × (u32 code point, u32 id) sorted by code point: every piece that is
         one character ("▁" for a space)
    BOSP: u32 id, present when the tokenizer puts that token before a prompt (Gemma's add_bos: HF's
         TemplateProcessing "<bos> $A"); the runtime then starts a plain (not chat) whole prompt with it
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from functools import lru_cache
from pathlib import Path

from ...models.chat import CHAT_PROBE, CHAT_SENTINEL, chat_pieces  # noqa: F401 - used here and re-exported
from .tokenizer_kinds import (  # noqa: F401 - the pipeline checks live with the kinds; re-exported
    KIND_GPT2, KIND_QWEN2, KIND_SP_BPE, KIND_UNIGRAM, QWEN2_SPLIT_PATTERN, UnsupportedTokenizer, _describe, bos_prefix,
    check_gpt2_pipeline, tokenizer_kind,
)
from .tokenizer_unicode import contractions_section, nfc_section

MAGIC = b"EKVTOKN\0"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0  # what a GPT-2 byte-level tokenizer is written as (every 1.x reader reads it)
FORMAT_MINOR_KINDS = 1  # Qwen2 and Unigram tokenizers
FORMAT_MINOR_SP_BPE = 2  # SentencePiece BPE (model 3, CHRS)
HEADER_BYTES = 32
SECTION_ENTRY_BYTES = 16

PRE_TOKENIZER_NONE = 0
PRE_TOKENIZER_GPT2_BYTE_LEVEL = 1
PRE_TOKENIZER_QWEN2 = 2
NORMALIZER_NONE = 0
NORMALIZER_NFC = 1
NORMALIZER_SPACE_TO_U2581 = 2
MODEL_BYTE_LEVEL_BPE = 1
MODEL_UNIGRAM = 2
MODEL_SP_BPE = 3

FLAG_FUSE_UNK = 1
NO_ID = 0xFFFFFFFF
VOCAB_PRESENT, VOCAB_SPECIAL, VOCAB_ADDED = 1, 2, 4
ADDED_SPECIAL, ADDED_NORMALIZED = 1, 2

MAX_CODE_POINT = 0x10FFFF
SURROGATES = range(0xD800, 0xE000)

# strings on which the transformers tokenizer must give exactly the backend's ids (it must add
# nothing around the text, as the native runtime adds nothing)
_SELF_CHECK_TEXTS = ["Hello world", " two  spaces\n\nand lines ", "It's 2024: déjà vu, 猫 😀", "x"]


def write_tokenizer_file(tokenizer, path: str | os.PathLike) -> dict:
    """Write ``tokenizer`` (a transformers tokenizer backed by HF ``tokenizers``) to ``path``.

    Atomic (written to ``<path>.part`` and renamed). Returns the facts for the artifact manifest:
    path, sha256, size, format_version, section sizes, counts, chat template and stop ids.
    Raises ``UnsupportedTokenizer`` (a ValueError) naming what the runtime cannot reproduce."""
    data, info = build_tokenizer_file(tokenizer)
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": str(path), "sha256": hashlib.sha256(data).hexdigest(), "size": len(data), **info}


def build_tokenizer_file(tokenizer) -> tuple[bytes, dict]:
    """The file's bytes and the manifest facts (without path/sha256/size)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizer(f"{type(tokenizer).__name__} is not backed by HF tokenizers (a 'fast' tokenizer); "
                                   "the native runtime reads only tokenizers' byte-level BPE")
    spec = json.loads(backend.to_str())
    kind = tokenizer_kind(spec)
    bos = bos_prefix(spec) if kind == KIND_SP_BPE else None
    _check_adds_nothing(tokenizer, backend, None if bos is None else backend.token_to_id(bos))
    if kind == KIND_UNIGRAM:
        return _build_unigram(tokenizer, backend, spec)
    if kind == KIND_SP_BPE:
        return _build_sentencepiece_bpe(tokenizer, backend, spec)
    model = spec["model"]
    vocab = _model_vocab(model)
    added = _added_tokens(backend)
    token_bytes, flags = _id_table(vocab, added)
    byte_ids = _byte_ids(model, vocab)
    unk_id = _unk_id(model, vocab) if NO_ID in byte_ids else None
    merges = _merges(model, vocab)
    classes = gpt2_classes()
    chat = chat_pieces(tokenizer)
    stop = _stop_ids(tokenizer, len(token_bytes), vocab, chat)
    qwen2 = kind == KIND_QWEN2
    normalizer = NORMALIZER_NFC if qwen2 and spec.get("normalizer") is not None else NORMALIZER_NONE
    sections = [
        (b"CONF", struct.pack("<5I", PRE_TOKENIZER_QWEN2 if qwen2 else PRE_TOKENIZER_GPT2_BYTE_LEVEL, normalizer,
                              MODEL_BYTE_LEVEL_BPE, FLAG_FUSE_UNK if model.get("fuse_unk") else 0,
                              NO_ID if unk_id is None else unk_id)),
        (b"VOCB", _vocab_section(token_bytes, flags)),
        (b"BYTE", struct.pack("<256I", *byte_ids)),
        (b"MERG", _merges_section(merges)),
        (b"ADDT", _added_section(added)),
        (b"UCLS", _classes_section(classes)),
        (b"CHAT", _chat_section(chat)),
        (b"STOP", struct.pack(f"<I{len(stop)}I", len(stop), *stop)),
    ]
    if normalizer == NORMALIZER_NFC:
        sections.append((b"NFCT", nfc_section()))
    if qwen2:
        sections.append((b"CONT", contractions_section(QWEN2_SPLIT_PATTERN)))
    minor = FORMAT_MINOR_KINDS if qwen2 else FORMAT_MINOR
    return _packed(kind, minor, sections, len(token_bytes), {"merges": len(merges)}, added, chat, stop,
                   unicode_ranges={k: len(v) for k, v in classes.items()})


def _build_unigram(tokenizer, backend, spec: dict) -> tuple[bytes, dict]:
    """A SentencePiece Unigram tokenizer (Gemma 3's, as transformers builds it from the GGUF)."""
    model = spec["model"]
    pieces = model.get("vocab") or []
    unk = model.get("unk_id")
    if unk is None or not 0 <= unk < len(pieces):
        raise UnsupportedTokenizer("the unigram model has no unknown token; the native runtime (as HF) needs one")
    added = _added_tokens(backend)
    n_ids = max(len(pieces), 1 + max((a["id"] for a in added), default=-1))
    for idx, (piece, _) in enumerate(pieces):
        if not piece:
            raise UnsupportedTokenizer(f"unigram piece {idx} is the empty string")
    text, flags, token_bytes = _sentencepiece_vocab(((idx, piece) for idx, (piece, _) in enumerate(pieces)),
                                                    n_ids, added)
    piece_ids = {piece: idx for idx, (piece, _) in enumerate(pieces)}  # the last id of a text, as HF
    byte_ids = _byte_fallback_ids(piece_ids, token_bytes)
    chat = chat_pieces(tokenizer)
    stop = _stop_ids(tokenizer, n_ids, piece_ids, chat)
    flags_u = (1 if model.get("byte_fallback") else 0) | 2  # HF's Unigram always fuses unknowns
    sections = [
        (b"CONF", struct.pack("<5I", PRE_TOKENIZER_NONE, NORMALIZER_SPACE_TO_U2581, MODEL_UNIGRAM, 0, unk)),
        (b"VOCB", _vocab_section(token_bytes, flags)),
        (b"BYTE", struct.pack("<256I", *byte_ids)),
        (b"MERG", struct.pack("<I", 0)),
        (b"ADDT", _added_section(added)),
        (b"UCLS", struct.pack("<3I", 0, 0, 0)),
        (b"CHAT", _chat_section(chat)),
        (b"STOP", struct.pack(f"<I{len(stop)}I", len(stop), *stop)),
        (b"UNIG", unigram_section(pieces, piece_ids, unk, flags_u)),
    ]
    return _packed(KIND_UNIGRAM, FORMAT_MINOR_KINDS, sections, n_ids, {"pieces": len(piece_ids)}, added, chat, stop)


def _build_sentencepiece_bpe(tokenizer, backend, spec: dict) -> tuple[bytes, dict]:
    """A BPE over characters with byte fallback (Gemma 3's tokenizer as ``models/loader.py`` rebuilds it)."""
    model = spec["model"]
    vocab = _model_vocab(model)
    added = _added_tokens(backend)
    n_ids = 1 + max([*vocab.values(), *(a["id"] for a in added)], default=-1)
    text, flags, token_bytes = _sentencepiece_vocab(((idx, token) for token, idx in vocab.items()), n_ids, added)
    byte_ids = _byte_fallback_ids(vocab, token_bytes)
    unk = model.get("unk_token")
    if unk is not None and unk not in vocab:
        raise UnsupportedTokenizer(f"the unknown token {unk!r} is not in the vocabulary")
    unk_id = NO_ID if unk is None else vocab[unk]
    chars = sorted((ord(t), idx) for t, idx in vocab.items() if len(t) == 1 and not 0xD800 <= ord(t) < 0xE000)
    merges = _merges(model, vocab)
    chat = chat_pieces(tokenizer)
    stop = _stop_ids(tokenizer, n_ids, vocab, chat)
    sections = [
        (b"CONF", struct.pack("<5I", PRE_TOKENIZER_NONE, NORMALIZER_SPACE_TO_U2581, MODEL_SP_BPE,
                              FLAG_FUSE_UNK if model.get("fuse_unk") else 0, unk_id)),
        (b"VOCB", _vocab_section(token_bytes, flags)),
        (b"BYTE", struct.pack("<256I", *byte_ids)),
        (b"MERG", _merges_section(merges)),
        (b"ADDT", _added_section(added)),
        (b"UCLS", struct.pack("<3I", 0, 0, 0)),
        (b"CHAT", _chat_section(chat)),
        (b"STOP", struct.pack(f"<I{len(stop)}I", len(stop), *stop)),
        (b"CHRS", struct.pack(f"<I{2 * len(chars)}I", len(chars), *(x for pair in chars for x in pair))),
    ]
    bos = bos_prefix(spec)
    if bos is not None:
        if bos not in vocab:
            raise UnsupportedTokenizer(f"the post-processor puts {bos!r} first, which is not in the vocabulary")
        sections.append((b"BOSP", struct.pack("<I", vocab[bos])))
    counts = {"merges": len(merges), "characters": len(chars), "bos_prefix": None if bos is None else vocab[bos]}
    return _packed(KIND_SP_BPE, FORMAT_MINOR_SP_BPE, sections, n_ids, counts, added, chat, stop)


def _packed(kind: str, minor: int, sections: list[tuple[bytes, bytes]], n_ids: int, counts: dict, added: list[dict],
            chat: dict, stop: list[int], **extra) -> tuple[bytes, dict]:
    """The file's bytes and what the manifest records of it, the same keys for every kind (``counts``:
    the kind's own sizes)."""
    info = {"kind": kind, "format_version": f"{FORMAT_MAJOR}.{minor}",
            "sections": {tag.decode(): len(body) for tag, body in sections}, "ids": n_ids, **counts,
            "added_tokens": len(added), "chat_template": chat["prefix"] is not None, "stop_ids": stop, **extra}
    if chat["prefix"] is None:
        info["chat_template_note"] = chat["reason"]
    return pack_sections(sections, minor), info


def _sentencepiece_vocab(entries, n_ids: int, added: list[dict]):
    """Text, flags and bytes per id of a SentencePiece-style vocabulary (Unigram pieces or the BPE
    over characters): ``entries`` are (id, piece) pairs, then the added tokens over them."""
    text: list[str | None] = [None] * n_ids
    flags = [0] * n_ids
    for idx, piece in entries:
        text[idx], flags[idx] = piece, VOCAB_PRESENT
    for a in added:
        text[a["id"]], flags[a["id"]] = a["content"], VOCAB_PRESENT | VOCAB_ADDED
    specials = {a["content"] for a in added if a["special"]}
    for idx, t in enumerate(text):
        if t is not None and t in specials:
            flags[idx] |= VOCAB_SPECIAL
    return text, flags, [sentencepiece_bytes(t) if t is not None else b"" for t in text]


def _byte_fallback_ids(ids_by_text: dict[str, int], token_bytes: list[bytes]) -> list[int]:
    """The id of each byte's <0xNN> token (NO_ID where there is none), each checked to decode to its byte."""
    byte_ids = [ids_by_text.get(f"<0x{b:02X}>", NO_ID) for b in range(256)]
    for b, idx in enumerate(byte_ids):
        if idx != NO_ID and token_bytes[idx] != bytes([b]):
            raise UnsupportedTokenizer(f"byte-fallback token <0x{b:02X}> (id {idx}) does not decode to its byte")
    return byte_ids


def sentencepiece_bytes(piece: str) -> bytes:
    """What HF's Replace("▁", " ") + ByteFallback decoder makes of one piece: <0xXX> is its byte."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def unigram_section(pieces: list, piece_ids: dict[str, int], unk_id: int, flags: int) -> bytes:
    scores = [float(score) for _, score in pieces]
    entries = sorted(((t.encode("utf-8"), idx) for t, idx in piece_ids.items()), key=lambda e: e[0])
    blob, table, offset = [], [], 0
    for text, idx in entries:
        table.append(struct.pack("<IIId", offset, len(text), idx, scores[idx]))
        blob.append(text)
        offset += len(text)
    head = struct.pack("<IIIId", len(entries), offset, flags, unk_id, min(scores))
    return head + b"".join(table) + b"".join(blob)


def pack_sections(sections: list[tuple[bytes, bytes]], minor: int = FORMAT_MINOR) -> bytes:
    """Header + section table + sections (tests use this to build files the reader must refuse)."""
    header_len = HEADER_BYTES + SECTION_ENTRY_BYTES * len(sections)
    file_len = header_len + sum(len(body) for _, body in sections)
    table, offset = [], header_len
    for tag, body in sections:
        table.append(struct.pack("<4sIII", tag, offset, len(body), zlib.crc32(body)))
        offset += len(body)
    head = MAGIC + struct.pack("<HHIIIII", FORMAT_MAJOR, minor, header_len, len(sections), file_len, 0, 0)
    head += b"".join(table)
    crc = zlib.crc32(head)
    head = head[:24] + struct.pack("<I", crc) + head[28:]
    return head + b"".join(body for _, body in sections)


# ------------------------------------------------------------------------------------------
# What the runtime reproduces
# ------------------------------------------------------------------------------------------
def check_pipeline(spec: dict) -> None:
    """Refuse a tokenizer.json whose model, normalizer, pre-tokenizer, decoder or post-processor
    the native runtime does not implement."""
    tokenizer_kind(spec)


def _check_adds_nothing(tokenizer, backend, bos_id: int | None = None) -> None:
    """The transformers tokenizer gives the backend's ids of the text, after ``bos_id`` when the file
    records that the runtime puts it first (BOSP)."""
    for text in _SELF_CHECK_TEXTS:
        wrapped = list(tokenizer(text)["input_ids"])
        plain = ([] if bos_id is None else [bos_id]) + backend.encode(text, add_special_tokens=False).ids
        if wrapped != plain:
            raise UnsupportedTokenizer(f"{type(tokenizer).__name__} adds or changes tokens around the text "
                                       f"({text!r}: {wrapped} vs the backend's {plain}); the native runtime "
                                       "encodes the text only")


# ------------------------------------------------------------------------------------------
# Vocabulary, merges, added tokens
# ------------------------------------------------------------------------------------------
def byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for
    U+0100 upwards in byte order (as HF tokenizers' ``bytes_char``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


CHAR_TO_BYTE = {c: b for b, c in byte_to_char().items()}


def decoded_bytes(token: str) -> bytes:
    """What HF's ByteLevel decoder makes of one token: its bytes when every character is a
    byte-level symbol, else the token's own UTF-8 text."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _model_vocab(model: dict) -> dict[str, int]:
    vocab = model.get("vocab") or {}
    seen: dict[int, str] = {}
    for token, idx in vocab.items():
        if not isinstance(idx, int) or idx < 0 or idx >= 1 << 31:
            raise UnsupportedTokenizer(f"vocabulary id {idx!r} of {token!r} is not a valid id")
        if idx in seen:
            raise UnsupportedTokenizer(f"vocabulary id {idx} is given to both {seen[idx]!r} and {token!r}")
        if not token:
            raise UnsupportedTokenizer(f"vocabulary id {idx} is the empty string")
        seen[idx] = token
    return vocab


def _added_tokens(backend) -> list[dict]:
    """The added tokens with the ids HF gave them at load (a token the model's vocabulary has
    takes the model's id, whatever tokenizer.json says)."""
    added = []
    for idx, tok in sorted(backend.get_added_tokens_decoder().items()):
        for flag in ("lstrip", "rstrip", "single_word"):
            if getattr(tok, flag):
                raise UnsupportedTokenizer(f"added token {tok.content!r} has {flag}=True, which the native "
                                           "runtime does not implement")
        if not tok.content:
            raise UnsupportedTokenizer(f"added token id {idx} has empty content")
        added.append({"id": int(idx), "content": tok.content, "special": bool(tok.special),
                      "normalized": bool(tok.normalized)})
    return added


def _id_table(vocab: dict[str, int], added: list[dict]) -> tuple[list[bytes], list[int]]:
    """Each id's bytes and flags, as HF decodes: an added token's content takes precedence over
    the model's token of the same id; a token is special when its text is a special token's."""
    n_ids = 1 + max([*vocab.values(), *(a["id"] for a in added)], default=-1)
    text: list[str | None] = [None] * n_ids
    flags = [0] * n_ids
    for token, idx in vocab.items():
        text[idx] = token
        flags[idx] = VOCAB_PRESENT
    for a in added:
        text[a["id"]] = a["content"]
        flags[a["id"]] = VOCAB_PRESENT | VOCAB_ADDED
    special_texts = {a["content"] for a in added if a["special"]}
    for idx, t in enumerate(text):
        if t is not None and t in special_texts:
            flags[idx] |= VOCAB_SPECIAL
    return [decoded_bytes(t) if t is not None else b"" for t in text], flags


def _byte_ids(model: dict, vocab: dict[str, int]) -> list[int]:
    """The token of each byte's symbol, NO_ID where the vocabulary lacks it. HF then tries byte
    fallback (the <0xXX> tokens of the symbol's UTF-8 bytes, added out of order with a pending
    unknown token): refused where it would apply, as the runtime does not reproduce it."""
    ids = []
    for b, c in sorted(byte_to_char().items()):
        if c in vocab:
            ids.append(vocab[c])
            continue
        if model.get("byte_fallback") and all(f"<0x{x:02X}>" in vocab for x in c.encode("utf-8")):
            raise UnsupportedTokenizer(f"byte 0x{b:02X} has no token and would use BPE byte fallback, which the "
                                       "native runtime does not implement")
        ids.append(NO_ID)
    return ids


def _unk_id(model: dict, vocab: dict[str, int]) -> int | None:
    unk = model.get("unk_token")
    if unk is None:
        return None
    if unk not in vocab:  # HF fails on such a byte
        raise UnsupportedTokenizer(f"the unknown token {unk!r} is not in the vocabulary, and some bytes need it")
    return vocab[unk]


def _merges(model: dict, vocab: dict[str, int]) -> list[tuple[int, int, int]]:
    """(left, right, merged) in rank order. As HF builds its merge map, a pair listed twice keeps
    its last rank."""
    by_pair: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, entry in enumerate(model.get("merges") or []):
        left, right = entry.split(" ", 1) if isinstance(entry, str) else entry
        missing = [t for t in (left, right, left + right) if t not in vocab]
        if missing:
            raise UnsupportedTokenizer(f"merge {left!r} + {right!r} (rank {rank}) uses {missing[0]!r}, which is not "
                                       "in the vocabulary")
        by_pair[(vocab[left], vocab[right])] = (rank, vocab[left + right])
    return [(l, r, m) for (l, r), (_, m) in sorted(by_pair.items(), key=lambda kv: kv[1][0])]


# ------------------------------------------------------------------------------------------
# The split regex's character classes, as the installed regex engine has them
# ------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def gpt2_classes() -> dict[str, list[tuple[int, int]]]:
    """``unicode_classes`` of ByteLevel's split regex, which is fixed inside HF tokenizers
    (``check_pipeline`` admits no other pre-tokenizer): measured once per process."""
    from tokenizers import pre_tokenizers

    return unicode_classes(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))


def unicode_classes(pre_tokenizer) -> dict[str, list[tuple[int, int]]]:
    """\\p{L}, \\p{N} and \\s of the GPT-2 regex as code-point ranges, measured on the
    tokenizer's own pre-tokenizer so they are Oniguruma's (Unicode 15 in tokenizers 0.22, where
    Python 3.11's unicodedata is Unicode 14; and \\s there lacks U+001C..U+001F, which
    str.isspace() has).

    Every code point but the surrogates is pre-tokenized once in one string: a piece never
    mixes classes (apart from ASCII, probed alone), so only each piece's first and last characters are
    classified, by four probes that each put it behind a character of a known class."""
    pieces = [[c] for c in range(0x80)]
    others = [c for c in range(0x80, MAX_CODE_POINT + 1) if c not in SURROGATES]
    for _, (start, end) in pre_tokenizer.pre_tokenize_str("".join(map(chr, others))):
        pieces.append(others[start:end])
    kinds = _classify(pre_tokenizer, [chr(p[0]) for p in pieces])
    last_kinds = _classify(pre_tokenizer, [chr(p[-1]) for p in pieces])
    for piece, first, last in zip(pieces, kinds, last_kinds):
        if first != last:
            raise UnsupportedTokenizer(f"the pre-tokenizer keeps U+{piece[0]:04X} ({first}) and U+{piece[-1]:04X} "
                                       f"({last}) in one piece, which the GPT-2 regex does not")
    ranges: dict[str, list[tuple[int, int]]] = {"letter": [], "number": [], "space": []}
    for piece, kind in zip(pieces, kinds):
        if kind == "other":
            continue
        out = ranges[kind]
        for c in piece:
            if out and out[-1][1] == c - 1:
                out[-1] = (out[-1][0], c)
            else:
                out.append((c, c))
    return ranges


def _classify(pre_tokenizer, chars: list[str]) -> list[str]:
    """'letter' when "a"+c is one piece, 'number' when "1"+c is, 'other' when "!"+c is, 'space'
    when "\\t"+c is (each followed by a character that ends the piece). Exactly one must hold,
    or the pre-tokenizer is not the GPT-2 regex."""
    probes = {
        "letter": _joins(pre_tokenizer, chars, "a", "\x01"),
        "number": _joins(pre_tokenizer, chars, "1", "\x01"),
        "other": _joins(pre_tokenizer, chars, "!", "a"),
        "space": _joins(pre_tokenizer, chars, "\t", "\t\x01"),
    }
    kinds = []
    for i, c in enumerate(chars):
        hits = [k for k, v in probes.items() if v[i]]
        if len(hits) != 1:
            raise UnsupportedTokenizer(f"the pre-tokenizer does not split like the GPT-2 regex around U+{ord(c):04X} "
                                       f"(classes {hits})")
        kinds.append(hits[0])
    return kinds


def _joins(pre_tokenizer, chars: list[str], lead: str, tail: str) -> list[bool]:
    segments = [lead + c + tail for c in chars]
    starts = {a: b for _, (a, b) in pre_tokenizer.pre_tokenize_str("".join(segments))}
    out, pos = [], 0
    for seg in segments:
        out.append(starts.get(pos) == pos + 2)
        pos += len(seg)
    return out


# ------------------------------------------------------------------------------------------
# Chat template and stop ids
# ------------------------------------------------------------------------------------------
# end-of-turn tokens of chat templates: generation also stops at them when the template has one
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")


def _stop_ids(tokenizer, n_ids: int, vocab: dict[str, int] | None = None, chat: dict | None = None) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    template = (chat or {}).get("prefix") or ""
    for marker in END_OF_TURN:
        idx = (vocab or {}).get(marker)
        if idx is not None and marker in template + ((chat or {}).get("suffix") or "") and idx not in ids:
            ids.append(idx)
    for i in ids:
        if not 0 <= i < n_ids:
            raise UnsupportedTokenizer(f"eos_token_id {i} is outside the vocabulary (0..{n_ids - 1})")
    return ids


# ------------------------------------------------------------------------------------------
# Section bodies
# ------------------------------------------------------------------------------------------
def _vocab_section(token_bytes: list[bytes], flags: list[int]) -> bytes:
    offsets, total = [0], 0
    for b in token_bytes:
        total += len(b)
        offsets.append(total)
    return (struct.pack("<II", len(token_bytes), total) + struct.pack(f"<{len(offsets)}I", *offsets)
            + bytes(flags) + b"".join(token_bytes))


def _merges_section(merges: list[tuple[int, int, int]]) -> bytes:
    flat = [x for m in merges for x in m]
    return struct.pack(f"<I{len(flat)}I", len(merges), *flat)


def _added_section(added: list[dict]) -> bytes:
    out = [struct.pack("<I", len(added))]
    for a in added:
        content = a["content"].encode("utf-8")
        flags = (ADDED_SPECIAL if a["special"] else 0) | (ADDED_NORMALIZED if a["normalized"] else 0)
        out.append(struct.pack("<III", a["id"], flags, len(content)) + content)
    return b"".join(out)


def _classes_section(classes: dict[str, list[tuple[int, int]]]) -> bytes:
    lists = [classes["letter"], classes["number"], classes["space"]]
    flat = [x for ranges in lists for r in ranges for x in r]
    return struct.pack(f"<3I{len(flat)}I", *(len(r) for r in lists), *flat)


def _chat_section(chat: dict) -> bytes:
    if chat["prefix"] is None:
        return struct.pack("<III", 0, 0, 0)
    prefix, suffix = chat["prefix"].encode("utf-8"), chat["suffix"].encode("utf-8")
    return struct.pack("<II", 1, len(prefix)) + prefix + struct.pack("<I", len(suffix)) + suffix
