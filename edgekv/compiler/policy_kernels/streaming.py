"""StreamingLLM's compiled face (``edgekv/policies/streaming.py``): its score kernel, CPU and GPU."""

from __future__ import annotations

from .face import PolicyKernels


def build_streaming_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                 dtype: str = "float32", sinks: int = 4):
    """TIR score kernel: the same definition as ``StreamingPolicy.score``."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S = int(sinks)

    @T.macro
    def streaming_score(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
        for h, i in T.grid(H, NB):
            with T.sblock("score"):
                nf: T.let[T.int32] = fill[0]
                if i < nf:
                    score[h, i] = T.if_then_else(pos_cache[h, i] < S, T.float32("inf"), T.Cast("float32", pos_cache[h, i]))
                elif i < nf + n_valid[0]:
                    score[h, i] = T.if_then_else(pos_blk[i - nf] < S, T.float32("inf"), T.Cast("float32", pos_blk[i - nf]))
                else:
                    score[h, i] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, B, D), streaming_score)


def build_streaming_evict_kernel_gpu(num_kv_heads: int, budget: int, block: int, head_dim: int,
                                     dtype: str = "float32", sinks: int = 4):
    """Elementwise: one thread per (head, candidate)."""
    from tvm.script import tirx as T  # lazy: tvm is the optional `compile` extra

    from ..kernels.common import check_dtype
    from ..kernels.signature import StepShapes, score_kernel

    check_dtype(dtype)
    H, N, B, D = num_kv_heads, budget, block, head_dim
    NB = N + B
    S = int(sinks)
    TPB = 128
    NBLK = (H * NB + TPB - 1) // TPB

    @T.macro
    def streaming_score_gpu(k_cache, v_cache, pos_cache, fill, k_blk, v_blk, pos_blk, n_valid, score):
        for bx in T.thread_binding(NBLK, thread="blockIdx.x"):
            for tx in T.thread_binding(TPB, thread="threadIdx.x"):
                with T.sblock("score"):
                    T.reads()
                    T.writes()
                    e: T.let[T.int32] = bx * TPB + tx
                    h: T.let[T.int32] = e // NB
                    i: T.let[T.int32] = e % NB
                    nf: T.let[T.int32] = fill[0]
                    if e < H * NB:
                        if i < nf:
                            score[h, i] = T.if_then_else(pos_cache[h, T.min(i, N - 1)] < S, T.float32("inf"),
                                                         T.Cast("float32", pos_cache[h, T.min(i, N - 1)]))
                        elif i < nf + n_valid[0]:
                            score[h, i] = T.if_then_else(pos_blk[T.max(i - nf, 0)] < S, T.float32("inf"),
                                                         T.Cast("float32", pos_blk[T.max(i - nf, 0)]))
                        else:
                            score[h, i] = T.float32("-inf")

    return score_kernel(StepShapes(H, N, B, D), streaming_score_gpu, gpu=True)



KERNELS = PolicyKernels(
    evict_kernel=build_streaming_evict_kernel,
    gpu_evict_kernel=build_streaming_evict_kernel_gpu,
    kernel_params=lambda policy, budget: {"sinks": int(policy.sinks)},
)
