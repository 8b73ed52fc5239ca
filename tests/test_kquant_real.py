"""The real Q4_K_M files (issue 30, -m slow): on a sample of Qwen2.5-Coder-1.5B's and Gemma 3
270M's tensors, the blocks a q4 artifact keeps dequantise — in numpy and through the GEMM's own
dequantisation — to exactly what ``gguf.quants.dequantize`` and transformers' GGUF loader make of
them, under the HF names transformers gives them. Files: $EDGEKV_QWEN_GGUF / $EDGEKV_GEMMA_GGUF,
else the shared copies in /work/wt/models (the qwen2.5-coder-1.5b known model fetches it)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
gguf = pytest.importorskip("gguf")

from edgekv.compiler import quant_formats as qf  # noqa: E402
from edgekv.compiler.kernels.kquant_dense import build_kquant_dequant_kernel, subpanel_cols  # noqa: E402
from edgekv.compiler.kquant_formats import KFormat, kpanel_arrays  # noqa: E402
from test_kquant_formats import bits, hf_from_gguf, run_kernel  # noqa: E402

pytestmark = pytest.mark.slow

FILES = {"qwen2": ("EDGEKV_QWEN_GGUF", "/work/wt/models/qwen2.5-coder-1.5b-q4_k_m.gguf"),
         "gemma3": ("EDGEKV_GEMMA_GGUF", "/work/wt/models/gemma-3-270m-q4_k_m.gguf")}
PER_TYPE = 3  # tensors sampled per type: the smallest, the largest under 20M weights, one between


def gguf_file(arch: str) -> Path:
    env, default = FILES[arch]
    path = Path(os.environ.get(env, default))
    if not path.is_file():
        pytest.skip(f"{path} not found: set {env} to the Q4_K_M GGUF (`edgekv run qwen2.5-coder-1.5b` fetches Qwen's)")
    return path


def field(reader, key: str):
    f = reader.fields[key]
    return f.contents()


def hf_names(path: Path, arch: str) -> tuple[dict[str, str], SimpleNamespace]:
    """transformers' own GGUF → HF tensor-name map (on a meta-device model of the file's
    architecture and depth; the names depend on nothing else), and the file's head counts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = gguf.GGUFReader(str(path))
    heads = SimpleNamespace(num_attention_heads=int(field(reader, f"{arch}.attention.head_count")),
                            num_key_value_heads=int(field(reader, f"{arch}.attention.head_count_kv")),
                            num_hidden_layers=int(field(reader, f"{arch}.block_count")))
    config = AutoConfig.for_model({"gemma3": "gemma3_text"}.get(arch, arch), num_hidden_layers=heads.num_hidden_layers,
                                  hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=32, vocab_size=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return get_gguf_hf_weights_map(model, TENSOR_PROCESSORS.get(arch, TensorProcessor)(config={})), heads


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_real_blocks_are_kept_bit_exact(arch):
    path = gguf_file(arch)
    names, config = hf_names(path, arch)
    src = qf.GGUFBlocks(path, config, int(config.num_hidden_layers))
    assert src.arch == arch and not src.unsupported()
    by_type: dict[str, list] = {}
    for t in src.reader.tensors:
        if len(t.shape) == 2 and t.tensor_type.name in qf.KEPT_TYPES:
            by_type.setdefault(t.tensor_type.name, []).append(t)
    expected = {"qwen2": {"Q4_K", "Q6_K"}, "gemma3": {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}}[arch]
    assert set(by_type) == expected
    for kind, tensors in by_type.items():
        tensors = sorted((t for t in tensors if t.n_elements <= 20_000_000), key=lambda t: t.n_elements)
        for t in [tensors[0], tensors[len(tensors) // 2], tensors[-1]][:PER_TYPE]:
            hf = names[t.name]
            shape = tuple(int(s) for s in t.shape[::-1])
            fmt = src.kept_format(hf, shape)
            assert fmt is not None and fmt.ggml == kind, (t.name, hf)
            want = hf_from_gguf(arch, t.name, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                config).reshape(shape)
            b = src.get(hf, fmt, shape)
            np.testing.assert_array_equal(bits(b.dequantize()), bits(want), err_msg=t.name)
            if isinstance(fmt, KFormat):  # the kernel's dequantisation of the first panels, bit for bit
                rows, nr = 64, 16
                sub = type(b)(fmt, b.u[:rows], {k: v[:rows] for k, v in b.scales.items()}, b.k)
                out = run_kernel(build_kquant_dequant_kernel(fmt, shape[1], rows, nr),
                                 [np.zeros(1, np.float32), *kpanel_arrays(sub, nr), np.zeros(rows * shape[1], np.float32)])
                ns = subpanel_cols(nr)  # the GEMM's layout: per panel, NR / NS blocks of K × NS
                out = out.reshape(rows // nr, nr // ns, shape[1], ns).transpose(0, 1, 3, 2).reshape(rows, shape[1])
                np.testing.assert_array_equal(bits(out), bits(want[:rows]), err_msg=t.name)
