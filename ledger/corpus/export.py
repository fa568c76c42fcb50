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

import hashlib
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

import numpy as np

from ledger.algorithms.canonical import canonical_json, canonical_str, json_digest
from ledger.algorithms.errors import InputError
from ledger.algorithms.identifiers import key_component
from ledger.corpus.accounting import accounting, accounting_all  # SPEC §6.7 (re-exported: the import path of callers)
from ledger.corpus.formats import EXTRA_COLUMN
from ledger.corpus.records import (PATH_FIELDS, DigestMismatch, ReadError, RecordChecks, RecordError,
                                   check_tree_doc, parquet_file)

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


def member_digest(record: dict) -> str:
    """SHA-256 hex of the canonical JSON of ``record`` without ``digest`` (SPEC §6.6)."""
    return json_digest({k: v for k, v in record.items() if k != "digest"})


# ====================================================================== reading the projection


def _evidence(evidence):
    if evidence is not None:
        return evidence
    from ledger.projections.admission import Evidence

    return Evidence.discover()


@dataclass
class _ExecContext:
    """Everything the records of one execution share (loaded once per execution)."""

    execution_id: str
    task_id: str | None
    group_id: str | None
    split: str | None
    state: str
    reward: float | None
    target_tokens: int
    loaded: Any = None  # ledger.projections.tree.LoadedTree
    paths: dict | None = None  # leaf request id -> row
    policy_nodes: np.ndarray | None = None  # per node: outputs are policy outputs
    semantics: int = 2  # the route's semantics version (SPEC §10): how its member ids are formed
    node_lists: dict | None = None  # node -> its _NodeParts, built once per execution
    lineage: Any = None  # semantics 3: ledger.corpus.member_lineage.ExecutionLineage (SPEC 11.2)
    fields: dict | None = None  # extra record fields every member of the execution carries (recovery segments)


class _NodeParts:
    """Node ``n``'s tokens and behaviour log-probs as Python lists and as canonical-JSON list
    bodies (no brackets), converted once per execution: its paths share their prefix nodes
    (issue 19; equal to converting each path's concatenation, tests/test_perf_paths.py)."""

    __slots__ = ("tokens", "behavior", "tokens_json", "behavior_json")

    def __init__(self, tokens: list, behavior: list) -> None:
        self.tokens, self.behavior = tokens, behavior
        self.tokens_json = canonical_str(tokens)[1:-1]
        self.behavior_json = canonical_str(behavior)[1:-1]


def _node_lists(ctx: _ExecContext, n: int) -> _NodeParts:
    cache = ctx.node_lists
    if cache is None:
        cache = ctx.node_lists = {}
    got = cache.get(n)
    if got is None:
        got = cache[n] = _NodeParts(ctx.loaded.nodes[n].tokens.tolist(), _behavior(ctx.loaded, ctx.policy_nodes, [n]))
    return got


def _mask_json(mask: np.ndarray) -> str:
    """canonical JSON body of a 0/1 uint8 array (``0,1,...``), written by numpy."""
    if mask.shape[0] == 0:
        return ""
    buf = np.full(2 * mask.shape[0] - 1, ord(","), dtype=np.uint8)
    buf[::2] = mask + ord("0")
    return buf.tobytes().decode("ascii")


def _spliced_digest(rec: dict, bodies: dict[str, str]) -> str:
    """= :func:`member_digest` (SPEC §6.6: SHA-256 of the canonical JSON of ``rec`` without
    ``digest``) with the list fields in ``bodies`` taken pre-encoded (``[`` + body + ``]``): the
    canonical JSON is sorted keys, ``,``/``:`` separators, and every other value as
    :func:`canonical_str` writes it.  tests/test_perf_paths.py compares the two."""
    parts = []
    for k in sorted(rec):
        if k == "digest":
            continue
        body = bodies.get(k)
        parts.append(f"{canonical_str(k)}:{canonical_str(rec[k]) if body is None else '[' + body + ']'}")
    return hashlib.sha256(("{" + ",".join(parts) + "}").encode("utf-8")).hexdigest()


