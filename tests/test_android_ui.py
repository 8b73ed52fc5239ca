"""The Android app's UI and lifecycle parts (issue 33), checked without a phone.

What a phone would show is checked here in three ways (android/README.md, "What was verified"):

* the app's UI-side logic that needs no framework runs on a desktop JVM (android/test/UiCheck.java):
  AppState through an Activity recreation (a job started under one screen reports to the next; a
  second job is refused while one runs; cancel), the scripted entry point's refusal of "..",
  absolute paths and separators, the document file with its preview and its refusals; with a host
  artifact, through the JNI bridge: a question asked through AppState (the same ids as the Engine
  alone, with decode progress), the pp/tg benchmark, and onTrimMemory closing an idle model and
  keeping a busy one;
* the built APK's manifest and resources (aapt): the foreground service and its type and
  permission, ScriptActivity guarded by the DUMP permission and separate from the launcher, the
  icon (adaptive and pre-Android-8), the day/night theme;
* the APK's code (dexdump): which component reads intent extras, the debuggable check, the
  notification channel on Android 8+, the copyable message; and the sources: sizes in dp.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_android_app import (ANDROID, DOCUMENT, QUESTIONS, WHY, apk, host_artifact, host_bridge,  # noqa: E402,F401
                              needs_tools, run)

DEMO = ANDROID / "src" / "com" / "edgekv" / "demo"
PURE = ["AppState", "Engine", "EdgeKv", "EdgeKvException", "ModelInfo", "Stats", "SnapshotInfo", "Json",
        "ManifestKeys", "Artifact", "Bench", "MemoryProbe", "DocumentStore", "ScriptRequest", "Panels"]


def _compile_ui_check(dest: Path) -> Path:
    if shutil.which("javac") is None or shutil.which("java") is None:
        pytest.skip("javac/java missing: apt-get install -y default-jdk-headless")
    classes = dest / "classes"
    r = run(["javac", "--release", "7", "-Xlint:all,-options", "-Werror", "-encoding", "UTF-8", "-d", classes,
             *[DEMO / f"{n}.java" for n in PURE], ANDROID / "test" / "UiCheck.java"])
    assert r.returncode == 0, r.stdout + r.stderr
    return classes


def _ui_check(classes: Path, work: Path, *args, env=None, library_path=None) -> dict:
    work.mkdir(exist_ok=True)
    cmd = ["java", "-cp", classes]
    if library_path:
        cmd.insert(1, f"-Djava.library.path={library_path}")
    r = run([*cmd, "UiCheck", work, *args], env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_ui_logic_on_a_desktop_jvm(tmp_path):
    got = _ui_check(_compile_ui_check(tmp_path), tmp_path / "work")

    # scripted runs take names: "..", absolute paths, separators, hidden and odd names are refused
    names = got["names"]
    for ok in ("smol-android", "doc.txt", "run-2.json"):
        assert names[ok] == f"ok {ok}"
    for bad in ("..", "../etc", "a/../../b", "sub/.."):
        assert names[bad].startswith("refused") and "(..)" in names[bad], names[bad]
    for bad in ("/sdcard/x", "/data/data/com.other/files/secret"):
        assert "an absolute path" in names[bad], names[bad]
    for bad in ("a/b", "a\\b", ".hidden", "", "café", "x\x00y"):
        assert names[bad].startswith("refused"), (bad, names[bad])
    assert "by its name" in names["../etc"]  # says what to pass instead
    req = got["requests"]
    assert req["good"] == "smol doc.txt r.json [Q1, Q2]"
    assert "document_file" in req["document_path"] and "absolute path" in req["document_path"]
    assert "document_file" in req["document_up"] and "(..)" in req["document_up"]
    assert "result" in req["result_up"] and "(..)" in req["result_up"]
    assert "artifact" in req["artifact_up"] and "(..)" in req["artifact_up"]
    assert "missing" in req["no_artifact"]

    # the document: a file with a preview; too large / not UTF-8 refused, the old one kept, no .part left
    docs = got["documents"]
    assert docs["empty_preview"] == ""
    assert docs["preview"].startswith("6.1 KiB (6292 bytes), first lines:\nline 1: the lighthouse keeper\n"), docs
    assert "line 4" not in docs["preview"]
    assert docs["read_equal"] and docs["kept_after_refusals"] and docs["files"] == ["document.txt"]
    assert "larger than 8.0 MiB" in docs["too_large"] and "not UTF-8" in docs["not_utf8"]

    # live memory from /proc/self/status
    assert got["memory_rss"] > 0 and got["memory_peak"] >= got["memory_rss"]
    assert "plan" in got["memory_text"] and "(0.50x)" in got["memory_text"]

    # a recreation while a job runs: the new screen sees it busy at once, the old one gets nothing more
    rec = got["recreation"]
    assert rec["first_started"] and rec["second_refused_while_busy"]
    assert rec["b_first_render"] == "busy|Answering…|document: block 1 / 4|"
    assert rec["a_renders_after_detach"] == 0
    assert rec["b_saw_block_2"]
    assert rec["b_last"] == "idle|Cancelled: cancelled at block 2|document: block 2 / 4|The ship"
    assert rec["busy_after"] is False and rec["third_started_after"]
    assert rec["b_after_third"].startswith("idle|third ran|")
    assert got["host_events"] == ["started Answering", "finished", "started Third", "finished"]  # the service's cues


def test_ui_state_with_a_model(host_bridge, host_artifact, tmp_path):
    """AppState, the benchmark and onTrimMemory on the real engine through the JNI bridge (a host
    artifact on a desktop JVM, as tests/test_android_app.py runs the Engine)."""
    import os

    classes = _compile_ui_check(tmp_path)
    (tmp_path / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    env = {**os.environ, "LD_PRELOAD": str(host_bridge["lib"] / "libedgekv_runtime.so")}  # as _host_check does
    got = _ui_check(classes, tmp_path / "work", host_artifact, tmp_path / "doc.txt", QUESTIONS[0], env=env,
                    library_path=host_bridge["lib"])
    m = got["model"]
    assert len(m["alone_ids"]) == 8
    assert m["state_ids"] == m["alone_ids"] == m["again_ids"]  # the benchmark's resets do not change answers
    assert m["state_answer_equal"]
    assert m["decode_progress"][0] == "decoding: token 1 / 8 at most"
    assert m["decode_progress"][-1] == "decoding: token 8 / 8 at most" and len(m["decode_progress"]) == 8
    assert m["memory_text"].startswith("memory now: RSS ") and "plan" in m["memory_text"]
    assert m["plan_bytes"] > 0

    pp, tg = m["bench"]
    assert (pp["test"], pp["tokens"], pp["reps"]) == ("pp12", 12, 2)
    assert (tg["test"], tg["tokens"], tg["reps"]) == ("tg6", 6, 2)
    for row in (pp, tg):
        assert row["mean_tok_s"] > 0 and row["sd_tok_s"] >= 0 and row["peak_rss_bytes"] > 0
        assert row["plan_bytes"] == m["plan_bytes"] and "tok/s" in row["row"] and "plan" in row["row"]
    assert m["bench_too_long"].startswith("4 ") and "context" in m["bench_too_long"], m["bench_too_long"]

    # onTrimMemory: kept while a job runs, kept at UI_HIDDEN, closed at COMPLETE when idle, and said so
    assert "stays open for the running job" in m["trim_busy_note"]
    assert m["open_after_busy_trim"] and m["open_after_ui_hidden"]
    assert m["open_after_idle_trim"] is False and m["closed_for_memory"]
    assert "to give memory back" in m["compiled_after_trim"]
    assert "closed to free memory" in m["screen_last"]


# ---- the APK: manifest, resources, code -----------------------------------------------------------

def _xmltree(apk_path: Path) -> str:
    r = run(["aapt", "dump", "xmltree", apk_path, "AndroidManifest.xml"])
    assert r.returncode == 0, r.stderr
    return r.stdout


def _elements(tree: str, tag: str) -> list[str]:
    """Each <tag> element's text (its attribute lines up to the next element at the same depth or above)."""
    lines = tree.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)E: " + tag + r" ", line)
        if not m:
            continue
        depth, body = len(m.group(1)), [line]
        for nxt in lines[i + 1:]:
            e = re.match(r"^(\s*)E: ", nxt)
            if e and len(e.group(1)) <= depth:
                break
            body.append(nxt)
        out.append("\n".join(body))
    return out


