"""Library functions behind `ledger splits check|show` and `ledger similarity candidates|curve`
(SPEC §6.3, §7.2; seed 002 §15.4).

Every function here reads the ``splits`` projection (:mod:`projections.splits`); the
``*_store`` variants first bring the store's projections up to date, as `ledger project`
would, and then query them.

``check(db, documents=None)`` re-derives the split map from the projection's fact tables
and lists every **offender** (the check fails when there is at least one):

* ``group_spans_splits`` — a group (recomputed from the facts) whose member tasks sit in
  different splits in the projected tables (also catches stale or tampered tables);
* ``stale_group`` / ``stale_split`` — a projected group id or split that the facts do not
  give;
* ``execution_task_mismatch`` — another projection (tree ``executions``, governance
  ``gov_executions``) records a different task for an execution;
* ``derived_spans_groups`` — a derived view whose parents resolve to different task
  groups; ``derived_disagrees_with_parent`` — a view that was also opened directly with a
  task whose split differs from its parent's;
* ``admitted_outside_split`` — an admission (admitted or dummy) on a route whose split is not
  the execution's split, or of a quarantined execution;
* ``published_leak`` — a member of a published manifest recorded as ``train`` whose
  execution now sits in another split (members from a ``manifest_members`` table if a
  projection keeps one, else from the archived manifest documents the log authenticates);
* ``consumed_leak`` — a member a feed consumer trained on (``batch_consumed``, SPEC §11.6) whose
  execution now sits outside train: names the consumer, the step and the checkpoints trained on it;
* ``possible_leak`` — a row of ``split_leaks``: a group that was ``train`` when a training
  manifest was published now sits in a protected split (a merge or a superseding policy
  pulled it).

``show(db)`` gives group, task and trajectory counts per split (the seed's dashboards
report group counts alongside raw trajectory counts: dozens of rollouts on one fixture
still test only one problem).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ledger.algorithms.errors import InputError
from ledger.algorithms.split_hash import SPLITS, SplitState
from ledger.projections.splits import split_tables_present
from ledger.projections.splits import state_from_facts
from ledger.projections.collections import leak_checkpoints
from ledger.projections.splits import execution_split, execution_task_ids
from ledger.projections.consumers import steps_touching
from ledger.projections.splits import execution_split
from ledger.projections.splits import current_split_policy, execution_split
from dataclasses import replace
from ledger.projections.splits import SimilarityConfig
from ledger.algorithms.minhash import candidate_curve, steepest_similarity
from dataclasses import asdict
from ledger.algorithms.lsh_plan import plan_screen
from ledger.events.signing import Trust
from ledger.log import open_log
from ledger.projections.registry import open_engine, store_keystore
from ledger.corpus.publish import PublishError, archived_manifest

__all__ = ["CheckReport", "candidates", "check", "check_store", "curve_text", "format_candidates", "format_check",
           "format_show", "project_store", "show", "show_store", "candidates_store"]

Documents = Callable[[str, int], "dict | None"]

_SPLIT_ORDER = ("train", "dev", "final_test", "reserve")


@dataclass
class CheckReport:
    """Outcome of :func:`check`: ``ok`` when there is no offender."""

    offenders: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    groups: int = 0
    tasks: int = 0
    executions: int = 0

    @property
    def ok(self) -> bool:
        return not self.offenders

    def to_json(self) -> dict:
        return {"ok": self.ok, "offenders": self.offenders, "notes": self.notes, "groups": self.groups,
                "tasks": self.tasks, "executions": self.executions}


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f'PRAGMA table_info("{table}")')}


def _require(db: sqlite3.Connection) -> None:

    if not split_tables_present(db):
        raise InputError("the projection database has no splits tables (run `ledger project`)")


def fresh_state(db: sqlite3.Connection) -> SplitState:
    """A :class:`SplitState` rebuilt from the projection's fact tables (independent of its caches)."""

    return state_from_facts(db)


