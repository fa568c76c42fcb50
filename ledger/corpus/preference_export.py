"""Preference-pair export (SPEC §6.9): one record per pair, the columns TRL's DPO trainer reads.

A ``preference`` route declared under semantics 2 or later emits **pairs**, not paths
(``projections.preference``).  Each record holds exactly::

    member_id, execution_ids [chosen, rejected], task_id, group_id, split, route,
    prompt_ids, chosen_ids, rejected_ids, chosen_logprobs, rejected_logprobs,
    chosen_reward, rejected_reward, criterion, digest

and, when the route was ingested under semantics 3 or later (SPEC 11.5), ``chosen_mask`` and
``rejected_mask``: 1 on each continuation's policy-output tokens (what a DPO trainer should score),
0 on tool results, later prompts and other inputs that the continuation carries.  Routes of
semantics 1-2 keep exactly the fields above, so their published manifests rebuild unchanged.
``prompt_ids`` is the longest common token prefix of the two root-to-leaf paths, and
``chosen_ids`` / ``rejected_ids`` the rest of each path from the first differing token, so
``prompt_ids + chosen_ids`` and ``prompt_ids + rejected_ids`` are paths of the recorded trees.
``*_logprobs`` align with ``*_ids``: the recorded float32 behaviour log-prob of a policy output
token (widened exactly), ``null`` elsewhere.  ``digest`` is SHA-256 of the canonical JSON of
the record without ``digest`` (SPEC §6.6), so a record survives JSON or Parquet with the same
digest.  Records stream in ``member_id`` byte order; trees are loaded once per execution in a
small cache, so memory is bounded by the executions of one task.
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from ledger.algorithms.errors import InputError
from ledger.algorithms.canonical import canonical_json
from ledger.corpus.path_records import member_digest, write_parquet_rows
from ledger.corpus.records import PAIR_FIELDS  # the pair record's fields and their rules (SPEC §6.9)
from ledger.projections.admission import route_definition
from ledger.projections.preference import preference_route
from ledger.projections.preference import pair_rows, side_arrays
from ledger.projections.admission import Evidence
from ledger.corpus.member_lineage import LineageCache
from ledger.projections.tree import FLAG_OUTPUT
from ledger.corpus.formats import schema_for
from ledger.projections.tree import load_tree

__all__ = ["PAIR_FIELDS", "PairSummary", "export_pairs", "is_pair_route", "preference_records", "write_pairs_jsonl",
           "write_pairs_parquet"]



def is_pair_route(db: sqlite3.Connection, route: str) -> bool:
    """True when ``route``'s members are preference pairs (use preference, semantics >= 2)."""

    try:
        return preference_route(route_definition(db, route))
    except (KeyError, sqlite3.OperationalError):
        return False


class _Trees:
    """A small LRU of (LoadedTree, policy-node mask) per execution."""

    def __init__(self, db: sqlite3.Connection, size: int = 16) -> None:
        self.db, self.size = db, size
        self.cache: OrderedDict[str, tuple] = OrderedDict()

    def get(self, ex: str):
        hit = self.cache.get(ex)
        if hit is not None:
            self.cache.move_to_end(ex)
            return hit

        t = load_tree(self.db, ex)
        gens = {rid: r.generator for rid, r in t.requests.items()}
        policy = np.array([gens.get(n.origin_request_id) == "policy" for n in t.nodes], dtype=bool)
        self.cache[ex] = hit = (t, policy)
        while len(self.cache) > self.size:
            self.cache.popitem(last=False)
        return hit


def _logprob_list(lp: np.ndarray) -> list:
    obj = lp.astype(np.float64).astype(object)
    obj[np.isnan(lp)] = None
    return obj.tolist()


def preference_records(db: sqlite3.Connection, route: str, *, evidence=None) -> Iterator[dict]:
    """The route's pair records (SPEC §6.9) in ``member_id`` byte order."""

    if evidence is None:

        evidence = Evidence.discover()
    trees = _Trees(db)
    lineage = _lineage_cache(db, route)
    masks = lineage is not None  # semantics 3+ (SPEC 11.5): the policy-output masks, inside the digest
    cur = pair_rows(db, route)
    while True:
        batch = cur.fetchmany(256)
        if not batch:
            return
        for (mid, task, c_ex, c_leaf, r_ex, r_leaf, n_prompt, n_chosen, n_rejected, c_reward, r_reward,
             criterion) in batch:
            c_tok, c_lp = _side(trees, c_ex, c_leaf, side_arrays)
            r_tok, r_lp = _side(trees, r_ex, r_leaf, side_arrays)
            if c_tok.shape[0] != n_prompt + n_chosen or r_tok.shape[0] != n_prompt + n_rejected or \
                    not np.array_equal(c_tok[:n_prompt], r_tok[:n_prompt]):
                raise RuntimeError(f"pair {mid}: the trees changed since the pair was formed; run the projections "
                                   "up to date first")
            split = group = None
            if evidence.split is not None:
                split, group, _ = evidence.split(db, c_ex)
            rec = {
                "member_id": mid, "execution_ids": [c_ex, r_ex], "task_id": task,
                "group_id": group if group is not None else task, "split": split, "route": route,
                "prompt_ids": c_tok[:n_prompt].tolist(),
                "chosen_ids": c_tok[n_prompt:].tolist(), "rejected_ids": r_tok[n_prompt:].tolist(),
                "chosen_logprobs": _logprob_list(c_lp[n_prompt:]), "rejected_logprobs": _logprob_list(r_lp[n_prompt:]),
                "chosen_reward": None if c_reward is None else float(c_reward),
                "rejected_reward": None if r_reward is None else float(r_reward),
                "criterion": criterion,
            }
            if masks:
                rec["chosen_mask"] = _policy_mask(trees, c_ex, c_leaf, n_prompt)
                rec["rejected_mask"] = _policy_mask(trees, r_ex, r_leaf, n_prompt)
            if lineage is not None:  # semantics 3 (SPEC 11.2): both sides' lineage, inside the digest
                rec["lineage"] = lineage.of_side(c_ex, trees.get(c_ex)[0], c_leaf)
                rec["rejected_lineage"] = lineage.of_side(r_ex, trees.get(r_ex)[0], r_leaf)
            rec["digest"] = member_digest(rec)
            yield rec


