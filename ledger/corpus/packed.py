"""Tree-packed trainer export (SPEC §7.5) and its reader.

One record per admitted execution (a zero-reward dummy is admitted as a dummy, §6.5, and gets
an empty record so trainers still count it), with exactly the contract fields::

    execution_id, input_ids, position_ids, node_spans, tin, tout, targets, members, digest

built by :func:`ledger.algorithms.tree_pack.pack` from the **same** admitted paths and target
positions (``admitted_paths``) the path export (§7.3) reads, with members in draw order (a
draw masks its whole path, so each target lies on a node its own member covers first).
``node_spans`` is ``[[start, end, parent_span|null]]`` (end exclusive), ``targets``
``[[target_index, predecessor_index|null, weight]]`` with weight ``1/L_i`` — the path
records' ``loss_weight`` — and ``members`` ``[{member_id, leaf_node_index}]``
(``leaf_node_index`` is a span index; ``null`` for a dummy).  ``digest`` is SHA-256 of the
canonical JSON of the record without ``digest`` (the member-digest rule of §6.6).  Indices
are JSON integers and weights floats; in Parquet the ``targets`` triples are stored as
doubles (exact below 2^53) and the reader gives back the JSON types, so a record has the
same digest in both encodings.

:func:`read_packed` iterates a packed JSON-lines or Parquet file, refusing (with
:class:`PackedRecordError`, naming the execution) a record whose digest does not verify or
whose arrays are not the ones its spans imply; :func:`unpack_record` gives back the path
records' ``input_ids`` / ``target_mask`` / per-position weights of each member.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from ledger.algorithms import tree_pack
from ledger.algorithms.canonical import canonical_json
from ledger.corpus.export import (DigestMismatch, ExportSummary, _context, _evidence, _open_out, member_digest,
                                  write_parquet_rows)

__all__ = ["PACKED_FIELDS", "PackedDigestMismatch", "PackedRecordError", "packed_records", "read_packed",
           "unpack_record", "write_packed_jsonl", "write_packed_parquet"]

PACKED_FIELDS = ("execution_id", "input_ids", "position_ids", "node_spans", "tin", "tout", "targets", "members", "digest")


class PackedRecordError(ValueError):
    """A packed record that is malformed or inconsistent (names the execution or line)."""


class PackedDigestMismatch(DigestMismatch, PackedRecordError):
    """A packed record's digest does not match its content."""

    def __init__(self, execution_id: str, expected, actual: str) -> None:
        self.member_id, self.execution_id, self.expected, self.actual = None, execution_id, expected, actual
        ValueError.__init__(self, f"packed record of execution {execution_id}: digest {expected} does not match its "
                                  f"content (sha256 {actual})")


# ====================================================================== building


def _packed_record(route: str, ctx) -> dict:
    from projections.admission import member_id

    if ctx.state == "dummy":
        rec = {"execution_id": ctx.execution_id, "input_ids": [], "position_ids": [], "node_spans": [], "tin": [], "tout": [],
               "targets": [], "members": [{"member_id": member_id(route, ctx.execution_id, None, ctx.semantics),
                                                     "leaf_node_index": None}]}
        rec["digest"] = member_digest(rec)
        return rec
    t = ctx.loaded
    rows = sorted(ctx.paths.values(), key=lambda r: r[1])  # draw order = member order
    leaves, targets, mids = [], [], []
    for leaf_req, _draw, mid, _role, path_tokens, _n, _reward, blob in rows:
        node = t.requests[leaf_req].node_id
        n_path = sum(int(t.nodes[v].tokens.shape[0]) for v in t.path_nodes(node))
        if n_path != path_tokens:
            raise RuntimeError(f"member {mid}: the tree changed since admission ({n_path} != {path_tokens} tokens); "
                               "run the projections up to date first")
        leaves.append(node)
        targets.append(np.frombuffer(blob, dtype="<u4").astype(np.int64))
        mids.append(mid)
    weight = 1.0 / ctx.target_tokens if ctx.target_tokens else 0.0
    p = tree_pack.pack([-1 if n.parent is None else n.parent for n in t.nodes], [n.tokens for n in t.nodes],
                       leaves, targets, weight)
    spans = p.node_spans.tolist()
    rec = {
        "execution_id": ctx.execution_id,
        "input_ids": p.input_ids.tolist(),
        "position_ids": p.position_ids.tolist(),
        "node_spans": [[a, b, None if c < 0 else c] for a, b, c in spans],
        "tin": p.tin.tolist(),
        "tout": p.tout.tolist(),
        "targets": [[i, None if j < 0 else j, weight] for i, j in p.targets.tolist()],
        "members": [{"member_id": m, "leaf_node_index": int(s)} for m, s in zip(mids, p.member_spans.tolist())],
    }
    rec["digest"] = member_digest(rec)
    return rec


