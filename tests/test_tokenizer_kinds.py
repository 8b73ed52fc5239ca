"""tokenizer.ekt's Qwen2 and Unigram kinds (edgekv/compiler/backend/tokenizer_kinds.py) through the
native runtime's C tokenizer (runtime/src/tokenizer.c, tokenizer_normalize.c, tokenizer_unigram.c)
via its ctypes binding, against HF tokenizers on the generated corpus (tools/tokenizer_corpus.py,
2,400 lines of code, scripts, combining marks, emoji, whitespace runs, numbers, contractions,
control characters).

Default suite: small tokenizers trained here with the same normalizer / pre-tokenizer / model
configuration as Qwen2 (NFC, Qwen2's split regex, byte-level BPE, ChatML) and Gemma 3 (Replace(" ",
"▁"), Unigram with byte fallback, Gemma's turn template), plus the same corpus under
AddressSanitizer. -m slow: the real tokenizers of the Qwen2.5-Coder-1.5B and Gemma 3 270M GGUFs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgekv.compiler.backend.tokenizer_file import UnsupportedTokenizer, build_tokenizer_file, write_tokenizer_file
from edgekv.compiler.backend.tokenizer_kinds import QWEN2_SPLIT_PATTERN

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from tokenizer_corpus import corpus_lines  # noqa: E402

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA_TURNS = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == "
               "'assistant' else message['role']) + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
MODELS = Path(os.environ.get("EDGEKV_MODELS_DIR", "/work/wt/models"))


@pytest.fixture(scope="session")
def native_lib():
    from edgekv.runtime.native import NativeRuntimeMissing, load_library

    try:
        return load_library()
    except NativeRuntimeMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    lines = corpus_lines()
    assert len(lines) >= 2000
    return lines


def _training_text() -> list[str]:
    return corpus_lines(1500, seed=7)


def toy_qwen2():
    """Qwen2's pipeline as transformers' Qwen2Converter builds it, on a 3,000-token BPE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    from edgekv.compiler.backend.tokenizer_file import byte_to_char

    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=3000, show_progress=False, initial_alphabet=list(byte_to_char().values()))
    tk.train_from_iterator(_training_text(), trainer)
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def toy_unigram():
    """Gemma 3's pipeline as transformers builds it from the GGUF, on a small Unigram with the 256
    <0xXX> byte-fallback pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.Unigram())
    base.normalizer = normalizers.Replace(" ", "\u2581")
    # trained without CJK and rare scripts, which then reach the <0xXX> byte fallback
    text = [line for line in _training_text() if all(ord(c) < 0x0600 for c in line)]
    base.train_from_iterator(text, trainers.UnigramTrainer(vocab_size=2500, show_progress=False,
                                                                       special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                                                       unk_token="<unk>"))
    pieces = json.loads(base.to_str())["model"]["vocab"]
    have = {p for p, _ in pieces}
    pieces += [[f"<0x{b:02X}>", 0.0] for b in range(256) if f"<0x{b:02X}>" not in have]
    pieces += [["<start_of_turn>", 0.0], ["<end_of_turn>", 0.0], ["\u2581\u2581", -3.0]]
    tk = Tokenizer(models.Unigram([(p, s) for p, s in pieces], unk_id=3, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<pad>", "<eos>", "<bos>", "<unk>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                  pad_token="<pad>")
    tok.chat_template = GEMMA_TURNS
    return tok


def toy_sentencepiece_bpe():
    """Gemma 3's tokenizer as edgekv's conversion rebuilds it from the GGUF (``_sentencepiece_bpe_tokenizer``):
    a BPE over characters with the 256 <0xXX> byte-fallback pieces, Replace(" ", "▁"), no pre-tokenizer,
    control tokens and a user-defined run of newlines whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Replace(" ", "\u2581")
    # trained without CJK and rare scripts, which then reach the <0xXX> byte fallback
    text = [line for line in _training_text() if all(ord(c) < 0x0600 for c in line)]
    base.train_from_iterator(text, trainers.BpeTrainer(vocab_size=2500, show_progress=False,
                                                       special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]))
    trained = json.loads(base.to_str())["model"]
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    for t in ("<start_of_turn>", "<end_of_turn>", "\n\n"):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")])
    tk.add_tokens([AddedToken("\n\n", normalized=False, special=False)])
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                      special_tokens=[("<bos>", vocab["<bos>"])])  # Gemma's add_bos
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                  pad_token="<pad>")
    tok.chat_template = GEMMA_TURNS
    return tok


TOYS = {"qwen2": (toy_qwen2, "1.1"), "unigram": (toy_unigram, "1.1"), "sentencepiece_bpe": (toy_sentencepiece_bpe, "1.2")}


