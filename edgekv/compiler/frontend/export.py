"""Export a decoder's *plain* forward (Llama family, Gemma 3) and import it into Relax.

The compiler pass never sees this module's Python class: it works on the exported graph.
This file only produces that graph the way any user would export a decoder:

    logits[1, T, V] = forward(tokens[1, T] int64, positions[1, T] int64)

with RMSNorm, RoPE computed from the position-ids input, GQA (``repeat_interleave`` of the
KV heads), ``scaled_dot_product_attention(..., is_causal=True)``, a SiLU-gated MLP and the
(tied) LM head, at a static sequence length T.

``import_model(model, block)`` exports the prefill step and decode and imports both into one
module: the pipeline's first step (``compiler/pipeline.py``).

Exported forms the pass accepts (see ``passes/attention_sites.py``):
  * attention written as ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` — with
    the default ``torch.export`` decompositions it imports as matmul → (scale) → causal mask
    (``R.tril``/``R.where`` on a constant) → softmax → matmul; without decompositions as
    ``R.nn.attention(..., causal_mask="TopLeft")``. Both are matched.
  * explicit eager attention ``softmax(q @ k.T * scale + causal_mask) @ v`` with the mask
    built from constants (``torch.triu``/``torch.full``) — the same matmul–softmax–matmul form.
  * K/V either with kv_heads (GQA expanded by ``repeat_interleave``/``expand``+``reshape``
    inside the graph, which the pass looks through) or already with the query head count.
Not accepted: HF transformers' ``LlamaForCausalLM`` export. Its mask is built from the
position/cache inputs (cumsum, bitwise ops, index_tensor), not a causal-mask constant. With
transformers 5.2 + TVM 0.27 here, ``from_exported_program`` already fails on it ("Concat expects
all input tensors to have same ndim"); a graph whose mask depends on the inputs is refused by
the pass naming the mask's operators (``attention_sites``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class PlainLlama(nn.Module):
    """A stateless decoder forward over HF-named weights (fp32), for export only.

    One forward for every supported family: where a family's decoder layer differs from Llama's,
    the difference is a field of its ``ModelConfig`` read here (``models/config.py``), never a
    second class — QK-norm (``qk_norm``), four norms per layer (``sandwich_norms``), RMSNorm's
    (1 + w) scale (``norm_offset``), GeGLU with tanh GELU (``mlp_activation``), the embedding scale
    (``embed_scale``), the attention scale (``attention_scale``), the output softcap
    (``final_softcap``) and the local layers' RoPE base (``local_inv_freq``). Every layer's
    attention is exported causal: a local layer's sliding window is not in the graph but a
    property of the description that the block-cache pass reads (``BlockCacheSpec.layer_windows``),
    so the exported graph of a local layer is exact for T ≤ window (the decode step, the block) and
    the attention-site matcher sees the one causal form it knows."""

    def __init__(self, config: Any, weights: dict[str, torch.Tensor], inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0, local_inv_freq: torch.Tensor | None = None,
                 local_attention_scaling: float | None = None):
        super().__init__()
        self.cfg = config
        self.attention_scaling = float(attention_scaling)
        self.local_attention_scaling = float(attention_scaling if local_attention_scaling is None
                                             else local_attention_scaling)
        self.w = nn.ParameterDict()
        for name, tensor in weights.items():
            self.w[name.replace(".", "__")] = nn.Parameter(tensor.detach().to(torch.float32), requires_grad=False)
        # RoPE angles in float64 (as the reference engine): positions up to 8K+ lose ~1e-3 rad in fp32.
        self.register_buffer("inv_freq", inv_freq.detach().to(torch.float64), persistent=False)
        local = inv_freq if local_inv_freq is None else local_inv_freq
        self.register_buffer("local_inv_freq", local.detach().to(torch.float64), persistent=False)

    def p(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "__")]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        scale = weight + self.cfg.norm_offset if self.cfg.norm_offset else weight  # Gemma: (1 + w)
        return x * torch.rsqrt(var + self.cfg.rms_eps) * scale

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        bias_name = prefix + ".bias"
        bias = self.p(bias_name) if bias_name.replace(".", "__") in self.w else None
        return F.linear(x, self.p(prefix + ".weight"), bias)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
        freqs = positions.to(torch.float64)[..., None] * inv_freq[None, None, :]  # [1, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * scaling).to(torch.float32)[:, None, :, :],
                (emb.sin() * scaling).to(torch.float32)[:, None, :, :])

    def _mlp(self, h: torch.Tensor, pre: str) -> torch.Tensor:
        gate = F.linear(h, self.p(pre + "mlp.gate_proj.weight"))
        up = F.linear(h, self.p(pre + "mlp.up_proj.weight"))
        act = F.gelu(gate, approximate="tanh") if self.cfg.mlp_activation == "gelu_tanh" else F.silu(gate)
        return F.linear(act * up, self.p(pre + "mlp.down_proj.weight"))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, seq = tokens.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        local_kinds = [cfg.layer_kind(i) == "local" for i in range(cfg.num_layers)]
        x = F.embedding(tokens, self.p("model.embed_tokens.weight"))
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        ropes = {False: self._rope(positions, self.inv_freq, self.attention_scaling)}
        if any(local_kinds):
            ropes[True] = self._rope(positions, self.local_inv_freq, self.local_attention_scaling)
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            cos, sin = ropes[local_kinds[i]]
            h = self._rms(x, self.p(pre + "input_layernorm.weight"))
            q = self._linear(h, pre + "self_attn.q_proj").view(bsz, seq, hq, d).transpose(1, 2)
            k = self._linear(h, pre + "self_attn.k_proj").view(bsz, seq, hkv, d).transpose(1, 2)
            v = self._linear(h, pre + "self_attn.v_proj").view(bsz, seq, hkv, d).transpose(1, 2)
            if cfg.qk_norm:  # per-head RMSNorm of queries and keys, before RoPE
                q = self._rms(q, self.p(pre + "self_attn.q_norm.weight"))
                k = self._rms(k, self.p(pre + "self_attn.k_norm.weight"))
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            if hq != hkv:
                k = k.repeat_interleave(hq // hkv, dim=1)
                v = v.repeat_interleave(hq // hkv, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.attention_scale)
            a = F.linear(a.transpose(1, 2).reshape(bsz, seq, hq * d), self.p(pre + "self_attn.o_proj.weight"))
            if cfg.sandwich_norms:  # Gemma: the attention and MLP outputs normed before the residual
                x = x + self._rms(a, self.p(pre + "post_attention_layernorm.weight"))
                h = self._rms(x, self.p(pre + "pre_feedforward_layernorm.weight"))
                x = x + self._rms(self._mlp(h, pre), self.p(pre + "post_feedforward_layernorm.weight"))
            else:
                x = x + a
                h = self._rms(x, self.p(pre + "post_attention_layernorm.weight"))
                x = x + self._mlp(h, pre)
        x = self._rms(x, self.p("model.norm.weight"))
        head = self.p("model.embed_tokens.weight") if cfg.tie_embeddings else self.p("lm_head.weight")
        logits = F.linear(x, head)
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # the gate activations ``PlainLlama._mlp`` exports
LAYER_KINDS = ("global", "local")  # local: the block-cache pass applies the window (``layer_windows``)


def check_exportable(config: Any) -> None:
    """Refuse a model description the plain forward and the attention-site rewrite cannot map yet,
    naming the missing piece (called by the driver before any work). What a description may set is
    what ``PlainLlama`` reads; a value outside it has no exported form."""
    from ..errors import CompileError

    activation = getattr(config, "mlp_activation", "silu")
    if activation not in MLP_ACTIVATIONS:
        raise CompileError(f"the plain forward (compiler/frontend/export.py) has no MLP activation {activation!r}; "
                           f"it exports {', '.join(MLP_ACTIVATIONS)}")
    kinds = tuple(getattr(config, "layer_kinds", ()) or ())
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise CompileError(f"layer kinds {unknown} have no compiled cache; the block-cache pass maps "
                           f"{', '.join(LAYER_KINDS)} layers")
    if "local" in kinds and int(getattr(config, "sliding_window", 0)) <= 0:
        raise CompileError("the description has local layers but no sliding_window: their ring has no size")
    if len(kinds) not in (0, int(config.num_layers)):
        raise CompileError(f"the description names {len(kinds)} layer kinds for {config.num_layers} layers")


def placeholder_weights(model: Any) -> dict[str, torch.Tensor]:
    """A stride-0 fp32 tensor of each weight's shape (4 bytes each): the export traces shapes only."""
    shapes = model.weight_shapes if hasattr(model, "weight_shapes") else {n: tuple(t.shape)
                                                                           for n, t in model.weights.items()}
    zero = torch.zeros((), dtype=torch.float32)
    return {n: zero.expand(s) for n, s in shapes.items()}


