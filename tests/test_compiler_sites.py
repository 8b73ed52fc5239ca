"""The pass finds every attention site of an exported graph, and refuses clearly what it cannot match."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

tvm = pytest.importorskip("tvm")

from edgekv.compiler import AttentionMatchError, find_attention_sites  # noqa: E402
from edgekv.compiler.frontend.export import import_to_relax  # noqa: E402


def _import(module, seq=8):
    args = (torch.zeros(1, seq, dtype=torch.long), torch.arange(seq)[None])
    mod, _ = import_to_relax(torch.export.export(module, args))
    return mod["main"]


class _NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, tokens, positions):
        return self.lin(tokens.float()[..., None].expand(1, tokens.shape[1], 4))


class _Attn(torch.nn.Module):
    """Eager attention with a configurable mask; q = k = v from a projection."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.lin = torch.nn.Linear(1, 16)

    def forward(self, tokens, positions):
        x = self.lin(tokens.float()[..., None])[:, None]  # [1, 1, T, 16]
        T = tokens.shape[1]
        if self.mode == "bidirectional":
            return F.scaled_dot_product_attention(x, x, x, is_causal=False)
        if self.mode == "causal-eager":
            s = x @ x.transpose(-1, -2) * 0.25 + torch.triu(torch.full((T, T), float("-inf")), 1)
            return s.softmax(-1) @ x
        if self.mode == "input-mask":  # mask built from the position input (like HF's mask subgraph)
            keep = positions[0][None, :] <= positions[0][:, None]
            s = (x @ x.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
            return s.softmax(-1) @ x
        if self.mode == "no-values":
            s = x @ x.transpose(-1, -2) + torch.triu(torch.full((T, T), float("-inf")), 1)
            return s.softmax(-1).sum(-1)
        raise ValueError(self.mode)


def test_refuses_graph_without_attention():
    with pytest.raises(AttentionMatchError, match=r"no attention site found.*matmul"):
        find_attention_sites(_import(_NoAttention()))


def test_refuses_bidirectional_attention():
    with pytest.raises(AttentionMatchError, match="without a causal mask"):
        find_attention_sites(_import(_Attn("bidirectional")))


def test_refuses_input_dependent_mask_naming_ops():
    with pytest.raises(AttentionMatchError, match=r"depends on the function's inputs \(ops: .*less_equal"):
        find_attention_sites(_import(_Attn("input-mask")))


def test_refuses_softmax_without_value_matmul():
    with pytest.raises(AttentionMatchError, match="does not reach a matmul with the values"):
        find_attention_sites(_import(_Attn("no-values")))


def test_accepts_eager_causal_attention():
    (site,) = find_attention_sites(_import(_Attn("causal-eager")))
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (1, 1, 16)
    assert site.sm_scale == pytest.approx(0.25)
