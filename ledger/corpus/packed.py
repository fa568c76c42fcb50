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
``{target_index, predecessor_index, weight}`` structs (int64, a null parent, float64; SPEC 11.5,
:mod:`ledger.corpus.formats`; files of earlier releases hold exact doubles) and the reader gives
back the JSON types, so a record has the same digest in both encodings.  A semantics-3 route's
records also carry the SPEC 11.5 fields (:func:`_add_extras`), from which :func:`member_records`
rebuilds each member's path record and digest.

:func:`read_packed` iterates a packed JSON-lines or Parquet file, refusing (with
:class:`PackedRecordError`, naming the execution) a record whose digest does not verify or
whose arrays are not the ones its spans imply; :func:`unpack_record` gives back the path
records' ``input_ids`` / ``target_mask`` / per-position weights of each member.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

import numpy as np

from ledger.algorithms import tree_pack
from ledger.algorithms.canonical import canonical_json
from ledger.corpus.path_records import (ExportSummary, dummy_record, evidence_of, exec_context, member_digest, node_lists,
                                        open_out, path_record, route_or_none, write_parquet_rows)
from ledger.corpus.formats import EXTRA_COLUMN, MEMBER_COLUMNS
from ledger.corpus.records import (PATH_EXTRAS, ROLE_CLASSES, DigestMismatch, MemberSet, RecordError, Where, check_logprobs,
                                   check_path_record, check_tokens, digest_with_lists, load_manifest_arg, parquet_file)
from ledger.projections.admission import member_id
from ledger.corpus.formats import schema_for

__all__ = ["PACKED_FIELDS", "PackedDigestMismatch", "PackedRecordError", "member_records", "packed_records", "read_packed",
           "unpack_record", "write_packed_jsonl", "write_packed_parquet"]

PACKED_FIELDS = ("execution_id", "input_ids", "position_ids", "node_spans", "tin", "tout", "targets", "members", "digest")


class PackedRecordError(RecordError):
    """A packed record that is malformed or inconsistent (names the execution or line)."""


class PackedDigestMismatch(DigestMismatch):
    """A packed record's digest does not match its content."""

    def __init__(self, execution_id: str, expected, actual: str, member_id: str | None = None) -> None:
        self.execution_id = execution_id
        what = "digest" if member_id is None else f"member {member_id}'s path record: digest"
        super().__init__(member_id, expected, actual, message=f"packed record of execution {execution_id}: {what} "
                                                              f"{expected} does not match its content (sha256 {actual})")


# ====================================================================== building


def _packed_record(route: str, ctx) -> dict:

    if ctx.state == "dummy":
        rec = {"execution_id": ctx.execution_id, "input_ids": [], "position_ids": [], "node_spans": [], "tin": [], "tout": [],
               "targets": [], "members": [{"member_id": member_id(route, ctx.execution_id, None, ctx.semantics),
                                                     "leaf_node_index": None}]}
        if ctx.semantics >= 3:
            _add_extras(rec, route, ctx, None, None)
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
    rec: dict = {
        "execution_id": ctx.execution_id,
        "input_ids": p.input_ids.tolist(),
        "position_ids": p.position_ids.tolist(),
        "node_spans": [[a, b, None if c < 0 else c] for a, b, c in spans],
        "tin": p.tin.tolist(),
        "tout": p.tout.tolist(),
        "targets": [[i, None if j < 0 else j, weight] for i, j in p.targets.tolist()],
        "members": [{"member_id": m, "leaf_node_index": int(s)} for m, s in zip(mids, p.member_spans.tolist())],
    }
    if ctx.semantics >= 3:  # SPEC 11.5, inside the packed digest (packed records of earlier routes keep §7.5's fields)
        _add_extras(rec, route, ctx, p, [r[0] for r in rows])
    rec["digest"] = member_digest(rec)
    return rec


def _member_entry(member: dict, path_record: dict) -> dict:
    """A member of a semantics-3 packed record: what its path record holds beyond the packed arrays
    (its digest, reward, leaf, role class and any further fields, e.g. its lineage)."""
    out = dict(member)
    out.update({k: v for k, v in path_record.items() if k not in _FROM_RECORD})
    return out


