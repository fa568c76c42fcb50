"""Library functions behind `ledger withdraw` and `ledger impact` (SPEC §6.4, §7.2).

``withdraw(paths, subject, reason=..., key=...)`` builds the ``withdrawal`` line, signs it
with the given Ed25519 key (``ledger.events.signing.sign_line``), ingests it through the one
ingest path (``Ingestor``, trust from the store's trust file), brings the projections up
to date and, with ``erase=True``, crypto-shreds: it destroys the data keys of every
subject the withdrawal covers (the subject, its tasks, executions and derived views) in
the store's ``data-keys.db`` and rebuilds the projection database from the log, so no
projection keeps a decrypted copy of the erased tokens.

``impact_report(paths, subject)`` brings the projections up to date and returns
:func:`projections.governance.impact`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

from ledger.events.signing import (
    Trust,
    key_id,
    load_private_key,
    public_bytes,
    sign_line,
)
from ledger.log import open_log
from ledger.log.paths import StorePaths
from ledger.log.sealing import KeyStore
from ledger.producers.ingest import Ingestor

__all__ = ["withdrawal_line", "withdraw", "impact_report", "erase_keys", "sealed_keys_of", "archived_documents",
           "check_subject", "format_impact"]


def withdrawal_line(subject: str, reason: str, authority: str, erase: bool = False) -> dict:
    """The JSON line (SPEC §7.1 ``withdrawal``) before signing."""
    line = {"type": "withdrawal", "subject": subject, "reason": reason, "authority": authority}
    if erase:
        line["erase"] = True
    return line


def sealed_keys_of(db: sqlite3.Connection, executions: list[str]) -> dict[str, list[str]]:
    """key id -> executions whose requests are sealed under it (from the governance projection)."""
    out: dict[str, list[str]] = {}
    for i in range(0, len(executions), 500):
        chunk = executions[i:i + 500]
        for ex, kid in db.execute(f"SELECT execution_id, key_id FROM sealed_keys WHERE execution_id IN "
                                  f"({','.join('?' * len(chunk))}) ORDER BY execution_id, key_id", chunk):
            out.setdefault(kid, []).append(ex)
    return out


def erase_keys(db: sqlite3.Connection, keystore: KeyStore, subject: str, *, reason: str | None = None) -> dict:
    """Destroy the data key of every subject ``subject`` covers; report what could not be destroyed.

    A key is destroyed when its own subject is covered by the withdrawal (the subject
    itself, ``task:`` of its tasks, ``execution:`` of its executions and derived views, or
    every key for ``*``).  A covered record sealed under a *broader* subject's key (say
    ``source:S`` when only ``execution:X`` is erased) is listed under ``not_destroyed``:
    destroying that key would erase records the withdrawal does not cover."""
    from projections.governance import covered_executions, covered_subjects

    subjects = covered_subjects(db, subject)
    if subject == "*":
        subjects = sorted(set(subjects) | set(keystore.subjects()))
    destroyed = []
    for s in subjects:
        kid = keystore.destroy(s, reason)
        if kid is not None:
            destroyed.append({"subject": s, "key_id": kid})
    originals, views = covered_executions(db, subject)
    not_destroyed = []
    for kid, exs in sorted(sealed_keys_of(db, originals + views).items()):
        if keystore.key_by_id(kid) is None:
            continue  # destroyed now or earlier
        owner = keystore.subject_of(kid)
        not_destroyed.append({"key_id": kid, "subject": owner, "executions": exs,
                              "why": f"the key belongs to {owner}, which this withdrawal does not cover; "
                                     f"withdraw {owner} with --erase to shred it"})
    return {"destroyed": destroyed, "not_destroyed": not_destroyed}


def _engine(log, paths: StorePaths, trust: Trust):
    """The store's engine, with the store's data-key store (when it has one) so the tree
    projection can open sealed requests that were not erased."""
    from projections.registry import open_engine, store_keystore

    return open_engine(log, paths.db, trust, keystore=store_keystore(paths))


def withdraw(paths: StorePaths, subject: str, *, reason: str, key: str | Path, erase: bool = False,
             authority: str | None = None, rebuild: bool = True,
             progress: Callable[[int, int], None] | None = None) -> dict:
    """Sign and ingest a withdrawal; with ``erase``, destroy the covered data keys and rebuild.

    Returns ``{"event_id", "appended", "duplicate", "conflicts", "erase": {...}|None,
    "impact": {...}}``.  Raises ``IngestError`` / ``ValidationError`` / ``SignatureError``
    on bad input (nothing appended).  On a conflict (the subject was already withdrawn with
    different content) nothing is appended and no key is touched."""
    check_subject(subject)
    pk = load_private_key(Path(key))
    authority = authority or f"key:{key_id(public_bytes(pk))}"
    line = sign_line(withdrawal_line(subject, reason, authority, erase), pk)
    trust = Trust.load(paths.trust)
    with open_log(paths.url) as log:
        report = Ingestor(log, trust, producer="ledger-withdraw").ingest_lines([(1, line)])
        out: dict = {"subject": subject, "erase": None, "appended": report.appended, "duplicate": report.duplicates,
                     "conflicts": report.conflicts}
        if report.result is not None:
            ids = [e for e, _ in report.result.appended + report.result.duplicates]
            out["event_id"] = ids[0] if ids else None
        if report.conflicts:
            return out
        engine = _engine(log, paths, trust)
        engine.run(progress=progress)
        if erase:
            with KeyStore(paths.data_keys) as ks:
                out["erase"] = erase_keys(engine.db, ks, subject, reason=reason)
            if rebuild:  # drop every decrypted copy a projection may hold, then replay
                engine.db.execute("PRAGMA secure_delete=ON")  # zero the dropped pages, not just free them
                engine.rebuild()
                engine.run(progress=progress)
                engine.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # no old page left in the WAL file
                out["erase"]["projections_rebuilt"] = True
        from projections.governance import impact

        out["impact"] = impact(engine.db, subject, archived_documents(paths))
        engine.db.close()
    return out


def archived_documents(paths: StorePaths) -> Callable[[dict], dict | None]:
    """Loader of published manifest documents from the store's archive (``ledger.corpus.publish.archive_path``).

    Returns a function ``manifest_row -> document | None``; ``None`` when the archive or
    the document is missing (the impact report then lists the version as unverifiable)."""
    import json

    from ledger.corpus.publish import archive_path

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
        raise ValueError(f"subject must be source:ID, task:ID, execution:ID or *, got {subject!r}")
    return subject


def impact_report(paths: StorePaths, subject: str, *, progress: Callable[[int, int], None] | None = None) -> dict:
    """Bring the projections up to date and report what ``subject`` touches."""
    from projections.governance import impact

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
            for mem in m["members"]:
                lines.append(f"    {mem['member_id']} (execution {mem['execution_id']})")
    for u in rep.get("unverifiable_manifests", []):
        lines.append(f"  {u['route']} v{u['version']}: cannot list members: {u['why']}")
    return "\n".join(lines)
