"""What a trainer reader refuses (SPEC §7.3, §7.5, §6.9, §11.5): one exception hierarchy and the
structural rules of every record shape, checked on each record a reader yields.

The hierarchy (exported from the package face, ``ledger``)::

    ReadError (LedgerError, ValueError) anything a reader refuses
    ├── DigestMismatch (IntegrityError) content does not hash to the digest it claims (or the manifest's)
    │   ├── PackedDigestMismatch       (ledger.corpus.packed) a packed record's digest
    │   ├── MemberSetMismatch          given a manifest: a duplicated, missing or extra member
    │   │   └── train.MemberSetError   (ledger.train: all of them at once; also a train.ManifestReadError)
    │   └── manifest.ManifestDigestMismatch (ledger.corpus.manifest, also a ManifestError)
    ├── train.ManifestReadError        (ledger.train: the manifest does not verify; also a manifest.ManifestError)
    └── RecordError (InputError)       a record (or tree line) that breaks its format's own rules
        └── PackedRecordError          (ledger.corpus.packed) a malformed packed record

so ``except DigestMismatch`` catches every integrity failure and ``except RecordError`` every
structural one.  A record whose digest was recomputed after an edit still fails here: a mask
shorter than the tokens, a NaN or negative weight, a weight other than ``1/L_i`` or an ``L_i``
that differs between records of one execution, more targets than ``L_i``, a log-prob list of
another length, a positive or non-finite log-prob, a token id outside ``[0, 2^32)``, a field of
the wrong type, an unknown field.

Checks run on the canonical JSON bytes the digest is computed from anyway (one pass of numpy
or C-level byte operations per list, no Python loop per token): a token list's bytes may hold
only digits and commas, a mask's only ``0``/``1`` in single-character elements, a log-prob
list's only what finite numbers and ``null`` print as.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ledger.algorithms.canonical import canonical_json
from ledger.algorithms.errors import InputError, IntegrityError, LedgerError

__all__ = ["DigestMismatch", "ExecutionChecks", "MemberSet", "MemberSetMismatch", "ReadError", "RecordChecks", "RecordError",
           "Where", "check_logprobs", "check_mask", "check_pair_record", "check_path_record", "check_tokens",
           "check_tree_doc", "digest_with_lists", "flat_list", "load_manifest_arg", "parquet_file"]

ROLE_CLASSES = ("main/task", "main/summary", "sub/task", "sub/summary")
PATH_FIELDS = ("member_id", "execution_id", "task_id", "group_id", "split", "route", "leaf_request_id", "role_class",
               "input_ids", "target_mask", "behavior_logprobs", "loss_weight", "execution_target_tokens", "reward",
               "dummy", "digest")
PAIR_FIELDS = ("member_id", "execution_ids", "task_id", "group_id", "split", "route", "prompt_ids", "chosen_ids",
               "rejected_ids", "chosen_logprobs", "rejected_logprobs", "chosen_reward", "rejected_reward", "criterion",
               "digest")
TOKEN_LIMIT = 1 << 32
FLOAT32_MAX = 3.4028234663852886e38


# ====================================================================== the hierarchy


class ReadError(LedgerError, ValueError):
    """A reader refused its input (base of :class:`DigestMismatch` and :class:`RecordError`)."""


class DigestMismatch(ReadError, IntegrityError):
    """A record's content does not hash to its digest (or to the digest its manifest publishes)."""

    def __init__(self, member_id: str | None, expected: str | None = None, actual: str | None = None, *,
                 message: str | None = None) -> None:
        self.member_id, self.expected, self.actual = member_id, expected, actual
        super().__init__(message or f"member {member_id}: digest {expected} does not match its content (sha256 {actual})")


class MemberSetMismatch(DigestMismatch):
    """Given a manifest, the records are not exactly its members: ``kind`` is ``duplicate``,
    ``missing`` or ``extra`` (the records' set does not hash to the manifest's root)."""

    def __init__(self, kind: str, member_id: str | None, message: str) -> None:
        self.kind = kind
        super().__init__(member_id, message=message)


class RecordError(ReadError, InputError):
    """A record that breaks its format's own rules (names the file, line and member)."""


# ====================================================================== digests on canonical bytes