def _component(tree: str, tag: str, name: str) -> str:
    found = [e for e in _elements(tree, tag) if f'"{name}"' in e or f'"com.edgekv.demo{name}"' in e]
    assert len(found) == 1, f"{tag} {name}: {len(found)} in the manifest"
    return found[0]


@needs_tools
def test_manifest_keeps_work_alive_and_guards_scripting(apk):
    tree = _xmltree(apk)
    perms = re.findall(r'E: uses-permission .*?\n\s+A: android:name\(0x01010003\)="([^"]+)"', tree)
    assert {"android.permission.FOREGROUND_SERVICE", "android.permission.FOREGROUND_SERVICE_DATA_SYNC"} <= set(perms)

    service = _component(tree, "service", ".WorkService")
    assert re.search(r"android:foregroundServiceType\(0x01010599\)=\(type 0x11\)0x1\b", service), service  # dataSync
    assert re.search(r"android:exported\(0x01010010\)=\(type 0x12\)0x0\b", service), service

    script = _component(tree, "activity", ".ScriptActivity")
    assert 'android:permission(0x01010006)="android.permission.DUMP"' in script, script  # adb shell: yes; apps: no
    assert "intent-filter" not in script
    main = _component(tree, "activity", ".MainActivity")
    assert "android.intent.category.LAUNCHER" in main and "android:permission" not in main
    # dark mode, locale and font scale recreate it (its state lives in AppState): not handled by hand
    config = re.search(r"android:configChanges\(0x0101001f\)=\(type 0x11\)(0x[0-9a-f]+)", main)
    assert config is None or int(config.group(1), 16) & (0x200 | 0x4 | 0x40000000) == 0, config.group(1)
    bench = _component(tree, "activity", ".BenchActivity")
    assert re.search(r"android:exported\(0x01010010\)=\(type 0x12\)0x0\b", bench), bench
    app = _elements(tree, "application")[0]
    assert 'android:name(0x01010003)="com.edgekv.demo.EdgeKvApp"' in app or '".EdgeKvApp"' in app, app


