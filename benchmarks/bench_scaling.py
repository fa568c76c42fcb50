"""Scaling: ingest + replay time per event and peak RSS across log sizes (issue 19, SPEC §8).

For each mix and each size N, two fresh processes: one ingests N events into a new embedded
store (``Ingestor.ingest_lines`` in batches of 1,000: validation, reference checks, sealing,
append), one replays it with every projection (``projections.registry.open_engine``).  Each
reports its wall time and its own peak RSS (``VmHWM``).  Events are produced lazily in the
ingesting process, so what its RSS shows is the ledger's, not the benchmark's list.

Mixes:
* ``small``: executions of 1 ``execution_opened`` + 99 ``cost_recorded`` (~100 B each);
* ``realistic``: a pool of 20 realistic executions (:func:`workloads.synthetic.generate`,
  prefix-referenced, ~2k events) replicated under fresh execution ids (``exec-…~k``) until N.

Figures: time per event at the largest size vs the smallest (flat = 1.0), the log-log slope of
time per event against N (0 = flat) and peak RSS largest vs smallest (target ≤ 1.5).

Sizes: ``LEDGER_BENCH_SCALING_SIZES`` (default ``10000,100000``; the issue's full range is
``10000,100000,1000000``, which takes tens of minutes on 2 cores) and
``LEDGER_BENCH_SCALING_MIXES`` (default ``small,realistic``).  Run alone:
``python -m benchmarks.bench_scaling --sizes 10000,100000,1000000 --mixes small``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from .common import print_table, row, now

ROOT = Path(__file__).resolve().parent.parent
BATCH = 1000
POOL_EXECUTIONS = 20


def _small_lines(n: int) -> Iterator[dict]:
    for i in range(n):
        ex, j = divmod(i, 100)
        if j == 0:
            yield {"type": "execution_opened", "execution_id": f"e{ex}", "task_id": "t", "deadline": "2030-01-01T00:00:00Z",
                   "policy": "p", "occurred_at": "2025-01-01T00:00:00Z"}
        else:
            yield {"type": "cost_recorded", "execution_id": f"e{ex}", "amount": 0.01 * j, "category": "generation",
                   "occurred_at": "2025-01-01T00:00:00Z"}


def _realistic_lines(n: int) -> Iterator[dict]:
    """The pool is generated here, before the caller starts its clock; the copies are made lazily."""
    from workloads import synthetic as workload

    return _copies(list(workload.with_prefix_references(workload.generate(POOL_EXECUTIONS, seed=11, turns=14))), n)


def _copies(pool: list[dict], n: int) -> Iterator[dict]:
    count = 0
    for k in itertools.count():
        for line in pool:
            if count >= n:
                return
            if line["type"] == "task_registered":
                if k:
                    continue  # tasks are shared by every copy
                out = line
            else:
                out = dict(line)
                out["execution_id"] = f"{line['execution_id']}~{k}"
            yield out
            count += 1


def _hwm_kb() -> int:
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])


def _worker(phase: str, mix: str, n: int, store: str) -> dict:
    from ledger.log import open_log

    if phase == "ingest":
        from ledger.producers.ingest import Ingestor

        lines = _small_lines(n) if mix == "small" else _realistic_lines(n)
        numbered = enumerate(lines, 1)
        t0 = now()
        with open_log(store, create=True) as log:
            ing = Ingestor(log)
            while True:
                chunk = list(itertools.islice(numbered, BATCH))
                if not chunk:
                    break
                report = ing.ingest_lines(chunk)
                if report.conflicts:
                    raise RuntimeError(f"conflicts while ingesting: {report.conflicts[:3]}")
            ing.close()
        seconds = now() - t0
    else:
        from ledger.projections.registry import open_engine

        t0 = now()
        with open_log(store) as log:
            eng = open_engine(log, Path(store) / "bench-projections.db", None)
            stats = eng.run()
            eng.db.close()
        seconds = now() - t0
        if stats.applied + stats.rejected + stats.dead_letters < n:
            raise RuntimeError(f"replay saw {stats} of {n} events")
    return {"seconds": seconds, "hwm_kb": _hwm_kb()}


def _run_worker(phase: str, mix: str, n: int, store: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_scaling", "--worker", phase, mix, str(n), str(store)],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_scaling worker {phase} {mix} {n} failed: {proc.stderr[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env_list(name: str, default: str) -> list[str]:
    return [s for s in os.environ.get(name, default).split(",") if s]


def run(sizes: list[int] | None = None, mixes: list[str] | None = None) -> list[dict]:
    sizes = sorted(sizes or [int(s) for s in _env_list("LEDGER_BENCH_SCALING_SIZES", "10000,100000")])
    mixes = mixes or _env_list("LEDGER_BENCH_SCALING_MIXES", "small,realistic")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for mix in mixes:
            got: dict[tuple[str, int], dict] = {}
            for n in sizes:
                store = Path(d) / f"{mix}-{n}"
                got[("ingest", n)] = _run_worker("ingest", mix, n, store)
                got[("replay", n)] = _run_worker("replay", mix, n, store)
                for phase in ("ingest", "replay"):
                    r = got[(phase, n)]
                    print(f"  {mix} {phase} {n}: {r['seconds']:.2f} s, {n / r['seconds']:.0f} events/s, "
                          f"peak RSS {r['hwm_kb'] / 1024:.1f} MB", file=sys.stderr)
            lo, hi = sizes[0], sizes[-1]
            for phase in ("ingest", "replay"):
                per = {n: got[(phase, n)]["seconds"] / n for n in sizes}
                slope = (math.log(per[hi] / per[lo]) / math.log(hi / lo)) if hi > lo else 0.0
                rows.append(row(f"scaling {mix} {phase}: time/event at {hi} vs {lo} events", per[hi] * 1e6, per[lo] * 1e6,
                                "us/event (flat = 1.0)", note=f"log-log slope {slope:+.3f}; "
                                + ", ".join(f"{n}: {n / got[(phase, n)]['seconds']:.0f}/s" for n in sizes)))
                rows.append(row(f"scaling {mix} {phase}: peak RSS at {hi} vs {lo} events",
                                got[(phase, hi)]["hwm_kb"] / 1024, got[(phase, lo)]["hwm_kb"] / 1024,
                                "MB (ratio target <= 1.5)"))
    return rows


def main(argv: list[str]) -> None:
    if argv[:1] == ["--worker"]:
        print(json.dumps(_worker(argv[1], argv[2], int(argv[3]), argv[4])))
        return
    sizes = mixes = None
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag == "--sizes":
            sizes = [int(s) for s in value.split(",")]
        elif flag == "--mixes":
            mixes = value.split(",")
        else:
            raise SystemExit(f"bench_scaling: unknown option {flag!r} (use --sizes N,N,... and --mixes small,realistic)")
    print_table(run(sizes, mixes))


if __name__ == "__main__":
    main(sys.argv[1:])
