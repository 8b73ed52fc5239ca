"""What ``edgekv simulate`` runs: a MODEL (eager engine) or an ARTIFACT directory, described
without loading the weights in the parent (geometry, weight bytes, tokenizer), and a spec
string the child process rebuilds the model from.

Specs: a known name (``smollm2-135m``), a GGUF file or HF directory (as ``edgekv run``), or
``tiny:SEED[:key=value,...]`` — a tiny random model built by ``tiny_random_model`` (tests);
its "tokenizer" maps text to UTF-8 bytes (vocab ≥ 256)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..artifact.errors import ArtifactError
from ..artifact.manifest import MANIFEST, Keys, Manifest
from ..models.config import ModelConfig
from ..models.errors import ModelError


class ByteTokenizer:
    """Text → UTF-8 bytes, for tiny test models (vocab ≥ 256)."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def parse_tiny(spec: str) -> dict:
    parts = spec.split(":", 2)
    try:
        kw: dict[str, Any] = {"seed": int(parts[1]) if len(parts) > 1 and parts[1] else 0}
        if len(parts) > 2 and parts[2]:
            for item in parts[2].split(","):
                k, v = item.split("=", 1)
                kw[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    except ValueError:
        raise ModelError(f"cannot read tiny model spec {spec!r}; write tiny:SEED or tiny:SEED:layers=2,hidden=64") from None
    return kw


def build_model(spec: str):
    """The child's side: a LoadedModel from a spec (imports torch)."""
    if spec.startswith("tiny:"):
        from ..models.tiny import tiny_random_model

        return tiny_random_model(**parse_tiny(spec))
    from ..models import load_model

    return load_model(spec)


@dataclass
class Target:
    kind: str  # "model" | "artifact"
    spec: str  # what the child loads
    model_id: str
    config: ModelConfig
    weight_bytes: int
    tokenizer: Any = None
    artifact_dir: Path | None = None
    manifest: Manifest | None = None  # an artifact's

    def as_loaded_like(self):
        """Enough of a LoadedModel for ``encode_prompt`` / ``check_context``."""
        return SimpleNamespace(model_id=self.model_id, tokenizer=self.tokenizer, config=self.config)


def _hf_dir_for(spec: str) -> Path:
    from ..models import loader
    from ..models.sources import resolve

    src = resolve(spec)
    if src.kind == "hf":
        return src.path
    cached = loader.converted_dir(src.path)
    if not (cached / "edgekv.json").is_file():
        # First use: convert once in a separate process so the parent never holds the weights.
        code = f"from edgekv.models import load_model; load_model({spec!r})"
        rc = subprocess.run([sys.executable, "-c", code]).returncode
        if rc != 0 or not (cached / "edgekv.json").is_file():
            raise ModelError(f"could not prepare model {spec!r} (conversion exited {rc}); try `edgekv run {spec}` once")
    return cached


def _weight_bytes_fp32(hf_dir: Path) -> int:
    """Bytes of the weights as the loader holds them (fp32), from safetensors headers only."""
    import struct

    total = 0
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for s in meta["shape"]:
                numel *= int(s)
            total += 4 * numel
    return total


def describe(spec: str | None) -> Target:
    """Geometry, weight bytes and tokenizer for a spec, without loading the weights here."""
    from ..models.sources import DEFAULT_MODEL

    spec = spec or DEFAULT_MODEL
    if spec.startswith("tiny:"):
        model = build_model(spec)
        tok = ByteTokenizer() if model.config.vocab_size >= 256 else None
        return Target("model", spec, model.model_id, model.config, model.weight_bytes, tok)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / MANIFEST).is_file():
        return _describe_artifact(path)
    from transformers import AutoConfig, AutoTokenizer

    from ..models.config import config_from_hf
    from ..models.loader import quiet_transformers

    hf_dir = _hf_dir_for(spec)
    quiet_transformers()
    cfg = config_from_hf(AutoConfig.from_pretrained(str(hf_dir)))
    tok = None
    if (hf_dir / "tokenizer.json").is_file() or (hf_dir / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model_id = spec if "/" not in spec and not path.exists() else path.name
    return Target("model", spec, model_id, cfg, _weight_bytes_fp32(hf_dir), tok)


def _describe_artifact(path: Path) -> Target:
    """Described from its manifest alone, whatever its format version (``edgekv simulate`` reads
    only the geometry, the plan and the work counts)."""
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path / MANIFEST}: {exc}") from None
    for key in (Keys.MODEL, Keys.MEMORY_PLAN, Keys.BUDGET, Keys.BLOCK, Keys.POLICY):
        if not isinstance(data, dict) or key not in data:
            raise ModelError(f"{path / MANIFEST} has no '{key}'; rebuild the artifact with `edgekv compile`")
    try:
        manifest = Manifest.from_json(data, str(path / MANIFEST))
    except ArtifactError as exc:
        raise ModelError(str(exc)) from None
    cfg = ModelConfig(**manifest.model_config)
    model_id = manifest.model_id
    inner = describe(model_id) if not model_id.startswith("tiny") else None
    return Target("artifact", model_id, model_id, cfg, manifest.memory_plan.weights_bytes,
                  inner.tokenizer if inner else None, artifact_dir=path, manifest=manifest)
