"""Library functions behind `ledger manifest publish|verify|prove|diff` (SPEC §6.6, §7.2).

``publish(paths, route, key=..., out=...)``
    Brings the projections up to date, replays the log into a fresh temporary database to the same
    positions and compares every projection table with the store's (SPEC 11.7,
    :mod:`ledger.corpus.projection_check`): a difference raises :class:`ProjectionMismatch` naming
    the tables and the members the store's database would have signed differently, before
    anything is signed or written.  Builds the route's manifest from the fresh replay's trainer
    records (:func:`ledger.corpus.export.trainer_records`) at that log position, signs it
    (the key must be allowed ``manifest_published`` in the trust file), writes the JSON
    manifest and a Croissant JSON-LD description beside it (``<out stem>.croissant.json``),
    keeps a copy in the store's archive (:func:`archive_path`) and appends the signed
    ManifestPublished event (header: route, version, route_version, root, size,
    log_position, manifest_sha256).  The files are renamed into place only after the event
    is on the log, so a failed publication leaves no manifest behind.  A training route's
    records are scanned for every declared canary on their way into the document
    (:mod:`ledger.corpus.canary_scan`, SPEC 11.2); an occurrence raises :class:`CanaryEscaped`
    before anything is signed or written.

``verify_file(path, paths, deep=False)``
    The document's own checks (:func:`ledger.corpus.manifest.verify_manifest`: signature via the
    trust file, root recomputed from the member digests, counts against the members).  With
    ``deep``: the log must hold the ManifestPublished of this route and version with this
    document's SHA-256, root, size and position; the log is replayed into a fresh temporary
    database up to ``log_position`` (``ReplayEngine.run(until=...)``), the manifest is
    rebuilt from the rebuilt trainer records, and every member digest, the root, the
    counts and every datasheet field must come out the same, and no canary declared before
    ``log_position`` may occur in the members (one declared later is not seen by the rebuild).

``prove_file(path, member_id)`` — RFC 9162 inclusion proof JSON of one member.
``diff_files(a, b, paths)`` — members removed / added / changed, with reasons from the
current projections (withdrawn, permission revoked, split moved, rejected by a predicate,
no longer admitted, newly admitted).

Member lists of published manifests live in the archived documents (see
``ledger/projections/manifests.py`` for why the projection keeps only the header); the log
authenticates them through ``manifest_sha256`` (:func:`archived_manifest`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledger.algorithms.canonical import sha256_hex
from ledger.algorithms.identifiers import file_name
from ledger.corpus import archive_cache
from ledger.corpus import manifest as M
from ledger.corpus.manifest import PublishError, parse_manifest  # re-exported: callers import them from here
from ledger.corpus.canary_scan import CanaryEscaped, RecordScanner, datasheet_section
from ledger.corpus.projection_check import ProjectionMismatch, Rederived, rederived
from ledger.events.catalog import key_of
from ledger.events.signing import (
    SignatureError,
    Trust,
    key_id,
    load_private_key,
    public_bytes,
    sign_line,
)
from ledger.events.validate import TRAINING_USES, format_micros
from ledger.log import open_log
from ledger.log.base import Log, Partition
from ledger.log.paths import StorePaths
from ledger.producers.ingest import Ingestor
from ledger.projections.manifests import ManifestsProjection
from ledger.projections.registry import all_projections
from ledger.projections.registry import with_keystore
from ledger.projections.engine import ReplayEngine, connect
import dataclasses
from ledger.corpus.export import accounting
from ledger.projections.preference import route_summary
from ledger.corpus.export import trainer_records
from ledger.projections.admission import route_definition
from ledger.projections.preference import preference_route
from ledger.projections.evidence import datasheet_sections
from ledger.projections.collections import datasheet_section as collection_section
from ledger.projections.admission import hard_negative_counts
from ledger.projections.canaries import declared
from ledger.corpus.formats import schema_of_route
from ledger.projections.manifests import latest_version
from ledger.projections.registry import store_keystore
from ledger.projections.manifests import manifest_row
from ledger.projections.manifests import published_manifests
from ledger.corpus.export import read_records
from ledger.corpus.packed import read_packed
from ledger.corpus.records import ReadError
from ledger.corpus.records import parquet_file
from ledger.events.codec import default_codec
from ledger.events.codec import CodecError, default_codec, event_digest
from ledger.events.codec import event_digest
from ledger.projections.engine import connect
from ledger.projections.governance import lineage_chain
from ledger.projections.governance import derived_views
from ledger.projections import governance

__all__ = ["CanaryEscaped", "ProjectionMismatch", "PublishError", "VerifyReport", "archive_path", "archived_manifest", "build_document",
           "croissant", "croissant_path", "diff_files", "records_file", "load_manifest", "log_position_of", "manifests_touching",
           "projections", "prove_file", "publish", "verify_file"]

ProjectionsFactory = Callable[[], list]
Progress = Callable[[int, int], None] | None


# ---------------------------------------------------------------------- plumbing
def projections(keystore=None) -> list:
    """The registry's projections, with the manifests projection appended if it is missing.

    ``keystore``: the store's :class:`ledger.log.sealing.KeyStore`, so sealed requests open."""

    out = list(all_projections(keystore=keystore))
    if not any(getattr(p, "name", None) == ManifestsProjection.name for p in out):
        out.append(ManifestsProjection())
    return out


def _projections(factory: ProjectionsFactory | None, keystore) -> list:
    """Fresh projections from ``factory`` (default :func:`projections`), handed ``keystore``."""

    return with_keystore((factory or projections)(), keystore)


def _engine(log: Log, db_path: str | Path, trust: Trust, factory: ProjectionsFactory | None, keystore=None):

    return ReplayEngine(log, connect(db_path), _projections(factory, keystore), trust=trust)


def log_position_of(log: Log, positions: Mapping[Partition, int]) -> int | dict[str, int]:
    """The manifest's ``log_position``: the log size (embedded) or ``{"topic:partition": offset}`` (Kafka)."""
    parts = log.partitions()
    if parts == [("log", 0)] or not parts:
        return int(positions.get(("log", 0), 0))
    return {f"{s}:{p}": int(positions.get((s, p), 0)) for s, p in parts}


