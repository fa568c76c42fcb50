"""Admission and export benchmarks (SPEC §6.5, §6.7, §8) on the realistic workload.

Rows (each beside a baseline measured in the same run on the same data):

* replay with the admission projection vs the same replay without it (events/s);
* a full admission recompute (every execution through the route's cascade and path
  selection, rows written) vs building the same executions' prefix trees (executions/s);
* trainer-record export (tree loads, masks, digests) vs canonical-JSON encoding of the
  same records (tokens/s);
* stored tokens of the emitted executions' trees, and processed tokens of path export and
  tree export, vs naive per-request expansion; tree vs path export (token counts; the
  ratio is the saving);
* tree-packed export (issue 18): tokens processed per admitted target for per-request rows,
  path, tree and packed export, and packing time vs path export time (same projection).

``python -m benchmarks bench_admission``; size with ``LEDGER_BENCH_ADMISSION_EXECUTIONS``
(default 80) and ``LEDGER_BENCH_ADMISSION_TURNS`` (default 30).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ledger.algorithms.canonical import canonical_json
from ledger.events.signing import Trust, new_private_key, public_bytes, sign_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor

from .common import row, now

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_ADMISSION_EXECUTIONS", "80"))
TURNS = int(os.environ.get("LEDGER_BENCH_ADMISSION_TURNS", "30"))


def _upstream():
    """The projections admission reads, in registry order (those that exist)."""
    from ledger.projections.assessment import AssessmentProjection
    from ledger.projections.tree import TreeProjection

    out = [TreeProjection()]
    for mod, cls in (("ledger.projections.governance", "GovernanceProjection"), ("ledger.projections.splits", "SplitsProjection")):
        try:
            m = __import__(mod, fromlist=[cls])
            out.append(getattr(m, cls)())
        except (ImportError, AttributeError):
            pass
    out.append(AssessmentProjection())
    return out


def _evidence():
    """Real split map / permissions when those projections exist, else a permissive stand-in."""
    from ledger.projections.admission import Evidence

    ev = Evidence.discover()
    if ev.split is not None and ev.governance_available:
        return ev, "real split map and permissions"
    return Evidence(split=lambda db, ex: ("train", None, False), permitted=lambda db, ex, use: ("pass", "bench"),
                    withdrawn=lambda db, ex: False, covered=lambda db, subject: [], split_facts=lambda db: {}), \
        "stand-in split map/permissions (modules absent)"


def _events(n: int, turns: int, key) -> list[dict]:
    from workloads import synthetic as workload

    events = list(workload.with_prefix_references(workload.generate(n, seed=11, turns=turns)))
    gov = [sign_line({"type": "permission", "subject": "*", "use": "sft", "action": "grant", "authority": "bench"}, key),
           sign_line({"type": "split_policy", "policy_id": "bench", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
                      "salt": "bench"}, key),
           sign_line({"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 8,
                      "predicates": ["record_adequacy", "permitted_use", "target_suitability"]}, key)]
    return gov + events


def _replay(log, trust, db_path: Path, projections) -> float:
    from ledger.projections.engine import ReplayEngine, connect

    db = connect(db_path)
    t0 = now()
    ReplayEngine(log, db, projections, trust=trust).run()
    elapsed = now() - t0
    db.close()
    return elapsed


def run(n_executions: int = N_EXECUTIONS, turns: int = TURNS) -> list[dict]:
    from ledger.corpus.export import accounting, trainer_records
    from ledger.projections.admission import AdmissionProjection, current_routes
    from ledger.projections.engine import connect
    from ledger.projections.tree import TreeProjection

    key = new_private_key()
    trust = Trust()
    from ledger.events.catalog import SIGNED_TYPES

    trust.add(public_bytes(key), list(SIGNED_TYPES))
    evidence, note = _evidence()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        log = open_log(str(tmp_path / "store"), create=True)
        events = _events(n_executions, turns, key)
        Ingestor(log, trust).ingest_lines(enumerate(events, 1))
        n_events = len(events)

        def best(label: str, make) -> float:  # best of two fresh replays (the machine is shared)
            return min(_replay(log, trust, tmp_path / f"{label}{i}.db", make()) for i in range(2))

        t_tree = best("tree", lambda: [TreeProjection()])
        t_without = best("without", _upstream)
        t_with = best("with", lambda: _upstream() + [AdmissionProjection(evidence)])
        rows.append(row("admission: replay with admission (events/s)", n_events / t_with, n_events / t_without, "events/s",
                        note=f"{n_executions} executions; {note}"))

        db = connect(tmp_path / "with1.db")
        route = current_routes(db)["sft"]
        adm = AdmissionProjection(evidence)
        db.execute("BEGIN IMMEDIATE")
        adm.dirty_routes.add(route.name)  # recompute every execution of the route from scratch
        t0 = now()
        adm.finish(db)
        t_recompute = now() - t0
        db.execute("COMMIT")
        rows.append(row("admission: full recompute vs tree build (executions/s)", n_executions / t_recompute,
                        n_executions / t_tree, "executions/s"))

        t0 = now()
        records = list(trainer_records(db, "sft", evidence=evidence))
        t_export = now() - t0
        tokens = sum(len(r["input_ids"]) for r in records)
        t0 = now()
        for r in records:
            canonical_json(r)
        t_json = now() - t0
        rows.append(row("export: trainer records vs JSON-encoding them (tokens/s)", tokens / t_export, tokens / t_json,
                        "tokens/s", note=f"{len(records)} records"))

        acc = accounting(db, "sft")
        pt = acc["processed_tokens"]
        rows.append(row("stored tokens (emitted trees) / naive per-request expansion", acc["tree_tokens"], pt["naive"],
                        "tokens"))
        rows.append(row("processed tokens: path export / naive per-request expansion", pt["path"], pt["naive"], "tokens"))
        rows.append(row("processed tokens: tree export / naive per-request expansion", pt["tree"], pt["naive"], "tokens"))
        rows.append(row("processed tokens: tree export / path export", pt["tree"], pt["path"], "tokens",
                        note=f"{acc['records']} records, {acc['target_tokens']} target tokens"))

        # Tree-packed export (SPEC §7.5, issue 18): tokens a trainer processes per admitted
        # target, and the cost of packing beside the path export on the same projection.
        from ledger.corpus.packed import packed_records

        t0 = now()
        packed = list(packed_records(db, "sft", evidence=evidence))
        t_packed = now() - t0
        n_packed = sum(len(r["input_ids"]) for r in packed)
        n_targets = acc["target_tokens"]
        per = {"per-request rows": pt["naive"], "path export": pt["path"], "tree export": pt["tree"],
               "packed export": n_packed}
        for label, n in per.items():
            rows.append(row(f"tokens per admitted target: {label} / path export", n / n_targets, pt["path"] / n_targets,
                            "tokens/target"))
        rows.append(row("packing time vs path export time (s)", t_packed, t_export, "s",
                        note=f"{len(packed)} packed records, {n_packed} tokens (tree export: {pt['tree']})"))
        db.close()
        log.close()
    return rows


if __name__ == "__main__":  # pragma: no cover
    from .common import print_table

    print_table(run())
