"""A clean exit on every OpenCL driver (issue 35): models of an OpenCL artifact opened, run and
closed several times in one process, two at once (they share one device), through the entry
points users call — ``edgekv-run --repeat-open`` (the C API) and the Python ctypes binding — on
PoCL, with the runtime built under AddressSanitizer + UBSan: exit 0, no sanitizer report, the
same ids every round. ``EDGEKV_OPENCL_TRACE_RELEASE=1``'s log is checked for the teardown order
the runtime promises: every object created is released exactly once, a sub-buffer before its
arena, a kernel before its program, everything before the queue and the context, nothing used
after its release.

NVIDIA's driver crashed in teardown where PoCL did not; the same command runs on a GPU machine
(docs/NATIVE.md, "Teardown"). Needs cmake, a C compiler, the OpenCL headers and PoCL
(apt-get install cmake gcc opencl-c-headers pocl-opencl-icd); skips, saying so, without them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

tvm = pytest.importorskip("tvm")

from edgekv.models import tiny_random_model  # noqa: E402
from edgekv.policies import make_policy  # noqa: E402
from edgekv.runtime import native  # noqa: E402

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"
SANITIZER_MARKS = ("AddressSanitizer", "LeakSanitizer", "runtime error:", "UndefinedBehaviorSanitizer")
PROMPT_IDS = ",".join(str(i) for i in range(3, 40))
ROUNDS = 3
TRACE = re.compile(r"^edgekv opencl: (create|release) ([a-z -]+?)(?: \(cached binary\))? (0x[0-9a-f]+|\(nil\))"
                   r"(?: of (0x[0-9a-f]+))?(?: \((\d+) bytes\))? \[device (0x[0-9a-f]+)\]$")


def _asan_env(extra: dict | None = None) -> dict:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"),
           # the driver (PoCL, LLVM) keeps allocations for the process's life: not ours to leak-check
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:exitcode=86",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87"}
    for k in ("POCL_CACHE_DIR", "XDG_CACHE_HOME", "OCL_ICD_VENDORS"):
        if k in os.environ:
            env[k] = os.environ[k]
    env.update(extra or {})
    return env


@pytest.fixture(scope="module")
def asan_build(tmp_path_factory):
    """libedgekv_runtime.so and edgekv-run from runtime/, with -DEDGEKV_ASAN=ON and the OpenCL device."""
    if shutil.which("cmake") is None or shutil.which("cc") is None:
        pytest.skip("cmake and a C compiler are needed (apt-get install cmake gcc)")
    if not Path("/usr/include/CL/cl.h").exists():
        pytest.skip("the OpenCL headers are needed for the runtime's OpenCL device (apt-get install opencl-c-headers)")
    reason = native.opencl_unavailable_reason() if native.available() else "the native runtime is not built"
    if reason:
        pytest.skip(reason)
    build = tmp_path_factory.mktemp("asan-ocl-build")
    ffi = subprocess.run([sys.executable, "-c", "import tvm_ffi.libinfo as l; print(l.find_include_path())"],
                         capture_output=True, text=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run(["cmake", "-S", str(RUNTIME_DIR), "-B", str(build), *gen, "-DEDGEKV_ASAN=ON",
                          "-DCMAKE_BUILD_TYPE=Debug", f"-DEDGEKV_TVM_FFI_INCLUDE={ffi.stdout.strip()}"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stderr
    assert "with the OpenCL device" in cfg.stdout, cfg.stdout[-2000:]
    made = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return build


@pytest.fixture(scope="module")
def artifact(shared_artifact):
    # the same build as tests/test_opencl.py's KeyDiff artifact: compiled once per session
    return shared_artifact(tiny_random_model(seed=1, layers=2), make_policy("keydiff"), 24, 8, "opencl-host")


def check_release_order(stderr: str) -> dict[str, int]:
    """Replay EDGEKV_OPENCL_TRACE_RELEASE's log; fail on any release out of order. Counts by kind."""
    live: dict[str, tuple[str, str | None]] = {}  # handle → (kind, parent)
    counts: dict[str, int] = {}
    lines = [ln for ln in stderr.splitlines() if ln.startswith("edgekv opencl: ")]
    assert lines, "no trace lines: EDGEKV_OPENCL_TRACE_RELEASE did nothing"
    for n, line in enumerate(lines):
        m = TRACE.match(line)
        assert m, f"line {n}: not a trace line: {line!r}"
        verb, kind, handle, parent = m.group(1), m.group(2).strip(), m.group(3), m.group(4)
        kind = kind.replace("weight ", "")
        if verb == "create":
            assert handle not in live, f"line {n}: {handle} created while still live: {line}"
            live[handle] = (kind, parent)
            counts[kind] = counts.get(kind, 0) + 1
            continue
        assert handle in live, f"line {n}: release of {handle}, which is not live (released twice?): {line}"
        made_kind, made_parent = live.pop(handle)
        assert made_kind == kind, f"line {n}: {handle} created as a {made_kind}, released as a {kind}"
        if kind == "sub-buffer":
            assert made_parent in live, f"line {n}: sub-buffer {handle} released after its arena {made_parent}"
        if kind == "program":
            kernels = [h for h, (k, p) in live.items() if k == "kernel" and p == handle]
            assert not kernels, f"line {n}: program {handle} released before its kernels {kernels}"
        if kind in ("queue", "context"):
            others = {h: k for h, (k, _) in live.items() if k not in ("queue", "context")}
            assert not others, f"line {n}: {kind} released while {others} are live"
    assert not live, f"never released: {live}"
    return counts


