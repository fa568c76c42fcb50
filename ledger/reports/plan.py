"""`ledger plan`: the collection-bottleneck planning helper (seed 002 §15.8.3, equation 4,
napkin math 15.6).

``R = min(A / g, W / T, B / S)`` attempts per second for ``A`` accelerators spending ``g``
accelerator-seconds per attempt, ``W`` verifier slots at ``T`` slot-seconds per attempt
(equation 1; ``ledger cascade plan`` measures it) and store write bandwidth ``B`` charged
at the per-record ceiling ``S``.  The smallest term is the **binding stage**; the planned
admitted-record rate is ``R * Y`` for route yield ``Y``.  With prices, the active-resource
charge per admitted record (only occupied accelerator and verifier time billed) is
``(g * price_acc + T * price_slot) / 3600 / Y``.  Sizes accept decimal (``MB`` = 10^6 B,
as in the seed) and binary (``MiB``) units.
"""

from __future__ import annotations

import re
from typing import Any

from ledger.algorithms.economics import active_cost_per_admitted, plan_collector
from ledger.algorithms.errors import InputError

__all__ = ["parse_size", "collector_plan", "format_plan"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*?)(?:/s|ps)?\s*$", re.IGNORECASE)


def parse_size(text: str | float | int) -> float:
    """``"8MB"`` -> 8e6, ``"200 MB/s"`` -> 2e8, ``"2MiB"`` -> 2097152, ``"123"`` -> 123 (bytes)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"not a size: {text!r} (use e.g. 8MB, 200MB, 2MiB, or a number of bytes)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def collector_plan(*, accelerators: int, gen_seconds: float, verifier_slots: int, check_seconds: float,
                   route_yield: float, record_ceiling: str | float, write_bandwidth: str | float,
                   accelerator_price: float | None = None, slot_price: float | None = None) -> dict[str, Any]:
    """Equation 4 (and, with prices, the active-resource charge) as a JSON-ready dict."""
    if accelerators < 0 or verifier_slots < 0:
        raise InputError("accelerators and verifier slots must be >= 0")
    ceiling, bandwidth = parse_size(record_ceiling), parse_size(write_bandwidth)
    plan = plan_collector(accelerators=accelerators, generation_seconds_per_attempt=gen_seconds,
                          verifier_slots=verifier_slots, checking_seconds_per_attempt=check_seconds,
                          write_bytes_per_second=bandwidth, record_ceiling_bytes=ceiling, route_yield=route_yield)
    out: dict[str, Any] = {
        "inputs": {"accelerators": accelerators, "gen_seconds": gen_seconds, "verifier_slots": verifier_slots,
                   "check_seconds": check_seconds, "route_yield": route_yield, "record_ceiling_bytes": ceiling,
                   "write_bytes_per_second": bandwidth},
        "stage_rates": dict(plan.stage_rates),
        "binding": plan.binding,
        "attempt_rate": plan.attempt_rate,
        "admitted_rate": plan.admitted_rate,
        "admitted_per_hour": plan.admitted_rate * 3600,
        "unused_generation_fraction": plan.unused_generation_fraction,
        "verifier_slots_to_match_generation": plan.verifier_slots_to_match_generation,
        "bandwidth_to_match_generation": plan.bandwidth_to_match_generation,
    }
    if accelerator_price is not None or slot_price is not None:
        cost = active_cost_per_admitted(generation_seconds_per_attempt=gen_seconds,
                                        accelerator_price_per_hour=accelerator_price or 0.0,
                                        checking_seconds_per_attempt=check_seconds,
                                        slot_price_per_hour=slot_price or 0.0, route_yield=route_yield)
        out["cost"] = {"generation_per_attempt": cost.generation_cost_per_attempt,
                       "checking_per_attempt": cost.checking_cost_per_attempt,
                       "per_attempt": cost.cost_per_attempt, "per_admitted": cost.cost_per_admitted,
                       "checking_share": cost.checking_share}
    return out


def _size(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.4g} {unit}"
    return f"{b:g} B"


def format_plan(p: dict[str, Any]) -> str:
    i = p["inputs"]
    rates = p["stage_rates"]
    terms = {"generation": f"{i['accelerators']} accelerators / {i['gen_seconds']:g} s",
             "assessment": f"{i['verifier_slots']} verifier slots / {i['check_seconds']:g} s",
             "storage": f"{_size(i['write_bytes_per_second'])}/s / {_size(i['record_ceiling_bytes'])}"}
    width = max(len(t) for t in terms.values())
    lines = ["stage ceilings (attempts/s, seed equation 4):"]
    for stage, term in terms.items():
        mark = "  <- binds" if stage == p["binding"] else ""
        lines.append(f"  {stage:<10}  {term:<{width}}  = {rates[stage]:.4g}{mark}")
    lines += [
        f"binding stage: {p['binding']}",
        f"planned attempt rate: {p['attempt_rate']:.4g}/s; admitted rate at yield {100 * i['route_yield']:.2f}%: "
        f"{p['admitted_rate']:.4g}/s ({p['admitted_per_hour']:.1f}/h)",
        f"unused generation capacity: {100 * p['unused_generation_fraction']:.1f}%",
        f"verifier slots to match generation: {p['verifier_slots_to_match_generation']}; "
        f"write bandwidth to match generation: {_size(p['bandwidth_to_match_generation'])}/s",
    ]
    if "cost" in p:
        c = p["cost"]
        per = "n/a (zero yield)" if c["per_admitted"] is None else f"${c['per_admitted']:.2f}"
        lines.append(f"active-resource charge: ${c['per_attempt']:.4f} per attempt (generation ${c['generation_per_attempt']:.4f}, "
                     f"checking ${c['checking_per_attempt']:.6f}); per admitted record {per} "
                     f"(checking {100 * c['checking_share']:.1f}%)")
    return "\n".join(lines)
