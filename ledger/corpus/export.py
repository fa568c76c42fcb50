"""Trainer export (SPEC §7.3), member digests (§6.6) and route accounting (§6.7).

One **trainer record** per manifest member: every drawn path of an admitted execution, plus
one dummy entry per zero-reward dummy.  The record holds exactly the contract fields::

    member_id, execution_id, task_id, group_id, split, route, leaf_request_id, role_class,
    input_ids, target_mask, behavior_logprobs, loss_weight, execution_target_tokens,
    reward, dummy, digest

``digest`` is SHA-256 (hex) of the canonical JSON (:func:`ledger.algorithms.canonical.canonical_json`)
of the record without ``digest``.  Numbers keep one JSON type each so a record survives a
round trip through JSON or Parquet with the same digest: ``reward``, ``loss_weight`` and
``behavior_logprobs`` are floats (log-probs are the recorded float32 values widened
exactly), everything else integers.  No field depends on the log position.

Records stream in ``member_id`` byte order (SQLite sorts the member ids; trees are loaded
one execution at a time), so memory is bounded by the largest execution, not the route.

Writers: :func:`write_jsonl` (one canonical JSON record per line), :func:`write_parquet`
(pyarrow, same column names, written in row groups while streaming) and :func:`write_tree`
(one JSON line per execution with its admitted subtree stored once: per-token target flags,
weights and behaviour log-probs, per node the draw that owns its targets, and per leaf the
member id and digest — :func:`read_records` rebuilds the path records from it and checks
their digests).  :func:`read_records` reads any of the three and raises
:class:`DigestMismatch` naming the member whose digest does not verify.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

import numpy as np

from ledger.algorithms.canonical import canonical_json, canonical_str, json_digest
from ledger.algorithms.errors import InputError
from ledger.algorithms.identifiers import key_component
from ledger.corpus.accounting import accounting, accounting_all  # SPEC §6.7 (re-exported: the import path of callers)
from ledger.corpus.formats import EXTRA_COLUMN
from ledger.corpus.packed import packed_records, write_packed_jsonl, write_packed_parquet
from ledger.corpus.path_records import (ExecContext, ExportSummary, behavior_of, dummy_record, evidence_of, exec_context,
                                        member_digest, open_out, path_record, route_members, route_or_none, write_jsonl,
                                        write_parquet)
from ledger.corpus.preference_export import PAIR_FIELDS, export_pairs, is_pair_route, preference_records
from ledger.corpus.records import (PATH_FIELDS, DigestMismatch, ReadError, RecordChecks, RecordError,
                                   check_tree_doc, parquet_file)
from ledger.projections.preference import preference_route
from ledger.projections.admission import member_id

__all__ = [
    "RECORD_FIELDS",
    "DigestMismatch",
    "ReadError",
    "RecordError",
    "ExportSummary",
    "accounting",
    "member_digest",
    "read_records",
    "trainer_records",
    "tree_lines",
    "write_jsonl",
    "write_parquet",
    "write_tree",
    "execution_records",
    "export",
]

RECORD_FIELDS = PATH_FIELDS  # SPEC §7.3 (ledger.corpus.records states each field's rules)


def trainer_records(db: sqlite3.Connection, route: str, *, evidence=None) -> Iterator[dict]:
    """The route's trainer records (SPEC §7.3) in ``member_id`` order, one execution loaded at a time."""
    evidence = evidence_of(evidence)
    r = route_or_none(db, route)

    if preference_route(r):  # SPEC §6.9: a preference route's members are pairs

        yield from preference_records(db, route, evidence=evidence)
        return
    ctx: ExecContext | None = None
    for mid, ex, leaf in route_members(db, route, r.semantics if r is not None else 2):
        if ctx is None or ctx.execution_id != ex:
            ctx = exec_context(db, route, ex, evidence, r)
        if leaf is None:
            yield dummy_record(route, ctx, mid)
        else:
            yield path_record(route, ctx, leaf)