# ----------------------------------------------------------------------------------------
# check
# ----------------------------------------------------------------------------------------
def _check_groups(res, stored_group: dict, stored_split: dict, off: list[dict]) -> None:
    """Groups: one split per group, and the tables agree with the facts."""
    for gid, members in sorted(res.members().items()):
        by_split: dict[str, list[str]] = {}
        for t in members:
            g = stored_group.get(t)
            s = stored_split.get(g) if g is not None else None
            by_split.setdefault(str(s), []).append(t)
        if len(by_split) > 1:
            off.append({"kind": "group_spans_splits", "subject": gid,
                        "detail": "members in " + "; ".join(f"{s}: {', '.join(ts[:5])}{' ...' if len(ts) > 5 else ''}"
                                                            for s, ts in sorted(by_split.items()))})
        for t in members:
            if stored_group.get(t) != gid:
                off.append({"kind": "stale_group", "subject": t,
                            "detail": f"projected group {stored_group.get(t)!r}, the facts give {gid!r}"})
        want = res.split_of_group.get(gid)
        if stored_split.get(gid, "<missing>") != want:
            off.append({"kind": "stale_split", "subject": gid,
                        "detail": f"projected split {stored_split.get(gid, '<missing>')!r}, the facts give {want!r}"})
    for t in sorted(set(stored_group) - set(res.group_of)):
        off.append({"kind": "stale_group", "subject": t, "detail": "projected task is unknown to the facts"})


def _check_executions(db: sqlite3.Connection, res, have: set[str], rep: CheckReport) -> None:
    """Executions: other projections agree on the task; derived views inherit one group."""
    off = rep.offenders
    mine = dict(db.execute("SELECT execution_id, task_id FROM execution_tasks"))
    rep.executions = len(mine)
    for table in ("executions", "gov_executions"):
        if table in have and {"execution_id", "task_id"} <= _columns(db, table):
            for ex, task in db.execute(f'SELECT execution_id, task_id FROM "{table}" ORDER BY 1'):
                if ex in mine and mine[ex] != task:
                    off.append({"kind": "execution_task_mismatch", "subject": ex,
                                "detail": f"{table} says task {task!r}, execution_opened says {mine[ex]!r}"})
    derived = db.execute("SELECT DISTINCT derived_execution_id FROM split_derived ORDER BY 1").fetchall()
    for (d,) in derived:
        parents = [r[0] for r in db.execute("SELECT parent_execution_id FROM split_derived WHERE derived_execution_id = ?",
                                            (d,))]
        tasks: set[str] = set()
        for p in parents:
            tasks |= execution_task_ids(db, p)
        groups = {res.group_of.get(t) for t in tasks}
        if len(groups) > 1:
            off.append({"kind": "derived_spans_groups", "subject": d,
                        "detail": f"parents {', '.join(sorted(parents))} resolve to groups "
                                  f"{', '.join(sorted(str(g) for g in groups))}"})
        elif d in mine and groups:
            g = next(iter(groups))
            own = res.group_of.get(mine[d])
            ps, os_ = res.split_of_group.get(g) if g else None, res.split_of_group.get(own) if own else None
            if ps != os_:
                off.append({"kind": "derived_disagrees_with_parent", "subject": d,
                            "detail": f"opened with task {mine[d]} ({os_}) but derived from a {ps} group {g}"})


def _check_admissions(db: sqlite3.Connection, have: set[str], off: list[dict]) -> None:
    """Admissions: nothing admitted outside its split or while quarantined."""
    if {"admission", "routes"} <= have:
        route_split = {(r, v): s for r, v, s in db.execute("SELECT route, version, split FROM routes")}
        for route, ex, version, state in db.execute(
                "SELECT route, execution_id, route_version, state FROM admission WHERE state IN ('admitted', 'dummy') "
                "ORDER BY route, execution_id"):
            split, group, quarantined = execution_split(db, ex)
            want = route_split.get((route, version))
            if split != want or quarantined:
                why = "quarantined" if split == want else f"execution split {split}, route split {want}"
                off.append({"kind": "admitted_outside_split", "subject": f"{route}/{ex}",
                            "detail": f"{state} on route {route} v{version}: {why} (group {group})"})