def _lineage_cache(db: sqlite3.Connection, route: str):

    try:
        r = route_definition(db, route)
    except KeyError:
        return None
    if r.semantics < 3:
        return None

    return LineageCache(db, r)


def _policy_mask(trees: _Trees, ex: str, leaf_request_id: str, n_prompt: int) -> list[int]:
    """1 per continuation token that the policy produced (an output of a policy request), else 0."""

    t, policy = trees.get(ex)
    nodes = t.path_nodes(t.requests[leaf_request_id].node_id)
    if not nodes:
        return []
    mask = np.concatenate([((t.nodes[n].flags & FLAG_OUTPUT) != 0) & policy[n] for n in nodes])
    return mask[n_prompt:].astype(np.uint8).tolist()


def _side(trees: _Trees, ex: str, leaf_request_id: str, side_arrays):
    t, policy = trees.get(ex)
    req = t.requests.get(leaf_request_id)
    if req is None:
        raise RuntimeError(f"execution {ex}: no request {leaf_request_id} in its tree; run the projections up to date")
    return side_arrays(t, policy, req.node_id)


# ---------------------------------------------------------------------------- writers


class PairSummary:
    """What a pair export wrote."""

    def __init__(self) -> None:
        self.pairs = 0
        self.prompt_tokens = 0
        self.continuation_tokens = 0
        self.executions: set[str] = set()

    def add(self, rec: dict) -> None:
        self.pairs += 1
        self.prompt_tokens += len(rec["prompt_ids"])
        self.continuation_tokens += len(rec["chosen_ids"]) + len(rec["rejected_ids"])
        self.executions.update(rec["execution_ids"])

    def to_json(self) -> dict:
        return {"records": self.pairs, "pairs": self.pairs, "executions": len(self.executions),
                "prompt_tokens": self.prompt_tokens, "continuation_tokens": self.continuation_tokens,
                # what a DPO trainer reads: the prompt once per side, plus both continuations
                "processed_tokens": {"pairs": 2 * self.prompt_tokens + self.continuation_tokens}}


def write_pairs_jsonl(records, out: str | Path | IO[str]) -> PairSummary:
    s = PairSummary()
    close = not hasattr(out, "write")
    fh = open(out, "w", encoding="utf-8") if close else out
    try:
        for rec in records:
            fh.write(canonical_json(rec).decode("utf-8"))
            fh.write("\n")
            s.add(rec)
    finally:
        if close:
            fh.close()
    return s


def _arrow_schema(first: dict | None = None):
    """SPEC 11.5: the logical schema of pair records (:mod:`ledger.corpus.formats`; semantics 3+ adds the
    two mask columns and both sides' lineage)."""

    return schema_for("pair", first)


def write_pairs_parquet(records, path: str | Path, *, row_group_tokens: int = 1 << 20,
                        row_group_rows: int = 4096) -> PairSummary:

    s = PairSummary()
    write_parquet_rows(records, path, _arrow_schema, s.add, row_group_tokens=row_group_tokens,
                       row_group_rows=row_group_rows,
                       tokens_of=lambda rec: len(rec["prompt_ids"]) + len(rec["chosen_ids"]) + len(rec["rejected_ids"]))
    return s


def export_pairs(db: sqlite3.Connection, route: str, out, fmt: str = "jsonl", *, evidence=None) -> dict:
    """``ledger export ROUTE --format jsonl|parquet`` on a preference route."""
    if fmt == "jsonl":
        s = write_pairs_jsonl(preference_records(db, route, evidence=evidence), out)
    elif fmt == "parquet":
        s = write_pairs_parquet(preference_records(db, route, evidence=evidence), out)
    else:
        raise InputError(f"route {route!r} is a preference route: it exports pairs with --format jsonl or parquet, "
                         f"not {fmt!r}")
    doc = s.to_json()
    doc["format"] = fmt
    doc["unassigned"] = db.execute("SELECT COUNT(*) FROM preference_unassigned WHERE route = ?", (route,)).fetchone()[0]
    return doc