def execution_records(db: sqlite3.Connection, route: str, execution_id: str, *, evidence=None) -> list[dict]:
    """The trainer records of one admitted execution of a path route (its drawn paths, or its dummy entry) in
    ``member_id`` order: exactly the records :func:`trainer_records` gives for it (the online feed, SPEC 11.6).
    Empty when the execution is not admitted on the route now."""

    row = db.execute("SELECT state FROM admission WHERE route = ? AND execution_id = ?", (route, execution_id)).fetchone()
    if row is None or row[0] not in ("admitted", "dummy"):
        return []
    ctx = exec_context(db, route, execution_id, evidence_of(evidence), route_or_none(db, route))
    if row[0] == "dummy":
        return [dummy_record(route, ctx, member_id(route, execution_id, None, ctx.semantics))]
    return [path_record(route, ctx, leaf) for leaf in sorted(ctx.paths, key=lambda k: ctx.paths[k][2].encode("utf-8"))]



# ====================================================================== summaries / accounting


def tree_lines(db: sqlite3.Connection, route: str, *, evidence=None) -> Iterator[dict]:
    """One document per admitted or dummy execution: its admitted subtree, each node once."""
    evidence = evidence_of(evidence)
    r = route_or_none(db, route)
    cur = db.cursor()
    cur.execute("SELECT execution_id FROM admission WHERE route = ? AND state IN ('admitted', 'dummy') ORDER BY execution_id",
                (route,))
    while True:
        batch = cur.fetchmany(256)
        if not batch:
            return
        for (ex,) in batch:
            ctx = exec_context(db, route, ex, evidence, r)
            yield _tree_doc(route, ctx)


def _tree_doc(route: str, ctx: ExecContext) -> dict:

    doc = {"execution_id": ctx.execution_id, "task_id": ctx.task_id, "group_id": ctx.group_id, "split": ctx.split,
           "route": route, "dummy": ctx.state == "dummy", "execution_target_tokens": ctx.target_tokens if ctx.state != "dummy" else 0,
           "loss_weight": (1.0 / ctx.target_tokens) if ctx.state != "dummy" and ctx.target_tokens else 0.0,
           "nodes": [], "leaves": []}
    if ctx.state == "dummy":
        d = dummy_record(route, ctx, member_id(route, ctx.execution_id, None, ctx.semantics))
        doc["reward"] = 0.0
        doc["leaves"].append({"member_id": d["member_id"], "leaf_request_id": None, "node_id": None, "draw_index": None,
                              "role_class": None, "reward": 0.0, "digest": d["digest"], **_leaf_fields(d)})
        return doc
    doc["reward"] = None if ctx.reward is None else float(ctx.reward)
    t = ctx.loaded
    owner: dict[int, int] = {}  # node -> draw index that first covers it
    targets: dict[int, np.ndarray] = {}
    rows = sorted(ctx.paths.values(), key=lambda r: r[1])
    for leaf_req, draw_index, mid, role_class, path_tokens, n_targets, reward, packed in rows:
        nodes = t.path_nodes(t.requests[leaf_req].node_id)
        pos = np.frombuffer(packed, dtype="<u4").astype(np.int64)
        off = 0
        for n in nodes:
            length = t.nodes[n].tokens.shape[0]
            if n not in owner:
                owner[n] = draw_index
                sel = pos[(pos >= off) & (pos < off + length)] - off
                flags = np.zeros(length, dtype=np.uint8)
                flags[sel] = 1
                targets[n] = flags
            off += length
    w = doc["loss_weight"]
    for n in sorted(owner):
        node = t.nodes[n]
        flags = targets[n]
        doc["nodes"].append({
            "node_id": n, "parent": node.parent, "draw": owner[n], "tokens": node.tokens.tolist(), "target": flags.tolist(),
            "weight": [w if f else 0.0 for f in flags.tolist()],
            "behavior_logprobs": behavior_of(t, ctx.policy_nodes, [n]),
        })
    for leaf_req, draw_index, mid, role_class, path_tokens, n_targets, reward, packed in rows:
        rec = path_record(route, ctx, leaf_req)
        doc["leaves"].append({"member_id": mid, "leaf_request_id": leaf_req, "node_id": t.requests[leaf_req].node_id,
                              "draw_index": draw_index, "role_class": role_class,
                              "reward": None if reward is None else float(reward), "digest": rec["digest"],
                              **_leaf_fields(rec)})
    return doc


