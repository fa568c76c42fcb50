"""ATIF export (SPEC §7.7): one execution of the prefix-tree projection as ATIF trajectories.

:func:`build_atif` builds the documents (plain dicts, each validated by the ``atif``
package's pydantic ``Trajectory``); it reads the projection database only (the tree
projection holds the opened, unsealed tokens) and writes nothing.  Writing the files is the
caller's job (``ledger export-atif``: temporary files renamed into place).

Layout, chosen so that ``import-atif`` of the result rebuilds the **same** prefix tree
(same node segments, flags and log-probs, same branches, same number of requests per node):

* every request becomes one agent step carrying ``metrics.prompt_token_ids`` (the whole
  input), ``completion_token_ids`` and ``logprobs`` (omitted when the output has none: not a
  policy output, or ``reconstructed``), exactly the fields the importer reads; its ledger
  identity (request id, agent, tier, turn kind, generator, reconstructed, tool-call ids) goes
  to ``step.extra["ledger"]`` (the importer keeps generator, reconstructed and turn kind);
  emitted tool calls with a cached ``call`` payload become ``tool_calls``, their cached
  results ``observation.results``;
* the main agent (``agent_id`` ``main``, else the first main-tier agent) is the root
  trajectory; every other agent is a sub-trajectory embedded in ``subagent_trajectories`` of
  the trajectory holding its anchor step (the latest request of its parent's agent recorded
  before its first call; an agent step with ``llm_call_count: 0`` when there is none), and
  referenced from that step's observation;
* **branches**: an agent's request continues a branch when its input runs into the
  output of that branch's latest request (the longest such match wins, the branch ending at
  its ``parent_request_id`` among equally long ones); any other request
  (an independent sample of the same context, a history restarted by compaction) opens a
  new branch.  With file output (``root_name``) every further branch is its own
  continuation trajectory, written beside the root as ``<stem>.cont-N.json`` (a
  sub-agent's as ``<stem>.subK.cont-N.json``) and chained by ``continued_trajectory_ref``;
  for a single document (``root_name=None``, ``--out -``) the branches stay inline, in
  recording order.

Before returning, the export replays the order in which ``import-atif`` will record the
steps (and the parent hint it gives a sub-agent's first call) through the pure prefix tree
(:class:`ledger.algorithms.prefix_match.Tree`) and compares its shape with the projected
tree (:func:`tree_shape`).  When the continuation layout would not rebuild it (a branch that
depends on a later one's output), the branches are written inline instead; when no layout
would, :class:`AtifExportError` is raised and nothing is returned.

Refused (:class:`AtifExportError`): an execution whose tokens were erased (a withdrawal with
``erase`` covers it, or its data key was destroyed), one whose sealed requests the projection
could not open, one with no request in its tree, a request with an empty input (ATIF's
importer needs ``prompt_token_ids``).  An unknown execution raises ``KeyError`` (from the
tree projection's read API).
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ledger.algorithms.errors import InputError
from ledger.algorithms.prefix_match import Tree, common_prefix, output_flag
from ledger.projections.tree import LoadedTree, execution_row, load_tree
from atif import Trajectory
from ledger.projections.governance import erased

__all__ = ["AtifExport", "AtifExportError", "SCHEMA_VERSION", "build_atif", "continuation_name", "tree_shape"]

SCHEMA_VERSION = "ATIF-v1.8"  # the version of the `atif` models that validate the output


class AtifExportError(InputError):
    """The execution cannot be exported as ATIF (nothing was built)."""


@dataclass
class AtifExport:
    execution_id: str
    documents: list[tuple[str | None, dict]]  # (file name beside the root, None for the root itself; document)
    import_order: list[str]  # original request ids in the order import-atif records them
    summary: dict = field(default_factory=dict)

    @property
    def root(self) -> dict:
        return self.documents[0][1]


@dataclass
class _Req:
    rid: str
    agent: str
    tier: str
    kind: str
    generator: str
    reconstructed: bool
    parent: str | None
    seq: int
    inp: np.ndarray
    out: np.ndarray
    lp: np.ndarray | None  # float32, None when the output carries no log-probs
    consumed: list[str]
    emitted: list[str]

    @property
    def path(self) -> np.ndarray:
        return np.concatenate((self.inp, self.out))


@dataclass
class _Doc:
    agent: str
    rids: list[str]
    index: int  # branch number of the agent (0 = first)
    subs: dict[str | None, list[str]] = field(default_factory=dict)  # anchor request (None: before the first) -> agents
    next: "_Doc | None" = None
    name: str | None = None  # continuation file name (None: root / embedded)
    trajectory_id: str = ""


def continuation_name(root_name: str, label: str | None, n: int) -> str:
    """File name of the ``n``-th continuation (1-based) of the root (``label`` None) or of
    sub-agent ``label``, beside a root file named ``root_name``."""
    stem = root_name[:-5] if root_name.endswith(".json") else root_name
    return f"{stem}.{label + '.' if label else ''}cont-{n}.json"


# ---------------------------------------------------------------------------- reading the projection
def _check_readable(db: sqlite3.Connection, execution_id: str, tree: LoadedTree, keystore) -> None:
    try:
        if erased(db, execution_id):
            raise AtifExportError(f"the tokens of execution {execution_id!r} were erased (a withdrawal with --erase "
                                  f"covers it): nothing to export")
        keys = [k for (k,) in db.execute("SELECT key_id FROM sealed_keys WHERE execution_id = ?", (execution_id,))]
    except sqlite3.OperationalError:  # no governance tables in this database
        keys = []
    if keys and keystore is not None and any(keystore.key_by_id(k) is None for k in keys):
        raise AtifExportError(f"the tokens of execution {execution_id!r} were erased (its data key was destroyed): "
                              f"nothing to export")
    if not tree.requests:
        if keys:
            raise AtifExportError(f"execution {execution_id!r} has sealed requests the projection could not open "
                                  f"(no data-key store?): run `ledger project --rebuild` in the store")
        raise AtifExportError(f"execution {execution_id!r} has no requests in its prefix tree: nothing to export")


def _requests(tree: LoadedTree) -> list[_Req]:
    out = []
    for rid, r in tree.requests.items():  # recording (seq) order
        nodes = [tree.nodes[n] for n in tree.path_nodes(r.node_id)]
        tokens = np.concatenate([n.tokens for n in nodes]) if nodes else np.zeros(0, dtype=np.uint32)
        if tokens.shape[0] != r.input_len + r.output_len:
            raise AtifExportError(f"request {rid!r}: its tree path holds {tokens.shape[0]} tokens, expected "
                                  f"{r.input_len} + {r.output_len}")
        if r.input_len == 0:
            raise AtifExportError(f"request {rid!r} has an empty input: ATIF steps need prompt_token_ids")
        lps = np.concatenate([n.logprobs for n in nodes])[r.input_len:].astype(np.float32)
        lp = None if (lps.shape[0] and np.isnan(lps).any()) else lps
        if lp is None and r.generator == "policy" and not r.reconstructed:
            raise AtifExportError(f"request {rid!r}: a policy output without log-probs")
        out.append(_Req(rid, r.agent_id, r.agent_tier, r.turn_kind, r.generator, r.reconstructed, r.parent_request_id,
                        r.seq, tokens[:r.input_len].copy(), tokens[r.input_len:].copy(), lp,
                        list(r.consumed_tool_call_ids), list(r.emitted_tool_call_ids)))
    return out


def _payloads(db: sqlite3.Connection, execution_id: str) -> dict[tuple[str, str], Any]:
    return {(c, k): json.loads(p) for c, k, p in db.execute(
        "SELECT call_id, kind, payload FROM tool_payloads WHERE execution_id = ?", (execution_id,))}


# ---------------------------------------------------------------------------- layout
def _branches(reqs: list[_Req], split: bool) -> list[list[_Req]]:
    if not split:
        return [list(reqs)]
    branches: list[list[_Req]] = []
    ends: list[np.ndarray] = []
    for r in reqs:
        best, best_key = None, (-1, False)
        for i, b in enumerate(branches):
            last = b[-1]
            n = common_prefix(ends[i], r.inp)
            key = (n, last.rid == r.parent)  # equally long (identical samples): the producer's parent hint decides
            if (n > last.inp.shape[0] or n == ends[i].shape[0]) and key > best_key:
                best, best_key = i, key
        if best is None:
            branches.append([r])
            ends.append(r.path)
        else:
            branches[best].append(r)
            ends[best] = r.path
    return branches


def _layout(reqs: list[_Req], split: bool) -> tuple[str, dict[str, list[_Doc]]]:
    by_id = {r.rid: r for r in reqs}
    agents: dict[str, list[_Req]] = {}
    for r in reqs:
        agents.setdefault(r.agent, []).append(r)
    main = "main" if "main" in agents else next((a for a, rs in agents.items() if rs[0].tier == "main"),
                                                 next(iter(agents)))
    docs: dict[str, list[_Doc]] = {}
    where: dict[str, _Doc] = {}  # request id -> the document holding its step
    for agent, rs in agents.items():
        chain = [_Doc(agent, [r.rid for r in b], i) for i, b in enumerate(_branches(rs, split))]
        for a, b in zip(chain, chain[1:]):
            a.next = b
        docs[agent] = chain
        for d in chain:
            for rid in d.rids:
                where[rid] = d
    for agent, rs in agents.items():  # anchor every other agent (agents in order of their first call)
        if agent == main:
            continue
        first = rs[0]
        parent = by_id.get(first.parent) if first.parent else None
        host = parent.agent if parent is not None and parent.agent != agent and parent.seq < first.seq else main
        before = [r for r in agents[host] if r.seq < first.seq]
        if before:
            anchor = before[-1].rid
            where[anchor].subs.setdefault(anchor, []).append(agent)
        else:
            docs[host][0].subs.setdefault(None, []).append(agent)
    return main, docs


def _import_order(main: str, docs: dict[str, list[_Doc]]) -> list[tuple[str, str | None]]:
    """(request id, parent hint) in the order ``import-atif`` records them (its ``_segment`` walk)."""
    out: list[tuple[str, str | None]] = []
    last_main: list[str | None] = [None]

    def walk(doc: _Doc, hint: str | None) -> None:
        first = True
        steps: list[str | None] = ([None] if None in doc.subs else []) + list(doc.rids)
        for rid in steps:
            if rid is not None:
                out.append((rid, hint if first else None))
                first = False
                if doc.agent == main:
                    last_main[0] = rid
            for sub in doc.subs.get(rid, ()):
                walk(docs[sub][0], last_main[0] if doc.agent == main else None)
        if doc.next is not None:
            walk(doc.next, None)

    walk(docs[main][0], None)
    return out


def _replay(order: list[tuple[str, str | None]], by_id: dict[str, _Req]) -> Tree:
    tree = Tree()
    for seq, (rid, hint) in enumerate(order):
        r = by_id[rid]
        tree.insert(rid, seq, r.inp, r.out, r.lp, output_flag(r.generator, r.reconstructed), hint=hint)
    return tree


def tree_shape(tree: LoadedTree | Tree) -> str:
    """A digest of a prefix tree that ignores node and request ids: every node's tokens, flags
    and log-probs, how many requests end there, and (unordered) its children.  Equal digests =
    the same tree (what an ATIF round trip must preserve)."""
    if isinstance(tree, Tree):
        nodes = [(n.id, None if n.parent is None else n.parent.id, n.raw, n.flag, n.lp) for n in tree.nodes]
        ends = [n.id for n in tree.requests.values()]
    else:
        nodes = [(n.node_id, n.parent, np.ascontiguousarray(n.tokens, dtype=np.uint32).tobytes(),
                  np.ascontiguousarray(n.flags, dtype=np.uint8).tobytes(),
                  np.ascontiguousarray(n.logprobs, dtype=np.float32).tobytes()) for n in tree.nodes]
        ends = [r.node_id for r in tree.requests.values()]
    count: dict[int, int] = {}
    for e in ends:
        count[e] = count.get(e, 0) + 1
    kids: dict[int | None, list[int]] = {}
    info = {}
    for nid, parent, tok, fl, lp in nodes:
        kids.setdefault(parent, []).append(nid)
        info[nid] = (tok, fl, lp)
    digest: dict[int, bytes] = {}
    order: list[int] = []
    stack = list(kids.get(None, ()))
    while stack:  # parents first; digests are computed children first (reversed)
        n = stack.pop()
        order.append(n)
        stack.extend(kids.get(n, ()))
    for n in reversed(order):
        tok, fl, lp = info[n]
        h = hashlib.sha256()
        for part in (tok, fl, lp, str(count.get(n, 0)).encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        for d in sorted(digest[c] for c in kids.get(n, ())):
            h.update(d)
        digest[n] = h.digest()
    top = hashlib.sha256()
    for d in sorted(digest[c] for c in kids.get(None, ())):
        top.update(d)
    return top.hexdigest()


# ---------------------------------------------------------------------------- documents
def _tool_call(cid: str, payload: Any) -> dict:
    name, args, extra = None, payload, None
    if isinstance(payload, dict):
        fn = payload.get("function") if isinstance(payload.get("function"), dict) else payload
        name = fn.get("function_name") or fn.get("name")
        args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else {"raw": args}
    if not isinstance(args, dict):
        args = {"value": args}
    if not isinstance(name, str) or not name:
        name, extra = "unknown", {"ledger_payload": payload}
    out = {"tool_call_id": cid, "function_name": name, "arguments": args}
    if extra:
        out["extra"] = extra
    return out


def _result(cid: str, payload: Any) -> dict:
    if isinstance(payload, dict) and isinstance(payload.get("content"), str):
        out: dict = {"source_call_id": cid, "content": payload["content"]}
        rest = {k: v for k, v in payload.items() if k != "content"}
        if rest:
            out["extra"] = rest
        return out
    return {"source_call_id": cid, "content": json.dumps(payload, sort_keys=True, ensure_ascii=False)}


def _float(x: float) -> float:
    if not math.isfinite(x):  # cannot happen for stored log-probs (checked at ingest); JSON has no NaN
        raise AtifExportError(f"non-finite log-prob {x}")
    return x


def _step(step_id: int, r: _Req, payloads: dict, refs: list[dict]) -> dict:
    calls = [_tool_call(c, payloads[(c, "call")]) for c in r.emitted if (c, "call") in payloads]
    results = [_result(tc["tool_call_id"], payloads[(tc["tool_call_id"], "result")]) for tc in calls
               if (tc["tool_call_id"], "result") in payloads]
    metrics: dict[str, Any] = {"prompt_tokens": int(r.inp.shape[0]), "completion_tokens": int(r.out.shape[0]),
                               "prompt_token_ids": r.inp.tolist(), "completion_token_ids": r.out.tolist()}
    if r.lp is not None:
        metrics["logprobs"] = [_float(x) for x in r.lp.tolist()]
    step: dict[str, Any] = {"step_id": step_id, "source": "agent", "message": "", "metrics": metrics,
                            "extra": {"ledger": {"request_id": r.rid, "agent_id": r.agent, "agent_tier": r.tier,
                                                 "turn_kind": r.kind, "generator": r.generator,
                                                 "reconstructed": r.reconstructed, "parent_request_id": r.parent,
                                                 "consumed_tool_call_ids": r.consumed,
                                                 "emitted_tool_call_ids": r.emitted}}}
    if calls:
        step["tool_calls"] = calls
    if results or refs:
        step["observation"] = {"results": results + refs}
    return step


def _choose_layout(execution_id: str, reqs: list, by_id: dict, want, root_name: str | None) -> tuple:
    """``(split, main, docs, order)``: continuations first (if files are named), else inline; the
    first layout whose import order replays into the same tree shape."""
    for split in ((True, False) if root_name is not None else (False,)):
        main, docs = _layout(reqs, split)
        order = _import_order(main, docs)
        if len(order) == len(reqs) and tree_shape(_replay(order, by_id)) == want:
            return split, main, docs, order
    raise AtifExportError(f"execution {execution_id!r}: no ATIF layout makes import-atif rebuild the same tree "
                          f"(a sub-agent's calls interleave with calls they depend on)")


def _execution_meta(row: dict) -> tuple[Any, dict]:
    """The execution's metadata (parsed JSON or None) and the ATIF agent it names (or ``{}``)."""
    try:
        meta = json.loads(row.get("metadata") or "null")
    except ValueError:
        meta = None
    atif_agent = ((meta or {}).get("atif") or {}).get("agent") if isinstance(meta, dict) else None
    return meta, atif_agent if isinstance(atif_agent, dict) else {}