def route_or_none(db: sqlite3.Connection, route: str):
    """The route version in force (:class:`projections.admission.Route`), or None when none is declared."""
    from ledger.projections.admission import route_definition

    try:
        return route_definition(db, route)
    except KeyError:
        return None


def _context(db: sqlite3.Connection, route: str, ex: str, evidence, r) -> _ExecContext:
    """Everything ``ex``'s records share on ``route``, whose version in force is ``r`` (:func:`route_or_none`,
    read once per export, not per execution)."""
    from ledger.projections.lineage import task_of

    state, reward, target_tokens = db.execute(
        "SELECT state, reward, target_tokens FROM admission WHERE route = ? AND execution_id = ?", (route, ex)).fetchone()
    task_id = task_of(db, ex)
    split = group = None
    if evidence.split is not None:
        split, group, _ = evidence.split(db, ex)
    if group is None:
        group = task_id  # no split map: the task stands for its group (noted in the accounting)
    ctx = _ExecContext(ex, task_id, group, split, state, reward, int(target_tokens))
    from ledger.projections.admission import selection_for

    ctx.semantics = r.semantics if r is not None else 2
    if r is not None and r.use_specific and r.outcome_scope == "branch":
        ctx.fields = _task_outcome(db, ex)
    if r is not None and r.semantics >= 3:
        from ledger.corpus.member_lineage import execution_lineage

        ctx.lineage = execution_lineage(db, r, ex, selection_for(db, ex, r.semantics))
    if state == "admitted":
        from ledger.projections.tree import load_tree

        ctx.loaded = load_tree(db, ex)
        gens = {rid: r.generator for rid, r in ctx.loaded.requests.items()}
        ctx.policy_nodes = np.array([gens.get(n.origin_request_id) == "policy" for n in ctx.loaded.nodes], dtype=bool)
        ctx.paths = {}
        for row in db.execute("SELECT leaf_request_id, draw_index, member_id, role_class, path_tokens, target_tokens, reward, "
                              "targets FROM admitted_paths WHERE route = ? AND execution_id = ?", (route, ex)):
            ctx.paths[row[0]] = row
    return ctx


def _behavior(loaded, policy_nodes: np.ndarray, nodes: list[int]) -> list:
    """Per position: the behaviour log-prob of a policy output token, else None."""
    from ledger.projections.tree import FLAG_OUTPUT

    out: list = []
    for n in nodes:
        node = loaded.nodes[n]
        k = node.logprobs.shape[0]
        if not policy_nodes[n]:
            out += [None] * k
            continue
        lp = node.logprobs.astype(np.float64)
        ok = ((node.flags & FLAG_OUTPUT) != 0) & ~np.isnan(lp)
        if ok.all():
            out += lp.tolist()
        elif not ok.any():
            out += [None] * k
        else:  # runs of kept / dropped positions (a node is mostly input then output: few runs)
            vals = lp.tolist()
            start = 0
            for end in (np.flatnonzero(ok[1:] != ok[:-1]) + 1).tolist() + [k]:
                out += vals[start:end] if ok[start] else [None] * (end - start)
                start = end
    return out


def _record_fields(ctx: _ExecContext, nodes: list[int] | None) -> dict:
    """The fields a member carries beyond SPEC §7.3's: a recovery segment's outcome fields (§6.8) and,
    under semantics 3, its ``lineage`` (§11.2).  Empty for other routes, so their digests never change."""
    out = dict(ctx.fields or {})
    if ctx.lineage is not None:
        from ledger.corpus.member_lineage import path_requests

        out["lineage"] = ctx.lineage.for_path(None if nodes is None else path_requests(ctx.loaded, nodes))
    return out


