"""The child process: put itself under the cap, load the model, run one job, report.

``python -m edgekv.simulate.child JOB.json``. Everything it says goes to two files in the
job's private temp folder: ``events.jsonl`` (stage, memory samples, prefill progress; one
JSON line each, flushed) and ``result.json`` (written last, atomically). Exit codes:
0 done, 3 out of memory under the cap, 4 any other error. A child killed by a signal (the
cgroup OOM killer, an abort inside a C library that could not allocate) writes nothing more;
the parent reads the events it left."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

EXIT_OK, EXIT_OOM, EXIT_ERROR = 0, 3, 4
_OOM_TEXT = re.compile(r"can't allocate memory|Cannot allocate memory|out of memory|std::bad_alloc|ENOMEM", re.I)
_REQ = re.compile(r"tried to allocate (\d+) bytes")
_NATIVE_OOM = re.compile(r"cannot allocate|out of (host )?memory|failed to map segment|cannot start worker thread",
                         re.I)


class _Events:
    def __init__(self, path: str):
        self.fh = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def emit(self, **rec) -> None:
        rec["t"] = time.time()
        line = json.dumps(rec) + "\n"
        with self.lock:
            try:
                self.fh.write(line)
                self.fh.flush()
            except Exception:  # noqa: BLE001 - reporting must never be what fails the run
                pass


def _status(pid: int | str = "self") -> dict:
    from .limits import proc_status

    return proc_status(pid)


class _Sampler(threading.Thread):
    """Samples a process's VmData / VmRSS every ``period`` s (this one, or the native runtime it
    started) and keeps the peaks."""

    def __init__(self, events: _Events, period: float = 0.02):
        super().__init__(daemon=True)
        self.events, self.period = events, period
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()
        self.last_emit = 0.0
        self.pid: int | str | None = "self"  # None: nothing to follow yet

    def sample(self) -> dict:
        s = _status(self.pid) if self.pid is not None else {}
        for k, v in s.items():
            if v > self.peak.get(k, 0):
                self.peak[k] = v
        return s

    def run(self) -> None:
        while not self.stop.is_set():
            s = self.sample()
            now = time.time()
            if now - self.last_emit > 0.5:
                self.events.emit(kind="sample", status=s, peak=dict(self.peak))
                self.last_emit = now
            self.stop.wait(self.period)


def _write_result(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _run_artifact(job: dict, ids, events: _Events, sampler: _Sampler, progress) -> dict:
    """A compiled artifact through the host runtime (TVM Relax VM). Its report is not
    ``run_report.build_report``'s: `edgekv simulate` keeps the runtime's own record
    (``HostRuntime.report()``: the manifest's policy, target and memory plan as written, the raw
    stats) with the timing keys its summary reads, under ``engine: artifact``."""
    from ..runtime import HostRuntime

    rt = HostRuntime(job["artifact"])
    events.emit(kind="stage", stage="loaded", status=sampler.sample())
    t0 = time.perf_counter()
    out = rt.generate(ids.numpy(), int(job["max_new_tokens"]), progress=progress)
    wall = time.perf_counter() - t0
    s = rt.stats
    rep = rt.report()
    rep.update({
        "engine": "artifact", "prompt_tokens": int(ids.numel()), "generated_tokens": len(out),
        "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds, "wall_seconds": wall,
        "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else None,
        "decode_tok_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else None,
    })
    return rep


def _run_native(job: dict, events: _Events, sampler: _Sampler) -> int:
    """The artifact in ``edgekv-run``, the native runtime's own command, as the measured process:
    the cap is applied in it between fork and exec (this Python process stays outside, free to
    watch and report) and the samples follow it, so the cap meets the runtime an app would use —
    no Python, torch or TVM in it. Report keys as ``_run_artifact``'s."""
    from .limits import apply_in_child

    import subprocess

    report = os.path.join(os.path.dirname(job["result"]), "native_report.json")  # the job's private folder
    cmd = [job["native_cli"], job["artifact"], "--prompt-ids", "@" + job["prompt_ids_csv"], "--max-new-tokens",
           str(int(job["max_new_tokens"])), "--report", report, "--quiet", "--allow-beyond-context"]
    if job.get("threads"):
        cmd += ["--threads", str(int(job["threads"]))]
    events.emit(kind="stage", stage="loading", status={})
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: apply_in_child(job["mechanism"], int(job["cap"]), job.get("cgroup_dir")))
    sampler.pid = proc.pid  # from here the samples (and the peaks) are the native runtime's
    _, err = proc.communicate()
    sampler.stop.set()
    text = err.decode("utf-8", "replace").strip()
    if proc.returncode == 0 and os.path.isfile(report):
        with open(report) as fh:
            rep = json.load(fh)
        mem = rep.get("memory") or {}
        if mem.get("peak_rss_bytes"):
            sampler.peak["VmHWM"] = max(sampler.peak.get("VmHWM", 0), int(mem["peak_rss_bytes"]))
        rep.update({"engine": "native (edgekv-run)",
                    "wall_seconds": (rep.get("prefill_seconds") or 0) + (rep.get("decode_seconds") or 0)})
        events.emit(kind="stage", stage="done", status={})
        _write_result(job["result"], {"status": "ok", "report": rep, "peak": sampler.peak, "final": {}})
        return EXIT_OK
    # the runtime's allocation failures ("cannot allocate the KV cache ...", "out of memory"), and
    # the loader's when the library's writable segments do not fit ("failed to map segment")
    oom = bool(_OOM_TEXT.search(text) or _NATIVE_OOM.search(text)) or proc.returncode < 0
    _write_result(job["result"], {"status": "oom" if oom else "error", "stage": "native run",
                                  "error": f"edgekv-run exited {proc.returncode}: {text[-1500:]}",
                                  "requested_bytes": None, "peak": sampler.peak, "final": {}})
    return EXIT_OOM if oom else EXIT_ERROR


