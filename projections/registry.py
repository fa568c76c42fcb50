"""The projections `ledger project` maintains, in dependency order."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ledger.log.base import Log
from ledger.signing import Trust

from .engine import Projection, ReplayEngine, connect


def all_projections() -> list[Projection]:
    """Fresh instances of every projection, upstream first."""
    out: list[Projection] = []
    try:
        from .tree import TreeProjection
    except ImportError:  # pragma: no cover - during bootstrap of the project only
        return out
    out.append(TreeProjection())
    from .splits import SplitsProjection  # task groups, splits, quarantine, similarity (before admission)

    out.append(SplitsProjection())
    from .governance import GovernanceProjection  # lineage, permissions, withdrawals (before admission)

    out.append(GovernanceProjection())
    from .assessment import AssessmentProjection  # scoring (SPEC 6.2)

    out.append(AssessmentProjection())
    from .admission import AdmissionProjection  # routes, cascades, targets; reads everything above in finish()

    out.append(AdmissionProjection())
    from .manifests import ManifestsProjection  # published manifest headers (reads only its own table; keep last)

    out.append(ManifestsProjection())
    return out


def open_engine(log: Log, db_path: str | Path, trust: Trust) -> ReplayEngine:
    db: sqlite3.Connection = connect(db_path)
    return ReplayEngine(log, db, all_projections(), trust=trust)
