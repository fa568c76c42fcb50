"""Log integrity for auditors (SPEC §5): signed heads, consistency proofs, audit.

The leaves of a partition's Merkle tree are the SHA-256 digests of its events'
single-object bytes, in offset order (RFC 9162: leaf hash = SHA-256(0x00 || digest)).
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.algorithms import merkle
from ledger.algorithms.checkpoint import make_checkpoint, parse_checkpoint, sign_checkpoint, verify_checkpoint
from ledger.algorithms.errors import InputError
from ledger.algorithms.identifiers import split_key
from ledger.events.catalog import event_type, natural_key, partition_key
from ledger.events.codec import Codec, CodecError, content_hash, default_codec, event_digest, plain_content_hash
from ledger.events.signing import Trust
from ledger.log.base import Log, LogError, Partition
from ledger.log.sealing import KeyCache, SealError, unseal
from ledger.events.signing import SignatureError, load_private_key, public_bytes
from ledger.log.paths import store_origin
from ledger.projections.governance_check import governance_problem
from ledger.corpus.projection_check import database_problems
from ledger.corpus.publish import projections


def _partition_origin(origin: str, log: Log, where: Partition) -> str:
    return origin if len(log.partitions()) == 1 else f"{origin}/{where[0]}/{where[1]}"


def partition_digests(log: Log, where: Partition, end: int | None = None, start: int = 0) -> list[bytes]:
    """The stored digests of one partition from ``start``, in order (the tree's leaves)."""
    return log.digests(where, end, start)


def tree_for(log: Log, where: Partition, end: int | None = None) -> merkle.MerkleLevels:
    return merkle.MerkleLevels(merkle.leaf_hashes(partition_digests(log, where, end)))


def partition_head(log: Log, where: Partition, end: int, frontiers: dict | None = None) -> tuple[int, bytes]:
    """``(size, Merkle root)`` of one partition's first ``end`` events.  ``frontiers`` (partition ->
    :class:`merkle.CompactRange`, kept by the caller between calls, say a server) holds each
    partition's frontier, so a later call hashes only the events appended since (the log is
    append-only; ``ledger audit`` is what checks that it stayed so)."""
    cached = (frontiers or {}).get(where)
    # a copy is extended (the cached frontier is never changed in place: concurrent requests may share it)
    rng = merkle.CompactRange.from_bytes(cached.size, cached.to_bytes()) if cached and cached.size <= end else merkle.CompactRange()
    rng.extend(merkle.leaf_hashes(partition_digests(log, where, end, start=rng.size)))
    if frontiers is not None:
        frontiers[where] = rng
    return rng.size, rng.root()


def _partition_name(where: Partition) -> str:
    return f"{where[0]}:{where[1]}"


def save_frontiers(path: Path, frontiers: dict[Partition, merkle.CompactRange]) -> None:
    """Write each partition's frontier (``{"stream:partition": {"size", "frontier": hex}}``) to
    ``path`` (the store's ``frontiers.json``, replaced atomically) so that a new process need not
    hash the whole log again; :func:`saved_frontiers` trusts one only at a signed checkpoint."""
    doc = {_partition_name(w): {"size": r.size, "frontier": r.to_bytes().hex()} for w, r in frontiers.items()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _signed_heads(record: Path, origin: str, public_key: bytes, wanted: set[tuple[str, int]]) -> set[tuple[str, int, bytes]]:
    """``(partition origin, size, root)`` of the checkpoints recorded in ``record`` whose
    ``(origin, size)`` is in ``wanted`` and whose signature verifies under ``public_key``."""
    out = set()
    for line in record.read_text(encoding="utf-8").splitlines():
        try:
            seen = json.loads(line)
            if (seen["origin"], seen["size"]) in wanted:
                cp = verify_checkpoint(seen["note"], origin, public_key)
                out.add((cp.origin, cp.size, cp.root))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a valid recorded checkpoint (`ledger audit` reports it)
    return out


def saved_frontiers(log: Log, path: Path, record: Path, origin: str, public_key: bytes) -> dict[Partition, merkle.CompactRange]:
    """The frontiers saved in ``path`` that :func:`partition_head` may extend: a partition's is kept
    only if its size is within the log and its root is that of a checkpoint recorded in ``record``
    at that size and signed by the store's checkpoint key (``public_key``); anything else (a missing,
    unreadable or altered file, a truncated log, no signed checkpoint at that size) is ignored."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or not record.exists():
            return {}
        ends = log.end_offsets()
        ranges = {}
        for where in log.partitions():
            saved = doc.get(_partition_name(where))
            if isinstance(saved, dict) and isinstance(saved.get("size"), int) and saved["size"] <= ends.get(where, 0):
                ranges[where] = merkle.CompactRange.from_bytes(saved["size"], bytes.fromhex(saved["frontier"]))
        names = {w: _partition_origin(origin, log, w) for w in ranges}
        signed = _signed_heads(record, origin, public_key, {(names[w], r.size) for w, r in ranges.items()})
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError):
        return {}
    return {w: r for w, r in ranges.items() if (names[w], r.size, r.root()) in signed}


def store_frontiers(log: Log, paths) -> dict[Partition, merkle.CompactRange]:
    """:func:`saved_frontiers` of a store (its ``frontiers.json``, ``checkpoints.jsonl``, origin and
    checkpoint key); empty when it has no checkpoint key or nothing saved."""

    if paths.frontiers is None or not paths.frontiers.exists() or not paths.checkpoint_key.exists():
        return {}
    try:
        origin, public = store_origin(paths, write=False), public_bytes(load_private_key(paths.checkpoint_key))
    except (LogError, SignatureError):
        return {}
    return saved_frontiers(log, paths.frontiers, paths.checkpoints, origin, public)


def log_heads(log: Log, key: Ed25519PrivateKey, origin: str, *, record: Path | None = None,
              frontiers: Path | None = None) -> list[str]:
    """One signed C2SP checkpoint note per partition (one for the embedded log).

    ``record``: a JSON-lines file (the store's ``checkpoints.jsonl``) to which every note is
    appended as one line ``{"origin", "size", "root", "note"}``: the checkpoints the store has
    seen, which :func:`audit` checks the log against (nothing may be lost or rewritten).
    ``frontiers``: where to save each partition's frontier at its checkpoint (:func:`save_frontiers`;
    written after ``record``, so that every saved frontier has its signed checkpoint)."""
    notes, lines, ranges = [], [], {}
    for where in log.partitions():
        levels = tree_for(log, where)
        ranges[where] = levels.frontier()
        name = _partition_origin(origin, log, where)
        root = levels.root()
        notes.append(sign_checkpoint(make_checkpoint(name, levels.size, root), origin, key))
        lines.append(json.dumps({"origin": name, "size": levels.size, "root": root.hex(), "note": notes[-1]},
                                sort_keys=True) + "\n")
    if record is not None:
        with open(record, "a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        if frontiers is not None:
            save_frontiers(frontiers, ranges)
    return notes


def seen_checkpoint_problems(log: Log, record: Path, origin: str, public_key: bytes | None = None) -> list[str]:
    """The log against every checkpoint recorded in ``record`` for its partitions: the log still
    holds at least that many events, and the Merkle root over its first N leaves is the recorded
    root; with ``public_key`` (the store's checkpoint key) each recorded note's signature too."""
    if not record.exists():
        return []
    names = {_partition_origin(origin, log, where): where for where in log.partitions()}
    problems: list[str] = []
    trees: dict[Partition, merkle.MerkleLevels] = {}
    latest: dict[str, int] = {}
    try:
        text = record.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{record}: cannot read the recorded checkpoints ({exc})"]
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            seen = json.loads(line)
            name, size, root, note = seen["origin"], seen["size"], bytes.fromhex(seen["root"]), seen["note"]
            cp = parse_checkpoint(note) if public_key is None else verify_checkpoint(note, origin, public_key)
            if (cp.origin, cp.size, cp.root) != (name, size, root):
                raise ValueError("the recorded origin/size/root differ from the note's")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{record} line {n}: not a valid recorded checkpoint ({exc})")
            continue
        where = names.get(name)
        if where is None:
            continue  # another store's (or another partition layout's) checkpoint
        levels = trees.get(where) or trees.setdefault(where, tree_for(log, where))
        latest[name] = max(latest.get(name, 0), size)
        if size > levels.size:
            problems.append(f"{name}: the log holds {levels.size} events, fewer than the {size} of the signed "
                            f"checkpoint seen at {record.name} line {n} (events lost or rolled back)")
        elif size and levels.root(size) != root:
            problems.append(f"{name}: the Merkle root over the first {size} events is {levels.root(size).hex()}, not "
                            f"the {root.hex()} of the signed checkpoint seen at {record.name} line {n} "
                            "(history rewritten)")
    return problems


def consistency(log: Log, old_size: int, new_size: int | None = None, where: Partition | None = None) -> dict:
    """A consistency proof between two sizes of one partition's tree (JSON-ready)."""
    where = where or log.partitions()[-1]
    levels = tree_for(log, where)
    new_size = levels.size if new_size is None else new_size
    if not 1 <= old_size <= new_size <= levels.size:
        raise InputError(f"need 1 <= from ({old_size}) <= to ({new_size}) <= log size ({levels.size}); "
                         "a proof from the empty tree proves nothing (RFC 9162)")
    proof = levels.consistency_proof(old_size, new_size)
    return {"partition": f"{where[0]}:{where[1]}", "old_size": old_size, "new_size": new_size,
            "old_root": levels.root(old_size).hex(), "new_root": levels.root(new_size).hex(),
            "proof": [p.hex() for p in proof]}


@dataclass
class AuditReport:
    events: int = 0
    first_bad_position: str | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was not checked, and why (not a problem)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"ok": self.ok, "events": self.events, "first_bad_position": self.first_bad_position,
                "problems": self.problems, **({"notes": self.notes} if self.notes else {})}


def audit(log: Log, trust: Trust, codec: Codec | None = None, *, max_problems: int = 100,
          checkpoints: Path | None = None, origin: str | None = None, public_key: bytes | None = None,
          databases: Iterable[Path] = (), keystore=None, erasure=None) -> AuditReport:
    """Re-hash every event, decode it, check that the index row's event id, type and partition
    key are the event's, that the natural key, idempotency hash and governance flag the backend stored
    at append (:meth:`Log.stored_keys`) are the event's own (a sealed request's hash is its plain content's,
    checked when ``keystore`` opens it), and re-check every governance signature; then the backend's own storage
    (:meth:`Log.storage_problems`: SQLite integrity, missing rows, file offsets, unindexed bytes),
    SQLite's integrity check of each of ``databases`` that exists (the projection database) and,
    when it passes, the database against a replay of the log to its applied positions (every
    projection table row for row, :mod:`ledger.corpus.projection_check`), and
    the log against the signed checkpoints recorded in ``checkpoints`` (see :func:`log_heads`;
    ``origin`` is the store's checkpoint origin).  ``erasure`` (a
    :class:`ledger.corpus.erasure.ErasureCheck`) sees every event that verifies and then names each
    erased execution whose tokens are still readable in a file of the store (SPEC 11.7).  A damaged
    index met while reading is a problem in the report, never an exception."""

    codec = codec or default_codec()
    report = AuditReport()
    many = len(log.partitions()) > 1
    last = None
    keys = KeyCache(keystore) if keystore is not None else None  # one key query and cipher per key, not per request
    try:
        for rec, stored in _all_records(log):
            report.events += 1
            if keys is not None and report.events % 500 == 0:
                keys.clear()  # bounded, as the replay's batches clear theirs
            last = where = f"{rec.stream}:{rec.partition}:{rec.offset}" if many else str(rec.offset)
            problem = None
            if event_digest(rec.value) != rec.digest:
                problem = f"position {where}: bytes do not match the recorded digest (event {rec.event_id})"
            else:
                try:
                    ev = codec.decode(rec.value)
                    problem = _index_mismatch(where, rec, ev) or (
                        stored and _stored_key_mismatch(where, rec, ev, stored, codec, keys))
                    why = None if problem else governance_problem(ev, trust)
                    if why:
                        problem = f"position {where}: {ev['event_type']} {rec.event_id}: {why}"
                    elif erasure is not None and not problem:
                        erasure.observe(ev, rec, where)
                except CodecError as exc:
                    problem = f"position {where}: undecodable event {rec.event_id}: {exc}"
            if problem:
                if report.first_bad_position is None and "digest" in problem:
                    report.first_bad_position = where
                if len(report.problems) < max_problems:
                    report.problems.append(problem)
    except (sqlite3.DatabaseError, OSError, ValueError, LogError) as exc:
        after = f"after position {last}" if last is not None else "at its first event"
        report.problems.append(f"reading the log failed {after} ({type(exc).__name__}: {exc}): the index is damaged")
    report.problems += _guarded(log.storage_problems, "the log's storage")
    for db in databases:
        if Path(db).exists():
            damaged = _sqlite_problems(Path(db))
            report.problems += damaged or _guarded(lambda: _rederived_problems(log, Path(db), trust, keystore, report),
                                                   f"{db} against the log")
    if checkpoints is not None and origin is not None:
        report.problems += _guarded(lambda: seen_checkpoint_problems(log, checkpoints, origin, public_key),
                                    "the recorded checkpoints")
    if erasure is not None:
        report.problems += _guarded(erasure.problems, "the store for erased content")
    return report


def _rederived_problems(log: Log, path: Path, trust: Trust, keystore, report: AuditReport) -> list[str]:
    """A projection database against a replay of the log to its applied positions (SPEC 11.7;
    :mod:`ledger.corpus.projection_check`): every table row for row."""

    problems, skipped = database_problems(log, path, projections(keystore), trust)
    if skipped:
        report.notes.append(f"{path}: not compared with the log: {skipped}")
    return problems


def _index_mismatch(where: str, rec, ev: dict) -> str | None:
    """The index row (event id, type, partition key) against the decoded event."""
    for what, stored, actual in (("event_id", rec.event_id, ev["event_id"]), ("type", rec.event_type, ev["event_type"]),
                                 ("partition key", rec.key, partition_key(ev))):
        if stored != actual:
            return f"position {where}: the index says {what} {stored!r}, the event's is {actual!r} (index row altered)"
    return None


def _stored_key_mismatch(where: str, rec, ev: dict, stored: tuple, codec: Codec, keystore) -> str | None:
    """The natural key, idempotency hash and governance flag stored at append against the event's own.

    A store written by the first release keeps natural keys whose components were joined
    unescaped (``request/run/7/a`` for execution ``run/7``); that form is the event's too."""
    natural, chash, *flag = stored
    if flag and flag[0] is not None and flag[0] != int(event_type(ev["event_type"]).governance):
        return (f"position {where}: the index says governance {flag[0]!r}, the event's type {ev['event_type']} is "
                f"{int(event_type(ev['event_type']).governance)} (index row altered)")
    expected = natural_key(ev)
    if natural != expected and natural != "/".join(split_key(expected)):
        return (f"position {where}: the index says natural key {natural!r}, the event's is {expected!r} "
                "(index row altered: a conflicting event with that key would be let in)")
    own = content_hash(ev, rec.value)
    if chash == own:
        return None
    if ev.get("sealed") is not None:  # the hash of the plain content (or, if it arrived sealed, maybe the sealed one's)
        if keystore is None:
            return None
        try:
            plain = unseal(ev, keystore)
        except SealError:
            return None  # the digest matched, so the bytes are the appended ones; the tree projection reports it
        if plain is None:
            return None  # erased: the plain content is gone, nothing to compare
        if plain_content_hash(plain, ev, rec.value, codec.writer_schema(rec.value), codec) == chash:
            return None
    return (f"position {where}: the index's idempotency hash of event {rec.event_id} is not the hash of its content "
            "(index row altered: a retry with other content could be taken for a duplicate)")


def _guarded(check, what: str) -> list[str]:
    try:
        return check()
    except (sqlite3.DatabaseError, OSError, ValueError, LogError) as exc:
        return [f"checking {what} failed ({type(exc).__name__}: {exc})"]


def _sqlite_problems(path: Path) -> list[str]:
    """SQLite's ``PRAGMA integrity_check`` of one database file, opened read-only."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            bad = [r[0] for r in db.execute("PRAGMA integrity_check(20)")]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return [f"{path}: damaged or not a SQLite database ({exc})"]
    return [] if bad == ["ok"] else [f"{path}: SQLite integrity check: {b}" for b in bad]


def _all_records(log: Log) -> Iterator[tuple]:
    """``(record, (natural key, idempotency hash, governance flag) or None)`` for every event, partition
    by partition; the tuple is what the backend stored at append (:meth:`Log.stored_keys`), matched by offset."""
    for where in log.partitions():
        stored = log.stored_keys(where)
        nxt = next(stored, None)
        for rec in log.read(where):
            while nxt is not None and nxt[0] < rec.offset:
                nxt = next(stored, None)
            yield rec, tuple(nxt[1:]) if nxt is not None and nxt[0] == rec.offset else None


def checkpoint_json(note: str) -> str:
    return json.dumps({"note": note, "note_b64": base64.b64encode(note.encode()).decode()})