def digest_with_lists(rec: Mapping[str, Any], lists: tuple[str, ...]) -> tuple[str, dict[str, bytes]]:
    """SHA-256 of the canonical JSON of ``rec`` without ``digest`` (= ``member_digest``), and the
    canonical bytes of the ``lists`` fields it was built from (the checks below read them).
    Canonical JSON is sorted keys with ``,``/``:`` separators, so the document is the
    concatenation of its members' encodings."""
    parts: dict[str, bytes] = {}
    out = []
    for k in sorted(rec):
        if k == "digest":
            continue
        enc = canonical_json(rec[k])
        if k in lists:
            parts[k] = enc
        out.append(canonical_json(k) + b":" + enc)
    return hashlib.sha256(b"{" + b",".join(out) + b"}").hexdigest(), parts


INT_BYTES = b"0123456789,"
_MASK_BYTES = b"01,"
_NUMBER_BYTES = b"0123456789.e+-nul,"  # what finite floats, ints and null print as (no NaN, Infinity, true, "...")


def flat_list(buf: bytes, allowed: bytes) -> bool:
    """``buf`` is one flat JSON list (``[...]``) of elements made of ``allowed`` bytes only."""
    return buf[:1] == b"[" and buf[-1:] == b"]" and not buf[1:-1].translate(None, allowed)


class Where:
    """Names a record in an error of class ``kind``: ``file:line: member m: ...``."""

    __slots__ = ("prefix", "kind")

    def __init__(self, where: str, rec: Any = None, kind: type[RecordError] = RecordError) -> None:
        mid = rec.get("member_id") if isinstance(rec, Mapping) else None
        self.prefix = f"{where}: " + (f"member {mid}: " if isinstance(mid, str) else "")
        self.kind = kind

    def error(self, what: str) -> RecordError:
        return self.kind(self.prefix + what)


def check_tokens(w: Where, name: str, v: Any, buf: bytes) -> int:
    """A list of token ids (integers in [0, 2^32)); returns its length."""
    if type(v) is not list or not flat_list(buf, INT_BYTES):
        raise w.error(f"{name} must be a list of non-negative integers")
    if v and _longest_element(buf) >= 10 and max(v) >= TOKEN_LIMIT:  # 2^32 - 1 has 10 digits
        raise w.error(f"{name} holds a token id >= 2^32")
    return len(v)


def _longest_element(buf: bytes) -> int:
    """Bytes of the longest element of a flat JSON list (numpy over its bytes)."""
    ends = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == ord(","))
    bounds = np.concatenate(([0], ends, [len(buf) - 1]))
    return int(np.diff(bounds).max()) - 1


def check_mask(w: Where, name: str, v: Any, buf: bytes, n: int) -> int:
    """A 0/1 list of length ``n``; returns the number of ones (vectorised on its bytes)."""
    if type(v) is not list or not flat_list(buf, _MASK_BYTES) or (v and len(buf) != 2 * len(v) + 1):
        raise w.error(f"{name} must be a list of 0/1 integers")
    if len(v) != n:
        raise w.error(f"{name} has {len(v)} entries for {n} tokens")
    return buf.count(b"1")


def check_logprobs(w: Where, name: str, v: Any, buf: bytes, n: int) -> None:
    """Per position: null or a log-prob finite as float32 and <= 0; ``n`` positions."""
    if type(v) is not list or not flat_list(buf, _NUMBER_BYTES):
        raise w.error(f"{name} must be a list of finite numbers or null")
    if len(v) != n:
        raise w.error(f"{name} has {len(v)} entries for {n} tokens")
    if not v:
        return
    a = np.frombuffer(buf, dtype=np.uint8)
    first = a[np.concatenate(([1], np.flatnonzero(a == ord(",")) + 1))]  # each element's first byte
    odd = np.flatnonzero((first != ord("-")) & (first != ord("n")))  # not negative, not null: must be a zero
    if odd.size and any(not _zero(v[i]) for i in odd.tolist()):
        raise w.error(f"{name} holds a positive log-prob")
    if b"e+" in buf and min(x for x in v if x is not None) < -FLOAT32_MAX:
        raise w.error(f"{name} holds a log-prob that is not finite as float32")


def _zero(x: Any) -> bool:
    return x == 0 and type(x) is not bool


