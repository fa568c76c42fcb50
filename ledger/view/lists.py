"""Lists that scale for ``ledger serve`` (issue 32 item 4): executions, tasks and withdrawals are
filtered, sorted and paged **in SQL** (one ``COUNT`` and one ``LIMIT/OFFSET`` query per page);
only the rows of the page shown are then completed (admission states, role classes, splits).

Query parameters of every list: ``sort`` (a column key the page names), ``order`` (``asc`` or
``desc``), ``page`` (1-based) and ``limit`` (rows per page, at most :data:`MAX_LIMIT`).  The
executions list also takes ``task``, ``split``, ``route``, ``state``, ``role_class`` and
``erased`` (``yes``: withdrawn with ``erase``; ``no``: not erased).  A page of the executions
list of a 100,000-execution store renders in well under a second (``benchmarks/bench_serve.py``).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from ledger.algorithms.errors import InputError
from ledger.events.validate import format_micros
from ledger.projections.splits import execution_split

MAX_LIMIT = 5000
DEFAULT_LIMIT = 100


class ListError(InputError):
    """A bad list parameter (the server answers 400 with this message)."""


@dataclass(frozen=True)
class PageArgs:
    page: int
    limit: int
    sort: str
    order: str

    @property
    def offset(self) -> int:
        return (self.page - 1) * self.limit


def page_args(p: dict, sorts: dict[str, str], default_sort: str, int_param) -> PageArgs:
    """Read ``page``, ``limit``, ``sort``, ``order`` of ``p`` (``int_param`` checks integers)."""
    sort = p.get("sort") or default_sort
    if sort not in sorts:
        raise ListError(f"sort must be one of {', '.join(sorts)}, got {sort[:40]!r}")
    order = p.get("order") or "asc"
    if order not in ("asc", "desc"):
        raise ListError(f"order must be asc or desc, got {order[:40]!r}")
    limit = DEFAULT_LIMIT if p.get("limit") is None else int_param("limit", p["limit"], 1, MAX_LIMIT)
    page = 1 if p.get("page") is None else int_param("page", p["page"], 1, 10**9)
    return PageArgs(page, limit, sort, order)


def order_by(sorts: dict[str, str], a: PageArgs, tie: str) -> str:
    """``ORDER BY`` of a sort key (NULLs last either way; ties by ``tie`` ascending keep pages disjoint)."""
    col, d = sorts[a.sort], "DESC" if a.order == "desc" else "ASC"
    return f"ORDER BY ({col}) IS NULL, {col} {d}, {tie} ASC"


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None


_CONTAINS = "{col} LIKE ? ESCAPE '\\'"


def contains(text: str) -> str:
    """The ``LIKE`` pattern (escape ``\\``) of the values that contain ``text``."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _in(ids: list[str]) -> str:
    return ",".join("?" * len(ids))


# ------------------------------------------------------------------ executions
EXECUTION_SORTS = {"execution": "b.execution_id", "task": "b.task_id", "split": "b.split", "requests": "b.requests",
                   "nodes": "b.nodes", "stored": "b.stored_tokens", "expanded": "b.expanded_tokens",
                   "reward": "b.reward", "opened": "b.opened_at_us"}


def _executions_base(db: sqlite3.Connection) -> str:
    """One row per execution and derived view with its sortable, filterable columns."""
    has = {t: _has(db, t) for t in ("lineage", "tree_stats", "execution_scores", "withdrawn_executions",
                                    "task_groups", "group_splits")}
    lin = "LEFT JOIN lineage l ON l.derived_execution_id = e.execution_id" if has["lineage"] else ""
    parent = "l.parent_execution_id" if has["lineage"] else "NULL"
    views = ("UNION ALL SELECT l.derived_execution_id, p.task_id, l.parent_execution_id, p.opened_at_us FROM lineage l "
             "LEFT JOIN executions p ON p.execution_id = l.parent_execution_id WHERE l.derived_execution_id NOT IN "
             "(SELECT execution_id FROM executions)") if has["lineage"] else ""
    split = ("(SELECT g.split FROM task_groups t JOIN group_splits g ON g.group_id = t.group_id WHERE t.task_id = x.task_id)"
             if has["task_groups"] and has["group_splits"] else "NULL")
    stats = "LEFT JOIN tree_stats s ON s.execution_id = x.execution_id" if has["tree_stats"] else ""
    cols = ", ".join(f"{'s.' + c if has['tree_stats'] else 'NULL'} AS {c}"
                     for c in ("requests", "nodes", "stored_tokens", "expanded_tokens"))
    scores = "LEFT JOIN execution_scores c ON c.execution_id = x.execution_id" if has["execution_scores"] else ""
    score = "c.state AS state, c.reward AS reward" if has["execution_scores"] else "NULL AS state, NULL AS reward"
    erased = ("(SELECT MAX(w.erase) FROM withdrawn_executions w WHERE w.execution_id = x.execution_id)"
              if has["withdrawn_executions"] else "NULL")
    return (f"(SELECT x.execution_id, x.task_id, x.parent, x.opened_at_us, {split} AS split, {cols}, "
            f"{score}, {erased} AS withdrawn_erase FROM (SELECT e.execution_id, e.task_id, "
            f"{parent} AS parent, e.opened_at_us FROM executions e {lin} {views}) x {stats} {scores})")


