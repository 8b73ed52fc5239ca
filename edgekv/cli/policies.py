"""`edgekv policies`: the eviction policies, what each does and its parameters."""

from __future__ import annotations

from rich.table import Table

from .common import out


def policies_cmd():
    """List the eviction policies: what each does, and its parameters (`--policy-arg key=value`)."""
    from ..policies import REGISTRY

    table = Table(title="eviction policies")
    table.add_column("name", no_wrap=True)
    table.add_column("what it does")
    table.add_column("parameters (defaults)")
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        params = cls().params()
        table.add_row(name, cls.summary or "—", ", ".join(f"{k}={v}" for k, v in params.items()) or "—")
    out.print(table)