def _number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _string(w: Where, rec: Mapping[str, Any], names: tuple[str, ...], nullable: bool) -> None:
    for k in names:
        v = rec[k]
        if not (isinstance(v, str) or (nullable and v is None)):
            raise w.error(f"{k} must be a string{' or null' if nullable else ''}")


def _fields(w: Where, rec: Any, required: tuple[str, ...], optional: Mapping[str, Any]) -> None:
    if not isinstance(rec, dict):
        raise w.error("not a JSON object")
    missing = [k for k in required if k not in rec]
    if missing:
        raise w.error(f"not a trainer record (missing {missing})")
    for k in rec:
        if k not in optional and k not in required:
            raise w.error(f"unexpected field {k!r}")
    for k, ok in optional.items():
        if k in rec and not ok(rec[k]):
            raise w.error(f"{k} is malformed")


# SPEC 11.2 lineage (semantics 3), SPEC 6.8 recovery segments: what path records may carry beyond §7.3
PATH_EXTRAS: dict[str, Any] = {
    "lineage": lambda v: isinstance(v, dict),
    "outcome_scope": lambda v: v == "branch",
    "task_outcome": lambda v: v == "unverified" or _number(v),
}


def _checked_digest(w: Where, rec: Mapping[str, Any], lists: tuple[str, ...]) -> tuple[str, dict[str, bytes]]:
    if not isinstance(rec["digest"], str):
        raise w.error("digest must be a string")
    digest, parts = digest_with_lists(rec, lists)
    if rec["digest"] != digest:
        mid = str(rec.get("member_id"))
        raise DigestMismatch(mid, rec["digest"], digest, message=f"{w.prefix}digest {rec['digest']} does not match "
                                                                  f"its content (sha256 {digest})")
    return digest, parts


_PATH_LISTS = ("input_ids", "target_mask", "behavior_logprobs")


def check_path_record(rec: Any, where: str) -> tuple[str, int]:
    """Check one path record (SPEC §7.3): fields and types, its digest, then its rules.  Returns
    ``(digest, number of targets)``; raises :class:`RecordError` / :class:`DigestMismatch`."""
    w = Where(where, rec)
    _fields(w, rec, PATH_FIELDS, PATH_EXTRAS)
    digest, parts = _checked_digest(w, rec, _PATH_LISTS)
    _string(w, rec, ("member_id", "execution_id", "route"), False)
    _string(w, rec, ("task_id", "group_id", "split", "leaf_request_id", "role_class"), True)
    n = check_tokens(w, "input_ids", rec["input_ids"], parts["input_ids"])
    targets = check_mask(w, "target_mask", rec["target_mask"], parts["target_mask"], n)
    check_logprobs(w, "behavior_logprobs", rec["behavior_logprobs"], parts["behavior_logprobs"], n)
    big_l, weight = rec["execution_target_tokens"], rec["loss_weight"]
    if type(big_l) is not int or big_l < 0:
        raise w.error(f"execution_target_tokens {big_l!r} is not a non-negative integer")
    if type(weight) is not float or weight != (1.0 / big_l if big_l else 0.0):
        raise w.error(f"loss_weight {weight!r} is not 1/L_i (execution_target_tokens {big_l})")
    if targets > big_l:
        raise w.error(f"{targets} targets exceed execution_target_tokens {big_l}")
    reward = rec["reward"]
    if not (reward is None or _number(reward)):
        raise w.error(f"reward {reward!r} is not a finite number or null")
    dummy = rec["dummy"]
    if type(dummy) is not bool:
        raise w.error("dummy must be true or false")
    if dummy and (n or big_l or rec["leaf_request_id"] is not None or rec["role_class"] is not None or reward != 0):
        raise w.error("a dummy record has no tokens, no leaf, no role class, reward 0 and L_i 0")
    if not dummy and (rec["leaf_request_id"] is None or rec["role_class"] not in ROLE_CLASSES or not n):
        raise w.error(f"a path record needs tokens, a leaf_request_id and a role_class of {list(ROLE_CLASSES)}")
    return digest, targets