def _add_extras(rec: dict, route: str, ctx, p, leaf_requests: list[str] | None) -> None:
    """SPEC 11.5: the route, task, group and split; the behaviour log-prob of every packed token; the role
    class of every node span (that of the member whose targets lie on it: the first to cover it); and per
    member its path record's digest, reward, leaf and role class, so :func:`member_records` rebuilds the
    path records (and their digests) that the route's manifest publishes."""

    rec.update({"route": route, "task_id": ctx.task_id, "group_id": ctx.group_id, "split": ctx.split})
    if leaf_requests is None:  # a dummy
        rec.update(behavior_logprobs=[], role_class=[])
        rec["members"] = [_member_entry(rec["members"][0], dummy_record(route, ctx, rec["members"][0]["member_id"]))]
        return
    paths = [path_record(route, ctx, leaf) for leaf in leaf_requests]
    behavior: list = []
    for node in p.span_nodes.tolist():  # spans in packed order
        behavior += node_lists(ctx, node).behavior
    rec["behavior_logprobs"] = behavior
    rec["role_class"] = [paths[m]["role_class"] for m in _span_owners(p.node_spans, p.member_spans)]
    rec["members"] = [_member_entry(m, r) for m, r in zip(rec["members"], paths)]


def _span_owners(node_spans: np.ndarray, member_spans) -> list[int]:
    """Per span, the first member (in member order) whose path covers it."""
    owner = [-1] * int(np.asarray(node_spans).reshape(-1, 3).shape[0])
    for m, leaf in enumerate(np.asarray(member_spans).tolist()):
        for v in tree_pack.path_spans(node_spans, leaf):
            if owner[v] < 0:
                owner[v] = m
    return owner


def packed_records(db: sqlite3.Connection, route: str, *, evidence=None) -> Iterator[dict]:
    """The route's packed records (SPEC §7.5), one per admitted or dummy execution in
    ``execution_id`` order, one execution loaded at a time."""
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
            yield _packed_record(route, exec_context(db, route, ex, evidence, r))


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
    fh, close = open_out(out)
    try:
        for rec in records:
            fh.write(canonical_json(rec).decode("utf-8"))
            fh.write("\n")
            _summarise(summary, rec)
    finally:
        if close:
            fh.close()
    return summary


def _arrow_schema(first: dict | None = None):
    """SPEC 11.5: the logical schema of packed records (:mod:`ledger.corpus.formats`)."""

    return schema_for("packed", first)


def _parquet_row(rec: dict) -> dict:
    """A packed record as its Parquet row: ``targets`` as ``{target_index, predecessor_index, weight}``
    structs (integers, null parents); a member's fields without a column as JSON in its ``fields``."""
    return {**rec, "targets": [{"target_index": t, "predecessor_index": q, "weight": w} for t, q, w in rec["targets"]],
            "members": [_member_row(m) for m in rec["members"]]}


def _member_row(m: dict) -> dict:
    extra = {k: v for k, v in m.items() if k not in MEMBER_COLUMNS}
    return {**m, EXTRA_COLUMN: canonical_json(extra).decode("utf-8")} if extra else m


def write_packed_parquet(records, path: str | Path, *, row_group_tokens: int = 1 << 20, row_group_rows: int = 256) -> ExportSummary:
    """Parquet with the packed record's columns, written in row groups while streaming."""
    summary = ExportSummary()
    write_parquet_rows(records, path, _arrow_schema, lambda rec: _summarise(summary, rec),
                       row_group_tokens=row_group_tokens, row_group_rows=row_group_rows, to_row=_parquet_row)
    return summary


# ====================================================================== reader


def _from_parquet(rec: dict) -> dict:
    """The JSON record back from its Parquet row: ``targets`` from ``{target_index, predecessor_index,
    weight}`` structs (this release) or from the exact doubles of earlier files; a member's ``fields``
    merged back.  Types are checked afterwards, as for a JSON line (:func:`check_record`)."""
    out = dict(rec)
    out["members"] = [_member_from_row(m) for m in rec["members"]] if isinstance(rec["members"], list) else rec["members"]
    targets = rec["targets"] or []
    if targets and _kinds(targets, (dict,)):
        out["targets"] = list(map(list, map(dict.values, targets)))  # C-level maps, not a Python step per target
    elif targets and not _kinds(targets, (list,)):
        raise PackedRecordError("targets must be [target, predecessor, weight] triples")
    else:
        out["targets"] = _legacy_targets(targets) if targets else []
    return out