def plain_module(model: Any, placeholders: bool = False) -> PlainLlama:
    """The plain forward of a ``edgekv.models.LoadedModel`` (``placeholders``: over stride-0
    stand-ins of its weights, for an export that needs their shapes only)."""
    check_exportable(model.config)
    weights = placeholder_weights(model) if placeholders else model.weights
    return PlainLlama(model.config, weights, model.inv_freq, getattr(model, "attention_scaling", 1.0),
                      getattr(model, "local_inv_freq", None), getattr(model, "local_attention_scaling", None)).eval()


def export_plain_forward(model: Any, seq_len: int, placeholders: bool = False) -> torch.export.ExportedProgram:
    """torch.export the plain forward of a LoadedModel at a static sequence length."""
    module = plain_module(model, placeholders)
    tokens = torch.zeros((1, seq_len), dtype=torch.int64)
    positions = torch.arange(seq_len, dtype=torch.int64)[None, :]
    with torch.no_grad():
        return torch.export.export(module, (tokens, positions))


def _placeholder_importer():
    """TVM's importer, except that it leaves a stride-0 placeholder (``placeholder_weights``) as a
    one-element tensor: its own conversion (DLPack, else ``.contiguous()``) would materialise every
    weight in fp32 for the ``params`` attribute that ``import_to_relax`` drops anyway."""
    import tvm
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    class PlaceholderImporter(ExportedProgramImporter):
        @staticmethod
        def _convert_pytorch_tensor_to_tvm(tensor_value):
            if tensor_value.numel() > 1 and all(s == 0 for s in tensor_value.stride()):
                return tvm.runtime.tensor(np.zeros(1, np.float32))
            return ExportedProgramImporter._convert_pytorch_tensor_to_tvm(tensor_value)

    return PlaceholderImporter()