PAIR_EXTRAS: dict[str, Any] = {
    "lineage": lambda v: isinstance(v, dict),
    "rejected_lineage": lambda v: isinstance(v, dict),
    "chosen_mask": lambda v: type(v) is list,  # SPEC 11.5 (checked against chosen_ids below)
    "rejected_mask": lambda v: type(v) is list,
}
_PAIR_LISTS = ("prompt_ids", "chosen_ids", "rejected_ids", "chosen_logprobs", "rejected_logprobs", "chosen_mask",
               "rejected_mask")


def check_pair_record(rec: Any, where: str) -> str:
    """Check one preference-pair record (SPEC §6.9, §11.5); returns its digest."""
    w = Where(where, rec)
    _fields(w, rec, PAIR_FIELDS, PAIR_EXTRAS)
    digest, parts = _checked_digest(w, rec, _PAIR_LISTS)
    _string(w, rec, ("member_id", "route", "criterion"), False)
    _string(w, rec, ("task_id", "group_id", "split"), True)
    ex = rec["execution_ids"]
    if type(ex) is not list or len(ex) != 2 or not all(isinstance(e, str) for e in ex):
        raise w.error("execution_ids must be [chosen, rejected] execution ids")
    check_tokens(w, "prompt_ids", rec["prompt_ids"], parts["prompt_ids"])
    for side in ("chosen", "rejected"):
        n = check_tokens(w, f"{side}_ids", rec[f"{side}_ids"], parts[f"{side}_ids"])
        check_logprobs(w, f"{side}_logprobs", rec[f"{side}_logprobs"], parts[f"{side}_logprobs"], n)
        if f"{side}_mask" in rec:
            check_mask(w, f"{side}_mask", rec[f"{side}_mask"], parts[f"{side}_mask"], n)
        if not (rec[f"{side}_reward"] is None or _number(rec[f"{side}_reward"])):
            raise w.error(f"{side}_reward is not a finite number or null")
    c, r = rec["chosen_ids"], rec["rejected_ids"]
    if c and r and c[0] == r[0]:
        raise w.error("prompt_ids is not the longest common prefix (chosen and rejected start alike)")
    return digest


# ====================================================================== across records


class ExecutionChecks:
    """What the records of one execution must agree on: one L_i and weight (checked per record
    as 1/L_i), their targets summing to at most L_i — exactly L_i when the member set is known
    complete (:meth:`finish` with ``complete``) — and a dummy alone."""

    def __init__(self) -> None:
        self.seen: dict[str, list] = {}  # execution -> [L_i, dummy, targets, where]

    def add(self, rec: Mapping[str, Any], targets: int, where: str) -> None:
        ex = rec["execution_id"]
        got = self.seen.get(ex)
        if got is None:
            self.seen[ex] = [rec["execution_target_tokens"], rec["dummy"], targets, where]
            return
        w = Where(where, rec)
        if got[1] or rec["dummy"]:
            raise w.error(f"execution {ex} has a dummy record and another record (first at {got[3]})")
        if got[0] != rec["execution_target_tokens"]:
            raise w.error(f"execution {ex}: execution_target_tokens {rec['execution_target_tokens']} differs from "
                          f"{got[0]} at {got[3]}")
        got[2] += targets
        if got[2] > got[0]:
            raise w.error(f"execution {ex}: its records hold {got[2]} targets, more than L_i = {got[0]}")

    def finish(self, complete: bool) -> None:
        if not complete:
            return
        for ex, (big_l, _dummy, targets, where) in self.seen.items():
            if targets != big_l:
                raise RecordError(f"{where}: execution {ex}: its records hold {targets} targets, L_i is {big_l}")