def _check_published(db: sqlite3.Connection, documents: Documents | None, have: set[str], rep: CheckReport) -> None:
    """Published members (exact, when the member lists are available).  A training route's manifest (sft, preference, rl) may hold train members only, whatever split the route named (SPEC §6.8; first-release routes could name any split)."""
    off = rep.offenders
    uses = {}
    if {"manifests", "routes"} <= have:
        uses = {(r, v): u for r, v, u in db.execute(
            "SELECT m.route, m.version, r.use FROM manifests m JOIN routes r ON r.route = m.route "
            "AND r.version = m.route_version")}
    for route, version, member_id, ex, recorded in _published_members(db, documents, rep.notes):
        split, group, _ = execution_split(db, ex) if ex else (None, None, False)
        use = uses.get((route, version))
        if use in _TRAINING_USES and (recorded not in (None, "train") or (recorded is None and split not in (None, "train"))):
            off.append({"kind": "training_manifest_outside_train", "subject": member_id,
                        "detail": f"{use} manifest {route} v{version} holds execution {ex} of the {recorded or split} "
                                  f"split (group {group}); training routes may read train only"})
        elif recorded == "train" and split not in (None, "train"):
            off.append(leak_checkpoints(db, {"kind": "published_leak", "subject": member_id,
                        "detail": f"published as train in {route} v{version}; execution {ex} is now in {split} "
                                  f"(group {group})"}, route, version))  # + checkpoints trained on it (SPEC 6.10)
        elif recorded is not None and split is not None and recorded != split:
            rep.notes.append(f"{member_id} was published as {recorded} in {route} v{version}; now {split}")


def check(db: sqlite3.Connection, documents: Documents | None = None) -> CheckReport:
    """Every offender against "one group, one split" (see the module docstring)."""

    _require(db)
    rep = CheckReport()
    off = rep.offenders
    res = fresh_state(db).resolve()
    stored_group = dict(db.execute("SELECT task_id, group_id FROM task_groups"))
    stored_split = {g: s for g, s in db.execute("SELECT group_id, split FROM group_splits")}
    rep.groups, rep.tasks = len(set(res.group_of.values())), len(res.group_of)

    _check_groups(res, stored_group, stored_split, off)
    have = _tables(db)
    _check_executions(db, res, have, rep)
    _check_admissions(db, have, off)
    _check_published(db, documents, have, rep)
    _consumed_leaks(db, off)

    # Possible leaks recorded by the projection (groups published for training, now protected).
    for g, p, route, version, split, reason in db.execute(
            "SELECT group_id, published_group, route, version, split, reason FROM split_leaks ORDER BY 1, 2"):
        off.append(leak_checkpoints(db, {"kind": "possible_leak", "subject": g, "detail": reason}, route, version))
    off.sort(key=lambda o: (o["kind"], o["subject"], o["detail"]))
    return rep


_TRAINING_USES = ("sft", "preference", "rl")


def _consumed_leaks(db: sqlite3.Connection, off: list[dict]) -> None:
    """SPEC 11.6: a feed consumer step that trained on a record now held out (its execution outside train)."""

    if "consumed_members" not in _tables(db):
        return
    held_out: dict[str, tuple] = {}
    for (ex,) in db.execute("SELECT DISTINCT execution_id FROM consumed_members WHERE disposition = 'trained' "
                            "AND execution_id IS NOT NULL"):
        split, group, _ = execution_split(db, ex)
        if split not in (None, "train"):
            held_out[ex] = (split, group)
    for s in steps_touching(db, set(held_out)):
        cks = f"; checkpoints trained on it: {', '.join(s['checkpoint_ids'])}" if s["checkpoint_ids"] else ""
        for m in s["members"]:
            split, group = held_out[m["execution_id"]]
            off.append({"kind": "consumed_leak", "subject": m["member_id"],
                        "detail": f"trained by consumer {s['consumer']} at step {s['step']} ({s['route']}); execution "
                                  f"{m['execution_id']} is now in {split} (group {group}){cks}",
                        "consumer": s["consumer"], "step": s["step"], "checkpoint_ids": s["checkpoint_ids"]})


def _published_members(db: sqlite3.Connection, documents: Documents | None,
                       notes: list[str]) -> list[tuple[str, int, str, str | None, str | None]]:
    """``(route, version, member_id, execution_id, recorded split)`` of every published member."""
    have = _tables(db)
    out: list[tuple[str, int, str, str | None, str | None]] = []
    if "manifest_members" in have:
        cols = _columns(db, "manifest_members")
        if {"route", "version", "member_id", "execution_id"} <= cols:
            split_col = "split" if "split" in cols else "NULL"
            for row in db.execute(f"SELECT route, version, member_id, execution_id, {split_col} FROM manifest_members "
                                  "ORDER BY route, version, member_id"):
                out.append(tuple(row))  # type: ignore[arg-type]
            return out
    if "manifests" not in have or documents is None:
        return out
    for route, version in db.execute("SELECT route, version FROM manifests ORDER BY route, version").fetchall():
        doc = documents(route, int(version))
        if doc is None:
            notes.append(f"{route} v{version}: manifest document not available; its members were not checked")
            continue
        for m in doc.get("members", []):
            if m.get("dummy") and m.get("execution_id") is None:
                continue
            out.append((route, int(version), m.get("member_id"), m.get("execution_id"), m.get("split")))
    return out


