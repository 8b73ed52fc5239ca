"""SnapKV++'s compiled face (``edgekv/policies/snapkv_pp.py``): SnapKV's kernels with its settings."""

from __future__ import annotations

from .face import PolicyKernels
from .snapkv import build_snapkv_evict_kernel


def build_snapkvpp_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                                *, window: int, kernel_short: int, kernel_long: int, long_threshold: int,
                                pooling: str, num_q_heads: int, sm_scale: float, question_rows: int = 0):
    """TIR score kernel (common eight + queries): ``SnapKVPlusPlusPolicy.score`` — group *sum*,
    max pooling with κ(L) chosen in the kernel from the newest block position (L = position + 1),
    the window pinned. The SnapKV kernel with those settings."""
    return build_snapkv_evict_kernel(num_kv_heads, budget, block, head_dim, dtype, window=window,
                                     kernel=kernel_short, kernel_long=kernel_long, long_threshold=long_threshold,
                                     pooling=pooling, group="sum", num_q_heads=num_q_heads, sm_scale=sm_scale,
                                     question_rows=question_rows)


def build_snapkvpp_evict_kernel_gpu(H, N, B, D, dtype="float32", *, window, kernel_short, kernel_long, long_threshold,
                                    pooling, num_q_heads, sm_scale):
    from ..kernels.attention_scores import build_window_score_kernel_gpu

    return build_window_score_kernel_gpu(H, N, B, D, num_q_heads, sm_scale, window=window, heads="group_sum",
                                         pin_window=True, pooling=pooling, kernel_short=kernel_short,
                                         kernel_long=kernel_long, long_threshold=long_threshold, dtype=dtype)



def snapkvpp_kernel_params(policy, budget: int) -> dict:
    short = policy.kernel if policy.kernel > 0 else policy.kernel_short
    long = policy.kernel if policy.kernel > 0 else policy.kernel_long
    return {"window": int(policy.window), "kernel_short": int(short), "kernel_long": int(long),
            "long_threshold": int(policy.long_threshold), "pooling": str(policy.pooling)}


KERNELS = PolicyKernels(
    evict_kernel=build_snapkvpp_evict_kernel,
    gpu_evict_kernel=build_snapkvpp_evict_kernel_gpu,
    kernel_inputs=("queries",),
    question_kernels=True,
    kernel_params=snapkvpp_kernel_params,
)
