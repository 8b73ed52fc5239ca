"""The Android demo app (android/, issue 15), checked on a machine with no device, emulator or NDK.

Fast (default suite):
* ``android/build.sh`` builds a signed APK from a copy of the tree that holds only what a clone
  has (tracked and new, not ignored, files of android/ and runtime/), into an empty directory;
  ``apksigner verify`` passes; ``aapt dump badging`` shows the package, the launcher activity,
  minSdk 24 and arm64-v8a;
* the APK's two libraries are aarch64 ELF shared objects with 16 KB-aligned segments and no ELF
  TLS, whose DT_NEEDED names only Android system libraries (or each other), whose every import is
  a bionic export listed in android/native/bionic-symbols.txt at an API level <= minSdk, and the
  JNI library exports exactly the native methods EdgeKv.java declares;
* the framework stubs the app compiles against match the Android API's signatures (from the PyPI
  wheel chaquopy-stubs-android), and the resource ids they inline match framework-res.apk;
* the runtime's own emulated TLS (android/native/emutls.c) under threads;
* ``finish`` links an Android model.so whose one import from its loader
  (TVMFFIErrorSetRaisedFromCStrParts) is defined inside it, forwarding through a slot.

The bridge itself (android/jni/edgekv_jni.c) and the app's Engine run on a desktop JVM against a
host artifact (``test_bridge_on_a_desktop_jvm``), compared with ``edgekv-run`` on the same
artifact, and again with both libraries built with AddressSanitizer and UBSan
(``test_bridge_is_clean_under_asan``). The aarch64 build of the same call sequence under qemu-user is slow (``-m slow``).

Each test skips, naming the packages, when a tool is missing:
``apt-get install -y --no-install-recommends default-jdk-headless aapt zipalign apksigner zip
android-framework-res clang lld llvm android-libnativehelper-dev libc6-dev-arm64-cross
opencl-c-headers dexdump``; the dexer comes from ``npm pack @nativescript/android@9.1.1``
(android/build.sh fetches it when npm is present).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ANDROID = REPO / "android"
FW = Path("/usr/share/android-framework-res/framework-res.apk")
APT_PACKAGES = ("default-jdk-headless aapt zipalign apksigner zip android-framework-res clang lld llvm "
                "android-libnativehelper-dev libc6-dev-arm64-cross opencl-c-headers dexdump")
APT = f"apt-get install -y --no-install-recommends {APT_PACKAGES}"
DX_VERSION = "9.1.1"
DX_JAR = Path(os.environ.get("EDGEKV_DX_JAR")
              or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
              / "edgekv-android" / f"android-metadata-generator-{DX_VERSION}.jar")
NPM = (f"npm pack @nativescript/android@{DX_VERSION} (android/build.sh runs it when npm is present; "
       "apt-get install -y npm)")
PACKAGE = "com.edgekv.demo"
SYSTEM_LIBS = {"libc.so", "libm.so", "libdl.so", "liblog.so"}
TOOLS = {"java": "default-jdk-headless", "javac": "default-jdk-headless", "jar": "default-jdk-headless",
         "keytool": "default-jdk-headless", "aapt2": "aapt", "aapt": "aapt", "zipalign": "zipalign",
         "apksigner": "apksigner", "zip": "zip", "clang": "clang", "ld.lld": "lld", "llvm-nm": "llvm",
         "llvm-readelf": "llvm"}
FILES = {FW: "android-framework-res", Path("/usr/include/android/nativehelper/jni.h"): "android-libnativehelper-dev",
         Path("/usr/aarch64-linux-gnu/include/stdio.h"): "libc6-dev-arm64-cross",
         Path("/usr/include/CL/cl.h"): "opencl-c-headers"}


def _why_not() -> str | None:
    missing = sorted({f"{t} ({p})" for t, p in TOOLS.items() if shutil.which(t) is None}
                     | {f"{f} ({p})" for f, p in FILES.items() if not f.exists()})
    if missing:
        return f"missing: {', '.join(missing)}; install with: {APT}"
    if not DX_JAR.is_file() and shutil.which("npm") is None:
        return f"the dexer (dx 1.11) is not cached at {DX_JAR} and npm is missing: {NPM}"
    try:
        import tvm_ffi.libinfo  # noqa: F401  (the runtime's C ABI headers)
    except ImportError as exc:
        return f"TVM-FFI headers not importable ({exc}): pip install -e ."
    return None


WHY = _why_not()
needs_tools = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def run(cmd, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def clone_files(dest: Path) -> None:
    """What a clone of this tree has under android/ and runtime/: tracked files and new files
    that git does not ignore (no build outputs)."""
    r = run(["git", "-C", REPO, "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "android",
             "runtime"])
    assert r.returncode == 0, r.stderr
    for rel in filter(None, r.stdout.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def build_apk(tmp_path_factory, name: str = "android-apk", home: Path | None = None, path_prefix: str | None = None,
              args: tuple = ()) -> Path:
    """android/build.sh from a copy of the tree that holds only what a clone has, into an empty
    directory; built once per test session for each ``name`` (tests/test_android_package.py uses
    the same APK). HOME is a directory of the session's (``home``), so the debug key is made there
    once and every APK of the session is signed with it; ``path_prefix`` puts another JDK first."""
    if WHY:
        pytest.skip(WHY)
    base = tmp_path_factory.getbasetemp() / name
    out = base / "out" / "edgekv-demo.apk"
    if out.is_file():
        return out
    shutil.rmtree(base, ignore_errors=True)
    clone_files(base / "src")
    env = {**os.environ, "EDGEKV_ANDROID_OUT": str(base / "out"), "EDGEKV_DX_JAR": str(DX_JAR),
           "HOME": str(home or tmp_path_factory.getbasetemp() / "android-home")}
    env.pop("ANDROID_NDK_HOME", None)  # the freestanding build is the one checked here
    env.pop("EDGEKV_ANDROID_KEYSTORE", None)
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    had_dx = DX_JAR.is_file()
    r = run(["bash", base / "src" / "android" / "build.sh", *args], env=env, timeout=600)
    if r.returncode != 0 and not had_dx and "npm pack" in r.stderr:
        pytest.skip(f"the dexer could not be fetched (no registry?): {NPM}\n{r.stderr[-500:]}")
    assert r.returncode == 0, f"android/build.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    built = Path(r.stdout.strip().splitlines()[-1])
    assert built == out and out.is_file(), r.stdout
    return out


@pytest.fixture(scope="module")
def apk(tmp_path_factory) -> Path:
    return build_apk(tmp_path_factory)


@pytest.fixture(scope="module")
def libs(apk, tmp_path_factory) -> dict[str, Path]:
    """The .so files as the APK holds them."""
    d = tmp_path_factory.mktemp("apk-libs")
    found = {}
    with zipfile.ZipFile(apk) as z:
        for name in z.namelist():
            if name.startswith("lib/") and name.endswith(".so"):
                found[name] = d / Path(name).name
                found[name].write_bytes(z.read(name))
    return found


def badging(apk: Path) -> str:
    r = run(["aapt", "dump", "badging", apk])
    assert r.returncode == 0, r.stderr
    return r.stdout


def bionic_list() -> dict[str, tuple[str, int, str]]:
    rows = {}
    for line in (ANDROID / "native" / "bionic-symbols.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, lib, api, kind = line.split()
        assert name not in rows, f"{name} listed twice"
        assert lib in ("libc", "libm", "libdl", "liblog") and kind in ("func", "object"), line
        rows[name] = (lib + ".so", int(api), kind)
    return rows


def dynamic(path: Path) -> dict:
    """DT_NEEDED, SONAME, program headers and dynamic symbols (llvm-readelf / llvm-nm)."""
    d = run(["llvm-readelf", "-d", "-l", "-W", path])
    assert d.returncode == 0, d.stderr
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", d.stdout)
    soname = re.findall(r"\(SONAME\)\s+Library soname: \[(.+?)\]", d.stdout)
    loads = [line.split() for line in d.stdout.splitlines() if line.strip().startswith("LOAD")]
    tls = [line for line in d.stdout.splitlines() if line.strip().startswith("TLS")]
    undef = run(["llvm-nm", "-D", "--undefined-only", path]).stdout.split()
    defined = run(["llvm-nm", "-D", "--defined-only", path]).stdout.splitlines()
    return {"needed": needed, "soname": soname, "loads": loads, "tls": tls,
            "undefined": sorted(s for s in undef if s not in ("U", "w", "v")),
            "exports": {line.split()[-1] for line in defined if line.split()[-2] in ("T", "D", "B", "R", "V")}}


def min_sdk(apk: Path) -> int:
    return int(re.search(r"sdkVersion:'(\d+)'", badging(apk)).group(1))


# ---- the APK ------------------------------------------------------------------------------------

@needs_tools
def test_build_script_makes_a_signed_apk(apk):
    r = run(["apksigner", "verify", "--verbose", apk])
    assert r.returncode == 0, r.stderr
    assert "Verifies" in r.stdout
    assert "Verified using v2 scheme (APK Signature Scheme v2): true" in r.stdout, r.stdout
    assert "Verified using v3 scheme (APK Signature Scheme v3): true" in r.stdout, r.stdout


@needs_tools
def test_badging_names_the_package_and_launcher_activity(apk):
    b = badging(apk)
    assert f"package: name='{PACKAGE}'" in b, b
    assert f"launchable-activity: name='{PACKAGE}.MainActivity'" in b, b
    assert "native-code: 'arm64-v8a'" in b, b
    assert min_sdk(apk) <= 24, b
    assert "application-debuggable" in b  # the debug APK: run-as, and installable next to nothing else


@needs_tools
def test_apk_holds_the_runtime_the_bridge_and_the_code(apk):
    names = set(zipfile.ZipFile(apk).namelist())
    assert {"lib/arm64-v8a/libedgekv_runtime.so", "lib/arm64-v8a/libedgekv_jni.so", "classes.dex",
            "AndroidManifest.xml", "resources.arsc"} <= names, names
    assert not [n for n in names if n.startswith("lib/") and not n.startswith("lib/arm64-v8a/")], names


@needs_tools
def test_native_libraries_are_android_arm64_shared_objects(libs):
    assert set(libs) == {"lib/arm64-v8a/libedgekv_runtime.so", "lib/arm64-v8a/libedgekv_jni.so"}
    for name, path in libs.items():
        head = path.read_bytes()[:64]
        assert head[:4] == b"\x7fELF" and head[4] == 2 and head[5] == 1, f"{name}: not a 64-bit little-endian ELF"
        e_type, e_machine = struct.unpack_from("<HH", head, 16)
        assert e_type == 3 and e_machine == 183, f"{name}: type {e_type}, machine {e_machine} (want DYN, AArch64)"
        info = dynamic(path)
        assert info["soname"] == [path.name], info["soname"]
        assert info["loads"] and all(int(load[-1], 16) >= 16384 for load in info["loads"]), \
            f"{name}: LOAD segments not 16 KB-aligned (Android 15 phones with 16 KB pages): {info['loads']}"
        assert not info["tls"], f"{name}: ELF TLS needs Android 10 (API 29); the app's minSdk is lower"


@needs_tools
def test_native_libraries_need_only_system_libraries_and_bionic_exports(apk, libs):
    """Every import is a function bionic exports at the app's minSdk (the hand-written list that
    the link stubs are made from), from a library named in DT_NEEDED; the JNI library's other
    imports are the runtime's exports."""
    api = min_sdk(apk)
    bionic = bionic_list()
    ours = {p.name: dynamic(p) for p in libs.values()}
    for so, info in ours.items():
        assert set(info["needed"]) <= SYSTEM_LIBS | set(ours), f"{so} needs {info['needed']}"
        for sym in info["undefined"]:
            if sym in bionic:
                lib, since, _ = bionic[sym]
                assert since <= api, f"{so} imports {sym}, which bionic exports from API {since} (minSdk {api})"
                assert lib in info["needed"], f"{so} imports {sym} from {lib} but does not name it in DT_NEEDED"
            else:
                providers = [o for o in info["needed"] if o in ours and sym in ours[o]["exports"]]
                assert providers, f"{so} imports {sym}: neither a listed bionic export nor defined by a library it needs"
    runtime = ours["libedgekv_runtime.so"]
    assert set(runtime["needed"]) <= SYSTEM_LIBS, runtime["needed"]
    assert "__emutls_get_address" not in set(runtime["undefined"]) | runtime["exports"]  # defined and hidden
    assert {"ekv_model_open", "ekv_session_prefill", "ekv_session_generate", "ekv_session_save", "ekv_session_load",
            "TVMFFIErrorSetRaisedFromCStrParts"} <= runtime["exports"]


