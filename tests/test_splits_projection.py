"""The ``splits`` projection: task groups, split map, quarantine, similarity screening, leaks
(SPEC §3 convergence, §6.3, §7.2 ``splits check``; seed 002 §15.4).

The seed's warning next to the ledger's 0 % — a random 80/20 split over traces leaves 83.2 %
of tasks with 8 attempts on both sides, a group split leaves none — is computed in
``tests/test_grouping_splits.py::test_random_trace_split_straddles_83_percent_vs_zero_for_group_split``;
here :func:`test_every_rollout_inherits_its_group_split` shows the projection half of it
(eight executions per task, every one in its group's split).
"""

from __future__ import annotations

import json
import random
import sqlite3
import tempfile
from collections.abc import Iterable
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ledger.projections.engine as engine_mod
from ledger import cli
from ledger.algorithms.grouping import build_groups
from ledger.algorithms.minhash import candidate_probability
from ledger.algorithms.split_hash import (
    PROTECTION,
    SplitPolicy,
    assign_split,
    resolve_splits,
)
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.log.base import Submission
from ledger.producers.ingest import Ingestor, submission
from ledger.reports.splits_report import (
    candidates,
    check,
    format_check,
    format_show,
    show,
)
from ledger.projections.engine import Applied, Rejected, ReplayEngine, canonical_dump, connect
from ledger.projections.splits import (
    TABLES,
    SimilarityConfig,
    SplitsProjection,
    current_split_policy,
    execution_split,
    task_split,
)

from .helpers import Signer, closed, opened, request

pytestmark = pytest.mark.usefixtures("earlier_release")  # routes of the first release's rules (SPEC §10)

SIGNER = Signer()
FR = {"train": 0.5, "dev": 0.2, "final_test": 0.2, "reserve": 0.1}
SALT = "salt-1"

TEXT_POOL = "fix the connection pool leak that appears when the server restarts under sustained load"
TEXT_POOL_FORK = TEXT_POOL + " in the vendored copy"
TEXT_UPLOAD = "add a retry around the flaky upload test of the storage client and document the timeout"


# ----------------------------------------------------------------------------------------
# line builders
# ----------------------------------------------------------------------------------------
def reg(task: str, derived_from: Iterable[str] = (), *, ambiguous: bool = False, features=None, **kw) -> dict:
    line = {"type": "task_registered", "task_id": task, "derived_from": list(derived_from), **kw}
    if ambiguous:
        line["ambiguous_lineage"] = True
    if features is not None:
        line["features"] = features
    return line


def link(a: str, b: str, relation: str = "same_problem", **kw) -> dict:
    return {"type": "task_linked", "task_a": a, "task_b": b, "relation": relation, **kw}


def reject(a: str, b: str, **kw) -> dict:
    return {"type": "task_link_rejected", "task_a": a, "task_b": b, **kw}


def policy(pid: str = "p1", fractions: dict | None = None, salt: str = SALT, supersedes: str | None = None, **kw) -> dict:
    line = {"type": "split_policy", "policy_id": pid, "fractions": fractions or FR, "salt": salt, **kw}
    if supersedes is not None:
        line["supersedes"] = supersedes
    return SIGNER.sign(line)


def reclassify(task: str, reason: str = "inspected a failure", **kw) -> dict:
    return SIGNER.sign({"type": "split_reclassified", "task_id": task, "reason": reason, **kw})


def derived(d: str, parent: str, **kw) -> dict:
    return {"type": "record_derived", "derived_execution_id": d, "parent_execution_id": parent,
            "transformation": "redaction@1", **kw}


def route(name: str = "sft", split: str = "train", version: int = 1) -> dict:
    # semantics 1: these tests declare sft routes on held-out splits, which only first-release routes may do
    return SIGNER.sign({"type": "admission_policy", "route": name, "version": version, "use": "sft", "split": split,
                        "semantics": 1,
                        "j_max": 4})


def published(name: str = "sft", version: int = 1, route_version: int = 1) -> dict:
    return SIGNER.sign({"type": "manifest_published", "route": name, "version": version, "route_version": route_version,
                        "root": "ab" * 32, "size": 3, "log_position": 10, "manifest_sha256": "cd" * 32})


def find_task(split: str, prefix: str, fractions: dict = FR, salt: str = SALT, start: int = 0) -> str:
    """A task id whose own keyed draw lands in ``split``."""
    i = start
    while True:
        t = f"{prefix}{i:03d}"
        if assign_split(t, fractions, salt) == split:
            return t
        i += 1


# ----------------------------------------------------------------------------------------
# projecting
# ----------------------------------------------------------------------------------------
def encode(lines: list[dict]) -> list[Submission]:
    """Validate, check signatures and encode lines (the ingest path, minus reference checks)."""
    ing = Ingestor(None, SIGNER.trust)  # type: ignore[arg-type]  # the log is not used for this
    subs = []
    for n, obj in enumerate(lines, 1):
        ev = validate_line(obj, line=n, now_micros=1_700_000_000_000_000, producer="test")
        ing._check_signature(obj, ev, n)
        subs.append(submission(ev))
    return subs


