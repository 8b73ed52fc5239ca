"""One benchmark run per system, executed inside a worker process.

Each function prefills the same prompt token ids, then decodes `decode_tokens` tokens
greedily, and returns seconds per phase. A one-block warm-up run before the timed run is
excluded, so the first-call costs (allocator, oneDNN/JIT set-up) are not counted."""

from __future__ import annotations

import time
from typing import Callable

import torch

SYSTEMS: dict[str, Callable] = {}
NEEDS = {  # the import each peer needs; missing → reported as "not installed"
    "hf": "transformers", "kvpress": "kvpress", "llamacpp": "llama-bench", "edgekv-compiled": "tvm",
    "onnxruntime": "onnxruntime", "edgekv-native": "edgekv-run", "edgekv-native-fp32": "edgekv-run",
}


def system(name):
    def register(fn):
        SYSTEMS[name] = fn
        return fn
    return register


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _timed_greedy_decode(step, logits, count: int) -> float:
    """Seconds to decode ``count`` tokens greedily with ``step(token) -> logits``."""
    def run():
        nonlocal logits
        for _ in range(count):
            logits = step(int(logits.argmax()))
    return _timed(run)[1]


def _prefill_with_question(prefill, ids, q: int):
    """The whole prompt, or (``q`` > 0) its document knowing its last q tokens, then those tokens:
    what `--question` costs (a query-aware policy's blocks run q more rows each)."""
    if not q:
        return prefill(ids)
    prefill(ids[:-q], question=ids[-q:])
    return prefill(ids[-q:])


@system("edgekv-eager")
def run_edgekv_eager(ids, args):
    from ..engine import BlockEngine
    from ..models import load_model
    from ..policies import make_policy

    model = load_model(args["model"])
    q = int(args.get("question_tokens") or 0)
    BlockEngine(model, make_policy(args["policy"]), args["budget"], args["block"]).prefill(ids[: args["block"]])
    engine = BlockEngine(model, make_policy(args["policy"]), args["budget"], args["block"],
                         max_tokens=int(ids.numel()) + args["decode_tokens"], question_rows=q)  # as `edgekv run` allocates
    logits, prefill = _timed(lambda: _prefill_with_question(engine.prefill, ids, q))
    dec = _timed_greedy_decode(engine.decode, logits, args["decode_tokens"])
    return {"prefill_seconds": prefill, "decode_seconds": dec, "kv_bytes": engine.kv_bytes}


@system("edgekv-compiled")
def run_edgekv_compiled(ids, args):
    from ..runtime import HostRuntime

    if not args.get("artifact"):
        raise RuntimeError("no compiled artifact given (--artifact); build one with `edgekv compile`")
    rt = HostRuntime(args["artifact"])
    rt.prefill(ids[: args["block"]].numpy())
    rt.reset()
    logits, prefill = _timed(lambda: _prefill_with_question(rt.prefill, ids.numpy(), int(args.get("question_tokens") or 0)))
    dec = _timed_greedy_decode(rt.decode, logits, args["decode_tokens"])
    return {"prefill_seconds": prefill, "decode_seconds": dec, "block_seconds": rt.stats.block_seconds}


@system("edgekv-native-fp32")
def run_edgekv_native_fp32(ids, args):
    """``edgekv-native`` on the same build with fp32 weights (``--fp32-artifact``)."""
    if not args.get("fp32_artifact"):
        raise RuntimeError("no fp32 artifact given (--fp32-artifact); build one with `edgekv compile --weights fp32`")
    return run_edgekv_native(ids, {**args, "artifact": args["fp32_artifact"]})


@system("edgekv-native")
def run_edgekv_native(ids, args):
    """The native runtime's own command, ``edgekv-run``, as a child process that never starts
    Python: its report gives the timings and its own peak RSS (a warm-up block first, excluded,
    as for the other systems; a fixed number of decode steps, EOS ignored). Start-up — load to
    the end of the first block — is from the same run before the warm-up."""
    import json
    import subprocess
    import tempfile

    from ..runtime import native

    exe = native.cli_path()
    if exe is None:
        raise RuntimeError("edgekv-run is not built (pip install -e . builds runtime/)")
    if not args.get("artifact"):
        raise RuntimeError("no compiled artifact given (--artifact); build one with `edgekv compile`")
    with tempfile.TemporaryDirectory() as d:
        report, id_file = f"{d}/native.json", f"{d}/ids.txt"
        with open(id_file, "w") as f:  # a file: a long prompt's ids exceed one argument's 128 KiB limit
            f.write(",".join(map(str, ids.tolist())))
        cmd = [str(exe), args["artifact"], "--prompt-ids", "@" + id_file, "--max-new-tokens",
               str(args["decode_tokens"] + 1), "--threads", str(args["threads"]), "--warmup", "--ignore-eos",
               "--allow-beyond-context", "--quiet", "--report", report]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"edgekv-run failed: {res.stderr.strip()[-500:]}")
        r = json.loads(open(report).read())
    return {"prefill_seconds": r["prefill_seconds"], "decode_seconds": r["decode_seconds"],
            "peak_rss": r["memory"]["peak_rss_bytes"], "plan_bytes": r["memory"]["plan"]["total_bytes"],
            "startup_seconds": r["startup_seconds"], "threads": r["threads"]}