def _path_record(route: str, ctx: _ExecContext, leaf_request_id: str) -> dict:
    leaf_req, draw_index, mid, role_class, path_tokens, n_targets, reward, targets = ctx.paths[leaf_request_id]
    t = ctx.loaded
    nodes = t.path_nodes(t.requests[leaf_req].node_id)
    input_ids: list = []
    behavior: list = []
    parts = [_node_lists(ctx, n) for n in nodes]
    for p in parts:
        input_ids += p.tokens
        behavior += p.behavior
    if len(input_ids) != path_tokens:
        raise RuntimeError(f"member {mid}: the tree changed since admission ({len(input_ids)} != {path_tokens} tokens); "
                           "run the projections up to date first")
    mask = np.zeros(len(input_ids), dtype=np.uint8)
    mask[np.frombuffer(targets, dtype="<u4").astype(np.int64)] = 1
    rec = {
        **_identity(route, ctx, mid),
        "leaf_request_id": leaf_req,
        "role_class": role_class,
        "input_ids": input_ids,
        "target_mask": mask.tolist(),
        "behavior_logprobs": behavior,
        "loss_weight": 1.0 / ctx.target_tokens if ctx.target_tokens else 0.0,
        "execution_target_tokens": ctx.target_tokens,
        "reward": None if reward is None else float(reward),
        "dummy": False,
        **_record_fields(ctx, nodes),
    }
    rec["digest"] = _spliced_digest(rec, {
        "input_ids": ",".join(p.tokens_json for p in parts if p.tokens_json),
        "behavior_logprobs": ",".join(p.behavior_json for p in parts if p.behavior_json),
        "target_mask": _mask_json(mask)})
    return rec


def _identity(route: str, ctx: _ExecContext, mid: str) -> dict:
    """The fields every trainer record of an execution shares (SPEC §7.3)."""
    return {"member_id": mid, "execution_id": ctx.execution_id, "task_id": ctx.task_id, "group_id": ctx.group_id,
            "split": ctx.split, "route": route}


def _dummy_record(route: str, ctx: _ExecContext, mid: str) -> dict:
    rec = {
        **_identity(route, ctx, mid),
        "leaf_request_id": None,
        "role_class": None,
        "input_ids": [],
        "target_mask": [],
        "behavior_logprobs": [],
        "loss_weight": 0.0,
        "execution_target_tokens": 0,
        "reward": 0.0,
        "dummy": True,
        **_record_fields(ctx, None),
    }
    rec["digest"] = member_digest(rec)
    return rec


def _members(db: sqlite3.Connection, route: str, semantics: int = 2) -> Iterator[tuple[str, str, str | None]]:
    """(member_id, execution_id, leaf_request_id or None for a dummy) in member_id byte order."""
    if semantics < 2:  # the first release's unescaped member ids (= ledger.projections.admission.member_id)
        db.create_function("ledger_key_component", 1, lambda x: x, deterministic=True)
        route_part = route
    else:
        db.create_function("ledger_key_component", 1, key_component, deterministic=True)  # = ledger.projections.admission.member_id
        route_part = key_component(route)
    cur = db.cursor()
    cur.execute("SELECT member_id, execution_id, leaf_request_id FROM admitted_paths WHERE route = ? "
                "UNION ALL SELECT ? || '/' || ledger_key_component(execution_id) || '/dummy', execution_id, NULL "
                "FROM admission WHERE route = ? AND state = 'dummy' ORDER BY 1", (route, route_part, route))
    while True:
        rows = cur.fetchmany(1024)
        if not rows:
            return
        yield from rows


def trainer_records(db: sqlite3.Connection, route: str, *, evidence=None) -> Iterator[dict]:
    """The route's trainer records (SPEC §7.3) in ``member_id`` order, one execution loaded at a time."""
    evidence = _evidence(evidence)
    r = route_or_none(db, route)
    from ledger.projections.preference import preference_route

    if preference_route(r):  # SPEC §6.9: a preference route's members are pairs
        from ledger.corpus.preference_export import preference_records

        yield from preference_records(db, route, evidence=evidence)
        return
    ctx: _ExecContext | None = None
    for mid, ex, leaf in _members(db, route, r.semantics if r is not None else 2):
        if ctx is None or ctx.execution_id != ex:
            ctx = _context(db, route, ex, evidence, r)
        if leaf is None:
            yield _dummy_record(route, ctx, mid)
        else:
            yield _path_record(route, ctx, leaf)