def main(job_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    from .limits import apply_in_child

    events = _Events(job["events"])
    if job.get("native_cli"):  # the cap goes on the runtime's own process, not on this Python one
        sampler = _Sampler(events)
        sampler.pid = None  # until the runtime starts: this process's memory is not the run's
        sampler.start()
        events.emit(kind="stage", stage="started", status={})
        return _run_native(job, events, sampler)
    reserve = bytearray(8 << 20)  # freed when memory runs out, so the report can still be written
    apply_in_child(job["mechanism"], int(job["cap"]), job.get("cgroup_dir"))
    sampler = _Sampler(events)
    sampler.sample()
    try:
        sampler.start()
    except RuntimeError as exc:  # "can't start new thread": the cap leaves no room for a thread's stack
        del reserve
        _write_result(job["result"], {"status": "oom", "stage": "start", "error": f"{type(exc).__name__}: {exc}",
                                      "requested_bytes": None, "peak": sampler.peak, "final": _status()})
        return EXIT_OOM
    events.emit(kind="stage", stage="started", status=_status())
    stage = "import"
    try:
        import torch

        from ..engine import Sampler
        from ..engine.session import open_eager_session
        from ..job import run
        from .source import build_model

        if job.get("threads"):
            from ..threads import apply_threads

            apply_threads(int(job["threads"]))  # torch and TVM (an artifact) alike
        stage = "load"
        events.emit(kind="stage", stage="loading", status=sampler.sample())
        with open(job["prompt_ids"]) as fh:
            ids = torch.tensor(json.load(fh), dtype=torch.long)
        done = [0, 0.0]

        def progress(n: int) -> None:
            done[0] += n
            now = time.time()
            if now - done[1] > 0.25:
                events.emit(kind="progress", tokens=done[0], status=sampler.sample())
                done[1] = now

        if job.get("artifact"):
            report = _run_artifact(job, ids, events, sampler, progress)
            sampler.stop.set()
            events.emit(kind="stage", stage="done", status=_status())
            _write_result(job["result"], {"status": "ok", "report": report, "peak": sampler.peak, "final": _status()})
            return EXIT_OK
        model = build_model(job["spec"])
        events.emit(kind="stage", stage="loaded", status=sampler.sample(), weight_bytes=model.weight_bytes)
        stage = "run"

        max_new = int(job["max_new_tokens"])
        session = open_eager_session(model, job["policy"], job.get("policy_args") or {}, str(job["budget"]),
                                     int(job["block"]), int(ids.numel()) + max_new, None)
        result = run(session, model, prompt_ids=ids, max_new_tokens=max_new, new_sampler=Sampler, progress=progress)
        sampler.sample()
        sampler.stop.set()
        events.emit(kind="stage", stage="done", status=_status())
        _write_result(job["result"], {"status": "ok", "report": result.report, "peak": sampler.peak,
                                      "final": _status()})
        return EXIT_OK
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a report
        del reserve
        sampler.stop.set()
        text = f"{type(exc).__name__}: {exc}"
        oom = isinstance(exc, MemoryError) or bool(_OOM_TEXT.search(str(exc)))
        m = _REQ.search(str(exc))
        try:
            _write_result(job["result"], {
                "status": "oom" if oom else "error", "stage": stage, "error": text[:2000],
                "requested_bytes": int(m.group(1)) if m else None, "peak": sampler.peak, "final": _status(),
            })
        except BaseException:  # noqa: BLE001
            pass
        return EXIT_OOM if oom else EXIT_ERROR


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (and any allocation it would need under the cap)
