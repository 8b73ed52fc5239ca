"""Artifact directory: written by compile_model, loaded by HostRuntime, refused when corrupt or mismatched."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")

from edgekv.compiler import compile_model  # noqa: E402
from edgekv.engine import BlockEngine  # noqa: E402
from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies.streaming import StreamingPolicy  # noqa: E402
from edgekv.runtime import ArtifactError, HostRuntime  # noqa: E402

TEST_TARGET = {"kind": "llvm", "opt-level": 0, "num-cores": 2}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model = tiny_random_model(seed=3, layers=1, tie_embeddings=True)
    out = tmp_path_factory.mktemp("art") / "stream"
    res = compile_model(model, StreamingPolicy(sinks=1), 12, 4, target=TEST_TARGET, out_dir=out)
    return model, out, res.manifest


def test_manifest_contents(artifact):
    model, out, _ = artifact
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["weight_hash"] == model.weight_hash
    assert m["policy"]["name"] == "streaming" and m["policy"]["params"] == {"sinks": 1}
    assert (m["budget"], m["block"], m["dtype"]) == (12, 4, "float32")
    assert m["target"]["tvm"]["kind"] == "llvm"
    assert m["versions"]["tvm"] == tvm.__version__ and m["versions"]["edgekv"]
    cfg = model.config
    assert m["cache"][0]["k"] == [cfg.num_kv_heads, 12, cfg.head_dim]
    plan = m["memory_plan"]
    assert plan["weights_bytes"] == sum(t.numel() * 4 for t in model.weights.values())
    # linear weights are stored pre-transposed and packed into column panels (host build: no
    # transposes at run time, each panel contiguous); the tied embedding is neither
    names = {p["name"] for p in m["params"]}
    assert any(re.search(r"q_proj__weight\.T\.P\d+$", n) for n in names)
    assert any(n.endswith("embed_tokens__weight") for n in names)
    assert plan["cache_bytes"] == cfg.num_layers * (cfg.num_kv_heads * 12 * (2 * cfg.head_dim * 4 + 4) + 4)
    assert plan["total_bytes"] == plan["weights_bytes"] + plan["cache_bytes"] + plan["activation_bytes"]
    assert {p.name for p in out.iterdir()} >= {"manifest.json", "params.safetensors", "model.so"}
    # the writer writes only keys edgekv/artifact/manifest.py defines, with the types it gives them
    from edgekv.artifact.manifest import Manifest, undefined_keys

    assert undefined_keys(m) == [] and Manifest.from_json(m).num_layers == cfg.num_layers


def test_load_and_run_matches_engine(artifact):
    model, out, _ = artifact
    rt = HostRuntime(out, expected_weight_hash=model.weight_hash)
    policy = StreamingPolicy(sinks=1)
    eng = BlockEngine(model, policy, 12, 4)
    prompt = torch.arange(3, 30) % 250
    got = rt.generate(prompt.numpy(), 5)
    want = eng.generate(prompt, 5)
    assert got == want
    np.testing.assert_array_equal(rt.kept_positions(0), eng.kept_positions(0).numpy())
    rep = rt.report()
    assert rep["stats"]["prefill_tokens"] == prompt.numel() and rep["measured"]["peak_rss_bytes"] > 0


def _copy(out, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


def test_refuses_missing_and_corrupt(artifact, tmp_path):
    model, out, _ = artifact
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        HostRuntime(tmp_path / "nope")
    bad = _copy(out, tmp_path)
    data = bytearray((bad / "params.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "params.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256|fails its checksum"):
        HostRuntime(bad)
    (bad / "model.so").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        HostRuntime(bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupt"):
        HostRuntime(bad)


def test_refuses_version_and_weight_mismatch(artifact, tmp_path):
    model, out, _ = artifact
    bad = _copy(out, tmp_path)
    m = json.loads((bad / "manifest.json").read_text())
    m["versions"]["tvm"] = "0.0.1"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="TVM 0.0.1"):
        HostRuntime(bad)
    with pytest.raises(ArtifactError, match="different weights"):
        HostRuntime(out, expected_weight_hash="0" * 64)
