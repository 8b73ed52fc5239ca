"""The Android demo app (android/) on a phone or emulator over adb: build and install the APK,
compile a tiny model with a byte-level tokenizer for the phone (``android-cpu``, and ``opencl``
where the phone has OpenCL), link it (android/finish.sh), push it into the app's external files
directory, run one document with two questions through the Activity's intent entry point, read
the result file back, and compare with ``edgekv-run`` on the host running a host artifact of the
same model, policy, budget and block (the phone's artifact is aarch64 code and cannot run here):
the same generated ids for both questions, the second answered from the saved document cache,
and the run's measurements present.

Skips, with the reason, when adb or a device is missing, or when the app cannot be built here
(tests/test_android_app.py names the packages). No device or emulator was available where this
was written: it has not been run. ``pytest device_tests/test_android_device.py -rs``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
PACKAGE = "com.edgekv.demo"
FILES = f"/sdcard/Android/data/{PACKAGE}/files"
DOCUMENT = ("The lighthouse keeper wrote in the log every night. On Monday the fog came in from the east; "
            "on Tuesday a ship named Aurora passed at dawn. ") * 3
QUESTIONS = ["Which ship passed?", "When did the fog come?"]  # no commas: `am start --esa` splits on them
NEW_TOKENS = 8
B, N = 4, 16


def adb(*args, timeout=120, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(["adb", *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"adb {' '.join(map(str, args))} failed ({r.returncode}): {r.stdout[-1000:]} {r.stderr[-2000:]}")
    return r


def _why_not() -> str | None:
    if shutil.which("adb") is None:
        return "adb is not on PATH (apt-get install -y adb)"
    try:
        out = subprocess.run(["adb", "devices"], capture_output=True, text=True, timeout=30).stdout
    except Exception as e:  # noqa: BLE001
        return f"adb devices failed: {e}"
    devices = [line for line in out.splitlines()[1:] if line.strip().endswith("device")]
    if not devices:
        return "no Android device or emulator in `adb devices`"
    if len(devices) > 1 and not os.environ.get("ANDROID_SERIAL"):
        return "several devices attached: set ANDROID_SERIAL"
    abi = subprocess.run(["adb", "shell", "getprop", "ro.product.cpu.abilist"], capture_output=True, text=True,
                         timeout=30).stdout
    if "arm64-v8a" not in abi:
        return f"the device's ABIs are {abi.strip() or '?'}; the app is arm64-v8a only"
    import test_android_app as t

    if t.WHY:
        return f"the app cannot be built here: {t.WHY}"
    try:
        import tvm  # noqa: F401
    except ImportError:
        return "TVM is not importable (pip install -e .[dev]): the artifacts cannot be compiled"
    return None


WHY = _why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    env = {**os.environ, "EDGEKV_ANDROID_OUT": str(tmp_path_factory.mktemp("apk"))}
    r = subprocess.run(["bash", REPO / "android" / "build.sh"], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    apk = Path(r.stdout.strip().splitlines()[-1])
    adb("install", "-r", "-t", apk, timeout=300)
    # the first start creates the app's external files directory (files/artifacts)
    adb("shell", "am", "start", "-W", "-n", f"{PACKAGE}/.MainActivity")
    adb("shell", "am", "force-stop", PACKAGE)
    adb("shell", "mkdir", "-p", f"{FILES}/artifacts", f"{FILES}/results")
    return apk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from edgekv.models import tiny_random_model
    from test_android_app import _byte_level_tokenizer

    d = tmp_path_factory.mktemp("tiny") / "hf"
    tiny_random_model(0, layers=2).to_hf().save_pretrained(d)
    _byte_level_tokenizer().save_pretrained(d)
    return d


def _host_answers(model_dir: Path, tmp: Path) -> list[dict]:
    from edgekv.compiler import compile_model
    from edgekv.models import load_model
    from edgekv.policies import make_policy
    from edgekv.runtime import native

    art = tmp / "host-art"
    compile_model(load_model(str(model_dir)), make_policy("keydiff", {}), N, B, "host", out_dir=art)
    (tmp / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    report = tmp / "host.json"
    cli = native.cli_path()
    assert cli is not None, "edgekv-run is not built (pip install -e .)"
    r = subprocess.run([str(cli), str(art), "--prompt-file", str(tmp / "doc.txt"),
                        *sum((["--question", q] for q in QUESTIONS), []), "--max-new-tokens", str(NEW_TOKENS),
                        "--report", str(report), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(report.read_text())
    return rep.get("document", rep)["answers"]


def _phone_artifact(model_dir: Path, target: str, tmp: Path) -> Path:
    from edgekv.compiler import compile_model
    from edgekv.compiler.errors import ToolchainNeededWarning
    from edgekv.models import load_model
    from edgekv.policies import make_policy

    art = tmp / f"tiny-{target}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ToolchainNeededWarning)
        compile_model(load_model(str(model_dir)), make_policy("keydiff", {}), N, B, target, art)
    r = subprocess.run(["bash", REPO / "android" / "finish.sh", art], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return art


def _run_on_phone(name: str, result: str, timeout: float = 600) -> dict:
    adb("shell", "rm", "-f", f"{FILES}/results/{result}")
    adb("logcat", "-c", check=False)
    cmd = ["am", "start", "-S", "-W", "-n", f"{PACKAGE}/.ScriptActivity", "--es", "artifact", name,
           "--es", "document_file", "doc.txt", "--esa", "questions", ",".join(QUESTIONS),
           "--ei", "max_new_tokens", str(NEW_TOKENS), "--es", "result", result]
    adb("shell", " ".join(shlex.quote(c) for c in cmd))
    t0 = time.time()
    while time.time() - t0 < timeout:
        r = adb("shell", "cat", f"{FILES}/results/{result}", check=False)
        if r.returncode == 0 and r.stdout.strip().startswith("{"):
            try:
                return json.loads(r.stdout)
            except json.JSONDecodeError:
                pass  # being written
        time.sleep(2)
    log = adb("logcat", "-d", "-s", "edgekv", "AndroidRuntime", check=False).stdout
    raise AssertionError(f"no result from the app after {timeout} s; logcat:\n{log[-4000:]}")


@pytest.mark.parametrize("target", ["android-cpu", "opencl"])
def test_app_answers_like_edgekv_run(installed, model_dir, tmp_path, target):
    want = _host_answers(model_dir, tmp_path)
    art = _phone_artifact(model_dir, target, tmp_path)
    name = art.name
    adb("shell", "rm", "-rf", f"{FILES}/artifacts/{name}")
    adb("push", f"{art}/.", f"{FILES}/artifacts/{name}/", timeout=600)
    adb("push", tmp_path / "doc.txt", f"{FILES}/doc.txt")
    got = _run_on_phone(name, f"{target}.json")
    if target == "opencl" and "OpenCL" in str(got.get("error", "")):
        pytest.skip(f"the phone runs no OpenCL artifact: {got['error']}")
    assert "error" not in got, got.get("error")
    compiled = got["compiled"]
    assert compiled["policy"] == "keydiff" and compiled["budget"] == N and compiled["block"] == B
    assert compiled["target"] == target and compiled["target_arch"] == "aarch64"
    assert compiled["device"].startswith("opencl" if target == "opencl" else "cpu"), compiled["device"]
    answers = got["answers"]
    assert [a["question"] for a in answers] == QUESTIONS
    assert [a["from_snapshot"] for a in answers] == [False, True]
    assert [a["generated_ids"] for a in answers] == [w["generated_ids"] for w in want]
    assert [a["text"] for a in answers] == [w["text"] for w in want]
    for a in answers:
        assert a["prefill_tok_s"] > 0 and a["decode_tok_s"] > 0
        assert a["stats"]["peak_rss_bytes"] > 0
        assert a["prompt_tokens"] == len(DOCUMENT.encode("utf-8")) + a["question_tokens"]


def test_scripted_entry_refuses_paths(installed):
    """ScriptActivity takes names, not paths: `..` in the artifact and an absolute document path
    are refused before anything runs, and the reason is written to the result file; another app
    (no DUMP permission) cannot start it at all (checked on the host from the manifest:
    tests/test_android_ui.py)."""
    for extras, word in [(["--es", "artifact", "../staged/x"], ".."),
                         (["--es", "artifact", "x", "--es", "document_file", "/sdcard/doc.txt"], "absolute path")]:
        adb("shell", "rm", "-f", f"{FILES}/results/refused.json")
        cmd = ["am", "start", "-S", "-W", "-n", f"{PACKAGE}/.ScriptActivity", *extras, "--es", "result", "refused.json"]
        adb("shell", " ".join(shlex.quote(c) for c in cmd))
        t0 = time.time()
        while time.time() - t0 < 60:
            r = adb("shell", "cat", f"{FILES}/results/refused.json", check=False)
            if r.returncode == 0 and r.stdout.strip().startswith("{"):
                break
            time.sleep(1)
        got = json.loads(r.stdout)
        assert "refused" in got["error"] and word in got["error"], got
        assert "answers" not in got