def _name_documents(execution_id: str, main: str, docs: dict, root_name: str | None) -> None:
    """Trajectory ids and file names of every document."""
    labels = {a: f"sub{i}" for i, a in enumerate((a for a in docs if a != main), 1)}
    for agent, chain in docs.items():  # ids and file names
        label = None if agent == main else labels[agent]
        base = execution_id if label is None else f"{execution_id}/{label}"
        for d in chain:
            d.trajectory_id = base if d.index == 0 else f"{base}/cont-{d.index}"
            if d.index and root_name is not None:
                d.name = continuation_name(root_name, label, d.index)


def _root_extra(execution_id: str, row: dict, meta: Any, branches: int, split: bool) -> dict:
    """The ``extra`` of the root document: the execution's row as the ledger keeps it."""
    extra = {"execution_id": execution_id, "task_id": row.get("task_id"), "policy": row.get("policy"),
             "tokenizer": row.get("tokenizer"), "origin": row.get("origin"),
             "collection_run_id": row.get("collection_run_id"), "metadata": meta,
             "branches": branches, "layout": "continuations" if split else "inline"}
    out = {"task_id": row.get("task_id"), "ledger": extra}
    if row.get("closed_status"):
        out["status"] = row["closed_status"]
    return out


def _validate_documents(documents: list[tuple[str | None, dict]]) -> None:
    for name, doc in documents:  # every document validates with the atif models
        try:
            Trajectory.model_validate(doc)
        except ValueError as exc:  # pydantic.ValidationError is a ValueError
            first = str(exc).splitlines()
            raise AtifExportError(f"{name or 'root'}: not a valid ATIF trajectory: {' '.join(first[:3])}") from None


