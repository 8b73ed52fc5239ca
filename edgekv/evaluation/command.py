"""`edgekv eval`: parse the options, run the sweep with a progress bar, write the reports.

The CLI command in edgekv/cli/eval.py is a thin wrapper around ``run_eval``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..budget import parse_budget
from ..errors import InputError
from .runner import ONE_BLOCK, TASKS, EvalSpec, Runner, build_prompts
from .workers import make_pool


def split_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise InputError(f"{what} is empty; give a comma-separated list")
    return items


def parse_lengths(text: str, what: str) -> list[int]:
    """Token counts in the forms --budget takes ("1k", "4096"), for the option named ``what``."""
    from ..budget import BudgetError, _TOKENS

    out = []
    for item in split_list(text, what):
        if not _TOKENS.match(item):
            raise InputError(f"{what} {item!r}: write token counts such as 512, 1k or 4096 (comma-separated)")
        try:
            n = parse_budget(item, block=1)
        except BudgetError:
            n = 0
        if n <= 0:  # a length, not a budget: say so in the option's own words
            raise InputError(f"{what} {item!r}: give a positive token count such as 512, 1k or 4096")
        out.append(n)
    return out


def parse_tasks(text: str) -> list[str]:
    tasks = []
    for t in split_list(text, "--task"):
        if t == "all":
            tasks.extend(TASKS)
        elif t in TASKS:
            tasks.append(t)
        else:
            raise InputError(f"--task {t!r}: choose from {', '.join(TASKS)}, all (comma-separated)")
    return list(dict.fromkeys(tasks))


def parse_blocks(text: str, one_block: bool) -> list[int]:
    blocks = []
    for item in split_list(text, "--block"):
        if item.lower() in ("one", "l", "prompt"):
            blocks.append(ONE_BLOCK)
            continue
        try:
            b = int(item)
        except ValueError:
            raise InputError(f"--block {item!r} is not a number of tokens (or 'one' for the whole prompt)") from None
        if b <= 0:
            raise InputError("--block sizes must be positive")
        blocks.append(b)
    if one_block and ONE_BLOCK not in blocks:
        blocks.append(ONE_BLOCK)
    if blocks[0] == ONE_BLOCK and len(blocks) > 1:  # the reference runs at the first block size
        blocks = [b for b in blocks if b != ONE_BLOCK] + [ONE_BLOCK]
    return blocks


def parse_depths(text: str) -> list[float]:
    out = []
    for item in split_list(text, "--depths"):
        try:
            d = float(item)
        except ValueError:
            raise InputError(f"--depths {item!r} is not a number in [0, 1]") from None
        if not 0 <= d <= 1:
            raise InputError(f"--depths {item}: depths are fractions of the haystack, in [0, 1]")
        out.append(d)
    return out


def parse_policy_specs(text: str, pairs: list[str] | None) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The policies and their ``--policy-arg`` values (``key=value`` for every chosen policy that
    has the argument, ``policy:key=value`` for one), as every edgekv command reads them."""
    from ..policies import make_policy, policy_arguments, policy_names

    names = split_list(text, "--policy")
    if names == ["none"]:  # only --artifacts run beside the full-cache reference (a 1.5B's eager runs are minutes)
        return [], {}
    if names == ["all"]:
        names = policy_names()
    for name in names:
        make_policy(name)  # unknown names first
    args = policy_arguments(pairs, names)
    for name in names:
        make_policy(name, args.get(name, {}))  # unknown names / bad arguments fail before any work
    return list(dict.fromkeys(names)), args


def build_spec(task: str, policies: str, budgets: str, block: str, one_block: bool, lengths: str, depths: str,
               seeds: str, keys: int, haystack: str, max_new_tokens: int, fidelity_lengths: str,
               fidelity_window: int, greedy_tokens: int, policy_arg: list[str] | None,
               question: bool = False, kv_dtype: str | None = None, artifacts: str | None = None) -> EvalSpec:
    names, args = parse_policy_specs(policies, policy_arg)
    from .native_runs import describe_artifacts

    compiled = describe_artifacts(split_list(artifacts, "--artifacts")) if artifacts else {}
    try:
        seed_list = [int(s) for s in split_list(seeds, "--seeds")]
    except ValueError:
        raise InputError("--seeds must be integers, e.g. 0,1,2") from None
    if keys < 2:
        raise InputError("--keys (needles in the multi-key task) must be ≥ 2")
    from .tasks import HAYSTACKS

    if haystack not in HAYSTACKS:
        raise InputError(f"--haystack {haystack!r}: choose 'varied' (varied natural prose, the default), 'repeat' "
                         "(the classic repeated filler) or 'text' (the Python reference alone)")
    spec = EvalSpec(tasks=parse_tasks(task), policies=names, budgets=sorted(set(parse_lengths(budgets, "--budgets"))),
                    blocks=parse_blocks(block, one_block), lengths=parse_lengths(lengths, "--lengths"),
                    depths=parse_depths(depths), seeds=seed_list, keys=keys, haystack=haystack,
                    max_new_tokens=max_new_tokens, fidelity_lengths=parse_lengths(fidelity_lengths, "--fidelity-lengths"),
                    fidelity_window=fidelity_window, greedy_tokens=greedy_tokens, policy_args=args, question=question,
                    kv_dtype=kv_dtype or "fp32", artifacts=compiled)
    spec.policies += list(compiled)
    if not spec.policies:
        raise InputError("--policy none runs no policy: give --artifacts DIR,... to run beside the full-cache "
                         "reference, or name policies")
    if any(fl <= fidelity_window for fl in spec.fidelity_lengths) and "fidelity" in spec.tasks:
        raise InputError(f"--fidelity-window {fidelity_window} must be shorter than every --fidelity-lengths")
    if greedy_tokens < 1 or max_new_tokens < 1:
        raise InputError("--greedy-tokens and --max-new-tokens must be ≥ 1")
    return spec


