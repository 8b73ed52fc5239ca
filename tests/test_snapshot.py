"""Cache snapshots (issue 20): a document prefilled once, saved, mapped back for each question.
Round trips for every policy in the eager engine, HostRuntime and the native runtime; the
snapshot file shared by the two compiled runtimes; bad snapshots refused with nothing changed."""

from __future__ import annotations

import os
import shutil
import stat
import struct

import numpy as np
import pytest
import torch

from edgekv.artifact import snapshot_file as sf
from edgekv.engine import BlockEngine
from edgekv.models import tiny_random_model
from edgekv.policies import REGISTRY, make_policy
from edgekv.compiler.policy_kernels import compiled_policy_names

B, N = 4, 12
POLICY_SETUP = {"full": ({}, 160), "lagkv": ({"sinks": 2, "lag": 2}, N)}
DOC = list(range(1, 58))
QUESTION = [5, 9, 11, 200, 17, 3] * 6  # longer than DapQ's window: its pseudo rows come from the question


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(seed=0, layers=2)


def engine(model, name):
    args, budget = POLICY_SETUP.get(name, ({}, N))
    return BlockEngine(model, make_policy(name, args), budget, B)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_eager_round_trip(model, name, tmp_path):
    """save → load gives the same cache tensors and the same continuation as running on."""
    live = engine(model, name)
    live.prefill(torch.tensor(DOC))
    live.save_cache(tmp_path / "doc.ekv")
    want = live.generate(torch.tensor(QUESTION), 12)
    loaded = engine(model, name)
    assert loaded.load_cache(tmp_path / "doc.ekv") == ""
    for a, b in zip(engine_after(model, name).caches, loaded.caches):
        assert a.length == b.length
        torch.testing.assert_close(a.keys[:, :a.length], b.keys[:, :b.length], rtol=0, atol=0)
        torch.testing.assert_close(a.positions[:, :a.length], b.positions[:, :b.length], rtol=0, atol=0)
    assert loaded.generate(torch.tensor(QUESTION), 12) == want
    again = engine(model, name)  # a second question from the same file: nothing leaked into it
    again.load_cache(tmp_path / "doc.ekv")
    assert again.generate(torch.tensor(QUESTION), 12) == want


def engine_after(model, name):
    e = engine(model, name)
    e.prefill(torch.tensor(DOC))
    return e


def test_bad_snapshots_are_refused(model, tmp_path):
    live = engine_after(model, "keydiff")
    path = tmp_path / "doc.ekv"
    live.save_cache(path)
    data = path.read_bytes()
    cases = {
        "truncated": data[: len(data) - 100],
        "corrupt": data[:4096] + bytes(b ^ 0xFF for b in data[4096:4104]) + data[4104:],
        "newer": data[:8] + struct.pack("<H", 2) + data[10:],
        "not a snapshot": b"hello" * 100,
    }
    for what, blob in cases.items():
        bad = tmp_path / f"{what}.ekv"
        bad.write_bytes(blob)
        fresh = engine(model, "keydiff")
        with pytest.raises(sf.SnapshotError):
            fresh.load_cache(bad)
        assert fresh.position == 0 and fresh.cache_lengths() == [0, 0], what  # nothing changed
    with pytest.raises(sf.SnapshotError, match="policy"):
        engine(model, "lagkv").load_cache(path)
    with pytest.raises(sf.SnapshotError, match="N = 12"):
        BlockEngine(model, make_policy("keydiff", {}), 16, B).load_cache(path)
    with pytest.raises(sf.SnapshotError, match="B = 4"):
        BlockEngine(model, make_policy("keydiff", {}), N, 2).load_cache(path)
    with pytest.raises(sf.SnapshotError, match="other model weights"):
        BlockEngine(tiny_random_model(seed=5, layers=2), make_policy("keydiff", {}), N, B).load_cache(path)


def test_unwritable_destination_leaves_nothing(model, tmp_path):
    live = engine_after(model, "keydiff")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root): the permission case cannot happen")
        with pytest.raises(OSError):
            live.save_cache(locked / "doc.ekv")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(stat.S_IRWXU)


def test_interrupted_write_leaves_no_partial_file(model, tmp_path, monkeypatch):
    """A failure in the middle of writing (a full disk, Ctrl-C) leaves neither the file nor its .part."""
    live = engine_after(model, "keydiff")
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        live.save_cache(tmp_path / "doc.ekv")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert list(tmp_path.iterdir()) == []


# ---- compiled: HostRuntime and the native runtime share the file -------------------------------
tvm = pytest.importorskip("tvm")


