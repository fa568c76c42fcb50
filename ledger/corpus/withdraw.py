"""Library functions behind `ledger withdraw` and `ledger impact` (SPEC §6.4, §7.2).

``withdraw(paths, subject, reason=..., key=...)`` builds the ``withdrawal`` line, signs it
with the given Ed25519 key (``ledger.events.signing.sign_line``), ingests it through the one
ingest path (``Ingestor``, trust from the store's trust file), brings the projections up
to date and, with ``erase=True``, crypto-shreds: it runs every erase step
(:func:`ledger.corpus.erasure.complete`: the projection databases purged by replay, the data
keys of every subject the withdrawal covers destroyed in the store's ``data-keys.db``, the
gateway's restoration state deleted), each on its own file, so one busy or damaged file never
stops the others; ``resume(paths)`` (``ledger withdraw --resume``) finishes what could not be done.

Erase never reports success over readable tokens (SPEC §9): before anything is appended,
:func:`erase_blockers` reads every covered request and ``record_derived`` from the log and
:class:`EraseRefused` (exit 2) names each record whose tokens a key destruction could not
make unreadable: requests stored in the clear (``--no-seal``, older logs, events written
straight to Kafka), requests sealed under a key that also seals records outside the
subject (or one this store's ``data-keys.db`` does not hold), the clear replacement tokens
of a ``record_derived``, and a derived view whose parent's tokens stay readable.

``impact_report(paths, subject)`` brings the projections up to date and returns
:func:`projections.governance.impact`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

from ledger.algorithms.errors import InputError
from ledger.events.signing import (
    Trust,
    key_id,
    load_private_key,
    public_bytes,
    sign_line,
)
from ledger.log import open_log
from ledger.log.paths import StorePaths
from ledger.corpus.erasure import (  # erase_keys, sealed_keys_of: re-exported (their home is erasure)
    ERASE_WAIT, complete, coverage_from_log, erase_keys, erase_subjects, retry_busy, sealed_keys_of)
from ledger.log.sealing import KeyStore
from ledger.producers.ingest import Ingestor
from ledger.events.codec import CodecError, default_codec
from ledger.projections.governance import covered_executions, covered_subjects, lineage_chain
from ledger.projections.registry import open_engine, store_keystore
from ledger.log.base import CorruptStore
import json
from ledger.corpus.publish import archive_path
from ledger.projections.governance import impact

__all__ = ["withdrawal_line", "withdraw", "resume", "impact_report", "erase_keys", "sealed_keys_of", "archived_documents",
           "check_subject", "format_impact", "erase_blockers", "EraseRefused"]

_LIST = 10  # records named per kind of blocker in the one-line refusal


class EraseRefused(InputError):
    """``withdraw --erase`` would leave covered tokens readable; nothing was appended or destroyed."""


def withdrawal_line(subject: str, reason: str, authority: str, erase: bool = False) -> dict:
    """The JSON line (SPEC §7.1 ``withdrawal``) before signing."""
    line = {"type": "withdrawal", "subject": subject, "reason": reason, "authority": authority}
    if erase:
        line["erase"] = True
    return line


def erase_blockers(log, db: sqlite3.Connection, keystore: KeyStore | None, subject: str) -> list[str]:
    """Why erasing ``subject`` cannot make every covered token unreadable ([] when it can).

    Reads the log itself (not a projection, which may have refused some of those events):
    every ``request`` and ``record_derived`` of a covered execution or derived view."""

    originals, views = covered_executions(db, subject)
    everything = subject == "*"
    covered = set(originals) | set(views)
    if subject.startswith("execution:"):
        covered.add(subject.partition(":")[2])
    key_subjects = set(covered_subjects(db, subject))
    codec = default_codec()
    unsealed, shared, unknown, replaced = [], {}, [], []
    for where in log.partitions():
        for rec in log.read(where):
            if rec.event_type not in ("request", "record_derived", ""):
                continue
            try:
                ev = codec.decode(rec.value)
            except (CodecError, ValueError):
                continue  # undecodable: dead-lettered by replay, reported by `ledger audit`
            if ev["event_type"] == "request" and (everything or ev["execution_id"] in covered):
                name = f"{ev['execution_id']}/{ev['request_id']}"
                sealed = ev.get("sealed")
                if sealed is None:
                    unsealed.append(name)
                    continue
                kid = sealed["key_id"]
                owner = keystore.subject_of(kid) if keystore is not None else None
                if owner is None:
                    unknown.append(f"{name} (key {kid})")
                elif keystore.key_by_id(kid) is not None and not everything and owner not in key_subjects:
                    shared.setdefault(owner, []).append(name)
            elif ev["event_type"] == "record_derived" and (everything or ev["derived_execution_id"] in covered):
                reps = sorted(r for r, v in (ev.get("replacements") or {}).items()
                              if v.get("input_ids") is not None or v.get("output_ids") is not None)
                if reps:
                    replaced.append(f"{ev['derived_execution_id']} ({', '.join(reps)})")

    def names(items: list[str]) -> str:
        more = f", and {len(items) - _LIST} more" if len(items) > _LIST else ""
        return ", ".join(items[:_LIST]) + more

    out = []
    if unsealed:
        out.append(f"{len(unsealed)} request{'s are' if len(unsealed) != 1 else ' is'} not sealed: {names(unsealed)} "
                   "(ingested with --no-seal, by an older release, or written straight to the log)")
    for owner, reqs in sorted(shared.items()):
        out.append(f"{len(reqs)} request(s) are sealed under the key of {owner}, which also seals records this "
                   f"withdrawal does not cover: {names(reqs)} (erase {owner} instead)")
    if unknown:
        out.append(f"{len(unknown)} request(s) are sealed under keys this store's data-keys.db does not hold, so they "
                   f"cannot be destroyed here: {names(unknown)}")
    if replaced:
        out.append(f"{len(replaced)} derived view(s) carry replacement tokens in the clear (record_derived "
                   f"replacements are not sealed): {names(replaced)}")
    if not everything:
        orphans = []
        for v in sorted(views):
            root = lineage_chain(db, v)[-1]
            if root not in originals:
                orphans.append(f"{v} (tokens of execution:{root})")
        if orphans:
            out.append(f"{len(orphans)} derived view(s) show tokens of an execution this withdrawal does not erase: "
                       f"{names(orphans)} (erase the parent execution instead)")
    return out


def _engine(log, paths: StorePaths, trust: Trust, busy_timeout: float = 30.0):
    """The store's engine, with the store's data-key store (when it has one) so the tree
    projection can open sealed requests that were not erased."""

    return open_engine(log, paths.db, trust, keystore=store_keystore(paths), busy_timeout=busy_timeout)


def _governance_db(log, paths: StorePaths, trust: Trust, wait: float, progress) -> sqlite3.Connection:
    """The store's projection database brought up to date, or -- when it is busy past ``wait`` or
    damaged -- the governance tables built in memory from the log (an erase never depends on it)."""

    def run(timeout: float) -> sqlite3.Connection:
        engine = _engine(log, paths, trust, timeout)
        try:
            engine.run(progress=progress)
        except BaseException:
            engine.db.close()
            raise
        return engine.db

    try:
        return retry_busy(run, wait)
    except (sqlite3.DatabaseError, CorruptStore):
        return coverage_from_log(log, trust)


def withdraw(paths: StorePaths, subject: str, *, reason: str, key: str | Path, erase: bool = False,
             authority: str | None = None, rebuild: bool = True, wait: float | None = None,
             progress: Callable[[int, int], None] | None = None) -> dict:
    """Sign and ingest a withdrawal; with ``erase``, run every erase step (:func:`ledger.corpus.erasure.complete`).

    Returns ``{"event_id", "appended", "duplicate", "conflicts", "erase": {...}|None,
    "impact": {...}}``.  Raises ``IngestError`` / ``ValidationError`` / ``SignatureError``
    on bad input (nothing appended).  On a conflict (the subject was already withdrawn with
    different content) nothing is appended and no key is touched.  An erase step that could not
    be done (a file busy for more than ``wait`` seconds, or damaged) is listed in
    ``erase["failed"]``; every other step was done, and re-running (or :func:`resume`) finishes it."""

    check_subject(subject)
    wait = ERASE_WAIT if wait is None else wait
    pk = load_private_key(Path(key))
    authority = authority or f"key:{key_id(public_bytes(pk))}"
    line = sign_line(withdrawal_line(subject, reason, authority, erase), pk)
    trust = Trust.load(paths.trust)
    with open_log(paths.url) as log:
        if erase:  # refuse before anything is appended when the erasure could not make every token unreadable
            _refuse_blocked(log, _governance_db(log, paths, trust, wait, progress), paths, subject)
        report = Ingestor(log, trust, producer="ledger-withdraw").ingest_lines([(1, line)])
        out: dict = {"subject": subject, "erase": None, "appended": report.appended, "duplicate": report.duplicates,
                     "conflicts": report.conflicts}
        if report.result is not None:
            ids = [e for e, _ in report.result.appended + report.result.duplicates]
            out["event_id"] = ids[0] if ids else None
        if report.conflicts:
            return out
        if erase:
            out["erase"], db = complete(paths, log, trust, [subject], reason=reason, wait=wait, rebuild=rebuild,
                                        progress=progress)
        else:
            engine = _engine(log, paths, trust)
            engine.run(progress=progress)
            db = engine.db
        try:
            out["impact"] = impact(db, subject, archived_documents(paths))
        finally:
            db.close()
    return out


def _refuse_blocked(log, db: sqlite3.Connection, paths: StorePaths, subject: str) -> None:
    ks = KeyStore(paths.data_keys) if Path(paths.data_keys).exists() else None
    try:
        blockers = erase_blockers(log, db, ks, subject)
    finally:
        if ks is not None:
            ks.close()
        db.close()
    if blockers:
        raise EraseRefused(f"cannot erase {subject}: " + "; ".join(blockers) + "; nothing was appended and no key "
                           "was destroyed")


def resume(paths: StorePaths, subject: str | None = None, *, wait: float | None = None,
           progress: Callable[[int, int], None] | None = None) -> dict:
    """``ledger withdraw --resume``: run every erase step again for ``subject`` (None: every withdrawal
    with erase on the log); appends nothing.  Raises ``ValueError`` when ``subject`` was never
    withdrawn with erase.  Returns the erase report (``failed`` empty when the erasure is complete)."""

    if subject is not None:
        check_subject(subject)
    trust = Trust.load(paths.trust)
    with open_log(paths.url) as log:
        if subject is not None:
            gov = coverage_from_log(log, trust)
            known = erase_subjects(gov)
            gov.close()
            if subject not in known:
                raise InputError(f"{subject} was never withdrawn with --erase on this log; nothing to resume")
        out, db = complete(paths, log, trust, None if subject is None else [subject],
                           wait=ERASE_WAIT if wait is None else wait, rebuild=False, progress=progress)
        db.close()
    return out


def archived_documents(paths: StorePaths) -> Callable[[dict], dict | None]:
    """Loader of published manifest documents from the store's archive (``ledger.corpus.publish.archive_path``).

    Returns a function ``manifest_row -> document | None``; ``None`` when the archive or
    the document is missing (the impact report then lists the version as unverifiable)."""


    def load(row: dict) -> dict | None:
        try:
            path = Path(archive_path(paths, row["route"], row["version"]))
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    return load


def check_subject(subject: str) -> str:
    """``source:ID``, ``task:ID``, ``execution:ID`` or ``*`` (raises ``ValueError`` otherwise)."""
    kind, sep, ident = subject.partition(":")
    if subject != "*" and (not sep or not ident or kind not in ("source", "task", "execution")):
        raise InputError(f"subject must be source:ID, task:ID, execution:ID or *, got {subject!r}")
    return subject


def impact_report(paths: StorePaths, subject: str, *, progress: Callable[[int, int], None] | None = None) -> dict:
    """Bring the projections up to date and report what ``subject`` touches."""

    check_subject(subject)
    with open_log(paths.url) as log:
        engine = _engine(log, paths, Trust.load(paths.trust))
        engine.run(progress=progress)
        try:
            return impact(engine.db, subject, archived_documents(paths))
        finally:
            engine.db.close()


def format_impact(rep: dict) -> str:
    """Human-readable impact report (``ledger impact`` without ``--json``)."""
    lines = [f"impact of {rep['subject']}" + (" (withdrawn)" if rep.get("withdrawn") else " (not withdrawn)")]
    for w in rep.get("withdrawals", []):
        lines.append(f"  withdrawal {w['event_id']}: {w['reason']} by {w['authority']}" + (" [erase]" if w["erase"] else ""))
    lines.append(f"tasks ({len(rep['tasks'])}): {', '.join(rep['tasks']) or '-'}")
    lines.append(f"executions ({len(rep['executions'])}): {', '.join(rep['executions']) or '-'}")
    lines.append(f"derived views ({len(rep['derived_views'])}): {', '.join(rep['derived_views']) or '-'}")
    if rep.get("note"):
        lines.append(f"manifests: {rep['note']}")
    else:
        lines.append(f"published manifest versions touched: {len(rep['manifests'])} ({rep['members']} members)")
        for m in rep["manifests"]:
            lines.append(f"  {m['route']} v{m['version']}: {len(m['members'])} members")
            for ck in m.get("checkpoints", []):  # SPEC 6.10: checkpoints trained on this manifest version
                lines.append(f"    checkpoint {ck['checkpoint_id']} trained on it (evaluation claims: "
                             f"{', '.join(ck['evaluation_claims']) or '-'})")
            for mem in m["members"]:
                lines.append(f"    {mem['member_id']} (execution {mem['execution_id']})")
    for u in rep.get("unverifiable_manifests", []):
        lines.append(f"  {u['route']} v{u['version']}: cannot list members: {u['why']}")
    steps = rep.get("consumer_steps", [])
    lines.append(f"feed consumer steps that trained on it: {len(steps)}")  # SPEC 11.6
    for s in steps:
        cks = f" (checkpoints: {', '.join(s['checkpoint_ids'])})" if s["checkpoint_ids"] else ""
        lines.append(f"  {s['consumer']} step {s['step']} on {s['route']}: {len(s['members'])} members{cks}")
    return "\n".join(lines)
