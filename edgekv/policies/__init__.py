"""Eviction policies: one file per policy, each registered here by name (one line each)."""

from __future__ import annotations

import dataclasses
import typing

from .base import EvictionContext, Policy, PolicyError, Selection, topk_keep
from .d2o import D2OPolicy
from .dapq import DapQPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .keydiff import KeyDiffPolicy
from .lagkv import LagKVPolicy
from .reconstruct import ReconstructPolicy
from .rocketkv import RocketKVPolicy
from .snapkv import SnapKVPolicy
from .snapkv_pp import SnapKVPlusPlusPolicy
from .streaming import StreamingPolicy
from .tova import TOVAPolicy

REGISTRY: dict[str, type[Policy]] = {
    "full": FullPolicy,
    "streaming": StreamingPolicy,
    "keydiff": KeyDiffPolicy,
    "lagkv": LagKVPolicy,
    "snapkv": SnapKVPolicy,
    "snapkv++": SnapKVPlusPlusPolicy,
    "rocketkv": RocketKVPolicy,
    "tova": TOVAPolicy,
    "h2o": H2OPolicy,
    "dapq": DapQPolicy,
    "d2o": D2OPolicy,
    "reconstruct": ReconstructPolicy,
}


from ..budget import DEFAULT_POLICY  # noqa: E402  (declared with the other shared defaults)
from ..policy_labels import COMPRESS_MODES, base_policy, compress_policy  # noqa: E402,F401  (light: the CLI checks before torch)

# `--compress MODE`: how a document is compressed as it is read, by the policy that does it
# (``reconstruct.py``: KVzip's reconstruction score, block-wise)
def policy_names() -> list[str]:
    return sorted(REGISTRY)


def _coerce(value: str, annotation: typing.Any, policy: str, key: str):
    kind = annotation if isinstance(annotation, type) else {"int": int, "float": float, "bool": bool, "str": str}.get(
        str(annotation).split("|")[0].strip(), str)
    try:
        if kind is bool:
            low = value.lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            return low in ("1", "true", "yes", "on")
        return kind(value)
    except ValueError:
        raise PolicyError(f"policy '{policy}': argument {key}={value!r} is not a valid {kind.__name__}") from None


def policy_arguments(pairs: list[str] | None, policies: list[str]) -> dict[str, dict[str, str]]:
    """``--policy-arg`` values for the chosen ``policies``, one form for every command:
    ``key=value`` applies to each chosen policy that has the argument ``key`` (an error when none
    has it), ``policy:key=value`` to that policy only (which must be among the chosen ones).
    Returns {policy: {key: value}} (values are checked by ``make_policy``)."""
    out: dict[str, dict[str, str]] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise PolicyError(f"--policy-arg {pair!r} is not key=value or policy:key=value; "
                              "e.g. --policy-arg sinks=4 or --policy-arg streaming:sinks=4")
        lhs, value = pair.split("=", 1)
        target = None
        if ":" in lhs:
            target, lhs = (x.strip() for x in lhs.split(":", 1))
        key, value = lhs.strip(), value.strip()
        if target is not None:
            if target not in policies:
                raise PolicyError(f"--policy-arg {pair!r} names policy '{target}', which is not among the chosen "
                                  f"ones ({', '.join(policies)})")
            out.setdefault(target, {})[key] = value
            continue
        takers = [p for p in policies if base_policy(p) in REGISTRY
                  and key in {f.name for f in dataclasses.fields(REGISTRY[base_policy(p)])}]
        if not takers:
            if len(policies) == 1:  # make_policy names the policy's arguments
                out.setdefault(policies[0], {})[key] = value
                continue
            raise PolicyError(f"--policy-arg {pair!r}: none of the chosen policies ({', '.join(policies)}) has an "
                              f"argument '{key}' (see `edgekv policies`)")
        for p in takers:
            out.setdefault(p, {})[key] = value
    return out


def make_policy(name: str, args: dict[str, str] | None = None) -> Policy:
    """Build a policy from its name (or a variant label ``name#tag``, ``base_policy``) and
    ``key=value`` strings (CLI ``--policy-arg``)."""
    if base_policy(name) not in REGISTRY:
        raise PolicyError(f"unknown policy '{name}'; known policies: {', '.join(policy_names())} (a variant of one "
                          "is written name#tag, e.g. snapkv++#k15 with --policy-arg snapkv++#k15:kernel=15)")
    cls = REGISTRY[base_policy(name)]
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in (args or {}).items():
        if key not in known:
            valid = ", ".join(known) or "none"
            raise PolicyError(f"policy '{name}' has no argument '{key}'; its arguments: {valid}")
        kwargs[key] = _coerce(value, known[key].type, name, key) if isinstance(value, str) else value
    return cls(**kwargs)


__all__ = ["COMPRESS_MODES", "compress_policy", "DEFAULT_POLICY", "base_policy", "EvictionContext", "Policy", "PolicyError", "Selection", "REGISTRY", "make_policy",
           "policy_arguments", "policy_names", "topk_keep"]