def _execution_filters(f: dict) -> tuple[list[str], list[Any]]:
    where, args = [], []
    if f.get("task") is not None:
        where.append("b.task_id = ?")
        args.append(f["task"])
    if f.get("split") is not None:
        where.append("COALESCE(b.split, 'unassigned') = ?")
        args.append(f["split"])
    if f.get("route") is not None or f.get("state") is not None:
        conds = " AND ".join(c for c, v in (("route = ?", f.get("route")), ("state = ?", f.get("state"))) if v is not None)
        where.append(f"b.execution_id IN (SELECT execution_id FROM admission WHERE {conds})")
        args += [v for v in (f.get("route"), f.get("state")) if v is not None]
    if f.get("role_class") is not None:
        tier, _, kind = f["role_class"].partition("/")
        where.append("(b.execution_id IN (SELECT execution_id FROM tree_requests WHERE agent_tier = ? AND turn_kind = ?) "
                     "OR b.parent IN (SELECT execution_id FROM tree_requests WHERE agent_tier = ? AND turn_kind = ?))")
        args += [tier, kind, tier, kind]
    if f.get("erased") == "yes":
        where.append("b.withdrawn_erase = 1")
    elif f.get("erased") == "no":
        where.append("COALESCE(b.withdrawn_erase, 0) = 0")
    return where, args


