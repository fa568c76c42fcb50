"""A route's member path records and the writers of one record file (SPEC 7.3): the per-execution
context, the path and dummy records and their digests, JSON lines and Parquet writers.

The base of every export format: :mod:`ledger.corpus.export` (path and tree exports, the readers),
:mod:`ledger.corpus.packed` (tree-packed records) and :mod:`ledger.corpus.preference_export` (pairs)
build on it, and ``export`` dispatches to the other two, so the modules import one way only.
"""

from __future__ import annotations

import hashlib
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np

from ledger.algorithms.canonical import canonical_json, canonical_str, json_digest
from ledger.algorithms.identifiers import key_component
from ledger.corpus.formats import EXTRA_COLUMN
from ledger.projections.admission import Evidence
from ledger.projections.assessment import execution_score
from ledger.projections.admission import route_definition
from ledger.projections.lineage import task_of
from ledger.projections.admission import selection_for
from ledger.corpus.member_lineage import execution_lineage
from ledger.projections.tree import load_tree
from ledger.projections.tree import FLAG_OUTPUT
from ledger.corpus.member_lineage import path_requests
from ledger.corpus.formats import path_schema
import itertools


def member_digest(record: dict) -> str:
    """SHA-256 hex of the canonical JSON of ``record`` without ``digest`` (SPEC §6.6)."""
    return json_digest({k: v for k, v in record.items() if k != "digest"})


# ====================================================================== reading the projection


def evidence_of(evidence):
    if evidence is not None:
        return evidence

    return Evidence.discover()


@dataclass
class ExecContext:
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
    node_lists: dict | None = None  # node -> its NodeParts, built once per execution
    lineage: Any = None  # semantics 3: ledger.corpus.member_lineage.ExecutionLineage (SPEC 11.2)
    fields: dict | None = None  # extra record fields every member of the execution carries (recovery segments)


class NodeParts:
    """Node ``n``'s tokens and behaviour log-probs as Python lists and as canonical-JSON list
    bodies (no brackets), converted once per execution: its paths share their prefix nodes
    (issue 19; equal to converting each path's concatenation, tests/test_perf_paths.py)."""

    __slots__ = ("tokens", "behavior", "tokens_json", "behavior_json")

    def __init__(self, tokens: list, behavior: list) -> None:
        self.tokens, self.behavior = tokens, behavior
        self.tokens_json = canonical_str(tokens)[1:-1]
        self.behavior_json = canonical_str(behavior)[1:-1]


def node_lists(ctx: ExecContext, n: int) -> NodeParts:
    cache = ctx.node_lists
    if cache is None:
        cache = ctx.node_lists = {}
    got = cache.get(n)
    if got is None:
        got = cache[n] = NodeParts(ctx.loaded.nodes[n].tokens.tolist(), behavior_of(ctx.loaded, ctx.policy_nodes, [n]))
    return got


def mask_json(mask: np.ndarray) -> str:
    """canonical JSON body of a 0/1 uint8 array (``0,1,...``), written by numpy."""
    if mask.shape[0] == 0:
        return ""
    buf = np.full(2 * mask.shape[0] - 1, ord(","), dtype=np.uint8)
    buf[::2] = mask + ord("0")
    return buf.tobytes().decode("ascii")


def spliced_digest(rec: dict, bodies: dict[str, str]) -> str:
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


def task_outcome(db: sqlite3.Connection, ex: str) -> dict:
    """SPEC §6.8 recovery segments: the two fields a branch-scoped route's records carry."""

    score = execution_score(db, ex)
    whole = score.reward if score is not None and score.state == "scored" else None
    return {"outcome_scope": "branch", "task_outcome": "unverified" if whole is None else float(whole)}



def route_or_none(db: sqlite3.Connection, route: str):
    """The route version in force (:class:`projections.admission.Route`), or None when none is declared."""

    try:
        return route_definition(db, route)
    except KeyError:
        return None


def exec_context(db: sqlite3.Connection, route: str, ex: str, evidence, r) -> ExecContext:
    """Everything ``ex``'s records share on ``route``, whose version in force is ``r`` (:func:`route_or_none`,
    read once per export, not per execution)."""

    state, reward, target_tokens = db.execute(
        "SELECT state, reward, target_tokens FROM admission WHERE route = ? AND execution_id = ?", (route, ex)).fetchone()
    task_id = task_of(db, ex)
    split = group = None
    if evidence.split is not None:
        split, group, _ = evidence.split(db, ex)
    if group is None:
        group = task_id  # no split map: the task stands for its group (noted in the accounting)
    ctx = ExecContext(ex, task_id, group, split, state, reward, int(target_tokens))

    ctx.semantics = r.semantics if r is not None else 2
    if r is not None and r.use_specific and r.outcome_scope == "branch":
        ctx.fields = task_outcome(db, ex)
    if r is not None and r.semantics >= 3:

        ctx.lineage = execution_lineage(db, r, ex, selection_for(db, ex, r.semantics))
    if state == "admitted":

        ctx.loaded = load_tree(db, ex)
        gens = {rid: r.generator for rid, r in ctx.loaded.requests.items()}
        ctx.policy_nodes = np.array([gens.get(n.origin_request_id) == "policy" for n in ctx.loaded.nodes], dtype=bool)
        ctx.paths = {}
        for row in db.execute("SELECT leaf_request_id, draw_index, member_id, role_class, path_tokens, target_tokens, reward, "
                              "targets FROM admitted_paths WHERE route = ? AND execution_id = ?", (route, ex)):
            ctx.paths[row[0]] = row
    return ctx