def _until(log_position: Any) -> dict[Partition, int]:
    if isinstance(log_position, bool) or not isinstance(log_position, (int, dict)):
        raise PublishError(f"log_position must be an integer or an object of partition offsets, got {log_position!r}")
    if isinstance(log_position, int):
        return {("log", 0): log_position}
    out = {}
    for key, offset in log_position.items():
        stream, _, part = str(key).rpartition(":")
        if not stream or not part.isdigit() or not isinstance(offset, int):
            raise PublishError(f"log_position key {key!r} is not 'topic:partition' with an integer offset")
        out[(stream, int(part))] = offset
    return out


ARCHIVE_NAME_MAX = 255  # bytes: NAME_MAX of Linux / macOS file systems


def _route_dir(route: str) -> str:
    """The route's archive folder name: percent-encoded, ``..`` escaped, long names cut with a
    hash suffix (SPEC §9 "Identifiers are opaque"; :func:`ledger.algorithms.identifiers.file_name`).
    A folder name may use the file system's whole 255 bytes, so every name that worked before is kept."""
    return file_name(route, ARCHIVE_NAME_MAX)


def archive_root(paths: StorePaths) -> Path:
    """Where published manifests are archived: ``<store>/manifests`` (embedded), else beside the DB."""
    return (Path(paths.db).parent if paths.is_kafka else Path(paths.url)) / "manifests"


def archive_path(paths: StorePaths, route: str, version: int) -> Path:
    """The archived copy of manifest ``route`` ``version``."""
    return archive_root(paths) / _route_dir(route) / f"v{int(version)}.json"


def croissant_path(out: str | Path) -> Path:
    """``m.json`` -> ``m.croissant.json`` (``m`` -> ``m.croissant.json``)."""
    out = Path(out)
    return out.with_name((out.stem if out.suffix == ".json" else out.name) + ".croissant.json")


def load_manifest(path: str | Path) -> dict:
    """Read a manifest document (PublishError when unreadable or not a JSON object)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PublishError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_manifest(data, path)


def _dump(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def _target(path: Path) -> tuple[Path, bool]:
    """Where writing ``path`` goes, and whether it is a stream: a symbolic link is followed (the
    file it names is replaced, never the link); a character device or a pipe is written
    through (``True``), never replaced; a regular file or nothing is replaced atomically
    (``False``).  Anything else (a directory, a socket, a block device) is refused."""
    if path.is_symlink():
        path = path.resolve()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return path, False
    except OSError as exc:
        raise PublishError(f"cannot write {path}: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode):
        return path, False
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return path, True
    raise PublishError(f"{path} is not a regular file, a character device or a pipe: it is left as it is")


def _write_through(path: Path, text: str) -> None:
    """Write ``text`` into a character device or pipe (opened for writing, never created or
    unlinked; a pipe blocks until a reader opens it)."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def _write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` (a regular file or nothing yet: see
    :func:`_target`); return the temporary path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


# ---------------------------------------------------------------------- datasheet
def _chain(db: sqlite3.Connection, ex: str) -> list[str]:
    try:
        return lineage_chain(db, ex)
    except (ImportError, sqlite3.OperationalError):
        return [ex]


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None


def _stored_tokens_of(db: sqlite3.Connection) -> Callable[[str], int | None]:
    """An execution's stored tokens (tree projection); a derived view without its own tree uses its parent's."""
    if not _has_table(db, "tree_stats"):
        return lambda ex: None

    def stored(ex: str) -> int | None:
        for e in _chain(db, ex):
            row = db.execute("SELECT stored_tokens FROM tree_stats WHERE execution_id = ?", (e,)).fetchone()
            if row is not None:
                return int(row[0])
        return None

    return stored


def source_pools(db: sqlite3.Connection, members: Iterable[Mapping[str, Any]]) -> list[dict] | str:
    """Member executions grouped by (collection run, origin, task source); missing facts marked unavailable."""
    per_exec: dict[str, int] = {}
    for m in members:
        per_exec[m["execution_id"]] = per_exec.get(m["execution_id"], 0) + 1
    if not per_exec:
        return []
    if not _has_table(db, "executions"):
        return M.UNAVAILABLE
    pools: dict[tuple, dict] = {}
    for ex, n in sorted(per_exec.items()):
        run = origin = source = None
        for e in _chain(db, ex):
            row = db.execute("SELECT collection_run_id, origin, task_id FROM executions WHERE execution_id = ?",
                             (e,)).fetchone()
            if row is not None:
                run, origin, task = row
                if _has_table(db, "gov_tasks"):
                    hit = db.execute("SELECT source FROM gov_tasks WHERE task_id = ?", (task,)).fetchone()
                    source = hit[0] if hit else None
                break
        key = tuple(v if v is not None else M.UNAVAILABLE for v in (run, origin, source))
        pool = pools.setdefault(key, {"collection_run_id": key[0], "origin": key[1], "task_source": key[2],
                                      "executions": 0, "members": 0})
        pool["executions"] += 1
        pool["members"] += n
    return [pools[k] for k in sorted(pools)]


def split_policy_of(db: sqlite3.Connection) -> Any:
    """The split policy in force (from ``projections.splits`` when it offers one), else "unavailable"."""
    try:
        from ledger.projections import splits  # type: ignore[attr-defined]
    except ImportError:
        return M.UNAVAILABLE
    for name in ("current_split_policy", "policy_in_force", "current_policy"):
        fn = getattr(splits, name, None)
        if callable(fn):
            try:
                policy = fn(db)
            except (KeyError, LookupError, sqlite3.OperationalError):
                return M.UNAVAILABLE
            if policy is None:
                return M.UNAVAILABLE
            return json.loads(json.dumps(policy, sort_keys=True, default=_jsonable))
    return M.UNAVAILABLE


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):

        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return sorted(obj) if isinstance(obj, (set, frozenset)) else list(obj)
    raise TypeError(f"cannot put {type(obj).__name__} into a manifest")


def _accounting(db: sqlite3.Connection, route: str) -> Any:

    acc = accounting(db, route)
    keep = ("attempts", "dispositions", "cost", "by_behavioral_role", "notes", "processed_tokens", "stored_tokens",
            "target_tokens", "records", "executions", "dummies")
    return {k: acc[k] for k in keep if k in acc}


def _use_rules(r) -> dict:
    """The SPEC §6.8 rules a route of semantics 2+ declares, as the datasheet's selection states them."""
    return {"min_reward": r.reward_floor, "required_criteria": list(r.required_criteria), "outcome_scope": r.outcome_scope,
            "per_task_cap": r.per_task_cap}