def import_to_relax(program: torch.export.ExportedProgram, with_params: bool = True, arrays=None):
    """Import into a Relax IRModule whose ``main(tokens, positions, *params)`` keeps the weights
    as inputs (``num_input`` = 2), plus the parameter tensors in order (numpy arrays, named).

    The arrays are views of the program's own parameters (the model's weights), not copies: TVM's
    importer already holds them zero-copy (DLPack), and ``.numpy()`` on those would copy the whole
    model once more per import. ``with_params=False`` returns names only (the decode import).
    ``arrays`` (HF weight name → array, ``weight_arrays.model_weight_arrays``): the program was
    exported over placeholders and each parameter's array is taken from there instead."""
    if arrays is None:
        from tvm.relax.frontend.torch import from_exported_program

        mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    else:  # as from_exported_program does, with the placeholders left unread
        mod = _placeholder_importer().from_exported_program(program.run_decompositions(), True, True, False, None)
    main = mod["main"]
    mod["main"] = main.without_attr("params")  # TVM's zero-copy handles: the views below replace them
    num_input = int(main.attrs["num_input"])
    variables = main.params[num_input:]
    named_tensors = list(program.named_parameters())
    tensors = [t for _, t in named_tensors]
    if len(tensors) != len(variables):
        raise RuntimeError(f"the exported program has {len(tensors)} parameters, its import {len(variables)}")
    named = []
    for var, (pname, tensor) in zip(variables, named_tensors):
        shape = tuple(int(s) for s in var.ty.shape)
        if tuple(tensor.shape) != shape:
            raise RuntimeError(f"parameter {var.name}: exported {tuple(tensor.shape)}, imported {shape}")
        if not with_params:
            array = None
        elif arrays is not None:  # PlainLlama's parameter "w.model__norm__weight" is the weight "model.norm.weight"
            array = arrays[pname.removeprefix("w.").replace("__", ".")]
        else:
            array = tensor.detach().numpy()
        named.append((var.name, array))
    return mod, named


def import_model(model: Any, block: int, extra_rows: int = 0):
    """(module with ``prefill_src`` and ``decode_src``, weights [(name, numpy array)], timings):
    the prefill step exported at T = ``block`` + ``extra_rows`` (pseudo rows,
    ``passes/pseudo_rows.py``) and decode at T = 1, both imported. The weights are the model's
    own tensors (views) or, for weights kept in their file, handles that read one when asked
    (``weight_arrays.FileWeight``), once: the decode import shares them. Both exports trace
    stride-0 placeholders, so no step here holds a copy of the model."""
    import tvm

    from .weight_arrays import model_weight_arrays

    t0 = time.perf_counter()
    arrays = model_weight_arrays(model)
    mod_b, params = import_to_relax(export_plain_forward(model, block + extra_rows, placeholders=True), arrays=arrays)
    mod_1, params_1 = import_to_relax(export_plain_forward(model, 1, placeholders=True), with_params=False,
                                      arrays=arrays)
    t1 = time.perf_counter()
    if [n for n, _ in params] != [n for n, _ in params_1]:
        raise RuntimeError("the block and decode exports disagree on their weight inputs")
    mod = tvm.IRModule({"prefill_src": mod_b["main"], "decode_src": mod_1["main"]})
    return mod, params, {"export_import_s": t1 - t0}


def check_imported_rows(mod, block: int, extra: int) -> None:
    """Refuse an ``imported`` module exported at another step size than this build needs."""
    from ..errors import CompileError

    rows = int(mod["prefill_src"].params[0].ty.shape[1])
    if rows != block + extra:
        need = f"B + {extra} pseudo rows = {block + extra}" if extra else f"B = {block}"
        raise CompileError(f"the imported module's prefill step has {rows} rows, this build needs {need}; "
                           f"import it with edgekv.compiler.import_model(model, {block}, extra_rows={extra})")


def default_sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
