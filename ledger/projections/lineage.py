"""The derivation chain of an execution, as the assessment projection records it.

A derived view (``record_derived``) has a ``parent_execution_id`` in ``assessment_executions``;
it inherits its parent's task, selections, feedback, campaign, controls.  Every reader that
walks up that chain uses these helpers, so the walk has one set of rules:

* the chain starts with ``ex`` itself (even when ``ex`` has no row);
* it ends at an execution without a row or without a parent;
* a cycle is cut: an execution is visited at most once (no helper loops or recurses forever).

(``projections.governance.lineage_chain`` walks the governance projection's own ``lineage``
table, which is a different fact with a depth cap; it is not this chain.)
"""

from __future__ import annotations

import sqlite3
from typing import Iterator


def parent_of(db: sqlite3.Connection, ex: str) -> str | None:
    """The execution ``ex`` was derived from, or None (an original, or not known)."""
    row = db.execute("SELECT parent_execution_id FROM assessment_executions WHERE execution_id = ?", (ex,)).fetchone()
    return row[0] if row else None


def iter_ancestors(db: sqlite3.Connection, ex: str) -> Iterator[str]:
    """``ex``, its parent, grandparent, ... lazily (stop consuming at the first one that answers)."""
    seen: set[str] = set()
    cur: str | None = ex
    while cur is not None and cur not in seen:
        seen.add(cur)
        yield cur
        cur = parent_of(db, cur)


def ancestors(db: sqlite3.Connection, ex: str) -> list[str]:
    """``[ex, parent, grandparent, ...]`` (cycles cut)."""
    return list(iter_ancestors(db, ex))


def root_of(db: sqlite3.Connection, ex: str) -> str:
    """The original execution ``ex`` derives from (``ex`` itself when it has no parent).

    On a cycle there is no original: the execution where the walk closes the cycle (the first
    one met twice) is returned."""
    seen: set[str] = set()
    while ex not in seen:
        seen.add(ex)
        parent = parent_of(db, ex)
        if parent is None:
            return ex
        ex = parent
    return ex


def task_of(db: sqlite3.Connection, ex: str) -> str | None:
    """The task of ``ex``: its own ``task_id``, else the nearest ancestor's; None when no execution
    of the chain names one (or ``ex`` is not known)."""
    seen: set[str] = set()
    cur: str | None = ex
    while cur is not None and cur not in seen:
        seen.add(cur)
        row = db.execute("SELECT task_id, parent_execution_id FROM assessment_executions WHERE execution_id = ?",
                         (cur,)).fetchone()
        if row is None:
            return None
        if row[0] is not None:
            return row[0]
        cur = row[1]
    return None