def packed_records(db: sqlite3.Connection, route: str, *, evidence=None) -> Iterator[dict]:
    """The route's packed records (SPEC §7.5), one per admitted or dummy execution in
    ``execution_id`` order, one execution loaded at a time."""
    evidence = _evidence(evidence)
    cur = db.cursor()
    cur.execute("SELECT execution_id FROM admission WHERE route = ? AND state IN ('admitted', 'dummy') ORDER BY execution_id",
                (route,))
    while True:
        batch = cur.fetchmany(256)
        if not batch:
            return
        for (ex,) in batch:
            yield _packed_record(route, _context(db, route, ex, evidence))


# ====================================================================== writers


def _summarise(summary: ExportSummary, rec: dict) -> None:
    summary.records += 1
    summary.executions += 1
    if not rec["input_ids"] and rec["members"] and rec["members"][0]["leaf_node_index"] is None:
        summary.dummies += 1
    summary.tree_tokens += len(rec["input_ids"])
    summary.target_tokens += len(rec["targets"])


def write_packed_jsonl(records, out: str | Path | IO[str]) -> ExportSummary:
    """One canonical JSON packed record per line."""
    summary = ExportSummary()
    fh, close = _open_out(out)
    try:
        for rec in records:
            fh.write(canonical_json(rec).decode("utf-8"))
            fh.write("\n")
            _summarise(summary, rec)
    finally:
        if close:
            fh.close()
    return summary


def _arrow_schema():
    import pyarrow as pa

    return pa.schema([
        ("execution_id", pa.string()), ("input_ids", pa.list_(pa.uint32())), ("position_ids", pa.list_(pa.int64())),
        ("node_spans", pa.list_(pa.list_(pa.int64()))), ("tin", pa.list_(pa.int64())), ("tout", pa.list_(pa.int64())),
        ("targets", pa.list_(pa.list_(pa.float64()))),
        ("members", pa.list_(pa.struct([("member_id", pa.string()), ("leaf_node_index", pa.int64())]))),
        ("digest", pa.string()),
    ])


def write_packed_parquet(records, path: str | Path, *, row_group_tokens: int = 1 << 20, row_group_rows: int = 256) -> ExportSummary:
    """Parquet with the packed record's columns, written in row groups while streaming."""
    summary = ExportSummary()
    write_parquet_rows(records, path, _arrow_schema(), lambda rec: _summarise(summary, rec),
                       row_group_tokens=row_group_tokens, row_group_rows=row_group_rows)
    return summary


# ====================================================================== reader


def _from_parquet(rec: dict) -> dict:
    """The JSON types back from the Parquet columns (indices were stored as exact doubles)."""
    out = {k: rec[k] for k in PACKED_FIELDS}
    out["targets"] = [[_int(t), None if p is None else _int(p), w] for t, p, w in (rec["targets"] or [])]
    return out


def _int(x: float) -> int:
    if x is None or x != int(x):
        raise PackedRecordError(f"target index {x!r} is not an integer")
    return int(x)


def _arrays(rec: dict):
    """numpy views of a record's arrays (after the field and type checks)."""
    spans = np.array([[a, b, -1 if c is None else c] for a, b, c in rec["node_spans"]], dtype=np.int64).reshape(-1, 3)
    targets = np.array([[t, -1 if p is None else p] for t, p, _ in rec["targets"]], dtype=np.int64).reshape(-1, 2)
    weights = np.array([w for _, _, w in rec["targets"]], dtype=np.float64)
    leaves = [m["leaf_node_index"] for m in rec["members"]]
    return spans, targets, weights, leaves


