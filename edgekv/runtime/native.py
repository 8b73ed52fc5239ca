"""Finding the native runtime that `pip install` built from ``runtime/`` (scikit-build-core).

``pip install`` puts ``libedgekv_runtime.so`` into the package (``edgekv/_native/``) and the
``edgekv-run`` command on PATH. ``EDGEKV_RUNTIME_LIB`` / ``EDGEKV_RUN`` point at another build
(an AddressSanitizer build in the tests, a cross build).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from functools import lru_cache
from pathlib import Path

from ..artifact import Keys

LIB_NAME = "libedgekv_runtime.so"
CLI_NAME = "edgekv-run"


class NativeRuntimeMissing(RuntimeError):
    """The native runtime was not built (the package was installed without its CMake build)."""


def _installed(relpath: str) -> Path | None:
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        dist = distribution("edgekv")
    except (ImportError, PackageNotFoundError):
        return None
    for f in dist.files or []:
        if str(f).replace("\\", "/").endswith(relpath):
            p = Path(str(dist.locate_file(f))).resolve()
            if p.is_file():
                return p
    return None


def library_path() -> Path | None:
    """The shared library to load, or None when there is none."""
    env = os.environ.get("EDGEKV_RUNTIME_LIB")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[1] / "_native" / LIB_NAME  # a wheel install
    if here.is_file():
        return here
    return _installed(f"edgekv/_native/{LIB_NAME}")


def cli_path() -> Path | None:
    """The ``edgekv-run`` command, or None when it was not built."""
    env = os.environ.get("EDGEKV_RUN")
    if env:
        return Path(env)
    found = shutil.which(CLI_NAME)
    return Path(found) if found else _installed(CLI_NAME)


def available() -> bool:
    p = library_path()
    return p is not None and p.is_file()


def opencl_unavailable_reason() -> str | None:
    """Why an OpenCL artifact cannot run here (None when it can): the runtime built without its
    OpenCL device, no OpenCL library, or no platform (driver) behind it."""
    lib = _declare(load_library())
    if b"opencl" not in lib.ekv_runtime_devices().split(b","):
        return "this runtime was built without OpenCL"
    try:
        cl = ctypes.CDLL("libOpenCL.so.1")
    except OSError:
        return "no OpenCL library (apt-get install ocl-icd-libopencl1 pocl-opencl-icd)"
    count = ctypes.c_uint(0)
    if cl.clGetPlatformIDs(0, None, ctypes.byref(count)) != 0 or count.value == 0:
        return "no OpenCL platform (apt-get install pocl-opencl-icd: OpenCL on the CPU)"
    return None


@lru_cache(maxsize=None)
def load_library(path: str | None = None) -> ctypes.CDLL:
    """Load the runtime library (once). RTLD_GLOBAL: the TVM-generated kernel library that the
    runtime dlopens resolves ``TVMFFIErrorSetRaisedFromCStrParts`` from the process."""
    p = Path(path) if path else library_path()
    if p is None or not p.is_file():
        raise NativeRuntimeMissing(
            "the native runtime (libedgekv_runtime.so) is not built; reinstall with "
            "`pip install -e .` (it builds runtime/ with CMake), or set EDGEKV_RUNTIME_LIB")
    return ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)


# ---- the C API through ctypes (runtime/include/edgekv.h) ------------------------------------
class NativeError(RuntimeError):
    """The native runtime refused or failed; the message is the runtime's own."""


class _ModelOptions(ctypes.Structure):
    _fields_ = [("threads", ctypes.c_int), ("mem_limit_bytes", ctypes.c_uint64), ("verify_weights", ctypes.c_int)]


class _ModelInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_char_p) for n in ("model_id", "policy", "policy_params", "target_profile", "target_arch",
                                                "edgekv_version", "weight_hash")] + \
               [(n, ctypes.c_int32) for n in ("num_layers", "vocab_size", "max_position", "budget", "block",
                                               "pseudo_rows", "threads", "chat")] + \
               [(n, ctypes.c_uint64) for n in ("weights_bytes", "cache_bytes", "arena_bytes", "plan_bytes")] + \
               [(n, ctypes.c_int32) for n in ("n_kernels", "n_calls_prefill", "n_calls_decode")] + \
               [("device", ctypes.c_char_p), ("weights_check", ctypes.c_int32), ("verify_seconds", ctypes.c_double),
                ("threads_cores", ctypes.c_int32), ("threads_busy", ctypes.c_int32)]

