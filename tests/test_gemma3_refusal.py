"""An architecture edgekv has no description for is refused from the GGUF's metadata, at once,
with the missing piece named — never after converting the file (minutes for a real model)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from edgekv.cli import app
from edgekv.models import ModelError
from edgekv.models.config import MISSING_PIECES


def metadata_only_gguf(path, architecture: str):
    """A GGUF whose header names ``architecture`` and holds one small tensor (enough to parse):
    conversion of it would fail, so a refusal that comes from the metadata is the only clean one."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture,model_type", [("gemma2", "gemma2"), ("phi3", "phi3"), ("bert", "bert")])
def test_gguf_architecture_refused_before_conversion(tmp_path, monkeypatch, architecture, model_type):
    import edgekv.models.loader as loader

    def no_conversion(*args, **kwargs):
        raise AssertionError("the file was converted before its architecture was checked")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))
    model = metadata_only_gguf(tmp_path / f"{architecture}.gguf", architecture)
    result = CliRunner().invoke(app, ["run", str(model), "--prompt", "hi"])
    out = " ".join((result.output + (result.stderr if result.stderr_bytes is not None else "")).split())
    assert result.exit_code == 2, out
    assert f"unsupported architecture '{model_type}'" in out and f"GGUF architecture '{architecture}'" in out
    missing = MISSING_PIECES.get(model_type, "a description of its decoder layer")
    assert f"Missing for '{model_type}': {' '.join(missing.split())}" in out
    assert "Traceback" not in out
    assert not (tmp_path / "cache" / "converted").exists() or not any((tmp_path / "cache" / "converted").iterdir())