@needs_tools
def test_jni_entry_points_are_exported(libs):
    """Each `native` method of EdgeKv.java has its Java_... export, and nothing else is exported
    under the class's prefix."""
    source = (ANDROID / "src" / "com" / "edgekv" / "demo" / "EdgeKv.java").read_text()
    natives = set(re.findall(r"\bnative\s+[\w\[\]]+\s+(\w+)\s*\(", source))
    assert len(natives) >= 15, natives
    exports = dynamic(libs["lib/arm64-v8a/libedgekv_jni.so"])["exports"]
    prefix = "Java_com_edgekv_demo_EdgeKv_"
    assert {prefix + n for n in natives} == {e for e in exports if e.startswith("Java_")}, \
        sorted({prefix + n for n in natives} ^ {e for e in exports if e.startswith("Java_")})
    assert "JNI_OnLoad" in exports


@needs_tools
def test_dex_holds_the_app_classes(apk, tmp_path):
    if shutil.which("dexdump") is None:
        pytest.skip("dexdump missing: apt-get install -y dexdump")
    with zipfile.ZipFile(apk) as z:
        (tmp_path / "classes.dex").write_bytes(z.read("classes.dex"))
    r = run(["dexdump", tmp_path / "classes.dex"])
    assert r.returncode == 0, r.stderr
    classes = dict(re.findall(r"Class descriptor\s+:\s+'(\S+)'\s+Access flags\s+:\s+\S+.*?\n\s+Superclass\s+:\s+'(\S+)'",
                              r.stdout))
    assert classes.get("Lcom/edgekv/demo/MainActivity;") == "Landroid/app/Activity;", classes
    assert {"Lcom/edgekv/demo/EdgeKv;", "Lcom/edgekv/demo/Engine;", "Lcom/edgekv/demo/Staging;"} <= set(classes)
    assert not [c for c in classes if c.startswith("Landroid/")], "framework stubs were dexed"