def splits_dump(db: sqlite3.Connection) -> str:
    """canonical_dump restricted to the splits projection's tables."""
    out = []
    for name in TABLES:
        sql = db.execute("SELECT sql FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone()[0]
        cols = [r[1] for r in db.execute(f'PRAGMA table_info("{name}")')]
        rows = sorted("|".join(v.hex() if isinstance(v, bytes) else repr(v) for v in row)
                      for row in db.execute(f'SELECT * FROM "{name}"'))
        out += [sql, ",".join(cols), *rows]
    return "\n".join(out)


def replay(subs: list[Submission], *, batch: int = 500, steps: list[int] | None = None,
           config: SimilarityConfig | None = None, directory: str | None = None,
           on_step=None) -> sqlite3.Connection:
    """Append ``subs`` in this order to a fresh embedded log and project them.

    ``batch`` is the engine's batch size; ``steps`` (log sizes) runs the engine up to each
    size in turn (a projector catching up in several runs), calling ``on_step(db)`` after each.
    """
    tmp = directory or tempfile.mkdtemp(prefix="splits-")
    log = open_log(str(Path(tmp) / "log"), create=True)
    res = log.append(subs)
    assert res.ok
    db = connect(":memory:")
    with mock.patch.object(engine_mod, "BATCH", batch):
        eng = ReplayEngine(log, db, [SplitsProjection(config)], trust=SIGNER.trust)
        for size in (steps or []) + [len(subs)]:
            eng.run(until={("log", 0): size})
            if on_step is not None:
                on_step(db)
    log.close()
    return db


def project(lines: list[dict], **kw) -> sqlite3.Connection:
    return replay(encode(lines), **kw)


def groups(db) -> dict[str, str]:
    return dict(db.execute("SELECT task_id, group_id FROM task_groups"))


def splits(db) -> dict[str, str | None]:
    return {t: task_split(db, t)[0] for t in groups(db)}


def group_row(db, g: str) -> dict:
    cur = db.execute("SELECT * FROM group_splits WHERE group_id = ?", (g,))
    cols = [c[0] for c in cur.description]
    return dict(zip(cols, cur.fetchone()))


# ----------------------------------------------------------------------------------------
# group map and split map
# ----------------------------------------------------------------------------------------
def test_group_map_union_find_over_lineage_and_links() -> None:
    db = project([reg("t-b"), reg("t-c", ["t-b"]), reg("t-a"), reg("t-x", ["t-y"]), link("t-c", "t-a", "fork"),
                  reg("t-z"), policy()])
    assert groups(db) == {"t-a": "t-a", "t-b": "t-a", "t-c": "t-a", "t-x": "t-x", "t-y": "t-x", "t-z": "t-z"}
    tasks = db.execute("SELECT task_id, derived_from, registrations FROM tasks ORDER BY 1").fetchall()
    assert tasks == [("t-a", "[]", 1), ("t-b", "[]", 1), ("t-c", '["t-b"]', 1), ("t-x", '["t-y"]', 1), ("t-z", "[]", 1)]
    row = group_row(db, "t-a")
    assert row["members"] == 3 and json.loads(row["keys"]) == ["t-a", "t-b"]
    # The split is the keyed rule of ledger.algorithms.split_hash on the final sets, one per group.
    res = resolve_splits({"t-b": (), "t-c": ("t-b",), "t-a": (), "t-x": ("t-y",), "t-z": ()}, [("t-c", "t-a")],
                         [SplitPolicy("p1", FR, SALT)], [])
    assert {g: r for g, r in db.execute("SELECT group_id, split FROM group_splits")} == res.split_of_group
    assert check(db).ok


def test_no_policy_no_split_and_execution_split_shapes() -> None:
    db = project([reg("t1"), opened("e1", "t1"), opened("e2", "unregistered"), derived("v1", "e1"), derived("v2", "v1")])
    assert execution_split(db, "e1") == (None, "t1", False)
    assert execution_split(db, "v2") == (None, "t1", False)  # a view of a view inherits too
    assert execution_split(db, "e2") == (None, None, False)
    assert execution_split(db, "nope") == (None, None, False)
    assert group_row(db, "t1")["reason"] == "no split policy in force"
    assert current_split_policy(db) is None
    # Without the projection's tables (a database of other projections only) it answers "unknown".
    assert execution_split(connect(":memory:"), "e1") == (None, None, False)


def test_every_rollout_inherits_its_group_split() -> None:
    """Eight executions per task and a redacted view of each: one split per group (0 % straddle)."""
    lines: list[dict] = [policy("p", {"train": 0.8, "dev": 0.0, "final_test": 0.2})]
    for i in range(60):
        lines.append(reg(f"pool_repair_{i:02d}"))
        for a in range(8):
            lines.append(opened(f"ex-{i:02d}-{a}", f"pool_repair_{i:02d}"))
            lines.append(derived(f"ex-{i:02d}-{a}-redacted", f"ex-{i:02d}-{a}"))
    db = project(lines)
    per_task: dict[str, set] = {}
    for (ex,) in db.execute("SELECT execution_id FROM execution_tasks"):
        task = db.execute("SELECT task_id FROM execution_tasks WHERE execution_id = ?", (ex,)).fetchone()[0]
        per_task.setdefault(task, set()).add(execution_split(db, ex)[0])
        per_task[task].add(execution_split(db, ex + "-redacted")[0])
    assert len(per_task) == 60 and all(len(s) == 1 and None not in s for s in per_task.values())
    out = show(db)
    assert out["splits"]["train"]["executions"] == 8 * out["splits"]["train"]["tasks"]
    assert out["splits"]["train"]["derived"] == out["splits"]["train"]["executions"]
    assert sum(b["groups"] for b in out["splits"].values()) == 60
    assert "train" in format_show(out)


def test_merge_takes_most_protected_split() -> None:
    tr = find_task("train", "tr")
    ft = find_task("final_test", "ft")
    db = project([policy(), reg(tr), reg(ft), opened("e-tr", tr)])
    assert execution_split(db, "e-tr") == ("train", tr, False)
    db = project([policy(), reg(tr), reg(ft), opened("e-tr", tr), link(tr, ft, "vendored")])
    g = min(tr, ft)
    assert execution_split(db, "e-tr") == ("final_test", g, False)
    assert "most protected of 2 keyed draws" in group_row(db, g)["reason"]


def test_superseding_policy_chain_and_statuses() -> None:
    fr2 = {"train": 0.3, "dev": 0.3, "final_test": 0.3, "reserve": 0.1}
    lines = [policy("p1"), policy("p2", fr2, "salt-2", supersedes="p1"), policy("p3", salt="other-root"),
             policy("p9", supersedes="missing"), reg("t1"), reg("t2")]
    db = project(lines)
    status = dict(db.execute("SELECT policy_id, status FROM split_policies"))
    assert status == {"p1": "superseded", "p2": "in_force", "p3": "conflict", "p9": "pending"}
    pol = current_split_policy(db)
    assert pol is not None and pol["policy_id"] == "p2" and pol["chain"] == ["p1", "p2"]
    assert pol["conflicts"] == ["p3"] and pol["pending"] == ["p9"]
    # Every policy in force protects: the split is the most protected draw over p1, p2, p3.
    pols = [SplitPolicy("p1", FR, SALT), SplitPolicy("p2", fr2, "salt-2", "p1"), SplitPolicy("p3", FR, "other-root")]
    for t in ("t1", "t2"):
        want = max((p.assign(t) for p in pols), key=PROTECTION.__getitem__)
        assert task_split(db, t)[0] == want


def test_invalid_policy_is_rejected_by_the_projection() -> None:
    proj = SplitsProjection()
    db = connect(":memory:")
    proj.create(db)
    ev = {"event_type": "split_policy", "event_id": "x", "policy_id": "bad", "salt": "s", "supersedes": None,
          "fractions": {"train": 0.9, "dev": 0.2, "final_test": 0.0}}
    with pytest.raises(Rejected, match="must sum to 1"):
        proj.apply(db, Applied(ev, None))  # type: ignore[arg-type]
    ev = {"event_type": "task_linked", "event_id": "y", "task_a": "a", "task_b": "a", "relation": "fork"}
    with pytest.raises(Rejected, match="itself"):
        proj.apply(db, Applied(ev, None))  # type: ignore[arg-type]


def test_reclassification_moves_to_dev_for_good_and_promotes_reserve() -> None:
    ft = find_task("final_test", "ft")
    reserves = [find_task("reserve", "rs", start=0)]
    reserves.append(find_task("reserve", "rs", start=int(reserves[0][2:]) + 1))
    tr = find_task("train", "tr")
    lines = [policy(), reg(ft), *(reg(r) for r in reserves), reg(tr), opened("e-ft", ft), reclassify(ft),
             reclassify(tr, "not a test group")]
    db = project(lines)
    row = group_row(db, ft)
    assert (row["split"], row["base_split"], row["reclassified"]) == ("dev", "final_test", 1)
    assert execution_split(db, "e-ft")[0] == "dev"
    promoted = db.execute("SELECT promoted_group FROM split_reclassifications WHERE task_id = ?", (ft,)).fetchone()[0]
    assert promoted in reserves and task_split(db, promoted)[0] == "final_test"
    assert group_row(db, promoted)["promoted"] == 1
    other = [r for r in reserves if r != promoted][0]
    assert task_split(db, other)[0] == "reserve"
    effects = dict(db.execute("SELECT task_id, effect FROM split_reclassifications"))
    assert effects == {ft: "moved_to_dev", tr: "ignored"}
    # For good: a later merge with a final_test group keeps the inspected problem in dev.
    ft2 = find_task("final_test", "fu")
    db2 = project(lines + [reg(ft2), link(ft, ft2)])
    assert task_split(db2, ft2)[0] == "dev"


# ----------------------------------------------------------------------------------------
# quarantine and similarity screening
# ----------------------------------------------------------------------------------------
def test_ambiguous_lineage_quarantined_until_link_or_rejection() -> None:
    base = [policy(), reg("amb", ambiguous=True), reg("other"), opened("e1", "amb")]
    db = project(base)
    assert execution_split(db, "e1")[2] is True
    assert "ambiguous lineage" in group_row(db, "amb")["quarantine_reason"]
    assert db.execute("SELECT ambiguous_lineage FROM tasks WHERE task_id='amb'").fetchone() == (1,)
    for resolution in (reject("amb", "other"), link("other", "amb", "variant")):
        db = project(base + [resolution])
        assert execution_split(db, "e1")[2] is False


def test_similarity_candidates_review_queue_quarantine_and_resolution() -> None:
    tr = find_task("train", "up-")
    ft = find_task("final_test", "fork-")
    lines = [policy(), reg(tr, features={"issue": TEXT_POOL}), reg(ft, features={"issue": TEXT_POOL_FORK}),
             reg("unrelated", features={"issue": TEXT_UPLOAD}), reg("bare"), opened("e-tr", tr), opened("e-ft", ft)]
    db = project(lines)
    rows = candidates(db)
    assert [(r["task_a"], r["task_b"], r["status"], r["straddles"]) for r in rows] == [
        (min(tr, ft), max(tr, ft), "pending", True)]
    assert 0.5 < rows[0]["estimated_jaccard"] < 1.0
    # The non-test side waits; the test side does not.
    assert execution_split(db, "e-tr") == ("train", tr, True)
    assert execution_split(db, "e-ft") == ("final_test", ft, False)
    assert "awaits review" in group_row(db, tr)["quarantine_reason"]
    # Tasks without features are never screened.
    assert db.execute("SELECT COUNT(*) FROM similarity_signatures WHERE task_id = 'bare'").fetchone() == (0,)

    # Rejected: recorded, never proposed again, quarantine lifted.
    db_r = project(lines + [reject(ft, tr, evidence={"review": "different root cause"})])
    assert [r["status"] for r in candidates(db_r)] == ["rejected"]
    assert candidates(db_r, "pending") == []
    assert execution_split(db_r, "e-tr") == ("train", tr, False)
    # ... also when the rejection arrives first and the features later (order-free).
    db_r2 = project([lines[0], reject(tr, ft, evidence={"review": "different root cause"})] + lines[1:])
    assert splits_dump(db_r2) == splits_dump(db_r)

    # Linked: one group, the most protected split.
    db_l = project(lines + [link(tr, ft, "fork")])
    assert [r["status"] for r in candidates(db_l)] == ["linked"]
    assert execution_split(db_l, "e-tr") == ("final_test", min(tr, ft), False)
    assert check(db_l).ok


def test_rejection_never_splits_a_linked_group() -> None:
    db = project([policy(), reg("a"), reg("b"), link("a", "b"), reject("a", "b")])
    assert groups(db) == {"a": "a", "b": "a"}


def test_similarity_config_is_configurable_and_rescreens() -> None:
    lines = [reg("x1", features=TEXT_POOL), reg("x2", features=TEXT_POOL_FORK), reg("x3", features=TEXT_UPLOAD)]
    strict = SimilarityConfig(num_perm=64, bands=2, rows=32)  # steep near s ~ 0.98
    tmp = tempfile.mkdtemp()
    db_default = replay(encode(lines), directory=tmp)
    assert len(candidates(db_default)) == 1
    db_strict = replay(encode(lines), config=strict)
    assert candidates(db_strict) == []
    # Re-opening the same database with another configuration re-screens everything at once.
    log = open_log(str(Path(tmp) / "log"))
    ReplayEngine(log, db_default, [SplitsProjection(strict)], trust=SIGNER.trust).run()
    assert splits_dump(db_default) == splits_dump(db_strict)
    assert SimilarityConfig().probability(0.5) == pytest.approx(0.8732, abs=1e-4)
    with pytest.raises(ValueError, match="bands"):
        SimilarityConfig(bands=40, rows=4)


def test_derived_views_inherit_and_check_flags_inconsistent_records() -> None:
    a, b = find_task("train", "ta"), find_task("final_test", "tb")
    lines = [policy(), reg(a), reg(b), opened("ea", a), opened("eb", b), derived("v", "ea"), derived("w", "ea"),
             opened("w", b)]
    db = project(lines)
    assert execution_split(db, "v") == ("train", a, False)
    assert execution_split(db, "w") == ("final_test", b, False)  # its own ExecutionOpened answers for it
    # The log refuses a second RecordDerived for one view (natural key); a row as if it had
    # slipped through anyway: parents in two groups -> most protected split, quarantined.
    db.execute("INSERT INTO split_derived VALUES ('v', 'eb')")
    assert execution_split(db, "v") == ("final_test", min(a, b), True)
    rep = check(db)
    kinds = {(o["kind"], o["subject"]) for o in rep.offenders}
    assert kinds == {("derived_spans_groups", "v"), ("derived_disagrees_with_parent", "w")}
    assert "FAILED" in format_check(rep)


def test_check_detects_tampered_tables() -> None:
    db = project([policy(), reg("a"), reg("b", ["a"]), reg("c")])
    assert check(db).ok
    other = "dev" if task_split(db, "a")[0] != "dev" else "final_test"
    db.execute("UPDATE task_groups SET group_id = 'c' WHERE task_id = 'b'")
    db.execute("UPDATE group_splits SET split = ? WHERE group_id = 'c'", (other,))
    kinds = {o["kind"] for o in check(db).offenders}
    assert {"group_spans_splits", "stale_group", "stale_split"} <= kinds


def test_published_training_group_pulled_into_test_is_a_leak() -> None:
    tr, tr2 = find_task("train", "tr"), find_task("train", "tr", start=int(find_task("train", "tr")[2:]) + 1)
    ft = find_task("final_test", "ft")
    lines = [policy(), route("sft", "train"), route("eval", "final_test"), reg(tr), reg(tr2), reg(ft),
             published("eval", 1), published("sft", 1)]
    db = project(lines)
    assert {r[0] for r in db.execute("SELECT group_id FROM published_train_groups")} == {tr, tr2}
    assert check(db).ok
    db = project(lines + [link(ft, tr, "vendored")])
    leaks = db.execute("SELECT group_id, published_group, route, version, split FROM split_leaks").fetchall()
    assert leaks == [(min(ft, tr), tr, "sft", 1, "final_test")]
    rep = check(db)
    assert [o["kind"] for o in rep.offenders] == ["possible_leak"]
    # A group registered after the publication was never published: no leak when it merges.
    db = project(lines + [reg("late"), link("late", ft)])
    assert db.execute("SELECT COUNT(*) FROM split_leaks").fetchone() == (0,)


# ----------------------------------------------------------------------------------------
# convergence: any order, any interleaving, any batching, any number of catch-up runs
# ----------------------------------------------------------------------------------------
TASKS = ["a", "b", "c", "d", "e", "f", "g"]
TEXTS = [TEXT_POOL, TEXT_POOL, TEXT_POOL_FORK, TEXT_UPLOAD, TEXT_UPLOAD, None]
POLICIES = [
    ("p1", None, {"train": 0.6, "dev": 0.2, "final_test": 0.1, "reserve": 0.1}, "s1"),
    ("p2", "p1", {"train": 0.3, "dev": 0.3, "final_test": 0.3, "reserve": 0.1}, "s2"),
    ("p3", None, {"train": 0.3, "dev": 0.1, "final_test": 0.3, "reserve": 0.3}, "s3"),
    ("p4", "nowhere", {"train": 0.0, "dev": 0.0, "final_test": 1.0}, "s4"),
    ("p5", "p2", {"train": 0.5, "dev": 0.0, "final_test": 0.2, "reserve": 0.3}, "s5"),
]

task_st = st.sampled_from(TASKS)
pair_st = st.tuples(task_st, task_st).filter(lambda p: p[0] != p[1])


@st.composite
def governance_lines(draw) -> list[dict]:
    """Registrations, links, rejections, policies, reclassifications (one per natural key: the
    log refuses a second event with the same natural key and different content)."""
    lines: list[dict] = []
    for task in draw(st.lists(task_st, min_size=2, max_size=7, unique=True)):
        parents = draw(st.lists(task_st.filter(lambda t, task=task: t != task), max_size=2, unique=True))
        lines.append(reg(task, parents, ambiguous=draw(st.booleans()), features=draw(st.sampled_from(TEXTS)),
                         family="fam", source="src"))
    unique_pairs = st.lists(pair_st, max_size=5, unique_by=lambda p: tuple(sorted(p)))
    for a, b in draw(unique_pairs):
        lines.append(link(a, b, draw(st.sampled_from(["same_problem", "fork", "vendored", "similar"]))))
    for a, b in draw(unique_pairs):
        lines.append(reject(a, b))
    some = draw(st.sampled_from([0, 1, 1, 1]))  # mostly at least one policy
    for k in draw(st.lists(st.integers(0, len(POLICIES) - 1), min_size=some, max_size=4, unique=True)):
        pid, sup, fr, salt = POLICIES[k]
        lines.append(policy(pid, fr, salt, supersedes=sup))
    for t in draw(st.lists(task_st, max_size=4, unique=True)):
        lines.append(reclassify(t))
    return lines


@st.composite
def execution_lines(draw) -> list[dict]:
    lines: list[dict] = []
    n = draw(st.integers(0, 6))
    for i in range(n):
        lines.append(opened(f"e{i}", draw(st.sampled_from(TASKS + ["unregistered"]))))
    for j in range(draw(st.integers(0, 3)) if n else 0):
        parent = draw(st.sampled_from([f"e{i}" for i in range(n)] + [f"v{k}" for k in range(j)]))
        lines.append(derived(f"v{j}", parent))
    return lines


def _no_group_spans_two_splits(db: sqlite3.Connection) -> None:
    rep = check(db)
    # (a possible leak — a group published for training, now protected — is reported, not a span)
    assert all(o["kind"] == "possible_leak" for o in rep.offenders), format_check(rep)
    # Independently of the projection's own group ids: connected tasks share one split.
    facts_edges = [(t, p) for t, ps in db.execute("SELECT task_id, derived_from FROM split_registrations")
                   for p in json.loads(ps)]
    facts_edges += db.execute("SELECT task_a, task_b FROM split_links").fetchall()
    naive = build_groups([r[0] for r in db.execute("SELECT task_id FROM split_registrations")], facts_edges)
    per_group: dict[str, set] = {}
    for t, g in naive.items():
        per_group.setdefault(g, set()).add(task_split(db, t)[0])
    assert all(len(s) == 1 for s in per_group.values()), per_group
    for (ex,) in db.execute("SELECT execution_id FROM execution_tasks UNION SELECT derived_execution_id FROM split_derived"):
        split, group, _ = execution_split(db, ex)
        if group is not None:
            assert split == group_row(db, group)["split"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(gov=governance_lines(), exe=execution_lines(), seed=st.integers(0, 2**32 - 1))
def test_any_order_of_the_json_lines_gives_identical_tables(gov: list[dict], exe: list[dict], seed: int) -> None:
    subs = encode(gov + exe)
    rnd = random.Random(seed)
    reference = replay(subs)
    _no_group_spans_two_splits(reference)
    want = splits_dump(reference)
    for _ in range(2):
        order = subs[:]
        rnd.shuffle(order)
        db = replay(order, batch=rnd.choice([1, 2, 3, 7, 500]))
        _no_group_spans_two_splits(db)
        assert splits_dump(db) == want
    # And the pure rule over the final sets agrees with the projected tables.
    res = resolve_splits(
        [(ln["task_id"], ln["derived_from"]) for ln in gov if ln["type"] == "task_registered"],
        [(ln["task_a"], ln["task_b"]) for ln in gov if ln["type"] == "task_linked"],
        [SplitPolicy(ln["policy_id"], ln["fractions"], ln["salt"], ln.get("supersedes")) for ln in gov
         if ln["type"] == "split_policy"],
        [ln["task_id"] for ln in gov if ln["type"] == "split_reclassified"])
    assert dict(reference.execute("SELECT group_id, split FROM group_splits")) == \
        {g: res.split_of_group.get(g) for g in set(res.group_of.values())}


@st.composite
def interleaving(draw, n_a: int, n_b: int) -> list[int]:
    """A merge of two sequences that keeps each one's order: 0 = next of the first, 1 = next of the second."""
    n = n_a + n_b
    first = draw(st.sets(st.integers(0, max(n - 1, 0)), min_size=n_a, max_size=n_a)) if n else set()
    return [0 if i in first else 1 for i in range(n)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(gov=governance_lines(), exe=execution_lines(), data=st.data())
def test_interleavings_of_two_partitions_and_catch_up_runs_converge(gov: list[dict], exe: list[dict],
                                                                   data: st.DataObject) -> None:
    """Governance (totally ordered, with publications) vs. the executions partition, merged in
    any interleaving and projected in several catch-up runs: identical final tables, and at
    every intermediate step no group spans two splits and no task ever drops back to train."""
    gov = [route("sft", "train")] + gov[: len(gov) // 2] + [published("sft", 1)] + gov[len(gov) // 2:]
    g_subs, e_subs = encode(gov), encode(exe)
    want = splits_dump(replay(g_subs + e_subs))
    merge = data.draw(interleaving(len(g_subs), len(e_subs)))
    gi, ei = iter(g_subs), iter(e_subs)
    order = [next(gi) if m == 0 else next(ei) for m in merge]
    steps = sorted(set(data.draw(st.lists(st.integers(1, len(order)), max_size=4))))
    held: dict[str, int] = {}

    def on_step(db: sqlite3.Connection) -> None:
        _no_group_spans_two_splits(db)
        reclassified = {r[0] for r in db.execute("SELECT task_id FROM split_reclassifications")}
        recl_groups = {groups(db).get(t) for t in reclassified}
        for t, g in groups(db).items():
            s = task_split(db, t)[0]
            if s is None:
                continue
            if t in held and held[t] > 0:
                assert s != "train", f"{t} went back to train"
                if PROTECTION[s] < held[t]:
                    # the only ways down: reclassified to dev, or displaced from final_test to reserve
                    assert (s == "dev" and g in recl_groups) or s == "reserve", (t, s, held[t])
            held[t] = max(held.get(t, 0), PROTECTION[s])

    db = replay(order, batch=data.draw(st.sampled_from([1, 2, 5, 500])), steps=steps, on_step=on_step)
    assert splits_dump(db) == want


def test_rebuild_and_restart_give_identical_tables(tmp_path: Path) -> None:
    lines = [policy(), reg("a", features=TEXT_POOL), reg("b", ["a"]), reg("c", features=TEXT_POOL_FORK),
             reg("d", ambiguous=True), link("d", "c"), route(), published(), opened("e1", "b"), derived("v1", "e1")]
    log = open_log(str(tmp_path / "log"), create=True)
    assert Ingestor(log, SIGNER.trust).ingest_lines(enumerate(lines, 1)).appended == len(lines)
    full = connect(tmp_path / "full.db")
    ReplayEngine(log, full, [SplitsProjection()], trust=SIGNER.trust).run()
    inc = connect(tmp_path / "inc.db")
    for size in (2, 5, 7, len(lines)):  # a new process (fresh caches) for every catch-up run
        ReplayEngine(log, inc, [SplitsProjection()], trust=SIGNER.trust).run(until={("log", 0): size})
    assert splits_dump(inc) == splits_dump(full)
    eng = ReplayEngine(log, full, [SplitsProjection()], trust=SIGNER.trust)
    before = canonical_dump(full)
    eng.rebuild()
    eng.run()
    assert canonical_dump(full) == before


# ----------------------------------------------------------------------------------------
# admission integration: quarantine and split reach the cascade
# ----------------------------------------------------------------------------------------
def test_admission_sees_split_and_quarantine(tmp_path: Path) -> None:
    from ledger.projections.admission import AdmissionProjection
    from ledger.projections.assessment import AssessmentProjection
    from ledger.projections.governance import GovernanceProjection
    from ledger.projections.tree import TreeProjection

    tr = find_task("train", "tr")
    ft = find_task("final_test", "ft")
    lines = [policy(), reg(tr, features=TEXT_POOL), reg(ft, features=TEXT_POOL_FORK), route(),
             opened("e-tr", tr), opened("e-ft", ft)]
    for ex in ("e-tr", "e-ft"):
        lines += [request(ex, "r1", [1, 2, 3], [4, 5]), closed(ex)]
    log = open_log(str(tmp_path / "log"), create=True)
    Ingestor(log, SIGNER.trust).ingest_lines(enumerate(lines, 1))

    def run(db_name: str) -> sqlite3.Connection:
        db = connect(tmp_path / db_name)
        projs = [TreeProjection(), SplitsProjection(), GovernanceProjection(), AssessmentProjection(), AdmissionProjection()]
        ReplayEngine(log, db, projs, trust=SIGNER.trust).run()
        return db

    db = run("a.db")
    row = dict(db.execute("SELECT execution_id, reason FROM admission WHERE predicate = 'permitted_use'").fetchall())
    assert "quarantined" in row["e-tr"] and "split final_test is not the route's split train" in row["e-ft"]
    Ingestor(log, SIGNER.trust).ingest_lines([(1, reject(tr, ft))])
    db = run("b.db")
    reasons = dict(db.execute("SELECT execution_id, COALESCE(reason, '') FROM admission").fetchall())
    assert "quarantined" not in reasons["e-tr"]


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------
def test_cli_splits_and_similarity_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    base = ["--store", store]
    assert cli.main(base + ["init"]) == 0
    key = tmp_path / "gov.key"
    assert cli.main(base + ["keys", "new", "--out", str(key)]) == 0
    tr = find_task("train", "tr")
    ft = find_task("final_test", "ft")
    plain = [reg(tr, features={"issue": TEXT_POOL}), reg(ft, features={"issue": TEXT_POOL_FORK}), reg("t-other"),
             opened("e1", tr), opened("e2", ft)]
    gov = [{"type": "split_policy", "policy_id": "p1", "fractions": FR, "salt": SALT},
           {"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 2}]
    (tmp_path / "gov.jsonl").write_text("\n".join(json.dumps(x) for x in gov) + "\n")
    capsys.readouterr()
    assert cli.main(base + ["sign", "--key", str(key), str(tmp_path / "gov.jsonl")]) == 0
    signed = capsys.readouterr().out.strip().splitlines()
    random.Random(3).shuffle(plain)
    (tmp_path / "events.jsonl").write_text("\n".join([json.dumps(x) for x in plain] + signed) + "\n")
    assert cli.main(base + ["ingest", str(tmp_path / "events.jsonl")]) == 0
    capsys.readouterr()

    assert cli.main(base + ["splits", "show", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"]["policy_id"] == "p1" and out["quarantined_groups"] == 1
    assert out["splits"]["train"]["executions"] == 1 and out["candidates"]["pending_straddling"] == 1
    assert cli.main(base + ["splits", "show"]) == 0
    assert "similarity review queue: 1 pending" in capsys.readouterr().out

    assert cli.main(base + ["similarity", "candidates"]) == 0
    table = capsys.readouterr().out
    assert "pending" in table and tr in table and ft in table
    assert cli.main(base + ["similarity", "candidates", "--json", "--status", "pending"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["straddles"] is True
    assert cli.main(base + ["similarity", "curve"]) == 0
    curve = capsys.readouterr().out
    assert "1 - (1 - s^4)^32" in curve and f"{candidate_probability(0.5, 32, 4):8.4f}" in curve

    assert cli.main(base + ["splits", "check"]) == 0
    assert "splits check ok" in capsys.readouterr().out

    # Publish for training (header signed by a trusted key), then a review links the train
    # task to the final-test fork: the published group is pulled into final_test.
    (tmp_path / "review.jsonl").write_text(json.dumps(reject(tr, ft)) + "\n")
    assert cli.main(base + ["ingest", str(tmp_path / "review.jsonl")]) == 0
    pub = {"type": "manifest_published", "route": "sft", "version": 1, "route_version": 1, "root": "ab" * 32,
           "size": 1, "log_position": 9, "manifest_sha256": "cd" * 32}
    (tmp_path / "pub.jsonl").write_text(json.dumps(pub) + "\n")
    capsys.readouterr()
    assert cli.main(base + ["sign", "--key", str(key), str(tmp_path / "pub.jsonl")]) == 0
    (tmp_path / "pub.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli.main(base + ["ingest", str(tmp_path / "pub.signed.jsonl")]) == 0
    (tmp_path / "link.jsonl").write_text(json.dumps(link(ft, tr, "fork", event_id="late-link")) + "\n")
    assert cli.main(base + ["ingest", str(tmp_path / "link.jsonl")]) == 0
    capsys.readouterr()
    assert cli.main(base + ["splits", "check"]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "possible_leak" in text and tr in text
    assert cli.main(base + ["splits", "check", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and {o["kind"] for o in rep["offenders"]} == {"possible_leak"}


def test_cli_published_training_member_pulled_into_test_is_listed(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """End to end through every projection: admitted on the train route, published, then a
    review links its task to a final-test task.  `splits check` names the published member
    (from the archived manifest the log authenticates) and the possible leak, and exits 1."""
    fr = {"train": 0.5, "dev": 0.2, "final_test": 0.3}
    tr, ft = find_task("train", "tr", fr, "e2e"), find_task("final_test", "ft", fr, "e2e")
    base = ["--store", str(tmp_path / "s")]
    key = tmp_path / "g.key"
    assert cli.main(base + ["init"]) == 0 and cli.main(base + ["keys", "new", "--out", str(key)]) == 0
    gov = [{"type": "split_policy", "policy_id": "p", "fractions": fr, "salt": "e2e"},
           {"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 2},
           {"type": "permission", "subject": "*", "use": "*", "action": "grant", "authority": "legal"}]
    (tmp_path / "gov.jsonl").write_text("\n".join(json.dumps(x) for x in gov) + "\n")
    capsys.readouterr()
    assert cli.main(base + ["sign", "--key", str(key), str(tmp_path / "gov.jsonl")]) == 0
    (tmp_path / "gov.signed.jsonl").write_text(capsys.readouterr().out)
    events = [reg(tr), reg(ft), opened("e1", tr), request("e1", "r1", [1, 2, 3], [4, 5]), closed("e1"),
              {"type": "assessment", "assessment_id": "a1", "execution_id": "e1", "artifact_version": "v1",
               "outcome": "scored", "reward": 1.0, "evaluator": "tests@1"}]
    (tmp_path / "ev.jsonl").write_text("\n".join(json.dumps(x) for x in events) + "\n")
    assert cli.main(base + ["ingest", str(tmp_path / "gov.signed.jsonl")]) == 0
    assert cli.main(base + ["ingest", str(tmp_path / "ev.jsonl")]) == 0
    assert cli.main(base + ["manifest", "publish", "sft", "--key", str(key), "--out", str(tmp_path / "m.json")]) == 0
    members = json.loads((tmp_path / "m.json").read_text())["members"]
    assert [(m["execution_id"], m["split"], m["group_id"]) for m in members] == [("e1", "train", tr)]
    assert cli.main(base + ["splits", "check"]) == 0
    (tmp_path / "link.jsonl").write_text(json.dumps(link(tr, ft, "fork")) + "\n")
    assert cli.main(base + ["ingest", str(tmp_path / "link.jsonl")]) == 0
    capsys.readouterr()
    assert cli.main(base + ["splits", "check", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert {(o["kind"], o["subject"]) for o in rep["offenders"]} == {("possible_leak", min(tr, ft)),
                                                                    ("published_leak", members[0]["member_id"])}
    # The admission follows the merge: the execution is no longer admitted on the train route.
    db = connect(tmp_path / "s" / "projections.db")
    assert db.execute("SELECT state FROM admission WHERE execution_id = 'e1'").fetchone() == ("rejected",)