@needs_tools
def test_icon_and_day_night_theme(apk):
    b = run(["aapt", "dump", "badging", apk]).stdout
    assert re.search(r"application: label='edgekv demo' icon='res/mipmap", b), b
    res = run(["aapt", "dump", "resources", apk]).stdout
    icon = res.split("mipmap/ic_launcher:", 1)[1].split("spec resource", 1)[0]
    assert "config (default)" in icon and "config anydpi-v26" in icon, icon  # vector before 8, adaptive from 8
    theme = res.split("style/AppTheme:", 1)[1].split("spec resource", 1)[0]
    assert "config (default)" in theme and "config night" in theme, theme
    names = set(zipfile.ZipFile(apk).namelist())
    assert {"res/mipmap/ic_launcher.xml", "res/mipmap-anydpi-v26/ic_launcher.xml",
            "res/drawable/ic_launcher_foreground.xml"} <= names
    tree = run(["aapt", "dump", "xmltree", apk, "res/mipmap-anydpi-v26/ic_launcher.xml"]).stdout
    assert "E: adaptive-icon" in tree and "E: foreground" in tree and "E: background" in tree


def _dex(apk_path: Path, tmp: Path) -> str:
    if shutil.which("dexdump") is None:
        pytest.skip("dexdump missing: apt-get install -y dexdump")
    with zipfile.ZipFile(apk_path) as z:
        (tmp / "classes.dex").write_bytes(z.read("classes.dex"))
    r = run(["dexdump", "-d", tmp / "classes.dex"])
    assert r.returncode == 0, r.stderr
    return r.stdout


def _class_code(dex: str, descriptor: str) -> str:
    """dexdump -d's text of one class and its inner classes (MainActivity$1 ...)."""
    parts = re.split(r"(?=Class #\d+\s+-)", dex)
    base = descriptor[:-1]
    return "\n".join(p for p in parts if re.search(rf"Class descriptor\s+:\s+'{re.escape(base)}(\$\w+)?;'", p))