def _preference_sheet(db: sqlite3.Connection, route: str) -> dict:
    """What a preference corpus declares about its pairs and the candidates left unassigned."""

    s = route_summary(db, route)
    by_reason: dict[str, int] = {}
    for u in s["unassigned"]:
        key = u["reason"].split(":", 1)[0]
        by_reason[key] = by_reason.get(key, 0) + 1
    return {"pairs": s["pairs"], "by_criterion": s["by_criterion"], "unassigned_candidates": len(s["unassigned"]),
            "unassigned_by_reason": dict(sorted(by_reason.items())),
            "pairing": "pairs share a decision point (byte-identical request input within one execution or across "
                       "executions of one task); chosen has the higher counting reward, or an equal one against a "
                       "declared hard_negative; criterion cites the rejected side's fail criterion or "
                       "hard_negative:<selection_id>"}


def build_document(db: sqlite3.Connection, route: str, *, version: int, log_position: int | dict,
                   consumer: str | None = None) -> dict:
    """The unsigned manifest of ``route`` from the projection database as it stands."""

    try:
        r = route_definition(db, route)
    except KeyError:
        raise PublishError(f"no admission policy declared for route {route!r}") from None
    except sqlite3.OperationalError as exc:
        raise PublishError(f"the admission projection is not in this database ({exc})") from None
    datasheet = {
        "declared_use": r.use,
        "consumer": consumer or r.consumer or M.UNAVAILABLE,
        "evaluation_claim": r.evaluation_claim or M.UNAVAILABLE,
        "route_split": r.split,
        "selection": {"route_version": r.version, "j_max": r.j_max, "seed": r.seed, "split": r.split,
                      "predicates": [{"name": p.name, "family": p.family, "depends_on": list(p.depends_on),
                                      **({"repetitions": {"runs": p.repetitions[0], "aggregate": p.repetitions[1],
                                                          "k": p.repetitions[2]}} if p.repetitions else {})}
                                     for p in r.predicates],
                      **(_use_rules(r) if r.use_specific else {})},
        **({"semantics": r.semantics} if r.use_specific else {}),  # SPEC §10 (first-release documents carry none)
        "accounting": _accounting(db, route),
        "integrity": {"member_digest": "sha256 of the canonical JSON of the trainer record (SPEC 7.3) without digest",
                      "canonical_json": "json.dumps(obj, sort_keys=True, separators=(',', ':'), ensure_ascii=False), UTF-8",
                      "signature": "ed25519 over the canonical JSON of this document without signature; key allowed "
                                   "manifest_published in the ledger trust file"},
    }
    if r.semantics >= 3:  # SPEC 11.2: hard negatives with and without a basis

        datasheet["hard_negatives"] = hard_negative_counts(db, r)

    pairs = preference_route(r)  # SPEC §6.9: one member per preference pair
    if pairs:
        datasheet["preference"] = _preference_sheet(db, route)
        datasheet["integrity"]["member_digest"] = ("sha256 of the canonical JSON of the pair record (SPEC 6.9) "
                                                   "without digest")

    datasheet.update(datasheet_sections(db, r))  # SPEC 6.10 fault coverage / probe evidence (when present)

    datasheet.update(collection_section(db, r))  # SPEC 6.10 collection campaign, declared_after_sampling
    scanner = _canary_scanner(db, r, pairs)
    records = trainer_records(db, route)
    doc = M.build_manifest(records if scanner is None else scanner.watch(records), route=route, version=version,
                           route_version=r.version, log_position=log_position, split_policy=split_policy_of(db),
                           role_priority=r.role_priority, datasheet=datasheet,
                           stored_tokens_of=_stored_tokens_of(db), pairs=pairs)
    if r.use in TRAINING_USES and r.semantics >= 3:  # SPEC 11.2; older documents rebuild without it
        doc["canaries"] = (scanner.summary() if scanner is not None
                           else datasheet_section([], scanned=0, members=0, tokens=0, escaped=0))
    doc["source_pools"] = source_pools(db, doc["members"])
    doc["unavailable"] = sorted(k for k, v in doc.items() if v == M.UNAVAILABLE and k != "unavailable")
    if scanner is not None and scanner.count:
        raise CanaryEscaped(route, scanner.escapes, scanner.count, doc)
    return doc


def _canary_scanner(db: sqlite3.Connection, r, pairs: bool) -> RecordScanner | None:
    """The canary scan of a training route's records (SPEC 11.2), None when the route is not a
    training route or no canary is declared at this log position."""

    canaries = declared(db) if r.use in TRAINING_USES else []
    return RecordScanner(canaries, pairs=bool(pairs)) if canaries else None


# ---------------------------------------------------------------------- Croissant
# The standard Croissant 1.0 JSON-LD @context, key for key (mlcroissant's own, as in the spec's
# datasets/1.0 examples); `mlcroissant` warns about any other.
CROISSANT_CONTEXT: dict[str, Any] = {
    "@language": "en", "@vocab": "https://schema.org/", "citeAs": "cr:citeAs", "column": "cr:column",
    "conformsTo": "dct:conformsTo", "cr": "http://mlcommons.org/croissant/", "rai": "http://mlcommons.org/croissant/RAI/",
    "data": {"@id": "cr:data", "@type": "@json"}, "dataType": {"@id": "cr:dataType", "@type": "@vocab"},
    "dct": "http://purl.org/dc/terms/", "equivalentProperty": "cr:equivalentProperty",
    "examples": {"@id": "cr:examples", "@type": "@json"}, "extract": "cr:extract", "field": "cr:field",
    "fileProperty": "cr:fileProperty", "fileObject": "cr:fileObject", "fileSet": "cr:fileSet", "format": "cr:format",
    "includes": "cr:includes", "isLiveDataset": "cr:isLiveDataset", "jsonPath": "cr:jsonPath", "key": "cr:key",
    "md5": "cr:md5", "parentField": "cr:parentField", "path": "cr:path", "recordSet": "cr:recordSet",
    "references": "cr:references", "regex": "cr:regex", "repeated": "cr:repeated", "replace": "cr:replace",
    "samplingRate": "cr:samplingRate", "sc": "https://schema.org/", "separator": "cr:separator", "source": "cr:source",
    "subField": "cr:subField", "transform": "cr:transform",
}