def _check_shape(rec: dict) -> None:
    """Field names and JSON types (so a malformed record fails with a sentence, not a traceback)."""
    if not isinstance(rec, dict):
        raise PackedRecordError("not a JSON object")
    if set(rec) != set(PACKED_FIELDS):
        missing = [f for f in PACKED_FIELDS if f not in rec]
        extra = sorted(set(rec) - set(PACKED_FIELDS))
        raise PackedRecordError(f"not a packed record (missing {missing or 'nothing'}, unexpected {extra or 'nothing'})")
    if not isinstance(rec["execution_id"], str) or not isinstance(rec["digest"], str):
        raise PackedRecordError("execution_id and digest must be strings")

    def ints(name, v, nullable=False):
        if not isinstance(v, list) or not all((x is None and nullable) or (isinstance(x, int) and not isinstance(x, bool)
                                                                          and 0 <= x < 2**63) for x in v):
            raise PackedRecordError(f"execution {rec['execution_id']}: {name} must be a list of non-negative integers")

    for name in ("input_ids", "position_ids", "tin", "tout"):
        ints(name, rec[name])
    if not isinstance(rec["node_spans"], list) or not all(isinstance(s, list) and len(s) == 3 for s in rec["node_spans"]):
        raise PackedRecordError(f"execution {rec['execution_id']}: node_spans must be [start, end, parent] triples")
    for s in rec["node_spans"]:
        ints("node_spans", s[:2])
        ints("node_spans", s[2:], nullable=True)
    if not isinstance(rec["targets"], list) or not all(isinstance(t, list) and len(t) == 3 for t in rec["targets"]):
        raise PackedRecordError(f"execution {rec['execution_id']}: targets must be [target, predecessor, weight] triples")
    for t in rec["targets"]:
        ints("targets", t[:1])
        ints("targets", t[1:2], nullable=True)
        w = t[2]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 < w <= 1):
            raise PackedRecordError(f"execution {rec['execution_id']}: target weight {w!r} is not in (0, 1]")
    if not isinstance(rec["members"], list) or not all(
            isinstance(m, dict) and set(m) == {"member_id", "leaf_node_index"} and isinstance(m["member_id"], str)
            for m in rec["members"]):
        raise PackedRecordError(f"execution {rec['execution_id']}: members must be [{{member_id, leaf_node_index}}]")
    ints("members' leaf_node_index", [m["leaf_node_index"] for m in rec["members"]], nullable=True)


def check_record(rec: dict) -> dict:
    """Verify one packed record: fields, digest, then structure (SPEC §7.5)."""
    _check_shape(rec)
    actual = member_digest(rec)
    if rec["digest"] != actual:
        raise PackedDigestMismatch(rec["execution_id"], rec["digest"], actual)
    spans, targets, _weights, leaves = _arrays(rec)
    dummy = not rec["input_ids"] and all(x is None for x in leaves)
    if not dummy:
        if any(x is None for x in leaves):
            raise PackedRecordError(f"execution {rec['execution_id']}: a member of a non-empty record has no leaf_node_index")
        try:
            tree_pack.check(len(rec["input_ids"]), rec["position_ids"], spans, rec["tin"], rec["tout"], targets, leaves)
        except ValueError as exc:
            raise PackedRecordError(f"execution {rec['execution_id']}: {exc}") from None
    return rec


def read_packed(path: str | Path, *, check: bool = True) -> Iterator[dict]:
    """Iterate the records of a packed JSON-lines or Parquet export, verifying each (digest
    and structure, :func:`check_record`).  Raises :class:`PackedDigestMismatch` (naming the
    execution) for a tampered record, :class:`PackedRecordError` for a malformed one."""
    path = Path(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"PAR1":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(str(path))
        names = pf.schema_arrow.names
        if sorted(names) != sorted(PACKED_FIELDS):
            raise PackedRecordError(f"{path}: not a packed Parquet export (columns {names})")
        for batch in pf.iter_batches(batch_size=64):
            for rec in batch.to_pylist():
                rec = _from_parquet(rec)
                yield check_record(rec) if check else rec
        return
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise PackedRecordError(f"{path}:{n}: not JSON ({exc})") from None
            try:
                yield check_record(rec) if check else rec
            except PackedDigestMismatch:
                raise
            except PackedRecordError as exc:
                raise PackedRecordError(f"{path}:{n}: {exc}") from None


def unpack_record(rec: dict) -> list[dict]:
    """Each member's path record from a packed record: ``member_id``, ``input_ids``,
    ``target_mask`` and per-position ``weights`` (1/L_i on its targets, 0 elsewhere) —
    what the path export (§7.3) holds for the same member."""
    spans, targets, weights, leaves = _arrays(rec)
    if not rec["input_ids"]:
        return [{"member_id": m["member_id"], "input_ids": [], "target_mask": [], "weights": []} for m in rec["members"]]
    p = tree_pack.Packed(
        input_ids=np.asarray(rec["input_ids"], dtype=np.uint32), position_ids=np.asarray(rec["position_ids"], dtype=np.int64),
        node_spans=spans, tin=np.asarray(rec["tin"], dtype=np.int64), tout=np.asarray(rec["tout"], dtype=np.int64),
        targets=targets, weights=weights, member_spans=np.asarray(leaves, dtype=np.int64),
        span_nodes=np.arange(spans.shape[0], dtype=np.int64))
    return [{"member_id": m["member_id"], "input_ids": u.input_ids.tolist(), "target_mask": u.target_mask.tolist(),
             "weights": u.weights.tolist()} for m, u in zip(rec["members"], tree_pack.unpack(p))]