# the policies whose saved state differs in kind run by default (a plain cache; H2O's accumulated
# scores; D2O's per-layer budgets and merge state; RocketKV's page summaries); the rest with -m slow
FAST_SNAPSHOT = ("keydiff", "h2o", "d2o", "rocketkv")


@pytest.fixture(scope="module")
def artifacts(model, tmp_path_factory):
    """name → artifact directory, each compiled the first time a test asks for it."""
    from edgekv.compiler import compile_model

    class Compiled(dict):
        def __missing__(self, name):
            args, budget = POLICY_SETUP.get(name, ({}, N))
            out = tmp_path_factory.mktemp(f"snap-{name}") / "art"
            compile_model(model, make_policy(name, args), budget, B,
                          target={"kind": "llvm", "opt-level": 0, "num-cores": 2}, out_dir=out)
            self[name] = out
            return out

    return Compiled()


@pytest.mark.parametrize("name", [n if n in FAST_SNAPSHOT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in compiled_policy_names()])
def test_compiled_round_trip_across_runtimes(artifacts, name, tmp_path):
    from edgekv.runtime import HostRuntime, native

    art = artifacts[name]
    host = HostRuntime(art)
    host.prefill(DOC)
    host.save_cache(tmp_path / "host.ekv")
    want = host.generate(QUESTION, 12)
    again = HostRuntime(art)
    again.load_cache(tmp_path / "host.ekv")
    assert again.generate(QUESTION, 12) == want
    if not native.available():
        pytest.skip("the native runtime is not built (pip install -e .)")
    nat = native.NativeRuntime(art)
    nat.prefill(DOC)
    nat.save_cache(tmp_path / "native.ekv")
    # the same bytes: one format, one cache layout — but for the document's measured prefill time
    # (header bytes 104..112) and the header checksum that covers it (248..252)
    host_bytes, native_bytes = (tmp_path / "host.ekv").read_bytes(), (tmp_path / "native.ekv").read_bytes()
    assert len(host_bytes) == len(native_bytes)
    for lo, hi in ((0, 104), (112, 248), (252, len(host_bytes))):
        assert native_bytes[lo:hi] == host_bytes[lo:hi], (lo, hi)
    host_info, native_info = sf.read_header(tmp_path / "host.ekv"), sf.read_header(tmp_path / "native.ekv")
    assert host_info.made_from == native_info.made_from == str(art.resolve())
    assert host_info.document_seconds > 0 and native_info.document_seconds > 0
    for _ in range(2):  # each question from the saved state
        nat.load_cache(tmp_path / "host.ekv")
        assert nat.generate(QUESTION, 12) == want


def test_compiled_snapshot_refusals(artifacts, tmp_path):
    from edgekv.runtime import HostRuntime, native

    host = HostRuntime(artifacts["keydiff"])
    host.prefill(DOC)
    path = tmp_path / "doc.ekv"
    host.save_cache(path)
    eager = engine_after(tiny_random_model(seed=0, layers=2), "keydiff")
    eager.save_cache(tmp_path / "eager.ekv")
    with pytest.raises(sf.SnapshotError, match="eager engine"):
        HostRuntime(artifacts["keydiff"]).load_cache(tmp_path / "eager.ekv")
    with pytest.raises(sf.SnapshotError, match="policy"):
        HostRuntime(artifacts["h2o"]).load_cache(path)
    if native.available():
        with pytest.raises(sf.SnapshotError, match="eager engine"):
            native.NativeRuntime(artifacts["keydiff"]).load_cache(tmp_path / "eager.ekv")
        with pytest.raises(sf.SnapshotError, match="policy"):
            native.NativeRuntime(artifacts["h2o"]).load_cache(path)
        corrupt = tmp_path / "corrupt.ekv"
        data = bytearray(path.read_bytes())
        head = struct.unpack_from("<I", data, 12)[0]
        data[head + 5] ^= 0x55  # a byte of the first cache tensor
        corrupt.write_bytes(bytes(data))
        rt = native.NativeRuntime(artifacts["keydiff"])
        with pytest.raises(sf.SnapshotError, match="checksum"):
            rt.load_cache(corrupt)
        assert rt.position == 0
        # an artifact recompiled (another program) refuses the old snapshot
        other = tmp_path / "other"
        shutil.copytree(artifacts["keydiff"], other)
        from edgekv.artifact import program_file as pf

        prog = pf.read(other / "program.ekv")
        prog.settings["compiled_cores"] = 99
        pf.write(prog, other / "program.ekv")
        with pytest.raises(sf.SnapshotError, match="another artifact"):
            native.NativeRuntime(other).load_cache(path)
