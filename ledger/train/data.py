"""``ManifestDataset`` and ``ExecutionBatchSampler`` (SPEC 11.5).

A dataset is a signed manifest plus the records of an export of the same route: path records
(SPEC 7.3), tree-packed records (7.5) or preference pairs (6.9).  It refuses to exist unless the
manifest verifies (signature against the trust file, member order, Merkle root, counts), every
record's digest matches its content, and the records are exactly the manifest's members: a
duplicated, missing or extra member, or a digest other than the one the manifest publishes, is a
:class:`MemberSetError` naming how many and the first of each.  Dummy records (SPEC 6.5) are kept
apart in ``dummies`` (and counted): they hold no tokens, so they never reach a batch.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from ledger.corpus.export import member_digest, read_records
from ledger.corpus import manifest as M
from ledger.corpus.manifest import verify_manifest
from ledger.corpus.packed import check_record, read_packed
from ledger.corpus.records import ReadError
from ledger.corpus.publish import load_manifest
from ledger.events.signing import Trust
from ledger.corpus.formats import schema_of_route
from ledger.corpus.export import DigestMismatch

try:  # a Sampler when torch is there; the grouping itself needs only numpy
    from torch.utils.data import Dataset as _Dataset
    from torch.utils.data import Sampler as _Sampler
except ImportError:  # pragma: no cover - the [train] extra installs torch
    _Dataset = _Sampler = object  # type: ignore[assignment,misc]

__all__ = ["ExecutionBatchSampler", "ManifestDataset", "ManifestError", "ManifestReadError", "MemberSetError", "features", "record_kind"]


class ManifestReadError(ReadError, M.ManifestError):
    """The manifest does not verify (its problems, one per line): a ``ledger.ReadError`` and a
    :class:`ledger.corpus.manifest.ManifestError`, so one ``except`` catches it with every reader error."""


ManifestError = ManifestReadError  # the name docs/train.md promises (``ledger.train.ManifestError``): one class


_KINDS = (("duplicates", "duplicate", "duplicated"), ("missing", "missing", "missing"), ("extra", "extra", "extra"),
          ("mismatched", "mismatch", "with another digest"))


class MemberSetError(ManifestReadError, M.ManifestMemberSetMismatch):
    """The records are not exactly the manifest's members: a ``ledger.MemberSetMismatch`` (so a
    ``ledger.DigestMismatch``) whose ``kind``/``member_id`` name the first problem, with every
    duplicated, missing, extra or mismatched member id listed."""

    def __init__(self, route: Any, version: Any, **found: list[str]) -> None:
        self.duplicates = found.get("duplicates", [])
        self.missing = found.get("missing", [])
        self.extra = found.get("extra", [])
        self.mismatched = found.get("mismatched", [])
        parts = [f"{len(found[k])} {label} (first {found[k][0]!r})" for k, _, label in _KINDS if found.get(k)]
        kind, first = next((kind, found[k][0]) for k, kind, _ in _KINDS if found.get(k))
        M.ManifestMemberSetMismatch.__init__(self, kind, first, f"records are not the members of manifest {route} v{version}: "
                                                        + "; ".join(parts))


def features(kind: str = "path", *, semantics: int = 3):
    """The Hugging Face ``datasets.Features`` of an export (SPEC 11.5; ``kind``: ``path``, ``pair`` or
    ``packed``) of a route of ``semantics`` (the manifest's ``semantics``): what
    ``load_dataset("parquet", ...)`` gives, and ``load_dataset("json", ..., features=...)`` for path and
    pair records (a packed record's ``[t, p, w]`` target triples have no Arrow type in JSON: read them
    with ``ledger.read_packed``)."""
    import datasets  # optional extra [train]


    return datasets.Features.from_arrow_schema(schema_of_route(kind, semantics))


def record_kind(rec: Mapping[str, Any]) -> str:
    """``"pair"`` (SPEC 6.9), ``"packed"`` (7.5) or ``"path"`` (7.3)."""
    if "chosen_ids" in rec:
        return "pair"
    return "packed" if "node_spans" in rec else "path"


def _is_packed_file(path: Path) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head == b"PAR1":
        import pyarrow.parquet as pq  # cold path: pyarrow

        return "node_spans" in pq.ParquetFile(str(path)).schema_arrow.names
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                return '"node_spans"' in line
    return False


def _iter_checked(records: str | Path | Iterable[Mapping[str, Any]]) -> Iterator[dict]:
    """The records, each digest (and a packed record's structure) checked."""
    if isinstance(records, (str, Path)):
        path = Path(records)
        yield from (read_packed(path, verify_members=True) if _is_packed_file(path) else read_records(path))
        return
    for rec in records:
        rec = dict(rec)
        if record_kind(rec) == "packed":
            check_record(rec)
        elif member_digest(rec) != rec.get("digest"):

            raise DigestMismatch(str(rec.get("member_id")), rec.get("digest"), member_digest(rec))
        yield rec


def _members_of(rec: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """(member_id, the member digest the record vouches for) of each member a record carries."""
    if record_kind(rec) == "packed":  # packed records of this release carry each member's digest (SPEC 11.5)
        return [(m["member_id"], m.get("digest")) for m in rec["members"]]
    return [(rec["member_id"], rec["digest"])]


def _is_dummy(rec: Mapping[str, Any]) -> bool:
    kind = record_kind(rec)
    if kind == "path":
        return bool(rec.get("dummy"))
    return kind == "packed" and not rec["input_ids"]


def _load_trust(trust: Trust | str | Path | None) -> Trust | None:
    if trust is None or isinstance(trust, Trust):
        return trust
    return Trust.load(Path(trust))


class ManifestDataset(_Dataset):
    """The records of ``records`` (a path to an export, or an iterable of records) checked against
    the signed ``manifest`` (a path or the loaded document).

    ``trust`` is the trust file (a path or a :class:`ledger.events.signing.Trust`); without one the
    manifest's structure is verified but not its signature (a warning says so, and
    ``signature_verified`` is False).  Items are the non-dummy records in file order; ``dummies``
    holds the dummy records; ``kind`` is ``"path"``, ``"packed"`` or ``"pair"``.  For packed records
    written before member digests existed, the member ids are checked but not their digests
    (``member_digests_checked`` is False).
    """

    def __init__(self, manifest: str | Path | Mapping[str, Any], records: str | Path | Iterable[Mapping[str, Any]],
                 trust: Trust | str | Path | None = None) -> None:
        doc = dict(manifest) if isinstance(manifest, Mapping) else load_manifest(manifest)
        trust_obj = _load_trust(trust)
        problems = verify_manifest(doc, trust_obj)
        if problems:
            raise ManifestReadError("manifest does not verify:\n" + "\n".join(problems))
        if trust_obj is None:
            warnings.warn("ManifestDataset without a trust file: the manifest's signature is not checked", stacklevel=2)
        self.manifest, self.signature_verified = doc, trust_obj is not None
        self.records: list[dict] = []
        self.dummies: list[dict] = []
        self.member_digests_checked = True
        seen: list[tuple[str, str | None]] = []
        kinds = set()
        for rec in _iter_checked(records):
            kinds.add(record_kind(rec))
            seen += _members_of(rec)
            (self.dummies if _is_dummy(rec) else self.records).append(rec)
        if len(kinds) > 1:
            raise ManifestReadError(f"records of several kinds in one dataset: {sorted(kinds)}")
        self.kind = kinds.pop() if kinds else "path"
        self._check_members(seen)

    def _check_members(self, seen: list[tuple[str, str | None]]) -> None:
        want = {m["member_id"]: m["digest"] for m in self.manifest["members"]}
        counts = Counter(mid for mid, _ in seen)
        found = {
            "duplicates": sorted(m for m, n in counts.items() if n > 1),
            "missing": sorted(set(want) - set(counts)),
            "extra": sorted(set(counts) - set(want)),
            "mismatched": sorted({m for m, d in seen if m in want and d is not None and d != want[m]}),
        }
        if any(found.values()):
            raise MemberSetError(self.manifest.get("route"), self.manifest.get("version"), **found)
        self.member_digests_checked = all(d is not None for _, d in seen)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return self.records[i]

    def to_json(self) -> dict:
        return {"route": self.manifest.get("route"), "version": self.manifest.get("version"), "kind": self.kind,
                "records": len(self.records), "dummies": len(self.dummies),
                "signature_verified": self.signature_verified, "member_digests_checked": self.member_digests_checked}

    def __repr__(self) -> str:
        return f"ManifestDataset({json.dumps(self.to_json())})"


def execution_of(rec: Mapping[str, Any]) -> str:
    """The execution a record's loss is normalised by (a pair counts for its chosen side's, SPEC 6.9)."""
    return rec["execution_ids"][0] if "execution_ids" in rec else rec["execution_id"]


def tokens_of(rec: Mapping[str, Any]) -> int:
    if "chosen_ids" in rec:
        return len(rec["prompt_ids"]) * 2 + len(rec["chosen_ids"]) + len(rec["rejected_ids"])
    return len(rec["input_ids"])


class ExecutionBatchSampler(_Sampler):
    """Batches of indices into ``dataset`` that hold whole executions (so each execution's 1/L_i
    weights sum to 1 within one batch, seed 000), filled up to ``max_tokens`` input tokens; an
    execution larger than the budget is a batch of its own.  ``shuffle`` permutes the executions
    (numpy, keyed by ``seed`` and :meth:`set_epoch`); members keep their file order.  Dummy records
    are never in ``dataset`` (see :class:`ManifestDataset`), so no batch is empty of tokens."""

    def __init__(self, dataset, max_tokens: int, *, shuffle: bool = False, seed: int = 0) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        groups: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for i in range(len(dataset)):
            rec = dataset[i]
            ex = execution_of(rec)
            groups.setdefault(ex, []).append(i)
            sizes[ex] = sizes.get(ex, 0) + tokens_of(rec)
        self.groups, self.sizes = list(groups.values()), [sizes[ex] for ex in groups]
        self.max_tokens, self.shuffle, self.seed, self.epoch = max_tokens, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        order = np.arange(len(self.groups))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
        out: list[list[int]] = []
        batch: list[int] = []
        tokens = 0
        for g in order.tolist():
            if batch and tokens + self.sizes[g] > self.max_tokens:
                out.append(batch)
                batch, tokens = [], 0
            batch += self.groups[g]
            tokens += self.sizes[g]
        if batch:
            out.append(batch)
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())
