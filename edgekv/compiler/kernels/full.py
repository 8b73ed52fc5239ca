"""``full`` has no score kernel: the cache is appended to (``select.build_select_compact_kernel``
with ``with_score=False``) and the host refuses a run that would overflow N."""


def build_full_evict_kernel(num_kv_heads: int, budget: int, block: int, head_dim: int,
                            dtype: str = "float32"):
    return None
