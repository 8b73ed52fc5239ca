"""manifest.json's keys are defined once (edgekv/artifact/manifest.py), the typed reader refuses a
damaged manifest with the field's name and the recompile command, and the Java and C readers
name no key the module does not define."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from edgekv.artifact import ArtifactError
from edgekv.artifact.manifest import ARTIFACT_VERSION, SCHEMA, Manifest, constants, key_classes, undefined_keys
from edgekv.artifact.manifest_java import JAVA_PATH, java_source

REPO = Path(__file__).resolve().parents[1]

# the shape of what `edgekv compile` writes (a host build), trimmed
GOOD = {
    "format": "edgekv-artifact", "format_version": ARTIFACT_VERSION,
    "model": {"id": "tiny-llama-0", "weight_hash": "ab" * 32, "config": {"vocab_size": 256}, "chat": False},
    "policy": {"name": "keydiff", "params": {"recent_window": 0.0}, "kernel_params": {}},
    "budget": 32, "block": 8, "extra_rows": 0, "pseudo_rows": None, "question_rows": 0, "dtype": "float32",
    "kv_dtype": "fp32", "target": {"profile": "host", "tvm": {"kind": "llvm", "num-cores": 2}}, "num_layers": 1,
    "attention_sites": [{"index": 0, "form": "sdpa", "q_heads": 4, "kv_heads": 2, "head_dim": 16, "sm_scale": 0.25}],
    "cache": [{"k": [2, 32, 16]}], "cache_fields": [["k", "float32"]], "entry_state": [],
    "functions": {"prefill_block": {"inputs": [], "outputs": []}, "decode": {"inputs": [], "outputs": []}},
    "params": [{"name": "w", "shape": [4, 4], "dtype": "float32"}], "cache_init": {},
    "prepare": {"min_prompt": 64},
    "memory_plan": {"weights_bytes": 1000, "cache_bytes": 200, "activation_bytes": 300, "total_bytes": 1500},
    "versions": {"edgekv": "0.1.0", "tvm": "0.22"}, "timings": {"tvm_compile_s": 1.5},
    "files": {"library": {"name": "model.so", "sha256": "00" * 32},
              "tokenizer": {"name": "tokenizer", "sha256": {"tokenizer.json": "11" * 32}}},
}


# ---- defined once ------------------------------------------------------------------------------

def test_every_key_is_defined_once_with_a_type_and_a_meaning():
    for cls in key_classes():
        names = constants(cls)
        assert len(set(names.values())) == len(names), f"{cls.__qualname__} defines a key twice"
        fields = [f.key for f in SCHEMA[cls]]
        assert len(set(fields)) == len(fields), f"SCHEMA[{cls.__qualname__}] lists a key twice"
        assert set(fields) == set(names.values()), cls.__qualname__
        assert all(f.meaning for f in SCHEMA[cls])
    assert set(SCHEMA) <= set(key_classes())


def test_a_full_manifest_reads_with_its_types_and_defaults():
    m = Manifest.from_json(copy.deepcopy(GOOD))
    assert (m.budget, m.block, m.policy_name, m.model_id, m.kv_dtype) == (32, 8, "keydiff", "tiny-llama-0", "fp32")
    assert m.memory_plan.total_bytes == 1500 and m.files["library"].name == "model.so"
    assert m.target.kind == "llvm" and m.target.mtriple is None and m.prepare_min_prompt == 64
    assert undefined_keys(GOOD) == []
    assert m.cache_fields == [("k", "float32")] and m.cache_init == {}
    old = {k: v for k, v in GOOD.items()
           if k not in ("kv_dtype", "question_rows", "extra_rows", "prepare", "files", "cache_fields", "cache_init")}
    m = Manifest.from_json(old)  # keys added since default as the runtimes always took them
    assert (m.kv_dtype, m.question_rows, m.extra_rows, m.prepare_min_prompt, m.files) == ("fp32", 0, 0, None, {})
    assert (m.cache_fields, m.cache_init, m.pseudo_window) == (None, {}, 0)


def test_undefined_keys_are_found_inside_objects_edgekv_owns():
    m = copy.deepcopy(GOOD)
    m["surprise"] = 1
    m["memory_plan"]["spare_bytes"] = 2
    m["attention_sites"][0]["rope"] = "x"
    m["policy"]["params"]["anything"] = 3  # a policy's own vocabulary: open
    m["target"]["tvm"]["mcpu"] = "native"  # TVM's: open
    assert sorted(undefined_keys(m)) == ["attention_sites.rope", "memory_plan.spare_bytes", "surprise"]


# ---- the typed reader's refusals ---------------------------------------------------------------

@pytest.mark.parametrize("path,value,message", [
    (("block",), [128], "'block' is list [128], expected an integer"),
    (("budget",), "abc", "'budget' is str \"abc\", expected an integer"),
    (("budget",), True, "'budget' is bool true, expected an integer"),
    (("budget",), 32.5, "'budget' is float 32.5, expected an integer"),
    (("model", "id"), 7, "'model.id' is int 7, expected a string"),
    (("memory_plan", "total_bytes"), "1GiB", "'memory_plan.total_bytes' is str"),
    (("files", "library"), "model.so", "'files.library' is str"),
    (("files", "tokenizer", "sha256"), 5, "'files.tokenizer.sha256' is int 5, expected a string or an object"),
    (("attention_sites",), [3], "'attention_sites[0]' is int, expected an object"),
    (("attention_sites", 0, "head_dim"), "16", "'attention_sites[0].head_dim' is str"),
    (("pseudo_rows",), 4, "'pseudo_rows' is int 4, expected an object"),
    (("kv_dtype",), None, "'kv_dtype' is null, expected a string"),
    (("cache_fields",), [["k"]], "'cache_fields' is not a list of [name, dtype] pairs"),
])
def test_a_mistyped_field_is_refused_by_name(path, value, message):
    m = copy.deepcopy(GOOD)
    obj = m
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    with pytest.raises(ArtifactError) as exc:
        Manifest.from_json(m, "/x/art/manifest.json")
    assert message in str(exc.value)
    assert "recompile the artifact (edgekv compile ... -o /x/art)" in str(exc.value)


@pytest.mark.parametrize("path", [("budget",), ("block",), ("model",), ("policy", "name"), ("model", "config"),
                                  ("memory_plan", "cache_bytes"), ("files", "library", "name"),
                                  ("prepare", "min_prompt")])
def test_a_missing_required_field_is_refused_by_name(path):
    m = copy.deepcopy(GOOD)
    obj = m
    for key in path[:-1]:
        obj = obj[key]
    del obj[path[-1]]
    with pytest.raises(ArtifactError, match=re.escape(f"has no '{'.'.join(path)}'") + ".*recompile the artifact"):
        Manifest.from_json(m)


def _write(tmp_path, manifest) -> Path:
    art = tmp_path / "art"
    art.mkdir(exist_ok=True)
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


def test_read_checks_format_and_version_as_before(tmp_path):
    art = _write(tmp_path, GOOD)
    assert Manifest.read(art).raw == GOOD
    with pytest.raises(ArtifactError, match=re.escape("artifact format version 1 is not supported by this edgekv "
                                                      f"(expects {ARTIFACT_VERSION}); recompile it")):
        Manifest.read(_write(tmp_path, {**GOOD, "format_version": 1}))
    with pytest.raises(ArtifactError, match="is not an edgekv artifact manifest"):
        Manifest.read(_write(tmp_path, {**GOOD, "format": "other"}))
    with pytest.raises(ArtifactError, match="'block' is list"):
        Manifest.read(_write(tmp_path, {**GOOD, "block": [128]}))


def test_edgekv_run_refuses_a_damaged_manifest_without_a_traceback(tmp_path):
    pytest.importorskip("tvm")
    from typer.testing import CliRunner

    from edgekv.cli import app

    art = _write(tmp_path, {**GOOD, "budget": "abc"})
    res = CliRunner().invoke(app, ["run", str(art), "--prompt", "hi"])
    text = " ".join((res.stdout + res.stderr).split())
    assert res.exit_code == 2, text
    assert "'budget' is str \"abc\", expected an integer" in text and "recompile the artifact" in text
    assert "Traceback" not in text


# ---- the Java and C readers --------------------------------------------------------------------

def test_the_committed_java_keys_are_what_the_generator_makes():
    committed = (REPO / JAVA_PATH).read_text(encoding="utf-8")
    assert committed == java_source(), "stale: run python -m edgekv.artifact.manifest_java"


def test_the_java_readers_name_keys_only_through_manifest_keys():
    """Artifact.java reads manifest.json: every key it names is a ManifestKeys constant, no literal."""
    source = (REPO / "android/src/com/edgekv/demo/Artifact.java").read_text()
    java = java_source()
    defined = set(re.findall(r"public static final class (\w+)", java))
    used = re.findall(r"Json\.(?:str|num|at)\(m, (?:0, )?([^)]*)\)", source)
    assert len(used) >= 10
    for args in used:
        for arg in (a.strip() for a in args.split(",")):
            assert not arg.startswith('"'), f"Artifact.java names the key {arg} as a literal: use ManifestKeys"
            cls, _, name = arg.rpartition(".")
            assert not cls or cls in defined, arg
            assert f"public static final String {name} = " in java, arg
    # the other Java files read no manifest (HostCheck goes through Artifact.read)
    for path in [*(REPO / "android/src").rglob("*.java"), *(REPO / "android/test").rglob("*.java")]:
        if path.name not in ("Artifact.java", "ManifestKeys.java"):
            assert '"manifest.json"' not in path.read_text(), path


def test_the_native_runtime_names_manifest_keys_only_through_the_generated_header():
    """runtime/ runs by program.ekv and checks the manifest minimally (manifest_check.c) through the
    keys of runtime/src/manifest_keys.h, generated from manifest.py as manifest_java does for Java."""
    from edgekv.artifact.manifest_c import C_PATH, c_source

    assert (REPO / C_PATH).read_text() == c_source(), "stale: run python -m edgekv.artifact.manifest_c"
    for path in (REPO / "runtime").rglob("*.[ch]"):
        if path.name != "manifest_keys.h":
            assert "manifest.json" not in path.read_text(errors="replace"), path
