"""ONNX input: an exported decoder ``model.onnx`` → the same Relax functions as the torch path.

Two ONNX forms are accepted (``onnx_export.py`` writes both with ``torch.onnx.export``):

  * plain:  ``input_ids[1, T], position_ids[1, T] → logits[1, T, V]``;
  * past:   the HF/optimum form ``input_ids, attention_mask, position_ids,
    past_key_values.{i}.key/value[1, H, P, d] → logits, present.{i}.key/value``.

The file is *specialised* before TVM sees it (ONNX glue, nothing model-specific): dynamic
dimensions are fixed to the block length T (B for ``prefill_src``, 1 for ``decode_src``);
``attention_mask`` becomes a constant of ones (no padding: the block step masks padding itself);
each ``past_key_values.*`` input becomes an empty constant [1, H, 0, d] — past length 0 — so
``concat(past, present)`` is the block's own K/V, which the rewrite then reads from the cache;
only the logits output is kept. onnxscript's optimizer then folds what is now constant: the shape
arithmetic and the mask subgraph (HF's mask is built from ``attention_mask``/``cache_position``),
so the attention-site matcher sees a constant causal mask. Initializers that are not weights
(shape vectors, scalars, the folded mask) become constants; the file's own floating initializers
stay function inputs and are the artifact's weights. TVM's ``relax.frontend.onnx.from_onnx``
imports the result.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CompileError

TOKENS, POSITIONS = "tokens", "positions"  # the input names the rewrite pass expects (BlockCacheSpec)
TOKEN_NAMES = ("input_ids", "tokens", "input")
POSITION_NAMES = ("position_ids", "positions")
MASK_NAMES = ("attention_mask",)
PAST_MARKERS = ("past_key_values", "past_key", "past_value", "past.")
INSTALL_HINT = "pip install -e '.[compile]' (ONNX input needs the `onnx` package)"


def require_onnx():
    try:
        import onnx
    except ImportError:
        raise CompileError(f"compiling an .onnx file needs the `onnx` package: {INSTALL_HINT}") from None
    return onnx


def is_onnx_path(name: Any) -> bool:
    return name is not None and str(name).lower().endswith(".onnx")


def load_onnx(path: str | Path):
    """The ModelProto of ``path`` (external data loaded), or a CompileError saying what is wrong."""
    onnx = require_onnx()
    path = Path(path)
    if not path.is_file():
        raise CompileError(f"ONNX file '{path}' does not exist")
    try:
        proto = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, external data OSError, ...
        raise CompileError(f"'{path}' is not a readable ONNX model ({type(exc).__name__}: {exc}); pass a .onnx file "
                           "written by torch.onnx.export / optimum (e.g. `edgekv export-onnx`)") from None
    if not proto.graph.node:
        raise CompileError(f"'{path}' holds no ONNX graph (0 nodes); it is not an exported model")
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:  # noqa: BLE001 - onnx.checker.ValidationError and friends
        raise CompileError(f"'{path}' is not a valid ONNX model: {str(exc).splitlines()[0]}") from None
    return proto


# ---- input roles ---------------------------------------------------------------------------

def _dims(value_info) -> list:
    """Static dims as ints; dynamic ones as their name (or None when unnamed)."""
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value_info.type.tensor_type.shape.dim]


def input_roles(proto) -> dict[str, str]:
    """Each graph input's role: tokens, positions, mask or past; anything else is refused."""
    init = {i.name for i in proto.graph.initializer}
    roles = {}
    for vi in proto.graph.input:
        if vi.name in init:
            continue
        low = vi.name.lower()
        if low in TOKEN_NAMES:
            roles[vi.name] = "tokens"
        elif low in POSITION_NAMES:
            roles[vi.name] = "positions"
        elif low in MASK_NAMES:
            roles[vi.name] = "mask"
        elif any(m in low for m in PAST_MARKERS) and len(_dims(vi)) == 4:
            roles[vi.name] = "past"
        else:
            raise CompileError(f"ONNX input '{vi.name}' {_dims(vi)} is not one edgekv knows; supported inputs: "
                               "input_ids, position_ids, attention_mask, past_key_values.<i>.key/value")
    names = {r: [n for n, x in roles.items() if x == r] for r in ("tokens", "positions")}
    if len(names["tokens"]) != 1:
        raise CompileError(f"the ONNX graph needs one token input named input_ids (its inputs: {', '.join(roles)})")
    if len(names["positions"]) != 1:
        raise CompileError("the ONNX graph has no position_ids input; the block step feeds every block its original "
                           "positions, so export the decoder with position_ids (e.g. `edgekv export-onnx`) "
                           f"(its inputs: {', '.join(roles)})")
    return roles