def execution_records(db: sqlite3.Connection, route: str, execution_id: str, *, evidence=None) -> list[dict]:
    """The trainer records of one admitted execution of a path route (its drawn paths, or its dummy entry) in
    ``member_id`` order: exactly the records :func:`trainer_records` gives for it (the online feed, SPEC 11.6).
    Empty when the execution is not admitted on the route now."""
    from ledger.projections.admission import member_id

    row = db.execute("SELECT state FROM admission WHERE route = ? AND execution_id = ?", (route, execution_id)).fetchone()
    if row is None or row[0] not in ("admitted", "dummy"):
        return []
    ctx = _context(db, route, execution_id, _evidence(evidence), route_or_none(db, route))
    if row[0] == "dummy":
        return [_dummy_record(route, ctx, member_id(route, execution_id, None, ctx.semantics))]
    return [_path_record(route, ctx, leaf) for leaf in sorted(ctx.paths, key=lambda k: ctx.paths[k][2].encode("utf-8"))]


def _task_outcome(db: sqlite3.Connection, ex: str) -> dict:
    """SPEC §6.8 recovery segments: the two fields a branch-scoped route's records carry."""
    from ledger.projections.assessment import execution_score

    score = execution_score(db, ex)
    whole = score.reward if score is not None and score.state == "scored" else None
    return {"outcome_scope": "branch", "task_outcome": "unverified" if whole is None else float(whole)}


# ====================================================================== summaries / accounting


@dataclass
class ExportSummary:
    """What an export wrote (SPEC §6.7 figures for the exported records)."""

    records: int = 0
    dummies: int = 0
    executions: int = 0
    path_tokens: int = 0  # processed tokens, path export (Σ len(input_ids))
    target_tokens: int = 0
    tree_tokens: int = 0  # processed tokens, tree export (admitted subtrees, each node once)
    by_role_class: dict | None = None

    def add(self, rec: dict) -> None:
        self.records += 1
        if rec["dummy"]:
            self.dummies += 1
        n = len(rec["input_ids"])
        t = int(sum(rec["target_mask"]))
        self.path_tokens += n
        self.target_tokens += t
        if self.by_role_class is None:
            self.by_role_class = {}
        key = rec["role_class"] or "dummy"
        row = self.by_role_class.setdefault(key, {"records": 0, "processed_tokens": 0, "target_tokens": 0})
        row["records"] += 1
        row["processed_tokens"] += n
        row["target_tokens"] += t

    def to_json(self) -> dict:
        return {"records": self.records, "dummies": self.dummies, "executions": self.executions,
                "processed_tokens": {"path": self.path_tokens, "tree": self.tree_tokens}, "target_tokens": self.target_tokens,
                "by_role_class": dict(sorted((self.by_role_class or {}).items()))}


# ====================================================================== writers


def write_jsonl(records, out: str | Path | IO[str]) -> ExportSummary:
    """One canonical JSON record per line; returns what was written."""
    summary = ExportSummary()
    execs: set[str] = set()
    fh, close = _open_out(out)
    try:
        for rec in records:
            fh.write(canonical_json(rec).decode("utf-8"))
            fh.write("\n")
            summary.add(rec)
            execs.add(rec["execution_id"])
    finally:
        if close:
            fh.close()
    summary.executions = len(execs)
    return summary


def _open_out(out):
    if hasattr(out, "write"):
        return out, False
    return open(out, "w", encoding="utf-8"), True


def _arrow_schema(first: dict | None = None):
    """SPEC 11.5: the logical schema of path records (:mod:`ledger.corpus.formats`)."""
    from ledger.corpus.formats import path_schema

    return path_schema(lineage=first is not None and "lineage" in first)