def format_check(rep: CheckReport) -> str:
    if rep.ok:
        head = (f"splits check ok: {rep.groups} groups, {rep.tasks} tasks, {rep.executions} executions; "
                "no group spans two splits and every execution and derived record sits in its group's split")
    else:
        head = f"splits check FAILED: {len(rep.offenders)} offender(s)"
    lines = [head]
    for o in rep.offenders:
        lines.append(f"  {o['kind']}: {o['subject']}: {o['detail']}")
    for n in rep.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# show
# ----------------------------------------------------------------------------------------
def show(db: sqlite3.Connection) -> dict:
    """Group, task and trajectory counts per split, quarantine and review-queue counts."""

    _require(db)
    per: dict[str, dict[str, int]] = {}

    def bucket(split: str | None) -> dict[str, int]:
        key = split if split is not None else "unassigned"
        return per.setdefault(key, {"groups": 0, "tasks": 0, "executions": 0, "derived": 0, "quarantined_groups": 0})

    for split, n, q, members in db.execute(
            "SELECT split, COUNT(*), SUM(quarantined), SUM(members) FROM group_splits GROUP BY split"):
        b = bucket(split)
        b["groups"], b["quarantined_groups"], b["tasks"] = n, int(q or 0), int(members or 0)
    for split, n in db.execute("SELECT g.split, COUNT(*) FROM execution_tasks e JOIN task_groups t ON t.task_id = e.task_id "
                               "JOIN group_splits g ON g.group_id = t.group_id GROUP BY g.split"):
        bucket(split)["executions"] = n
    unknown = db.execute("SELECT COUNT(*) FROM execution_tasks e WHERE NOT EXISTS "
                         "(SELECT 1 FROM task_groups t WHERE t.task_id = e.task_id)").fetchone()[0]
    if unknown:
        bucket(None)["executions"] += unknown
    for (d,) in db.execute("SELECT DISTINCT derived_execution_id FROM split_derived WHERE derived_execution_id NOT IN "
                           "(SELECT execution_id FROM execution_tasks) ORDER BY 1").fetchall():
        bucket(execution_split(db, d)[0])["derived"] += 1
    total_groups = sum(b["groups"] for k, b in per.items() if k != "unassigned")
    order = [s for s in _SPLIT_ORDER if s in per] + [k for k in sorted(per) if k not in _SPLIT_ORDER]
    splits = {}
    for k in order:
        b = dict(per[k])
        if k != "unassigned":
            b["group_fraction"] = (b["groups"] / total_groups) if total_groups else 0.0
        splits[k] = b
    cand = dict(db.execute("SELECT status, COUNT(*) FROM similarity_candidates GROUP BY status").fetchall())
    straddling = db.execute("SELECT COUNT(*) FROM similarity_candidates WHERE status = 'pending' AND straddles = 1"
                            ).fetchone()[0]
    leaks = db.execute("SELECT COUNT(*) FROM split_leaks").fetchone()[0]
    policy = current_split_policy(db)
    extra = {"strata": _strata_counts(db, policy["policy_id"])} if policy is not None and policy.get("strata") else {}
    return {"policy": policy, "splits": splits, **extra,
            "quarantined_groups": sum(b["quarantined_groups"] for b in per.values()),
            "candidates": {"pending": cand.get("pending", 0), "linked": cand.get("linked", 0),
                           "rejected": cand.get("rejected", 0), "pending_straddling": straddling},
            "possible_leaks": leaks}


def _strata_counts(db: sqlite3.Connection, policy_id: str) -> dict[str, dict[str, int]]:
    """``{stratum: {split: allocations}}`` under a stratified policy (``(none)``: no value)."""
    out: dict[str, dict[str, int]] = {}
    for stratum, split, n in db.execute("SELECT stratum, split, COUNT(*) FROM split_allocations WHERE policy_id = ? "
                                        "GROUP BY 1, 2 ORDER BY 1, 2", (policy_id,)):
        out.setdefault("(none)" if stratum is None else stratum, {s: 0 for s in SPLITS})[split] = n
    return out


