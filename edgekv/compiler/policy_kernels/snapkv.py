"""SnapKV's compiled face (``edgekv/policies/snapkv.py``): its score kernel, CPU and GPU (the
window-score stages live in ``compiler/kernels/attention_scores.py``)."""

from __future__ import annotations

from .face import PolicyKernels


def build_snapkv_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                              *, window: int, kernel: int, pooling: str, group: str = "mean",
                              kernel_long: int | None = None, long_threshold: int = 1 << 30,
                              num_q_heads: int, sm_scale: float, question_rows: int = 0):
    """TIR score kernel (args: the common eight + the block's queries): the same definition as
    ``SnapKVPolicy.score`` — window votes of the last min(w, n_valid) block rows (softmax rows
    over cache ⊕ block, one row at a time), group mean (``group="sum"``: SnapKV++), pooling of the
    non-window candidates, the window pinned to +inf. ``kernel_long`` / ``long_threshold``: the
    length-adaptive κ of SnapKV++ (κ = ``kernel`` below the threshold). ``question_rows``: the step's
    last rows are a question's (``--question-rows``), whose last w rows vote when present, as
    ``window_votes`` with ``scoring_rows``. Shared with ``snapkv++``;
    the stages live in ``edgekv/compiler/kernels/attention_scores.py``."""
    from ..kernels.attention_scores import build_window_score_kernel  # lazy: tvm is optional

    return build_window_score_kernel(
        num_kv_heads, budget, block, head_dim, num_q_heads, sm_scale, window=window,
        heads={"mean": "group_mean", "sum": "group_sum"}[group], pin_window=True, pooling=pooling,
        kernel_short=kernel, kernel_long=kernel if kernel_long is None else kernel_long,
        long_threshold=long_threshold, question_rows=question_rows, dtype=dtype)



def build_snapkv_evict_kernel_gpu(H, N, B, D, dtype="float32", *, window, kernel, pooling, num_q_heads, sm_scale):
    from ..kernels.attention_scores import build_window_score_kernel_gpu

    return build_window_score_kernel_gpu(H, N, B, D, num_q_heads, sm_scale, window=window, heads="group_mean",
                                         pin_window=True, pooling=pooling, kernel_short=kernel, kernel_long=kernel,
                                         dtype=dtype)



KERNELS = PolicyKernels(
    evict_kernel=build_snapkv_evict_kernel,
    gpu_evict_kernel=build_snapkv_evict_kernel_gpu,
    kernel_inputs=("queries",),
    question_kernels=True,
    kernel_params=lambda policy, budget: {"window": int(policy.window), "kernel": int(policy.kernel),
                                          "pooling": str(policy.pooling)},
)