def croissant(doc: Mapping[str, Any], manifest_file: str, manifest_file_sha256: str,
              date_published: str | None = None) -> dict:
    """A Croissant 1.0 (MLCommons) JSON-LD description of a manifest document (a derived file,
    outside the signed manifest).  ``date_published``: the ``occurred_at`` of the version's
    ManifestPublished event (RFC 3339), so one publication always gives the same bytes."""
    def field_(name: str, dtype: str, desc: str) -> dict:
        return {"@type": "cr:Field", "@id": f"members/{name}", "name": name, "description": desc, "dataType": dtype,
                "source": {"fileObject": {"@id": "manifest"}, "extract": {"jsonPath": f"$.members[*].{name}"}}}

    counts = doc.get("counts", {})
    return {
        "@context": dict(CROISSANT_CONTEXT),
        "@type": "sc:Dataset",
        "conformsTo": "http://mlcommons.org/croissant/1.0",
        "name": f"{doc.get('route')}-v{doc.get('version')}",
        "version": f"{doc.get('version')}.0.0",
        **({"datePublished": date_published} if date_published else {}),
        "description": (f"Trajectory-ledger corpus manifest of route {doc.get('route')} version {doc.get('version')} "
                        f"(admission policy v{doc.get('route_version')}), built at log position "
                        f"{json.dumps(doc.get('log_position'))}: {counts.get('members')} members from "
                        f"{counts.get('executions')} executions ({counts.get('dummies')} zero-reward dummies); "
                        f"{counts.get('target_tokens')} target tokens, {counts.get('processed_tokens')} processed, "
                        f"{counts.get('stored_tokens')} stored. Declared use: {doc.get('declared_use')}; consumer: "
                        f"{doc.get('consumer')}. Merkle root (RFC 9162, SHA-256) {doc.get('merkle', {}).get('root')}."),
        "license": M.UNAVAILABLE,
        "url": manifest_file,
        "keywords": ["agent trajectories", "training corpus", str(doc.get("declared_use"))],
        "isLiveDataset": False,
        "citeAs": f"trajectory-ledger manifest {doc.get('route')} v{doc.get('version')} root "
                  f"{doc.get('merkle', {}).get('root')}",
        "rai:dataCollection": "Agent executions recorded as events on an append-only ledger; see source_pools.",
        "rai:dataUseCases": f"declared use: {doc.get('declared_use')}; evaluation claim: {doc.get('evaluation_claim')}",
        "distribution": [{
            "@type": "cr:FileObject", "@id": "manifest", "name": manifest_file,
            "description": "signed corpus manifest (member digests, Merkle root, datasheet)",
            "contentUrl": manifest_file, "encodingFormat": "application/json", "sha256": manifest_file_sha256,
        }, {
            "@type": "cr:FileSet", "@id": "records-files", "name": "records-files",
            "description": "the route's trainer records (`ledger export --format parquet`), each checked against "
                           "its member digest in the signed manifest",
            "encodingFormat": "application/x-parquet", "includes": records_file(manifest_file),
        }],
        "recordSet": [{
            "@type": "cr:RecordSet", "@id": "members", "name": "members",
            "description": "one entry per manifest member; the digest is SHA-256 of the canonical JSON of the trainer "
                           "record (obtain the records with `ledger export ROUTE`)",
            "key": {"@id": "members/member_id"},
            "field": [
                field_("member_id", "sc:Text", "deterministic member id route/execution/leaf"),
                field_("digest", "sc:Text", "SHA-256 (hex) of the trainer record"),
                field_("execution_id", "sc:Text", "execution (or derived view) the path comes from"),
                field_("split", "sc:Text", "train | dev | final_test | reserve of the task group"),
                field_("role_class", "sc:Text", "main/task, main/summary, sub/task or sub/summary"),
                field_("dummy", "sc:Boolean", "zero-reward dummy entry (no targets)"),
                field_("tokens", "sc:Integer", "tokens on the root-to-leaf path"),
                field_("target_tokens", "sc:Integer", "target positions of this path"),
            ],
        }, _records_set(doc)],
    }


_CROISSANT_TYPES = {"string": "sc:Text", "int64": "sc:Integer", "double": "sc:Float", "bool": "sc:Boolean"}


def records_file(manifest_file: str) -> str:
    """Where the Croissant file expects the route's Parquet export: ``m.json`` -> ``m.records.parquet``
    (Parquet, not JSON lines: mlcroissant reads JSON lines through pandas, which rounds float64 in
    the last digits; Parquet keeps every value exact)."""
    return (manifest_file[:-5] if manifest_file.endswith(".json") else manifest_file) + ".records.parquet"


def _records_set(doc: Mapping[str, Any]) -> dict:
    """The ``records`` record set (SPEC 11.5): every flat and list column of the route's trainer records
    (path or pair records, ledger.corpus.formats), read from the Parquet export put beside the
    manifest as :func:`records_file` (a file set: its integrity is the members' digests, not a
    checksum here).  Struct columns (a semantics-3 record's ``lineage``) are left to the export."""

    kind = "pair" if "pairs" in (doc.get("counts") or {}) else "path"
    fields = []
    for f in schema_of_route(kind, int(doc.get("semantics") or 1)):
        many = hasattr(f.type, "value_type")
        dtype = _CROISSANT_TYPES.get(str(f.type.value_type if many else f.type))
        if dtype is None:
            continue
        fields.append({"@type": "cr:Field", "@id": f"records/{f.name}", "name": f.name, "dataType": dtype,
                       "description": f"trainer record field {f.name} (SPEC 7.3, 6.9, 11.5)",
                       **({"repeated": True} if many else {}),
                       "source": {"fileSet": {"@id": "records-files"}, "extract": {"column": f.name}}})
    return {"@type": "cr:RecordSet", "@id": "records", "name": "records", "key": {"@id": "records/member_id"},
            "description": f"the trainer records ({kind} records), one per member: `ledger export "
                           f"{doc.get('route')} --format parquet` saved as the file set records-files names; check "
                           "them against the manifest with ledger.read_records(path, manifest=...)",
            "field": fields}


# ---------------------------------------------------------------------- publish
@dataclass
class Published:
    path: Path
    croissant_path: Path | None  # None: --out is a character device or a pipe (no file beside it)
    archive_path: Path
    route: str
    version: int
    root: str
    size: int
    log_position: int | dict
    manifest_sha256: str
    event_id: str | None
    counts: dict

    def to_json(self) -> dict:
        return {"path": str(self.path), "croissant": None if self.croissant_path is None else str(self.croissant_path),
                "archive": str(self.archive_path),
                "route": self.route, "version": self.version, "root": self.root, "size": self.size,
                "log_position": self.log_position, "manifest_sha256": self.manifest_sha256, "event_id": self.event_id,
                "counts": self.counts}


