"""The projections `ledger project` maintains, in dependency order."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ledger.events.signing import Trust
from ledger.log.base import Log
from ledger.projections.engine import Projection, ReplayEngine, connect
from ledger.projections.splits import SplitsProjection
from ledger.projections.governance import GovernanceProjection
from ledger.projections.admission import AdmissionProjection
from ledger.projections.credits import CreditsProjection
from ledger.projections.manifests import ManifestsProjection
from ledger.log.sealing import KeyStore
from ledger.projections.tree import TreeProjection
from ledger.projections.assessment import AssessmentProjection  # scoring (SPEC 6.2)
from ledger.projections.evidence import EvidenceProjection  # faults, feedback, probes (SPEC 6.10; before admission)
from ledger.projections.verifier import VerifierProjection  # protected paths, grader controls (SPEC 6.10; before admission)
from ledger.projections.collections import CollectionsProjection  # collection manifests, checkpoints (SPEC 6.10)
from ledger.projections.canaries import CanariesProjection  # declared canaries (SPEC 11.2; read by manifest publish)
from ledger.projections.preference import PreferenceProjection  # preference pairs (SPEC 6.9; reads admission in finish())
from ledger.projections.consumers import ConsumersProjection  # feed consumers' acknowledged batches (SPEC 11.6; own tables)


def all_projections(keystore=None) -> list[Projection]:
    """Fresh instances of every projection, upstream first.

    ``keystore`` (a :class:`ledger.log.sealing.KeyStore`, see :func:`store_keystore`) lets the
    tree projection open sealed requests; without it they are refused (and listed)."""
    out: list[Projection] = []
    out.append(TreeProjection(keystore=keystore))
    out.append(SplitsProjection())
    out.append(GovernanceProjection())
    out.append(AssessmentProjection())
    out.append(EvidenceProjection())
    out.append(VerifierProjection())
    out.append(CollectionsProjection())
    out.append(CanariesProjection())
    out.append(AdmissionProjection())
    out.append(PreferenceProjection())
    out.append(CreditsProjection())
    out.append(ConsumersProjection())
    out.append(ManifestsProjection())
    return out


def open_engine(log: Log, db_path: str | Path, trust: Trust, keystore=None, *, busy_timeout: float = 30.0) -> ReplayEngine:
    db: sqlite3.Connection = connect(db_path, busy_timeout=busy_timeout)
    return ReplayEngine(log, db, all_projections(keystore=keystore), trust=trust)


def store_keystore(paths):
    """The store's data-key store (``StorePaths.data_keys``) when its file exists, else ``None``.

    The file is created by the first sealed ingestion (``ledger ingest-sealed``), so a store
    that never sealed anything gets no key file from reading it.  The caller closes it."""

    path = getattr(paths, "data_keys", None)
    return KeyStore(path) if path is not None and Path(path).exists() else None


def with_keystore(projections: list, keystore) -> list:
    """Hand ``keystore`` to every projection of a (factory-made) list that reads sealed
    requests (has a ``keystore`` attribute still ``None``); returns the list."""
    if keystore is not None:
        for p in projections:
            if getattr(p, "keystore", False) is None:
                p.keystore = keystore
    return projections