VERIFY_MODES = {"off": 0, "default": 1, "always": 2}  # edgekv.h's EKV_VERIFY_*
WEIGHTS_CHECK = {0: "unchecked", 1: "checked", 2: "stamped"}  # EKV_WEIGHTS_*


class _Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("prefill_tokens", "prefill_blocks", "decode_tokens")] + \
               [(n, ctypes.c_double) for n in ("prefill_seconds", "decode_seconds", "prepare_seconds", "load_seconds",
                                                "first_block_seconds")] + \
               [(n, ctypes.c_uint64) for n in ("runtime_bytes_peak", "workspace_bytes_peak", "peak_rss_bytes",
                                               "mapped_bytes", "device_bytes_peak")]


class _SnapshotInfo(ctypes.Structure):
    _fields_ = [("question", ctypes.c_char_p), ("made_from", ctypes.c_char_p), ("chat", ctypes.c_int),
                ("tokens", ctypes.c_uint64), ("document_seconds", ctypes.c_double)]


PROGRESS_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
STATUS_NAMES = {1: "io", 2: "format", 3: "mismatch", 4: "invalid input", 5: "no memory", 6: "kernel", 7: "cancelled",
                8: "capacity", 9: "device"}


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if getattr(lib, "_edgekv_declared", False):
        return lib
    P, c = ctypes.c_void_p, ctypes
    sig = {
        "ekv_model_options_init": (None, [c.POINTER(_ModelOptions)]),
        "ekv_runtime_devices": (c.c_char_p, []),
        "ekv_model_open": (c.c_int, [c.c_char_p, c.POINTER(_ModelOptions), c.POINTER(P)]),
        "ekv_model_close": (None, [P]),
        "ekv_model_last_error": (c.c_char_p, [P]),
        "ekv_model_get_info": (None, [P, c.POINTER(_ModelInfo)]),
        "ekv_session_new": (c.c_int, [P, c.POINTER(P)]),
        "ekv_session_free": (None, [P]),
        "ekv_session_last_error": (c.c_char_p, [P]),
        "ekv_session_reset": (None, [P]),
        "ekv_session_prefill": (c.c_int, [P, c.POINTER(c.c_int32), c.c_size_t, PROGRESS_FN, P]),
        "ekv_session_decode": (c.c_int, [P, c.c_int32]),
        "ekv_session_set_question": (c.c_int, [P, c.POINTER(c.c_int32), c.c_size_t]),
        "ekv_model_question_rows": (c.c_int32, [P]),
        "ekv_session_logits": (c.POINTER(c.c_float), [P]),
        "ekv_session_position": (c.c_size_t, [P]),
        "ekv_session_allow_beyond_context": (None, [P, c.c_int]),
        "ekv_session_cancel": (None, [P]),
        "ekv_session_kept_positions": (c.c_int, [P, c.c_int32, c.POINTER(c.c_int32), c.c_size_t,
                                                 c.POINTER(c.c_int32), c.POINTER(c.c_int32)]),
        "ekv_session_get_stats": (None, [P, c.POINTER(_Stats)]),
        "ekv_session_save": (c.c_int, [P, c.c_char_p, c.c_char_p, c.c_int]),
        "ekv_session_snapshot_info": (c.c_int, [P, c.POINTER(_SnapshotInfo)]),
        "ekv_session_load": (c.c_int, [P, c.c_char_p]),
    }
    for name, (res, args) in sig.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:  # a library built from an older checkout than this Python package
            raise NativeRuntimeMissing(
                f"the native runtime library {lib._name} lacks {name}: it was built from another version of edgekv; "
                "rebuild it (pip install -e .), or run with --runtime tvm") from None
        fn.restype, fn.argtypes = res, args
    lib._edgekv_declared = True
    return lib