def _next_version(log: Log, db: sqlite3.Connection, route: str) -> int:

    version = latest_version(db, route) + 1
    while log.lookup(key_of("manifest_published", route=route, version=version)) is not None:
        version += 1
    return version


def _refuse_mismatch(path: Path, store: sqlite3.Connection, fresh: Rederived, route: str, position: int | dict,
                     consumer: str | None) -> None:
    """Raise :class:`ProjectionMismatch` when the store's projection database is not what the log
    derives (SPEC 11.7): the differing tables, and the members the store's database would have
    signed differently (a member digest, a member the log does not admit or one it does)."""
    problems = list(fresh.problems) + ([f"{path}: not compared with the log: {fresh.skipped}"] if fresh.skipped else [])
    if not problems:
        return
    try:
        want, have = (_members_built(db, route, position, consumer) for db in (fresh.db, store))
    except Exception as exc:  # noqa: BLE001 - a tampered database may break anything; the tables are named above
        problems.append(f"the manifest of {route} could not be built from {path} to name the members ({exc})")
    else:
        ids = sorted(set(want) | set(have), key=M._id_key)
        for k in [k for k in ids if k in want and k in have and want[k] != have[k]][:_MAX_LISTED]:
            problems.append(f"{path} would sign member {k} with digest {have[k]}; the log derives {want[k]}")
        problems += [f"{path} would sign member {k}, which the log does not admit at this position"
                     for k in [k for k in ids if k not in want][:_MAX_LISTED]]
        problems += [f"{path} would leave out member {k}, which the log admits at this position"
                     for k in [k for k in ids if k not in have][:_MAX_LISTED]]
    raise ProjectionMismatch(path, problems)


def _members_built(db: sqlite3.Connection, route: str, position: int | dict, consumer: str | None) -> dict[str, str]:
    """``{member_id: digest}`` of the manifest ``db`` gives (a canary in it does not matter here)."""
    try:
        doc = build_document(db, route, version=0, log_position=position, consumer=consumer)
    except CanaryEscaped as exc:
        doc = exc.doc
    return {m["member_id"]: m["digest"] for m in doc["members"]}


def publish(paths: StorePaths, route: str, *, key: str | Path, out: str | Path, consumer: str | None = None,
            projections_factory: ProjectionsFactory | None = None, progress: Progress = None) -> Published:
    """Build, sign, write and record the next manifest version of ``route`` (see module doc)."""
    trust = Trust.load(paths.trust)
    pk = load_private_key(Path(key))
    kid = key_id(public_bytes(pk))
    tk = trust.keys.get(kid)
    if tk is None or M.SIGNED_TYPE not in tk.may_sign:
        raise SignatureError(f"key {kid} is not allowed to sign {M.SIGNED_TYPE} in the trust file {paths.trust} "
                             f"(create one with `ledger keys new --may-sign {M.SIGNED_TYPE}`)")
    out = Path(out)
    targets = _targets(out)  # checked before anything is signed: a directory or a socket is refused

    keystore = store_keystore(paths)
    with open_log(paths.url) as log:
        engine = _engine(log, paths.db, trust, projections_factory, keystore)
        try:
            engine.run(progress=progress)
            with rederived(log, paths.db, _projections(projections_factory, keystore), trust) as fresh:
                position = log_position_of(log, fresh.positions)
                _refuse_mismatch(Path(paths.db), engine.db, fresh, route, position, consumer)
                version = _next_version(log, fresh.db, route)
                doc = M.sign_manifest(build_document(fresh.db, route, version=version, log_position=position,
                                                     consumer=consumer), pk)
            text = _dump(doc)
            digest = M.document_sha256(doc)
            cpath = croissant_path(out)
            apath = archive_path(paths, route, version)
            # the ManifestPublished event's time, stamped here (signed with the line) so that the
            # Croissant file's datePublished is that event's occurred_at exactly
            published_at = format_micros(time.time_ns() // 1000)
            manifest_to, croissant_to = targets
            files = [(apath, False, text)]
            if croissant_to is not None:
                files.append((*croissant_to, _dump(croissant(doc, out.name, sha256_hex(text.encode("utf-8")),
                                                             published_at))))
            staged = _stage(files + [(*manifest_to, text)])
            try:  # every temporary is removed when the append fails (nothing half-written)
                line = {"type": M.SIGNED_TYPE, "occurred_at": published_at, "route": route, "version": version,
                        "route_version": doc["route_version"], "root": doc["merkle"]["root"],
                        "size": doc["merkle"]["size"], "log_position": M.event_log_position(position),
                        "manifest_sha256": digest}
                report = Ingestor(log, trust, producer="ledger-manifest").ingest_lines([(1, sign_line(line, pk))])
                if report.conflicts:
                    raise PublishError(f"{route} v{version} was published concurrently: "
                                       + "; ".join(c["reason"] for c in report.conflicts))
            except BaseException:
                for _path, tmp, _text in staged:
                    if tmp is not None:
                        tmp.unlink(missing_ok=True)
                raise
            _put_in_place(staged, f"{route} v{version} is published and archived at {apath}")
            archive_cache.record(paths.archive_cache, text.encode("utf-8"), digest, doc)  # what `ledger serve` reads
            ids = [e for e, _ in report.result.appended + report.result.duplicates] if report.result else []
            engine.run()  # record the publication in the manifests projection
        finally:
            engine.db.close()
            if keystore is not None:
                keystore.close()
    return Published(out, None if targets[1] is None else cpath, apath, route, version, doc["merkle"]["root"],
                     doc["merkle"]["size"], position, digest, ids[0] if ids else None, doc["counts"])


def _targets(out: Path) -> tuple[tuple[Path, bool], tuple[Path, bool] | None]:
    """Where the manifest and its Croissant file go (:func:`_target` of each); a manifest written
    into a device or pipe has no Croissant file beside it (None, as for ``--out -``)."""
    manifest = _target(out)
    return manifest, None if manifest[1] else _target(croissant_path(out))


def _stage(files: list[tuple[Path, bool, str]]) -> list[tuple[Path, Path | None, str]]:
    """Write each regular file's text to a temporary beside it (``(path, temporary, text)``; a
    stream's temporary is None: it is written through after the publication is on the log)."""
    staged: list[tuple[Path, Path | None, str]] = []
    try:
        for path, stream, text in files:
            staged.append((path, None if stream else _write_atomic(path, text), text))
    except BaseException:
        for _path, tmp, _text in staged:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        raise
    return staged


def _put_in_place(staged: list[tuple[Path, Path | None, str]], done: str) -> None:
    """Rename each temporary over its regular file, then write each stream (a failure there is
    reported with what is already done)."""
    for path, tmp, _text in staged:
        if tmp is not None:
            os.replace(tmp, path)
    for path, tmp, text in staged:
        if tmp is None:
            try:
                _write_through(path, text)
            except OSError as exc:
                raise PublishError(f"{done}, but writing {path} failed: {exc.strerror or exc}") from None


def archived_manifest(paths: StorePaths, db: sqlite3.Connection, route: str, version: int) -> dict:
    """The archived document of a publication, authenticated by the log's manifest_sha256."""

    row = manifest_row(db, route, version)
    if row is None:
        raise PublishError(f"no publication of {route} v{version} is recorded (run `ledger project`)")
    doc = load_manifest(archive_path(paths, route, version))
    if M.document_sha256(doc) != row["manifest_sha256"]:
        raise PublishError(f"archived {route} v{version} does not match the manifest_sha256 on the log")
    return doc


def manifests_touching(paths: StorePaths, db: sqlite3.Connection, executions: Iterable[str]) -> list[dict]:
    """Published manifest versions holding members of ``executions`` (from authenticated archives)."""

    wanted = set(executions)
    out = []
    for row in published_manifests(db):
        try:
            doc = archived_manifest(paths, db, row["route"], row["version"])
        except PublishError as exc:
            out.append({"route": row["route"], "version": row["version"], "members": None, "why": str(exc)})
            continue
        hits = [{"member_id": m["member_id"], "execution_id": m.get("execution_id")}
                for m in doc["members"] if m.get("execution_id") in wanted]
        if hits:
            out.append({"route": row["route"], "version": row["version"], "members": hits})
    return out


# ---------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    path: str
    route: Any = None
    version: Any = None
    deep: bool = False
    problems: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"path": self.path, "route": self.route, "version": self.version, "deep": self.deep, "ok": self.ok,
                "problems": self.problems, "checks": self.checks}