def hf_generate(model, ids, decode_tokens, press=None):
    from contextlib import nullcontext

    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        ctx = press(model) if press is not None else nullcontext()
        with ctx:
            out, prefill = _timed(lambda: model(ids[None], past_key_values=cache, use_cache=True))
        token = out.logits[0, -1].argmax()

        def decode():
            nonlocal token
            pos = ids.numel()
            for i in range(decode_tokens):
                step = model(token.view(1, 1), past_key_values=cache, use_cache=True,
                             position_ids=torch.tensor([[pos + i]]))
                token = step.logits[0, -1].argmax()
        _, dec = _timed(decode)
    return prefill, dec


@system("hf")
def run_hf(ids, args):
    from ..models import load_model

    model = load_model(args["model"]).to_hf()
    hf_generate(model, ids[: args["block"]], 1)
    prefill, dec = hf_generate(model, ids, args["decode_tokens"])
    return {"prefill_seconds": prefill, "decode_seconds": dec}


@system("kvpress")
def run_kvpress(ids, args):
    """kvpress BlockPress(KeyDiffPress): it runs the FULL prompt in one forward pass and
    prunes block-wise afterwards (a simulation, per its own docstring), with a compression
    ratio chosen so that N entries remain."""
    from kvpress import BlockPress, KeyDiffPress

    from ..models import load_model

    model = load_model(args["model"]).to_hf()
    ratio = max(0.0, 1.0 - args["budget"] / ids.numel())
    press = BlockPress(KeyDiffPress(compression_ratio=ratio), block_size=args["block"])
    hf_generate(model, ids[: args["block"]], 1, press)
    prefill, dec = hf_generate(model, ids, args["decode_tokens"], press)
    return {"prefill_seconds": prefill, "decode_seconds": dec, "compression_ratio": ratio}


@system("llamacpp")
def run_llamacpp(ids, args):
    """llama.cpp's own `llama-bench` on the same GGUF (its kernels, full F16 cache), as a child
    process (``edgekv.bench.llama_cpp``; built once by tools/bench/build_llama_cpp.py): pp<L> for the
    prefill, tg<decode_tokens> at depth L for the decode, each the better of flash attention off and
    on (both recorded). llama-bench feeds its own random ids: its speed does not depend on them."""
    from ..models.sources import resolve
    from .llama_cpp import llama_bench

    src = resolve(args["model"])
    if src.kind != "gguf":
        raise RuntimeError("llama.cpp needs a GGUF model")
    n, t = int(ids.numel()), int(args["decode_tokens"])
    runs = {f"{phase}_fa{int(fa)}": llama_bench(src.path, args["threads"], flash_attn=fa,
                                                **({"prompt": n} if phase == "prefill" else {"generate": t, "depth": n}))
            for phase in ("prefill", "decode") for fa in (False, True)}
    pre = max((runs["prefill_fa0"], runs["prefill_fa1"]), key=lambda r: r["tok_s"])
    dec = max((runs["decode_fa0"], runs["decode_fa1"]), key=lambda r: r["tok_s"])
    return {"prefill_seconds": n / pre["tok_s"], "decode_seconds": t / dec["tok_s"] if t else 0.0,
            "peak_rss": dec["peak_rss"], "llama_bench": runs}  # the tg run holds the context of n + t tokens


@system("onnxruntime")
def run_onnxruntime(ids, args):
    """ONNX Runtime (CPU execution provider) on the model exported by torch in the
    past_key_values form (``edgekv export-onnx --form past``; the runner exports it once, in
    its own process, so the export's memory is not in this run's peak RSS): full cache."""
    import numpy as np
    import onnxruntime as ort

    if not args.get("onnx"):
        raise RuntimeError("no ONNX file given (--onnx FILE from `edgekv export-onnx --form past`)")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args["threads"]
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(args["onnx"], opts, providers=["CPUExecutionProvider"])
    past_inputs = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    if not past_inputs:
        raise RuntimeError(f"{args['onnx']} has no past_key_values inputs; export it with --form past")
    outputs = [o.name for o in sess.get_outputs()]

    def empty_cache():
        return {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), dtype=np.float32) for i in past_inputs}

    def forward(tokens, cache):
        start, n = next(iter(cache.values())).shape[2], len(tokens)
        feed = {"input_ids": np.asarray([tokens], dtype=np.int64),
                "attention_mask": np.ones((1, start + n), dtype=np.int64),
                "position_ids": np.arange(start, start + n, dtype=np.int64)[None], **cache}
        got = sess.run(outputs, feed)
        present = {name.replace("present.", "past_key_values."): t for name, t in zip(outputs[1:], got[1:])}
        return torch.from_numpy(got[0][0, -1]), present

    tokens = ids.tolist()
    forward(tokens[: args["block"]], empty_cache())  # warm-up
    (logits, cache), prefill = _timed(lambda: forward(tokens, empty_cache()))

    def step(token):
        nonlocal cache
        logits, cache = forward([token], cache)
        return logits
    dec = _timed_greedy_decode(step, logits, args["decode_tokens"])
    return {"prefill_seconds": prefill, "decode_seconds": dec}