def _logits_output(proto) -> str:
    outs = [o.name for o in proto.graph.output]
    for o in outs:
        if o == "logits":
            return o
    return outs[0]


# ---- specialisation ------------------------------------------------------------------------

def _is_weight(tensor) -> bool:
    from onnx import TensorProto

    floating = tensor.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
    return floating and int(np.prod(tensor.dims, dtype=np.int64)) > 1


def specialise(proto, seq_len: int):
    """A copy of ``proto`` with static shapes for one block length (see the module doc)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    roles = input_roles(model)
    rename = {n: TOKENS if r == "tokens" else POSITIONS for n, r in roles.items() if r in ("tokens", "positions")}
    constants = []
    keep_inputs = []
    for vi in graph.input:
        role = roles.get(vi.name)
        if role is None:  # an initializer listed as input (old exporters)
            keep_inputs.append(vi)
            continue
        dims = _dims(vi)
        if role in ("tokens", "positions"):
            if len(dims) != 2 or not (dims[0] == 1 or not isinstance(dims[0], int)):
                raise CompileError(f"ONNX input '{vi.name}' has shape {dims}; expected [batch, T] (batch 1 or dynamic)")
            if isinstance(dims[1], int) and dims[1] != seq_len:
                raise CompileError(f"ONNX input '{vi.name}' has a fixed length {dims[1]}, but edgekv imports the graph "
                                   f"at T = {seq_len} (T = block for prefill, 1 for decode); export with a dynamic "
                                   "sequence dimension (torch.onnx.export dynamic_shapes / dynamic_axes, or "
                                   "`edgekv export-onnx`)")
            new = helper.make_tensor_value_info(rename[vi.name], vi.type.tensor_type.elem_type, [1, seq_len])
            keep_inputs.append(new)
        elif role == "mask":
            constants.append(helper.make_node("Constant", [], [vi.name], value=numpy_helper.from_array(
                np.ones((1, seq_len), dtype=onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)))))
        else:  # past: an empty cache
            if len(dims) != 4 or not all(isinstance(d, int) and d > 0 for d in (dims[1], dims[3])):
                raise CompileError(f"past input '{vi.name}' has shape {dims}; expected [batch, kv_heads, past, head_dim] "
                                   "with kv_heads and head_dim fixed")
            empty = np.zeros((1, dims[1], 0, dims[3]),
                             dtype=onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
            constants.append(helper.make_node("Constant", [], [vi.name], value=numpy_helper.from_array(empty)))
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    logits = _logits_output(model)
    out = next(o for o in graph.output if o.name == logits)
    out_type = out.type.tensor_type.elem_type
    del graph.input[:]
    graph.input.extend(keep_inputs)
    nodes = constants + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.output[:]
    vocab = _dims(out)[-1] if _dims(out) else None
    graph.output.append(helper.make_tensor_value_info(logits, out_type, [1, seq_len, vocab]))
    del graph.value_info[:]
    if out_type != TensorProto.FLOAT:
        raise CompileError(f"the logits output '{logits}' is {TensorProto.DataType.Name(out_type)}; only float32 "
                           "models are compiled (export in fp32)")
    return model


def fold_shapes(model):
    """Fold the graph's shape arithmetic (Shape → Gather → Range/Reshape ...) into constants with
    onnxscript's optimizer: with static inputs it is all constant, and TVM's ONNX frontend cannot
    import some of its dynamic forms (a Reshape of a shape-derived scalar)."""
    try:
        from onnxscript import optimizer
    except ImportError:
        raise CompileError(f"compiling an .onnx file needs the `onnxscript` package: {INSTALL_HINT}") from None
    return optimizer.optimize(model)


def inline_constants(model, weight_names: set[str]):
    """Initializers that are not weights become Constant nodes, so TVM folds the shapes and masks
    they feed: shape vectors, scalars, and what the optimizer folded (the causal mask, RoPE tables).
    A weight is a floating tensor of more than one element that the user's file holds as an
    initializer; those stay function inputs and become the artifact's weights."""
    from onnx import helper

    graph = model.graph
    weights, constants = [], []
    for init in graph.initializer:
        if init.name in weight_names and _is_weight(init):
            weights.append(init)
        else:
            constants.append(helper.make_node("Constant", [], [init.name], value=init))
    names = {c.output[0] for c in constants}
    inputs = [vi for vi in graph.input if vi.name not in names]
    nodes = constants + list(graph.node)
    del graph.initializer[:]
    graph.initializer.extend(weights)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.input[:]
    graph.input.extend(inputs)
    return model