def behavior_of(loaded, policy_nodes: np.ndarray, nodes: list[int]) -> list:
    """Per position: the behaviour log-prob of a policy output token, else None."""

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


def record_fields(ctx: ExecContext, nodes: list[int] | None) -> dict:
    """The fields a member carries beyond SPEC §7.3's: a recovery segment's outcome fields (§6.8) and,
    under semantics 3, its ``lineage`` (§11.2).  Empty for other routes, so their digests never change."""
    out = dict(ctx.fields or {})
    if ctx.lineage is not None:

        out["lineage"] = ctx.lineage.for_path(None if nodes is None else path_requests(ctx.loaded, nodes))
    return out


def path_record(route: str, ctx: ExecContext, leaf_request_id: str) -> dict:
    leaf_req, draw_index, mid, role_class, path_tokens, n_targets, reward, targets = ctx.paths[leaf_request_id]
    t = ctx.loaded
    nodes = t.path_nodes(t.requests[leaf_req].node_id)
    input_ids: list = []
    behavior: list = []
    parts = [node_lists(ctx, n) for n in nodes]
    for p in parts:
        input_ids += p.tokens
        behavior += p.behavior
    if len(input_ids) != path_tokens:
        raise RuntimeError(f"member {mid}: the tree changed since admission ({len(input_ids)} != {path_tokens} tokens); "
                           "run the projections up to date first")
    mask = np.zeros(len(input_ids), dtype=np.uint8)
    mask[np.frombuffer(targets, dtype="<u4").astype(np.int64)] = 1
    rec = {
        **identity_fields(route, ctx, mid),
        "leaf_request_id": leaf_req,
        "role_class": role_class,
        "input_ids": input_ids,
        "target_mask": mask.tolist(),
        "behavior_logprobs": behavior,
        "loss_weight": 1.0 / ctx.target_tokens if ctx.target_tokens else 0.0,
        "execution_target_tokens": ctx.target_tokens,
        "reward": None if reward is None else float(reward),
        "dummy": False,
        **record_fields(ctx, nodes),
    }
    rec["digest"] = spliced_digest(rec, {
        "input_ids": ",".join(p.tokens_json for p in parts if p.tokens_json),
        "behavior_logprobs": ",".join(p.behavior_json for p in parts if p.behavior_json),
        "target_mask": mask_json(mask)})
    return rec


def identity_fields(route: str, ctx: ExecContext, mid: str) -> dict:
    """The fields every trainer record of an execution shares (SPEC §7.3)."""
    return {"member_id": mid, "execution_id": ctx.execution_id, "task_id": ctx.task_id, "group_id": ctx.group_id,
            "split": ctx.split, "route": route}


def dummy_record(route: str, ctx: ExecContext, mid: str) -> dict:
    rec = {
        **identity_fields(route, ctx, mid),
        "leaf_request_id": None,
        "role_class": None,
        "input_ids": [],
        "target_mask": [],
        "behavior_logprobs": [],
        "loss_weight": 0.0,
        "execution_target_tokens": 0,
        "reward": 0.0,
        "dummy": True,
        **record_fields(ctx, None),
    }
    rec["digest"] = member_digest(rec)
    return rec


def route_members(db: sqlite3.Connection, route: str, semantics: int = 2) -> Iterator[tuple[str, str, str | None]]:
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
    fh, close = open_out(out)
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


def open_out(out):
    if hasattr(out, "write"):
        return out, False
    return open(out, "w", encoding="utf-8"), True


def arrow_schema(first: dict | None = None):
    """SPEC 11.5: the logical schema of path records (:mod:`ledger.corpus.formats`)."""

    return path_schema(lineage=first is not None and "lineage" in first)


def write_parquet_rows(records, path: str | Path, schema, on_record, *, row_group_tokens: int,
                       row_group_rows: int, tokens_of=None, to_row=None) -> None:
    """Stream ``records`` into a Parquet file of ``schema`` (or of ``schema(first record)``), one row
    group per ``row_group_tokens`` input tokens (``tokens_of(rec)``, default ``len(rec["input_ids"])``)
    or ``row_group_rows`` rows; ``on_record(rec)`` sees each record once, ``to_row(rec)`` (default: the
    record) is what is written.  Fields without a column go, as canonical JSON, to :data:`EXTRA_COLUMN`."""

    import pyarrow as pa  # cold path: pyarrow
    import pyarrow.parquet as pq  # cold path: pyarrow

    records = iter(records)
    first = next(records, None)
    rows = (to_row or (lambda rec: rec))
    if callable(schema):
        schema = schema(first)
    if first is not None and set(rows(first)) - set(schema.names):  # recovery-segment fields: one JSON column
        schema = schema.append(pa.field(EXTRA_COLUMN, pa.string()))
        plain = rows
        rows = lambda rec: with_extra_column(plain(rec), schema.names)  # noqa: E731
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


def with_extra_column(rec: dict, names: list[str]) -> dict:
    extra = {k: v for k, v in rec.items() if k not in names}
    return {**rec, EXTRA_COLUMN: canonical_str(extra) if extra else None}


def write_parquet(records, path: str | Path, *, row_group_tokens: int = 1 << 20, row_group_rows: int = 4096) -> ExportSummary:
    """Parquet with the record's columns, written in row groups while streaming."""
    summary = ExportSummary()
    execs: set[str] = set()

    def on_record(rec: dict) -> None:
        summary.add(rec)
        execs.add(rec["execution_id"])

    write_parquet_rows(records, path, arrow_schema, on_record, row_group_tokens=row_group_tokens,
                       row_group_rows=row_group_rows)
    summary.executions = len(execs)
    return summary
