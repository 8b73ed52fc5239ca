"""Where `edgekv eval` runs its prompts: local worker processes (the default) or a Ray cluster.

A prompt is the unit of work: its full-cache reference and every (policy, budget, block) run of it
happen in one worker, which loads the model once and rebuilds the prompts from the spec (they are
deterministic), so only the spec, a prompt's index and its result rows cross process boundaries.
``Runner.run`` puts the rows back in prompt order, so the JSON does not depend on which worker ran
what or when (only the timing fields differ between runs, as they do between any two runs).

Each worker runs torch with ``threads`` threads; results are identical for the same thread count
(the engine is deterministic), so a sweep spread over workers equals the same sweep run in one
process with that thread count.

Ray (``--ray auto|ADDRESS``): ``auto`` connects to the Ray instance running on this machine, or starts
one (and stops it at the end); an address such as ``ray://head:10001`` or ``head:6379`` joins that
cluster, whose nodes need edgekv and the model installed. One actor per worker holds the model.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Iterable, Iterator

from ..errors import InputError
from ..threads import usable_cores

_WORKER = None  # this process's Runner, in a worker process


def _make_runner(model_name: str | None, spec, threads: int):
    import torch

    from ..models import load_model
    from .runner import Runner, build_prompts

    torch.set_num_threads(max(1, int(threads)))
    torch.manual_seed(0)
    model = load_model(model_name, None)
    return Runner(model, spec), build_prompts(spec, model.tokenizer)


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """End this worker when the eval process that started it is gone (killed, not shut down):
    a pool's workers otherwise run on as orphans, each holding a model and a core."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="edgekv-parent-watch", daemon=True).start()


def _init_local(model_name, spec, threads, parent: int | None = None) -> None:
    global _WORKER
    if parent is not None:
        _exit_with_parent(parent)
    _WORKER = _make_runner(model_name, spec, threads)


def _run_local(index: int):
    runner, prompts = _WORKER
    return index, runner.run_prompt(prompts[index])


class LocalPool:
    """``workers`` processes (spawned: torch and fork do not mix), each with its own model."""

    def __init__(self, workers: int, model_name: str | None, spec, threads: int):
        self.workers, self.model_name, self.spec, self.threads = workers, model_name, spec, threads

    def describe(self) -> str:
        return f"{self.workers} local worker processes × {self.threads} thread(s)"

    def map_prompts(self, indices: Iterable[int]) -> Iterator[tuple[int, tuple[dict, list[dict]]]]:
        indices = list(indices)
        if not indices:
            return
        with ProcessPoolExecutor(max_workers=min(self.workers, len(indices)),
                                 mp_context=multiprocessing.get_context("spawn"), initializer=_init_local,
                                 initargs=(self.model_name, self.spec, self.threads, os.getpid())) as pool:
            for fut in as_completed([pool.submit(_run_local, i) for i in indices]):
                yield fut.result()


class RayPool:
    """One Ray actor per worker, each holding the model, fed prompt indices as they free up."""

    def __init__(self, address: str, workers: int | None, model_name: str | None, spec, threads: int):
        try:
            import ray
        except ImportError:
            raise InputError("--ray needs Ray: pip install 'ray>=2.9' (or drop --ray to use local worker "
                             "processes)") from None
        self.ray = ray
        self.started_here = not ray.is_initialized()
        # Ray nices its workers (15) by default: beside any other work on the machine a sweep started
        # here would barely run (an instance started by `ray start` keeps its own setting)
        os.environ.setdefault("RAY_worker_niceness", "0")
        try:
            ray.init(address=None if address == "auto" else address, ignore_reinit_error=True,
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError(f"--ray {address}: cannot reach a Ray cluster ({exc}); start one with `ray start "
                             "--head`, give its address, or use --ray auto to start one on this machine") from None
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.threads = max(1, min(int(threads), cpus))
        self.workers = max(1, workers if workers else cpus // self.threads)
        self.model_name, self.spec = model_name, spec

    def describe(self) -> str:
        return f"{self.workers} Ray actors × {self.threads} thread(s)"

    def map_prompts(self, indices: Iterable[int]) -> Iterator[tuple[int, tuple[dict, list[dict]]]]:
        ray = self.ray
        from ray.util import ActorPool

        indices = list(indices)
        if not indices:
            return

        @ray.remote
        class EvalWorker:
            def __init__(self, model_name, spec, threads):
                self.runner, self.prompts = _make_runner(model_name, spec, threads)

            def run(self, index):
                return index, self.runner.run_prompt(self.prompts[index])

        actors = [EvalWorker.options(num_cpus=self.threads).remote(self.model_name, self.spec, self.threads)
                  for _ in range(min(self.workers, len(indices)))]
        try:
            yield from ActorPool(actors).map_unordered(lambda actor, i: actor.run.remote(i), indices)
        finally:
            for actor in actors:
                ray.kill(actor)

    def close(self) -> None:
        if self.started_here:
            self.ray.shutdown()


def make_pool(workers: int | None, ray: str | None, model_name: str | None, spec, threads: int | None):
    """The pool ``run_eval`` hands to ``Runner.run``: None (this process: one worker, no Ray),
    ``LocalPool`` or ``RayPool``. ``workers`` None = as many as cores / threads."""
    if workers is not None and workers < 1:
        raise InputError("--workers must be ≥ 1 (1 runs the prompts in this process)")
    if ray:
        return RayPool(ray, workers, model_name, spec, threads or 1)
    n = workers if workers is not None else max(1, usable_cores() // (threads or 1))
    if n == 1:
        return None
    return LocalPool(n, model_name, spec, threads or max(1, usable_cores() // n))