def _summary(execution_id: str, requests: int, docs: dict, split: bool, documents: int, want) -> dict:
    return {"execution_id": execution_id, "requests": requests, "agents": len(docs),
            "subagents": len(docs) - 1, "branches": {a: len(c) for a, c in docs.items()},
            "layout": "continuations" if split else "inline", "documents": documents,
            "tree_shape": want}


def build_atif(db: sqlite3.Connection, execution_id: str, *, keystore=None,
               root_name: str | None = "trajectory.json") -> AtifExport:
    """The ATIF documents of one projected execution (see the module docstring).

    ``root_name``: the root file's name; continuation files are named after it (see
    :func:`continuation_name`).  ``None``: one self-contained document, branches inline.
    ``keystore`` (the store's data keys, optional) lets an erased execution be recognised by
    its destroyed key.  Raises ``KeyError`` (unknown execution) or :class:`AtifExportError`."""

    tree = load_tree(db, execution_id)
    _check_readable(db, execution_id, tree, keystore)
    row = execution_row(db, execution_id) or {}
    reqs = _requests(tree)
    by_id = {r.rid: r for r in reqs}
    want = tree_shape(tree)
    split, main, docs, order = _choose_layout(execution_id, reqs, by_id, want, root_name)
    payloads = _payloads(db, execution_id)
    meta, atif_agent = _execution_meta(row)
    policy = row.get("policy")
    _name_documents(execution_id, main, docs, root_name)

    def agent_json(agent: str) -> dict:
        tier = by_id[docs[agent][0].rids[0]].tier if docs[agent][0].rids else "main"
        if agent == main:
            name = atif_agent.get("name") if isinstance(atif_agent.get("name"), str) else agent
            version = atif_agent.get("version") if isinstance(atif_agent.get("version"), str) else "unknown"
        else:
            name, version = agent, "unknown"
        out = {"name": name, "version": version, "extra": {"ledger": {"agent_id": agent, "agent_tier": tier}}}
        if policy:
            out["model_name"] = policy
        return out

    def doc_json(d: _Doc) -> dict:
        steps = []
        embedded = []

        def refs_for(anchor: str | None) -> list[dict]:
            out = []
            for sub in d.subs.get(anchor, ()):
                embedded.append(doc_json(docs[sub][0]))
                out.append({"subagent_trajectory_ref": [{"trajectory_id": docs[sub][0].trajectory_id,
                                                         "extra": {"agent_id": sub}}]})
            return out

        if None in d.subs:
            steps.append({"step_id": 1, "source": "agent", "message": "", "llm_call_count": 0,
                          "observation": {"results": refs_for(None)},
                          "extra": {"ledger": {"note": "delegation before the agent's first call"}}})
        for rid in d.rids:
            steps.append(_step(len(steps) + 1, by_id[rid], payloads, refs_for(rid)))
        rs = [by_id[r] for r in d.rids]
        doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION, "session_id": execution_id, "trajectory_id": d.trajectory_id,
            "agent": agent_json(d.agent), "steps": steps,
            "final_metrics": {"total_prompt_tokens": sum(int(r.inp.shape[0]) for r in rs),
                              "total_completion_tokens": sum(int(r.out.shape[0]) for r in rs),
                              "total_steps": len(steps)},
        }
        if d.agent == main and d.index == 0:
            doc["notes"] = ("exported by the trajectory ledger from the prefix tree of execution "
                            f"{execution_id}: token IDs and log-probs per step are exact; message texts are not kept")
            doc["extra"] = _root_extra(execution_id, row, meta, len(docs[main]), split)
        else:
            doc["extra"] = {"ledger": {"part_of_execution": execution_id, "agent_id": d.agent, "branch": d.index}}
        if embedded:
            doc["subagent_trajectories"] = embedded
        if d.next is not None and split:
            doc["continued_trajectory_ref"] = d.next.name
        return doc

    documents: list[tuple[str | None, dict]] = [(None, doc_json(docs[main][0]))]
    if split:
        documents += [(d.name, doc_json(d)) for chain in docs.values() for d in chain[1:]]
    _validate_documents(documents)
    return AtifExport(execution_id, documents, [rid for rid, _ in order],
                      _summary(execution_id, len(reqs), docs, split, len(documents), want))