def write_parquet_rows(records, path: str | Path, schema, on_record, *, row_group_tokens: int,
                       row_group_rows: int, tokens_of=None, to_row=None) -> None:
    """Stream ``records`` into a Parquet file of ``schema`` (or of ``schema(first record)``), one row
    group per ``row_group_tokens`` input tokens (``tokens_of(rec)``, default ``len(rec["input_ids"])``)
    or ``row_group_rows`` rows; ``on_record(rec)`` sees each record once, ``to_row(rec)`` (default: the
    record) is what is written.  Fields without a column go, as canonical JSON, to :data:`EXTRA_COLUMN`."""
    import itertools

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = iter(records)
    first = next(records, None)
    rows = (to_row or (lambda rec: rec))
    if callable(schema):
        schema = schema(first)
    if first is not None and set(rows(first)) - set(schema.names):  # recovery-segment fields: one JSON column
        schema = schema.append(pa.field(EXTRA_COLUMN, pa.string()))
        plain = rows
        rows = lambda rec: _with_extra_column(plain(rec), schema.names)  # noqa: E731
    if first is not None:
        records = itertools.chain([first], records)
    buf: list[dict] = []
    tokens = 0
    with pq.ParquetWriter(str(path), schema) as writer:
        for rec in records:
            buf.append(rows(rec))
            tokens += len(rec["input_ids"]) if tokens_of is None else tokens_of(rec)
            on_record(rec)
            if tokens >= row_group_tokens or len(buf) >= row_group_rows:
                writer.write_table(pa.Table.from_pylist(buf, schema=schema))
                buf, tokens = [], 0
        if buf:
            writer.write_table(pa.Table.from_pylist(buf, schema=schema))


def _with_extra_column(rec: dict, names: list[str]) -> dict:
    extra = {k: v for k, v in rec.items() if k not in names}
    return {**rec, EXTRA_COLUMN: canonical_str(extra) if extra else None}


def write_parquet(records, path: str | Path, *, row_group_tokens: int = 1 << 20, row_group_rows: int = 4096) -> ExportSummary:
    """Parquet with the record's columns, written in row groups while streaming."""
    summary = ExportSummary()
    execs: set[str] = set()

    def on_record(rec: dict) -> None:
        summary.add(rec)
        execs.add(rec["execution_id"])

    write_parquet_rows(records, path, _arrow_schema, on_record, row_group_tokens=row_group_tokens,
                       row_group_rows=row_group_rows)
    summary.executions = len(execs)
    return summary


def tree_lines(db: sqlite3.Connection, route: str, *, evidence=None) -> Iterator[dict]:
    """One document per admitted or dummy execution: its admitted subtree, each node once."""
    evidence = _evidence(evidence)
    r = route_or_none(db, route)
    cur = db.cursor()
    cur.execute("SELECT execution_id FROM admission WHERE route = ? AND state IN ('admitted', 'dummy') ORDER BY execution_id",
                (route,))
    while True:
        batch = cur.fetchmany(256)
        if not batch:
            return
        for (ex,) in batch:
            ctx = _context(db, route, ex, evidence, r)
            yield _tree_doc(route, ctx)


def _tree_doc(route: str, ctx: _ExecContext) -> dict:
    from ledger.projections.admission import member_id

    doc = {"execution_id": ctx.execution_id, "task_id": ctx.task_id, "group_id": ctx.group_id, "split": ctx.split,
           "route": route, "dummy": ctx.state == "dummy", "execution_target_tokens": ctx.target_tokens if ctx.state != "dummy" else 0,
           "loss_weight": (1.0 / ctx.target_tokens) if ctx.state != "dummy" and ctx.target_tokens else 0.0,
           "nodes": [], "leaves": []}
    if ctx.state == "dummy":
        d = _dummy_record(route, ctx, member_id(route, ctx.execution_id, None, ctx.semantics))
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
            "behavior_logprobs": _behavior(t, ctx.policy_nodes, [n]),
        })
    for leaf_req, draw_index, mid, role_class, path_tokens, n_targets, reward, packed in rows:
        rec = _path_record(route, ctx, leaf_req)
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
    fh, close = _open_out(out)
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
        from ledger.corpus.preference_export import PAIR_FIELDS

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
    from ledger.corpus.preference_export import export_pairs, is_pair_route

    if is_pair_route(db, route):
        return export_pairs(db, route, out, fmt, evidence=evidence)
    if fmt == "jsonl":
        s = write_jsonl(trainer_records(db, route, evidence=evidence), out)
    elif fmt == "parquet":
        s = write_parquet(trainer_records(db, route, evidence=evidence), out)
    elif fmt == "tree":
        s = write_tree(db, route, out, evidence=evidence)
    elif fmt in ("packed", "packed-parquet"):  # SPEC §7.5 (ledger.corpus.packed)
        from ledger.corpus.packed import packed_records, write_packed_jsonl, write_packed_parquet

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

