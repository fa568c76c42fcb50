"""What refusing duplicate JSON keys costs (issue 27 item 8, SPEC 11.7), against the old parse in the same run.

* parse alone: ``loads_unique`` (C-speed parse, the ``object_pairs_hook`` only for lines with nested
  objects or a key count that does not add up) vs plain ``json.loads``, and vs the hook on every
  object (what the fast check saves), on the realistic synthetic log and on small events;
* ``ledger ingest``'s whole path (read, parse, validate, seal, append) of the same lines with the new
  parse vs the old one (``json.loads``), each in a fresh store.

Process CPU time, candidates interleaved, best of several runs: the figure is the ratio.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

from .common import row


def _lines() -> tuple[list[str], list[str]]:
    from workloads import synthetic as workload

    realistic = [json.dumps(e) for e in workload.with_prefix_references(workload.generate(12, seed=7))]
    small = [json.dumps({"type": "cost_recorded", "execution_id": f"e{i % 500}", "amount": 0.5 + i, "category": "gpu"})
             for i in range(20_000)]
    small = [json.dumps({"type": "execution_opened", "execution_id": f"e{i}", "task_id": "t", "policy": "p",
                         "deadline": "2030-01-01T00:00:00Z"}) for i in range(500)] + small
    return realistic, small


def _best_cpu(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Best process CPU time of each of ``fns``, run interleaved ``repeat`` times (the machine is
    shared: CPU time and interleaving keep the ratio from following the load)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.process_time()
            fn()
            best[i] = min(best[i], time.process_time() - t0)
    return best


def _parse_rows(name: str, texts: list[str]) -> list[dict]:
    from ledger.algorithms.canonical import loads_unique, unique_keys

    plain, new, hook = _best_cpu([lambda: [json.loads(t) for t in texts], lambda: [loads_unique(t) for t in texts],
                                  lambda: [json.loads(t, object_pairs_hook=unique_keys) for t in texts]], 15)
    n = len(texts)
    return [row(f"parse {name}: duplicate-refusing loads_unique", n / new, n / plain, "lines/s",
                note="baseline json.loads"),
            row(f"parse {name}: object_pairs_hook on every object", n / hook, n / plain, "lines/s",
                note="baseline json.loads")]


def _ingest_seconds(texts: list[str], old: bool) -> float:
    """CPU seconds of one ``ledger ingest`` of ``texts`` into a fresh store (new or old parse)."""
    from ledger.cli import main as cli
    from ledger.log import open_log
    from ledger.producers import ingest as ing

    data = ("\n".join(texts) + "\n").encode()
    saved = ing.loads_unique
    with tempfile.TemporaryDirectory() as d:
        store = str(Path(d) / "s")
        cli(["--store", store, "init"])
        with open_log(store) as log:
            ingestor = ing.Ingestor(log)
            if old:
                ing.loads_unique = json.loads  # the parse before issue 27
            try:
                t0 = time.process_time()
                ingestor.ingest_lines(ing.read_json_lines(io.BytesIO(data)))
                return time.process_time() - t0
            finally:
                ing.loads_unique = saved
                ingestor.close()


def _ingest_rows(name: str, texts: list[str]) -> list[dict]:
    old, new = [], []
    for _ in range(9):  # interleaved, best of nine each
        old.append(_ingest_seconds(texts, True))
        new.append(_ingest_seconds(texts, False))
    n = len(texts)
    return [row(f"ingest {name}: duplicate keys refused", n / min(new), n / min(old), "lines/s",
                note="baseline: same path, json.loads")]


def run() -> list[dict]:
    import contextlib

    realistic, small = _lines()
    rows = _parse_rows("realistic log", realistic) + _parse_rows("small events", small)
    with contextlib.redirect_stdout(io.StringIO()):  # `ledger init` prints
        rows += _ingest_rows("realistic log", realistic) + _ingest_rows("small events", small)
    return rows