@needs_tools
def test_stub_resource_ids_match_framework_res():
    """javac inlines android.R's constants into the app: each must be the framework's real id."""
    stub = (ANDROID / "stubs" / "android" / "R.java").read_text()
    consts = re.findall(r"static final class (\w+) \{(.*?)\}", stub, re.S)
    want = {f"{kind}/{name}": int(value, 16) for kind, body in consts
            for name, value in re.findall(r"int (\w+) = (0x[0-9a-fA-F]+);", body)}
    assert want
    dump = run(["aapt", "dump", "resources", FW]).stdout
    real = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"spec resource (0x[0-9a-f]+) android:(\S+):", dump)}
    for key, value in want.items():
        assert real.get(key) == value, f"android.R.{key.replace('/', '.')}: stub {value:#x}, framework-res {real.get(key)}"


API_STUBS_WHEEL = "chaquopy_stubs_android-36.20260406-py3-none-any.whl"
API_STUBS_FETCH = "pip download --no-deps chaquopy-stubs-android==36.20260406 -d ~/.cache/edgekv-android"


@pytest.fixture(scope="module")
def api_signatures(tmp_path_factory) -> Path:
    """The Android API's signatures (API 36), as .pyi files from the PyPI wheel chaquopy-stubs-android."""
    import sys

    for entry in sys.path:  # installed
        if (Path(entry) / "android-stubs" / "widget" / "__init__.pyi").is_file():
            return Path(entry) / "android-stubs"
    wheel = DX_JAR.parent / API_STUBS_WHEEL
    if not wheel.is_file():
        pytest.skip(f"the Android API signatures are not here: {API_STUBS_FETCH}")
    d = tmp_path_factory.mktemp("api")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(d, [n for n in z.namelist() if n.startswith("android-stubs/")])
    return d / "android-stubs"


