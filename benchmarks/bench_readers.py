"""Trainer readers (issue 27 item 10): validated reads vs reading with the digest check alone.

The realistic workload (:func:`workloads.synthetic.generate`, as ``bench_admission``) is
replayed and its training route exported in every format; each file is then read by
``ledger.read_records`` / ``ledger.read_packed`` (digest, structure, member set, per-execution
L_i) and, as the same-run baseline, by the reader as it was before the structural checks: parse
each line (or Parquet row), rebuild tree records, compare the member digest — nothing else.
The ratio is what validation costs (1.0 = free).

``python -m benchmarks bench_readers``; size with ``LEDGER_BENCH_READERS_EXECUTIONS`` (default 80)
and ``LEDGER_BENCH_READERS_ROUNDS`` (default 5; best of, interleaved, for a shared machine).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ledger.corpus.export import EXTRA_COLUMN, member_digest, records_from_tree_doc

from .common import row, now

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_READERS_EXECUTIONS", "80"))
ROUNDS = int(os.environ.get("LEDGER_BENCH_READERS_ROUNDS", "5"))
FORMATS = (("jsonl", "r.jsonl"), ("parquet", "r.parquet"), ("tree", "r.tree.jsonl"), ("packed", "p.jsonl"),
           ("packed-parquet", "p.parquet"))


def _digest_only_lines(path: Path):
    """JSON lines (path, tree or packed): parse, rebuild tree records, compare digests."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            doc = json.loads(line)
            for rec in (records_from_tree_doc(doc, verify=False) if "leaves" in doc else (doc,)):
                if member_digest(rec) != rec["digest"]:
                    raise ValueError("digest")
                yield rec


def _digest_only_parquet(path: Path):
    import pyarrow.parquet as pq

    packed = "node_spans" in pq.ParquetFile(str(path)).schema_arrow.names
    for batch in pq.ParquetFile(str(path)).iter_batches(batch_size=256):
        for rec in batch.to_pylist():
            if packed:  # SPEC 11.5: integer target structs (ledger.corpus.formats)
                rec["targets"] = [[t["target_index"], t["predecessor_index"], t["weight"]] for t in rec["targets"]]
            else:  # int64 / float64 columns are the JSON types already; lineage is a struct column
                extra = rec.pop(EXTRA_COLUMN, None)
                rec = rec | (json.loads(extra) if extra else {})
            if member_digest(rec) != rec["digest"]:
                raise ValueError("digest")
            yield rec


def _timed(records) -> tuple[float, int]:
    t0 = now()
    tokens = sum(len(r["input_ids"]) for r in records)
    return now() - t0, tokens


def _export(tmp: Path, n_executions: int) -> dict[str, int]:
    from benchmarks.bench_admission import _events
    from ledger.corpus.export import export
    from ledger.events.catalog import SIGNED_TYPES
    from ledger.events.signing import Trust, new_private_key, public_bytes
    from ledger.log import open_log
    from ledger.producers.ingest import Ingestor
    from ledger.projections.engine import ReplayEngine, connect
    from ledger.projections.registry import all_projections

    key = new_private_key()
    trust = Trust()
    trust.add(public_bytes(key), list(SIGNED_TYPES))
    with open_log(str(tmp / "store"), create=True) as log:
        Ingestor(log, trust).ingest_lines(enumerate(_events(n_executions, 30, key), 1))
        db = connect(tmp / "p.db")
        ReplayEngine(log, db, list(all_projections()), trust=trust).run()
    records = {fmt: export(db, "sft", tmp / name, fmt)["records"] for fmt, name in FORMATS}
    db.close()
    return records


def run(n_executions: int = N_EXECUTIONS, rounds: int = ROUNDS) -> list[dict]:
    from ledger import read_packed, read_records

    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        records = _export(tmp, n_executions)
        for fmt, name in FORMATS:
            path = tmp / name
            reader = read_packed if fmt.startswith("packed") else read_records
            baseline = _digest_only_parquet if fmt.endswith("parquet") else _digest_only_lines
            best_new = best_old = float("inf")
            for _ in range(rounds):  # interleaved: both see the same machine load
                t_old, tokens = _timed(baseline(path))
                t_new, _ = _timed(reader(path))
                best_old, best_new = min(best_old, t_old), min(best_new, t_new)
            rows.append(row(f"read {fmt}: validated vs digest-only (tokens/s)", tokens / best_new, tokens / best_old,
                            "tokens/s", note=f"{records[fmt]} records, {tokens} tokens"))
            if fmt.startswith("packed"):  # SPEC 11.5: members' path records rebuilt and hashed (as against a manifest)
                best = min(_timed(read_packed(path, verify_members=True))[0] for _ in range(rounds))
                rows.append(row(f"read {fmt} + member records vs digest-only (tokens/s)", tokens / best,
                                tokens / best_old, "tokens/s", note=f"{records[fmt]} records, {tokens} tokens"))
    return rows


if __name__ == "__main__":  # pragma: no cover
    from .common import print_table

    print_table(run())
