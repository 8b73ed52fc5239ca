"""The parent side: refuse a static plan above the cap, run the job in a child under the
cap, watch it, and turn whatever happens into an outcome. Never raises for the child's
failures (memory, errors, signals); only for the parent's own bad inputs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..artifact.manifest import Keys
from ..artifact_target import artifact_runs_here
from ..memory import MemoryPlan, plan_memory
from ..policies import make_policy
from . import limits
from .source import Target

FITS, DOES_NOT_FIT, REFUSED, ERROR = "fits", "does not fit", "refused (plan above cap)", "error"
NOT_RUN = "not run (cross-compiled artifact)"


@dataclass
class Job:
    target: Target
    prompt_ids: list[int]
    policy: str
    policy_args: dict
    budget: int  # tokens N (already resolved; `full` → prompt + output)
    block: int
    max_new_tokens: int
    cap: int
    mechanism: limits.Mechanism
    threads: int | None = None
    timeout_s: float | None = None


@dataclass
class Outcome:
    policy: str
    policy_params: dict
    budget: int
    block: int
    prompt_tokens: int
    cap: int
    mechanism: str
    mechanism_reason: str
    measures: str
    status: str
    plan: dict
    needs_bytes: int | None = None  # ≈ what the job needs under this mechanism (when it did not fit)
    needs_basis: str = ""
    needs_lower_bound: bool = False  # True: it failed before anything could be measured; needs > cap
    measured_peak: int | None = None  # of the mechanism's own quantity
    measured_peak_field: str = ""
    peak_rss: int | None = None  # resident high-water mark (VmHWM / ru_maxrss)
    runtime_overhead: int | None = None  # measured peak − plan total (what Python/torch/libs add)
    host: dict = field(default_factory=dict)  # host seconds and tok/s, eager engine
    engine: str = "eager"
    error: str = ""
    exit: str = ""
    report: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.status == FITS

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        return d


def plan_for(target: Target, policy: str, policy_args: dict, budget: int, block: int,
             max_tokens: int | None = None) -> MemoryPlan:
    """The engine's static plan, exactly as ``engine.session.open_eager_session`` computes it (no weights loaded);
    ``max_tokens`` = prompt + output bounds the cache as it does in the engine."""
    from ..memory import cache_capacity

    pol = make_policy(policy, policy_args)
    pol.check_budget(budget, block)
    capacity = cache_capacity(budget, block, int(getattr(pol, "max_extra_tokens", 0)), max_tokens)
    return plan_memory(target.config, target.weight_bytes, capacity, block, len(pol.entry_state))


def _read_events(path: Path) -> list[dict]:
    out = []
    try:
        with open(path) as fh:
            for ln in fh:
                try:
                    out.append(json.loads(ln))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill
    except OSError:
        pass
    return out


class _Tail:
    """New complete lines of the child's events file since the last call (no re-reading)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.offset += end
        out = []
        for ln in data[:end].splitlines():
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
        return out


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def native_cli(t: Target) -> str | None:
    """``edgekv-run`` when it can run this target: an artifact with a flat program, and the native
    runtime built (else the artifact runs in the host runtime, inside Python)."""
    if t.kind != "artifact" or Keys.Files.PROGRAM not in t.manifest.files:
        return None
    if os.environ.get("EDGEKV_SIMULATE_HOST_RUNTIME"):  # the TVM VM path, kept reachable for comparison
        return None
    from ..runtime import native

    exe = native.cli_path()
    return str(exe) if exe is not None else None


