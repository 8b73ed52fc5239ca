"""Roofline estimate of prefill and decode time on one compute unit of a device profile.

Each step takes max(FLOPs / peak FLOP/s, bytes / peak bandwidth): an ideal lower bound
(peak figures, perfect overlap of compute and memory traffic). Real kernels on phones reach
a fraction of both peaks, so read the result as "no faster than"; it ranks policies,
budgets and devices, it does not predict a stopwatch."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .profiles import PRECISIONS, DeviceProfile
from .work import Schedule, WorkModel


@dataclass
class Estimate:
    device: str
    unit: str
    precision: str
    work_source: str
    prompt_tokens: int
    prefill_s: float
    prefill_tok_s: float
    prefill_bound: str  # "compute" | "memory" | "mixed"
    decode_context: int
    decode_s_per_token: float
    decode_tok_s: float
    decode_bound: str
    prefill_flops: float
    prefill_bytes: float
    decode_flops: float
    decode_bytes: float
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def step_time(flops: float, nbytes: float, ops_per_s: float, bytes_per_s: float) -> tuple[float, str]:
    tc, tm = flops / ops_per_s, nbytes / bytes_per_s
    return max(tc, tm), ("compute" if tc >= tm else "memory")


def estimate(profile: DeviceProfile, work: WorkModel, sched: Schedule, unit: str | None = None,
             precision: str = "fp32") -> Estimate:
    unit = unit or profile.default_unit
    cu = profile.units[unit]
    prec = cu.best_precision(precision)
    note = ""
    if prec != precision:
        note = (f"{cu.name} has no {precision} rate in the profile: estimated as a {prec} build "
                f"({PRECISIONS[prec][2]} B per weight/cache value)")
    vb = PRECISIONS[prec][2]
    ops, bw = cu.ops_per_second(prec), profile.bandwidth_bytes_per_s
    t_pre = f_pre = m_pre = 0.0
    bounds = set()
    for n, b, ev in sched.blocks():
        w = work.block(n, b, ev, vb)
        t, bound = step_time(w.flops, w.bytes, ops, bw)
        t_pre += t
        f_pre += w.flops
        m_pre += w.bytes
        bounds.add(bound)
    n_dec = min(sched.prompt, sched.budget) if sched.evicting else sched.prompt
    wd = work.decode(n_dec, sched.evicting and n_dec + 1 > sched.budget, vb)
    t_dec, dec_bound = step_time(wd.flops, wd.bytes, ops, bw)
    return Estimate(
        device=profile.name, unit=unit, precision=prec, work_source=work.source,
        prompt_tokens=sched.prompt, prefill_s=t_pre, prefill_tok_s=sched.prompt / t_pre if t_pre else 0.0,
        prefill_bound=bounds.pop() if len(bounds) == 1 else "mixed",
        decode_context=n_dec, decode_s_per_token=t_dec, decode_tok_s=1.0 / t_dec, decode_bound=dec_bound,
        prefill_flops=f_pre, prefill_bytes=m_pre, decode_flops=wd.flops, decode_bytes=wd.bytes, note=note,
    )


def estimate_all_units(profile: DeviceProfile, work: WorkModel, sched: Schedule, precision: str = "fp32"):
    return [estimate(profile, work, sched, u, precision) for u in profile.units]
