"""device_tests/gpu_check.sh's inputs: prepare_gpu_check.py packs a tree into size-limited parts
(large files in chunks, identical files once, gzip where it helps) and gpu_check.py reassembles
exactly the files whose chunks it was given, naming the parts the others need."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

DEVICE_TESTS = Path(__file__).resolve().parents[1] / "device_tests"


def load(name):
    spec = importlib.util.spec_from_file_location(name, DEVICE_TESTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def tree(tmp_path):
    full = tmp_path / "full"
    (full / "a" / "b").mkdir(parents=True)
    rnd = os.urandom(300_000)  # incompressible, like q4 weights
    (full / "a" / "params.bin").write_bytes(rnd)
    (full / "a" / "b" / "same.bin").write_bytes(rnd)  # stored once
    (full / "text.cl").write_text("kernel void k() {}\n" * 5000)  # compresses
    (full / "run").write_bytes(b"\x7fELF" + bytes(1000))
    os.chmod(full / "run", 0o755)
    return full


def test_parts_reassemble_exactly_and_name_what_is_missing(tree, tmp_path, monkeypatch):
    prep, check = load("prepare_gpu_check"), load("gpu_check")
    monkeypatch.setattr(prep, "CHUNK", 100_000)
    parts = prep.pack(tree, tmp_path / "out", 150_000)
    assert len(parts) >= 3
    sizes = [sum(f.stat().st_size for f in (p / "blobs").iterdir()) for p in parts]
    assert max(sizes) <= 150_000
    stored = sum(sizes)
    assert stored < 300_000 + 50_000  # params stored once, the kernel source gzipped
    present, missing = check.assemble(parts[:1], tmp_path / "w1")
    assert "a/params.bin" in missing and all(p > 1 for p in missing["a/params.bin"])
    present, missing = check.assemble(parts, tmp_path / "w2")
    assert not missing
    for rel in ("a/params.bin", "a/b/same.bin", "text.cl", "run"):
        assert (tmp_path / "w2" / rel).read_bytes() == (tree / rel).read_bytes()
    assert os.access(tmp_path / "w2" / "run", os.X_OK)


def test_a_corrupt_part_is_refused(tree, tmp_path, monkeypatch):
    prep, check = load("prepare_gpu_check"), load("gpu_check")
    parts = prep.pack(tree, tmp_path / "out", 10 << 20)
    blob = next(b for b in (parts[0] / "blobs").iterdir() if not b.name.endswith(".gz"))
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        check.assemble(parts, tmp_path / "w")