def executions_page(db: sqlite3.Connection, filters: dict, a: PageArgs) -> dict:
    """The executions list: ``matching`` rows, the page's rows completed with admission and roles."""
    where, args = _execution_filters(filters)
    base = _executions_base(db)
    cond = f"WHERE {' AND '.join(where)}" if where else ""
    total = db.execute(f"SELECT COUNT(*) FROM {base} b {cond}", args).fetchone()[0]
    cur = db.execute(f"SELECT b.* FROM {base} b {cond} {order_by(EXECUTION_SORTS, a, 'b.execution_id')} "
                     f"LIMIT ? OFFSET ?", [*args, a.limit, a.offset])
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r)) for r in cur]
    ids = [r["execution_id"] for r in rows]
    own = ids + [r["parent"] for r in rows if r["parent"]]
    roles: dict[str, list[str]] = {}
    for ex, rc in db.execute(f"SELECT DISTINCT execution_id, agent_tier || '/' || turn_kind FROM tree_requests "
                             f"WHERE execution_id IN ({_in(own)}) ORDER BY 1, 2", own):
        roles.setdefault(ex, []).append(rc)
    admission: dict[str, dict[str, str]] = {}
    if _has(db, "admission"):
        for ex, rt, st in db.execute(f"SELECT execution_id, route, state FROM admission WHERE execution_id IN ({_in(ids)}) "
                                     "ORDER BY route", ids):
            admission.setdefault(ex, {})[rt] = st
    out = []
    for r in rows:
        ex = r["execution_id"]
        sp, group, quarantined = execution_split(db, ex)
        out.append({"execution_id": ex, "task_id": r["task_id"], "parent_execution_id": r["parent"], "split": sp,
                    "group_id": group, "quarantined": bool(quarantined), "requests": r["requests"], "nodes": r["nodes"],
                    "stored_tokens": r["stored_tokens"], "expanded_tokens": r["expanded_tokens"],
                    "role_classes": roles.get(ex) or roles.get(r["parent"] or "", []), "score_state": r["state"],
                    "reward": r["reward"], "admission": admission.get(ex, {}),
                    "withdrawn": r["withdrawn_erase"] is not None, "erased": r["withdrawn_erase"] == 1})
    return {"filters": {**filters, "limit": a.limit}, "sort": a.sort, "order": a.order, "page": a.page,
            "pages": max(1, -(-total // a.limit)), "limit": a.limit, "matching": total, "shown": len(out),
            "executions": out}


# ------------------------------------------------------------------ tasks
TASK_SORTS = {"task": "b.task_id", "source": "b.source", "split": "b.split", "executions": "b.executions",
              "admitted": "b.admitted", "erased": "b.erased"}


def tasks_page(db: sqlite3.Connection, filters: dict, a: PageArgs) -> dict:
    """Every task with its source, group, split and counts of executions, admissions and erasures."""
    if not _has(db, "tasks"):
        return {"filters": filters, "sort": a.sort, "order": a.order, "page": 1, "pages": 1, "limit": a.limit, "matching": 0, "shown": 0,
                "tasks": []}
    split = ("(SELECT g.split FROM task_groups t JOIN group_splits g ON g.group_id = t.group_id WHERE t.task_id = k.task_id)"
             if _has(db, "group_splits") else "NULL")
    # per-task counts aggregated once (GROUP BY), not one correlated scan per task
    joins = ["LEFT JOIN (SELECT task_id, COUNT(*) AS n FROM executions GROUP BY task_id) ne ON ne.task_id = k.task_id"]
    adm = er = "0"
    if _has(db, "admission"):
        joins.append("LEFT JOIN (SELECT e.task_id, COUNT(DISTINCT a.execution_id) AS n FROM admission a JOIN executions e "
                     "ON e.execution_id = a.execution_id WHERE a.state IN ('admitted', 'dummy') GROUP BY e.task_id) na "
                     "ON na.task_id = k.task_id")
        adm = "COALESCE(na.n, 0)"
    if _has(db, "withdrawn_executions"):
        joins.append("LEFT JOIN (SELECT e.task_id, COUNT(DISTINCT w.execution_id) AS n FROM withdrawn_executions w JOIN "
                     "executions e ON e.execution_id = w.execution_id WHERE w.erase = 1 GROUP BY e.task_id) nw "
                     "ON nw.task_id = k.task_id")
        er = "COALESCE(nw.n, 0)"
    base = (f"(SELECT k.task_id, k.source, k.family, {split} AS split, COALESCE(ne.n, 0) AS executions, {adm} AS admitted, "
            f"{er} AS erased FROM tasks k {' '.join(joins)})")
    where, args = [], []
    for key, col in (("source", "b.source"), ("split", "COALESCE(b.split, 'unassigned')")):
        if filters.get(key) is not None:
            where.append(f"{col} = ?")
            args.append(filters[key])
    if filters.get("task") is not None:
        where.append(_CONTAINS.format(col="b.task_id"))
        args.append(contains(filters["task"]))
    cond = f"WHERE {' AND '.join(where)}" if where else ""
    total = db.execute(f"SELECT COUNT(*) FROM {base} b {cond}", args).fetchone()[0]
    cur = db.execute(f"SELECT b.* FROM {base} b {cond} {order_by(TASK_SORTS, a, 'b.task_id')} LIMIT ? OFFSET ?",
                     [*args, a.limit, a.offset])
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r)) for r in cur]
    return {"filters": filters, "sort": a.sort, "order": a.order, "page": a.page, "pages": max(1, -(-total // a.limit)),
            "limit": a.limit, "matching": total, "shown": len(rows), "tasks": rows}


# ------------------------------------------------------------------ withdrawals
WITHDRAWAL_SORTS = {"date": "b.occurred_at", "subject": "b.subject", "executions": "b.executions",
                    "erased": "b.erase"}


def withdrawals_page(db: sqlite3.Connection, a: PageArgs) -> dict:
    """Withdrawals on the log with their date and the executions they cover."""
    if not _has(db, "withdrawals"):
        return {"sort": a.sort, "order": a.order, "page": 1, "pages": 1, "limit": a.limit, "matching": 0, "shown": 0, "withdrawals": []}
    cover = ("(SELECT COUNT(*) FROM withdrawn_executions x WHERE x.withdrawal_event_id = w.event_id)"
             if _has(db, "withdrawn_executions") else "NULL")
    base = f"(SELECT w.*, {cover} AS executions FROM withdrawals w)"
    total = db.execute(f"SELECT COUNT(*) FROM {base} b").fetchone()[0]
    cur = db.execute(f"SELECT b.* FROM {base} b {order_by(WITHDRAWAL_SORTS, a, 'b.event_id')} LIMIT ? OFFSET ?",
                     (a.limit, a.offset))
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r)) for r in cur]
    for r in rows:
        r["date"] = format_micros(r["occurred_at"]) if isinstance(r["occurred_at"], int) else None
    return {"sort": a.sort, "order": a.order, "page": a.page, "pages": max(1, -(-total // a.limit)), "limit": a.limit,
            "matching": total, "shown": len(rows), "withdrawals": rows}


# ------------------------------------------------------------------ collection runs (campaign grid)
def runs_list(db: sqlite3.Connection) -> list[dict]:
    """Every collection run with its executions, tasks and admitted count."""
    admitted: dict[str, int] = {}
    if _has(db, "admission"):  # one aggregate over admission, not one scan per run
        admitted = dict(db.execute("SELECT e.collection_run_id, COUNT(DISTINCT a.execution_id) FROM admission a JOIN "
                                   "executions e ON e.execution_id = a.execution_id WHERE a.state IN ('admitted', 'dummy') "
                                   "GROUP BY e.collection_run_id"))
    cur = db.execute("SELECT e.collection_run_id, COUNT(*), COUNT(DISTINCT e.task_id), MIN(e.opened_at_us) "
                     "FROM executions e WHERE e.collection_run_id IS NOT NULL GROUP BY e.collection_run_id ORDER BY 1")
    return [{"collection_run_id": r[0], "executions": r[1], "tasks": r[2], "first_opened_us": r[3],
             "admitted": admitted.get(r[0], 0)} for r in cur]


_STATES = ("admitted", "dummy", "rejected", "unresolved")  # admission states (admission.state CHECK)
RUN_SORTS = {"task": "b.task_id", "attempts": "b.attempts", "admitted": "b.admitted", "reward": "b.best_reward",
             "erased": "b.erased"}


def _run_tasks(db: sqlite3.Connection, route: str | None) -> str:
    """One row per task of a collection run (``?``: the run id) with its attempts, admissions on ``route``
    (the first ``?`` when a route is given), best reward and erased attempts."""
    has = {t: _has(db, t) for t in ("lineage", "execution_scores", "withdrawn_executions")}
    joins, cols = [], []
    if route is not None:
        joins.append("LEFT JOIN admission a ON a.route = ? AND a.execution_id = e.execution_id")
        cols.append("SUM(a.state IN ('admitted', 'dummy')) AS admitted, "
                    + ", ".join(f"SUM(a.state = '{st}') AS n_{st}" for st in _STATES))
    else:
        cols.append("0 AS admitted, " + ", ".join(f"0 AS n_{st}" for st in _STATES))
    if has["execution_scores"]:
        joins.append("LEFT JOIN execution_scores c ON c.execution_id = e.execution_id")
    cols.append("MAX(c.reward) AS best_reward" if has["execution_scores"] else "NULL AS best_reward")
    if has["withdrawn_executions"]:
        joins.append("LEFT JOIN (SELECT execution_id, MAX(erase) AS erase FROM withdrawn_executions GROUP BY execution_id) "
                     "w ON w.execution_id = e.execution_id")
    cols.append("COALESCE(SUM(w.erase = 1), 0) AS erased" if has["withdrawn_executions"] else "0 AS erased")
    views = "AND e.execution_id NOT IN (SELECT derived_execution_id FROM lineage)" if has["lineage"] else ""
    return (f"(SELECT e.task_id, COUNT(*) AS attempts, {', '.join(cols)} FROM executions e {' '.join(joins)} "
            f"WHERE e.collection_run_id = ? {views} GROUP BY e.task_id)")


def run_grid(db: sqlite3.Connection, run_id: str, route: str | None, filters: dict | None = None,
             a: PageArgs | None = None) -> dict:
    """Task x attempt cells of one collection run (attempts in opening order), each with its reward,
    admission state on ``route`` (the first route when None) and erasure; the tasks (rows) filtered
    (``task``: contains; ``state``: some attempt in that state on the route; ``erased``: yes / no),
    sorted (:data:`RUN_SORTS`) and paged in SQL.  ``task_ids``: the page's tasks in order (``tasks``,
    a JSON object, has no order once serialised)."""
    filters = filters or {}
    a = a or PageArgs(1, DEFAULT_LIMIT, "task", "asc")
    routes = [r[0] for r in db.execute("SELECT DISTINCT route FROM admission ORDER BY 1")] if _has(db, "admission") else []
    route = route or (routes[0] if routes else None)
    base, args = _run_tasks(db, route), ([route] if route is not None else []) + [run_id]
    where, wargs = _run_filters(filters)
    cond = f"WHERE {' AND '.join(where)}" if where else ""
    total, attempts, executions = db.execute(f"SELECT COUNT(*), MAX(b.attempts), SUM(b.attempts) FROM {base} b",
                                             args).fetchone()
    matching = db.execute(f"SELECT COUNT(*) FROM {base} b {cond}", [*args, *wargs]).fetchone()[0] if where else total
    page = db.execute(f"SELECT b.task_id FROM {base} b {cond} {order_by(RUN_SORTS, a, 'b.task_id')} LIMIT ? OFFSET ?",
                      [*args, *wargs, a.limit, a.offset]).fetchall()
    tasks = _run_cells(db, run_id, route, [r[0] for r in page])
    return {"collection_run_id": run_id, "route": route, "routes": routes, "executions": executions or 0,
            "attempts": attempts or 0, "task_count": total, "filters": {**filters, "limit": a.limit}, "sort": a.sort,
            "order": a.order, "page": a.page, "pages": max(1, -(-matching // a.limit)), "limit": a.limit,
            "matching": matching, "shown": len(tasks), "task_ids": list(tasks), "tasks": tasks}


def _run_filters(f: dict) -> tuple[list[str], list[Any]]:
    where, args = [], []
    if f.get("task") is not None:
        where.append(_CONTAINS.format(col="b.task_id"))
        args.append(contains(f["task"]))
    if f.get("state") is not None:  # one of _STATES (the page checks it)
        where.append(f"b.n_{f['state']} > 0")
    if f.get("erased") == "yes":
        where.append("b.erased > 0")
    elif f.get("erased") == "no":
        where.append("b.erased = 0")
    return where, args


def _run_cells(db: sqlite3.Connection, run_id: str, route: str | None, task_ids: list[str]) -> dict[str, list[dict]]:
    """The attempts of the run's tasks ``task_ids`` (in that order), each a grid cell."""
    tasks: dict[str, list[dict]] = {t: [] for t in task_ids}
    if not task_ids:
        return tasks
    views = "AND execution_id NOT IN (SELECT derived_execution_id FROM lineage)" if _has(db, "lineage") else ""
    rows = db.execute(f"SELECT execution_id, task_id FROM executions WHERE collection_run_id = ? AND task_id IN "
                      f"({_in(task_ids)}) {views} ORDER BY task_id, opened_at_us, execution_id", (run_id, *task_ids)).fetchall()
    ids = [r[0] for r in rows]
    state: dict[str, tuple] = {}
    reward: dict[str, Any] = {}
    erased: dict[str, int] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        marks = _in(chunk)
        if route is not None:
            state.update({r[0]: (r[1], r[2], r[3]) for r in db.execute(
                f"SELECT execution_id, state, predicate, reason FROM admission WHERE route = ? AND execution_id IN ({marks})",
                [route, *chunk])})
        if _has(db, "execution_scores"):
            reward.update(db.execute(f"SELECT execution_id, reward FROM execution_scores WHERE execution_id IN ({marks})",
                                     chunk))
        if _has(db, "withdrawn_executions"):
            erased.update(db.execute(f"SELECT execution_id, MAX(erase) FROM withdrawn_executions WHERE execution_id IN "
                                     f"({marks}) GROUP BY execution_id", chunk))
    for ex, task in rows:
        st = state.get(ex)
        tasks[task].append({"execution_id": ex, "reward": reward.get(ex), "state": st[0] if st else None,
                            "predicate": st[1] if st else None, "reason": st[2] if st else None,
                            "withdrawn": ex in erased, "erased": erased.get(ex) == 1})
    return tasks
