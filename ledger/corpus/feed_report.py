"""``feed.report()`` / ``ledger feed report``: what happened to every admitted member a feed observed (SPEC §11.6).

Each member has one status:

* ``trained`` -- acknowledged by the consumer at ``step`` (``batch_consumed`` on the log);
* ``stale`` -- given the disposition ``stale`` (beyond the staleness bound, ``stale_policy="stale"``);
* ``delivered`` -- yielded by this feed and not acknowledged yet (delivered again after a restart);
* ``held`` -- waiting, and more than ``max_staleness`` behind the trainer's current policy version;
* ``waiting`` -- waiting in a task group that is not complete yet (``group_by="task"``);
* ``pending`` -- ready to be delivered;
* ``withdrawn`` -- observed admitted, then left the route (e.g. a withdrawal) before it was consumed.

``staleness`` counts, per task and per completion-time bucket (execution open -> close), the members
held now, those given ``stale``, and those trained beyond the bound (their batch's policy version minus
their behaviour version > ``max_staleness``), so a bias toward fast completions shows.
"""

from __future__ import annotations

from collections import Counter
from ledger.projections.admission import member_id, route_definition

__all__ = ["BUCKETS", "completion_bucket", "format_report", "report"]

# completion time (execution open -> close) buckets for the staleness report, in seconds
BUCKETS = ((60, "<1m"), (300, "1-5m"), (900, "5-15m"), (3600, "15-60m"), (None, ">=60m"))


def completion_bucket(opened_us: int | None, closed_us: int | None) -> str:
    if opened_us is None or closed_us is None:
        return "unknown"
    seconds = (closed_us - opened_us) / 1e6
    return next(label for limit, label in BUCKETS if limit is None or seconds < limit)


STATUSES = ("trained", "stale", "delivered", "held", "waiting", "pending", "withdrawn")


def _current_members(db, route: str, ex: str) -> list[str]:

    ids = [r[0] for r in db.execute("SELECT member_id FROM admitted_paths WHERE route = ? AND execution_id = ? "
                                    "ORDER BY member_id", (route, ex))]
    state = db.execute("SELECT state FROM admission WHERE route = ? AND execution_id = ?", (route, ex)).fetchone()
    if state is not None and state[0] == "dummy":
        ids.append(member_id(route, ex, None, route_definition(db, route).semantics))
    return ids


def _waiting_status(feed, pending) -> dict[str, str]:
    """Execution -> ``pending`` / ``held`` / ``waiting`` for the executions still in the queue."""
    ready: set[str] = set()
    if feed.group_by == "task":
        saved = feed._queue
        try:
            while True:
                chosen = feed._choose()
                if chosen is None:
                    break
                ready |= {p.execution_id for p in chosen[0]}
                feed._take(chosen[0])
        finally:
            feed._queue = saved
    out = {}
    for p in pending:
        if feed.is_stale(p.policy_version):
            out[p.execution_id] = "held"
        elif feed.group_by == "task" and p.execution_id not in ready:
            out[p.execution_id] = "waiting"
        else:
            out[p.execution_id] = "pending"
    return out


def _member_rows(feed) -> list[dict]:
    db, route = feed.db, feed.route
    done: dict[str, tuple[int, str]] = {}
    by_ex: dict[str, list[str]] = {}
    for mid, ex, step, disp in db.execute("SELECT member_id, execution_id, step, disposition FROM consumed_members "
                                          "WHERE consumer = ? AND route = ? ORDER BY step, disposition DESC",
                                          (feed.consumer, route)):
        if mid not in done:
            done[mid] = (step, disp)
            by_ex.setdefault(ex, []).append(mid)
    batch_pv = dict(db.execute("SELECT step, policy_version FROM consumer_batches WHERE consumer = ? AND "
                               "disposition = 'trained'", (feed.consumer,)).fetchall())
    waiting = _waiting_status(feed, feed._queue or [])

    out = []
    for seq, ex, _obs, admitted, _consumed, task, _run, opened, closed, pv in feed._rows():
        base = {"execution_id": ex, "task_id": task, "policy_version": pv, "completion": completion_bucket(opened, closed)}
        if ex in by_ex:
            for mid in sorted(by_ex[ex]):
                step, disp = done[mid]
                trained_pv = batch_pv.get(step) if disp == "trained" else None
                out.append({**base, "member_id": mid, "status": disp, "step": step,
                            "trained_stale": disp == "trained" and _beyond(feed, trained_pv, pv)})
            continue
        if not admitted:
            out.append({**base, "member_id": None, "status": "withdrawn"})
            continue
        status = "delivered" if ex in feed._delivered else waiting.get(ex, "pending")
        out += [{**base, "member_id": mid, "status": status} for mid in _current_members(db, route, ex)]
    return out


def _beyond(feed, trainer_pv, member_pv) -> bool:
    return (feed.max_staleness is not None and trainer_pv is not None and member_pv is not None
            and trainer_pv - member_pv > feed.max_staleness)


def _staleness(rows: list[dict]) -> dict:
    by_task: dict[str, Counter] = {}
    by_bucket: dict[str, Counter] = {}
    for r in rows:
        kind = "held" if r["status"] == "held" else "stale" if r["status"] == "stale" else \
            "trained_stale" if r.get("trained_stale") else None
        if kind is None:
            continue
        by_task.setdefault(str(r["task_id"]), Counter())[kind] += 1
        by_bucket.setdefault(r["completion"], Counter())[kind] += 1
    return {"by_task": {k: dict(v) for k, v in sorted(by_task.items())},
            "by_completion_time": {k: dict(v) for k, v in sorted(by_bucket.items())}}


def report(feed) -> dict:
    """The report of ``feed`` (a :class:`ledger.corpus.feed.Feed`) at its last refresh."""
    rows = _member_rows(feed)
    counts = Counter(r["status"] for r in rows if r["member_id"] is not None)
    return {"consumer": feed.consumer, "route": feed.route, "group_by": feed.group_by, "last_step": feed.last_step,
            "policy_version": feed.policy_version, "max_staleness": feed.max_staleness, "stale_policy": feed.stale_policy,
            "counts": {s: counts.get(s, 0) for s in STATUSES if s != "withdrawn"},
            "withdrawn_executions": sorted(r["execution_id"] for r in rows if r["status"] == "withdrawn"),
            "staleness": _staleness(rows), "members": [r for r in rows if r["member_id"] is not None]}


def format_report(rep: dict) -> str:
    lines = [f"feed {rep['consumer']} on {rep['route']}: last step {rep['last_step']}, policy version "
             f"{rep['policy_version']}, max staleness {rep['max_staleness']} ({rep['stale_policy']})",
             "members: " + ", ".join(f"{k} {v}" for k, v in rep["counts"].items())]
    if rep["withdrawn_executions"]:
        lines.append(f"withdrawn before consumption: {', '.join(rep['withdrawn_executions'])}")
    for title, key in (("by task", "by_task"), ("by completion time", "by_completion_time")):
        for name, c in rep["staleness"][key].items():
            lines.append(f"  staleness {title} {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    return "\n".join(lines)
