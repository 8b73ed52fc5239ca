"""Host runtime: run a compiled edgekv artifact with TVM's Relax VM.

    rt = HostRuntime("build/kd")            # checks manifest, hashes and versions, loads, allocates
    logits = rt.prefill(prompt_ids)         # block loop: one compiled call per block
    logits = rt.decode(token_id)            # one compiled call per token
    ids = rt.generate(prompt_ids, 64)

It is a ``Session`` (``edgekv/session.py``): the token loop, documents and run reports are shared
with the eager engine and the native runtime.

The caches (per layer K, V [H, N, d], positions [H, N], fill [1], and the policy's state: for a
policy with per-entry state such as H2O one state [S, H, N] float32, for D2O its own per-layer
tensors — the manifest's ``cache_fields``) are allocated once at load
and updated *in place* by the compiled functions (their eviction kernels are
``call_tir_inplace``); nothing is reallocated per block and there is no per-layer or per-head
Python in the loop.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..artifact import ArtifactError, Keys, Manifest, is_artifact, verify_artifact  # noqa: F401 - re-exported

# an artifact without "cache_fields" (before policies carried compiled state) holds these
DEFAULT_CACHE_FIELDS = [("k", "float32"), ("v", "float32"), ("pos", "int32"), ("fill", "int32")]


@dataclass
class RuntimeStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_blocks: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    load_seconds: float = 0.0
    peak_rss_bytes: int = 0
    block_seconds: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "block_seconds"}
        d["prefill_tok_per_s"] = self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else None
        d["decode_tok_per_s"] = self.decode_tokens / self.decode_seconds if self.decode_seconds else None
        return d


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # psutil missing: fall back to ru_maxrss (KiB on Linux)
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# the manifest's pseudo_rows.positions of a `--compress reconstruct` artifact: the extra rows are each
# block's reconstruction rows (``_reconstruction_rows``)
RECONSTRUCT = "reconstruct"


class HostRuntime:
    weights_check = None  # the WeightsCheck of an artifact opened from a directory
    def __init__(self, artifact: str | Path, *, check_hashes: bool = True, expected_weight_hash: str | None = None,
                 device=None, verify: str = "default"):
        """Load an artifact directory; refuses a missing, corrupt or mismatched one (ArtifactError).
        ``device``: the TVM device of a device artifact (e.g. ``tvm.cuda()``); default the CPU.
        ``verify``: the weights' checksums — ``default`` (checked, or a stamp of an earlier check of
        the same file), ``always``, ``off`` (``--no-verify``)."""
        import tvm

        from ..artifact.params_file import map_params

        t0 = time.perf_counter()
        path = Path(artifact)
        manifest = Manifest.read(path)
        if device is None:  # a device artifact on this CPU: say where it runs instead of TVM's linker output
            from ..artifact_target import artifact_runs_here, device_artifact_message, needs_native_device

            if needs_native_device(manifest):
                raise ArtifactError(f"{path} runs on OpenCL, which TVM's Python runtime does not have: run it with the "
                                    "native runtime (edgekv run ARTIFACT, or edgekv-run ARTIFACT)")
            if not artifact_runs_here(manifest):
                raise ArtifactError(device_artifact_message(path, manifest))
        self.weights_check = verify_artifact(path, manifest, check_hashes=check_hashes,
                                             tvm_version=str(tvm.__version__), verify=verify)
        if expected_weight_hash and expected_weight_hash != manifest.weight_hash:
            raise ArtifactError("the artifact was compiled from different weights than the model given "
                                f"({manifest.weight_hash[:12]}… vs {expected_weight_hash[:12]}…)")
        library, params = path / manifest.files[Keys.Files.LIBRARY].name, path / manifest.files[Keys.Files.PARAMS].name
        try:
            lib = tvm.runtime.load_module(str(library))
        except Exception as exc:  # noqa: BLE001 - TVM raises its own error types
            raise ArtifactError(f"cannot load {library}: {exc}") from None
        try:
            arrays = map_params(params)  # mapped: TVM's tensors use it in place
        except Exception as exc:  # noqa: BLE001
            raise ArtifactError(f"cannot read {params}: {exc}") from None
        self._setup(path, manifest, lib, arrays, t0, device)

    @classmethod
    def from_executable(cls, executable, manifest: dict, params: list[tuple[str, np.ndarray]]) -> "HostRuntime":
        """Run an in-memory build (``compile_model(...)``'s executable and manifest dict) without
        writing files (tests)."""
        self = cls.__new__(cls)
        self._setup(None, Manifest.from_json(manifest), executable, dict(params), time.perf_counter())
        return self

    def _setup(self, path, manifest: Manifest, lib, arrays, t0, device=None) -> None:
        import tvm
        from tvm import relax

        self.path = path
        self.manifest = manifest
        self.budget = int(manifest.budget)
        self.block = int(manifest.block)
        self.policy = manifest.policy_name
        self.num_layers = int(manifest.num_layers)
        # pseudo rows after the B real rows of every prefill step (DapQ): built from the whole prompt
        # as the manifest describes them (``pseudo_rows``), the same rule the native runtime follows
        self.extra_rows = int(manifest.extra_rows)
        self._pseudo_spec = manifest.pseudo_rows or {}
        self.pseudo_window = manifest.pseudo_window
        # rows a document's question may fill instead (`--question-rows`): prefill(question=)
        self.question_rows = int(manifest.question_rows)
        if self.extra_rows != max(self.pseudo_window, self.question_rows):
            raise ArtifactError("the manifest has extra rows that its pseudo_rows / question_rows do not describe; "
                                "recompile the artifact")
        self._prompt: np.ndarray | None = None
        self._question: tuple[np.ndarray, np.ndarray] | None = None  # during prefill(question=)
        self.device = device if device is not None else tvm.cpu()
        self.vm = relax.VirtualMachine(lib, self.device)
        self.params = []
        P = Keys.Param
        for p in manifest.raw[Keys.PARAMS]:
            name, shape, dtype = p[P.NAME], p[P.SHAPE], p[P.DTYPE]
            if name not in arrays:
                raise ArtifactError(f"parameter {name} missing from the artifact's parameters")
            a = arrays[name]
            if list(a.shape) != list(shape) or str(a.dtype) != dtype:
                raise ArtifactError(f"parameter {name} has shape {list(a.shape)} {a.dtype}, the manifest says "
                                    f"{shape} {dtype}")
            if self.device.dlpack_device_type() == 1 and a.ctypes.data % 64 == 0:  # the CPU: no copy
                self.params.append(tvm.runtime.from_dlpack(a))
            else:
                self.params.append(tvm.runtime.tensor(np.ascontiguousarray(a), self.device))
        del arrays
        # caches: allocated once, mutated in place by the compiled functions. Per layer k, v, pos,
        # fill, then the policy's state as the manifest lists it (``block_cache.cache_layout``):
        # the generic per-entry "state" [S, H, N] (entry_state) or the policy's own (D2O)
        self.cache_fields = list(DEFAULT_CACHE_FIELDS if manifest.cache_fields is None else manifest.cache_fields)
        self._stride = len(self.cache_fields)
        self.caches = []
        self.state_names = list(manifest.raw.get(Keys.ENTRY_STATE) or [])
        if self.state_names and "state" not in dict(self.cache_fields):
            raise ArtifactError("the manifest names per-entry state but its cache fields hold no state tensor; "
                                "recompile the artifact")
        for c in manifest.raw[Keys.CACHE]:
            self.caches += [tvm.runtime.tensor(np.zeros(c[f], dtype=dt), self.device) for f, dt in self.cache_fields]
        self._tail = self.caches + self.params
        # fields that start every prompt with other contents than zeros (D2O's layer budgets), and
        # the compiled per-prompt function (compiler/passes/add_prepare_function.py) with the prompts it runs for
        dtypes = dict(self.cache_fields)
        self._init = {name: np.asarray(v, dtype=dtypes[name]) for name, v in manifest.cache_init.items()}
        self._prepare_min = manifest.prepare_min_prompt
        self._restore_init()
        self._prefill = self.vm["prefill_block"]
        self._decode = self.vm["decode"]
        self._zero_fill = np.zeros((1,), dtype="int32")
        self._tok = np.zeros((self.block,), dtype="int64")
        self.position = 0
        self.stats = RuntimeStats()
        self.stats.load_seconds = time.perf_counter() - t0
        self._sample_rss()

    @property
    def tokenizer(self):
        """The model's tokenizer saved in the artifact (None when the model had none)."""
        if not hasattr(self, "_tokenizer"):
            entry = self.manifest.files.get(Keys.Files.TOKENIZER)
            self._tokenizer = None
            if entry and self.path is not None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.path / entry.name))
        return self._tokenizer

    # ---- state --------------------------------------------------------------------------
    def _field(self, layer: int, name: str):
        return self.caches[self._stride * layer + [f for f, _ in self.cache_fields].index(name)]

    def reset(self) -> None:
        """Start a new sequence: empty every cache (fill = 0) without reallocating."""
        self._restore_init()
        for layer in range(self.num_layers):
            self._field(layer, "fill").copyfrom(self._zero_fill)
        self.position = 0
        self.stats = RuntimeStats(load_seconds=self.stats.load_seconds, peak_rss_bytes=self.stats.peak_rss_bytes)

    def _sample_rss(self) -> None:
        self.stats.peak_rss_bytes = max(self.stats.peak_rss_bytes, _rss())

    def cache_lengths(self) -> list[int]:
        return [int(self._field(l, "fill").numpy()[0]) for l in range(self.num_layers)]

    def kept_positions(self, layer: int) -> np.ndarray:
        """Original positions of the entries of layer ``layer``'s cache, [H, fill]."""
        fill = int(self._field(layer, "fill").numpy()[0])
        return self._field(layer, "pos").numpy()[:, :fill].copy()

    def entry_state(self, layer: int) -> dict[str, np.ndarray]:
        """The policy's per-entry state of layer ``layer``'s cache: ``{name: [H, fill]}`` (empty without)."""
        if not self.state_names:
            return {}
        fill = int(self._field(layer, "fill").numpy()[0])
        st = self._field(layer, "state").numpy()
        return {name: st[s, :, :fill].copy() for s, name in enumerate(self.state_names)}

    def _restore_init(self) -> None:
        for layer in range(self.num_layers):
            for name, value in self._init.items():
                self._field(layer, name).copyfrom(value)

    # ---- snapshots (edgekv/artifact/snapshot_file.py; the native runtime reads the same files) --
    def _snapshot_identity(self) -> dict:
        from ..artifact import snapshot_file as sf

        if self.path is None:
            raise ArtifactError("cache snapshots need an artifact directory with program.ekv (recompile it)")
        return sf.artifact_identity(self.path, self.manifest)

    def save_cache(self, path, question: str | None = None, chat: bool = False, made_from: str = "") -> None:
        """Save every cache tensor and the position to one file, atomically. The file names this
        artifact (its absolute path, as the native runtime writes it; ``made_from`` is ignored)."""
        import os

        from ..artifact import snapshot_file as sf

        ident = self._snapshot_identity()
        tensors = {(i // self._stride, i % self._stride): c.numpy() for i, c in enumerate(self.caches)}
        sf.write(sf.Snapshot(engine=sf.ENGINE_COMPILED, position=self.position, tokens=self.stats.prefill_tokens,
                             question=question or "", chat=chat, tensors=tensors, made_from=os.path.realpath(self.path),
                             document_seconds=self.stats.prefill_seconds, **ident), path)

    def load_cache(self, path) -> str:
        """Map a snapshot back: the caches become views of the copy-on-write mapping (nothing is
        copied; decode's writes stay in this process). Returns the question it was made with."""
        import tvm

        from ..artifact import snapshot_file as sf

        snap = sf.read(path)
        ident = self._snapshot_identity()
        sf.check_matches(snap, path, engine=sf.ENGINE_COMPILED, **ident)
        caches = []
        for i, c in enumerate(self.caches):
            data = snap.tensors.get((i // self._stride, i % self._stride))
            if data is None or data.nbytes != c.numpy().nbytes:
                raise sf.SnapshotError(f"{path}: its cache layout differs from this artifact's")
            arr = data.view(c.dtype).reshape(c.shape)
            caches.append(tvm.runtime.from_dlpack(arr) if self.device.dlpack_device_type() == 1
                          else tvm.runtime.tensor(np.ascontiguousarray(arr), self.device))
        self.caches = caches
        self._tail = self.caches + self.params
        self.position = snap.position
        self.snapshot_info = snap.info()
        self.stats = RuntimeStats(load_seconds=self.stats.load_seconds, peak_rss_bytes=self.stats.peak_rss_bytes)
        return snap.question

    def cache_field(self, layer: int, name: str) -> np.ndarray:
        """A copy of one of layer ``layer``'s cache tensors (``cache_fields``), e.g. "d2o_budget"."""
        return self._field(layer, name).numpy().copy()

    def _check_room(self, extra: int) -> None:
        if self.policy == "full" and self.position + extra > self.budget:
            from ..policies.base import PolicyError

            raise PolicyError(f"policy 'full' never evicts, but the sequence needs {self.position + extra} cache "
                              f"entries and this artifact's budget is {self.budget}; compile with --budget "
                              f"{self.position + extra} or more, or choose an evicting policy")

    # ---- per-prompt setup -------------------------------------------------------------------
    def prepare(self, prompt_ids) -> None:
        """What ``Policy.prepare`` does before a prompt (``prefill`` does it; call it yourself
        before ``step_block``): DapQ builds its pseudo tokens from the whole prompt, D2O its
        per-layer budgets: the compiled ``prepare`` function on the first block, for prompts longer
        than the manifest's ``prepare.min_prompt``); other policies need nothing."""
        import tvm

        self._prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self._prompt_end = self.position + self._prompt.size
        self._restore_init()
        if self._prepare_min is None or self._prompt.size <= self._prepare_min:
            return
        n = min(self.block, self._prompt.size)
        tok, pos, nv = self._step_inputs(self._prompt[:n], self.position)
        self.vm["prepare"](tok, pos, nv, tvm.runtime.tensor(np.array([self._prompt.size], dtype=np.int64), self.device),
                           *self._tail)

    # ---- pseudo rows (DapQ) ---------------------------------------------------------------
    def _pseudo_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, positions) of the w pseudo rows of the next step of n real tokens: the first
        ``prefix`` and the last w − prefix prompt tokens, at the positions after the prompt
        ("final") or after the block about to run ("block")."""
        from ..policies.base import PolicyError

        if self._prompt is None:
            raise PolicyError(f"this '{self.policy}' artifact appends pseudo tokens built from the whole prompt to "
                              "every block: call prefill(prompt), or prepare(prompt) before step_block")
        w, prefix, prompt = self.pseudo_window, int(self._pseudo_spec.get(Keys.PseudoRows.PREFIX, 0)), self._prompt
        total, end = prompt.size, self._prompt_end  # end: the position after this prefill's last token
        ids = np.concatenate([prompt[: min(prefix, total)], prompt[total - min(w - prefix, total):]])
        at = min(self.position + self.block, end) if self._pseudo_spec.get(Keys.PseudoRows.POSITIONS) == "block" else end
        if ids.size < w:
            # a prompt shorter than the window gives fewer pseudo tokens; harmless unless this step evicts
            need = int(self._field(0, "fill").numpy()[0]) + n
            if need > self.budget:
                raise PolicyError(f"the prompt gives only {ids.size} pseudo tokens but this artifact was compiled "
                                  f"for window={w}; recompile with --policy-arg window={ids.size}, or a budget of at "
                                  f"least {need} so that this prompt is not evicted")
            # this step keeps every row: the pseudo rows' scores are not read, any content does
            ids = np.resize(ids, w) if ids.size else np.zeros(w, np.int64)
            at = self.position + self.block
        return ids, np.arange(at, at + w, dtype=np.int64)

    # ---- reconstruction rows (`--compress reconstruct`) -----------------------------------
    def _reconstruction_rows(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, positions) of the reconstruction rows of the block of n tokens at ``start`` of a
        document longer than N read from position 0: the repeat prompt (``first`` before block 0,
        else ``later`` and the previous block's last ``tail`` tokens), ``suffix``, the block, at the
        positions after the block (the manifest's ``policy.kernel_params``); none (all padding) on a
        continuation or a document within N."""
        doc = self._prompt
        if doc is None or self._prompt_end != doc.size or doc.size <= self.budget:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        kp = self.manifest.raw[Keys.POLICY][Keys.Policy.KERNEL_PARAMS]
        tail = int(kp["tail"])
        head = list(kp["first"]) if start == 0 else list(kp["later"]) + doc[max(0, start - tail):start].tolist()
        ids = np.asarray(head + list(kp["suffix"]) + doc[start:start + n].tolist(), dtype=np.int64)
        return ids, np.arange(start + n, start + n + ids.size, dtype=np.int64)

    # ---- running ------------------------------------------------------------------------
    def step_block(self, token_ids, start: int | None = None) -> np.ndarray:
        """One compiled prefill call on ≤ B tokens at positions start…; returns last-token logits."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if not 1 <= n <= self.block:
            raise ValueError(f"a block holds 1..{self.block} tokens, got {n}")
        start = self.position if start is None else start
        self._check_room(n)
        out = self._run_block(ids, start)
        self.position = start + n
        return out[0].numpy()

    def _step_inputs(self, ids: np.ndarray, start: int):
        """(tokens, positions, n_valid) of one prefill step: the ids at positions start…, padded
        to B, then the extra rows: the question's (``prefill(question=)``), else DapQ's pseudo rows,
        then padding at position −1 (``compiler/passes/pseudo_rows.py``)."""
        import tvm

        n = ids.shape[0]
        rows = self.block + self.extra_rows
        tok = np.zeros((rows,), dtype=np.int64)
        tok[:n] = ids
        pos = np.arange(start, start + rows, dtype=np.int64)
        pos[self.block:] = -1
        B = self.block
        if self._question is not None:
            q_ids, q_pos = self._question
            tok[B:B + q_ids.size], pos[B:B + q_ids.size] = q_ids, q_pos
        elif self._pseudo_spec.get(Keys.PseudoRows.POSITIONS) == RECONSTRUCT:
            r_ids, r_pos = self._reconstruction_rows(start, n)
            tok[B:B + r_ids.size], pos[B:B + r_ids.size] = r_ids, r_pos
        elif self.pseudo_window:
            self.position = start  # the pseudo positions may follow the block (positions=block)
            tok[B:B + self.pseudo_window], pos[B:B + self.pseudo_window] = self._pseudo_rows(n)
        return (tvm.runtime.tensor(tok, self.device), tvm.runtime.tensor(pos, self.device),
                tvm.runtime.tensor(np.array([n], dtype=np.int32), self.device))

    def _run_block(self, ids: np.ndarray, start: int):
        """One ``prefill_block`` call (all its outputs)."""
        return self._prefill(*self._step_inputs(ids, start), *self._tail)

    def call_prefill_block(self, tokens, positions, n_valid):
        """The compiled ``prefill_block`` called as it is, on these VM tensors (the block's token
        ids, their positions, how many are real) and this runtime's caches and weights; returns all
        its outputs. Nothing else is done (no position, stats or policy step): for tools that time
        or inspect the compiled function itself."""
        return self._prefill(tokens, positions, n_valid, *self._tail)

    def question_ids(self, question, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, positions end…) of a question that scores the blocks, or a clear error."""
        from ..policies.base import PolicyError

        q = np.asarray(question, dtype=np.int64).reshape(-1)
        if q.size == 0:
            raise PolicyError("the question is empty; give its text")
        if not self.question_rows:
            raise PolicyError(f"this '{self.policy}' artifact was compiled without question rows, so its blocks "
                              "cannot score with a question; compile it with --question-rows N (N ≥ the question's "
                              "tokens), or read the document without the question")
        if q.size > self.question_rows:
            raise PolicyError(f"the question has {q.size} tokens and this artifact was compiled for questions of at "
                              f"most {self.question_rows}; shorten the question, or compile with --question-rows "
                              f"{q.size} or more")
        return q, np.arange(end, end + q.size, dtype=np.int64)

    def prefill(self, prompt_ids, progress: Callable[[int], None] | None = None, question=None) -> np.ndarray:
        """Prefill the prompt block by block; ``question``: the ids that will follow it (a
        document's question), whose rows score every block (artifacts with ``question_rows``).
        The question itself is not prefilled here."""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("the prompt is empty; give at least one token")
        self._check_room(ids.size)
        if question is not None:
            self._question = self.question_ids(question, self.position + ids.size)
            try:
                return self.prefill(ids, progress)
            finally:
                self._question = None
        if self.position == 0:  # a new sequence: the per-prompt step; a continuation keeps the state
            self.prepare(ids)
        else:  # a continuation's pseudo rows are built from its own tokens, after its end
            self._prompt, self._prompt_end = ids, self.position + ids.size
        logits = None
        t0 = time.perf_counter()
        for s in range(0, ids.size, self.block):
            tb = time.perf_counter()
            logits = self.step_block(ids[s: s + self.block])
            self.stats.block_seconds.append(time.perf_counter() - tb)
            self.stats.prefill_blocks += 1
            if progress is not None:
                progress(min(self.block, ids.size - s))
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefill_tokens += int(ids.size)
        self._sample_rss()
        return logits

    def decode(self, token_id: int) -> np.ndarray:
        import tvm

        self._check_room(1)
        t0 = time.perf_counter()
        out = self._decode(tvm.runtime.tensor(np.array([token_id], dtype=np.int64), self.device),
                           tvm.runtime.tensor(np.array([self.position], dtype=np.int64), self.device), *self._tail)
        self.position += 1
        logits = out[0].numpy()
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_tokens += 1
        return logits

    def generate(self, prompt_ids, max_new_tokens: int, sampler: Callable[[np.ndarray], int] | None = None,
                 eos_ids=(), on_token=None, progress=None) -> list[int]:
        """Prefill then decode (``edgekv.session.generate``, greedy unless a sampler is given); EOS
        ends it and is included."""
        from ..session import generate

        out = generate(self, prompt_ids, sampler or (lambda logits: int(np.argmax(logits))), max_new_tokens,
                       eos_ids=eos_ids, on_token=on_token, progress=progress)
        self._sample_rss()
        return out

    # ---- the Session face (edgekv/session.py) ------------------------------------------------
    def describe(self) -> dict:
        from .artifact_report import artifact_identity

        return artifact_identity(self.manifest, self.path, "tvm", self.budget, self.block)

    def session_stats(self):
        from ..session import SessionStats
        from .artifact_report import manifest_memory_plan, planned_kv_bytes

        self._sample_rss()
        s = self.stats
        return SessionStats(prefill_tokens=s.prefill_tokens, prefill_seconds=s.prefill_seconds,
                            decode_tokens=s.decode_tokens, decode_seconds=s.decode_seconds,
                            cache_lengths=self.cache_lengths(), memory_plan=manifest_memory_plan(self.manifest),
                            planned_kv_bytes=planned_kv_bytes(self.manifest), peak_rss_bytes=s.peak_rss_bytes,
                            device="cpu", question_rows=self.question_rows)

    def report(self) -> dict[str, Any]:
        """Plan vs measured, per phase (same keys as the eager engine's report where they overlap)."""
        return {
            "artifact": str(self.path) if self.path else None,
            "model": self.manifest.model_id,
            "policy": self.manifest.raw[Keys.POLICY],
            "budget": self.budget,
            "block": self.block,
            "target": self.manifest.raw[Keys.TARGET],
            "memory_plan": self.manifest.raw[Keys.MEMORY_PLAN],
            "measured": {"peak_rss_bytes": self.stats.peak_rss_bytes},
            "stats": self.stats.as_dict(),
            "cache_lengths": self.cache_lengths(),
        }