def _member_from_row(m):
    if not isinstance(m, dict) or EXTRA_COLUMN not in m:
        return m
    m = dict(m)
    extra = m.pop(EXTRA_COLUMN)
    try:
        m.update(json.loads(extra) if extra is not None else {})
    except (TypeError, ValueError):
        raise PackedRecordError(f"a member's {EXTRA_COLUMN!r} is not a JSON object") from None
    return m


def _legacy_targets(targets: list) -> list:
    """Targets of a packed Parquet file of an earlier release: triples of doubles (indices exact below
    2^53, a null predecessor NaN), converted by columns: numpy checks every index is an integer."""
    if set(map(len, targets)) != {3}:
        raise PackedRecordError("targets must be [target, predecessor, weight] triples")
    t, p, w = zip(*targets)
    cols = np.array([t, p], dtype=np.float64)  # a null predecessor becomes NaN
    none = np.isnan(cols[1])
    ints = cols.copy()
    ints[1, none] = -1
    if np.isnan(ints).any() or not np.array_equal(ints, np.floor(ints)) or np.abs(ints).max() >= 2.0 ** 53:
        raise PackedRecordError("a target index is not an integer")
    tt, pp = ints.astype(np.int64).tolist()
    for i in np.flatnonzero(none).tolist():  # only a target opening a path has no predecessor
        pp[i] = None
    return list(map(list, zip(tt, pp, w)))


def _arrays(rec: dict):
    """numpy views of a record's arrays (after the field and type checks)."""
    spans = np.array([[a, b, -1 if c is None else c] for a, b, c in rec["node_spans"]], dtype=np.int64).reshape(-1, 3)
    targets, weights = _target_columns(rec["targets"])
    leaves = [m["leaf_node_index"] for m in rec["members"]]
    return spans, targets, weights, leaves


def _target_columns(targets: list) -> tuple[np.ndarray, np.ndarray]:
    """``[[t, p|null, w]...]`` as a ``[T, 2]`` int64 array (``-1`` for a null predecessor) and the
    weights, by columns (C-level ``zip``, one numpy conversion each), not a Python step per target."""
    if not targets:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.float64)
    t, p, w = zip(*targets)
    if None in p:
        p = [-1 if x is None else x for x in p]  # only a target opening a path has none
    return np.column_stack((np.array(t, dtype=np.int64), np.array(p, dtype=np.int64))), np.array(w, dtype=np.float64)


def _kinds(values, allowed: tuple[type, ...]) -> bool:
    return set(map(type, values)) <= set(allowed)


_PACKED_LISTS = ("input_ids", "position_ids", "tin", "tout")
# SPEC 11.5: what packed records may carry beyond §7.5, checked when present
PACKED_EXTRAS = ("route", "task_id", "group_id", "split", "behavior_logprobs", "role_class")
MEMBER_FIELDS = {"member_id", "leaf_node_index"}
MEMBER_EXTRAS = {"digest", "reward", "leaf_request_id", "role_class"} | set(PATH_EXTRAS)
# a path record's fields a semantics-3 packed record gives itself (the rest are in its member entry)
_FROM_RECORD = frozenset(("member_id", "execution_id", "task_id", "group_id", "split", "route", "input_ids", "target_mask",
                          "behavior_logprobs", "loss_weight", "execution_target_tokens", "dummy"))