_RECORD_KEYS = frozenset(RECORD_FIELDS)


def _leaf_fields(rec: dict) -> dict:
    """A tree-format leaf's ``fields``: what its record carries beyond SPEC §7.3 (absent when nothing)."""
    extra = {k: v for k, v in rec.items() if k not in _RECORD_KEYS}
    return {"fields": extra} if extra else {}


def write_tree(db: sqlite3.Connection, route: str, out: str | Path | IO[str], *, evidence=None) -> ExportSummary:
    """JSON lines, one execution per line, each admitted subtree stored once."""
    summary = ExportSummary()
    fh, close = open_out(out)
    try:
        for doc in tree_lines(db, route, evidence=evidence):
            fh.write(canonical_json(doc).decode("utf-8"))
            fh.write("\n")
            summary.executions += 1
            summary.tree_tokens += sum(len(n["tokens"]) for n in doc["nodes"])
            for rec in records_from_tree_doc(doc, verify=False):
                summary.add(rec)
    finally:
        if close:
            fh.close()
    return summary


def records_from_tree_doc(doc: dict, *, verify: bool = True) -> Iterator[dict]:
    """Rebuild the path records of one tree-format line (and check their digests)."""
    nodes = {n["node_id"]: n for n in doc["nodes"]}
    for leaf in sorted(doc["leaves"], key=lambda lf: lf["member_id"]):
        if doc["dummy"]:
            rec = {"member_id": leaf["member_id"], "execution_id": doc["execution_id"], "task_id": doc["task_id"],
                   "group_id": doc["group_id"], "split": doc["split"], "route": doc["route"], "leaf_request_id": None,
                   "role_class": None, "input_ids": [], "target_mask": [], "behavior_logprobs": [], "loss_weight": 0.0,
                   "execution_target_tokens": 0, "reward": 0.0, "dummy": True}
        else:
            chain = []
            cur = leaf["node_id"]
            while cur is not None:
                chain.append(nodes[cur])
                cur = nodes[cur]["parent"]
            chain.reverse()
            ids: list = []
            mask: list = []
            behavior: list = []
            for n in chain:  # list extends, not a Python step per token
                ids += n["tokens"]
                mask += n["target"] if n["draw"] == leaf["draw_index"] else [0] * len(n["target"])
                behavior += n["behavior_logprobs"]
            rec = {"member_id": leaf["member_id"], "execution_id": doc["execution_id"], "task_id": doc["task_id"],
                   "group_id": doc["group_id"], "split": doc["split"], "route": doc["route"],
                   "leaf_request_id": leaf["leaf_request_id"], "role_class": leaf["role_class"],
                   "input_ids": ids, "target_mask": mask, "behavior_logprobs": behavior,
                   "loss_weight": doc["loss_weight"], "execution_target_tokens": doc["execution_target_tokens"],
                   "reward": leaf["reward"], "dummy": False}
        if isinstance(leaf.get("fields"), dict):
            rec.update({k: v for k, v in leaf["fields"].items() if k not in _RECORD_KEYS})
        rec["digest"] = leaf["digest"]
        if verify:
            _check(rec)
        yield rec


# ====================================================================== reader


def _check(rec: dict) -> dict:
    actual = member_digest(rec)
    if rec.get("digest") != actual:
        raise DigestMismatch(str(rec.get("member_id")), rec.get("digest"), actual)
    return rec


def read_records(path: str | Path, *, manifest: str | Path | Mapping[str, Any] | None = None) -> Iterator[dict]:
    """Iterate the records of a JSON-lines, Parquet or tree export (path or preference-pair
    records), checking each (:mod:`ledger.corpus.records`): its digest, its structure, that no
    member appears twice and that the records of an execution agree on ``L_i``.

    ``manifest`` (a manifest document or its file): the records must be exactly its members,
    each with the digest it publishes (its signature is not checked here: ``ledger manifest
    verify`` does that).  Raises :class:`DigestMismatch` (naming the member; a
    :class:`~ledger.corpus.records.MemberSetMismatch` for a duplicated, missing or extra member)
    or :class:`~ledger.corpus.records.RecordError` (naming file, line and member) at the first
    record that fails, and a missing member at the end of the input.
    """
    checks = RecordChecks(manifest)
    for where, rec in _raw_records(Path(path)):
        yield checks.record(rec, where)
    checks.finish()


