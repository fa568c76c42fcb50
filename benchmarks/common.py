"""Shared helpers for benchmarks: timing and the result-row shape.

The clock: wall time by default; ``LEDGER_BENCH_CLOCK=cpu`` (or ``python -m benchmarks --cpu ...``)
times every figure that goes through :func:`now` / :func:`timed` in CPU seconds of this process and
of the subprocesses it waited for, so ratios stay repeatable on a shared, loaded machine (a broker
or server process the benchmark talks to is not counted: its work is outside the ledger's glue)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any, Callable

CLOCK_ENV = "LEDGER_BENCH_CLOCK"


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its waited-for children."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def clock_name() -> str:
    """``"cpu"`` or ``"wall"`` (read at each call: a test or ``--cpu`` may set it after import)."""
    name = os.environ.get(CLOCK_ENV, "wall").strip().lower() or "wall"
    if name not in ("cpu", "wall"):
        raise ValueError(f"{CLOCK_ENV} must be 'cpu' or 'wall', not {name!r}")
    return name


def now() -> float:
    """The benchmark clock's reading in seconds (``time.perf_counter`` or :func:`cpu_seconds`)."""
    return cpu_seconds() if clock_name() == "cpu" else time.perf_counter()


def timed(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best time of ``repeat`` runs (seconds, on the benchmark clock)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = now()
        fn()
        best = min(best, now() - t0)
    return best


def row(name: str, value: float, baseline: float, unit: str, target: float | None = None, note: str = "") -> dict:
    return {"name": name, "value": value, "baseline": baseline, "ratio": value / baseline if baseline else float("nan"),
            "unit": unit, "target": target, "note": note}


def print_table(rows: list[dict]) -> None:
    print(f"clock: {clock_name()}" + (" (CPU seconds of this process and its children)" if clock_name() == "cpu" else ""))
    print(f"{'benchmark':58} {'value':>12} {'baseline':>12} {'ratio':>7} {'target':>7}  unit")
    for r in rows:
        tgt = f">={r['target']}" if r.get("target") is not None else ""
        print(f"{r['name']:58} {r['value']:12.4g} {r['baseline']:12.4g} {r['ratio']:7.3f} {tgt:>7}  {r['unit']} {r.get('note', '')}")


def signed_store(root: Path) -> tuple[Any, Any, Any, Any]:
    """A new embedded store at ``root/store`` whose trust lets one new key sign every signed type:
    ``(key, trust, paths, log)`` (the log open; the caller closes it)."""
    from ledger.events.catalog import SIGNED_TYPES
    from ledger.events.signing import Trust, new_private_key, public_bytes
    from ledger.log import open_log
    from ledger.log.paths import store_paths

    key = new_private_key()
    trust = Trust()
    trust.add(public_bytes(key), list(SIGNED_TYPES))
    paths = store_paths(str(root / "store"))
    log = open_log(paths.url, create=True)
    trust.save(paths.trust)
    return key, trust, paths, log