def _check_shape(rec: dict, parts: dict[str, bytes]) -> None:
    """Field names and JSON types (so a malformed record fails with a sentence, not a traceback);
    the integer lists are checked on their canonical bytes (:mod:`ledger.corpus.records`)."""
    ex = rec["execution_id"]
    w = Where(f"execution {ex}", None, PackedRecordError)
    for name in _PACKED_LISTS:
        check_tokens(w, name, rec[name], parts[name])
    spans = rec["node_spans"]
    if type(spans) is not list or not all(type(s) is list and len(s) == 3 and _kinds(s[:2], (int,)) and s[0] >= 0
                                           and s[1] >= 0 and (s[2] is None or (type(s[2]) is int and s[2] >= 0))
                                           for s in spans):
        raise PackedRecordError(f"execution {ex}: node_spans must be [start, end, parent] triples of non-negative integers")
    _check_targets(ex, rec["targets"])
    members = rec["members"]
    if type(members) is not list or not all(
            isinstance(m, dict) and MEMBER_FIELDS <= set(m) <= MEMBER_FIELDS | MEMBER_EXTRAS
            and isinstance(m["member_id"], str) for m in members):
        raise PackedRecordError(f"execution {ex}: members must be [{{member_id, leaf_node_index}}]")
    if not all(m["leaf_node_index"] is None or (type(m["leaf_node_index"]) is int and m["leaf_node_index"] >= 0)
               for m in members):
        raise PackedRecordError(f"execution {ex}: members' leaf_node_index must be a list of non-negative integers")
    if not all(isinstance(m.get("digest", ""), str) and _reward_ok(m.get("reward")) for m in members):
        raise PackedRecordError(f"execution {ex}: a member's digest must be a string, its reward a finite number or null")


def _reward_ok(x) -> bool:
    return x is None or (type(x) in (int, float) and np.isfinite(x))


def _check_targets(ex: str, targets) -> None:
    """``[[target, predecessor|null, weight]...]``: non-negative integer indices, every weight
    the same 1/L_i in (0, 1] (L_i = the number of targets: each admitted target once); types by
    C-level ``map``, values by numpy."""
    if type(targets) is not list or not _kinds(targets, (list,)) or (targets and set(map(len, targets)) != {3}):
        raise PackedRecordError(f"execution {ex}: targets must be [target, predecessor, weight] triples")
    if not targets:
        return
    t, p, w = zip(*targets)
    if not _kinds(t, (int,)) or not _kinds(p, (int, type(None))) or \
            not _non_negative(t) or not _non_negative(p if None not in p else [x for x in p if x is not None]):
        raise PackedRecordError(f"execution {ex}: targets must be a list of non-negative integers")
    weights = np.array(w, dtype=np.float64) if _kinds(w, (int, float)) else None
    ok = None if weights is None else (weights > 0) & (weights <= 1)  # NaN fails both comparisons
    if ok is None or not ok.all():
        bad = next(x for x in w if type(x) not in (int, float)) if ok is None else w[int(np.flatnonzero(~ok)[0])]
        raise PackedRecordError(f"execution {ex}: target weight {bad!r} is not in (0, 1]")
    if not (weights == 1.0 / len(targets)).all():
        raise PackedRecordError(f"execution {ex}: target weights {sorted(set(w))[:3]} are not 1/L_i = 1/{len(targets)}")


def _non_negative(ints) -> bool:
    """Python ints all in [0, 2^63) (numpy's range check; a larger one does not fit int64)."""
    try:
        a = np.fromiter(ints, dtype=np.int64)
    except OverflowError:
        return False
    return not a.size or int(a.min()) >= 0


def _check_extras(rec: dict, parts: dict[str, bytes]) -> None:
    """SPEC 11.5 fields of a packed record, when present: behaviour log-probs per packed token,
    the split, a role class per node span."""
    ex = rec["execution_id"]
    if "behavior_logprobs" in rec:
        check_logprobs(Where(f"execution {ex}", None, PackedRecordError), "behavior_logprobs", rec["behavior_logprobs"],
                       parts["behavior_logprobs"], len(rec["input_ids"]))
    if "split" in rec and not (rec["split"] is None or isinstance(rec["split"], str)):
        raise PackedRecordError(f"execution {ex}: split must be a string or null")
    if "role_class" in rec and (type(rec["role_class"]) is not list or len(rec["role_class"]) != len(rec["node_spans"])
                                or not all(c is None or c in ROLE_CLASSES for c in rec["role_class"])):
        raise PackedRecordError(f"execution {ex}: role_class must hold one role class per node span")
    present = [k for k in PACKED_EXTRAS if k in rec]
    if not present:
        return
    if len(present) != len(PACKED_EXTRAS) or not all(_MEMBER_CORE <= set(m) for m in rec["members"]):
        raise PackedRecordError(f"execution {ex}: a packed record with any of {list(PACKED_EXTRAS)} has all of them, "
                                f"and each member its {sorted(_MEMBER_CORE)}")
    if not isinstance(rec["route"], str) or not all(rec[k] is None or isinstance(rec[k], str)
                                                    for k in ("task_id", "group_id")):
        raise PackedRecordError(f"execution {ex}: route must be a string, task_id and group_id strings or null")


