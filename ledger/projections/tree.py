"""Prefix-tree projection (SPEC §6.1): one tree per execution, holding every agent's requests.

Tables (other projections and the CLI read them; node ids in ``tree_nodes`` /
``tree_requests`` are the projection's internal ids — use :func:`load_tree` & co. for the
renumbered, parent-before-child view):

``executions``     one row per ExecutionOpened, updated by ExecutionClosed / ExecutionFinalized
``tree_nodes``     node segments, **packed**: ``tokens`` uint32 LE, ``flags`` uint8 (bit 0 =
                   output token, bit 1 = policy target candidate), ``logprobs`` float32 LE
                   (NaN where the token is not an output or the producer gave none)
``tree_requests``  request -> node, with its agent, role, provenance and tool-call ids
``tree_stats``     per execution: requests, nodes, stored tokens, expanded tokens
``tool_payloads``  exact tool calls / results by call id (see :func:`request_tool_payloads`)

Refused (raised as :class:`~ledger.projections.engine.Rejected`, so the engine records them in
``_rejected`` with the reason): requests, payloads, closures for an unknown execution; a
request after its execution closed; a duplicate request id; a prefix reference that does
not verify against the tree; a second ExecutionOpened / ExecutionClosed; a sealed request
(crypto-shredding, :mod:`ledger.log.sealing`) without a key store (``sealed request: no key
store configured``), whose data key was destroyed (``sealed payload erased``) or whose
ciphertext does not open; any execution-scoped event addressed to a derived view.

**Sealed requests** (SPEC §6.4 ``erase``).  ``TreeProjection(keystore=KeyStore(...))``
opens them with :func:`ledger.log.sealing.unseal` and inserts the plain tokens.  After an
erasure (key destroyed) a replay refuses them (:data:`ERASED`), so a rebuild holds no node with
their tokens.  A withdrawal with erase applied while the key still opens them purges the covered
trees and has the engine record each purged request as refused with that same reason, at its
log position (:attr:`TreeProjection.refused_after_apply`): the database is then exactly what a
replay without the key derives.

**Derived views** (RecordDerived, SPEC §6.4).  A view gets its own tree: its parent's
requests in the parent's recording (seq) order, read back from the parent's tree, turned
into the view's requests by :func:`projections.governance.derived_requests` (replaced
tokens, withheld requests dropped, replaced outputs context only) and inserted afresh under
the view's id; its ``executions`` row is a copy of the parent's (task, deadline, policy,
closure, finalization) under the view's id.  Record_derived arrives on the governance
stream, so in any order relative to the parent's events: ``finish()`` rebuilds a view from
scratch whenever its record_derived arrived or its parent's tree / row changed in the batch
(parents before views, views of views transitively), so the state is the same for every
interleaving.  A view whose parent is unknown (not opened yet) or whose lineage does not
lead back to an original execution (a cycle) has no row and no tree.  The lineage facts
are the governance projection's tables (``lineage``, ``lineage_replacements``), filled in
its ``apply``: run it in the same engine (the registry does); without them there are no
views.  A view is defined by its transformation only: an ExecutionOpened, request, tool
payload, closure or finalization addressed to a view id is refused ("derived view"), and
one applied before its record_derived arrived is discarded by the rebuild.  A view carries
no tool payloads (its parent's may hold exactly what the transformation withheld).

The matching itself is :mod:`ledger.algorithms.prefix_match`.  Recently touched trees stay in memory
(bounded LRU by trees and stored tokens); changed nodes are written at the end of every
engine batch (inside the batch's transaction), so state and log position commit together.
"""

from __future__ import annotations

import json
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ledger.algorithms.path_draws import Leaf, TreeView
from ledger.events.catalog import key_of
from ledger.algorithms.prefix_match import (
    FLAG_CANDIDATE,
    FLAG_OUTPUT,
    U32,
    PrefixReferenceError,
    Tree,
    as_tokens,
    creation_order,
    output_flag,
)
from ledger.projections.descendants import descendants
from ledger.projections.engine import Applied, Rejected
from ledger.projections.treeview import view_of  # the view shape shared with admission
from ledger.projections.governance import covered_executions, erased_among
from ledger.projections.governance import lineage_chain
from ledger.projections.governance import derived_requests
from ledger.log.sealing import KeyCache, SealError, unseal

__all__ = [
    "ERASED",
    "FLAG_CANDIDATE",
    "FLAG_OUTPUT",
    "LoadedTree",
    "TreeNode",
    "TreeProjection",
    "TreeRequest",
    "execution_row",
    "load_tree",
    "request_path",
    "request_tool_payloads",
    "tree_json",
    "tree_stats",
    "tree_text",
    "tree_view",
]

ERASED = "sealed payload erased"  # why a replay refuses a request whose data key was destroyed, and an erase purge too

SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    execution_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, deadline_us INTEGER NOT NULL, policy TEXT NOT NULL,
    tokenizer TEXT, origin TEXT, collection_run_id TEXT, metadata TEXT, opened_at_us INTEGER NOT NULL,
    closed_status TEXT, closed_at_us INTEGER, artifact_versions TEXT, finalized INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS tree_nodes (
    execution_id TEXT NOT NULL, node_id INTEGER NOT NULL, parent INTEGER, origin_request_id TEXT NOT NULL,
    tokens BLOB NOT NULL, flags BLOB NOT NULL, logprobs BLOB NOT NULL, PRIMARY KEY (execution_id, node_id));
CREATE TABLE IF NOT EXISTS tree_requests (
    execution_id TEXT NOT NULL, request_id TEXT NOT NULL, node_id INTEGER NOT NULL, agent_id TEXT NOT NULL,
    agent_tier TEXT NOT NULL, turn_kind TEXT NOT NULL, generator TEXT NOT NULL, reconstructed INTEGER NOT NULL,
    parent_request_id TEXT, input_len INTEGER NOT NULL, output_len INTEGER NOT NULL,
    consumed_tool_call_ids TEXT NOT NULL, emitted_tool_call_ids TEXT NOT NULL, seq INTEGER NOT NULL,
    PRIMARY KEY (execution_id, request_id));
