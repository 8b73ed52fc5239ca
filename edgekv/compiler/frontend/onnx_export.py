"""Write the ONNX file a user would have: ``torch.onnx.export`` of a decoder, in two forms.

  * ``plain``: ``export.PlainLlama`` — ``input_ids[1, T], position_ids[1, T] → logits[1, T, V]``;
  * ``past``:  HF transformers' own ``LlamaForCausalLM`` with the cache as flat inputs and outputs,
    the layout optimum exports: ``input_ids, attention_mask[1, P+T], position_ids,
    past_key_values.{i}.key/value[1, H, P, d] → logits, present.{i}.key/value[1, H, P+T, d]``.

T (and P) are dynamic dimensions. The folder gets ``model.onnx`` plus ``config.json`` and the
tokenizer files, as optimum writes them, so ``edgekv compile <folder>/model.onnx`` finds them.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch

FORMS = ("plain", "past")
ONNX_FILE = "model.onnx"
EXAMPLE_T, EXAMPLE_PAST = 8, 4  # example sizes for tracing; the exported dims are dynamic
MAX_LEN = 1 << 15


class CachedCausalLM(torch.nn.Module):
    """HF causal LM with past keys/values as flat tensors in and out (optimum's layout)."""

    def __init__(self, hf_model):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def _plain_args(model: Any):
    from .export import plain_module

    seq = torch.export.Dim("seq", max=MAX_LEN)
    args = (torch.zeros((1, EXAMPLE_T), dtype=torch.int64), torch.arange(EXAMPLE_T)[None])
    return (plain_module(model), args, ["input_ids", "position_ids"], ["logits"],
            {"tokens": {1: seq}, "positions": {1: seq}})


def _past_args(model: Any):
    cfg = model.config
    seq, past_len = torch.export.Dim("seq", max=MAX_LEN), torch.export.Dim("past", max=MAX_LEN)
    past = tuple(torch.zeros(1, cfg.num_kv_heads, EXAMPLE_PAST, cfg.head_dim)
                 for _ in range(2 * cfg.num_layers))
    names = [f"past_key_values.{i}.{kv}" for i in range(cfg.num_layers) for kv in ("key", "value")]
    args = (torch.zeros((1, EXAMPLE_T), dtype=torch.int64), torch.ones((1, EXAMPLE_PAST + EXAMPLE_T), dtype=torch.int64),
            torch.arange(EXAMPLE_PAST, EXAMPLE_PAST + EXAMPLE_T)[None], *past)
    shapes = {"input_ids": {1: seq}, "attention_mask": {1: torch.export.Dim("total", max=2 * MAX_LEN)},
              "position_ids": {1: seq}, "past": tuple({2: past_len} for _ in past)}
    outputs = ["logits"] + [n.replace("past_key_values", "present") for n in names]
    return CachedCausalLM(model.to_hf()).eval(), args, ["input_ids", "attention_mask", "position_ids", *names], \
        outputs, shapes


def export_onnx(model: Any, out_dir: str | Path, form: str = "plain") -> Path:
    """Export ``model`` (a ``LoadedModel``) to ``out_dir/model.onnx`` (+ config.json, tokenizer)."""
    if form not in FORMS:
        raise ValueError(f"unknown ONNX form {form!r}; one of {', '.join(FORMS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module, args, inputs, outputs, shapes = (_plain_args if form == "plain" else _past_args)(model)
    path = out / ONNX_FILE
    big = model.weight_bytes > (1800 << 20)  # protobuf's 2 GiB limit: weights go to model.onnx.data
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs, dynamic_shapes=shapes,
                          dynamo=True, external_data=big, verbose=False)
    model.hf_config.save_pretrained(str(out))
    if getattr(model, "tokenizer", None) is not None:
        model.tokenizer.save_pretrained(str(out))
    return path


def onnxruntime_logits(path: str | Path, token_ids) -> Any:
    """ONNX Runtime on the exported file over the whole prompt in one call: logits [T, V] (numpy).
    The reference for the compiled artifact at full budget; the past form gets an empty cache."""
    import numpy as np
    import onnxruntime as ort

    ids = np.asarray(token_ids, dtype=np.int64)[None]
    T = ids.shape[1]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {}
    for inp in sess.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = ids
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(T, dtype=np.int64)[None]
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((1, T), dtype=np.int64)
        else:  # past_key_values.*: [1, H, 0, d]
            feeds[inp.name] = np.zeros((1, inp.shape[1], 0, inp.shape[3]), dtype=np.float32)
    return sess.run(["logits"], feeds)[0][0]