def format_show(d: dict) -> str:
    pol = d["policy"]
    if pol is None:
        lines = ["split policy: none in force (every group is unassigned)"]
    else:
        fr = ", ".join(f"{s}={pol['fractions'].get(s, 0):g}" for s in SPLITS)
        opts = "".join(f"; {k} {pol[k]}" for k in ("strata", "group_by") if pol.get(k))
        lines = [f"split policy: {pol['policy_id']} ({fr}{opts}; chain {' -> '.join(pol['chain'])})"]
        for stratum, counts in d.get("strata", {}).items():
            lines.append(f"  stratum {stratum}: " + ", ".join(f"{s} {n}" for s, n in counts.items()) +
                         " (quota allocations)")
        if pol["conflicts"]:
            lines.append(f"  competing declarations (their draws still protect): {', '.join(pol['conflicts'])}")
        if pol["pending"]:
            lines.append(f"  pending (supersedes chain incomplete): {', '.join(pol['pending'])}")
    lines.append(f"{'split':<12} {'groups':>7} {'share':>7} {'tasks':>7} {'executions':>11} {'derived':>8} {'quarantined':>12}")
    for split, b in d["splits"].items():
        share = f"{b['group_fraction']:.3f}" if "group_fraction" in b else "-"
        lines.append(f"{split:<12} {b['groups']:>7} {share:>7} {b['tasks']:>7} {b['executions']:>11} {b['derived']:>8} "
                     f"{b['quarantined_groups']:>12}")
    c = d["candidates"]
    lines.append(f"similarity review queue: {c['pending']} pending ({c['pending_straddling']} straddling splits), "
                 f"{c['linked']} linked, {c['rejected']} rejected")
    lines.append(f"possible leaks: {d['possible_leaks']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# similarity
# ----------------------------------------------------------------------------------------
def candidates(db: sqlite3.Connection, status: str | None = None) -> list[dict]:
    """Rows of ``similarity_candidates`` (all, or one status), highest similarity first."""
    _require(db)
    sql = ("SELECT task_a, task_b, estimated_jaccard, status, straddles, group_a, group_b, split_a, split_b "
           "FROM similarity_candidates")
    args: tuple[Any, ...] = ()
    if status is not None:
        sql += " WHERE status = ?"
        args = (status,)
    cur = db.execute(sql + " ORDER BY estimated_jaccard DESC, task_a, task_b", args)
    cols = [c[0] for c in cur.description]
    out = []
    for row in cur:
        d = dict(zip(cols, row))
        d["straddles"] = bool(d["straddles"])
        out.append(d)
    return out


def format_candidates(rows: list[dict]) -> str:
    if not rows:
        return "no similarity candidates"
    head = f"{'task_a':<28} {'task_b':<28} {'J~':>5} {'status':<9} {'splits':<22} straddles"
    lines = [head]
    for r in rows:
        splits = f"{r['split_a'] or '-'}/{r['split_b'] or '-'}"
        lines.append(f"{r['task_a']:<28} {r['task_b']:<28} {r['estimated_jaccard']:>5.2f} {r['status']:<9} "
                     f"{splits:<22} {'yes' if r['straddles'] else 'no'}")
    return "\n".join(lines)


def screening_config(bands: int | None = None, rows: int | None = None, num_perm: int | None = None):
    """The screening configuration (``projections.splits.SimilarityConfig``) with these overrides."""


    cfg = SimilarityConfig()
    changes: dict[str, int] = {}
    if bands is not None:
        changes["bands"] = bands
    if rows is not None:
        changes["rows"] = rows
    if num_perm is not None:
        changes["num_perm"] = num_perm
    elif bands is not None or rows is not None:
        changes["num_perm"] = max(cfg.num_perm, (bands or cfg.bands) * (rows or cfg.rows))
    return replace(cfg, **changes)


def curve_text(bands: int | None = None, rows: int | None = None, num_perm: int | None = None,
               points: int = 11) -> str:
    """The candidate probability curve ``1 - (1 - s^r)^b`` of the screening configuration."""
    cfg = screening_config(bands, rows, num_perm)
    head = (f"similarity screening: MinHash num_perm={cfg.num_perm} (seed {cfg.seed}, {cfg.scheme}), "
            f"{cfg.shingle_kind} {cfg.shingle_k}-gram shingles{' case-folded' if cfg.lowercase else ''}")
    return head + "\n" + cfg.curve_text(points)


def curve_doc(bands: int | None = None, rows: int | None = None, num_perm: int | None = None,
              points: int = 11) -> dict:
    """:func:`curve_text` as data (``ledger similarity curve --json``)."""

    cfg = screening_config(bands, rows, num_perm)
    return {"num_perm": cfg.num_perm, "bands": cfg.bands, "rows": cfg.rows, "seed": cfg.seed, "scheme": cfg.scheme,
            "steepest_similarity": steepest_similarity(cfg.bands, cfg.rows),
            "curve": [{"similarity": x, "candidate_probability": p} for x, p in candidate_curve(cfg.bands, cfg.rows,
                                                                                                points)]}


def plan_doc(records: int, budget: int | None, *, bands: int | None = None, rows: int | None = None,
             num_perm: int | None = None, **kw: Any) -> dict:
    """Seed 002 exercise 8: the review load of each band design for a corpus of ``records``
    (every ``b x r`` of the signature, or the one design given by ``bands`` / ``rows``)."""


    cfg = screening_config(bands, rows, num_perm)
    designs = [(cfg.bands, cfg.rows)] if bands is not None or rows is not None else None
    return asdict(plan_screen(records, budget, num_perm=cfg.num_perm, designs=designs, **kw))


def _size(n: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n:g} B"


def plan_text(plan: dict) -> str:
    """:func:`plan_doc` as the table ``ledger similarity curve --records N --budget PAIRS`` prints."""
    s0, s1, n = plan["similarity_of_unrelated"], plan["similarity_of_relatives"], plan["num_perm"]
    budget = "no review budget given" if plan["budget"] is None else f"review budget {plan['budget']} pairs"
    lines = [f"LSH screening plan: {plan['records']} records, {plan['pairs']} pairs ({plan['relatives']} true relatives "
             f"at s={s1:g}, {plan['unrelated_pairs']} unrelated at s={s0:g}); {budget}",
             f"signature: {n} components x {plan['bytes_per_value']} bytes = {_size(plan['bytes_per_signature'])} per "
             f"signature, {_size(plan['bytes_per_corpus'])} per corpus; standard error sqrt(s(1-s)/{n}) at most "
             f"{plan['standard_error_max']:.4f} (s=0.5), {plan['standard_error_relatives']:.4f} at s={s1:g}, "
             f"{plan['standard_error_unrelated']:.4f} at s={s0:g}",
             f"{'bands x rows':>12}  {'steepest':>8}  {'false cand.':>11}  {f'recall@{s1:g}':>11}  {'true cand.':>10}  "
             f"{'expected':>10}  fits budget"]
    fits = {True: "yes", False: "no", None: "-"}
    for d in plan["designs"]:
        lines.append(f"{d['bands']:>6} x {d['rows']:<3}  {d['threshold']:>8.3f}  {d['false_candidates']:>11.3g}  "
                     f"{d['recall']:>11.4f}  {d['true_candidates']:>10.1f}  {d['expected_candidates']:>10.3g}  "
                     f"{fits[d['fits_budget']]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# store helpers (bring the projections up to date first)
# ----------------------------------------------------------------------------------------
def project_store(paths: Any, progress: Callable[[int, int], None] | None = None) -> sqlite3.Connection:
    """Bring every projection of the store up to date; return the projection database."""

    keystore = store_keystore(paths)  # sealed requests open with the store's data keys
    try:
        with open_log(paths.url) as log:
            engine = open_engine(log, paths.db, Trust.load(paths.trust), keystore=keystore)
            engine.run(progress=progress)
    finally:
        if keystore is not None:
            keystore.close()
    return engine.db


def store_documents(paths: Any, db: sqlite3.Connection) -> Documents:
    """Loader of archived manifest documents, authenticated by the log's manifest_sha256."""
    def load(route: str, version: int) -> dict | None:
        try:
            return archived_manifest(paths, db, route, version)
        except (PublishError, OSError, ValueError):
            return None

    return load


def check_store(paths: Any, progress: Callable[[int, int], None] | None = None) -> CheckReport:
    db = project_store(paths, progress)
    try:
        return check(db, store_documents(paths, db))
    finally:
        db.close()


def show_store(paths: Any, progress: Callable[[int, int], None] | None = None) -> dict:
    db = project_store(paths, progress)
    try:
        return show(db)
    finally:
        db.close()


def candidates_store(paths: Any, status: str | None = None,
                     progress: Callable[[int, int], None] | None = None) -> list[dict]:
    db = project_store(paths, progress)
    try:
        return candidates(db, status)
    finally:
        db.close()