def android_test_module(name: str):
    """A checker module of android/test (check_stubs, check_api_levels), imported by its path."""
    import importlib
    import sys

    sys.path.insert(0, str(ANDROID / "test"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_framework_stubs_match_the_android_api(api_signatures, tmp_path):
    """Every class and member of android/stubs exists in the real API with the same parameter
    and return types (the app binds to the framework by full signature on the phone), and the
    check notices a wrong one."""
    check_stubs = android_test_module("check_stubs")
    assert check_stubs.check(ANDROID / "stubs", api_signatures) == []
    wrong = tmp_path / "stubs"
    shutil.copytree(ANDROID / "stubs", wrong)
    tv = wrong / "android" / "widget" / "TextView.java"
    tv.write_text(tv.read_text().replace("setTextSize(float size)", "setTextSize(int size)"))
    problems = check_stubs.check(wrong, api_signatures)
    assert len(problems) == 1 and "setTextSize(int)" in problems[0], problems


# ---- native pieces on the host ------------------------------------------------------------------

EMUTLS_CHECK = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
static _Thread_local int counter = 7;            /* initial bytes from a template */
static _Thread_local char buffer[300];           /* zero-initialised */
static _Thread_local _Alignas(64) double aligned[4];
#define MANY(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECL(i) static _Thread_local long many##i = i * 10;
MANY(DECL)
static void *work(void *arg) {
  int id = (int)(intptr_t)arg, bad = 0;
  if (counter != 7 || buffer[0] != 0 || buffer[299] != 0 || ((uintptr_t)aligned & 63) != 0) bad = 1;
#define CHECK(i) if (many##i != i * 10) bad = 1; many##i += id;
  MANY(CHECK)
  for (int k = 0; k < 100000; k++) counter += id;
  memset(buffer, id, sizeof buffer);
  sched_yield();
  if (counter != 7 + 100000 * id || buffer[123] != (char)id) bad = 1;
#define AGAIN(i) if (many##i != i * 10 + id) bad = 1;
  MANY(AGAIN)
  return (void *)(intptr_t)bad;
}
int main(void) {
  pthread_t t[8];
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < 8; i++) pthread_create(&t[i], NULL, work, (void *)(intptr_t)(i + 1));
    for (int i = 0; i < 8; i++) {
      void *bad;
      pthread_join(t[i], &bad);
      if (bad) { printf("thread %d saw wrong thread-local values\n", i); return 1; }
    }
  }
  if (counter != 7) { printf("main thread's counter changed\n"); return 1; }
  printf("ok\n");
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang missing: apt-get install -y clang")
def test_emulated_tls_keeps_each_threads_variables(tmp_path):
    """android/native/emutls.c, which the freestanding Android build links into the runtime (its
    _Thread_local variables below API 29), built on the host with -femulated-tls: every thread
    sees its own copy, initialised from the template or zeros, aligned as declared."""
    (tmp_path / "check.c").write_text(EMUTLS_CHECK)
    exe = tmp_path / "check"
    r = run(["clang", "-std=c11", "-O1", "-femulated-tls", "-pthread", "-Wall", "-Werror", "-o", exe,
             tmp_path / "check.c", ANDROID / "native" / "emutls.c"])
    assert r.returncode == 0, r.stderr
    assert "__emutls_get_address" in run(["nm", exe]).stdout  # the calls really go through it
    r = run([exe], timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


KERNEL_OBJECT = r"""
typedef int int32_t;
void TVMFFIErrorSetRaisedFromCStrParts(const char *kind, const char **parts, int32_t n);
int TVMFFIEnvModRegisterSystemLibSymbol(const char *name, void *symbol);
int __tvm_ffi_fail(void *self, void *args, int n, void *ret);
__attribute__((constructor)) static void register_kernels(void) {  /* as unoptimised TVM builds do */
  TVMFFIEnvModRegisterSystemLibSymbol("__tvm_ffi_fail", (void *)__tvm_ffi_fail);
}
int __tvm_ffi_fail(void *self, void *args, int n, void *ret) {
  const char *parts[1] = {"wrong shapes"};
  TVMFFIErrorSetRaisedFromCStrParts("ValueError", parts, 1);
  return -1;
}
"""


@pytest.mark.parametrize("profile", ["android-cpu", "aarch64-linux"])
@pytest.mark.skipif(shutil.which("clang") is None or shutil.which("ld.lld") is None or shutil.which("llvm-nm") is None,
                    reason="clang/lld/llvm missing: apt-get install -y clang lld llvm")
def test_finish_defines_the_loader_symbol_inside_android_model_so(tmp_path, profile):
    """An app loads the runtime RTLD_LOCAL, so an Android model.so cannot import
    TVMFFIErrorSetRaisedFromCStrParts from it: finish links a forwarder into it (hidden) and
    exports the slot the runtime fills (and a no-op TVMFFIEnvModRegisterSystemLibSymbol, which
    unoptimised kernels call from a constructor). Linked with -Wl,--no-undefined against the bionic stubs
    the link proves model.so imports nothing but bionic's functions; a glibc aarch64 build
    (aarch64-linux, loaded by edgekv-run, which exports the symbol) gets no shim and still imports it."""
    from edgekv.compiler.backend.finish import ERROR_SHIM_SLOT, finish

    stubs = tmp_path / "stubs"
    assert run(["bash", ANDROID / "native" / "stubs.sh", stubs, "24"]).returncode == 0
    (tmp_path / "k.c").write_text(KERNEL_OBJECT)
    triple = "aarch64-linux-android24" if profile == "android-cpu" else "aarch64-linux-gnu"
    obj = tmp_path / "lib0.o"
    assert run(["clang", f"--target={triple}", "-ffreestanding", "-fPIC", "-O2", "-c", tmp_path / "k.c", "-o", obj]).returncode == 0
    art = tmp_path / "art"
    art.mkdir()
    import tarfile

    with tarfile.open(art / "model.tar", "w") as tf:
        tf.add(obj, arcname="lib0.o")
    mtriple = "aarch64-linux-android" if profile == "android-cpu" else "aarch64-linux-gnu"
    manifest = {"format": "edgekv-artifact", "target": {"profile": profile, "tvm": {"kind": "llvm", "mtriple": mtriple}},
                "files": {"library": {"name": "model.tar"}},
                "device": {"toolchain": {"env": "EDGEKV_TEST_CC", "tool": "clang", "status": "needs-toolchain"}}}
    (art / "manifest.json").write_text(json.dumps(manifest))
    os.environ["EDGEKV_TEST_CC"] = (f"clang --target={triple} -nostdlib -fuse-ld=lld -Wl,--no-undefined "
                                    f"-L{stubs} -lc")
    try:
        if profile == "aarch64-linux":
            from edgekv.compiler import CompileError

            with pytest.raises(CompileError, match="TVMFFIErrorSetRaisedFromCStrParts"):
                finish(art)
            return
        so = finish(art)
    finally:
        os.environ.pop("EDGEKV_TEST_CC", None)
    undefined = run(["llvm-nm", "-D", "--undefined-only", so]).stdout
    exported = run(["llvm-nm", "-D", "--defined-only", so]).stdout
    assert "TVMFFIErrorSetRaisedFromCStrParts" not in undefined.replace(ERROR_SHIM_SLOT, ""), undefined
    assert "TVMFFIEnvModRegisterSystemLibSymbol" not in undefined + exported, undefined
    assert re.search(rf"\b[BDV] {ERROR_SHIM_SLOT}$", exported, re.M), exported
    assert re.search(r"\bT __tvm_ffi_fail$", exported, re.M)
    assert not re.search(r" TVMFFIErrorSetRaisedFromCStrParts$", exported, re.M)  # hidden: binds inside
    assert json.loads((art / "manifest.json").read_text())["device"]["toolchain"]["status"] == "finished"


# ---- the bridge and the app's Engine on a desktop JVM ---------------------------------------------

DOCUMENT = ("The lighthouse keeper wrote in the log every night. On Monday the fog came in from the east; "
            "on Tuesday a ship named Aurora passed at dawn. Café owners in the village said the keeper "
            "liked tea, not coffee. " * 2)
QUESTIONS = ["Which ship passed?", "What did the keeper like?", "When did the fog come?"]
PROBE = "plain ASCII, é, 漢字, a parrot 🦜 outside the BMP, and a NUL \x00 byte"
NEW_TOKENS = 12
JVM_PURE = ["EdgeKv", "EdgeKvException", "ModelInfo", "Stats", "SnapshotInfo", "Json", "ManifestKeys", "Artifact",
            "Engine"]


def _jdk_include() -> Path | None:
    javac = shutil.which("javac")
    if javac is None:
        return None
    inc = Path(javac).resolve().parents[1] / "include"
    return inc if (inc / "jni.h").is_file() else None


def _byte_level_tokenizer():
    """Every byte its own token (id = byte value), split by the GPT-2 regex: what tokenizer.ekt
    can hold, for the 256-token tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra, vocab = 0, {}
    for b in range(256):
        if b in printable:
            vocab[chr(b)] = b
        else:
            vocab[chr(256 + extra)] = b
            extra += 1
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def _build_bridge(d: Path, sanitize: bool) -> dict:
    """The runtime built from runtime/src as the app builds it (with android/native/emutls.c and
    -femulated-tls, here for x86-64), the JNI library against it, the app's pure-Java classes
    (compiled without the framework stubs: they must not touch android.*) and HostCheck.
    ``sanitize``: both libraries with gcc's AddressSanitizer and UBSan instead (no emulated TLS:
    that is clang's, and test_emulated_tls_keeps_each_threads_variables covers it)."""
    need = [t for t in ("gcc" if sanitize else "clang", "javac", "java") if shutil.which(t) is None]
    if need or _jdk_include() is None:
        pytest.skip(f"{' '.join(need) or 'the JDK headers'} missing: apt-get install -y clang gcc default-jdk-headless")
    try:
        import tvm_ffi.libinfo
    except ImportError as exc:
        pytest.skip(f"TVM-FFI headers not importable ({exc}): pip install -e .")
    ffi = tvm_ffi.libinfo.find_include_path()
    cmake = (REPO / "runtime" / "CMakeLists.txt").read_text()
    sources = re.findall(r"src/\w+\.c", cmake.split("set(EDGEKV_SOURCES", 1)[1].split(")", 1)[0])
    sources.append("src/device_opencl.c" if Path("/usr/include/CL/cl.h").exists() else "src/device_opencl_none.c")
    version = re.search(r"project\(edgekv_runtime VERSION ([0-9.]+)", cmake).group(1)
    lib = d / "lib"
    lib.mkdir()
    cc, tls = (["gcc", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                "-g"], []) if sanitize else (["clang"], ["-femulated-tls", ANDROID / "native" / "emutls.c"])
    flags = [*cc, "-std=c11", "-O1", "-fPIC", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
             "-D_GNU_SOURCE", f'-DEDGEKV_VERSION="{version}"', f"-I{REPO / 'runtime' / 'include'}",
             f"-I{REPO / 'runtime' / 'src'}", f"-I{ffi}"]
    r = run([*flags, "-shared", "-o", lib / "libedgekv_runtime.so", "-Wl,-soname,libedgekv_runtime.so",
             *[REPO / "runtime" / s for s in sources], *tls, "-lpthread", "-ldl", "-lm"])
    assert r.returncode == 0, r.stderr[-3000:]
    jdk = _jdk_include()
    r = run([*cc, "-std=c11", "-O1", "-fPIC", "-Wall", "-Wextra", "-Werror", f"-I{jdk}", f"-I{jdk / 'linux'}",
             f"-I{REPO / 'runtime' / 'include'}", "-shared", "-o", lib / "libedgekv_jni.so",
             ANDROID / "jni" / "edgekv_jni.c", f"-L{lib}", "-ledgekv_runtime", "-Wl,-rpath,$ORIGIN",
             "-Wl,--no-undefined"])
    assert r.returncode == 0, r.stderr[-3000:]
    classes = d / "classes"
    srcs = [ANDROID / "src" / "com" / "edgekv" / "demo" / f"{n}.java" for n in JVM_PURE]
    r = run(["javac", "--release", "7", "-Xlint:all,-options", "-Werror", "-encoding", "UTF-8", "-d", classes, *srcs,
             ANDROID / "test" / "HostCheck.java"])
    assert r.returncode == 0, r.stdout + r.stderr
    return {"lib": lib, "classes": classes, "sanitize": sanitize}


@pytest.fixture(scope="module")
def host_bridge(tmp_path_factory):
    return _build_bridge(tmp_path_factory.mktemp("host-bridge"), sanitize=False)


@pytest.fixture(scope="module")
def asan_bridge(tmp_path_factory):
    return _build_bridge(tmp_path_factory.mktemp("asan-bridge"), sanitize=True)


def _host_artifact(tmp_path_factory, policy: str, args: dict, question_rows: int = 0) -> Path:
    tvm = pytest.importorskip("tvm")  # noqa: F841
    from edgekv.compiler import compile_model
    from edgekv.models import load_model, tiny_random_model
    from edgekv.policies import make_policy

    d = tmp_path_factory.mktemp("host-art")
    tiny_random_model(0, layers=2).to_hf().save_pretrained(d / "hf")
    _byte_level_tokenizer().save_pretrained(d / "hf")
    compile_model(load_model(str(d / "hf")), make_policy(policy, args), 16, 4,
                  target={"kind": "llvm", "opt-level": 0, "num-cores": 2}, out_dir=d / "art",
                  question_rows=question_rows)
    assert (d / "art" / "tokenizer.ekt").is_file()
    return d / "art"


@pytest.fixture(scope="module")
def host_artifact(tmp_path_factory):
    return _host_artifact(tmp_path_factory, "keydiff", {})


@pytest.fixture(scope="module")
def question_artifact(tmp_path_factory):
    """A SnapKV++ artifact compiled with --question-rows 32."""
    return _host_artifact(tmp_path_factory, "snapkv++", {"window": 4, "kernel": 3}, question_rows=32)


def _host_check(host_bridge, artifact, tmp_path, questions) -> dict:
    """HostCheck (the app's Engine through the bridge on a desktop JVM) on ``artifact``; its JSON."""
    (tmp_path / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    (tmp_path / "probe.txt").write_text(PROBE, encoding="utf-8")
    env = dict(os.environ)
    # A host artifact's model.so is linked by TVM (not by finish): it imports
    # TVMFFIErrorSetRaisedFromCStrParts, which a JVM's RTLD_LOCAL System.loadLibrary hides; preload
    # the runtime as edgekv-run (exporting it) and Python (RTLD_GLOBAL) do. Android artifacts carry
    # the symbol themselves (test_finish_defines_the_loader_symbol_inside_android_model_so).
    env["LD_PRELOAD"] = str(host_bridge["lib"] / "libedgekv_runtime.so")
    if host_bridge["sanitize"]:
        # the JVM is not instrumented: the sanitizer's runtime must come first; the JVM handles
        # SIGSEGV itself (null checks, safepoints) and its own allocations are not ours to leak-check
        asan = run(["gcc", "-print-file-name=libasan.so"]).stdout.strip()
        env["LD_PRELOAD"] = f"{os.path.realpath(asan)} {env['LD_PRELOAD']}"
        env["ASAN_OPTIONS"] = "handle_segv=0:allow_user_segv_handler=1:detect_leaks=0:abort_on_error=0:exitcode=99"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:exitcode=98"
    r = run(["java", "-Xss4m", f"-Djava.library.path={host_bridge['lib']}", "-cp", host_bridge["classes"], "HostCheck",
             artifact, tmp_path / "doc.txt", tmp_path / "snapshots", NEW_TOKENS, tmp_path / "probe.txt",
             *questions], env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Sanitizer" not in r.stderr and "runtime error:" not in r.stderr, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _edgekv_run_answers(artifact, tmp_path, questions) -> list[dict]:
    """edgekv-run's answers on the same artifact, document and questions."""
    from edgekv.runtime import native

    cli = native.cli_path()
    if cli is None:
        pytest.skip("edgekv-run is not built (pip install -e .)")
    report = tmp_path / "run.json"
    res = run([cli, artifact, "--prompt-file", tmp_path / "doc.txt", *sum((["--question", q] for q in questions), []),
               "--max-new-tokens", NEW_TOKENS, "--report", report, "--quiet"], timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(report.read_text())
    return data["document"]["answers"] if "document" in data else data["answers"]


def test_bridge_on_a_desktop_jvm(host_bridge, host_artifact, tmp_path):
    """The app's Engine through the JNI bridge on a real JVM, on the artifact edgekv-run answers
    too: the same ids and text for each question (the first reads the document and saves its
    cache, the later ones load it), the text streamed whole; text into the bridge crosses as
    UTF-16 (a character outside the BMP, a NUL) and encodes as HF tokenizers does; a cancel stops
    the run and the engine answers again after it; refusals arrive as EdgeKvException."""
    got = _host_check(host_bridge, host_artifact, tmp_path, QUESTIONS)

    # what was compiled, and the memory check before loading
    assert got["info"]["policy"] == "keydiff" and got["info"]["budget"] == 16 and got["info"]["block"] == 4
    assert got["info"]["chat"] is False and got["info"]["vocab_size"] == 256 and got["info"]["question_rows"] == 0
    assert got["describe"] == "hf · keydiff · N=16 · B=4 · float32 · custom"  # model dir name, dict target
    assert got["refusal_large"] is None
    assert "Not loading art: its memory plan needs" in got["refusal_small"] and "MiB" in got["refusal_small"]

    # the answers, against edgekv-run on the same artifact, document and questions
    want = _edgekv_run_answers(host_artifact, tmp_path, QUESTIONS)
    answers = got["answers"]
    assert [a["generated_ids"] for a in answers] == [w["generated_ids"] for w in want]
    assert [a["text"] for a in answers] == [w["text"] for w in want]
    assert [a["from_snapshot"] for a in answers] == [False, True, True]
    assert not any(a["question_scoring"] for a in answers)
    doc_tokens = len(DOCUMENT.encode("utf-8"))  # one token per byte
    for a, q in zip(answers, QUESTIONS):
        assert len(a["generated_ids"]) == NEW_TOKENS  # no stop id in this vocabulary
        assert a["streamed"] == a["text"] == bytes(a["generated_ids"]).decode("utf-8", errors="replace")
        assert a["document_tokens"] == doc_tokens and a["question_tokens"] == len(("\n\n" + q).encode("utf-8"))
        assert a["decode_tokens"] == NEW_TOKENS - 1
        assert a["position"] == doc_tokens + a["question_tokens"] + NEW_TOKENS - 1
    first = answers[0]
    assert first["prefill_tokens"] == doc_tokens + first["question_tokens"]  # read now: both parts
    assert answers[1]["prefill_tokens"] == answers[1]["question_tokens"]    # loaded: the question only
    blocks = -(-doc_tokens // 4)
    assert first["progress"][0] == f"document 4/{doc_tokens} 1/{blocks}"
    assert first["progress"][blocks - 1] == f"document {doc_tokens}/{doc_tokens} {blocks}/{blocks}"
    assert any(p.startswith("loading the saved document cache") for p in got["phases"])

    # text in: UTF-16 -> UTF-8 in the bridge, encoded as HF tokenizers does
    assert got["probe_ids"] == _byte_level_tokenizer()(PROBE)["input_ids"] == list(PROBE.encode("utf-8"))

    # cancel, then answer again; errors as exceptions with the runtime's status and message
    assert got["cancelled"].startswith("7 ") and "cancelled" in got["cancelled"], got["cancelled"]
    assert got["after_cancel_ids"] == answers[0]["generated_ids"] and got["after_cancel_from_snapshot"] is False
    assert got["error_missing"].startswith("1 "), got["error_missing"]
    assert got["error_memory"].startswith("5 ") and "memory plan" in got["error_memory"], got["error_memory"]
    assert got["error_empty"].startswith("4 ") and "document" in got["error_empty"], got["error_empty"]


def test_bridge_scores_the_document_with_the_question(host_bridge, question_artifact, tmp_path):
    """An artifact compiled with --question-rows (issue 16): the app reads the document knowing
    each question, as edgekv-run does (the same ids and text, the document read once per new
    question); its saved cache serves the same question again and no other; a question longer
    than the rows is refused with the fix."""
    art = question_artifact
    questions = [QUESTIONS[0], QUESTIONS[0], QUESTIONS[1]]
    got = _host_check(host_bridge, art, tmp_path, questions)
    assert got["info"]["policy"] == "snapkv++" and got["info"]["question_rows"] == 32
    want = _edgekv_run_answers(art, tmp_path, questions)
    answers = got["answers"]
    assert [a["generated_ids"] for a in answers] == [w["generated_ids"] for w in want]
    assert [a["text"] for a in answers] == [w["text"] for w in want]
    assert all(a["question_scoring"] for a in answers)
    assert [a["from_snapshot"] for a in answers] == [False, True, False]  # the cache is the question's
    doc_tokens = len(DOCUMENT.encode("utf-8"))
    assert [a["prefill_tokens"] for a in answers] == [doc_tokens + answers[0]["question_tokens"],
                                                      answers[1]["question_tokens"],
                                                      doc_tokens + answers[2]["question_tokens"]]
    assert got["error_long_question"].startswith("4 "), got["error_long_question"]
    assert "--question-rows" in got["error_long_question"], got["error_long_question"]


def test_bridge_is_clean_under_asan(asan_bridge, host_artifact, question_artifact, tmp_path):
    """The JNI bridge and the runtime under it, built with AddressSanitizer and UBSan, through the
    app's whole call sequence on a desktop JVM (HostCheck: answers from a read document and from
    its saved cache, UTF-16 text in, a cancel, the refusals, and setQuestion on a question-rows
    artifact): no sanitizer report, and the same answers as edgekv-run. Leak checking is off: the
    JVM's own allocations at exit would bury the bridge's (the runtime's leaks are checked by
    tests/test_native_asan.py through edgekv-run)."""
    for name, art, questions in [("plain", host_artifact, QUESTIONS),
                                 ("question", question_artifact, [QUESTIONS[0], QUESTIONS[1]])]:
        work = tmp_path / name
        work.mkdir()
        got = _host_check(asan_bridge, art, work, questions)
        want = _edgekv_run_answers(art, work, questions)
        assert [a["generated_ids"] for a in got["answers"]] == [w["generated_ids"] for w in want], name
        assert [a["text"] for a in got["answers"]] == [w["text"] for w in want], name
        assert got["cancelled"].startswith("7 ") and got["error_empty"].startswith("4 "), got
        if name == "question":
            assert all(a["question_scoring"] for a in got["answers"])
            assert "--question-rows" in got["error_long_question"], got["error_long_question"]


@pytest.mark.slow
def test_bridge_runs_an_opencl_artifact(host_bridge, tmp_path):
    """The app's runtime build has the OpenCL device: through the bridge on a desktop JVM, an
    ``opencl-host`` artifact (the kernels of the phones' ``opencl`` target) runs on this machine's
    OpenCL (PoCL) and answers as edgekv-run does on the same artifact."""
    pytest.importorskip("tvm")
    from edgekv.runtime import native

    try:
        why = native.opencl_unavailable_reason() if native.available() else "the native runtime is not built"
    except Exception as exc:  # noqa: BLE001  (a stale build: pip install -e .)
        why = str(exc)
    if why:
        pytest.skip(why)
    if not Path("/usr/include/CL/cl.h").exists():
        pytest.skip("the bridge's runtime was built without OpenCL headers: apt-get install -y opencl-c-headers")
    import warnings

    from edgekv.compiler import compile_model
    from edgekv.models import load_model, tiny_random_model
    from edgekv.policies import make_policy

    hf = tmp_path / "hf"
    tiny_random_model(0, layers=2).to_hf().save_pretrained(hf)
    _byte_level_tokenizer().save_pretrained(hf)
    art = tmp_path / "ocl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_model(load_model(str(hf)), make_policy("keydiff", {}), 16, 4, "opencl-host", art)
    (tmp_path / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    (tmp_path / "probe.txt").write_text(PROBE, encoding="utf-8")
    env = {**os.environ, "LD_PRELOAD": str(host_bridge["lib"] / "libedgekv_runtime.so")}
    r = run(["java", f"-Djava.library.path={host_bridge['lib']}", "-cp", host_bridge["classes"], "HostCheck", art,
             tmp_path / "doc.txt", tmp_path / "snapshots", NEW_TOKENS, tmp_path / "probe.txt", *QUESTIONS[:2]],
            env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["runtime_devices"] == "cpu,opencl" and got["info"]["device"].startswith("opencl"), got["info"]
    report = tmp_path / "run.json"
    res = run([native.cli_path(), art, "--prompt-file", tmp_path / "doc.txt",
               *sum((["--question", q] for q in QUESTIONS[:2]), []), "--max-new-tokens", NEW_TOKENS, "--report", report,
               "--quiet"], timeout=900)
    assert res.returncode == 0, res.stderr
    want = json.loads(report.read_text())["answers"]
    assert [a["generated_ids"] for a in got["answers"]] == [w["generated_ids"] for w in want]
    assert [a["from_snapshot"] for a in got["answers"]] == [False, True]


# ---- the same call sequence on aarch64 under qemu-user (slow) -------------------------------------

SYSROOT = Path("/usr/aarch64-linux-gnu")
CROSS_APT = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static cmake ninja-build"


def _qemu() -> str | None:
    return shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")


@pytest.mark.slow
def test_bridge_on_aarch64_under_qemu(tmp_path):
    """The runtime's aarch64 Linux build and the JNI library loaded as an app loads them (dlopen
    RTLD_LOCAL, runtime first), driven by android/test/jni_harness.c (a JNIEnv of its own) through
    the Engine's calls on an ``android-cpu`` artifact linked by finish with the cross gcc: the
    answers equal aarch64 edgekv-run's on the same artifact, the second from the saved cache.
    Without finish's error shim the same model.so does not load this way (undefined
    TVMFFIErrorSetRaisedFromCStrParts), while edgekv-run, which exports the symbol, runs it."""
    missing = [t for t in ("aarch64-linux-gnu-gcc", "cmake", "ninja") if shutil.which(t) is None]
    if missing or _qemu() is None or not (SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists():
        pytest.skip(f"{' '.join(missing) or 'qemu-user or the aarch64 glibc'} missing: {CROSS_APT}")
    if not Path("/usr/include/android/nativehelper/jni.h").exists():
        pytest.skip("jni.h missing: apt-get install -y android-libnativehelper-dev")
    pytest.importorskip("tvm")
    import tvm_ffi.libinfo

    import edgekv.compiler.backend.finish as finish_step
    from edgekv.compiler import compile_model
    from edgekv.compiler.errors import ToolchainNeededWarning
    from edgekv.models import load_model, tiny_random_model
    from edgekv.policies import make_policy

    rt = tmp_path / "rt"
    cfg = run(["cmake", "-S", REPO / "runtime", "-B", rt, "-G", "Ninja",
               f"-DCMAKE_TOOLCHAIN_FILE={REPO / 'runtime' / 'cmake' / 'aarch64-linux-gnu.cmake'}",
               f"-DEDGEKV_TVM_FFI_INCLUDE={tvm_ffi.libinfo.find_include_path()}"], timeout=600)
    assert cfg.returncode == 0, cfg.stderr[-3000:]
    build = run(["ninja", "-C", rt, "-j", "2"], timeout=900)
    assert build.returncode == 0, build.stdout[-3000:]
    jni_h = "-I/usr/include/android/nativehelper"
    r = run(["aarch64-linux-gnu-gcc", "-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror", jni_h,
             f"-I{REPO / 'runtime' / 'include'}", "-shared", "-o", rt / "libedgekv_jni.so", ANDROID / "jni" / "edgekv_jni.c",
             f"-L{rt}", "-ledgekv_runtime", "-Wl,--no-undefined"])
    assert r.returncode == 0, r.stderr
    harness = tmp_path / "jni_harness"
    r = run(["aarch64-linux-gnu-gcc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", jni_h, "-o", harness,
             ANDROID / "test" / "jni_harness.c", "-ldl"])
    assert r.returncode == 0, r.stderr

    hf = tmp_path / "hf"
    tiny_random_model(0, layers=2).to_hf().save_pretrained(hf)
    _byte_level_tokenizer().save_pretrained(hf)
    profile = json.loads((REPO / "edgekv" / "profiles" / "targets" / "android-cpu.json").read_text())
    profile["target"]["opt-level"] = 0  # agreement, not speed
    art = tmp_path / "android-cpu"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ToolchainNeededWarning)
        compile_model(load_model(str(hf)), make_policy("keydiff", {}), 16, 4, profile, art)
    os.environ["TVM_NDK_CC"] = "aarch64-linux-gnu-gcc"  # glibc's linker: runs under qemu with the Linux runtime
    try:
        finish_step.finish(art)
        bare = tmp_path / "no-shim"
        shutil.copytree(art, bare)
        real = finish_step.needs_error_shim
        finish_step.needs_error_shim = lambda manifest: False
        try:
            finish_step.finish(bare)
        finally:
            finish_step.needs_error_shim = real
    finally:
        os.environ.pop("TVM_NDK_CC", None)
    (tmp_path / "doc.txt").write_text(DOCUMENT, encoding="utf-8")
    qemu = [_qemu(), "-L", SYSROOT, "-E", f"LD_LIBRARY_PATH={rt}"]

    def harness_run(artifact):
        res = run([*qemu, harness, rt / "libedgekv_runtime.so", rt / "libedgekv_jni.so", artifact, tmp_path / "doc.txt",
                   tmp_path / f"{artifact.name}.ekv", NEW_TOKENS, *QUESTIONS[:2]], timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    def text(units):
        return b"".join(u.to_bytes(2, "little") for u in units).decode("utf-16-le")

    got = harness_run(art)
    assert "open_error" not in got, text(got["open_error"][1])
    report = tmp_path / "run.json"
    res = run([*qemu, rt / "edgekv-run", art, "--prompt-file", tmp_path / "doc.txt",
               *sum((["--question", q] for q in QUESTIONS[:2]), []), "--max-new-tokens", NEW_TOKENS, "--report", report,
               "--quiet"], timeout=600)
    assert res.returncode == 0, res.stderr
    want = json.loads(report.read_text())["answers"]
    assert text(got["info"]["targetProfile"]) == "android-cpu" and text(got["info"]["targetArch"]) == "aarch64"
    assert [a["generated_ids"] for a in got["answers"]] == [w["generated_ids"] for w in want]
    assert ["".join(text(t[1]) for t in a["tokens"]) for a in got["answers"]] == [w["text"] for w in want]
    doc_tokens = len(DOCUMENT.encode("utf-8"))
    assert got["document_tokens"] == doc_tokens and got["progress"][-1] == f"{doc_tokens}/{doc_tokens}"
    q0, q1 = got["answers"]
    assert q0["prefillTokens"] == doc_tokens + len(("\n\n" + QUESTIONS[0]).encode())  # read, then the question
    assert q1["prefillTokens"] == len(("\n\n" + QUESTIONS[1]).encode())              # from the saved cache
    assert got["cancelled"][0] == 7 and got["cancel_progress_calls"] == 2
    assert got["missing"][0] == 1

    bare_run = harness_run(bare)
    assert bare_run["open_error"][0] == 3, bare_run
    assert "undefined symbol: TVMFFIErrorSetRaisedFromCStrParts" in text(bare_run["open_error"][1])
    res = run([*qemu, rt / "edgekv-run", bare, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--quiet"], timeout=600)
    assert res.returncode == 0, res.stderr  # edgekv-run exports the symbol: the shim is for apps
