"""The `edgekv` command (typer + rich): the app, and its commands in the order `--help` lists them.

One vocabulary across the subcommands (README, "Using it"): MODEL (or ARTIFACT) is always the
positional argument; ``--budget``/``--block``/``--policy``/``--policy-arg`` (``key=value`` or
``policy:key=value``) mean the same everywhere and share their defaults; ``-o/--output`` is where
a command writes (``--report`` and ``--out`` remain as aliases); ``--threads`` sets the threads of
every runtime (default: the free cores, ``edgekv/threads.py``); ``--mem-limit`` refuses a memory
plan above it; ``--allow-beyond-context`` opts in to positions past the trained context.

``common.py`` declares that vocabulary and the console helpers; each other module is one command
(two for ``run.py``: run and ask; ``compile.py``: compile and export-onnx). Torch, TVM and
transformers are imported inside the command functions that need them, so ``edgekv --help``
stays quick."""

from __future__ import annotations

import os
import sys

from ..threads import prepare_process

# typer's help and usage errors (rich) wrap at 80 columns when piped, cutting option names: give
# them a wide page unless the user set a width (common.py does the same for edgekv's own messages)
if not sys.stdout.isatty() and not os.environ.get("COLUMNS") and not os.environ.get("TERMINAL_WIDTH"):
    os.environ["TERMINAL_WIDTH"] = "200"

prepare_process()  # before torch / TVM load: thread pools that sleep instead of spinning

import typer  # noqa: E402

from .bench import bench_cmd  # noqa: E402
from .cache import cache_cmd  # noqa: E402
from .compile import compile_cmd, export_onnx_cmd  # noqa: E402
from .eval import eval_cmd  # noqa: E402
from .pack import pack_cmd  # noqa: E402
from .policies import policies_cmd  # noqa: E402
from .run import ask_cmd, run_cmd  # noqa: E402
from .simulate import simulate_cmd  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help="edgekv: long prompts under a hard KV-cache budget")
app.command("run")(run_cmd)
app.command("ask")(ask_cmd)
app.command("compile")(compile_cmd)
app.command("export-onnx")(export_onnx_cmd)
app.command("policies")(policies_cmd)
app.command("cache")(cache_cmd)
app.command("pack")(pack_cmd)
app.command("simulate")(simulate_cmd)
app.command("eval")(eval_cmd)
app.command("bench")(bench_cmd)