def run_job(job: Job, on_progress=None, on_stage=None) -> Outcome:
    t = job.target
    pol = make_policy(job.policy, job.policy_args)
    plan = plan_for(t, job.policy, job.policy_args, job.budget, job.block, len(job.prompt_ids) + job.max_new_tokens)
    if t.kind == "artifact":  # the compiled module's own static plan decides the refusal
        mp = t.manifest.memory_plan
        plan = MemoryPlan(weights=mp.weights_bytes, kv_cache=mp.cache_bytes, activations=mp.activation_bytes)
    field_name = limits.PEAK_FIELD[job.mechanism.name]
    cli = native_cli(t)  # the artifact runs in edgekv-run (None: the host runtime, or the eager engine)
    out = Outcome(policy=job.policy, policy_params=pol.params(), budget=job.budget, block=job.block,
                  prompt_tokens=len(job.prompt_ids), cap=job.cap, mechanism=job.mechanism.name,
                  mechanism_reason=job.mechanism.reason, measures=job.mechanism.measures, status=ERROR,
                  plan=plan.to_dict(), measured_peak_field=field_name,
                  engine="eager" if t.kind == "model" else (
                      "compiled artifact (native runtime, edgekv-run)" if cli else
                      "compiled artifact (host runtime, TVM Relax VM)"))
    if plan.total > job.cap:
        out.status = REFUSED
        out.needs_bytes = plan.total
        out.needs_basis = "static plan alone (weights + KV cache + activations), before any runtime overhead"
        return out

    if t.kind == "artifact" and not artifact_runs_here(t.manifest):
        out.status = NOT_RUN
        out.error = (f"the artifact is built for {t.manifest.target.tvm or None}, not this host: the plan fits "
                     "the cap; nothing was measured (estimates only)")
        return out
    work = Path(tempfile.mkdtemp(prefix="edgekv-sim-"))
    cg = None
    try:
        (work / "ids.json").write_text(json.dumps([int(i) for i in job.prompt_ids]))
        (work / "ids.csv").write_text(",".join(str(int(i)) for i in job.prompt_ids))
        spec = {"spec": t.spec, "prompt_ids": str(work / "ids.json"), "policy": job.policy,
                "policy_args": job.policy_args, "budget": job.budget, "block": job.block,
                "max_new_tokens": job.max_new_tokens, "cap": job.cap, "mechanism": job.mechanism.name,
                "threads": job.threads, "events": str(work / "events.jsonl"), "result": str(work / "result.json"),
                "artifact": str(t.artifact_dir) if t.kind == "artifact" else None,
                "native_cli": cli, "prompt_ids_csv": str(work / "ids.csv")}
        if job.mechanism.name == "cgroup2":
            cg = limits.make_cgroup(job.mechanism.cgroup_parent, job.cap)
            spec["cgroup_dir"] = str(cg)
        (work / "job.json").write_text(json.dumps(spec))
        log = open(work / "child.log", "wb")
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "edgekv.simulate.child", str(work / "job.json")],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        rusage = None
        status_code = None
        tail = _Tail(work / "events.jsonl")
        try:
            while True:
                pid, status_code, rusage = os.wait4(proc.pid, os.WNOHANG)
                if pid == proc.pid:
                    proc.returncode = os.waitstatus_to_exitcode(status_code)
                    break
                for ev in tail.new():
                    if ev.get("kind") == "progress" and on_progress:
                        on_progress(ev["tokens"])
                    if ev.get("kind") == "stage" and on_stage:
                        on_stage(ev["stage"])
                if job.timeout_s and time.perf_counter() - t0 > job.timeout_s:
                    proc.kill()
                time.sleep(0.2)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            log.close()
        wall = time.perf_counter() - t0
        out.host["child_wall_s"] = wall
        out.peak_rss = rusage.ru_maxrss * 1024 if rusage is not None else None
        events = _read_events(work / "events.jsonl")
        result = None
        if (work / "result.json").is_file():
            try:
                result = json.loads((work / "result.json").read_text())
            except json.JSONDecodeError:
                result = None
        _finish(out, job, plan, events, result, proc.returncode, work, cg, native=cli is not None)
    finally:
        if cg is not None:
            limits.remove_cgroup(cg)
        shutil.rmtree(work, ignore_errors=True)
    return out


def _peak_from(events: list[dict], result: dict | None, key: str) -> int | None:
    vals = [ev.get("peak", {}).get(key) for ev in events] + [ev.get("status", {}).get(key) for ev in events]
    if result:
        vals += [result.get("peak", {}).get(key), result.get("final", {}).get(key)]
    vals = [v for v in vals if v]
    return max(vals) if vals else None


