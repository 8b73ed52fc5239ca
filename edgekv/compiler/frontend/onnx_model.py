"""An ONNX decoder as the compiler's model: the graph (weights = its initializers) plus the
config.json / tokenizer the user points at — what ``compile_model`` needs besides the graph.

The ONNX file carries no model config or tokenizer. They are read from an HF-style folder:
``--tokenizer DIR`` when given, else the ``.onnx`` file's own folder (where optimum and
``edgekv export-onnx`` put ``config.json`` and the tokenizer files). ``config.json`` is required
(geometry for budgets in bytes, context length, the artifact's manifest); the tokenizer is
optional (without it the artifact runs on token ids only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CompileError
from .onnx_import import import_onnx, input_roles, load_onnx, onnx_sha256


@dataclass
class OnnxModel:
    model_id: str
    path: Path
    proto: Any  # onnx.ModelProto
    config: Any  # edgekv.models.ModelConfig
    hf_config: Any
    tokenizer: Any = None
    chat: bool = False
    form: str = "plain"  # "plain" | "past" (past_key_values inputs)
    weight_hash: str = field(default="")

    @property
    def source_info(self) -> dict[str, Any]:
        return {"format": "onnx", "file": str(self.path), "sha256": self.weight_hash, "form": self.form}

    def import_graph(self, block: int):
        """``(IRModule{prefill_src, decode_src}, weights, timings)`` as ``frontend.export.import_model``."""
        return import_onnx(self.proto, block, self)


def load_onnx_model(path: str | Path, config_dir: str | Path | None = None) -> OnnxModel:
    """Read ``path`` (refusing a missing/corrupt/unsupported file) and its config/tokenizer."""
    from ...models.config import config_from_hf
    from ...models.errors import ModelError

    path = Path(path).expanduser()
    proto = load_onnx(path)
    roles = input_roles(proto)
    folder = Path(config_dir).expanduser() if config_dir else path.parent
    where = f"--tokenizer {folder}" if config_dir else f"the folder of {path.name} ({folder})"
    if not (folder / "config.json").is_file():
        raise CompileError(f"compiling {path} needs the model's HF config.json, not found in {where}; put "
                           "config.json and the tokenizer files next to the .onnx file (as optimum and "
                           "`edgekv export-onnx` do) or pass --tokenizer DIR naming an HF model folder that has them")
    from transformers import AutoConfig, AutoTokenizer

    try:
        hf_config = AutoConfig.from_pretrained(str(folder))
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise CompileError(f"cannot read {folder / 'config.json'}: {exc}") from None
    try:
        config = config_from_hf(hf_config)
    except ModelError as exc:
        raise CompileError(f"{folder / 'config.json'}: {exc}") from None
    tokenizer = None
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return OnnxModel(model_id=f"{path.parent.name}/{path.name}", path=path, proto=proto, config=config,
                     hf_config=hf_config, tokenizer=tokenizer, chat=bool(getattr(tokenizer, "chat_template", None)),
                     form="past" if "past" in roles.values() else "plain", weight_hash=onnx_sha256(path))
