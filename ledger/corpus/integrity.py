"""Log integrity for auditors (SPEC §5): signed heads, consistency proofs, audit.

The leaves of a partition's Merkle tree are the SHA-256 digests of its events'
single-object bytes, in offset order (RFC 9162: leaf hash = SHA-256(0x00 || digest)).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.algorithms import merkle
from ledger.algorithms.checkpoint import make_checkpoint, sign_checkpoint
from ledger.events.codec import Codec, CodecError, default_codec, event_digest
from ledger.events.signing import Trust
from ledger.log.base import Log, Partition


def _partition_origin(origin: str, log: Log, where: Partition) -> str:
    return origin if len(log.partitions()) == 1 else f"{origin}/{where[0]}/{where[1]}"


def partition_digests(log: Log, where: Partition, end: int | None = None) -> list[bytes]:
    """The stored digests of one partition, in order (the tree's leaves)."""
    return log.digests(where, end)


def tree_for(log: Log, where: Partition, end: int | None = None) -> merkle.MerkleLevels:
    return merkle.MerkleLevels(merkle.leaf_hashes(partition_digests(log, where, end)))


def log_heads(log: Log, key: Ed25519PrivateKey, origin: str) -> list[str]:
    """One signed C2SP checkpoint note per partition (one for the embedded log)."""
    notes = []
    for where in log.partitions():
        levels = tree_for(log, where)
        name = _partition_origin(origin, log, where)
        notes.append(sign_checkpoint(make_checkpoint(name, levels.size, levels.root()), origin, key))
    return notes


def consistency(log: Log, old_size: int, new_size: int | None = None, where: Partition | None = None) -> dict:
    """A consistency proof between two sizes of one partition's tree (JSON-ready)."""
    where = where or log.partitions()[-1]
    levels = tree_for(log, where)
    new_size = levels.size if new_size is None else new_size
    if not 1 <= old_size <= new_size <= levels.size:
        raise ValueError(f"need 1 <= from ({old_size}) <= to ({new_size}) <= log size ({levels.size}); "
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

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"ok": self.ok, "events": self.events, "first_bad_position": self.first_bad_position,
                "problems": self.problems}


def audit(log: Log, trust: Trust, codec: Codec | None = None, *, max_problems: int = 100) -> AuditReport:
    """Re-hash every event, decode it, and re-check every governance signature."""
    from projections.governance_check import (
        governance_problem,  # audit sits above projections' checks
    )

    codec = codec or default_codec()
    report = AuditReport()
    for rec in _all_records(log):
        report.events += 1
        where = f"{rec.stream}:{rec.partition}:{rec.offset}" if len(log.partitions()) > 1 else str(rec.offset)
        problem = None
        if event_digest(rec.value) != rec.digest:
            problem = f"position {where}: bytes do not match the recorded digest (event {rec.event_id})"
        else:
            try:
                ev = codec.decode(rec.value)
                why = governance_problem(ev, trust)
                if why:
                    problem = f"position {where}: {ev['event_type']} {rec.event_id}: {why}"
            except CodecError as exc:
                problem = f"position {where}: undecodable event {rec.event_id}: {exc}"
        if problem:
            if report.first_bad_position is None and "digest" in problem:
                report.first_bad_position = where
            if len(report.problems) < max_problems:
                report.problems.append(problem)
    return report


def _all_records(log: Log) -> Iterator:
    for where in log.partitions():
        yield from log.read(where)


def checkpoint_json(note: str) -> str:
    return json.dumps({"note": note, "note_b64": base64.b64encode(note.encode()).decode()})
