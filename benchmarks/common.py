"""Shared helpers for benchmarks: timing and the result-row shape."""

from __future__ import annotations

import time
from typing import Callable


def timed(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` runs (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def row(name: str, value: float, baseline: float, unit: str, target: float | None = None, note: str = "") -> dict:
    return {"name": name, "value": value, "baseline": baseline, "ratio": value / baseline if baseline else float("nan"),
            "unit": unit, "target": target, "note": note}


def print_table(rows: list[dict]) -> None:
    print(f"{'benchmark':58} {'value':>12} {'baseline':>12} {'ratio':>7} {'target':>7}  unit")
    for r in rows:
        tgt = f">={r['target']}" if r.get("target") is not None else ""
        print(f"{r['name']:58} {r['value']:12.4g} {r['baseline']:12.4g} {r['ratio']:7.3f} {tgt:>7}  {r['unit']} {r.get('note', '')}")
