"""TOVA's compiled face (``edgekv/policies/tova.py``): its score kernel, CPU and GPU."""

from __future__ import annotations

from .face import PolicyKernels


def build_tova_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int, dtype: str = "float32",
                            *, heads: str = "group", num_q_heads: int, sm_scale: float, question_rows: int = 0):
    """TIR score kernel (common eight + queries): ``TOVAPolicy.score`` — the last valid block row's
    attention over cache ⊕ block, averaged over the group's query heads (``heads="layer"``: over all
    query heads, the same score for every KV head). No pooling, nothing pinned. ``question_rows``:
    a question's last row scores instead when the step carries one (``scoring_rows``)."""
    from ..kernels.attention_scores import build_window_score_kernel  # lazy: tvm is optional

    return build_window_score_kernel(num_kv_heads, budget, block, head_dim, num_q_heads, sm_scale, window=1,
                                     heads={"group": "group_mean", "layer": "layer_mean"}[heads], pin_window=False,
                                     pooling="none", question_rows=question_rows, dtype=dtype)


def build_tova_evict_kernel_gpu(H, N, B, D, dtype="float32", *, heads="group", num_q_heads, sm_scale):
    from ..kernels.attention_scores import build_window_score_kernel_gpu

    return build_window_score_kernel_gpu(H, N, B, D, num_q_heads, sm_scale, window=1,
                                         heads={"group": "group_mean", "layer": "layer_mean"}[heads], pin_window=False,
                                         dtype=dtype)



def tova_kernel_params(policy, budget: int) -> dict:
    policy.check_budget(budget, 1)
    return {"heads": str(policy.heads)}


KERNELS = PolicyKernels(
    evict_kernel=build_tova_evict_kernel,
    gpu_evict_kernel=build_tova_evict_kernel_gpu,
    kernel_inputs=("queries",),
    question_kernels=True,
    kernel_params=tova_kernel_params,
)
