"""Accuracy evaluation on the real model: passkey / needle retrieval and fidelity to the
full cache, swept over policies × budgets × block sizes (`edgekv eval`)."""

from .fidelity import compare, run_trace
from .runner import ONE_BLOCK, TASKS, EvalSpec, Runner, build_prompts, run_one
from .tasks import Prompt, build_fidelity, build_passkey, extract_key

__all__ = ["ONE_BLOCK", "TASKS", "EvalSpec", "Prompt", "Runner", "build_fidelity", "build_passkey", "build_prompts",
           "compare", "extract_key", "run_one", "run_trace"]