_MEMBER_CORE = {"digest", "reward", "leaf_request_id", "role_class"}


def _check_members(rec: dict) -> None:
    """A semantics-3 packed record (SPEC 11.5): each member's path record, rebuilt from the packed
    arrays and its member entry, passes the path-record rules and hashes to the digest the member
    carries (which the route's manifest publishes: :func:`read_packed` with ``manifest``)."""
    ex = rec["execution_id"]
    for path in member_records(rec):
        where = f"execution {ex}: member {path['member_id']}"
        try:
            check_path_record(path, where)
        except DigestMismatch as exc:
            raise PackedDigestMismatch(ex, path["digest"], exc.actual, member_id=path["member_id"]) from None
        except RecordError as exc:
            raise PackedRecordError(str(exc)) from None


def member_records(rec: dict) -> list[dict]:
    """Each member's path record (SPEC §7.3, with its ``digest``) rebuilt from a semantics-3 packed
    record (SPEC 11.5): what the path export holds for the same member, so a packed file is checked
    against the member digests of the route's signed manifest."""
    if "route" not in rec:
        raise PackedRecordError(f"execution {rec.get('execution_id')}: a packed record of a semantics 1-2 route carries "
                                "no member records (export the path records)")
    base = {k: rec[k] for k in ("execution_id", "task_id", "group_id", "split", "route")}
    n_targets = len(rec["targets"])
    if not rec["input_ids"]:
        return [{**base, **_member_fields(m), "input_ids": [], "target_mask": [], "behavior_logprobs": [],
                 "loss_weight": 0.0, "execution_target_tokens": 0, "dummy": True} for m in rec["members"]]
    behavior = np.array(rec["behavior_logprobs"], dtype=object)
    weight = 1.0 / n_targets if n_targets else 0.0
    return [{**base, **_member_fields(m), "input_ids": u.input_ids.tolist(), "target_mask": u.target_mask.tolist(),
             "behavior_logprobs": behavior[u.indices].tolist(), "loss_weight": weight,
             "execution_target_tokens": n_targets, "dummy": False}
            for m, u in zip(rec["members"], tree_pack.unpack(_packed(rec)))]


def _member_fields(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "leaf_node_index"}


def check_record(rec: dict, *, members: bool = True) -> dict:
    """Verify one packed record: fields, digest, then structure (SPEC §7.5); with ``members``, a
    semantics-3 record's members too (:func:`member_records` hash to the digests they carry)."""
    if not isinstance(rec, dict):
        raise PackedRecordError("not a JSON object")
    if not set(PACKED_FIELDS) <= set(rec) <= set(PACKED_FIELDS) | set(PACKED_EXTRAS):
        missing = [f for f in PACKED_FIELDS if f not in rec]
        extra = sorted(set(rec) - set(PACKED_FIELDS) - set(PACKED_EXTRAS))
        raise PackedRecordError(f"not a packed record (missing {missing or 'nothing'}, unexpected {extra or 'nothing'})")
    if not isinstance(rec["execution_id"], str) or not isinstance(rec["digest"], str):
        raise PackedRecordError("execution_id and digest must be strings")
    actual, parts = digest_with_lists(rec, _PACKED_LISTS + ("behavior_logprobs",))
    if rec["digest"] != actual:
        raise PackedDigestMismatch(rec["execution_id"], rec["digest"], actual)
    _check_shape(rec, parts)
    _check_extras(rec, parts)
    spans, targets, _weights, leaves = _arrays(rec)
    dummy = not rec["input_ids"] and all(x is None for x in leaves)
    if not dummy:
        if any(x is None for x in leaves):
            raise PackedRecordError(f"execution {rec['execution_id']}: a member of a non-empty record has no leaf_node_index")
        try:
            tree_pack.check(len(rec["input_ids"]), rec["position_ids"], spans, rec["tin"], rec["tout"], targets, leaves)
        except ValueError as exc:
            raise PackedRecordError(f"execution {rec['execution_id']}: {exc}") from None
    elif len(rec["members"]) != 1 or rec["node_spans"] or rec["targets"] or rec["position_ids"]:
        raise PackedRecordError(f"execution {rec['execution_id']}: a dummy's record is empty and has one member")
    if members and "route" in rec:
        _check_members(rec)
    return rec


