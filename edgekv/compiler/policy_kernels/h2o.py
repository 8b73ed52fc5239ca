"""H2O's compiled face (``edgekv/policies/h2o.py``): its score and observe kernels, CPU and GPU."""

from __future__ import annotations

from .face import PolicyKernels


def build_h2o_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                           *, recent: int, num_q_heads: int, sm_scale: float, question_rows: int = 0):
    """TIR score kernel (common eight + queries + the observed candidate state): ``H2OPolicy.score``
    — the accumulated attention (plus, on a step carrying a question, the question rows' column
    sums: ``question_rows``), the ``recent`` newest candidates pinned to +inf."""
    from ..kernels.attention_scores import build_state_score_kernel  # lazy: tvm is optional

    return build_state_score_kernel(num_kv_heads, budget, block, head_dim, num_q_heads, sm_scale, recent=recent,
                                    question_rows=question_rows, dtype=dtype)


def build_h2o_observe_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                             *, recent: int = 0, num_q_heads: int, sm_scale: float, question_rows: int = 0):
    """TIR observe kernel (every step): ``H2OPolicy.observe`` — each candidate's ``h2o_acc`` (old
    entries' sums, 0 for the block's) plus this step's column sums over all n_valid block rows,
    group-averaged; the rows' softmax is made one row at a time (no [b, n] matrix). Question rows
    (``question_rows``: the step's last rows) are never observed: they read rows < n_valid only."""
    from ..kernels.attention_scores import build_colsum_observe_kernel  # lazy: tvm is optional

    return build_colsum_observe_kernel(num_kv_heads, budget, block, head_dim, num_q_heads, sm_scale,
                                       heads="group_mean", dtype=dtype)


def build_h2o_evict_kernel_gpu(H, N, B, D, dtype="float32", *, recent, num_q_heads, sm_scale):
    from ..kernels.attention_scores import build_state_score_kernel_gpu

    return build_state_score_kernel_gpu(H, N, B, D, num_q_heads, sm_scale, recent=recent, dtype=dtype)


def build_h2o_observe_kernel_gpu(H, N, B, D, dtype="float32", *, recent=0, num_q_heads, sm_scale):
    from ..kernels.attention_scores import build_colsum_observe_kernel_gpu

    return build_colsum_observe_kernel_gpu(H, N, B, D, num_q_heads, sm_scale, heads="group_mean", dtype=dtype)




KERNELS = PolicyKernels(
    evict_kernel=build_h2o_evict_kernel,
    gpu_evict_kernel=build_h2o_evict_kernel_gpu,
    observe_kernel=build_h2o_observe_kernel,
    gpu_observe_kernel=build_h2o_observe_kernel_gpu,
    kernel_inputs=("queries",),
    question_kernels=True,
    kernel_params=lambda policy, budget: {"recent": policy.recent_size(budget)},
)