CREATE TABLE IF NOT EXISTS tree_stats (
    execution_id TEXT PRIMARY KEY, requests INTEGER NOT NULL, nodes INTEGER NOT NULL,
    stored_tokens INTEGER NOT NULL, expanded_tokens INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tool_payloads (
    execution_id TEXT NOT NULL, call_id TEXT NOT NULL, kind TEXT NOT NULL, payload TEXT NOT NULL,
    PRIMARY KEY (execution_id, call_id, kind));
"""


class _Exec:
    """In-memory state of one execution (cached)."""

    __slots__ = ("tree", "closed", "dirty", "stats_dirty", "payload_keys", "view")

    def __init__(self, tree: Tree, closed: bool, payload_keys: set | None = None, view: bool = False) -> None:
        self.tree = tree
        self.closed = closed
        self.dirty: set[int] = set()
        self.stats_dirty = False
        self.payload_keys = payload_keys  # (call_id, kind) cached so far; None: not loaded yet
        self.view = view  # a derived view: built by finish(), refuses events addressed to it


class TreeProjection:
    """The ``tree`` projection (engine Projection protocol)."""

    name = "tree"
    rules_version = "erase-purge-2"  # an erase purge leaves a replay's state, rejections included (SPEC 11.7): rebuild older databases

    def __init__(self, *, keystore=None, cache_trees: int = 64, cache_tokens: int = 4_000_000) -> None:
        """``keystore``: a :class:`ledger.log.sealing.KeyStore` to open sealed requests (``None``:
        sealed requests are refused with "sealed request: no key store configured")."""
        self.keystore = keystore
        self.cache_trees, self.cache_tokens = cache_trees, cache_tokens
        self._cache: OrderedDict[str, _Exec] = OrderedDict()
        self._touched: dict[str, _Exec] = {}  # executions changed in the current batch
        self._request_rows: list[tuple] = []
        self._payload_rows: list[tuple] = []
        self._changed: set[str] = set()  # executions whose tree or row changed (their views follow)
        self._derived: set[str] = set()  # record_derived seen in the current batch
        self._lineage = False  # the governance projection's lineage tables exist (memo, once true)
        self._keys = None  # ledger.log.sealing.KeyCache over self.keystore, emptied at every batch end
        self._erase_subjects: set[str] = set()  # subjects of withdrawals with erase applied in the current batch
        self._tasks: set[str] = set()  # tasks registered in the current batch (a source erasure may now cover them)
        self._rebuilt: set[str] = set()  # derived views rebuilt in the current batch
        self._erasing = False  # a withdrawal with erase exists in this database (memo, once true)
        # (natural key, event type, reason) of events applied and then undone by this batch's finish (an
        # erase purge); the engine records each in ``_rejected`` at its log position, as a replay refusing it would
        self.refused_after_apply: list[tuple[str, str, str]] = []

    # ------------------------------------------------------------------ protocol
    def create(self, db: sqlite3.Connection) -> None:
        db.executescript(SCHEMA)

    def reset(self) -> None:
        self._cache.clear()
        self._touched.clear()
        self._request_rows.clear()
        self._payload_rows.clear()
        self._changed.clear()
        self._derived.clear()
        self._lineage = False
        self._keys = None
        self._erase_subjects.clear()
        self._tasks.clear()
        self._rebuilt.clear()
        self._erasing = False
        self.refused_after_apply.clear()

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        handler = _HANDLERS.get(item.type)
        if handler is not None:
            handler(self, db, item.event)

    def finish(self, db: sqlite3.Connection) -> None:
        self.refused_after_apply.clear()  # the engine took the previous batch's
        gone = self._erased_in_batch(db)
        if self._request_rows:
            db.executemany("INSERT INTO tree_requests VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", self._request_rows)
            self._request_rows.clear()
        if self._payload_rows:
            db.executemany("INSERT INTO tool_payloads VALUES (?,?,?,?)", self._payload_rows)
            self._payload_rows.clear()
        node_rows, stat_rows = [], []
        for exid, ex in self._touched.items():
            nodes = ex.tree.nodes
            for nid in sorted(ex.dirty):
                n = nodes[nid]
                node_rows.append((exid, nid, None if n.parent is None else n.parent.id, n.origin, n.raw, n.flag, n.lp))
            ex.dirty.clear()
            if ex.stats_dirty:
                t = ex.tree
                stat_rows.append((exid, len(t.requests), len(t.nodes), t.stored_tokens, t.expanded_tokens))
                ex.stats_dirty = False
        if node_rows:
            db.executemany("INSERT OR REPLACE INTO tree_nodes VALUES (?,?,?,?,?,?,?)", node_rows)
        if stat_rows:
            db.executemany("INSERT OR REPLACE INTO tree_stats VALUES (?,?,?,?,?)", stat_rows)
        self._touched.clear()
        if gone:
            self._purge(db, gone)
            self._changed |= gone  # their views are re-derived from the emptied trees
        self._derive_views(db)
        if gone:
            self._purge(db, gone & self._rebuilt)  # a view erased on its own, rebuilt from a parent that is not
        self._rebuilt.clear()
        self._trim()
        if self._keys is not None:
            self._keys.clear()  # a key destroyed meanwhile is seen by the next batch

    # ------------------------------------------------------------------ cache
    def _trim(self) -> None:
        total = sum(ex.tree.stored_tokens for ex in self._cache.values())
        while self._cache and (len(self._cache) > self.cache_trees or total > self.cache_tokens):
            _, ex = self._cache.popitem(last=False)
            total -= ex.tree.stored_tokens
            ex.tree.release()  # freed now, not at the cyclic collector's next full pass (issue 19)

    def _get(self, db: sqlite3.Connection, execution_id: str) -> _Exec | None:
        ex = self._cache.get(execution_id)
        if ex is not None:
            self._cache.move_to_end(execution_id)
            return ex
        row = db.execute("SELECT closed_status FROM executions WHERE execution_id = ?", (execution_id,)).fetchone()
        if row is None:
            return None
        ex = _Exec(_load(db, execution_id), row[0] is not None, view=self._is_view(db, execution_id))
        self._cache[execution_id] = ex
        return ex

    def _touch(self, execution_id: str, ex: _Exec) -> None:
        self._touched[execution_id] = ex

    # ------------------------------------------------------------------ erasure (SPEC 11.7)
    def _erased_in_batch(self, db: sqlite3.Connection) -> set[str]:
        """The executions and views of this batch that a withdrawal with ``erase`` covers: those
        whose tree changed, those a withdrawal with erase applied in the batch covers, those of a
        task registered in the batch (a source erasure may reach them now).  Empty, at the cost of
        one query per batch, while the database holds no erasure."""
        subjects, tasks = self._erase_subjects, self._tasks
        self._erase_subjects, self._tasks = set(), set()
        if not self._has_lineage(db):
            return set()  # no governance projection in this database: no withdrawal is known here
        if not (subjects or self._erasing) and \
                db.execute("SELECT 1 FROM withdrawals WHERE erase = 1 LIMIT 1").fetchone() is None:
            return set()
        self._erasing = True

        candidates = set(self._touched) | self._changed | self._derived
        for s in subjects:
            for group in covered_executions(db, s):
                candidates.update(group)
        for t in tasks:
            candidates.update(r[0] for r in db.execute("SELECT execution_id FROM executions WHERE task_id = ?", (t,)))
        return erased_among(db, candidates) if candidates else set()

    def _purge(self, db: sqlite3.Connection, executions: set[str]) -> None:
        """Delete the token payloads of ``executions`` (their nodes and requests; stats zeroed) and
        hand the engine each deleted request of an original execution as refused with
        :data:`ERASED` (:attr:`refused_after_apply`): exactly the state a replay gives once their
        keys are gone, which refuses those requests with that reason (a derived view's requests are
        not events of the log: a replay re-derives the view from the emptied parent, refusing
        nothing).  The rows are overwritten on disk (the connection's ``secure_delete``); the
        engine's ``_erase_scrub`` row asks it to truncate the WAL after the commit
        (:meth:`projections.engine.ReplayEngine.scrub`)."""
        ids = sorted(executions)
        deleted = 0
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            marks = ",".join("?" * len(chunk))
            originals = [ex for ex in chunk if not self._is_view(db, ex)]
            self.refused_after_apply.extend(
                (key_of("request", execution_id=ex, request_id=rid), "request", ERASED) for ex, rid in db.execute(
                    f"SELECT execution_id, request_id FROM tree_requests WHERE execution_id IN "
                    f"({','.join('?' * len(originals))})", originals))
            deleted += db.execute(f"DELETE FROM tree_nodes WHERE execution_id IN ({marks})", chunk).rowcount
            db.execute(f"DELETE FROM tree_requests WHERE execution_id IN ({marks})", chunk)
            db.execute(f"UPDATE tree_stats SET requests = 0, nodes = 0, stored_tokens = 0, expanded_tokens = 0 "
                       f"WHERE execution_id IN ({marks})", chunk)
        for ex in ids:
            cached = self._cache.pop(ex, None)
            if cached is not None:
                cached.tree.release()
        if deleted:
            db.executemany("INSERT OR IGNORE INTO _erase_scrub VALUES (?)", [(ex,) for ex in ids])

    def _withdrawal(self, db: sqlite3.Connection, ev: dict) -> None:
        if ev.get("erase"):
            self._erase_subjects.add(ev["subject"])

    def _task_registered(self, db: sqlite3.Connection, ev: dict) -> None:
        self._tasks.add(ev["task_id"])

    # ------------------------------------------------------------------ derived views
    def _has_lineage(self, db: sqlite3.Connection) -> bool:
        if not self._lineage:
            self._lineage = db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name IN "
                                       "('lineage', 'lineage_replacements')").fetchone()[0] == 2
        return self._lineage

    def _is_view(self, db: sqlite3.Connection, execution_id: str) -> bool:
        """True when a record_derived (applied by the governance projection) names ``execution_id``."""
        return self._has_lineage(db) and db.execute(
            "SELECT 1 FROM lineage WHERE derived_execution_id = ?", (execution_id,)).fetchone() is not None

    def _refuse_view(self, db: sqlite3.Connection, ex: _Exec | None, execution_id: str, what: str) -> None:
        if (ex.view if ex is not None else self._is_view(db, execution_id)):
            raise Rejected(f"{what} addressed to derived view {execution_id!r} refused: a derived view is defined by "
                           f"its record_derived transformation of its parent only")

    def _derive_views(self, db: sqlite3.Connection) -> None:
        """Rebuild, from scratch, every view whose record_derived arrived or whose parent
        (transitively) changed in this batch; parents before views."""
        changed, derived = self._changed, self._derived
        self._changed, self._derived = set(), set()
        if not (changed or derived) or not self._has_lineage(db):
            return
        if db.execute("SELECT 1 FROM lineage LIMIT 1").fetchone() is None:
            return
        todo = {v for v in derived if self._is_view(db, v)}
        todo |= descendants(db, changed | todo, table="lineage", child="derived_execution_id",
                            parent="parent_execution_id")
        if not todo:
            return

        chains = {v: lineage_chain(db, v) for v in todo}
        parents: dict[str, Tree] = {}  # parent trees read in this pass
        for v in sorted(todo, key=lambda v: (len(chains[v]), v)):
            self._rebuild_view(db, v, chains[v], parents)

    def _rebuild_view(self, db: sqlite3.Connection, view: str, chain: list[str], parents: dict[str, Tree]) -> None:

        if len(chain) < 2:
            return  # not a view after all (no lineage row)
        for table in ("tree_nodes", "tree_requests", "tree_stats", "tool_payloads", "executions"):
            db.execute(f"DELETE FROM {table} WHERE execution_id = ?", (view,))
        self._cache.pop(view, None)
        self._touched.pop(view, None)
        parents.pop(view, None)
        if self._is_view(db, chain[-1]):
            return  # a lineage cycle, or a chain longer than governance.MAX_DEPTH: no original behind it
        parent = chain[1]
        if db.execute("SELECT 1 FROM executions WHERE execution_id = ?", (parent,)).fetchone() is None:
            return  # the parent is not opened (yet): built when it is
        db.execute("INSERT INTO executions SELECT ?, task_id, deadline_us, policy, tokenizer, origin, collection_run_id, "
                   "metadata, opened_at_us, closed_status, closed_at_us, artifact_versions, finalized FROM executions "
                   "WHERE execution_id = ?", (view, parent))
        ptree = parents.get(parent)
        if ptree is None:
            cached = self._cache.get(parent)
            ptree = parents[parent] = cached.tree if cached is not None else _load(db, parent)
        events = []
        for (rid, agent_id, agent_tier, turn_kind, generator, reconstructed, hint, input_len, consumed,
             emitted) in db.execute(
                "SELECT request_id, agent_id, agent_tier, turn_kind, generator, reconstructed, parent_request_id, "
                "input_len, consumed_tool_call_ids, emitted_tool_call_ids FROM tree_requests WHERE execution_id = ? "
                "ORDER BY seq", (parent,)):
            path_nodes = ptree.path_nodes(ptree.requests[rid])
            raw = b"".join(n.raw for n in path_nodes)
            lp = b"".join(n.lp for n in path_nodes)
            cut = input_len * 4
            events.append({"execution_id": parent, "request_id": rid, "input_ids": raw[:cut], "input_prefix": None,
                           "input_suffix_ids": None, "output_ids": raw[cut:], "output_logprobs": lp[cut:],
                           "agent_id": agent_id, "agent_tier": agent_tier, "turn_kind": turn_kind,
                           "generator": generator, "reconstructed": bool(reconstructed), "parent_request_id": hint,
                           "consumed_tool_call_ids": consumed, "emitted_tool_call_ids": emitted})
        tree = Tree()
        rows = []
        for seq, ev in enumerate(derived_requests(db, view, events)):
            rid, inp, out = ev["request_id"], ev["input_ids"], ev["output_ids"]
            res = tree.insert(rid, seq, inp, out, ev["output_logprobs"],
                              output_flag(ev["generator"], ev["reconstructed"]), hint=ev["parent_request_id"])
            rows.append((view, rid, res.node.id, ev["agent_id"], ev["agent_tier"], ev["turn_kind"], ev["generator"],
                         int(ev["reconstructed"]), ev["parent_request_id"], len(inp) >> 2, len(out) >> 2,
                         ev["consumed_tool_call_ids"], ev["emitted_tool_call_ids"], seq))
        db.executemany("INSERT INTO tree_requests VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        db.executemany("INSERT INTO tree_nodes VALUES (?,?,?,?,?,?,?)",
                       [(view, n.id, None if n.parent is None else n.parent.id, n.origin, n.raw, n.flag, n.lp)
                        for n in tree.nodes])
        db.execute("INSERT INTO tree_stats VALUES (?,?,?,?,?)",
                   (view, len(tree.requests), len(tree.nodes), tree.stored_tokens, tree.expanded_tokens))
        parents[view] = tree  # a view of this view reads it from here
        self._rebuilt.add(view)

    # ------------------------------------------------------------------ sealed requests
    def _unseal(self, ev: dict) -> dict:
        if self.keystore is None:
            raise Rejected("sealed request: no key store configured")

        if self._keys is None or self._keys.keystore is not self.keystore:
            self._keys = KeyCache(self.keystore)
        try:
            plain = unseal(ev, self._keys)
        except SealError as exc:
            raise Rejected(str(exc)) from None
        if plain is None:
            raise Rejected(ERASED)
        return plain

    # ------------------------------------------------------------------ handlers
    def _opened(self, db: sqlite3.Connection, ev: dict) -> None:
        exid = ev["execution_id"]
        ex = self._get(db, exid)
        self._refuse_view(db, ex, exid, "execution_opened")
        if ex is not None:
            raise Rejected(f"execution {exid!r} was already opened")
        db.execute("INSERT INTO executions VALUES (?,?,?,?,?,?,?,?,?,NULL,NULL,NULL,0)",
                   (exid, ev["task_id"], ev["deadline"], ev["policy"], ev.get("tokenizer"), ev.get("origin"),
                    ev.get("collection_run_id"), ev.get("metadata"), ev["occurred_at"]))
        ex = _Exec(Tree(), False, set())
        ex.stats_dirty = True
        self._cache[exid] = ex
        self._touch(exid, ex)
        self._changed.add(exid)

    def _request(self, db: sqlite3.Connection, ev: dict) -> None:
        exid, rid = ev["execution_id"], ev["request_id"]
        ex = self._get(db, exid)
        if ex is None or ex.view:
            self._refuse_view(db, ex, exid, f"request {rid!r}")
            raise Rejected(f"request {rid!r} for unknown execution {exid!r} (no execution_opened before it)")
        if ex.closed:
            raise Rejected(f"execution {exid!r} is closed; request {rid!r} after closure ignored")
        tree = ex.tree
        if rid in tree.requests:
            raise Rejected(f"duplicate request id {rid!r} in execution {exid!r}")
        if ev.get("sealed") is not None:
            ev = self._unseal(ev)
        out = ev["output_ids"] or b""
        logprobs = ev.get("output_logprobs")
        if logprobs is not None and len(logprobs) != len(out):
            raise Rejected(f"request {rid!r}: {len(logprobs) // 4} log-probs for {len(out) // 4} output tokens")
        ref = ev.get("input_prefix")
        if ref is not None:
            try:
                prefix = tree.resolve_prefix(ref["request_id"], int(ref["length"]), ref["sha256"])
            except PrefixReferenceError as exc:
                raise Rejected(f"request {rid!r}: {exc}") from None
            inp = prefix + (ev.get("input_suffix_ids") or b"")
        elif ev.get("input_ids") is not None:
            inp = ev["input_ids"]
        else:
            raise Rejected(f"request {rid!r} has neither input_ids nor input_prefix")
        generator = ev.get("generator") or "policy"
        reconstructed = bool(ev.get("reconstructed"))
        seq = len(tree.requests)
        res = tree.insert(rid, seq, inp, out, logprobs, output_flag(generator, reconstructed),
                          hint=ev.get("parent_request_id"))
        ex.dirty.update(n.id for n in res.changed)
        ex.stats_dirty = True
        self._touched[exid] = ex
        self._changed.add(exid)
        self._request_rows.append((
            exid, rid, res.node.id, ev.get("agent_id") or "main", ev.get("agent_tier") or "main",
            ev.get("turn_kind") or "task", generator, int(reconstructed), ev.get("parent_request_id"),
            len(inp) >> 2, len(out) >> 2, _json_list(ev.get("consumed_tool_call_ids")),
            _json_list(ev.get("emitted_tool_call_ids")), seq))

    def _tool_payload(self, db: sqlite3.Connection, ev: dict) -> None:
        exid = ev["execution_id"]
        ex = self._get(db, exid)
        if ex is None or ex.view:
            self._refuse_view(db, ex, exid, f"tool payload {ev['call_id']!r}")
            raise Rejected(f"tool payload {ev['call_id']!r} for unknown execution {exid!r}")
        if ex.payload_keys is None:
            ex.payload_keys = set(db.execute("SELECT call_id, kind FROM tool_payloads WHERE execution_id = ?", (exid,)))
        key = (ev["call_id"], ev["kind"])
        if key in ex.payload_keys:
            raise Rejected(f"duplicate tool payload ({ev['call_id']!r}, {ev['kind']}) in execution {exid!r}")
        ex.payload_keys.add(key)
        self._touched[exid] = ex  # keep it cached until the rows are written
        self._payload_rows.append((exid, ev["call_id"], ev["kind"], ev["payload"]))

    def _closed(self, db: sqlite3.Connection, ev: dict) -> None:
        exid = ev["execution_id"]
        ex = self._get(db, exid)
        if ex is None or ex.view:
            self._refuse_view(db, ex, exid, "execution_closed")
            raise Rejected(f"closure of unknown execution {exid!r}")
        if ex.closed:
            raise Rejected(f"execution {exid!r} was already closed")
        db.execute("UPDATE executions SET closed_status = ?, closed_at_us = ?, artifact_versions = ? WHERE execution_id = ?",
                   (ev["status"], ev["occurred_at"], json.dumps(list(ev.get("artifact_versions") or [])), exid))
        ex.closed = True
        self._changed.add(exid)

    def _finalized(self, db: sqlite3.Connection, ev: dict) -> None:
        exid = ev["execution_id"]
        ex = self._get(db, exid)
        if ex is None or ex.view:
            self._refuse_view(db, ex, exid, "execution_finalized")
            raise Rejected(f"finalization of unknown execution {exid!r}")
        db.execute("UPDATE executions SET finalized = 1 WHERE execution_id = ?", (exid,))
        self._changed.add(exid)

    def _record_derived(self, db: sqlite3.Connection, ev: dict) -> None:
        self._derived.add(ev["derived_execution_id"])  # built in finish(), once the lineage row is in


_enc = json.encoder.encode_basestring_ascii  # the C encoder json.dumps uses for str


def _json_list(values) -> str:
    """``json.dumps(list_of_str)`` (same text), without the encoder's per-call overhead."""
    return "[" + ", ".join(map(_enc, values)) + "]" if values else "[]"


_HANDLERS = {
    "execution_opened": TreeProjection._opened,
    "request": TreeProjection._request,
    "tool_payload": TreeProjection._tool_payload,
    "execution_closed": TreeProjection._closed,
    "execution_finalized": TreeProjection._finalized,
    "record_derived": TreeProjection._record_derived,
    "withdrawal": TreeProjection._withdrawal,
    "task_registered": TreeProjection._task_registered,
}
TreeProjection.event_types = frozenset(_HANDLERS)  # the engine calls apply only for these


def _load(db: sqlite3.Connection, execution_id: str) -> Tree:
    nodes = db.execute("SELECT node_id, parent, origin_request_id, tokens, flags, logprobs FROM tree_nodes "
                       "WHERE execution_id = ?", (execution_id,)).fetchall()
    reqs = db.execute("SELECT request_id, node_id, seq FROM tree_requests WHERE execution_id = ?",
                      (execution_id,)).fetchall()
    st = db.execute("SELECT stored_tokens, expanded_tokens FROM tree_stats WHERE execution_id = ?",
                    (execution_id,)).fetchone()
    return Tree.from_rows(nodes, reqs, *(st or (None, None)))


# ====================================================================== read API


@dataclass(frozen=True)
class TreeNode:
    node_id: int  # renumbered: parents before children, in recording order
    parent: int | None  # None for a child of the root
    origin_request_id: str
    tokens: np.ndarray  # uint32
    flags: np.ndarray  # uint8 (FLAG_OUTPUT | FLAG_CANDIDATE)
    logprobs: np.ndarray  # float32, NaN where not an output
    stored_id: int  # node_id in the tree_nodes table

    @property
    def target(self) -> np.ndarray:
        """0/1 per token: policy target candidate."""
        return ((self.flags & FLAG_CANDIDATE) != 0).astype(np.uint8)


@dataclass(frozen=True)
class TreeRequest:
    request_id: str
    node_id: int  # renumbered
    agent_id: str
    agent_tier: str
    turn_kind: str
    generator: str
    reconstructed: bool
    parent_request_id: str | None
    input_len: int
    output_len: int
    consumed_tool_call_ids: list[str]
    emitted_tool_call_ids: list[str]
    seq: int

    @property
    def role_class(self) -> str:
        return f"{self.agent_tier}/{self.turn_kind}"


@dataclass
class LoadedTree:
    execution_id: str
    nodes: list[TreeNode]
    requests: dict[str, TreeRequest]  # in recording (seq) order
    stats: dict
    children: dict[int | None, list[int]] = field(default_factory=dict)

    def path_nodes(self, node_id: int) -> list[int]:
        out = []
        cur: int | None = node_id
        while cur is not None:
            out.append(cur)
            cur = self.nodes[cur].parent
        out.reverse()
        return out

    def path(self, request_id: str) -> np.ndarray:
        parts = [self.nodes[n].tokens for n in self.path_nodes(self.requests[request_id].node_id)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=U32)


def execution_row(db: sqlite3.Connection, execution_id: str) -> dict | None:
    cur = db.execute("SELECT * FROM executions WHERE execution_id = ?", (execution_id,))
    row = cur.fetchone()
    if row is None:
        return None
    out = dict(zip([d[0] for d in cur.description], row))
    out["artifact_versions"] = json.loads(out["artifact_versions"]) if out["artifact_versions"] else []
    return out


def tree_stats(db: sqlite3.Connection, execution_id: str) -> dict:
    """Per-execution counts (SPEC §6.1): requests, nodes, stored, expanded, ratio."""
    row = db.execute("SELECT requests, nodes, stored_tokens, expanded_tokens FROM tree_stats WHERE execution_id = ?",
                     (execution_id,)).fetchone()
    if row is None:
        raise KeyError(f"no prefix tree for execution {execution_id!r} (never opened, or not projected yet)")
    req, nodes, stored, expanded = row
    return {"requests": req, "nodes": nodes, "stored_tokens": stored, "expanded_tokens": expanded,
            "ratio": (stored / expanded) if expanded else None}


def _list(text: str) -> list:
    return [] if text == "[]" else json.loads(text)  # most requests consume / emit no tool call


def load_tree(db: sqlite3.Connection, execution_id: str) -> LoadedTree:
    """The execution's tree, nodes renumbered parent-before-child (raises KeyError if unknown)."""
    stats = tree_stats(db, execution_id)
    tree = _load(db, execution_id)
    ordered = creation_order(tree.nodes)
    new_id = {n.id: i for i, n in enumerate(ordered)}
    nodes = [TreeNode(i, None if n.parent is None else new_id[n.parent.id], n.origin, n.tokens, n.flags, n.logprobs, n.id)
             for i, n in enumerate(ordered)]
    children: dict[int | None, list[int]] = {}
    for n in nodes:
        children.setdefault(n.parent, []).append(n.node_id)
    tree.release()  # only its blobs live on (in `nodes`); free the rest now
    requests: dict[str, TreeRequest] = {}
    for r in db.execute("SELECT request_id, node_id, agent_id, agent_tier, turn_kind, generator, reconstructed, "
                        "parent_request_id, input_len, output_len, consumed_tool_call_ids, emitted_tool_call_ids, seq "
                        "FROM tree_requests WHERE execution_id = ? ORDER BY seq", (execution_id,)):
        requests[r[0]] = TreeRequest(r[0], new_id[r[1]], r[2], r[3], r[4], r[5], bool(r[6]), r[7], r[8], r[9],
                                     _list(r[10]), _list(r[11]), r[12])
    return LoadedTree(execution_id, nodes, requests, stats, children)


def tree_json(db: sqlite3.Connection, execution_id: str) -> dict:
    """The SPEC §7.2 ``ledger tree --json`` document."""
    t = load_tree(db, execution_id)
    return {
        "execution_id": execution_id,
        "nodes": [{"node_id": n.node_id, "parent": n.parent, "tokens": n.tokens.tolist(), "target": n.target.tolist()}
                  for n in t.nodes],
        "requests": {rid: r.node_id for rid, r in t.requests.items()},
        "stored_tokens": t.stats["stored_tokens"],
        "expanded_tokens": t.stats["expanded_tokens"],
    }


def tree_view(db: sqlite3.Connection, execution_id: str, context_only_request_ids: Iterable[str] = ()) -> TreeView:
    """The tree as :class:`ledger.algorithms.path_draws.TreeView`: candidate masks (outputs of
    ``context_only_request_ids`` turned into context) and the candidate leaves."""
    t = load_tree(db, execution_id)
    context_only = set(context_only_request_ids)
    return view_of(t, [np.zeros(n.tokens.shape[0], dtype=np.uint8) if n.origin_request_id in context_only else n.target
                       for n in t.nodes])


def request_path(db: sqlite3.Connection, execution_id: str, request_id: str) -> np.ndarray:
    """A request's full input+output tokens (its root-to-node path)."""
    row = db.execute("SELECT node_id FROM tree_requests WHERE execution_id = ? AND request_id = ?",
                     (execution_id, request_id)).fetchone()
    if row is None:
        raise KeyError(f"no request {request_id!r} in execution {execution_id!r} (or not projected yet)")
    parts = []
    node: int | None = row[0]
    while node is not None:
        parent, tok = db.execute("SELECT parent, tokens FROM tree_nodes WHERE execution_id = ? AND node_id = ?",
                                 (execution_id, node)).fetchone()
        parts.append(as_tokens(tok))
        node = parent
    parts.reverse()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=U32)


def request_tool_payloads(db: sqlite3.Connection, execution_id: str) -> dict[str, dict[str, list[dict]]]:
    """Per request: the tool payloads it ``emitted`` and ``consumed`` (by call id).

    Each entry is ``{"call_id", "kind", "payload"}`` (payload decoded JSON); a call id with
    no cached payload appears with ``kind: None, payload: None`` so capture gaps show.
    """
    payloads: dict[str, list[dict]] = {}
    for call_id, kind, payload in db.execute(
            "SELECT call_id, kind, payload FROM tool_payloads WHERE execution_id = ? ORDER BY call_id, kind", (execution_id,)):
        payloads.setdefault(call_id, []).append({"call_id": call_id, "kind": kind, "payload": json.loads(payload)})
    out: dict[str, dict[str, list[dict]]] = {}
    for rid, consumed, emitted in db.execute(
            "SELECT request_id, consumed_tool_call_ids, emitted_tool_call_ids FROM tree_requests "
            "WHERE execution_id = ? ORDER BY seq", (execution_id,)):
        entry = {}
        for name, ids in (("emitted", json.loads(emitted)), ("consumed", json.loads(consumed))):
            entry[name] = [p for c in ids for p in payloads.get(c, [{"call_id": c, "kind": None, "payload": None}])]
        out[rid] = entry
    return out


def tree_text(db: sqlite3.Connection, execution_id: str, *, preview: int = 6, max_nodes: int = 2000) -> str:
    """A readable indented view of the tree."""
    t = load_tree(db, execution_id)
    s = t.stats
    ratio = f"{s['ratio']:.3f}" if s["ratio"] is not None else "-"
    lines = [f"execution {execution_id}: {s['requests']} requests, {s['nodes']} nodes, "
             f"stored {s['stored_tokens']:,} / expanded {s['expanded_tokens']:,} tokens (ratio {ratio})"]
    by_node: dict[int, list[TreeRequest]] = {}
    for r in t.requests.values():
        by_node.setdefault(r.node_id, []).append(r)
    stack: list[tuple[int, int]] = [(c, 0) for c in reversed(t.children.get(None, []))]
    shown = 0
    while stack:
        nid, depth = stack.pop()
        n = t.nodes[nid]
        shown += 1
        if shown > max_nodes:
            lines.append(f"... ({len(t.nodes) - max_nodes} more nodes)")
            break
        out = int(np.count_nonzero(n.flags & FLAG_OUTPUT))
        tgt = int(np.count_nonzero(n.flags & FLAG_CANDIDATE))
        toks = n.tokens
        if toks.shape[0] > 2 * preview:
            prev = " ".join(map(str, toks[:preview].tolist())) + " … " + " ".join(map(str, toks[-preview:].tolist()))
        else:
            prev = " ".join(map(str, toks.tolist()))
        head = f"{'  ' * depth}#{nid} {toks.shape[0]} tok (ctx {toks.shape[0] - out}, out {out}, target {tgt}) from {n.origin_request_id}"
        reqs = by_node.get(nid, [])
        if reqs:
            head += " ← " + ", ".join(
                f"{r.request_id} [{r.agent_id} {r.role_class} {r.generator}{' reconstructed' if r.reconstructed else ''}]"
                for r in reqs)
        lines.append(head)
        lines.append(f"{'  ' * depth}   [{prev}]")
        for c in reversed(t.children.get(nid, [])):
            stack.append((c, depth + 1))
    return "\n".join(lines)
