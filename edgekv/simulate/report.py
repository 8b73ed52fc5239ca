"""Rich tables for ``edgekv simulate``: one per run, and a short comparison of the runs."""

from __future__ import annotations

from rich.table import Table

from ..units import human_bytes
from .roofline import Estimate
from .runner import Outcome


def _hb(n) -> str:
    return human_bytes(int(n)) if n is not None else "—"


def _needs(o: Outcome) -> str:
    return f"> {_hb(o.cap)}" if o.needs_lower_bound else f"≈ {_hb(o.needs_bytes)}"


def _secs(s: float) -> str:
    return f"{s * 1000:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def run_table(title: str, o: Outcome, estimates: list[Estimate], work_source: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=True)
    table.add_column("")
    table.add_column("value", overflow="fold")
    style = "green" if o.fits else "red"
    table.add_row("memory cap", f"{_hb(o.cap)} via {o.mechanism}")
    table.add_row("cap measures", o.measures)
    p = o.plan
    table.add_row("static plan", f"{_hb(p['total'])} = weights {_hb(p['weights'])} + KV cache {_hb(p['kv_cache'])} "
                                 f"+ activations {_hb(p['activations'])}")
    if o.measured_peak is not None:
        table.add_row(f"measured peak ({o.measured_peak_field})",
                      f"{_hb(o.measured_peak)}" + (f"  (runtime overhead over plan ≈ {_hb(o.runtime_overhead)})"
                                                  if o.fits and o.runtime_overhead is not None else ""))
    if o.peak_rss is not None:
        table.add_row("measured peak RSS (VmHWM)", _hb(o.peak_rss))
    if o.fits:
        verdict = f"[{style}]fits[/] — {_hb(o.cap - (o.measured_peak or 0))} headroom under the cap"
    elif o.needs_bytes is not None:
        verdict = f"[{style}]{'refused: ' if o.status.startswith('refused') else ''}does not fit: needs {_needs(o)}[/]"
    else:
        verdict = f"[{style}]{o.status}[/]"
    table.add_row("fits?", verdict)
    if not o.fits and o.needs_basis:
        table.add_row("needs ≈ from", o.needs_basis)
    if o.exit:
        table.add_row("child", o.exit + (f": {o.error[:300]}" if o.error else ""))
    elif o.error:
        table.add_row("error", o.error[:500])
    h = o.host
    if o.fits:
        table.add_row(f"host time ({'eager engine' if o.engine == 'eager' else 'compiled artifact'}, this machine)",
                      f"prefill {_secs(h['prefill_seconds'])} ({h['prefill_tok_s'] or 0:,.0f} tok/s) · decode "
                      f"{h['decode_tok_s'] or 0:,.1f} tok/s · child wall {_secs(h['child_wall_s'])}")
    elif "child_wall_s" in h:
        table.add_row("host time", f"child wall {_secs(h['child_wall_s'])} until it stopped")
    for e in estimates:
        table.add_row(f"est. {e.device} ({e.unit}, {e.precision})",
                      f"prefill {_secs(e.prefill_s)} ({e.prefill_tok_s:,.0f} tok/s, {e.prefill_bound}) · decode "
                      f"{e.decode_tok_s:,.1f} tok/s at {e.decode_context:,} cached ({e.decode_bound}-bound)"
                      + (f" · {e.note}" if e.note else ""))
    if estimates:
        table.add_row("estimates", f"ideal roofline lower bound from peak figures; work counted from {work_source}")
    return table


def summary_table(outcomes: list[Outcome]) -> Table:
    table = Table(title="summary", title_justify="left")
    for c in ("policy", "N", "B", "prompt", "cap", "plan", "measured peak", "result"):
        table.add_column(c, justify="right" if c not in ("policy", "result") else "left")
    for o in outcomes:
        if o.fits:
            res = "[green]fits[/]"
        elif o.needs_bytes is not None:
            res = f"[red]does not fit: needs {_needs(o)}[/]" + (" (refused)" if o.status.startswith("refused") else "")
        else:
            res = f"[red]{o.status}[/]"
        table.add_row(o.policy, f"{o.budget:,}", str(o.block), f"{o.prompt_tokens:,}", _hb(o.cap), _hb(o.plan["total"]),
                      _hb(o.measured_peak), res)
    return table
