"""The thread choice (edgekv/threads.py): free cores by default, one count for torch and TVM.
Speeds are measured by tools/bench/measure_threads.py, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgekv import threads


def _stat(running: int) -> str:
    return f"cpu  1 2 3 4\nintr 5\nprocs_running {running}\nprocs_blocked 0\n"


@pytest.fixture()
def machine(monkeypatch):
    """A fake machine: CPUs this process may use, /proc/stat's running count, sysfs files."""
    state = {"cpus": [0, 1, 2, 3], "running": [1], "files": {}, "total": 4}

    def read(path):
        if path == "/proc/stat":
            return _stat(state["running"][0])
        return state["files"].get(path)

    monkeypatch.setattr(threads, "_read", read)
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: list(state["cpus"]))
    monkeypatch.setattr(os, "cpu_count", lambda: state["total"])
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    return state


def test_idle_machine_uses_every_core(machine):
    assert threads.usable_cores() == 4
    choice = threads.choose_threads(None)
    assert (choice.count, choice.source, choice.busy) == (4, "default", 0)
    assert "4 cores, none busy" in choice.reason


def test_busy_processes_take_their_cores(machine):
    machine["running"] = [3]  # this process + two others
    choice = threads.choose_threads(None)
    assert (choice.count, choice.busy) == (2, 2)
    assert "2 busy with other work" in choice.reason
    machine["running"] = [9]
    assert threads.default_threads() == 1  # never fewer than one


def test_smt_siblings_and_little_cores_do_not_count(machine):
    sib = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
    machine["files"].update({sib.format(0): "0,2", sib.format(2): "0,2", sib.format(1): "1,3", sib.format(3): "1,3"})
    assert threads.usable_cores() == 2
    machine["files"].clear()
    machine["cpus"] = list(range(8))
    machine["total"] = 8
    freq = "/sys/devices/system/cpu/cpu{}/cpufreq/cpuinfo_max_freq"
    for c, f in enumerate([1800000] * 4 + [2800000] * 3 + [3300000]):  # 4 little, 3 big, 1 prime
        machine["files"][freq.format(c)] = str(f)
    assert threads.usable_cores() == 4


def test_a_cgroup_quota_caps_the_cores(machine):
    machine["files"]["/sys/fs/cgroup/cpu.max"] = "150000 100000"
    assert threads.usable_cores() == 2
    machine["files"]["/sys/fs/cgroup/cpu.max"] = "max 100000"
    assert threads.usable_cores() == 4


def test_unreadable_proc_stat_counts_no_load(machine, monkeypatch):
    monkeypatch.setattr(threads, "_read", lambda path: None)
    assert threads.other_runnable() == 0


def test_the_user_choice_wins_and_is_checked(machine):
    machine["running"] = [9]
    assert threads.choose_threads(3).count == 3
    from edgekv.errors import InputError

    with pytest.raises(InputError, match="--threads 0"):
        threads.choose_threads(0)


def test_prepare_process_keeps_the_users_settings(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("TVM_BIND_THREADS", raising=False)
    threads.prepare_process()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["TVM_BIND_THREADS"] == "0"


def test_one_count_for_torch_and_tvm_in_a_fresh_process():
    """TVM sizes its pool once, from TVM_NUM_THREADS, when it is first used; on x86 its own
    default is half the logical CPUs (one thread on a 2-core box). apply_threads must win over
    both, before and after TVM is imported."""
    pytest.importorskip("tvm")
    code = (
        "import json, os\n"
        "from edgekv.threads import prepare_process, apply_threads\n"
        "prepare_process()\n"
        "import torch, tvm\n"
        "used = apply_threads(3)\n"
        "num = tvm.get_global_func('runtime.NumThreads')\n"
        "print(json.dumps({'used': used, 'tvm': num(), 'torch': torch.get_num_threads(),\n"
        "                  'env': [os.environ.get(k) for k in ('TVM_NUM_THREADS', 'OMP_WAIT_POLICY')]}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tvm"] == 3 and got["torch"] == 3 and got["used"] == {"torch": 3, "tvm": 3}
    assert got["env"] == ["3", "PASSIVE"]