def _finish(out: Outcome, job: Job, plan: MemoryPlan, events, result, rc: int, work: Path, cg,
            native: bool = False) -> None:
    mech = job.mechanism.name
    key = {"rlimit-data": "VmData", "rlimit-as": "VmPeak", "cgroup2": "VmRSS"}[mech]
    peak = _peak_from(events, result, key)
    oom_kills = 0
    if cg is not None:
        cg_peak, oom_kills = limits.cgroup_peak_and_oom(cg)
        peak = cg_peak or peak
    out.measured_peak = peak
    hwm = _peak_from(events, result, "VmHWM")
    out.peak_rss = max(v for v in (out.peak_rss, hwm) if v) if (out.peak_rss or hwm) else None
    loaded = next((ev for ev in events if ev.get("stage") == "loaded"), None)
    base = loaded["status"].get(key) if loaded else None
    native_rss = ((result or {}).get("report") or {}).get("memory", {}).get("peak_rss_bytes")
    if native:  # edgekv-run's own high-water mark: the Python child that started it is not the run
        out.peak_rss = int(native_rss) if native_rss else hwm
        if peak is None and native_rss:  # a run shorter than one sampling period
            peak = out.measured_peak = int(native_rss)
            out.measured_peak_field = "VmHWM (from edgekv-run's report: the run ended before a sample)"
    if rc == 0 and result and result.get("status") == "ok":
        rep = result["report"]
        out.status = FITS
        out.report = {k: v for k, v in rep.items() if k != "text"}
        out.host.update({k: rep.get(k) for k in ("prefill_seconds", "decode_seconds", "wall_seconds",
                                                 "prefill_tok_s", "decode_tok_s", "generated_tokens",
                                                 "torch_threads")})
        if peak is not None:
            # an rlimit does not count edgekv-run's weights: a read-only file mapping, not private data
            counted = plan.total - (plan.weights if native and mech.startswith("rlimit") else 0)
            out.runtime_overhead = peak - counted
        return
    # did not finish: out of memory under the cap, another error, or killed
    tail = ""
    try:
        tail = (work / "child.log").read_bytes()[-1500:].decode("utf-8", "replace")
    except OSError:
        pass
    if result and result.get("status") == "error":
        out.status = ERROR
        out.error = result.get("error", "")
        out.exit = f"exit {rc} in stage {result.get('stage')}"
        return
    # out of memory: Python's MemoryError, C++'s bad_alloc, errno ENOMEM's text, the dynamic
    # loader's "cannot allocate memory for thread-local data" (a child that dies while loading),
    # or OpenBLAS giving up at numpy's import ("Memory allocation still failed after 10 retries")
    oom = (result and result.get("status") == "oom") or oom_kills > 0 or rc < 0 or \
        any(s in tail.lower() for s in ("memoryerror", "cannot allocate memory", "can't allocate memory", "bad_alloc",
                                        "memory allocation still failed"))
    if not oom:
        out.status = ERROR
        out.error = tail.strip()[-800:] or f"the child exited with {rc} and wrote no report"
        out.exit = f"exit {rc}"
        return
    out.status = DOES_NOT_FIT
    out.exit = f"killed by {_signal_name(-rc)}" if rc < 0 else f"exit {rc}"
    out.error = (result or {}).get("error", "") or tail.strip()[-400:]
    requested = (result or {}).get("requested_bytes") or 0
    last = (result or {}).get("final", {}).get(key) or (events[-1].get("status", {}).get(key) if events else None)
    if base is not None and job.target.kind == "artifact":  # caches were allocated at load already
        need = max(base + plan.activations, (last or base) + requested)
        out.needs_basis = ("measured after loading the artifact (weights + caches) + planned activations, "
                           "or in use when the allocation failed + the failed allocation")
        out.runtime_overhead = base - plan.weights - plan.kv_cache
    elif base is not None:  # the model loaded: what the run adds is the plan's cache + activations
        need = base + plan.kv_cache + plan.activations
        out.needs_basis = (f"{limits.PEAK_FIELD[mech] if mech != 'cgroup2' else key} after loading the model "
                           f"({base / 2**20:,.0f} MiB, measured in the child) + planned KV cache + activations")
        if last is not None and requested and last + requested > need:
            need = last + requested
            out.needs_basis = "memory in use when the allocation failed + the failed allocation"
        out.runtime_overhead = base - plan.weights
    else:
        stages = [ev.get("stage") for ev in events if ev.get("kind") == "stage"]
        doing = "loading the model" if "loading" in stages else "importing Python/torch"
        need = max(plan.total, (last or 0) + requested, job.cap + 1)
        out.needs_lower_bound = True
        out.needs_basis = f"a lower bound: the child ran out of memory while {doing}, before the model was in memory"
    out.needs_bytes = int(need)
