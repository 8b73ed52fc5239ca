"""Policy labels and compression modes, without torch: the CLI resolves ``--policy`` variants and
``--compress`` before anything heavy loads (``edgekv.policies`` re-exports these)."""

from __future__ import annotations

from .errors import PolicyError


def base_policy(label: str) -> str:
    """The registered policy a label names: ``snapkv++#k15`` is a variant of ``snapkv++`` (a sweep
    runs several settings of one policy side by side, each with its own ``--policy-arg LABEL:k=v``)."""
    return label.split("#", 1)[0]


COMPRESS_MODES = {"reconstruct": "reconstruct"}


def compress_policy(policy: str | None, compress: str | None) -> str | None:
    """The policy a run reads its document with, given ``--policy`` and ``--compress``: the mode's
    own policy (a different --policy is refused: the mode decides what the cache keeps), else
    ``policy`` unchanged. ``compress`` None or "none": no mode."""
    if compress is None or compress == "none":
        return policy
    if compress not in COMPRESS_MODES:
        raise PolicyError(f"--compress {compress!r} is not a compression mode; known: "
                          f"{', '.join(['none', *COMPRESS_MODES])}")
    mode = COMPRESS_MODES[compress]
    if policy is not None and base_policy(policy) != mode:
        raise PolicyError(f"--compress {compress} scores the document itself and replaces the eviction policy: "
                          f"drop --policy {policy} (or run --policy {policy} without --compress)")
    return mode
