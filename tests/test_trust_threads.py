"""Thread counts (issue 31, item 2): one rule in the Python CLI (edgekv/threads.py) and the native
runtime (runtime/src/threads.c) — the same usable cores here, a request above them clamped with a
warning — so `--threads 999` finishes; and SIGINT ends a native run promptly (the pool stops at
the next kernel call). The time SIGINT took is printed, not asserted as a speed: the bound below is
a correctness check that the run was interruptible at all."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from edgekv import threads
from trust_common import edgekv, native_ready, trust_artifact

needs_native = pytest.mark.skipif(not native_ready(), reason="the native runtime is not built: `pip install -e .` "
                                                             "builds runtime/ (needs cmake and a C compiler)")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    pytest.importorskip("tvm")
    return trust_artifact(tmp_path_factory)


def test_python_clamps_a_request_above_the_usable_cores():
    cores = threads.usable_cores()
    choice = threads.choose_threads(999)
    assert (choice.count, choice.asked, choice.clamped) == (cores, 999, True)
    assert not threads.choose_threads(1).clamped


@needs_native
def test_native_and_python_choose_the_same_cores(art):
    from edgekv.runtime import native

    rt = native.NativeRuntime(art, threads=999)
    assert rt.info["threads_cores"] == threads.usable_cores()
    assert rt.threads == threads.choose_threads(999).count
    rt.close()


@needs_native
def test_edgekv_run_threads_999_is_clamped_and_finishes(art):
    from edgekv.runtime import native

    res = subprocess.run([str(native.cli_path()), str(art), "--prompt", "hello world " * 40, "--max-new-tokens", "8",
                          "--threads", "999"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    cores = threads.usable_cores()
    assert "warning: --threads 999 is more than the" in res.stderr
    assert f", {cores} threads;" in res.stderr


@needs_native
def test_edgekv_cli_threads_999_is_clamped_and_finishes(art):
    res = edgekv("run", art, "--prompt", "hello world " * 40, "--max-new-tokens", "8", "--threads", "999",
                 timeout=300)
    assert res.returncode == 0, res.stderr
    assert "--threads 999 is more than the" in res.stderr.replace("\n", " ")


@needs_native
def test_sigint_ends_edgekv_run_promptly(art):
    from edgekv.runtime import native

    # a long run: 64 threads asked (clamped), a long prompt past the context, many tokens
    proc = subprocess.Popen([str(native.cli_path()), str(art), "--prompt", "a b c d e f g h " * 3000,
                             "--max-new-tokens", "100000", "--ignore-eos", "--allow-beyond-context", "--threads", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    assert proc.poll() is None, "the run ended before the signal: make it longer"
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("edgekv-run ignored SIGINT for 10 s")
    seconds = time.perf_counter() - t0
    print(f"\nedgekv-run --threads 64 exited {seconds:.3f} s after SIGINT (exit {proc.returncode})")
    assert proc.returncode == 130, err
    assert "cancelled" in err


@needs_native
def test_sigint_ends_the_python_cli_inside_one_long_native_call(art, tmp_path):
    """`edgekv run ARTIFACT` makes one ctypes call for the whole prefill: Ctrl-C in the middle of it
    must end the run (the runtime's cancel flag, set from the waiting main thread), with exit 130
    and one line, not a traceback after the prefill."""
    import os
    import sys

    prompt = tmp_path / "long.txt"
    prompt.write_text("a b c d e f g h " * 6000)  # ~96k tokens of the byte tokenizer: one long prefill call
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    proc = subprocess.Popen([sys.executable, "-m", "edgekv", "run", str(art), "--prompt-file", str(prompt),
                             "--max-new-tokens", "4", "--allow-beyond-context", "--runtime", "native"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    said = []
    for line in proc.stderr:  # wait until the prefill call has begun
        said.append(line)
        if "prefill:" in line:
            break
    time.sleep(1.5)
    assert proc.poll() is None, "the run ended before the signal: make the prompt longer\n" + "".join(said)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=10)[1], None
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("edgekv run ignored SIGINT for 10 s (the native prefill ran on)")
    seconds = time.perf_counter() - t0
    err = "".join(said) + (rest or "")
    print(f"\nedgekv run ARTIFACT exited {seconds:.3f} s after SIGINT (exit {proc.returncode})")
    assert proc.returncode == 130, err
    assert "cancelled (Ctrl-C)" in err and "Traceback" not in err, err
