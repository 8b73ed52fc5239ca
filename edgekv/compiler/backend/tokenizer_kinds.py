"""Which tokenizer a tokenizer.json is, for ``tokenizer.ekt``: the native runtime implements three
kinds, told apart by the model and the pre-tokenizer (``tokenizer_file.py`` writes them):

    gpt2     byte-level BPE, ByteLevel's own GPT-2 regex, no normalizer (SmolLM2)
    qwen2    byte-level BPE, Split(Qwen2's regex, isolated) then ByteLevel(use_regex=False),
             NFC or no normalizer (Qwen2 / Qwen2.5, as transformers' Qwen2Converter builds it)
    unigram  SentencePiece Unigram with byte fallback, Replace(" ", "▁"), no effective
             pre-tokenizer (Gemma 3, as transformers builds it from the GGUF)
    sentencepiece_bpe
             SentencePiece BPE: a BPE over characters with byte fallback, Replace(" ", "▁"), no
             pre-tokenizer (Gemma 3's GGUF tokenizer as edgekv's conversion rebuilds it,
             ``models/loader.py``'s ``_sentencepiece_bpe_tokenizer``)

Anything else is refused with ``UnsupportedTokenizer`` naming the part that differs and the kinds
that are supported, so an artifact never silently lacks its native tokenizer."""

from __future__ import annotations

class UnsupportedTokenizer(ValueError):
    """The tokenizer does something the native runtime does not reproduce."""


KIND_GPT2 = "gpt2"
KIND_QWEN2 = "qwen2"
KIND_UNIGRAM = "unigram"
KIND_SP_BPE = "sentencepiece_bpe"
SUPPORTED = ("gpt2 (byte-level BPE with ByteLevel's regex, e.g. SmolLM2), qwen2 (byte-level BPE with Qwen2's split "
             "regex and NFC), unigram (SentencePiece Unigram with byte fallback, e.g. Gemma 3 as transformers reads "
             "it), sentencepiece_bpe (BPE over characters with byte fallback and Replace(' ', '▁'), e.g. Gemma 3 as "
             "edgekv rebuilds it)")

# transformers' Qwen2Converter (convert_slow_tokenizer.py) and Qwen2's own tokenizer.json
QWEN2_SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                       r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def tokenizer_kind(spec: dict) -> str:
    """The kind of a tokenizer.json (parsed), after checking that every part of its pipeline is
    one the native runtime reproduces; raises UnsupportedTokenizer (a ValueError) otherwise."""
    model = spec.get("model") or {}
    if model.get("type") == "Unigram":
        _check_unigram(spec, UnsupportedTokenizer, _describe)
        return KIND_UNIGRAM
    # byte_fallback only matters without a ByteLevel step: a byte-level BPE (SmolLM2's tokenizer as
    # transformers converts it from the GGUF sets the flag) has every byte in its vocabulary already
    if model.get("type") == "BPE" and model.get("byte_fallback") and not _has_byte_level(spec.get("pre_tokenizer")):
        _check_sentencepiece_bpe(spec)
        return KIND_SP_BPE
    if model.get("type") == "BPE" and _is_qwen2_pre_tokenizer(spec.get("pre_tokenizer")):
        normalizer = spec.get("normalizer")
        if normalizer is not None and normalizer.get("type") != "NFC":
            raise UnsupportedTokenizer(f"normalizer {_describe(normalizer)} is not supported with Qwen2's split (the "
                                       f"native runtime applies NFC or none); supported kinds: {SUPPORTED}")
        check_gpt2_pipeline({**spec, "normalizer": None, "pre_tokenizer": {"type": "ByteLevel",
                                                                           "add_prefix_space": False}})
        return KIND_QWEN2
    try:
        check_gpt2_pipeline(spec)
    except UnsupportedTokenizer as exc:
        raise UnsupportedTokenizer(f"{exc}; supported kinds: {SUPPORTED}") from None
    return KIND_GPT2


def _has_byte_level(pre) -> bool:
    """A ByteLevel pre-tokenizer, alone or inside a Sequence."""
    if not pre:
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre.get("pretokenizers") or [])
    return pre.get("type") == "ByteLevel"


def _is_qwen2_pre_tokenizer(pre) -> bool:
    if pre is None or pre.get("type") != "Sequence" or len(pre.get("pretokenizers") or []) != 2:
        return False
    split, byte_level = pre["pretokenizers"]
    return (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") == QWEN2_SPLIT_PATTERN
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
            and byte_level.get("use_regex") is False)