_MAX_LISTED = 10
# fields a deep rebuild does not reproduce: the signature itself, the publisher's declared
# consumer (given on the command line) and the publication counter (checked against the log)
_NOT_REBUILT = {"signature", "consumer", "version"}


def verify_file(path: str | Path, paths: StorePaths | None = None, *, trust: Trust | None = None, deep: bool = False,
                projections_factory: ProjectionsFactory | None = None, progress: Progress = None,
                records: str | Path | None = None) -> VerifyReport:
    """Verify a manifest file (see module doc); the report lists every problem found.  ``records``:
    an export (path, pair, tree or packed records; JSON lines or Parquet) that must be exactly
    the manifest's members, each digest the published one, each record within its rules."""
    report = VerifyReport(str(path), deep=deep)
    doc = load_manifest(path)  # unreadable, not JSON, not an object: bad input (PublishError), not a finding
    report.route, report.version = doc.get("route"), doc.get("version")
    if trust is None:
        if paths is None:
            raise PublishError("a trust file is needed to verify the signature")
        trust = Trust.load(paths.trust)
    report.problems += M.verify_manifest(doc, trust)
    report.checks += ["signature (trust file)", "member order", "merkle root", "counts against members"]
    if records is not None:
        _check_records(doc, Path(records), report)
    if not deep:
        return report
    if paths is None:
        raise PublishError("--deep needs the store (--store) to replay the log")

    keystore = store_keystore(paths)
    try:
        with open_log(paths.url) as log:
            _deep(doc, log, trust, report, projections_factory, progress, keystore)
    finally:
        if keystore is not None:
            keystore.close()
    return report


def _check_records(doc: Mapping[str, Any], records: Path, report: VerifyReport) -> None:
    """The first problem ``ledger.read_records`` / ``read_packed`` find in ``records`` against ``doc``."""

    if not records.is_file():
        raise PublishError(f"--records {records}: no such file")
    reader = read_packed if _is_packed_file(records) else read_records
    n = 0
    try:
        for _rec in reader(records, manifest=doc):
            n += 1
    except ReadError as exc:
        report.problems.append(f"records {records}: {exc}")
        return
    except OSError as exc:
        raise PublishError(f"cannot read --records {records}: {exc.strerror or exc}") from None
    report.checks.append(f"records: {n} in {records.name}, exactly the members, every digest and structure")


def _is_packed_file(path: Path) -> bool:
    """A tree-packed export (SPEC §7.5): ``node_spans`` in its Parquet columns or first JSON line."""
    with open(path, "rb") as fh:
        if fh.read(4) == b"PAR1":

            return "node_spans" in parquet_file(path).schema_arrow.names
        fh.seek(0)
        first = next((line for line in fh if line.strip()), b"")
    return b'"node_spans"' in first


_SEALED_REASONS = {"sealed payload erased": "their data key was destroyed (crypto-shredded by `ledger withdraw --erase`)",
                   "sealed request: no key store configured": "no key store (the store's data-keys.db) is available "
                                                              "to open them"}


def unreadable_sealed(db: sqlite3.Connection, log: Log) -> dict[str, str]:
    """Executions (and their derived views) whose sealed requests a replay into ``db`` could
    not open, with the reason: ``{execution_id: why}`` (from the engine's ``_rejected``)."""

    if not _has_table(db, "_rejected"):
        return {}
    rows = db.execute("SELECT stream, partition, \"offset\", reason FROM _rejected WHERE projection = 'tree' "
                      "AND event_type = 'request' AND (reason IN (?, ?) OR reason LIKE 'sealed payload of request %' "
                      "OR reason LIKE 'unknown sealed payload version %') ORDER BY stream, partition, \"offset\"",
                      tuple(_SEALED_REASONS)).fetchall()
    out: dict[str, str] = {}
    codec = default_codec()
    for stream, partition, offset, reason in rows:
        for rec in log.read((stream, partition), offset, offset + 1):
            ex = codec.decode(rec.value)["execution_id"]
            out.setdefault(ex, _SEALED_REASONS.get(reason, reason))
    try:
        for ex, why in list(out.items()):
            for v in derived_views(db, ex):
                out.setdefault(v, f"{why} (in its parent {ex})")
    except (ImportError, sqlite3.OperationalError):
        pass
    return out


