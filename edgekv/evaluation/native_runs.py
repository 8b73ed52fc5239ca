"""Compiled artifacts as runs of an eval sweep (`edgekv eval MODEL --artifacts DIR,DIR`).

Each artifact is one (policy, N, B) run of every prompt through the native runtime — the q4/K-quant
kernels, the compiled eviction, the bounded cache a phone would hold — scored against the same
eager full-cache reference as the eager policies. Its row is labelled ``policy (weights, native)``
(``keydiff (q4, native)``; ``+q`` when compiled with question rows) and carries the artifact's
own N and B, so it sits beside the eager policy of the same name in the tables.

What differs from an eager run, by construction:
- passkey: an artifact compiled with question rows reads the document knowing the question
  (``--question``), as ``edgekv run ARTIFACT --question`` does; one without reads it plain;
- fidelity: the scored window is teacher-forced one token at a time through decode (the native
  runtime returns the last position's logits only), where eager runs step it in chunks of B;
- ``eviction_events`` is not counted by the native runtime (reported as null).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import InputError

NATIVE_SUFFIX = "native"


@dataclass(frozen=True)
class ArtifactRun:
    """What the sweep needs to know about one artifact, read from its manifest (no weights)."""

    label: str
    path: str
    model_id: str
    policy: str
    params: dict
    budget: int
    block: int
    question_rows: int
    weights: str

    def to_dict(self) -> dict:
        return asdict(self)


def describe_artifacts(paths: list[str]) -> dict[str, dict]:
    """label → ``ArtifactRun.to_dict()`` for each artifact folder, in order; a folder that is not
    an artifact, or two that would share a label, are refused here (before any model loads)."""
    from ..artifact import ArtifactError, Manifest

    runs: dict[str, dict] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        try:
            m = Manifest.read(path)
        except (ArtifactError, OSError) as exc:
            raise InputError(f"--artifacts {raw}: not a readable edgekv artifact ({exc}); give a folder that "
                             "`edgekv compile ... -o DIR` wrote") from None
        weights = str((m.weights or {}).get("format") or m.dtype)
        label = f"{m.policy_name}{'+q' if m.question_rows else ''} ({weights}, {NATIVE_SUFFIX})"
        if label in runs:
            label = f"{label[:-1]}, {path.name})"
        if label in runs:
            raise InputError(f"--artifacts names {raw} twice; give each artifact once")
        runs[label] = ArtifactRun(label=label, path=str(path.resolve()), model_id=m.model_id, policy=m.policy_name,
                                  params={"policy": m.policy_params, "artifact": path.name}, budget=int(m.budget),
                                  block=int(m.block), question_rows=int(m.question_rows), weights=weights).to_dict()
    return runs


def check_artifacts(runs: dict[str, dict], model_id: str, threads: int | None) -> None:
    """Each artifact was compiled from the eval's model and opens in the native runtime here
    (mapped, checked, closed): refused before the first prompt, not after its reference run."""
    from ..runtime import native

    if runs and not native.available():
        raise InputError("--artifacts needs the native runtime (libedgekv_runtime), which is not built here; "
                         "reinstall edgekv (`pip install -e .` builds it) or drop --artifacts")
    for run in runs.values():
        if run["model_id"] != model_id:
            raise InputError(f"--artifacts {run['path']} was compiled from {run['model_id']!r}, not the eval's model "
                             f"{model_id!r}; compile it from {model_id} or eval {run['model_id']}")
        native.NativeRuntime(run["path"], threads=threads).close()


class NativeEngine:
    """The eval's engine face (``prefill``/``decode``/``kept_positions``/``stats``, torch in and
    out) over an artifact in the native runtime, so ``runner.read_and_answer`` and
    ``fidelity.run_trace`` run it unchanged."""

    def __init__(self, run: dict, threads: int | None):
        from ..runtime.native import NativeRuntime

        self.run = run
        self.rt = NativeRuntime(run["path"], threads=threads)
        self.rt.allow_beyond_context(False)
        self.block = self.rt.block
        self.caches = range(self.rt.num_layers)  # needle_retention counts layers by len(caches)
        # fidelity: teacher-force through decode (the runtime returns the last position's logits)
        self.policy = SimpleNamespace(replaces_decode_attention=lambda: True)

    def prefill(self, ids, progress=None, question=None):
        q = None if question is None else question.numpy()
        return torch.from_numpy(self.rt.prefill(ids.numpy(), progress=progress, question=q))

    def decode(self, token: int):
        return torch.from_numpy(self.rt.decode(int(token)))

    def kept_positions(self, layer: int) -> torch.Tensor:
        return torch.from_numpy(self.rt.kept_positions(layer)).long()

    @property
    def stats(self):
        st = self.rt.stats
        return SimpleNamespace(prefill_seconds=st.prefill_seconds, eviction_events=None)

    def close(self) -> None:
        self.rt.close()
