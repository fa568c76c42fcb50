"""Corpus manifests (SPEC §6.6, §7.2, §7.3): build, sign, verify, prove, diff.

Pure functions over plain data: no log, no database, no files.  ``ledger/corpus/publish.py``
feeds them the trainer records of a route (``ledger.corpus.export.trainer_records``) and writes
the results; an outside verifier needs only this module's rules, restated here:

* A member's **digest** is SHA-256 (hex) of the canonical JSON (:mod:`ledger.algorithms.canonical`)
  of its trainer record without the ``digest`` field.
* ``members`` are ordered by ``member_id`` in UTF-8 byte order (unique ids).
* ``merkle.root`` is the RFC 9162 tree hash over the members in that order; a leaf's data
  is the 32 raw bytes of its digest, so leaf hash = SHA-256(0x00 ‖ digest bytes).
* ``signature`` = Ed25519 over the canonical JSON of the whole document minus
  ``signature``; the key must be allowed ``manifest_published`` in the trust file.
* ``counts`` must agree with ``members`` (executions, members, dummies, processed and
  target tokens are re-derivable from the member entries; stored tokens need the records,
  so only ``verify --deep`` re-derives them).

Token accounting, in the three denominators of seed 002 §15.6.4:

* ``processed_tokens``: every position a path-format trainer reads (sum of ``input_ids``
  lengths over members; shared prefixes count once per path);
* ``stored_tokens``: what the repository stores for the member executions — each
  non-dummy execution's whole prefix tree (every shared prefix once), as the tree
  projection counts it and :func:`ledger.corpus.export.accounting` sums it; the pure builder falls back to the admitted subtrees (the token trie of each
  execution's member paths) when it is not told the trees' sizes;
* ``target_tokens``: positions with ``target_mask`` 1 (the supervised loss positions).

The mixture by role class splits all three (plus processed tokens).  A stored token shared
by paths of several role classes is attributed to the highest-priority class (SPEC §6.5
default priority main/task > main/summary > sub/task > sub/summary, or the route's own);
stored tokens on no member path form the row ``not_selected`` (a dummy stores nothing in
the corpus), so the per-row stored tokens sum to ``stored_tokens``.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ledger.algorithms import merkle
from ledger.algorithms.canonical import canonical_json, json_digest
from ledger.algorithms.errors import InputError, LedgerError
from ledger.algorithms.prefix_match import common_prefix
from ledger.corpus import records as record_rules
from ledger.events.signing import SignatureError, Trust, sign_bytes

__all__ = [
    "ALGORITHM",
    "DEFAULT_ROLE_PRIORITY",
    "FORMAT",
    "SIGNED_TYPE",
    "UNAVAILABLE",
    "ManifestDigestMismatch",
    "ManifestError",
    "ManifestMemberSetMismatch",
    "build_manifest",
    "counts_from_entries",
    "diff_manifests",
    "document_sha256",
    "inclusion_proof",
    "iter_verified_records",
    "leaf_hashes_of",
    "member_digest",
    "member_entry",
    "merkle_root_hex",
    "mixture",
    "order_members",
    "pair_entry",
    "record_counts",
    "sign_manifest",
    "signing_body",
    "stored_token_attribution",
    "verify_manifest",
    "verify_proof",
]

FORMAT = "trajectory-ledger/manifest/v1"
ALGORITHM = "rfc9162-sha256"
SIGNATURE_ALGORITHM = "ed25519"
SIGNED_TYPE = "manifest_published"
UNAVAILABLE = "unavailable"
NOT_SELECTED = "not_selected"  # mixture row: stored tokens of member executions on no member path
DEFAULT_ROLE_PRIORITY: tuple[str, ...] = ("main/task", "main/summary", "sub/task", "sub/summary")
COUNT_KEYS = ("executions", "members", "dummies", "stored_tokens", "processed_tokens", "target_tokens")
# counts re-derivable from member entries alone (stored_tokens needs the token content)
_ENTRY_COUNT_KEYS = ("executions", "members", "dummies", "processed_tokens", "target_tokens")
# what a member entry carries besides member_id and digest (for diffs and impact reports)
ENTRY_FIELDS = ("execution_id", "task_id", "group_id", "split", "leaf_request_id", "role_class", "dummy",
                "reward", "loss_weight", "tokens", "target_tokens")


class PublishError(InputError):
    """A manifest cannot be published or read as asked (bad route, key, file...)."""


def parse_manifest(data: bytes, path: str | Path) -> dict:
    """A manifest document from the bytes of the file ``path`` (PublishError when not a JSON object)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PublishError(f"{path} is not a manifest: not UTF-8 text (byte {exc.start})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PublishError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise PublishError(f"{path} is not a manifest: JSON nested too deeply") from None
    except ValueError as exc:  # an integer literal too long to convert
        raise PublishError(f"{path} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise PublishError(f"{path} is not a JSON object")
    return doc


class ManifestError(LedgerError, ValueError):
    """A manifest document is malformed or a request about it cannot be answered."""


class ManifestDigestMismatch(record_rules.DigestMismatch, ManifestError):
    """A trainer record does not match the digest its manifest publishes for it (a
    :class:`ledger.DigestMismatch`, so one ``except`` catches every digest failure)."""

    def __init__(self, message: str, member_id: str | None = None) -> None:
        record_rules.DigestMismatch.__init__(self, member_id, message=message)


class ManifestMemberSetMismatch(ManifestDigestMismatch, record_rules.MemberSetMismatch):
    """The records are not exactly the manifest's members (``kind``: duplicate, missing, extra)."""

    def __init__(self, kind: str, member_id: str | None, message: str) -> None:
        self.kind = kind
        ManifestDigestMismatch.__init__(self, message, member_id)


# ---------------------------------------------------------------------- members
def member_digest(record: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of a trainer record without ``digest`` (SPEC §6.6)."""
    return json_digest({k: v for k, v in record.items() if k != "digest"})


def _id_key(member_id: str) -> bytes:
    return member_id.encode("utf-8")


def order_members(items: Iterable[Mapping[str, Any]]) -> list:
    """Items sorted by ``member_id`` in UTF-8 byte order."""
    return sorted(items, key=lambda m: _id_key(m["member_id"]))


def _length(values: Any) -> int:
    return 0 if values is None else len(values)


def _mask_sum(mask: Any) -> int:
    if mask is None or len(mask) == 0:
        return 0
    return int(np.asarray(mask, dtype=np.int64).sum())


def member_entry(record: Mapping[str, Any], digest: str | None = None) -> dict:
    """The manifest's entry for one trainer record: id, digest, and what diffs need."""
    entry = {"member_id": record["member_id"], "digest": digest or member_digest(record)}
    for key in ("execution_id", "task_id", "group_id", "split", "leaf_request_id", "role_class", "reward",
                "loss_weight"):
        entry[key] = record.get(key)
    entry["dummy"] = bool(record.get("dummy"))
    entry["tokens"] = _length(record.get("input_ids"))
    entry["target_tokens"] = _mask_sum(record.get("target_mask"))
    return _with_lineage(entry, record)


def _with_lineage(entry: dict, record: Mapping[str, Any]) -> dict:
    """A semantics-3 member's lineage (SPEC §11.2) is copied into its entry, so ``manifest prove`` and
    diffs can show it; the digest already covers it (it is a field of the record)."""
    for key in ("lineage", "rejected_lineage"):
        if key in record:
            entry[key] = record[key]
    return entry


def leaf_hashes_of(members: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """RFC 9162 leaf hashes of the members' digests (leaf data = 32 raw digest bytes)."""
    return merkle.leaf_hashes(bytes.fromhex(m["digest"]) for m in members)


def merkle_root_hex(digests: Sequence[str]) -> str:
    """RFC 9162 root (hex) over hex digests taken as 32-byte leaves, in the given order."""
    return merkle.root([bytes.fromhex(d) for d in digests]).hex()


# --------------------------------------------------------------------- accounting
def stored_token_attribution(paths: Sequence[tuple[str, Any]],
                             priority: Sequence[str] = DEFAULT_ROLE_PRIORITY) -> dict[str, int]:
    """Stored tokens of one execution's member paths, each shared prefix once, by role class.

    ``paths`` are (role_class, input_ids).  Paths are taken in role-priority order (ties by
    position in ``paths``); each contributes the tokens beyond its longest common prefix
    with any path taken before it, which is the number of new nodes it adds to the token
    trie.  The values sum to the size of the trie.
    """
    rank = {c: i for i, c in enumerate(priority)}
    order = sorted(range(len(paths)), key=lambda i: (rank.get(paths[i][0], len(rank)), i))
    seen: list[np.ndarray] = []
    out: dict[str, int] = defaultdict(int)
    for i in order:
        role, ids = paths[i]
        arr = np.asarray(ids if ids is not None else [], dtype=np.int64)
        shared = max((common_prefix(arr, s) for s in seen), default=0)
        out[role] += len(arr) - shared
        if len(arr):
            seen.append(arr)
    return dict(out)


class _Accumulator:
    """Streaming counts and per-role-class volumes over trainer records.

    Stored tokens need all member paths of one execution together; records come ordered by
    ``member_id`` (``route/execution/leaf``), so an execution's paths are consecutive and
    only the current execution's paths are held in memory.  Should an execution's records
    not be consecutive, each run is counted as its own trie (deterministic for a given
    record order, which is all verification needs).
    """

    def __init__(self, priority: Sequence[str], stored_of: Callable[[str], int | None] | None = None) -> None:
        self.priority = tuple(priority)
        self.stored_of = stored_of
        self.per_class: dict[str, dict[str, int]] = defaultdict(
            lambda: {"records": 0, "stored_tokens": 0, "processed_tokens": 0, "target_tokens": 0})
        self.executions: set[str] = set()
        self.members = 0
        self.dummies = 0
        self._current: str | None = None
        self._dummy_only = True
        self._paths: list[tuple[str, Any]] = []

    def add(self, rec: Mapping[str, Any]) -> None:
        ex = rec["execution_id"]
        if ex != self._current:
            self._flush()
            self._current = ex
            self._dummy_only = True
        self.executions.add(ex)
        self.members += 1
        dummy = bool(rec.get("dummy"))
        self.dummies += dummy
        role = "dummy" if dummy else (rec.get("role_class") or UNAVAILABLE)
        row = self.per_class[role]
        row["records"] += 1
        row["processed_tokens"] += _length(rec.get("input_ids"))
        row["target_tokens"] += _mask_sum(rec.get("target_mask"))
        if not dummy:
            self._dummy_only = False
            ids = rec.get("input_ids")
            self._paths.append((role, np.asarray([] if ids is None else ids, dtype=np.int64)))

    def _flush(self) -> None:
        if self._current is None:
            return
        subtree = 0
        if self._paths:
            for role, n in stored_token_attribution(self._paths, self.priority).items():
                self.per_class[role]["stored_tokens"] += n
                subtree += n
        total = self.stored_of(self._current) if self.stored_of else None
        if total is not None and not self._dummy_only:  # a dummy's record holds no tokens (as in the accounting)
            rest = max(0, int(total) - subtree)
            if rest:
                self.per_class[NOT_SELECTED]["stored_tokens"] += rest
        self._paths = []
        self._current = None

    def result(self) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        self._flush()
        pc = self.per_class
        counts = {
            "executions": len(self.executions),
            "members": self.members,
            "dummies": self.dummies,
            "stored_tokens": sum(r["stored_tokens"] for r in pc.values()),
            "processed_tokens": sum(r["processed_tokens"] for r in pc.values()),
            "target_tokens": sum(r["target_tokens"] for r in pc.values()),
        }
        return counts, {k: dict(v) for k, v in sorted(pc.items())}


def record_counts(records: Iterable[Mapping[str, Any]], priority: Sequence[str] = DEFAULT_ROLE_PRIORITY,
                  stored_tokens_of: Callable[[str], int | None] | None = None
                  ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(counts, per-role-class volumes) of trainer records (see :class:`_Accumulator`).

    Dummies have no role class; they are counted under ``"dummy"`` in the per-class table.
    """
    acc = _Accumulator(priority, stored_tokens_of)
    for rec in records:
        acc.add(rec)
    return acc.result()


def counts_from_entries(members: Sequence[Mapping[str, Any]], pairs: bool | None = None) -> dict[str, int]:
    """The counts a verifier can re-derive from member entries alone (no stored tokens).

    Pair entries (a preference route, SPEC §6.9; ``pairs=None``: when an entry has
    ``prompt_tokens``) count both sides' executions and add ``pairs``, ``prompt_tokens`` and
    ``continuation_tokens``."""
    if pairs is None:
        pairs = any("prompt_tokens" in m for m in members)
    out = {
        "executions": len(_entry_executions(members) if pairs else {m.get("execution_id") for m in members}),
        "members": len(members),
        "dummies": sum(bool(m.get("dummy")) for m in members),
        "processed_tokens": sum(int(m.get("tokens") or 0) for m in members),
        "target_tokens": sum(int(m.get("target_tokens") or 0) for m in members),
    }
    if pairs:
        out["pairs"] = len(members)
        out["prompt_tokens"] = sum(_int(m.get("prompt_tokens")) for m in members)
        out["continuation_tokens"] = sum(_int(m.get("continuation_tokens")) for m in members)
    return out


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _entry_executions(members: Sequence[Mapping[str, Any]]) -> set[str]:
    out: set[str] = set()
    for m in members:
        ids = m.get("execution_ids")
        out.update(str(x) for x in (ids if isinstance(ids, list) else [m.get("execution_id")]))
    return out


# ------------------------------------------------------------------ preference pairs (SPEC §6.9)
PAIR_COUNT_KEYS = ("pairs", "prompt_tokens", "continuation_tokens")
PAIR_KINDS = ("pair/within_execution", "pair/cross_execution")


def pair_entry(record: Mapping[str, Any], digest: str | None = None) -> dict:
    """The manifest's entry for one preference pair record: ``execution_id`` is the chosen
    side's, ``tokens`` what a DPO trainer reads (the prompt once per side plus both
    continuations), ``target_tokens`` the continuation positions its loss scores."""
    prompt = _length(record.get("prompt_ids"))
    cont = _length(record.get("chosen_ids")) + _length(record.get("rejected_ids"))
    ids = list(record.get("execution_ids") or [])
    kind = PAIR_KINDS[0] if len(ids) == 2 and ids[0] == ids[1] else PAIR_KINDS[1]
    return {"member_id": record["member_id"], "digest": digest or member_digest(record),
            "execution_id": ids[0] if ids else None, "execution_ids": ids, "task_id": record.get("task_id"),
            "group_id": record.get("group_id"), "split": record.get("split"), "leaf_request_id": None,
            "role_class": kind, "reward": record.get("chosen_reward"), "rejected_reward": record.get("rejected_reward"),
            "criterion": record.get("criterion"), "loss_weight": None, "dummy": False,
            "tokens": 2 * prompt + cont, "target_tokens": cont, "prompt_tokens": prompt, "continuation_tokens": cont,
            **_with_lineage({}, record)}


_PAIR_MIXTURE_NOTE = ("records = pairs; processed = tokens a DPO trainer reads (the prompt once per side plus both "
                      "continuations); stored = the member executions' prefix trees, each once, attributed to the kind "
                      "of the first pair holding it; target = continuation positions the preference loss scores")


class _PairAccumulator:
    """Counts and the mixture of pair records (rows by pair kind).  Stored tokens: each member
    execution's prefix tree once (``stored_of``), attributed to the kind of the first pair (in
    record order) that holds it; without ``stored_of``, each pair's distinct tokens."""

    def __init__(self, stored_of: Callable[[str], int | None] | None = None) -> None:
        self.stored_of = stored_of
        self.per_class: dict[str, dict[str, int]] = {}
        self.executions: dict[str, str] = {}  # execution -> kind it is attributed to
        self.members = self.prompt = self.cont = 0

    def add(self, rec: Mapping[str, Any]) -> None:
        e = pair_entry(rec, "0" * 64)
        row = self.per_class.setdefault(e["role_class"], {"records": 0, "stored_tokens": 0, "processed_tokens": 0,
                                                          "target_tokens": 0})
        row["records"] += 1
        row["processed_tokens"] += e["tokens"]
        row["target_tokens"] += e["target_tokens"]
        self.members += 1
        self.prompt += e["prompt_tokens"]
        self.cont += e["continuation_tokens"]
        for ex in e["execution_ids"]:
            if ex not in self.executions:
                self.executions[ex] = e["role_class"]
                stored = self.stored_of(ex) if self.stored_of else None
                if stored is not None:
                    row["stored_tokens"] += int(stored)
        if self.stored_of is None:
            row["stored_tokens"] += e["prompt_tokens"] + e["continuation_tokens"]

    def result(self) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        pc = self.per_class
        counts = {"executions": len(self.executions), "members": self.members, "dummies": 0,
                  "stored_tokens": sum(r["stored_tokens"] for r in pc.values()),
                  "processed_tokens": sum(r["processed_tokens"] for r in pc.values()),
                  "target_tokens": sum(r["target_tokens"] for r in pc.values()),
                  "pairs": self.members, "prompt_tokens": self.prompt, "continuation_tokens": self.cont}
        return counts, {k: dict(v) for k, v in sorted(pc.items())}


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 6) if whole else None


def mixture(per_class: Mapping[str, Mapping[str, int]]) -> dict:
    """The datasheet's mixture: per role class, volumes and shares under each denominator."""
    totals = {k: sum(v[k] for v in per_class.values())
              for k in ("records", "stored_tokens", "processed_tokens", "target_tokens")}
    by_class = {}
    for role, vol in per_class.items():
        by_class[role] = {**vol, "shares": {k: _share(vol[k], totals[k]) for k in totals}}
    return {"denominators": totals, "by_role_class": by_class,
            "note": "records = manifest members; processed = tokens a path-format trainer reads; stored = the member "
                    "executions' prefix trees, each shared prefix once, attributed to the highest-priority role class "
                    "whose member path covers it (not_selected: on no member path); target = supervised positions"}


# ------------------------------------------------------------------------ build
def build_manifest(records: Iterable[Mapping[str, Any]], *, route: str, version: int, route_version: int | None,
                   log_position: int | Mapping[str, int], split_policy: Any = UNAVAILABLE,
                   role_priority: Sequence[str] = DEFAULT_ROLE_PRIORITY, datasheet: Mapping[str, Any] | None = None,
                   stored_tokens_of: Callable[[str], int | None] | None = None, check_digests: bool = True,
                   pairs: bool = False) -> dict:
    """An unsigned manifest document over ``records`` (trainer records, SPEC §7.3).

    ``pairs``: the records are preference pairs (SPEC §6.9): one member per pair
    (:func:`pair_entry`), counts add ``pairs``, ``prompt_tokens`` and ``continuation_tokens``,
    and the mixture's rows are the pair kinds (within one execution / across executions).

    ``records`` is consumed once, streaming (only member entries and the current
    execution's paths are kept).  ``stored_tokens_of(execution_id)`` gives an execution's
    stored tokens (its whole prefix tree, the repository denominator); without it, or when
    it returns ``None``, the admitted subtree (the member paths' token trie) stands in.
    Stored tokens of member executions that lie on no member path form the mixture row
    ``not_selected``; a dummy contributes no stored tokens (its record holds none, as in
    :func:`ledger.corpus.export.accounting`).  Records may carry ``digest``; with ``check_digests`` it
    must equal the recomputed one.  ``datasheet`` adds the corpus-level fields
    (declared_use, consumer, source_pools, evaluation_claim, selection, ...); every
    top-level value equal to ``"unavailable"`` is listed in the document's ``unavailable``.
    """
    acc = _PairAccumulator(stored_tokens_of) if pairs else _Accumulator(role_priority, stored_tokens_of)
    entry_of = pair_entry if pairs else member_entry
    entries = []
    seen: set[str] = set()
    for rec in records:
        digest = member_digest(rec)
        if check_digests and rec.get("digest") is not None and rec["digest"] != digest:
            raise ManifestDigestMismatch(f"record {rec['member_id']} carries digest {rec['digest']}, its content hashes to {digest}")
        if rec["member_id"] in seen:
            raise ManifestError(f"duplicate member_id {rec['member_id']!r}")
        seen.add(rec["member_id"])
        entries.append(entry_of(rec, digest))
        acc.add(rec)
    entries = order_members(entries)
    counts, per_class = acc.result()
    doc: dict[str, Any] = {
        "format": FORMAT,
        "route": route,
        "version": int(version),
        "route_version": route_version if route_version is not None else UNAVAILABLE,
        "log_position": dict(sorted(log_position.items())) if isinstance(log_position, Mapping) else int(log_position),
        "counts": counts,
        "merkle": {"algorithm": ALGORITHM, "root": merkle_root_hex([e["digest"] for e in entries]),
                   "size": len(entries), "leaf": "sha256 digest bytes of each member, members in member_id byte order"},
        "members": entries,
        "split_policy": split_policy,
        "role_priority": list(role_priority),
        "mixture": mixture(per_class) if not pairs else {**mixture(per_class), "note": _PAIR_MIXTURE_NOTE},
    }
    for key, value in (datasheet or {}).items():
        if key in doc:
            raise ManifestError(f"datasheet field {key!r} would overwrite a manifest field")
        doc[key] = value
    doc["unavailable"] = sorted(k for k, v in doc.items() if v == UNAVAILABLE)
    return doc


def signing_body(doc: Mapping[str, Any]) -> bytes:
    """The bytes a manifest signature covers: canonical JSON of the document minus ``signature``."""
    return canonical_json({k: v for k, v in doc.items() if k != "signature"})


def sign_manifest(doc: Mapping[str, Any], key) -> dict:
    """Return ``doc`` with ``signature`` {algorithm: ed25519, key_id, value} (SPEC §7.2)."""
    return {**{k: v for k, v in doc.items() if k != "signature"}, "signature": sign_bytes(signing_body(doc), key)}


def document_sha256(doc: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of the whole signed document (ManifestPublished.manifest_sha256)."""
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def event_log_position(log_position: int | Mapping[str, int]) -> int:
    """The single integer ManifestPublished carries: the log size (embedded) or the summed offsets (Kafka).

    The full per-partition position is in the document, which ``manifest_sha256`` binds.
    """
    if isinstance(log_position, Mapping):
        return int(sum(int(v) for v in log_position.values()))
    return int(log_position)


# ------------------------------------------------------------------------ verify
def _is_hex(value: Any, nbytes: int) -> bool:
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return value == value.lower()


def verify_manifest(doc: Any, trust: Trust | None) -> list[str]:
    """Every problem found in a manifest document (empty list: it verifies).

    Checks the shape, the signature against ``trust`` (skipped when ``trust`` is None),
    member order and digests, the Merkle root and size, and the counts that the member
    entries determine.  Each check runs independently so one tamper can show several
    symptoms (a changed count breaks the signature *and* disagrees with the members).
    """
    if not isinstance(doc, Mapping):
        return ["manifest is not a JSON object"]
    problems: list[str] = []
    for key in ("route", "version", "log_position", "counts", "merkle", "members", "signature"):
        if key not in doc:
            problems.append(f"manifest has no {key!r} field")
    if problems:
        return problems
    problems += _signature_problems(doc, trust)
    members = doc["members"]
    if not isinstance(members, list) or not all(isinstance(m, Mapping) for m in members):
        return problems + ["members is not a list of objects"]
    bad = [i for i, m in enumerate(members) if not isinstance(m.get("member_id"), str) or not _is_hex(m.get("digest"), 32)]
    for i in bad[:5]:
        problems.append(f"member {i} has no string member_id or no 64-hex-digit digest")
    if bad:
        return problems
    ids = [_id_key(m["member_id"]) for m in members]
    for i in range(1, len(ids)):
        if ids[i - 1] >= ids[i]:
            what = "duplicated" if ids[i - 1] == ids[i] else "out of byte order"
            problems.append(f"member_id {members[i]['member_id']!r} at index {i} is {what}")
            break
    tree = doc["merkle"]
    if not isinstance(tree, Mapping):
        problems.append("merkle is not an object")
    else:
        if tree.get("algorithm") != ALGORITHM:
            problems.append(f"merkle.algorithm is {tree.get('algorithm')!r}, expected {ALGORITHM!r}")
        if tree.get("size") != len(members):
            problems.append(f"merkle.size is {tree.get('size')!r} but the manifest lists {len(members)} members")
        root = merkle_root_hex([m["digest"] for m in members])
        if tree.get("root") != root:
            problems.append(f"merkle.root {tree.get('root')!r} does not match the root recomputed from the "
                            f"member digests ({root})")
    counts = doc["counts"]
    if not isinstance(counts, Mapping):
        problems.append("counts is not an object")
    else:
        for key in COUNT_KEYS:
            if not isinstance(counts.get(key), int) or isinstance(counts.get(key), bool) or counts[key] < 0:
                problems.append(f"counts.{key} is missing or not a non-negative integer")
        pairs = any(k in counts for k in PAIR_COUNT_KEYS) or any("prompt_tokens" in m for m in members)
        derived = counts_from_entries(members, pairs)
        for key in _ENTRY_COUNT_KEYS + (PAIR_COUNT_KEYS if pairs else ()):
            if pairs and key in PAIR_COUNT_KEYS and not (isinstance(counts.get(key), int)
                                                         and not isinstance(counts.get(key), bool)):
                problems.append(f"counts.{key} is missing or not a non-negative integer")
            elif isinstance(counts.get(key), int) and counts[key] != derived[key]:
                problems.append(f"counts.{key} is {counts[key]} but the members give {derived[key]}")
    return problems


def _signature_problems(doc: Mapping[str, Any], trust: Trust | None) -> list[str]:
    sig = doc["signature"]
    if not isinstance(sig, Mapping):
        return ["signature is not an object {algorithm, key_id, value}"]
    if sig.get("algorithm") != SIGNATURE_ALGORITHM:
        return [f"signature.algorithm is {sig.get('algorithm')!r}, expected {SIGNATURE_ALGORITHM!r}"]
    if trust is None:
        return []
    try:
        trust.verify(SIGNED_TYPE, signing_body(doc), {"key_id": sig.get("key_id"), "value": sig.get("value")})
    except SignatureError as exc:
        return [f"signature: {exc} (the document was changed after signing, or signed by an untrusted key)"]
    return []


# ------------------------------------------------------------------------- prove
def inclusion_proof(doc: Mapping[str, Any], member_id: str) -> dict:
    """RFC 9162 inclusion proof of one member (SPEC §7.2 JSON shape plus member_id and digest)."""
    members = doc["members"]
    index = next((i for i, m in enumerate(members) if m["member_id"] == member_id), None)
    if index is None:
        raise ManifestError(f"{member_id!r} is not a member of manifest {doc.get('route')} v{doc.get('version')}")
    levels = merkle.MerkleLevels(leaf_hashes_of(members))
    return {
        "member_id": member_id,
        "digest": members[index]["digest"],
        "leaf_index": index,
        "tree_size": levels.size,
        "root": levels.root().hex(),
        "leaf_hash": merkle.leaf_hash(bytes.fromhex(members[index]["digest"])).hex(),
        "proof": [h.hex() for h in levels.inclusion_proof(index)],
        **{k: members[index][k] for k in ("lineage", "rejected_lineage") if k in members[index]},  # SPEC 11.2
    }


def verify_proof(proof: Mapping[str, Any], root: str | None = None, digest: str | None = None) -> None:
    """Check an inclusion proof JSON (optionally against a trusted root and a record digest).

    Raises :class:`ledger.algorithms.merkle.ProofError` with the reason.
    """
    try:
        leaf = bytes.fromhex(proof["leaf_hash"])
        path = [bytes.fromhex(h) for h in proof["proof"]]
        claimed_root = bytes.fromhex(proof["root"])
        index, size = int(proof["leaf_index"]), int(proof["tree_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise merkle.ProofError(f"malformed proof JSON: {exc}") from None
    if root is not None and root != proof["root"]:
        raise merkle.ProofError(f"proof is for root {proof['root']}, expected {root}")
    expected_digest = digest or proof.get("digest")
    if expected_digest is not None and merkle.leaf_hash(bytes.fromhex(expected_digest)) != leaf:
        raise merkle.ProofError(f"leaf_hash is not the leaf hash of digest {expected_digest}")
    merkle.verify_inclusion(leaf, index, size, path, claimed_root)


# -------------------------------------------------------------------- trainer reads
def iter_verified_records(doc: Mapping[str, Any], records: Iterable[Mapping[str, Any]], *,
                          complete: bool = True) -> Iterator[Mapping[str, Any]]:
    """Yield ``records`` after checking each against the manifest's member digest.

    Raises :class:`ManifestDigestMismatch` on a record whose content does not hash to the digest
    the manifest publishes for its ``member_id``, and its :class:`ManifestMemberSetMismatch` on a record
    that is not a member, a member read twice, and (with ``complete``) at the end when some
    member never appeared.  Digests only: :func:`ledger.read_records` with ``manifest=`` also
    checks each record's structure.
    """
    expected = {m["member_id"]: m["digest"] for m in doc["members"]}
    name = f"manifest {doc.get('route')} v{doc.get('version')}"
    seen: set[str] = set()
    for rec in records:
        mid = rec.get("member_id")
        if mid not in expected:
            raise ManifestMemberSetMismatch("extra", mid, f"record {mid!r} is not a member of {name}")
        if mid in seen:
            raise ManifestMemberSetMismatch("duplicate", mid, f"record {mid!r} appears twice (one member of {name})")
        digest = member_digest(rec)
        if digest != expected[mid]:
            raise ManifestDigestMismatch(f"record {mid!r} hashes to {digest}, the manifest publishes {expected[mid]}", mid)
        if rec.get("digest") is not None and rec["digest"] != digest:
            raise ManifestDigestMismatch(f"record {mid!r} carries digest {rec['digest']}, its content hashes to {digest}", mid)
        seen.add(mid)
        yield rec
    if complete and len(seen) != len(expected):
        missing = sorted(set(expected) - seen, key=_id_key)
        raise ManifestMemberSetMismatch("missing", missing[0],
                                f"{len(missing)} member(s) missing from the records, first {missing[0]!r}")


# -------------------------------------------------------------------------- diff
Explain = Callable[[str, Mapping[str, Any]], list[str]]


def diff_manifests(a: Mapping[str, Any], b: Mapping[str, Any], explain: Explain | None = None) -> dict:
    """Members removed from, added to, and changed between manifests ``a`` and ``b``.

    Each removed or added member gets ``reasons``.  ``explain(side, entry)`` (side is
    ``"removed"`` or ``"added"``) may supply reasons from the current projections
    (withdrawn, permission revoked, ...); without one, or when it finds none, the reasons
    come from the documents: ``split moved`` when the execution appears in both with
    different splits, else ``no longer admitted`` / ``newly admitted``.
    """
    ma = {m["member_id"]: m for m in a["members"]}
    mb = {m["member_id"]: m for m in b["members"]}
    split_a = {m.get("execution_id"): m.get("split") for m in a["members"]}
    split_b = {m.get("execution_id"): m.get("split") for m in b["members"]}

    def reasons(side: str, entry: Mapping[str, Any]) -> list[str]:
        found = list(explain(side, entry)) if explain else []
        ex = entry.get("execution_id")
        if ex in split_a and ex in split_b and split_a[ex] != split_b[ex] and "split moved" not in found:
            found.append("split moved")
        if not found:
            found.append("no longer admitted" if side == "removed" else "newly admitted")
        return found

    def brief(entry: Mapping[str, Any], why: list[str]) -> dict:
        return {"member_id": entry["member_id"], "execution_id": entry.get("execution_id"),
                "split": entry.get("split"), "role_class": entry.get("role_class"),
                "dummy": entry.get("dummy"), "reasons": why}

    removed = [brief(ma[k], reasons("removed", ma[k])) for k in sorted(ma.keys() - mb.keys(), key=_id_key)]
    added = [brief(mb[k], reasons("added", mb[k])) for k in sorted(mb.keys() - ma.keys(), key=_id_key)]
    changed = []
    for k in sorted(ma.keys() & mb.keys(), key=_id_key):
        if ma[k]["digest"] != mb[k]["digest"]:
            fields = [f for f in ENTRY_FIELDS if ma[k].get(f) != mb[k].get(f)]
            changed.append({"member_id": k, "execution_id": mb[k].get("execution_id"),
                            "digest_a": ma[k]["digest"], "digest_b": mb[k]["digest"],
                            "changed_fields": fields,
                            "reasons": [f"{f} changed" for f in fields] or ["record content changed"]})
    by_reason: dict[str, int] = defaultdict(int)
    for item in removed + added:
        for r in item["reasons"]:
            by_reason[r] += 1

    def header(doc: Mapping[str, Any]) -> dict:
        return {"route": doc.get("route"), "version": doc.get("version"), "route_version": doc.get("route_version"),
                "log_position": doc.get("log_position"), "root": doc.get("merkle", {}).get("root"),
                "size": doc.get("merkle", {}).get("size")}

    return {"a": header(a), "b": header(b), "same_route": a.get("route") == b.get("route"),
            "removed": removed, "added": added, "changed": changed,
            "unchanged": len(ma.keys() & mb.keys()) - len(changed),
            "summary": {"removed": len(removed), "added": len(added), "changed": len(changed),
                        "by_reason": dict(sorted(by_reason.items()))}}