@pytest.fixture(scope="session", params=list(TOYS))
def toy(request, native_lib, tmp_path_factory):
    from edgekv.runtime.native_tokenizer import NativeTokenizer

    make, version = TOYS[request.param]
    hf = make()
    path = tmp_path_factory.mktemp("ekt") / f"{request.param}.ekt"
    info = write_tokenizer_file(hf, path)
    assert info["kind"] == request.param and info["format_version"] == version
    return hf, NativeTokenizer(path), path, request.param


def _mismatches(hf, native, lines):
    """Lines whose native ids differ from HF's: a plain whole prompt (BOS first where the tokenizer
    puts it there, BOSP)."""
    bad = []
    for line in lines:
        want, got = hf(line)["input_ids"], list(native.encode_part(line, chat=False, part="whole"))
        if want != got:
            bad.append((line[:80], want[:20], got[:20]))
    return bad


def test_toy_ids_equal_hf_on_the_corpus(toy, corpus):
    hf, native, _, kind = toy
    assert _mismatches(hf, native, corpus) == []
    whole = "\n".join(corpus)
    assert list(native.encode_part(whole, chat=False, part="whole")) == hf(whole)["input_ids"]
    assert list(native.encode(whole)) == hf(whole, add_special_tokens=False)["input_ids"]


def test_toy_corpus_exercises_the_odd_paths(toy, corpus):
    """the corpus reaches what the kind's C code special-cases, so the equality above means something"""
    import unicodedata

    hf, _, _, kind = toy
    text = "\n".join(corpus)
    assert unicodedata.normalize("NFC", text) != text  # NFC composes and reorders something
    if kind in ("unigram", "sentencepiece_bpe"):
        ids = hf(text)["input_ids"]
        byte_ids = {hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
        assert sum(i in byte_ids for i in ids) > 100  # byte fallback is used
    else:
        assert any(c in text for c in ("'ſ", "'LL", "'RE"))


def test_toy_chat_template_matches_hf(toy):
    hf, native, _, kind = toy
    for text in ["Hi there", "  spaced  \n", "猫 😀 it's"]:
        want = hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        assert list(native.encode_chat(text)) == hf(want, add_special_tokens=False)["input_ids"]
    stops = native.stop_ids()
    assert hf.eos_token_id in stops
    if kind in ("unigram", "sentencepiece_bpe"):  # Gemma's turn ends at <end_of_turn>
        assert hf.convert_tokens_to_ids("<end_of_turn>") in stops


def test_unsupported_kinds_are_refused_by_name():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from edgekv.compiler.backend.artifact_writer import check_native_tokenizer

    tk = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(UnsupportedTokenizer, match="WordPiece.*supported kinds|supported kinds"):
        check_native_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tk))
    qwen = toy_qwen2()
    qwen.backend_tokenizer.normalizer = normalizers.NFKC()
    with pytest.raises(UnsupportedTokenizer, match="NFKC"):
        build_tokenizer_file(qwen)
    uni = toy_unigram()
    uni.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(UnsupportedTokenizer, match="Lowercase.*Unigram"):
        check_native_tokenizer(uni)
    sp = toy_sentencepiece_bpe()
    sp.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(UnsupportedTokenizer, match="pre-tokenizer Whitespace is not supported with a BPE with byte "
                                                   "fallback"):
        check_native_tokenizer(sp)