def _raw_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of a Parquet, JSON-lines or tree-format file, not yet checked."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ReadError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic == b"PAR1":
        yield from _parquet_records(path)
        return
    n = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    doc = json.loads(line)
                except ValueError as exc:
                    raise RecordError(f"{where}: not JSON ({exc})") from None
                if isinstance(doc, dict) and "nodes" in doc and "leaves" in doc:
                    check_tree_doc(doc, where)
                    for rec in records_from_tree_doc(doc, verify=False):
                        yield where, rec
                else:
                    yield where, doc
    except UnicodeDecodeError:
        raise RecordError(f"{path}:{n + 1}: not UTF-8 text") from None


_LINEAGE_COLUMNS = ("lineage", "rejected_lineage")


def _parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    pf = parquet_file(path)
    fields, floats = RECORD_FIELDS, ("behavior_logprobs",)
    names = pf.schema_arrow.names
    if "chosen_ids" in names:  # a preference route's pairs (SPEC §6.9)

        fields, floats = PAIR_FIELDS, ("chosen_logprobs", "rejected_logprobs")
        if "chosen_mask" in names:  # semantics 3+ pairs (SPEC 11.5)
            fields = fields + ("chosen_mask", "rejected_mask")
    fields = fields + tuple(k for k in _LINEAGE_COLUMNS if k in names)  # semantics 3 (SPEC 11.2), a struct column
    missing = [k for k in fields if k not in names]
    if missing:
        raise RecordError(f"{path}: not a trainer-record Parquet export (missing columns {missing})")
    row = 0
    for batch in pf.iter_batches(batch_size=256):
        for rec in batch.to_pylist():
            row += 1
            extra = rec.get(EXTRA_COLUMN)
            out = {k: rec[k] for k in fields}
            if extra:
                try:
                    out.update({k: v for k, v in json.loads(extra).items() if k not in out})
                except (ValueError, AttributeError):
                    raise RecordError(f"{path} row {row}: column {EXTRA_COLUMN!r} is not a JSON object") from None
            for k in floats:
                out[k] = [None if x is None else float(x) for x in out[k]] if isinstance(out[k], list) else out[k]
            yield f"{path} row {row}", out


# ====================================================================== one call


def export(db: sqlite3.Connection, route: str, out: str | Path, fmt: str = "jsonl", *, evidence=None) -> dict:
    """``ledger export ROUTE --out FILE --format jsonl|parquet|tree|packed|packed-parquet``; returns the summary
    (records, dummies, executions, processed tokens for this format and the other, target
    tokens, by role class) merged with the route accounting.  A preference route exports its
    pairs (:func:`ledger.corpus.preference_export.export_pairs`, jsonl or parquet)."""

    if is_pair_route(db, route):
        return export_pairs(db, route, out, fmt, evidence=evidence)
    if fmt == "jsonl":
        s = write_jsonl(trainer_records(db, route, evidence=evidence), out)
    elif fmt == "parquet":
        s = write_parquet(trainer_records(db, route, evidence=evidence), out)
    elif fmt == "tree":
        s = write_tree(db, route, out, evidence=evidence)
    elif fmt in ("packed", "packed-parquet"):  # SPEC §7.5 (ledger.corpus.packed)

        write = write_packed_jsonl if fmt == "packed" else write_packed_parquet
        s = write(packed_records(db, route, evidence=evidence), out)
    else:
        raise InputError(f"unknown export format {fmt!r} (jsonl, parquet, tree, packed, packed-parquet)")
    acc = accounting(db, route)
    out_json = s.to_json()
    out_json["processed_tokens"] = dict(acc["processed_tokens"])
    if fmt.startswith("packed"):
        out_json["processed_tokens"]["packed"] = s.tree_tokens  # = the tree export's: each admitted node once
    out_json["format"] = fmt
    out_json["stored_tokens"] = acc["stored_tokens"]
    return out_json

