"""Transitive derived views: the one walk over a parent -> child table that projections share."""

from __future__ import annotations

import sqlite3
from typing import Iterable


def descendants(db: sqlite3.Connection, roots: Iterable[str], *, table: str, child: str, parent: str) -> set[str]:
    """Every id reachable from ``roots`` by one or more ``parent -> child`` rows of ``table``.

    Roots are included only when another root (or a cycle) reaches them.  Queries go in
    chunks of 500 ids, each id is expanded at most once, so cycles terminate.
    """
    out: set[str] = set()
    frontier = sorted(set(roots))
    while frontier:
        found: set[str] = set()
        for i in range(0, len(frontier), 500):
            chunk = frontier[i:i + 500]
            found.update(r[0] for r in db.execute(
                f"SELECT {child} FROM {table} WHERE {parent} IN ({','.join('?' * len(chunk))})", chunk))
        frontier = sorted(found - out)
        out |= found
    return out