def _unreadable_problems(doc: dict, rebuilt: dict, unreadable: dict[str, str]) -> list[str]:
    """The deep comparison when some sealed payloads could not be read back: members of those
    executions are named with the reason (they cannot be re-derived), the other members are
    compared one by one; root, counts and datasheet are not compared (they cover both)."""
    members = [m for m in doc.get("members") or [] if isinstance(m, Mapping)]
    hit = [m for m in members if m.get("execution_id") in unreadable]
    problems = [f"{len(hit)} member(s) cannot be re-derived from the log: the sealed token payloads of their "
                f"execution(s) {', '.join(sorted({str(m['execution_id']) for m in hit}))} cannot be opened any more"]
    for m in sorted(hit, key=lambda m: str(m.get("member_id")).encode("utf-8"))[:_MAX_LISTED]:
        problems.append(f"member {m.get('member_id')}: not re-derivable: {unreadable[m['execution_id']]}")
    if len(hit) > _MAX_LISTED:
        problems.append(f"... and {len(hit) - _MAX_LISTED} more members of unreadable executions")
    keep = {m.get("member_id") for m in members} - {m.get("member_id") for m in hit}
    rest = _member_problems({k: m for k, m in ((m.get("member_id"), m) for m in members) if k in keep},
                            {m["member_id"]: m for m in rebuilt["members"] if m.get("execution_id") not in unreadable})
    problems += rest
    problems.append("merkle root, counts and datasheet were not compared with the rebuild: they include the members "
                    "above" + ("" if rest else "; every other member matches the record rebuilt from the log"))
    return problems


def _deep(doc: dict, log: Log, trust: Trust, report: VerifyReport, factory: ProjectionsFactory | None,
          progress: Progress, keystore=None) -> None:

    problems = report.problems
    if not isinstance(doc.get("version"), int) or isinstance(doc.get("version"), bool) or not isinstance(doc.get("route"), str):
        problems.append("cannot replay: route must be a string and version an integer")
        return
    try:
        until = _until(doc.get("log_position"))
    except PublishError as exc:
        problems.append(str(exc))
        return
    ends = log.end_offsets()
    for where, offset in until.items():
        if where not in ends and offset:
            problems.append(f"log_position names partition {where[0]}:{where[1]}, which the log does not have")
            return
        if offset > ends.get(where, 0):
            problems.append(f"log_position {offset} of {where[0]}:{where[1]} is beyond the log's end "
                            f"({ends.get(where, 0)}); the log was truncated or the manifest is not from this log")
            return
    # 1. the publication is on the log with this document's hash
    rec = log.lookup(key_of("manifest_published", route=doc.get("route"), version=doc.get("version")))
    report.checks.append("ManifestPublished on the log")
    if rec is None:
        problems.append(f"the log holds no ManifestPublished for {doc.get('route')} v{doc.get('version')}")
        ev = None
    else:
        ev = _decoded_intact(rec)
        if ev is None:
            problems.append(_damaged(rec.offset, "the ManifestPublished event"))
            return
    if ev is not None:
        want = {"manifest_sha256": M.document_sha256(doc), "root": doc.get("merkle", {}).get("root"),
                "size": doc.get("merkle", {}).get("size"), "route_version": doc.get("route_version"),
                "log_position": M.event_log_position(doc["log_position"])}
        for k, v in want.items():
            if ev.get(k) != v:
                problems.append(f"ManifestPublished at position {rec.offset} says {k} = {ev.get(k)!r}, "
                                f"the document gives {v!r}")
    # 2. replay into a fresh database up to log_position and rebuild
    with tempfile.TemporaryDirectory(prefix="ledger-verify-") as tmp:
        db = connect(Path(tmp) / "replay.db")
        try:
            engine = ReplayEngine(log, db, _projections(factory, keystore), trust=trust)
            stats = engine.run(until=until, progress=progress)
            damaged = _first_damaged(db, log) if stats.dead_letters else None
            if damaged is not None:  # bytes that fail their digest: a truncated log cannot re-derive anything
                where = damaged[2] if len(ends) == 1 else f"{damaged[0]}:{damaged[1]}:{damaged[2]}"
                problems.append(_damaged(where, f"{stats.dead_letters} undecodable event(s) in the replay, the first"))
                return
            report.checks.append(f"replayed the log to {json.dumps(doc['log_position'])} in a fresh database")
            unreadable = unreadable_sealed(db, log)
            consumer = doc.get("consumer")
            try:
                rebuilt = build_document(db, doc["route"], version=doc["version"],
                                         log_position=doc["log_position"],
                                         consumer=None if consumer == M.UNAVAILABLE else consumer)
            except PublishError as exc:
                problems.append(f"cannot rebuild from the log: {exc}")
                return
            except CanaryEscaped as exc:  # a canary declared before log_position is in the members
                problems += [f"{e} (declared before this manifest's log position)" for e in exc.escapes[:_MAX_LISTED]]
                rebuilt = exc.doc
        finally:
            db.close()
    report.checks += ["member digests against the rebuilt trainer records", "root, counts and datasheet against the rebuild"]
    members = doc.get("members") if isinstance(doc.get("members"), list) else []
    if any(isinstance(m, Mapping) and m.get("execution_id") in unreadable for m in members):
        problems += _unreadable_problems(doc, rebuilt, unreadable)
        return
    found = compare_rebuilt(doc, rebuilt)
    if found and unreadable:
        found.append(f"note: the replay could not open the sealed requests of {len(unreadable)} execution(s) "
                     f"({', '.join(sorted(unreadable)[:_MAX_LISTED])}): " + "; ".join(sorted(set(unreadable.values()))[:3]))
    problems += found


def _decoded_intact(rec) -> dict | None:
    """The decoded event of a log record, or None when its bytes do not match the recorded
    digest or do not decode (a damaged or truncated log)."""

    if event_digest(rec.value) != rec.digest:
        return None
    try:
        return default_codec().decode(rec.value)
    except CodecError:
        return None


def _first_damaged(db: sqlite3.Connection, log: Log) -> tuple | None:
    """(stream, partition, offset) of the first dead letter of a replay whose bytes on the log
    fail their recorded digest; None if every dead letter is intact (merely undecodable)."""

    for stream, part, off in db.execute('SELECT stream, partition, "offset" FROM _dead_letter '
                                        'ORDER BY stream, partition, "offset" LIMIT 100'):
        for rec in log.read((stream, part), off, off + 1):
            if event_digest(rec.value) != rec.digest:
                return stream, part, off
    return None


