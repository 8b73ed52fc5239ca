"""Regenerate docs/policies.md from the per-policy sections in docs/policies/<name>.md,
in registry order, so each policy's text lives next to the others' but is written once."""

from __future__ import annotations

from pathlib import Path

from edgekv.policies import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
HEADER = """# Eviction policies

Every policy keeps at most N entries per layer and KV head after each block (B tokens)
and each decode step; tokens keep their original RoPE positions. Ties are broken toward
the older entry. `edgekv policies` lists the parameters; `--policy-arg key=value` sets them.

Common to all: with N ≥ prompt + output every policy is exactly full attention; block size
changes nothing while nothing is evicted (both are tested for every registered policy in
`tests/test_policy_properties.py`).

## full

No eviction; refuses with the size it needs when cache ⊕ block exceeds N.

## streaming

StreamingLLM: keep `sinks` (default 4) first positions plus the most recent N − sinks.
Positions are not re-indexed into cache slots (the paper re-indexes); score-free, so
block-wise and one-shot give the same set.
"""


def main() -> None:
    parts = [HEADER]
    for name in REGISTRY:
        section = ROOT / "docs" / "policies" / f"{name.replace('+', '_p').replace('_p_p', '_pp')}.md"
        if section.is_file():
            parts.append(section.read_text().strip() + "\n")
    (ROOT / "docs" / "policies.md").write_text("\n".join(parts))
    print("wrote docs/policies.md")


if __name__ == "__main__":
    main()