def read_packed(path: str | Path, *, check: bool = True, manifest: str | Path | Mapping[str, Any] | None = None,
                verify_members: bool | None = None) -> Iterator[dict]:
    """Iterate the records of a packed JSON-lines or Parquet export, verifying each (digest
    and structure, :func:`check_record`), and that no execution or member appears twice.
    Raises :class:`PackedDigestMismatch` (naming the execution) for a tampered record,
    :class:`PackedRecordError` for a malformed one.

    ``manifest`` (a manifest document or its file): the records' members must be exactly its
    members (a :class:`~ledger.corpus.records.MemberSetMismatch` names a duplicated, missing
    or extra one); a member that carries its path record's ``digest`` must carry the
    manifest's.  ``verify_members`` (default: when ``manifest`` is given) rebuilds the path records
    of a semantics-3 record's members and checks they hash to those digests (about the cost of
    reading the path export: only worth it against a manifest, which anchors the digests)."""
    if verify_members is None:
        verify_members = manifest is not None
    members = MemberSet(None if manifest is None else load_manifest_arg(manifest))
    executions: dict[str, str] = {}
    for where, rec in _raw_packed(Path(path)):
        if not check:
            yield rec
            continue
        try:
            check_record(rec, members=False)
        except PackedDigestMismatch:
            raise
        except PackedRecordError as exc:
            raise PackedRecordError(f"{where}: {exc}") from None
        ex = rec["execution_id"]
        if ex in executions:
            raise PackedRecordError(f"{where}: execution {ex} has a second record (first at {executions[ex]})")
        executions[ex] = where
        for m in rec["members"]:
            members.add(m["member_id"], m.get("digest"), where)
        if verify_members and "route" in rec:  # after the member set: an extra member is named as such
            _check_members(rec)
        yield rec
    if check:
        members.finish()


def _raw_packed(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"PAR1":
        pf = parquet_file(path, PackedRecordError)
        names = pf.schema_arrow.names
        if not set(PACKED_FIELDS) <= set(names) <= set(PACKED_FIELDS) | set(PACKED_EXTRAS):
            raise PackedRecordError(f"{path}: not a packed Parquet export (columns {names})")
        row = 0
        for batch in pf.iter_batches(batch_size=64):
            for rec in batch.to_pylist():
                row += 1
                try:
                    yield f"{path} row {row}", _from_parquet(rec)
                except PackedRecordError as exc:
                    raise PackedRecordError(f"{path} row {row}: {exc}") from None
        return
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise PackedRecordError(f"{path}:{n}: not JSON ({exc})") from None
            yield f"{path}:{n}", rec


def unpack_record(rec: dict) -> list[dict]:
    """Each member's path record from a packed record: ``member_id``, ``input_ids``,
    ``target_mask`` and per-position ``weights`` (1/L_i on its targets, 0 elsewhere) —
    what the path export (§7.3) holds for the same member."""
    if not rec["input_ids"]:
        return [{"member_id": m["member_id"], "input_ids": [], "target_mask": [], "weights": []} for m in rec["members"]]
    return [{"member_id": m["member_id"], "input_ids": u.input_ids.tolist(), "target_mask": u.target_mask.tolist(),
             "weights": u.weights.tolist()} for m, u in zip(rec["members"], tree_pack.unpack(_packed(rec)))]


def _packed(rec: dict) -> tree_pack.Packed:
    spans, targets, weights, leaves = _arrays(rec)
    return tree_pack.Packed(
        input_ids=np.asarray(rec["input_ids"], dtype=np.uint32), position_ids=np.asarray(rec["position_ids"], dtype=np.int64),
        node_spans=spans, tin=np.asarray(rec["tin"], dtype=np.int64), tout=np.asarray(rec["tout"], dtype=np.int64),
        targets=targets, weights=weights, member_spans=np.asarray(leaves, dtype=np.int64),
        span_nodes=np.arange(spans.shape[0], dtype=np.int64))