def _damaged(where, what: str) -> str:
    return (f"the log is damaged: {what} at position {where} cannot be read back (bytes missing or changed: the "
            "event file was truncated or altered); run `ledger audit`")


def _member_problems(have: Mapping[Any, Mapping], want: Mapping[Any, Mapping]) -> list[str]:
    """Member-level differences: digests that differ, members missing or extra."""
    problems: list[str] = []
    changed = [k for k in want if k in have and have[k].get("digest") != want[k]["digest"]]
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    for k in sorted(changed, key=M._id_key)[:_MAX_LISTED]:
        diffs = [f for f in M.ENTRY_FIELDS if have[k].get(f) != want[k].get(f)]
        hint = f" (entry differs in {', '.join(diffs)})" if diffs else " (the token ids, target mask, log-probs or " \
                                                                       "weights behind it differ)"
        problems.append(f"member {k}: digest {have[k].get('digest')} is not the digest of the record rebuilt from the "
                        f"log ({want[k]['digest']}){hint}")
    for k in sorted(missing, key=M._id_key)[:_MAX_LISTED]:
        problems.append(f"member {k} is admitted at this log position but missing from the manifest")
    for k in sorted(extra, key=M._id_key)[:_MAX_LISTED]:
        problems.append(f"member {k} is in the manifest but not admitted at this log position")
    more = sum(max(0, len(x) - _MAX_LISTED) for x in (changed, missing, extra))
    if more:
        problems.append(f"... and {more} more member discrepancies")
    return problems


def compare_rebuilt(doc: Mapping[str, Any], rebuilt: Mapping[str, Any]) -> list[str]:
    """Problems found comparing a document with the manifest rebuilt from the log."""
    members = doc.get("members") if isinstance(doc.get("members"), list) else []
    have = {m.get("member_id"): m for m in members if isinstance(m, Mapping)}
    want = {m["member_id"]: m for m in rebuilt["members"]}
    problems = _member_problems(have, want)
    if doc.get("merkle", {}).get("root") != rebuilt["merkle"]["root"]:
        problems.append(f"merkle.root {doc.get('merkle', {}).get('root')} differs from the root rebuilt from the log "
                        f"({rebuilt['merkle']['root']})")
    counts = doc.get("counts") if isinstance(doc.get("counts"), Mapping) else {}
    for k, v in rebuilt["counts"].items():
        if counts.get(k) != v:
            problems.append(f"counts.{k} is {counts.get(k)!r}, the log gives {v}")
    for k in sorted(set(doc) | set(rebuilt)):
        if k in _NOT_REBUILT or k in ("members", "merkle", "counts"):
            continue
        if doc.get(k) != rebuilt.get(k):
            problems.append(f"field {k!r} differs from the manifest rebuilt from the log")
    return problems


# ---------------------------------------------------------------------- prove / diff
def prove_file(path: str | Path, member_id: str) -> dict:
    """Inclusion proof of ``member_id`` in the manifest at ``path`` (checked before it is returned).

    Raises :class:`ledger.corpus.manifest.ManifestError` when the member is absent or the
    document's root does not match its members.
    """
    return prove_document(load_manifest(path), member_id)


def prove_document(doc: dict, member_id: str) -> dict:
    """:func:`prove_file` of a manifest document already read."""
    proof = M.inclusion_proof(doc, member_id)
    if proof["root"] != doc.get("merkle", {}).get("root"):
        raise M.ManifestError(f"the members hash to root {proof['root']}, but the manifest states "
                              f"{doc.get('merkle', {}).get('root')}; verify the manifest")
    M.verify_proof(proof, root=doc["merkle"]["root"])
    return proof


def explain_from_db(db: sqlite3.Connection, route: str, use: str | None) -> M.Explain:
    """Reasons a member left or joined a route, from the current projections."""
    def explain(side: str, entry: Mapping[str, Any]) -> list[str]:
        ex = entry.get("execution_id")
        out: list[str] = []
        if ex is None:
            return out
        if side == "removed":
            try:
                if governance.withdrawn(db, ex):
                    out.append("withdrawn")
                elif use is not None:
                    verdict, _why = governance.permitted(db, ex, use)
                    if verdict is False or verdict == "fail":
                        out.append("permission revoked")
            except (ImportError, sqlite3.OperationalError):
                pass
        split = _current_split(db, ex)
        if side == "removed" and split is not None and entry.get("split") is not None and split != entry.get("split"):
            out.append("split moved")
        if side == "removed" and not out and _has_table(db, "admission"):
            row = db.execute("SELECT state, predicate, reason FROM admission WHERE route = ? AND execution_id = ?",
                             (route, ex)).fetchone()
            if row is not None and row[0] in ("rejected", "unresolved"):
                out.append(f"no longer admitted ({row[0]} at {row[1]}: {row[2]})")
        return out

    return explain


def _current_split(db: sqlite3.Connection, ex: str) -> str | None:
    try:
        from ledger.projections import splits  # type: ignore[attr-defined]
    except ImportError:
        return None
    fn = getattr(splits, "execution_split", None)
    if fn is None:
        return None
    try:
        return fn(db, ex)[0]
    except (KeyError, LookupError, sqlite3.OperationalError, TypeError):
        return None


def diff_files(a: str | Path, b: str | Path, paths: StorePaths | None = None, *, trust: Trust | None = None) -> dict:
    """``ledger manifest diff A B``: what changed from A to B and why (see module doc)."""
    da, db_ = load_manifest(a), load_manifest(b)
    if trust is None and paths is not None:
        trust = Trust.load(paths.trust)
    for doc in (da, db_):
        if not isinstance(doc.get("members"), list):
            raise PublishError("both files must be manifest documents with a members list")
    explain = None
    conn = None
    if paths is not None and Path(paths.db).exists():

        conn = connect(paths.db)
        use = db_.get("declared_use") if isinstance(db_.get("declared_use"), str) else None
        explain = explain_from_db(conn, str(db_.get("route")), use)
    try:
        out = M.diff_manifests(da, db_, explain)
    finally:
        if conn is not None:
            conn.close()
    out["verification"] = {"a": M.verify_manifest(da, trust) if trust else ["not checked (no trust file)"],
                           "b": M.verify_manifest(db_, trust) if trust else ["not checked (no trust file)"]}
    out["reasons_from"] = "current projections and the documents" if explain else "the documents only"
    return out