# ------------------------------------------------------------------------------------------
# The same corpus through an AddressSanitizer build of the runtime library
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def asan_library(tmp_path_factory):
    if shutil.which("cmake") is None or shutil.which("cc") is None:
        pytest.skip("cmake and a C compiler are needed for the AddressSanitizer build (apt-get install cmake gcc)")
    libasan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not Path(libasan).is_file():
        pytest.skip("libasan is not installed (apt-get install libasan8)")
    build = tmp_path_factory.mktemp("asan-tok")
    ffi = subprocess.run([sys.executable, "-c", "import tvm_ffi.libinfo as l; print(l.find_include_path())"],
                         capture_output=True, text=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run(["cmake", "-S", str(ROOT / "runtime"), "-B", str(build), *gen, "-DEDGEKV_ASAN=ON",
                          "-DCMAKE_BUILD_TYPE=Debug", f"-DEDGEKV_TVM_FFI_INCLUDE={ffi.stdout.strip()}"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stderr
    made = subprocess.run(["cmake", "--build", str(build), "-j", "2", "--target", "edgekv_runtime"],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return build / "libedgekv_runtime.so", libasan


ASAN_SCRIPT = r"""
import json, sys
from edgekv.runtime.native_tokenizer import NativeTokenizer
path, lines_file, want_file = sys.argv[1:4]
lines = json.load(open(lines_file)); want = json.load(open(want_file))
tok = NativeTokenizer(path)
whole = lambda text: list(tok.encode_part(text, chat=False, part="whole"))
bad = sum(whole(l) != w for l, w in zip(lines, want))
bad += whole("\n".join(lines)) != want[-1]
tok.encode_bytes(b"\xff\xfe bad \xe2\x96 utf8 \xcc\x81\xf0\x9f")  # ill-formed input must not fault
print("mismatches", bad)
sys.exit(1 if bad else 0)
"""


def test_toy_corpus_is_clean_under_asan(toy, corpus, asan_library, tmp_path):
    hf, _, path, kind = toy
    lib, libasan = asan_library
    (tmp_path / "lines.json").write_text(json.dumps(corpus))
    want = [hf(line)["input_ids"] for line in corpus] + [hf("\n".join(corpus))["input_ids"]]
    (tmp_path / "want.json").write_text(json.dumps(want))
    env = {**os.environ, "EDGEKV_RUNTIME_LIB": str(lib), "LD_PRELOAD": libasan,
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=23"}
    res = subprocess.run([sys.executable, "-c", ASAN_SCRIPT, str(path), str(tmp_path / "lines.json"),
                          str(tmp_path / "want.json")], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "mismatches 0" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


# ------------------------------------------------------------------------------------------
# The real models (-m slow): the GGUFs' tokenizer metadata, not the converted models
# ------------------------------------------------------------------------------------------
def _gguf_tokenizer(name: str):
    from transformers import AutoTokenizer

    from edgekv.models.loader import _fixed_tokenizer, _gguf_tokenizer_fields, quiet_transformers

    path = MODELS / name
    if not path.is_file():
        pytest.skip(f"{path} is not here (set EDGEKV_MODELS_DIR to the folder holding it)")
    quiet_transformers()
    # the tokenizer alone: transformers reads the GGUF's tokenizer.* metadata, no weights
    return _fixed_tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
                            _gguf_tokenizer_fields(path))


@pytest.mark.slow
def test_real_gemma_tokenizer_as_edgekv_rebuilds_it_equals_hf(native_lib, corpus, tmp_path):
    """Gemma 3 270M's tokenizer as the conversion rebuilds it (SentencePiece BPE, what `edgekv run`
    encodes with) in the native runtime: ids equal to HF's on the corpus, and Gemma's turn template."""
    from edgekv.models.loader import _gguf_tokenizer_fields, _sentencepiece_bpe_tokenizer
    from edgekv.models.config import GEMMA_CHAT_TEMPLATE
    from edgekv.runtime.native_tokenizer import NativeTokenizer

    path = MODELS / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is not here (set EDGEKV_MODELS_DIR to the folder holding it)")
    hf = _sentencepiece_bpe_tokenizer(path, _gguf_tokenizer_fields(path))
    hf.chat_template = GEMMA_CHAT_TEMPLATE
    info = write_tokenizer_file(hf, tmp_path / "tokenizer.ekt")
    assert info["kind"] == "sentencepiece_bpe"
    assert info["bos_prefix"] == hf.bos_token_id == 2  # a plain prompt starts with <bos>, as HF's
    native = NativeTokenizer(tmp_path / "tokenizer.ekt")
    assert _mismatches(hf, native, corpus) == []
    whole = "\n".join(corpus)
    assert list(native.encode_part(whole, chat=False, part="whole")) == hf(whole)["input_ids"]
    assert list(native.encode(whole)) == hf(whole, add_special_tokens=False)["input_ids"]
    want = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert list(native.encode_chat("Hi")) == hf(want, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("name,kind", [("qwen2.5-coder-1.5b-q4_k_m.gguf", "qwen2"),
                                       ("gemma-3-270m-q4_k_m.gguf", "unigram")])
def test_real_tokenizer_ids_equal_hf(name, kind, native_lib, corpus, tmp_path):
    from edgekv.runtime.native_tokenizer import NativeTokenizer

    hf = _gguf_tokenizer(name)
    info = write_tokenizer_file(hf, tmp_path / "tokenizer.ekt")
    assert info["kind"] == kind
    native = NativeTokenizer(tmp_path / "tokenizer.ekt")
    assert _mismatches(hf, native, corpus) == []
    whole = "\n".join(corpus)
    assert list(native.encode(whole)) == hf(whole)["input_ids"]
    if kind == "qwen2":  # ChatML, and generation stops at <|im_end|>
        want = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
        assert list(native.encode_chat("Hi")) == hf(want, add_special_tokens=False)["input_ids"]
        assert native.stop_ids() == [151645]
