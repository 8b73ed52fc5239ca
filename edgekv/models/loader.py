"""Load a model from a name, a GGUF file or an HF directory into a ``LoadedModel``.

GGUF files are converted once into an HF directory in the user cache (config.json, safetensors
shards, tokenizer); later loads read that copy. For the families whose GGUF tensors map to HF
names with at most llama.cpp's q/k row permutation (``STREAMED_ARCHS``: llama, qwen2) the weights
are dequantised one tensor at a time with ``gguf.quants`` and written shard by shard (a layer per
file), with a progress bar over the bytes and the disk they need checked first: memory stays at one
layer, not the model. The copy is fp32, so it is exactly ``gguf``'s dequantisation (the eager
oracle's weights; bf16 would round Q4_K's d·sc·q). Other families go through transformers'
GGUF loader (the whole model in memory)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from rich.console import Console

from .config import CHAT_TEMPLATES, GGUF_ARCHITECTURES, check_architecture, config_from_hf
from .errors import ModelError
from .gguf_weights import STREAMED_ARCHS, GGUFWeights
from .file_hash import source_sha256
from .loaded import LoadedModel
from .sources import ModelSource, cache_lock, cache_root, resolve

CONVERSION_FORMAT = 1  # bump when the cached copy's layout changes
_OUT_OF_MEMORY = re.compile(r"can't allocate|cannot allocate|out of memory|bad_alloc|ENOMEM|os error 12", re.I)


class ModelMemoryError(ModelError, MemoryError):
    """The model does not fit in the memory left (an allocation failed while loading it)."""


def _gguf_tokenizer_fields(path: Path, reader=None) -> dict:
    import gguf

    reader = reader or gguf.GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception:  # noqa: BLE001 - unreadable metadata is treated as absent
            return default

    return {
        "add_bos": bool(field("tokenizer.ggml.add_bos_token", False)),
        "bos_id": field("tokenizer.ggml.bos_token_id"),
        "eos_id": field("tokenizer.ggml.eos_token_id"),
        "unk_id": field("tokenizer.ggml.unknown_token_id"),
        "pad_id": field("tokenizer.ggml.padding_token_id"),
        "chat_template": field("tokenizer.chat_template"),
        "model": field("tokenizer.ggml.model"),
    }


def _fixed_tokenizer(converted, meta: dict):
    """transformers 5.2 maps a GGUF 'gpt2' tokenizer to CodeLlamaTokenizer, prepends BOS even
    when the file says add_bos_token=False, and takes EOS from BOS. Rebuild a plain fast
    tokenizer from the same tokenizer.json with the special tokens the GGUF declares."""
    from tokenizers import decoders, processors
    from transformers import PreTrainedTokenizerFast

    backend = converted.backend_tokenizer
    if meta["model"] == "gpt2":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        backend.decoder = decoders.ByteLevel()
    elif not meta["add_bos"]:
        backend.post_processor = None

    def token(idx):
        return backend.id_to_token(int(idx)) if idx is not None else None

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token(meta["bos_id"]),
        eos_token=token(meta["eos_id"]),
        unk_token=token(meta["unk_id"]),
        pad_token=token(meta["pad_id"]),
    )
    if meta["chat_template"]:
        tok.chat_template = meta["chat_template"]
    return tok


def _sentencepiece_bpe_tokenizer(path: Path, meta: dict):
    """Gemma's GGUF tokenizer ('llama' model, SentencePiece BPE: a piece's score is its merge rank):
    transformers 5.2 turns it into a Unigram over those scores, which cuts words into pieces
    ("▁capital" → "▁c", "ap", "it", "al") and drops the BOS. Rebuilt here as the BPE it is: a merge
    for every split of a piece into two pieces, ranked by the merged piece's score; control and
    user-defined pieces (<start_of_turn>, runs of newlines) are whole tokens; bytes fall back."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(path))
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    scores = [float(x) for x in reader.fields["tokenizer.ggml.scores"].contents()]
    kinds_field = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(kinds_field.parts[i][0]) for i in kinds_field.data]
    normal, control, user_defined = 1, 3, 4
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, k in zip(tokens, kinds) if k == normal}
    merges = []
    for piece, score, kind in zip(tokens, scores, kinds):
        if kind != normal:
            continue
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in mergeable and piece[i:] in mergeable]
        merges.extend((score, vocab[a], vocab[b], a, b) for a, b in splits)
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], byte_fallback=True,
                     unk_token=tokens[meta["unk_id"]] if meta["unk_id"] is not None else None, fuse_unk=True)
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, kinds) if k == control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, kinds) if k == user_defined])
    if meta["add_bos"] and meta["bos_id"] is not None:
        bos = tokens[meta["bos_id"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta["bos_id"])])

    def token(idx):
        return tokens[int(idx)] if idx is not None else None

    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=token(meta["bos_id"]),
                                   eos_token=token(meta["eos_id"]), unk_token=token(meta["unk_id"]),
                                   pad_token=token(meta["pad_id"]))


def quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def check_gguf(path: Path):
    """Refuse a truncated or corrupt GGUF before converting it (transformers' own errors do not
    say so): the header must parse and every tensor's data must lie inside the file. Returns the
    file's ``gguf.GGUFReader`` (reading the header of a 151K-token vocabulary takes tens of seconds:
    read it once)."""
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # noqa: BLE001 - gguf raises many kinds for a damaged header
        raise ModelError(f"'{path}' is truncated or corrupt: its GGUF header cannot be read ({type(exc).__name__}: "
                         f"{exc}); download the file again") from None
    if end > size:
        raise ModelError(f"'{path}' is truncated or corrupt: its tensors need {end:,} bytes but the file has "
                         f"{size:,}; download the file again")
    return reader


def check_gguf_architecture(path: Path, reader=None) -> None:
    """Refuse a GGUF whose architecture edgekv cannot run from its metadata alone (no conversion:
    converting first would take minutes before the same refusal)."""
    import gguf

    try:
        arch = str((reader or gguf.GGUFReader(str(path))).fields["general.architecture"].contents())
    except KeyError:
        raise ModelError(f"'{path}' names no general.architecture in its GGUF metadata; it is not a model file "
                         "edgekv can read") from None
    except Exception:  # noqa: BLE001 - a damaged header: check_gguf says so with the details
        return
    check_architecture(GGUF_ARCHITECTURES.get(arch, arch), f"'{path.name}': GGUF architecture '{arch}'")


def _status(console: Console, msg: str):
    """A spinner on a terminal; one line otherwise (output redirected)."""
    if not console.is_terminal:
        console.print(f"edgekv: {msg}", highlight=False)
    return console.status(msg)


