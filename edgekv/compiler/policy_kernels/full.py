"""``full``'s compiled face (``edgekv/policies/full.py``): no score kernel — the cache is appended
to by the shared select/compaction kernel (``with_score=False``) and the host refuses a run that
would overflow N."""

from __future__ import annotations

from .face import PolicyKernels

KERNELS = PolicyKernels(kernel_params=lambda policy, budget: {})