def to_relax(proto, seq_len: int):
    """Import the specialised graph with TVM's ONNX frontend. Returns (IRModule with ``main``,
    [(name, numpy array)] of the weight inputs in order)."""
    from tvm.relax.frontend import detach_params
    from tvm.relax.frontend.onnx import from_onnx

    model = inline_constants(fold_shapes(specialise(proto, seq_len)), {i.name for i in proto.graph.initializer})
    try:
        mod = from_onnx(model, keep_params_in_input=True)
    except Exception as exc:  # noqa: BLE001 - the frontend raises many kinds for an op it lacks
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CompileError(f"TVM's ONNX frontend cannot import the graph at T = {seq_len}: {type(exc).__name__}: "
                           f"{first}. Export with plain torch.onnx.export in fp32 (standard ONNX ops; no ONNX "
                           "Runtime contrib/fused ops such as an optimum --optimize export)") from None
    mod, params = detach_params(mod)
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    named = [(var.name, value.numpy()) for var, value in zip(main.params[num_input:], params["main"])]
    return mod, named


def import_onnx(proto, block: int, model: Any):
    """``(IRModule{prefill_src, decode_src}, weights, timings)`` — what ``frontend.export.import_model``
    returns for a torch model, from an ONNX file imported at T = block and T = 1. ``model`` (an
    ``OnnxModel``) names the file in errors and gives the config its geometry is checked against."""
    import tvm

    t0 = time.perf_counter()
    mod_b, params = to_relax(proto, block)
    mod_1, params_1 = to_relax(proto, 1)
    if [n for n, _ in params] != [n for n, _ in params_1]:
        raise CompileError(f"{model.path}: the graph imports with different weights at T = {block} and T = 1 "
                           f"({len(params)} vs {len(params_1)} weight tensors)")
    check_geometry(mod_b["main"], model)
    mod = tvm.IRModule({"prefill_src": mod_b["main"], "decode_src": mod_1["main"]})
    return mod, params, {"export_import_s": time.perf_counter() - t0}


def check_geometry(func, model: Any) -> None:
    """The attention sites of the imported graph against the config: a graph without causal
    attention, or one that disagrees with config.json, is refused naming the file."""
    from ..passes.attention_sites import AttentionMatchError, find_attention_sites

    try:
        sites = find_attention_sites(func)
    except AttentionMatchError as exc:
        raise AttentionMatchError(f"{model.path} is not a causal decoder edgekv can rewrite: {exc}") from None
    cfg = model.config
    want = (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    got = (len(sites), sites[0].num_q_heads, sites[0].num_kv_heads, sites[0].head_dim)
    if got != want:
        raise CompileError(f"{model.path} has {got[0]} attention layers with {got[1]} query / {got[2]} KV heads of "
                           f"dim {got[3]}, but its config.json says {want[0]} / {want[1]} / {want[2]} / {want[3]}; "
                           "point --tokenizer at the folder of the model that was exported")


def onnx_sha256(path: Path) -> str:
    """sha256 of the ONNX file and its external-data files (the weights' identity)."""
    digest = hashlib.sha256()
    files = [path] + sorted(p for p in path.parent.glob(path.name + ".data*"))
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