class Cancelled(KeyboardInterrupt):
    """Ctrl-C (SIGINT) ended a native call: the runtime stopped at its next kernel call."""


class _InterruptibleCalls:
    """Long native calls (a prefill, a decode step) made so that Ctrl-C ends them within one kernel.

    A ctypes call holds the main thread until it returns, and Python runs its SIGINT handler only
    between bytecodes of that thread: a minute-long prefill would ignore Ctrl-C for a minute (and a
    KeyboardInterrupt raised inside a progress callback is dropped by ctypes). So the call runs on
    one worker thread and the main thread waits for it in short, interruptible waits; on Ctrl-C it
    sets the session's cancel flag (``ekv_session_cancel``: the runtime checks it between kernel
    calls), waits for the call to return and raises ``Cancelled``. Off the main thread (no signals
    there) the call is made directly."""

    def __init__(self):
        self._pool = None

    def call(self, cancel, fn, *args):
        import threading

        if threading.current_thread() is not threading.main_thread():
            return fn(*args)
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgekv-native")
        future = self._pool.submit(fn, *args)
        try:
            return future.result()  # a Condition wait: SIGINT's KeyboardInterrupt interrupts it
        except KeyboardInterrupt:
            cancel()
            while True:  # the runtime stops at its next kernel call; a second Ctrl-C does not abandon it
                try:
                    future.result()
                    break
                except KeyboardInterrupt:
                    continue
                except Exception:  # noqa: BLE001 - the cancelled call's own error is not the story
                    break
            raise Cancelled("cancelled (Ctrl-C): the native runtime stopped at its next kernel call") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class NativeRuntime:
    """A compiled artifact run by the native runtime (libedgekv_runtime) — a ``Session``
    (``edgekv/session.py``) as ``HostRuntime`` is, with its kept positions, no TVM in the process.

        rt = NativeRuntime("build/kd", threads=2)
        ids = rt.generate(prompt_ids, 64)
    """

    def __init__(self, artifact, *, threads: int | None = None, mem_limit: int | None = None,
                 verify: str = "default", verify_weights: bool = False, library: str | None = None):
        import numpy as np

        from ..artifact import ArtifactError, Manifest

        self._np = np
        self.path = Path(artifact)
        self.lib = _declare(load_library(library))
        opts = _ModelOptions()
        self.lib.ekv_model_options_init(ctypes.byref(opts))
        opts.threads = int(threads or 0)
        opts.mem_limit_bytes = int(mem_limit or 0)
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify {verify!r}: one of {', '.join(VERIFY_MODES)}")
        # the weights' checksums at open (runtime/src/weights_check.c); verify_weights: the older
        # spelling of verify="always"
        opts.verify_weights = VERIFY_MODES["always" if verify_weights else verify]
        self._model = ctypes.c_void_p()
        self._session = ctypes.c_void_p()
        st = self.lib.ekv_model_open(str(self.path).encode(), ctypes.byref(opts), ctypes.byref(self._model))
        if st != 0:
            msg = self.lib.ekv_model_last_error(self._model).decode(errors="replace")
            self.close()
            raise (MemoryError if st == 5 else ArtifactError)(msg)
        try:
            self.manifest: Manifest | None = Manifest.read(self.path)
        except Exception:  # the native runtime needs only program.ekv; the manifest is for reports
            self.manifest = None
        info = _ModelInfo()
        self.lib.ekv_model_get_info(self._model, ctypes.byref(info))
        self.info = {f: (getattr(info, f).decode() if isinstance(getattr(info, f), bytes) else getattr(info, f))
                     for f, _ in _ModelInfo._fields_}
        st = self.lib.ekv_session_new(self._model, ctypes.byref(self._session))
        if st != 0:
            msg = self.lib.ekv_session_last_error(self._session).decode(errors="replace")
            self.close()
            raise MemoryError(msg) if st == 5 else NativeError(msg)
        self.budget, self.block = self.info["budget"], self.info["block"]
        self.num_layers, self.vocab_size = self.info["num_layers"], self.info["vocab_size"]
        self.policy = self.info["policy"]
        self.threads = self.info["threads"]
        from ..artifact.weights_check import WeightsCheck

        self.weights_check = WeightsCheck(WEIGHTS_CHECK.get(self.info["weights_check"], "unchecked"),
                                          self.info["verify_seconds"])
        self._block_hook = None
        self._calls = _InterruptibleCalls()

    def _long_call(self, fn, *args) -> int:
        """``fn(*args)`` (a session call that may run long), ended by Ctrl-C within one kernel."""
        return self._calls.call(lambda: self.lib.ekv_session_cancel(self._session), fn, *args)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_calls", None) is not None:
            self._calls.close()
        if getattr(self, "_session", None):
            self.lib.ekv_session_free(self._session)
            self._session = None
        if getattr(self, "_model", None):
            self.lib.ekv_model_close(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _check(self, status: int) -> None:
        if status != 0:
            msg = self.lib.ekv_session_last_error(self._session).decode(errors="replace")
            from ..policies.base import PolicyError

            if status == 4 or status == 8:
                raise PolicyError(msg)
            raise NativeError(f"{STATUS_NAMES.get(status, status)}: {msg}")

    @property
    def tokenizer(self):
        """The HF tokenizer saved in the artifact, for Python-side encoding (None when absent)."""
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = None
            entry = self.manifest.files.get(Keys.Files.TOKENIZER) if self.manifest is not None else None
            if entry:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.path / entry.name))
        return self._tokenizer

    # ---- running -----------------------------------------------------------------------------
    def reset(self) -> None:
        self.lib.ekv_session_reset(self._session)

    @property
    def position(self) -> int:
        return int(self.lib.ekv_session_position(self._session))

    def allow_beyond_context(self, allow: bool = True) -> None:
        self.lib.ekv_session_allow_beyond_context(self._session, int(allow))

    def _logits(self):
        ptr = self.lib.ekv_session_logits(self._session)
        return self._np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy()

    @property
    def question_rows(self) -> int:
        """The longest question (tokens) this artifact's blocks can score with (0: none)."""
        return int(self.lib.ekv_model_question_rows(self._model))

    def prefill(self, prompt_ids, progress=None, on_block=None, question=None):
        """Block-wise prefill; ``progress(n)`` gets each block's token count, ``on_block(rt)``
        runs after every block (tests read the kept positions there). Returns last-token logits.
        ``question``: the ids that will follow (a document's question; artifacts compiled with
        --question-rows), whose rows score every block; it is not prefilled here."""
        if question is not None:
            q = self._np.ascontiguousarray(self._np.asarray(question, dtype=self._np.int64).reshape(-1),
                                           dtype=self._np.int32)
            if q.size == 0:
                from ..policies.base import PolicyError

                raise PolicyError("the question is empty; give its text")
            self._check(self.lib.ekv_session_set_question(self._session, q.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                                          q.size))
            try:
                return self.prefill(prompt_ids, progress, on_block)
            finally:
                self.lib.ekv_session_set_question(self._session, None, 0)
        ids = self._np.ascontiguousarray(self._np.asarray(prompt_ids, dtype=self._np.int64).reshape(-1), dtype=self._np.int32)
        seen = [0]

        def cb(_user, done, total):
            if progress is not None:
                progress(int(done) - seen[0])
            seen[0] = int(done)
            if on_block is not None:
                on_block(self)
            return 0

        fn = PROGRESS_FN(cb)
        self._check(self._long_call(self.lib.ekv_session_prefill, self._session,
                                    ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), ids.size, fn, None))
        return self._logits()

    def decode(self, token_id: int):
        self._check(self._long_call(self.lib.ekv_session_decode, self._session, int(token_id)))
        return self._logits()

    def generate(self, prompt_ids, max_new_tokens: int, sampler=None, eos_ids=(), on_token=None, progress=None):
        """Prefill then decode (``edgekv.session.generate``, greedy unless a sampler is given); EOS
        ends it and is included."""
        from ..session import generate

        return generate(self, prompt_ids, sampler or (lambda logits: int(self._np.argmax(logits))), max_new_tokens,
                        eos_ids=eos_ids, on_token=on_token, progress=progress)

    def save_cache(self, path, question: str | None = None, chat: bool = False, made_from: str = "") -> None:
        """Save the cache state to one file, atomically (``ekv_session_save``; it records the
        artifact's absolute path itself, ``made_from`` is ignored)."""
        from ..artifact.snapshot_file import SnapshotError

        st = self.lib.ekv_session_save(self._session, str(path).encode(), (question or "").encode(), int(chat))
        if st != 0:
            raise SnapshotError(self.lib.ekv_session_last_error(self._session).decode(errors="replace"))

    def load_cache(self, path) -> str:
        """Map a snapshot back and continue from it; returns the question it was made with ("")."""
        from ..artifact.snapshot_file import SnapshotError

        st = self.lib.ekv_session_load(self._session, str(path).encode())
        if st != 0:
            raise SnapshotError(self.lib.ekv_session_last_error(self._session).decode(errors="replace"))
        info = _SnapshotInfo()
        self.lib.ekv_session_snapshot_info(self._session, ctypes.byref(info))
        self.snapshot_info = {"question": (info.question or b"").decode(errors="replace"),
                              "made_from": (info.made_from or b"").decode(errors="replace"), "chat": bool(info.chat),
                              "tokens": int(info.tokens), "document_seconds": float(info.document_seconds)}
        return self.snapshot_info["question"]

    def kept_positions(self, layer: int):
        """Original positions of layer ``layer``'s kept entries, [H, fill]."""
        heads, fill = ctypes.c_int32(), ctypes.c_int32()
        self._check(self.lib.ekv_session_kept_positions(self._session, layer, None, 0, ctypes.byref(heads),
                                                        ctypes.byref(fill)))
        out = self._np.zeros((heads.value, fill.value), dtype=self._np.int32)
        self._check(self.lib.ekv_session_kept_positions(self._session, layer,
                                                        out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), out.size,
                                                        ctypes.byref(heads), ctypes.byref(fill)))
        return out

    def cache_lengths(self) -> list[int]:
        return [int(self.kept_positions(layer).shape[1]) for layer in range(self.num_layers)]

    @property
    def stats(self):
        """The session's counters, with the attribute names of ``HostRuntime.stats``."""
        from types import SimpleNamespace

        st = _Stats()
        self.lib.ekv_session_get_stats(self._session, ctypes.byref(st))
        d = {f: getattr(st, f) for f, _ in _Stats._fields_}
        d["prefill_tok_per_s"] = d["prefill_tokens"] / d["prefill_seconds"] if d["prefill_seconds"] else None
        d["decode_tok_per_s"] = d["decode_tokens"] / d["decode_seconds"] if d["decode_seconds"] else None
        return SimpleNamespace(**d)

    # ---- the Session face (edgekv/session.py) ------------------------------------------------
    def describe(self) -> dict:
        from .artifact_report import artifact_identity

        return artifact_identity(self.manifest, self.path, "native", self.budget, self.block)

    def session_stats(self):
        from ..session import SessionStats
        from .artifact_report import planned_kv_bytes

        s = self.stats
        return SessionStats(prefill_tokens=s.prefill_tokens, prefill_seconds=s.prefill_seconds,
                            decode_tokens=s.decode_tokens, decode_seconds=s.decode_seconds,
                            cache_lengths=self.cache_lengths(), memory_plan=self.memory_plan(),
                            planned_kv_bytes=planned_kv_bytes(self.manifest), peak_rss_bytes=s.peak_rss_bytes,
                            device=self.info["device"], device_bytes_peak=int(s.device_bytes_peak),
                            question_rows=self.question_rows, threads={"native": self.threads})

    def memory_plan(self) -> dict:
        """The native plan: mapped weights, one session's caches and arena (exact bytes)."""
        i = self.info
        return {"weights": i["weights_bytes"], "kv_cache": i["cache_bytes"], "activations": i["arena_bytes"],
                "total": i["plan_bytes"]}