def load_manifest_arg(manifest: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    """A manifest document, or the path of a manifest JSON file (not checked for its signature
    here: ``ledger manifest verify`` and ``ledger.train.ManifestDataset`` do that)."""
    if isinstance(manifest, Mapping):
        doc = manifest
    else:
        try:
            doc = json.loads(Path(manifest).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ReadError(f"cannot read manifest {manifest}: {exc}") from None
    members = doc.get("members") if isinstance(doc, Mapping) else None
    if not isinstance(members, list) or not all(isinstance(m, Mapping) and isinstance(m.get("member_id"), str)
                                                for m in members):
        raise ReadError(f"{manifest if not isinstance(manifest, Mapping) else 'manifest'}: not a manifest (no members)")
    return doc


class MemberSet:
    """The exact member set: every member_id once; with a manifest, exactly its members, each
    with the digest it publishes (``digest`` None: only membership can be checked)."""

    def __init__(self, manifest: Mapping[str, Any] | None) -> None:
        self.expected = None if manifest is None else {m["member_id"]: m.get("digest") for m in manifest["members"]}
        self.name = "" if manifest is None else f"manifest {manifest.get('route')} v{manifest.get('version')}"
        self.seen: dict[str, str] = {}

    def add(self, member_id: str, digest: str | None, where: str) -> None:
        first = self.seen.get(member_id)
        if first is not None:
            raise MemberSetMismatch("duplicate", member_id, f"{where}: member {member_id} appears twice (first at {first})")
        self.seen[member_id] = where
        if self.expected is None:
            return
        if member_id not in self.expected:
            raise MemberSetMismatch("extra", member_id, f"{where}: member {member_id} is not a member of {self.name}")
        want = self.expected[member_id]
        if digest is not None and want != digest:
            raise DigestMismatch(member_id, want, digest, message=f"{where}: member {member_id} hashes to {digest}, "
                                                                  f"{self.name} publishes {want}")

    def finish(self) -> None:
        if self.expected is None or len(self.seen) == len(self.expected):
            return
        missing = sorted(set(self.expected) - set(self.seen), key=lambda m: m.encode("utf-8"))
        raise MemberSetMismatch("missing", missing[0], f"{len(missing)} member(s) of {self.name} missing from the "
                                                       f"records, first {missing[0]}")


def parquet_file(path: Path, error: type[RecordError] = RecordError):
    """``pyarrow.parquet.ParquetFile`` of ``path``; a file pyarrow cannot read is a record error."""
    import pyarrow as pa  # cold path: pyarrow
    import pyarrow.parquet as pq  # cold path: pyarrow

    try:
        return pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as exc:
        raise error(f"{path}: not a readable Parquet file ({exc})") from None


class RecordChecks:
    """Everything a reader checks besides each record on its own: one route, the exact member
    set (:class:`MemberSet`) and each execution's agreement (:class:`ExecutionChecks`).  Call
    :meth:`path` / :meth:`pair` per record and :meth:`finish` at the end of the input."""

    def __init__(self, manifest: str | Path | Mapping[str, Any] | None = None) -> None:
        self.members = MemberSet(None if manifest is None else load_manifest_arg(manifest))
        self.executions = ExecutionChecks()
        self.route: tuple[str, str] | None = None  # (route, where first seen)

    def record(self, rec: Any, where: str) -> Any:
        """A path or pair record (a pair has ``chosen_ids``), checked; returns it."""
        pair = isinstance(rec, dict) and "chosen_ids" in rec
        digest, targets = (check_pair_record(rec, where), 0) if pair else check_path_record(rec, where)
        self._one_route(rec, where)
        self.members.add(rec["member_id"], digest, where)
        if not pair:
            self.executions.add(rec, targets, where)
        return rec

    def _one_route(self, rec: Mapping[str, Any], where: str) -> None:
        if self.route is None:
            self.route = (rec["route"], where)
        elif rec["route"] != self.route[0]:
            raise Where(where, rec).error(f"route {rec['route']!r} differs from {self.route[0]!r} at {self.route[1]}")

    def finish(self) -> None:
        self.members.finish()
        self.executions.finish(complete=self.members.expected is not None)


# ====================================================================== tree-format lines


TREE_FIELDS = ("execution_id", "task_id", "group_id", "split", "route", "dummy", "execution_target_tokens", "loss_weight",
               "nodes", "leaves", "reward")
NODE_FIELDS = ("node_id", "parent", "draw", "tokens", "target", "weight", "behavior_logprobs")
LEAF_FIELDS = ("member_id", "leaf_request_id", "node_id", "draw_index", "role_class", "reward", "digest")


def _index(x: Any) -> bool:
    return type(x) is int and x >= 0


def check_tree_doc(doc: Any, where: str) -> None:
    """Check a tree-format line before its records are rebuilt (each rebuilt record is then checked
    as a path record): fields, unique nodes whose parents exist and form no cycle, per-node lists
    of one length, weights ``loss_weight`` on target positions and 0 elsewhere, leaves on nodes."""
    w = Where(where, {})
    _fields(w, doc, TREE_FIELDS, {})
    nodes, leaves = doc["nodes"], doc["leaves"]
    if type(nodes) is not list or type(leaves) is not list:
        raise w.error("nodes and leaves must be lists")
    parent: dict[int, Any] = {}
    targets: list = []
    weights: list = []
    for node in nodes:
        _fields(w, node, NODE_FIELDS, {})
        n = node["node_id"]
        if not _index(n) or n in parent or not (node["parent"] is None or _index(node["parent"])) or not _index(node["draw"]):
            raise w.error(f"node {n!r}: node_id, parent and draw must be non-negative integers, node ids unique")
        parent[n] = node["parent"]
        tokens, target, weight, behavior = node["tokens"], node["target"], node["weight"], node["behavior_logprobs"]
        if not all(type(v) is list for v in (tokens, target, weight, behavior)) or \
                not len(tokens) == len(target) == len(weight) == len(behavior):
            raise w.error(f"node {n}: tokens, target, weight and behavior_logprobs must be lists of one length")
        targets += target
        weights += weight
    _node_weights(w, nodes, targets, weights, doc["loss_weight"])
    _acyclic(w, parent)
    for leaf in leaves:
        _fields(w, leaf, LEAF_FIELDS, {"fields": lambda v: isinstance(v, dict)})
        if not isinstance(leaf["member_id"], str) or not (leaf["draw_index"] is None or _index(leaf["draw_index"])):
            raise w.error(f"leaf {leaf['member_id']!r}: member_id must be a string, draw_index an integer")
        if doc["dummy"] is not True and leaf["node_id"] not in parent:
            raise w.error(f"leaf {leaf['member_id']!r} is on node {leaf['node_id']!r}, which is not in the tree")
    if doc["dummy"] is True and (nodes or len(leaves) != 1 or leaves[0]["node_id"] is not None):
        raise w.error("a dummy execution has no nodes and one leaf on no node")


def _node_weights(w: Where, nodes: list, targets: list, weights: list, loss_weight: Any) -> None:
    """Every node's target flags are 0/1 and its weights ``loss_weight`` on them, 0 elsewhere: one
    numpy comparison over the whole line (the flags' JSON types are checked in the records
    rebuilt from them); an error names the first node that breaks it."""
    if not targets:
        return
    try:
        flags = np.asarray(targets)
    except (TypeError, ValueError):  # ragged nesting
        flags = np.zeros(0, dtype=object)
    if flags.ndim != 1 or flags.size != len(targets):
        flags = np.full(len(targets), None, dtype=object)
    if flags.dtype.kind not in "iub" or flags.min() < 0 or flags.max() > 1:
        bad = (flags < 0) | (flags > 1) if flags.dtype.kind in "iub" else \
            np.array([type(x) not in (int, bool) for x in targets])  # the error path only
        what = "target must be a list of 0/1 integers"
    else:
        try:
            got = np.array(weights, dtype=np.float64)
        except (TypeError, ValueError):
            got = np.full(len(weights), np.nan)
        bad = got != np.where(flags == 1, loss_weight if _number(loss_weight) else np.nan, 0.0)
        what = "weight is not loss_weight on its targets and 0 elsewhere"
        if not bad.any():
            return
    first = int(np.flatnonzero(bad)[0])
    ends = np.cumsum([len(node["target"]) for node in nodes])
    raise w.error(f"node {nodes[int(np.searchsorted(ends, first, side='right'))]['node_id']}: {what}")


def _acyclic(w: Where, parent: Mapping[int, Any]) -> None:
    """Every parent chain ends at a root: no missing parent, no cycle (O(nodes))."""
    done: set[int] = set()
    for start in parent:
        walk: list[int] = []
        on_walk: set[int] = set()
        v = start
        while v is not None and v not in done:
            if v in on_walk:
                raise w.error(f"the parents of node {v} form a cycle ({' -> '.join(map(str, walk[walk.index(v):] + [v]))})")
            if v not in parent:
                raise w.error(f"node {walk[-1]} has parent {v}, which is not in the tree")
            on_walk.add(v)
            walk.append(v)
            v = parent[v]
        done.update(walk)