@needs_tools
def test_dex_components_and_guards(apk, tmp_path):
    dex = _dex(apk, tmp_path)
    supers = dict(re.findall(r"Class descriptor\s+:\s+'(\S+)'\s+Access flags\s+:\s+\S+.*?\n\s+Superclass\s+:\s+'(\S+)'",
                             dex))
    assert supers["Lcom/edgekv/demo/EdgeKvApp;"] == "Landroid/app/Application;"
    assert supers["Lcom/edgekv/demo/WorkService;"] == "Landroid/app/Service;"
    assert supers["Lcom/edgekv/demo/ScriptActivity;"] == "Landroid/app/Activity;"
    assert supers["Lcom/edgekv/demo/BenchActivity;"] == "Landroid/app/Activity;"

    # only ScriptActivity reads intent extras; it checks FLAG_DEBUGGABLE (ApplicationInfo.flags & 2) first
    script = _class_code(dex, "Lcom/edgekv/demo/ScriptActivity;")
    assert "Landroid/content/Intent;.getStringExtra" in script
    assert "Landroid/content/pm/ApplicationInfo;.flags:I" in script
    assert re.search(r"and-int/lit8 v\d+, v\d+, #int 2\b", script), "no FLAG_DEBUGGABLE test in ScriptActivity"
    for other in ("MainActivity", "BenchActivity", "EdgeKvApp", "WorkService"):
        code = _class_code(dex, f"Lcom/edgekv/demo/{other};")
        assert code and "getStringExtra" not in code and "getStringArrayExtra" not in code, other

    # onTrimMemory reaches AppState; the service goes to the foreground
    assert "Lcom/edgekv/demo/AppState;.trimMemory:(I)V" in _class_code(dex, "Lcom/edgekv/demo/EdgeKvApp;")
    service = _class_code(dex, "Lcom/edgekv/demo/WorkService;")
    assert "Landroid/app/Service;.startForeground" in service or "Lcom/edgekv/demo/WorkService;.startForeground" in service

    # the Android 8+ branch is there (an inlined SDK_INT stub would compile it out: test_android_package
    # plants one and sees the stub check refuse it)
    assert "Landroid/app/NotificationChannel;.<init>" in service
    assert "Landroid/content/Context;.startForegroundService" in service or "startForegroundService" in service

    # errors can be copied: the message line is selectable, and "Copy message" puts it on the clipboard
    ui = _class_code(dex, "Lcom/edgekv/demo/Ui;")
    assert "Landroid/widget/TextView;.setTextIsSelectable:(Z)V" in ui
    assert "Landroid/content/ClipboardManager;.setPrimaryClip:(Landroid/content/ClipData;)V" in ui
    main = _class_code(dex, "Lcom/edgekv/demo/MainActivity;")
    assert "Lcom/edgekv/demo/Ui;.message:" in main and "Lcom/edgekv/demo/Ui;.copy:" in main


def test_sources_size_views_in_dp():
    """Padding and sizes go through Ui.dp (density-scaled), never raw pixels; text sizes are sp."""
    for path in DEMO.glob("*.java"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r"setPadding\(([^;]*)\);", line)
            if m:
                args = [a.strip() for a in m.group(1).split(",")]
                assert all(a == "0" or "dp(" in a for a in args), f"{path.name}:{n}: raw pixels: {line.strip()}"


@pytest.mark.slow
@pytest.mark.realmodel
def test_ui_state_and_bench_on_smollm2(host_bridge, tmp_path):
    """The real model: SmolLM2-135M (KeyDiff, N = 512, B = 128, host CPU) through AppState as the
    screen asks it (the same ids as the Engine alone and after a benchmark), and the benchmark
    screen's pp512/tg128 measurement with peak RSS next to the plan."""
    import os
    import warnings

    pytest.importorskip("tvm")
    from edgekv.compiler import compile_model
    from edgekv.corpus import natural_text
    from edgekv.models import load_model
    from edgekv.policies import make_policy

    art = tmp_path / "smol"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_model(load_model("smollm2-135m"), make_policy("keydiff", {}), 512, 128, "host", art)
    (tmp_path / "doc.txt").write_text(natural_text()[:6000], encoding="utf-8")
    classes = _compile_ui_check(tmp_path)
    env = {**os.environ, "LD_PRELOAD": str(host_bridge["lib"] / "libedgekv_runtime.so")}
    got = _ui_check(classes, tmp_path / "work", art, tmp_path / "doc.txt", "What is the text about?", "512", "128",
                    "2", env=env, library_path=host_bridge["lib"])
    m = got["model"]
    assert m["state_ids"] == m["alone_ids"] == m["again_ids"] and len(m["state_ids"]) >= 1
    pp, tg = m["bench"]
    assert (pp["test"], tg["test"]) == ("pp512", "tg128")
    assert pp["mean_tok_s"] > 0 and tg["mean_tok_s"] > 0
    assert 0 < pp["peak_rss_bytes"] and pp["plan_bytes"] == m["plan_bytes"] > 0
    assert m["closed_for_memory"]
