"""ledger.projections.lineage: the one walk up a derived view's parent chain (missing rows, cycles)."""

from __future__ import annotations

import sqlite3

import pytest

from ledger.projections.lineage import ancestors, iter_ancestors, parent_of, root_of, task_of


@pytest.fixture
def db():
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE assessment_executions (execution_id TEXT PRIMARY KEY, task_id TEXT, parent_execution_id TEXT)")
    db.executemany("INSERT INTO assessment_executions VALUES (?,?,?)", [
        ("o", "t1", None),  # an original
        ("v", None, "o"), ("vv", None, "v"),  # a view and a view of the view
        ("own", "t2", "o"),  # a view naming its own task
        ("dangling", None, "ghost"),  # the parent has no row
        ("a", None, "b"), ("b", None, "c"), ("c", None, "b"),  # a -> b -> c -> b: a cycle
        ("s", None, "s"),  # its own parent
    ])
    return db


def test_chain_of_an_original_a_view_and_a_view_of_a_view(db):
    assert ancestors(db, "o") == ["o"]
    assert ancestors(db, "vv") == ["vv", "v", "o"]
    assert parent_of(db, "vv") == "v" and parent_of(db, "o") is None and parent_of(db, "nobody") is None
    assert root_of(db, "vv") == "o" and root_of(db, "o") == "o"
    assert task_of(db, "vv") == "t1" and task_of(db, "own") == "t2"


def test_unknown_executions_and_missing_parents(db):
    assert ancestors(db, "nobody") == ["nobody"] and root_of(db, "nobody") == "nobody" and task_of(db, "nobody") is None
    assert ancestors(db, "dangling") == ["dangling", "ghost"]
    assert root_of(db, "dangling") == "ghost" and task_of(db, "dangling") is None


def test_cycles_are_cut(db):
    assert ancestors(db, "a") == ["a", "b", "c"] and ancestors(db, "s") == ["s"]
    assert root_of(db, "a") == "b" and root_of(db, "s") == "s"  # where the walk closes the cycle
    assert task_of(db, "a") is None and task_of(db, "s") is None


def test_the_walk_is_lazy(db):
    seen = []
    db.set_trace_callback(seen.append)
    assert next(iter_ancestors(db, "vv")) == "vv"
    assert seen == []  # the first answer costs no query