def _gguf_arch(reader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else "?"


def _shards(names: list[str]) -> list[tuple[str, list[str]]]:
    """HF tensor names grouped into shard files: one per decoder layer, the embedding and the LM
    head alone (the two largest tensors), the rest together."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        key = f"layer{int(m.group(1)):03d}" if m else ("embed" if "embed_tokens" in name else
                                                      "lm_head" if name.startswith("lm_head") else "other")
        groups.setdefault(key, []).append(name)
    return sorted(groups.items())


def check_disk_for(dest: Path, need: int, what: str) -> None:
    """Refuse before writing when ``dest``'s disk has less than ``need`` bytes free."""
    probe = dest
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ModelError(f"not enough disk for {what} in {dest.parent}: it needs {need:,} bytes, {free:,} are free; "
                         "free some space, or point EDGEKV_CACHE at a larger disk")


@contextlib.contextmanager
def _staged_dir(dest: Path):
    """A fresh folder beside ``dest`` that replaces it only when the block completes: an
    interrupted conversion never leaves a half-written copy under the cache's name. The swap is two
    renames (the old copy aside under a unique name, the new one in), never a delete at the
    cache's name, so another process that finishes the same conversion at the same moment cannot
    make this one's rename fail; ``sources.cache_lock`` keeps two from converting at all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        yield tmp
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=dest.name + ".old.", dir=dest.parent))
            dest.replace(old / "copy")
        tmp.replace(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_conversion_meta(tmp: Path, path: Path, model_type: str) -> None:
    """edgekv.json: which file the copy came from (and its sha256), so a changed source is converted again."""
    meta = {"source": str(path), "source_sha256": source_sha256(path), "model_type": model_type,
            "format": CONVERSION_FORMAT}
    (tmp / "edgekv.json").write_text(json.dumps(meta, indent=2))


def gguf_config_and_tokenizer(path: Path, console: Console, reader=None):
    """(HF config, tokenizer) of a GGUF, read through transformers (the tokenizer fixed as
    ``_fixed_tokenizer`` says); unsupported architectures are refused here, before any work."""
    from transformers import AutoConfig, AutoTokenizer

    with _status(console, f"reading {path.name}'s config and tokenizer…"), \
            contextlib.redirect_stderr(io.StringIO()):
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        config_from_hf(hf_config)  # refuse unsupported architectures before writing
        converted_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf_config, _fixed_tokenizer(converted_tok, _gguf_tokenizer_fields(path, reader))


def convert_gguf_streamed(path: Path, dest: Path, console: Console, reader=None, arch: str = "llama") -> None:
    """Dequantise a GGUF tensor by tensor (``gguf_weights.GGUFWeights``) into fp32 safetensors shards
    at ``dest`` (written under a temporary name, renamed when complete), with a progress bar."""
    import gguf
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeElapsedColumn, TimeRemainingColumn
    from safetensors.torch import save_file

    reader = reader or gguf.GGUFReader(str(path))
    hf_config, tokenizer = gguf_config_and_tokenizer(path, console, reader)
    weights = GGUFWeights(path, reader, hf_config, arch)
    total = weights.fp32_bytes
    check_disk_for(dest, total, f"the fp32 copy of {path.name}")
    with _staged_dir(dest) as tmp:
        console.print(f"edgekv: converting {path.name} once to an fp32 safetensors copy ({total / 2**30:.1f} GiB) in "
                      f"{dest.parent} (`edgekv cache --clear` deletes it)", highlight=False, soft_wrap=True)
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=console, transient=True) as progress:
            task = progress.add_task("dequantising", total=total)
            shards = _shards(list(weights))
            for i, (group, members) in enumerate(shards):
                progress.update(task, description=f"dequantising {group} ({i + 1}/{len(shards)})")
                state = {}
                for hf_name in members:
                    state[hf_name] = weights[hf_name]
                    progress.advance(task, 4 * state[hf_name].numel())
                save_file(state, str(tmp / f"model-{group}.safetensors"), metadata={"format": "pt"})
                del state
        hf_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _write_conversion_meta(tmp, path, hf_config.model_type)


def load_gguf_lazy(path: Path, model_id: str, chat: bool, console: Console, reader=None) -> LoadedModel:
    """A GGUF of a ``STREAMED_ARCHS`` family as a ``LoadedModel`` whose weights are dequantised on
    access (``GGUFWeights``): no fp32 copy on disk or in memory — what a compile needs, since it keeps
    the file's blocks and re-stores only a few tensors. Config and tokenizer are read from the file."""
    reader = reader or check_gguf(path)
    quiet_transformers()
    hf_config, tokenizer = gguf_config_and_tokenizer(path, console, reader)
    weights = GGUFWeights(path, reader, hf_config, _gguf_arch(reader))
    if not getattr(tokenizer, "chat_template", None) and hf_config.model_type in CHAT_TEMPLATES:
        tokenizer.chat_template = CHAT_TEMPLATES[hf_config.model_type]
    return LoadedModel(model_id=model_id, config=config_from_hf(hf_config), hf_config=hf_config, weights=weights,
                       tokenizer=tokenizer, chat=chat or bool(getattr(tokenizer, "chat_template", None)), source=path,
                       known_weight_hash=source_sha256(path))


def convert_gguf(path: Path, dest: Path, console: Console) -> None:
    """Convert a GGUF to an HF directory at ``dest`` atomically: streamed tensor by tensor for
    ``STREAMED_ARCHS``, else through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file

    reader = check_gguf(path)
    quiet_transformers()
    arch = _gguf_arch(reader)
    if arch in STREAMED_ARCHS:
        return convert_gguf_streamed(path, dest, console, reader, arch)
    with _staged_dir(dest) as tmp:
        with _status(console, f"converting {path.name} once to a cached safetensors copy in {dest.parent} "
                              "(through transformers, no progress to show; `edgekv cache --clear` deletes it)…"):
            with contextlib.redirect_stderr(io.StringIO()):
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
                converted_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model_type = model.config.model_type
            config_from_hf(model.config)  # refuse unsupported architectures before writing
            state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            if model.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            model.config.save_pretrained(str(tmp))
            tok_meta = _gguf_tokenizer_fields(path)
            if model_type == "gemma3_text" and tok_meta["model"] == "llama":
                _sentencepiece_bpe_tokenizer(path, tok_meta).save_pretrained(str(tmp))
            else:
                _fixed_tokenizer(converted_tok, tok_meta).save_pretrained(str(tmp))
            _write_conversion_meta(tmp, path, model_type)


def cached_conversions() -> list[dict]:
    """The converted copies in the cache: path, the source they came from, its sha256, bytes."""
    out = []
    root = cache_root() / "converted"
    for d in sorted(root.glob("*")) if root.is_dir() else []:
        meta_file = d / "edgekv.json"
        if not d.is_dir() or not meta_file.is_file():
            continue
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            meta = {}
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        out.append({"path": d, "source": meta.get("source", "?"), "sha256": meta.get("source_sha256"),
                    "format": meta.get("format"), "bytes": size})
    return out


def converted_dir(path: Path) -> Path:
    """The cached conversion of a GGUF, keyed by the file's content (not its path or mtime): the
    same model reached through two paths (the installed wheel, the fetched copy) is converted and
    stored once. An earlier copy of the same content under another name is reused."""
    digest = source_sha256(path)
    for entry in cached_conversions():
        if entry["sha256"] == digest and entry["format"] == CONVERSION_FORMAT:
            return entry["path"]
    return cache_root() / "converted" / f"{path.stem}-{digest[:12]}-v{CONVERSION_FORMAT}"


def load_hf_dir(path: Path, model_id: str, chat: bool = False, source: Path | None = None) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    quiet_transformers()
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path / 'config.json'}: {exc}") from None
    config = config_from_hf(hf_config)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            weights.update({k: v.float() for k, v in load_file(str(file)).items()})
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            if isinstance(exc, MemoryError) or _OUT_OF_MEMORY.search(str(exc)):
                raise ModelMemoryError(f"not enough memory to load the weights {file} ({file.stat().st_size:,} "
                                       f"bytes on disk, held as float32): {exc}") from None
            raise ModelError(f"cannot read weights {file}: {exc}; the file is damaged or not safetensors") from None
    if "model.embed_tokens.weight" not in weights:
        raise ModelError(f"{path} holds no 'model.embed_tokens.weight': not a Llama-family checkpoint")
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if not getattr(tokenizer, "chat_template", None) and config.model_type in CHAT_TEMPLATES:
            tokenizer.chat_template = CHAT_TEMPLATES[config.model_type]  # the family's (Gemma's GGUF has none)
    meta_file = path / "edgekv.json"
    known_hash = json.loads(meta_file.read_text()).get("source_sha256") if meta_file.is_file() else None
    return LoadedModel(
        model_id=model_id, config=config, hf_config=hf_config, weights=weights, tokenizer=tokenizer,
        chat=chat or bool(getattr(tokenizer, "chat_template", None)), source=source or path,
        known_weight_hash=known_hash,
    )


def load_model(name_or_path: str | os.PathLike | None = None, console: Console | None = None, *,
               lazy: bool = False) -> LoadedModel:
    """Load by known name (``smollm2-135m``), GGUF file, or HF directory. ``lazy``: a GGUF of a
    ``STREAMED_ARCHS`` family keeps its weights in the file (``load_gguf_lazy``; for compiles)
    instead of the cached fp32 copy (converted on first use; for the eager engine)."""
    console = console or Console(stderr=True)
    src: ModelSource = resolve(name_or_path, console)
    if src.kind == "hf":
        return load_hf_dir(src.path, src.model_id, src.chat)
    if lazy:  # the header is read once (a 151K-token vocabulary takes ~15 s of CPU per read)
        reader = check_gguf(src.path)
        check_gguf_architecture(src.path, reader)
        if _gguf_arch(reader) in STREAMED_ARCHS:
            return load_gguf_lazy(src.path, src.model_id, src.chat, console, reader)
    check_gguf_architecture(src.path)
    cached = converted_dir(src.path)
    ensure_converted(src.path, cached, console)
    return load_hf_dir(cached, src.model_id, src.chat, source=src.path)


def ensure_converted(path: Path, cached: Path, console: Console) -> None:
    """The GGUF's cached copy at ``cached``, converted now unless it is there; under
    ``sources.cache_lock``, so of several processes asking at once one converts and the rest read."""
    if (cached / "edgekv.json").is_file():
        return
    with cache_lock(cached):
        if (cached / "edgekv.json").is_file():  # made by another process while this one waited
            return
        try:
            convert_gguf(path, cached, console)
        except ModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad GGUF
            raise ModelError(f"cannot load GGUF '{path}': {exc}") from None