def test_edgekv_run_opens_and_closes_an_opencl_model_repeatedly_under_asan(asan_build, artifact):
    res = subprocess.run([str(asan_build / "edgekv-run"), str(artifact), "--prompt-ids", PROMPT_IDS,
                          "--max-new-tokens", "6", "--repeat-open", str(ROUNDS)], capture_output=True, text=True,
                         env=_asan_env({"EDGEKV_OPENCL_TRACE_RELEASE": "1"}), timeout=600)
    bad = [m for m in SANITIZER_MARKS if m in res.stderr]
    assert res.returncode == 0 and not bad, res.stderr[-4000:]
    assert f"repeat-open: {ROUNDS} rounds ok" in res.stdout
    assert res.stderr.count("freed and closed (opencl: ") == ROUNDS
    counts = check_release_order(res.stderr)
    # per round one device (the two models share it): one context, one queue, its kernels
    assert counts["context"] == counts["queue"] == ROUNDS, counts
    assert counts["sub-buffer"] > 0 and counts["kernel"] > 0, counts


def test_repeat_open_refuses_what_it_does_not_run(asan_build, artifact):
    res = subprocess.run([str(asan_build / "edgekv-run"), str(artifact), "--prompt-ids", "1,2",
                          "--repeat-open", "0"], capture_output=True, text=True, env=_asan_env(), timeout=60)
    assert res.returncode == 2 and "--repeat-open 0: give a count of rounds" in res.stderr, res.stderr
    res = subprocess.run([str(asan_build / "edgekv-run"), str(artifact), "--prompt", "x", "--question", "q",
                          "--repeat-open", "2"], capture_output=True, text=True, env=_asan_env(), timeout=60)
    assert res.returncode == 2 and "--repeat-open runs the prompt only" in res.stderr, res.stderr