def _check_unigram(spec: dict, error, describe) -> None:
    model = spec["model"]
    if not model.get("byte_fallback"):
        raise error("a Unigram model without byte_fallback is not supported (the native runtime implements "
                    f"SentencePiece's byte fallback); supported kinds: {SUPPORTED}")
    normalizer = spec.get("normalizer")
    if not (normalizer is not None and normalizer.get("type") == "Replace"
            and normalizer.get("pattern") == {"String": " "} and normalizer.get("content") == "\u2581"):
        raise error(f"normalizer {describe(normalizer)} is not supported with a Unigram model (the native runtime "
                    f"applies Replace(' ', '▁')); supported kinds: {SUPPORTED}")
    pre = spec.get("pre_tokenizer")
    # Split on " " after " " became "▁" splits nothing (transformers' Gemma converter installs it)
    if pre is not None and not (pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}):
        raise error(f"pre-tokenizer {describe(pre)} is not supported with a Unigram model (the native runtime "
                    f"encodes each span whole); supported kinds: {SUPPORTED}")
    decoder = spec.get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders") or []]
    if kinds[:3] != ["Replace", "ByteFallback", "Fuse"] or any(k != "Strip" for k in kinds[3:]):
        raise error(f"decoder {describe(decoder)} is not supported with a Unigram model (only Replace('▁', ' '), "
                    "ByteFallback, Fuse)")
    post = spec.get("post_processor")
    if post is not None and not (post.get("type") == "TemplateProcessing"
                                 and all("Sequence" in p for p in post.get("single", []))):
        raise error(f"post-processor {describe(post)} adds tokens around the text; the native runtime encodes the "
                    "text only")


def _check_sentencepiece_bpe(spec: dict) -> None:
    """A BPE with byte fallback: SentencePiece's, as Gemma 3's GGUF tokenizer is rebuilt — characters
    merged by rank, no pre-tokenizer, spaces as "▁"; its decoder and post-processor as the Unigram's."""
    model = spec["model"]
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges"):
        if model.get(key):
            raise UnsupportedTokenizer(f"BPE setting {key}={model[key]!r} is not supported by the native runtime; "
                                       f"supported kinds: {SUPPORTED}")
    pre = spec.get("pre_tokenizer")
    if pre is not None:
        raise UnsupportedTokenizer(f"pre-tokenizer {_describe(pre)} is not supported with a BPE with byte fallback "
                                   f"(the native runtime merges each span whole); supported kinds: {SUPPORTED}")
    # the normalizer, decoder and post-processor checks are the Unigram kind's (one SentencePiece text form);
    # a post-processor that puts BOS before a prompt is the file's BOSP (``bos_prefix``)
    post = None if bos_prefix(spec) is not None else spec.get("post_processor")
    _check_unigram({**spec, "model": {"byte_fallback": True}, "pre_tokenizer": None, "post_processor": post},
                   lambda msg: UnsupportedTokenizer(msg.replace("a Unigram model", "a BPE with byte fallback")),
                   _describe)


def bos_prefix(spec: dict) -> str | None:
    """The token a TemplateProcessing post-processor puts before the text and nothing else ("<bos> $A",
    Gemma's add_bos), else None."""
    post = spec.get("post_processor") or {}
    single = post.get("single") or []
    if post.get("type") != "TemplateProcessing" or len(single) != 2:
        return None
    first, text = single
    if "SpecialToken" not in first or "Sequence" not in text:
        return None
    return first["SpecialToken"].get("id")


def check_gpt2_pipeline(spec: dict) -> None:
    """The GPT-2 byte-level kind (SmolLM2's): everything but the pipeline's kind is checked here."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedTokenizer(f"model {model.get('type')!r} is not supported (only byte-level BPE)")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges"):
        if model.get(key):
            raise UnsupportedTokenizer(f"BPE setting {key}={model[key]!r} is not supported by the native runtime")
    normalizer = spec.get("normalizer")
    if normalizer is not None and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        raise UnsupportedTokenizer(f"normalizer {_describe(normalizer)} is not supported (the native runtime "
                                   "applies none)")
    pre = spec.get("pre_tokenizer")
    if pre is not None and pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 1:
        pre = pre["pretokenizers"][0]
    if pre is None or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        raise UnsupportedTokenizer(f"pre-tokenizer {_describe(pre)} is not supported (the native runtime splits "
                                   "with ByteLevel(add_prefix_space=False, use_regex=True), the GPT-2 regex)")
    decoder = spec.get("decoder")
    if decoder is None or decoder.get("type") != "ByteLevel":
        raise UnsupportedTokenizer(f"decoder {_describe(decoder)} is not supported (only ByteLevel)")
    post = spec.get("post_processor")
    processors = (post.get("processors") or []) if post is not None and post.get("type") == "Sequence" else [post]
    for proc in processors:
        if proc is not None and not _adds_nothing(proc):
            raise UnsupportedTokenizer(f"post-processor {_describe(proc)} adds tokens around the text; the native "
                                       "runtime encodes the text only")


def _adds_nothing(processor: dict) -> bool:
    """ByteLevel (offsets only), or a template that is the text alone (transformers 5 installs
    TemplateProcessing("$A") on tokenizers without BOS/EOS)."""
    if processor.get("type") == "ByteLevel":
        return True
    return processor.get("type") == "TemplateProcessing" and all("Sequence" in p for p in processor.get("single", []))


def _describe(component) -> str:
    if component is None:
        return "None"
    kind = component.get("type", "?")
    inner = component.get("normalizers") or component.get("pretokenizers") or component.get("processors")
    if inner:
        return f"{kind}[{', '.join(_describe(c) for c in inner)}]"
    if kind == "Split":
        pattern = component.get("pattern", {})
        return f"Split({next(iter(pattern.values()), '?')!r})"
    details = {k: v for k, v in component.items() if k != "type" and not isinstance(v, (dict, list))}
    return f"{kind}({', '.join(f'{k}={v!r}' for k, v in details.items())})" if details else kind