class _Bar:
    """A rich progress bar over prompt tokens of every engine run."""

    def __init__(self, console, total: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.progress = Progress(TextColumn("[bold]eval[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tokens"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
        self.task = self.progress.add_task("", total=total)
        self.progress.start()

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=text)
        if not self.progress.console.is_terminal:  # no live bar: one line per run instead
            self.progress.console.print(f"eval: {text}", highlight=False)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)

    def close(self) -> None:
        self.progress.stop()


def earlier_results(json_path: Path, model_id: str) -> dict | None:
    """The earlier run's results in ``json_path`` for ``--resume`` (None when there is none)."""
    from . import report

    if not json_path.exists():
        return None
    try:
        prior = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"--resume: cannot read the earlier results {json_path} ({exc}); "
                         f"delete it or choose another --out") from None
    if prior.get("schema") != report.SCHEMA:
        raise InputError(f"--resume: {json_path} is not an edgekv eval result; choose another --out")
    if prior.get("meta", {}).get("model") != model_id:
        raise InputError(f"--resume: {json_path} was made with model {prior.get('meta', {}).get('model')!r}, "
                         f"not {model_id!r}; choose another --out or drop --resume")
    return prior


def check_output_folder(path: Path, what: str = "-o/--output") -> None:
    """An output folder that can be written (new, or an existing folder), before any work starts."""
    import os
    import tempfile

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise InputError(f"{what} {p} is a file; give a folder (it is created if missing)")
    probe = p
    while not probe.exists():
        probe = probe.parent if str(probe.parent) != str(probe) else Path(".")
    if not probe.is_dir():
        raise InputError(f"{what} {p}: {probe} is a file, not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".edgekv-check.", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise InputError(f"{what} {p}: cannot write in {probe} ({exc.strerror or exc}); choose another folder") from None


def run_eval(spec: EvalSpec, out_dir: Path, *, model_name: str | None = None, threads: int | None = None,
             console=None, argv: list[str] | None = None, progress: bool = True, resume: bool = False,
             allow_beyond_context: bool = False, workers: int | None = 1, ray: str | None = None) -> dict:
    """Run the sweep and write DIR/results.json, DIR/results.md and DIR/*.png; returns the data.

    ``resume``: prompts that DIR/results.json (an earlier, possibly interrupted run) already
    finished with the same prompt, model and policy parameters are taken from it, not rerun.
    ``workers`` / ``ray``: where the prompts run (``workers.make_pool``; 1 and no Ray: here)."""
    import torch

    from ..job import check_context
    from ..output_files import write_json_atomic
    from ..models import load_model
    from . import report

    out_dir = Path(out_dir).expanduser()  # made once every check has passed: a refusal leaves no folder
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_model(model_name, console)
    if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
        raise InputError(f"model {model.model_id} has no tokenizer with a chat template; eval needs one")
    from .native_runs import check_artifacts

    check_artifacts(spec.artifacts, model.model_id, threads)
    prompts = build_prompts(spec, model.tokenizer)
    for p in prompts:
        check_context(model, p.tokens, spec.greedy_tokens if p.task == "fidelity" else spec.max_new_tokens,
                      allow_beyond_context)
    data = {"schema": report.SCHEMA, "meta": report.meta(model, argv or sys.argv), "config": spec.to_dict()}
    json_path = out_dir / "results.json"
    prior = earlier_results(json_path, model.model_id) if resume else None
    if prior is not None:  # this run rewrites results.json as it goes: keep the earlier file
        write_json_atomic(out_dir / "results.earlier.json", prior)

    def save_partial(partial: dict) -> None:
        write_json_atomic(json_path, report.finish({**data, **partial}))

    runner = Runner(model, spec, progress_factory=(lambda total: _Bar(console, total)) if progress else None,
                    on_prompt_done=save_partial)  # called after every run (every prompt with a pool)
    pool = make_pool(workers, ray, model_name, spec, threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    # results are reproducible for a thread count: record the one the engine ran with
    data["meta"]["execution"] = ({"where": "this process", "workers": 1, "threads": torch.get_num_threads()}
                                 if pool is None else {"where": pool.describe(), "workers": pool.workers,
                                                       "threads": pool.threads})
    if pool is not None and console is not None:
        console.print(f"eval: {len(prompts)} prompts over {pool.describe()}", highlight=False)
    try:
        data.update(runner.run(prompts, prior, pool))
    finally:
        if pool is not None and hasattr(pool, "close"):
            pool.close()
    report.finish(data)
    write_json_atomic(json_path, data)
    plots = report.plot(data, out_dir)
    md = [f"# edgekv eval · {data['meta']['model']}", "",
          f"command: `{data['meta']['command']}`  ", f"commit: {data['meta']['commit']}  ",
          f"machine: {data['meta']['machine']['cpu']}, torch {data['meta']['machine']['torch']}, "
          f"{data['meta']['machine']['torch_threads']} thread(s)  ",
          f"runtime: {data['runtime_seconds']:.0f} s  ",
          f"KV cache of the runs: {spec.kv_dtype} (the full-cache reference: fp32)", "", report.markdown(data)]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    data["_files"] = [str(json_path), str(out_dir / "results.md")] + [str(p) for p in plots]
    return data