def test_python_binding_opens_and_closes_an_opencl_model_repeatedly_under_asan(asan_build, artifact):
    """The ctypes binding (edgekv.runtime.native) on the ASan library, in a fresh interpreter that
    preloads the sanitizer's runtime; models closed in every order, two open at once."""
    libasan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not libasan or not Path(libasan).exists():
        pytest.skip("the compiler's libasan.so was not found (cc -print-file-name=libasan.so)")
    script = textwrap.dedent(f"""
        from edgekv.runtime import native
        prompt = [{PROMPT_IDS}]
        first = None
        for round in range({ROUNDS}):
            a = native.NativeRuntime({str(artifact)!r})
            b = native.NativeRuntime({str(artifact)!r})
            ids = [a.generate(prompt, 6), b.generate(prompt, 6)]
            first = first or ids[0]
            assert ids == [first, first], (round, ids, first)
            assert a.info["device"].startswith("opencl: "), a.info["device"]
            (a if round % 2 else b).close()
            (b if round % 2 else a).close()
        print("python repeat-open ok", first)
    """)
    env = _asan_env({"LD_PRELOAD": os.path.realpath(libasan), "EDGEKV_OPENCL_TRACE_RELEASE": "1",
                     "EDGEKV_RUNTIME_LIB": str(asan_build / "libedgekv_runtime.so"),
                     "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    env["ASAN_OPTIONS"] += ":handle_segv=1"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    bad = [m for m in SANITIZER_MARKS if m in res.stderr]
    assert res.returncode == 0 and not bad, res.stdout[-2000:] + res.stderr[-4000:]
    assert "python repeat-open ok" in res.stdout
    counts = check_release_order(res.stderr)
    assert counts["context"] == ROUNDS, counts


def test_release_order_check_catches_what_it_promises():
    """The trace checker itself: a sub-buffer after its arena, a double release, a leak."""
    ok = ["edgekv opencl: create context 0xc [device 0xd]", "edgekv opencl: create queue 0xq of 0xc [device 0xd]",
          "edgekv opencl: create buffer 0xa (64 bytes) [device 0xd]",
          "edgekv opencl: create sub-buffer 0xb of 0xa (16 bytes) [device 0xd]"]
    good = ok + ["edgekv opencl: release sub-buffer 0xb of 0xa (16 bytes) [device 0xd]",
                 "edgekv opencl: release buffer 0xa (64 bytes) [device 0xd]",
                 "edgekv opencl: release queue 0xq [device 0xd]", "edgekv opencl: release context 0xc [device 0xd]"]
    fix = [ln.replace("0xq", "0xe") for ln in good]
    assert check_release_order("\n".join(fix))["sub-buffer"] == 1
    swapped = fix[:4] + [fix[5], fix[4]] + fix[6:]
    with pytest.raises(AssertionError, match="released after its arena"):
        check_release_order("\n".join(swapped))
    with pytest.raises(AssertionError, match="not live"):
        check_release_order("\n".join(fix[:6] + [fix[5]]))
    with pytest.raises(AssertionError, match="never released"):
        check_release_order("\n".join(fix[:5]))
    with pytest.raises(AssertionError, match="released while"):
        check_release_order("\n".join(fix[:4] + fix[6:]))


REPEAT_OPEN_JAVA = """
import com.edgekv.demo.EdgeKv;
import java.util.Arrays;

/** The app's native methods (EdgeKv, through android/jni/edgekv_jni.c): open, run and close an
 *  artifact's models repeatedly, two at once, closed in alternating order. */
public class RepeatOpen {
    public static void main(String[] args) throws Exception {
        EdgeKv.loadLibraries();
        int rounds = Integer.parseInt(args[1]);
        String[] parts = args[2].split(",");
        int[] prompt = new int[parts.length];
        for (int i = 0; i < parts.length; i++) prompt[i] = Integer.parseInt(parts[i]);
        int[] first = null;
        for (int r = 0; r < rounds; r++) {
            long[] models = {EdgeKv.modelOpen(args[0], 2, 0), EdgeKv.modelOpen(args[0], 2, 0)};
            long[] sessions = {EdgeKv.sessionNew(models[0]), EdgeKv.sessionNew(models[1])};
            for (int k = 0; k < 2; k++) {
                int[] ids = EdgeKv.generate(sessions[k], prompt, 6, 0f, 1f, 0L, null, null);
                if (first == null) first = ids;
                if (!Arrays.equals(first, ids)) throw new AssertionError("round " + r + ": other ids");
            }
            int a = r % 2, b = 1 - a;
            EdgeKv.sessionFree(sessions[a]);
            EdgeKv.modelClose(models[a]);
            EdgeKv.sessionFree(sessions[b]);
            EdgeKv.modelClose(models[b]);
        }
        System.out.println("jni repeat-open ok " + Arrays.toString(first));
    }
}
"""


def test_jni_bridge_opens_and_closes_an_opencl_model_repeatedly_under_asan(artifact, tmp_path_factory):
    """The JNI bridge on a desktop JVM (as tests/test_android_app.py runs it), built with gcc's
    ASan + UBSan, on the OpenCL artifact on PoCL."""
    from test_android_app import _build_bridge, run

    reason = native.opencl_unavailable_reason() if native.available() else "the native runtime is not built"
    if reason:
        pytest.skip(reason)
    bridge = _build_bridge(tmp_path_factory.mktemp("jni-asan"), sanitize=True)
    src = tmp_path_factory.mktemp("repeat-java")
    (src / "RepeatOpen.java").write_text(REPEAT_OPEN_JAVA)
    made = run(["javac", "--release", "8", "-cp", bridge["classes"], "-d", bridge["classes"], src / "RepeatOpen.java"])
    assert made.returncode == 0, made.stdout + made.stderr
    asan = run(["gcc", "-print-file-name=libasan.so"]).stdout.strip()
    env = dict(os.environ)
    # as in test_android_app: the sanitizer first; the runtime preloaded for model.so's FFI symbol;
    # the JVM handles SIGSEGV itself and its allocations are not ours to leak-check
    env["LD_PRELOAD"] = f"{os.path.realpath(asan)} {bridge['lib'] / 'libedgekv_runtime.so'}"
    # the JVM's threads set their own signal stacks: ASan's own (use_sigaltstack) fails to unmap
    # at a JVM thread's exit ("unable to unmap"), a sanitizer/JVM clash, not the bridge's
    env["ASAN_OPTIONS"] = ("handle_segv=0:allow_user_segv_handler=1:use_sigaltstack=0:detect_leaks=0:"
                           "abort_on_error=0:exitcode=99")
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:exitcode=98"
    env["EDGEKV_OPENCL_TRACE_RELEASE"] = "1"
    res = run(["java", "-Xss4m", f"-Djava.library.path={bridge['lib']}", "-cp", bridge["classes"], "RepeatOpen",
               artifact, ROUNDS, PROMPT_IDS], env=env, timeout=600)
    bad = [m for m in SANITIZER_MARKS if m in res.stderr]
    other = "\n".join(ln for ln in res.stderr.splitlines() if not ln.startswith("edgekv opencl: "))
    assert res.returncode == 0 and not bad, f"exit {res.returncode}, {bad}\n{res.stdout[-2000:]}\n{other[-6000:]}"
    assert "jni repeat-open ok" in res.stdout
    assert check_release_order(res.stderr)["context"] == ROUNDS
