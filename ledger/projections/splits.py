"""Task groups, split assignment, quarantine and similarity screening (SPEC §6.3; seed 002 §15.4).

Projection ``splits``.  It folds the governance facts about tasks into the group map and the
split map, screens task features for unrecorded near-duplicates, and answers the question
every downstream consumer asks: *which split does this execution belong to, and may it
leave quarantine?* (:func:`execution_split`).

The rule
--------
The split of a group is a function of the **final sets** of facts (registrations, links,
link rejections, policy declarations, reclassifications), never of their order of arrival:
see :mod:`ledger.algorithms.split_hash` (rules 1-6) and :class:`ledger.algorithms.split_hash.SplitState`.  This
projection only stores the facts, feeds them to a ``SplitState`` and writes the resolution
into tables, so every replay order — shuffled JSON lines, any interleaving of Kafka
partitions, any batching — ends in byte-identical tables.

Tables
------
Facts (one row per accepted event, keyed by ``event_id``; a set, so order-free):

``split_registrations(event_id, task_id, fixture, family, source, derived_from, ambiguous_lineage, features)``
``split_links(event_id, task_a, task_b, relation, evidence)``        pair stored with ``task_a < task_b``
``split_link_rejections(event_id, task_a, task_b, evidence)``
``split_policies(event_id, policy_id, fractions, salt, supersedes, status)``
    ``status`` (derived): ``in_force`` (head of the primary chain), ``superseded`` (on the
    chain, below the head), ``conflict`` (a competing declaration: refused as the policy in
    force, but its draws still protect, because some order of arrival would have put it in
    force), ``pending`` (its ``supersedes`` chain does not reach a root yet).
``split_reclassifications(event_id, task_id, reason, group_id, effect, promoted_group)``
    ``effect`` (derived): ``moved_to_dev`` or ``ignored`` (unknown task, or a group that was
    neither final_test nor reserve).
``split_routes(route, version, split)``                from AdmissionPolicyDeclared
``execution_tasks(execution_id, task_id)``             from ExecutionOpened (own copy: no
                                                       dependency on projection order)
``split_derived(derived_execution_id, parent_execution_id)``   from RecordDerived

Derived (recomputed in ``finish`` when a fact of this projection arrived in the batch):

``tasks(task_id, fixture, family, source, ambiguous_lineage, features, derived_from, registrations)``
    one row per registered task: descriptive fields from its registration with the smallest
    ``event_id``; ``ambiguous_lineage`` is true if any registration says so; ``derived_from``
    the union of all registrations' lineage.
``task_groups(task_id, group_id)``   every registered, lineage-referenced or linked task id;
    ``group_id`` = the group's smallest task id.
``group_splits(group_id, split, base_split, reclassified, promoted, quarantined, reason,
               quarantine_reason, keys, members)``
    ``split`` is NULL while no split policy is in force.  ``keys``: the group ids the group
    may have carried in some order of arrival (it draws once per key and keeps the most
    protected result).
``similarity_signatures(task_id, signature)``   MinHash signature of the union of a task's
    feature shingles (tasks without features are not screened).
``similarity_pairs(task_a, task_b, estimated_jaccard)``   every banded-LSH candidate pair.
``similarity_candidates(task_a, task_b, estimated_jaccard, status, straddles, group_a,
                        group_b, split_a, split_b)``
    LSH pairs that are in different groups or that a review decided: ``status`` is
    ``pending`` (in the review queue), ``linked`` (a TaskLinked joined them; a link beats a
    rejection of the same pair) or ``rejected`` (a reviewed non-match: never proposed
    again).  ``straddles`` = the two groups sit in different splits.
``published_train_groups(group_id, route, version)``   see *Leaks*.
``split_leaks(group_id, published_group, route, version, split, reason)``
``similarity_config(key, value)``   the screening configuration the tables were built with.

Quarantine
----------
A quarantined group is in no manifest (:func:`execution_split` returns ``quarantined=True``;
admission keeps such executions ``pending``) until the reason is resolved:

* a member task registered with ``ambiguous_lineage`` that no TaskLinked or
  TaskLinkRejected names yet (the whole group waits: the unknown relative could pull it
  into a protected split);
* a pending similarity candidate whose two groups sit in different splits: the **less
  protected** side (the non-test side) waits for the review (TaskLinked merges the groups,
  TaskLinkRejected dismisses the pair).

Leaks
-----
The log carries only manifest *headers*, so which groups were "already published for
training" is recorded deterministically at the moment a ManifestPublished for a route
whose split (AdmissionPolicyDeclared of that ``route_version``) is ``train`` is applied:
every group that was ``train`` and not quarantined at that point goes into
``published_train_groups`` (first publication wins).  All these events sit on the totally
ordered governance topic, so the snapshot is the same on every replay.  ``split_leaks``
then lists, for the current state, every such group whose members now sit in a group
whose split is not ``train`` (a merge pulled it towards dev/final_test, or a superseding
policy raised it): a *possible* leak, since the group was eligible for training when the
manifest was published.  ``ledger splits check`` additionally compares the members of the
published (archived, log-authenticated) manifest documents with the current split map.

Similarity screening
--------------------
MinHash (:class:`ledger.algorithms.minhash.MinHasher`, datasketch-compatible) over each task's feature
shingles (:func:`ledger.algorithms.minhash.feature_shingles`), banded LSH with ``b`` bands of ``r``
rows.  Defaults (:class:`SimilarityConfig`): ``num_perm=128``, ``b=32``, ``r=4``, seed 1,
scheme ``affine32``, word 3-gram shingles, case-folded.  A pair with Jaccard similarity
``s`` becomes a candidate with probability ``1 - (1 - s^r)^b`` (0.873 at s = 0.5 for the
defaults).  Changing the configuration re-screens every task on the next batch.

Executions and derived records inherit their task group's split: :func:`execution_split`
resolves an execution to its task (a derived view through its parent, transitively) at
query time, so nothing can override it and no order of arrival can make it stale.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass

import numpy as np

from ledger.algorithms.canonical import json_or_text
from ledger.algorithms.errors import InputError
from ledger.algorithms.minhash import (
    DEFAULT_NUM_PERM,
    DEFAULT_SCHEME,
    DEFAULT_SEED,
    LSHIndex,
    MinHasher,
    ShingleConfig,
    candidate_probability,
    feature_shingles,
    format_candidate_curve,
    lsh_candidate_indices,
)
from ledger.algorithms.split_hash import (
    PROTECTION,
    SplitPolicy,
    SplitPolicyError,
    SplitResolution,
    SplitState,
    most_protected,
)
from ledger.algorithms.split_strata import Allocation
from ledger.projections.engine import Applied, Rejected

__all__ = [
    "SimilarityConfig",
    "SplitsProjection",
    "TABLES",
    "current_split_policy",
    "execution_split",
    "execution_task_ids",
    "split_tables_present",
    "task_split",
]

MAX_LINEAGE_DEPTH = 64

#: Tables whose content is the projection's state (for canonical dumps in tests and reports).
TABLES: tuple[str, ...] = (
    "split_registrations", "split_links", "split_link_rejections", "split_policies", "split_reclassifications",
    "split_allocations", "split_routes", "execution_tasks", "split_derived", "tasks", "task_groups", "group_splits",
    "similarity_config", "similarity_signatures", "similarity_pairs", "similarity_candidates",
    "published_train_groups", "split_leaks",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS split_registrations (
    event_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, fixture TEXT, family TEXT, source TEXT,
    derived_from TEXT NOT NULL, ambiguous_lineage INTEGER NOT NULL, features TEXT);
CREATE INDEX IF NOT EXISTS split_registrations_task ON split_registrations(task_id);
CREATE TABLE IF NOT EXISTS split_links (
    event_id TEXT PRIMARY KEY, task_a TEXT NOT NULL, task_b TEXT NOT NULL, relation TEXT NOT NULL, evidence TEXT);
CREATE TABLE IF NOT EXISTS split_link_rejections (
    event_id TEXT PRIMARY KEY, task_a TEXT NOT NULL, task_b TEXT NOT NULL, evidence TEXT);
CREATE TABLE IF NOT EXISTS split_policies (
    event_id TEXT PRIMARY KEY, policy_id TEXT NOT NULL, fractions TEXT NOT NULL, salt TEXT NOT NULL, supersedes TEXT,
    status TEXT, strata TEXT, group_by TEXT);
CREATE TABLE IF NOT EXISTS split_allocations (
    seq INTEGER PRIMARY KEY, policy_id TEXT NOT NULL, variant TEXT NOT NULL, key TEXT NOT NULL, stratum TEXT,
    split TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS split_reclassifications (
    event_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, reason TEXT NOT NULL, group_id TEXT, effect TEXT,
    promoted_group TEXT);
CREATE TABLE IF NOT EXISTS split_routes (
    route TEXT NOT NULL, version INTEGER NOT NULL, split TEXT NOT NULL, PRIMARY KEY (route, version));
CREATE TABLE IF NOT EXISTS execution_tasks (execution_id TEXT PRIMARY KEY, task_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS execution_tasks_task ON execution_tasks(task_id);
CREATE TABLE IF NOT EXISTS split_derived (
    derived_execution_id TEXT NOT NULL, parent_execution_id TEXT NOT NULL,
    PRIMARY KEY (derived_execution_id, parent_execution_id));
CREATE INDEX IF NOT EXISTS split_derived_parent ON split_derived(parent_execution_id);
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY, fixture TEXT, family TEXT, source TEXT, ambiguous_lineage INTEGER NOT NULL,
    features TEXT, derived_from TEXT NOT NULL, registrations INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS task_groups (task_id TEXT PRIMARY KEY, group_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS task_groups_group ON task_groups(group_id);
CREATE TABLE IF NOT EXISTS group_splits (
    group_id TEXT PRIMARY KEY, split TEXT, base_split TEXT, reclassified INTEGER NOT NULL, promoted INTEGER NOT NULL,
    quarantined INTEGER NOT NULL, reason TEXT NOT NULL, quarantine_reason TEXT, keys TEXT NOT NULL,
    members INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS similarity_config (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS similarity_signatures (task_id TEXT PRIMARY KEY, signature BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS similarity_pairs (
    task_a TEXT NOT NULL, task_b TEXT NOT NULL, estimated_jaccard REAL NOT NULL, PRIMARY KEY (task_a, task_b));
CREATE TABLE IF NOT EXISTS similarity_candidates (
    task_a TEXT NOT NULL, task_b TEXT NOT NULL, estimated_jaccard REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'linked', 'rejected')), straddles INTEGER NOT NULL,
    group_a TEXT, group_b TEXT, split_a TEXT, split_b TEXT, PRIMARY KEY (task_a, task_b));
CREATE TABLE IF NOT EXISTS published_train_groups (
    group_id TEXT PRIMARY KEY, route TEXT NOT NULL, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS split_leaks (
    group_id TEXT NOT NULL, published_group TEXT NOT NULL, route TEXT NOT NULL, version INTEGER NOT NULL,
    split TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (group_id, published_group));
"""

_MY_FACTS = frozenset({"task_registered", "task_linked", "task_link_rejected", "split_policy", "split_reclassified"})


# ----------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimilarityConfig:
    """Similarity screening parameters (seed 002 §15.4.3).

    ``num_perm`` MinHash permutations (``seed``, ``scheme`` as in datasketch), ``bands`` x
    ``rows`` banded LSH (``bands * rows <= num_perm``), shingles of kind ``shingle_kind``
    (``word`` or ``char``) of size ``shingle_k``, case-folded when ``lowercase``.  Version
    it with the data: changing it changes every signature.
    """

    num_perm: int = DEFAULT_NUM_PERM
    bands: int = 32
    rows: int = 4
    seed: int = DEFAULT_SEED
    scheme: str = DEFAULT_SCHEME
    shingle_kind: str = "word"
    shingle_k: int = 3
    lowercase: bool = True

    def __post_init__(self) -> None:
        if self.bands < 1 or self.rows < 1 or self.bands * self.rows > self.num_perm:
            raise InputError(f"bands and rows must be positive with bands*rows <= num_perm, got {self.bands}*{self.rows} "
                             f"and num_perm={self.num_perm}")
        ShingleConfig(self.shingle_kind, self.shingle_k, self.lowercase)  # type: ignore[arg-type]  # validates

    @property
    def shingles(self) -> ShingleConfig:
        return ShingleConfig(self.shingle_kind, self.shingle_k, self.lowercase)  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "SimilarityConfig":
        return cls(**json.loads(text))

    def probability(self, s: float) -> float:
        """``1 - (1 - s^r)^b``: chance that a pair of Jaccard similarity ``s`` is a candidate."""
        return float(candidate_probability(s, self.bands, self.rows))

    def curve_text(self, points: int = 11) -> str:
        return format_candidate_curve(self.bands, self.rows, points)


# ----------------------------------------------------------------------------------------
# The projection
# ----------------------------------------------------------------------------------------
def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def _policies(db: sqlite3.Connection, extra: str = "") -> list[tuple]:
    """``(policy, *extra columns)`` for every declared policy."""
    return [(SplitPolicy(r[0], json.loads(r[1]), r[2], r[3], r[4], r[5]), *r[6:]) for r in db.execute(
        f"SELECT policy_id, fractions, salt, supersedes, strata, group_by{extra} FROM split_policies")]


def state_from_facts(db: sqlite3.Connection) -> SplitState:
    """A :class:`SplitState` rebuilt from the projection's fact tables and the quota allocations
    already taken (``split_allocations``); independent of caches."""
    regs = [(task, json.loads(parents), {"family": fam, "fixture": fix, "source": src}, json_or_text(feat))
            for task, parents, fam, fix, src, feat in db.execute(
                "SELECT task_id, derived_from, family, fixture, source, features FROM split_registrations")]
    return SplitState.restore(
        regs, db.execute("SELECT task_a, task_b FROM split_links").fetchall(),
        db.execute("SELECT task_a, task_b FROM split_link_rejections").fetchall(), [r[0] for r in _policies(db)],
        [t for (t,) in db.execute("SELECT task_id FROM split_reclassifications")],
        [Allocation(*r[1:], r[0]) for r in db.execute(
            "SELECT seq, policy_id, variant, key, stratum, split FROM split_allocations ORDER BY seq")])


class SplitsProjection:
    """Group map, split map, quarantine, similarity review queue, leaks (see module doc)."""

    name = "splits"

    def __init__(self, config: SimilarityConfig | None = None) -> None:
        self.config = config or SimilarityConfig()
        self._hasher = MinHasher(self.config.num_perm, self.config.seed, self.config.scheme)
        self.reset()

    # -- protocol -----------------------------------------------------------------------
    def reset(self) -> None:
        self._state: SplitState | None = None
        self._index: LSHIndex | None = None
        self._sigs: dict[str, np.ndarray] | None = None
        self._written_groups: dict[str, str] | None = None
        self._written_splits: dict[str, tuple] | None = None
        self._changed = False
        self._rescreen = False
        self._dirty_tasks: set[str] = set()

    def create(self, db: sqlite3.Connection) -> None:
        db.executescript(_SCHEMA)
        want = self.config.to_json()
        row = db.execute("SELECT value FROM similarity_config WHERE key = 'config'").fetchone()
        if row is None or row[0] != want:
            # A new configuration: every signature and pair is recomputed now, atomically.
            own = not db.in_transaction
            if own:
                db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("INSERT OR REPLACE INTO similarity_config VALUES ('config', ?)", (want,))
                if row is not None:
                    self.reset()
                    self._rescreen = True
                    self._recompute(db)
                if own:
                    db.execute("COMMIT")
            except BaseException:
                if own:
                    db.execute("ROLLBACK")
                self.reset()
                raise

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et == "execution_opened":
            db.execute("INSERT OR IGNORE INTO execution_tasks VALUES (?,?)", (ev["execution_id"], ev["task_id"]))
        elif et == "record_derived":
            d, p = ev["derived_execution_id"], ev["parent_execution_id"]
            if d == p:
                raise Rejected("a record cannot be derived from itself")
            db.execute("INSERT OR IGNORE INTO split_derived VALUES (?,?)", (d, p))
        elif et == "admission_policy":
            db.execute("INSERT OR IGNORE INTO split_routes VALUES (?,?,?)", (ev["route"], int(ev["version"]), ev["split"]))
        elif et == "manifest_published":
            self._published(db, ev)
        elif et in _MY_FACTS:
            self._fact(db, et, ev)

    def finish(self, db: sqlite3.Connection) -> None:
        if self._changed:
            self._recompute(db)

    # -- facts --------------------------------------------------------------------------
    def _fact(self, db: sqlite3.Connection, et: str, ev: dict) -> None:
        state = self._load(db)
        eid = ev["event_id"]
        if et == "task_registered":
            parents = sorted(set(ev.get("derived_from") or []))
            cur = db.execute(
                "INSERT OR IGNORE INTO split_registrations VALUES (?,?,?,?,?,?,?,?)",
                (eid, ev["task_id"], ev.get("fixture"), ev.get("family"), ev.get("source"), json.dumps(parents),
                 int(bool(ev.get("ambiguous_lineage"))), ev.get("features")))
            if cur.rowcount:
                fields = {f: ev.get(f) for f in ("family", "fixture", "source")}
                state.register(ev["task_id"], parents, fields, json_or_text(ev.get("features")))
                self._dirty_tasks.add(ev["task_id"])
        elif et in ("task_linked", "task_link_rejected"):
            a, b = _pair(ev["task_a"], ev["task_b"])
            if a == b:
                raise Rejected(f"a task cannot be linked to (or rejected against) itself: {a!r}")
            if et == "task_linked":
                cur = db.execute("INSERT OR IGNORE INTO split_links VALUES (?,?,?,?,?)",
                                 (eid, a, b, ev["relation"], ev.get("evidence")))
                if cur.rowcount:
                    state.link(a, b)
            else:
                cur = db.execute("INSERT OR IGNORE INTO split_link_rejections VALUES (?,?,?,?)",
                                 (eid, a, b, ev.get("evidence")))
                if cur.rowcount:
                    state.reject(a, b)
        elif et == "split_policy":
            try:
                policy = SplitPolicy(ev["policy_id"], dict(ev["fractions"]), ev["salt"], ev.get("supersedes"),
                                     ev.get("strata"), ev.get("group_by"))
            except SplitPolicyError as exc:
                raise Rejected(f"invalid split policy: {exc}") from None
            fractions = json.dumps(dict(policy.fractions), sort_keys=True, separators=(",", ":"))
            cur = db.execute("INSERT OR IGNORE INTO split_policies VALUES (?,?,?,?,?,NULL,?,?)",
                             (eid, policy.policy_id, fractions, policy.salt, policy.supersedes, policy.strata,
                              policy.group_by))
            if cur.rowcount:
                state.declare_policy(policy)
        elif et == "split_reclassified":
            cur = db.execute("INSERT OR IGNORE INTO split_reclassifications VALUES (?,?,?,NULL,NULL,NULL)",
                             (eid, ev["task_id"], ev["reason"]))
            if cur.rowcount:
                state.reclassify(ev["task_id"])
        self._changed = True

    def _published(self, db: sqlite3.Connection, ev: dict) -> None:
        row = db.execute("SELECT split FROM split_routes WHERE route = ? AND version = ?",
                         (ev["route"], int(ev["route_version"]))).fetchone()
        if row is None or row[0] != "train":
            return
        # Snapshot the split map as it stands at this point of the (totally ordered)
        # governance topic: bring the derived tables up to date first.
        if self._changed:
            self._recompute(db)
        db.execute("INSERT OR IGNORE INTO published_train_groups "
                   "SELECT group_id, ?, ? FROM group_splits WHERE split = 'train' AND quarantined = 0",
                   (ev["route"], int(ev["version"])))
        self._changed = True  # leaks are recomputed in finish

    # -- in-memory caches (rebuilt from the tables after a reset) ------------------------
    def _load(self, db: sqlite3.Connection) -> SplitState:
        if self._state is None:
            self._state = state_from_facts(db)
        return self._state

    def _load_written(self, db: sqlite3.Connection) -> tuple[dict[str, str], dict[str, tuple]]:
        if self._written_groups is None or self._written_splits is None:
            self._written_groups = dict(db.execute("SELECT task_id, group_id FROM task_groups"))
            self._written_splits = {r[0]: tuple(r) for r in db.execute(f"SELECT {_GROUP_COLS} FROM group_splits")}
        return self._written_groups, self._written_splits

    def _load_index(self, db: sqlite3.Connection) -> tuple[LSHIndex, dict[str, np.ndarray]]:
        if self._index is None or self._sigs is None:
            index = LSHIndex(self.config.bands, self.config.rows)
            sigs: dict[str, np.ndarray] = {}
            for task, blob in db.execute("SELECT task_id, signature FROM similarity_signatures ORDER BY task_id"):
                sig = np.frombuffer(blob, dtype=self._hasher.dtype)
                sigs[task] = sig
                index.insert(task, sig)
            self._index, self._sigs = index, sigs
        return self._index, self._sigs

    # -- recomputation --------------------------------------------------------------------
    def _recompute(self, db: sqlite3.Connection) -> None:
        state = self._load(db)
        if self._rescreen:
            self._rescreen_all(db)
        elif self._dirty_tasks:
            self._screen(db, sorted(self._dirty_tasks))
        for t in sorted(self._dirty_tasks):
            _write_task(db, t)
        self._dirty_tasks = set()
        db.executemany("INSERT OR REPLACE INTO split_allocations VALUES (?,?,?,?,?,?)",
                       [(a.seq, a.policy_id, a.variant, a.key, a.stratum, a.split) for a in state.strata.drain()])
        res = state.resolve()
        self._write_groups(db, res)
        quarantine = self._write_candidates(db, res, state)
        quarantine_ambiguous(db, res, state, quarantine)
        self._write_splits(db, res, quarantine)
        _write_policy_status(db, res)
        _write_reclassifications(db, res)
        _write_leaks(db, res)
        self._changed = False

    def _shingles(self, db: sqlite3.Connection, task: str) -> set[bytes]:
        out: set[bytes] = set()
        for (features,) in db.execute("SELECT features FROM split_registrations WHERE task_id = ? AND features IS NOT NULL",
                                      (task,)):
            try:
                value = json.loads(features)
            except ValueError:
                value = features
            out |= feature_shingles(value, self.config.shingles)
        return out

    def _screen(self, db: sqlite3.Connection, tasks: list[str]) -> None:
        """Signatures of ``tasks`` (new or with new features) and their new LSH pairs."""
        docs = {t: self._shingles(db, t) for t in tasks}
        docs = {t: s for t, s in docs.items() if s}
        if not docs:
            return
        index, sigs = self._load_index(db)
        new = self._hasher.signatures(docs)
        changed = [t for t, sig in new.items() if t in sigs and not np.array_equal(sig, sigs[t])]
        fresh = {t: sig for t, sig in new.items() if t not in sigs}
        for t, sig in sorted(new.items()):
            if t in fresh or t in changed:
                db.execute("INSERT OR REPLACE INTO similarity_signatures VALUES (?,?)", (t, sig.tobytes()))
        if changed:  # a task gained features: its buckets moved, rebuild every pair
            self._index = self._sigs = None
            self._rebuild_pairs(db)
            return
        rows = []
        for t in sorted(fresh):
            sig = fresh[t]
            for other in sorted(index.insert(t, sig)):
                a, b = _pair(t, other)
                rows.append((a, b, _jaccard(sig, sigs[other])))
            sigs[t] = sig
        db.executemany("INSERT OR REPLACE INTO similarity_pairs VALUES (?,?,?)", rows)

    def _rescreen_all(self, db: sqlite3.Connection) -> None:
        db.execute("DELETE FROM similarity_signatures")
        tasks = [r[0] for r in db.execute("SELECT DISTINCT task_id FROM split_registrations WHERE features IS NOT NULL")]
        docs = {t: s for t in sorted(tasks) if (s := self._shingles(db, t))}
        if docs:
            for t, sig in sorted(self._hasher.signatures(docs).items()):
                db.execute("INSERT INTO similarity_signatures VALUES (?,?)", (t, sig.tobytes()))
        self._index = self._sigs = None
        self._rebuild_pairs(db)
        self._rescreen = False

    def _rebuild_pairs(self, db: sqlite3.Connection) -> None:
        db.execute("DELETE FROM similarity_pairs")
        keys, mats = [], []
        for task, blob in db.execute("SELECT task_id, signature FROM similarity_signatures ORDER BY task_id"):
            keys.append(task)
            mats.append(np.frombuffer(blob, dtype=self._hasher.dtype))
        if len(keys) < 2:
            return
        matrix = np.stack(mats)
        idx = lsh_candidate_indices(matrix, self.config.bands, self.config.rows)
        if idx.size:
            eq = np.count_nonzero(matrix[idx[:, 0]] == matrix[idx[:, 1]], axis=1) / float(matrix.shape[1])
            db.executemany("INSERT INTO similarity_pairs VALUES (?,?,?)",
                           [(keys[i], keys[j], float(e)) for (i, j), e in zip(idx.tolist(), eq.tolist())])

    def _write_groups(self, db: sqlite3.Connection, res: SplitResolution) -> None:
        written, _ = self._load_written(db)
        changes = [(t, g) for t, g in res.group_of.items() if written.get(t) != g]
        if changes:
            db.executemany("INSERT OR REPLACE INTO task_groups VALUES (?,?)", sorted(changes))
            written.update(changes)

    def _write_candidates(self, db: sqlite3.Connection, res: SplitResolution, state: SplitState) -> dict[str, list[str]]:
        """Rewrite ``similarity_candidates``; return quarantine reasons by group (similarity)."""
        rows = []
        quarantine: dict[str, list[str]] = {}
        for a, b, jac in db.execute("SELECT task_a, task_b, estimated_jaccard FROM similarity_pairs ORDER BY 1, 2"):
            ga, gb = res.group_of.get(a), res.group_of.get(b)
            pair = (a, b)
            status = "linked" if pair in state.links else "rejected" if pair in state.rejections else "pending"
            if status == "pending" and ga == gb:
                continue  # already one group: nothing to review
            sa = res.split_of_group.get(ga) if ga is not None else None
            sb = res.split_of_group.get(gb) if gb is not None else None
            straddles = sa is not None and sb is not None and sa != sb
            rows.append((a, b, jac, status, int(straddles), ga, gb, sa, sb))
            if status == "pending" and straddles:
                assert sa is not None and sb is not None and ga is not None and gb is not None
                low, other, other_split = (ga, gb, sb) if PROTECTION[sa] < PROTECTION[sb] else (gb, ga, sa)
                quarantine.setdefault(low, []).append(
                    f"similarity candidate {a} ~ {b} (J~{jac:.2f}) awaits review; group {other} is {other_split}")
        db.execute("DELETE FROM similarity_candidates")
        db.executemany("INSERT INTO similarity_candidates VALUES (?,?,?,?,?,?,?,?,?)", rows)
        return quarantine

    def _write_splits(self, db: sqlite3.Connection, res: SplitResolution, quarantine: dict[str, list[str]]) -> None:
        _, written = self._load_written(db)
        members: dict[str, int] = {}
        for g in res.group_of.values():
            members[g] = members.get(g, 0) + 1
        promoted_from = {v: k for k, v in res.promotions.items()}
        reclassified = set(res.reclassified)
        under = ", ".join(sorted({p.policy_id for p in res.policies.in_force if not p.strata}))
        quota = _quota_reasons(res)
        keys_json: dict[tuple[str, ...], str] = {}
        rows = {}
        for g in sorted(members):
            keys = res.keys.get(g, (g,))
            split, base = res.split_of_group.get(g), res.base_split.get(g)
            if split is None:
                reason = "no split policy in force"
            elif g in promoted_from:
                reason = f"promoted from reserve to final_test to replace reclassified group {promoted_from[g]}"
            elif g in reclassified:
                reason = f"inspected (split_reclassified): moved from {base} to dev for good"
            elif g in quota:
                reason = quota[g] + (f"; most protected with the keyed draws under {under}" if under else "")
            elif len(keys) == 1:
                reason = f"keyed draw of {keys[0]} under {under}"
            else:
                reason = f"most protected of {len(keys)} keyed draws (merged parts) under {under}"
            q = quarantine.get(g)
            qs = "; ".join(sorted(set(q))) if q else None
            kj = keys_json.get(keys)
            if kj is None:
                kj = keys_json[keys] = json.dumps(list(keys))
            rows[g] = (g, split, base, int(g in reclassified), int(g in promoted_from), int(bool(q)), reason, qs, kj,
                       members[g])
        changes = [r for g, r in rows.items() if written.get(g) != r]
        gone = [g for g in written if g not in rows]
        if gone:
            db.executemany("DELETE FROM group_splits WHERE group_id = ?", [(g,) for g in sorted(gone)])
            for g in gone:
                del written[g]
        if changes:
            db.executemany(f"INSERT OR REPLACE INTO group_splits ({_GROUP_COLS}) VALUES ({','.join('?' * 10)})", changes)
            written.update((r[0], r) for r in changes)


_GROUP_COLS = ("group_id, split, base_split, reclassified, promoted, quarantined, reason, quarantine_reason, keys, "
               "members")


def _quota_reasons(res: SplitResolution) -> dict[str, str]:
    """Reason text of every group a stratified policy allocated (its allocations, in order)."""
    parts: dict[str, list[str]] = {}
    for a in res.allocations:
        g = res.group_of.get(a.key)
        if g is not None:
            stratum = "(none)" if a.stratum is None else repr(a.stratum)
            parts.setdefault(g, []).append(f"{a.key} to {a.split} by {a.policy_id}'s quota in stratum {stratum} "
                                           f"(allocation {a.seq})")
    return {g: "quota fill: " + "; ".join(ps) for g, ps in parts.items()}


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.count_nonzero(a == b)) / float(a.size)


def _write_task(db: sqlite3.Connection, task: str) -> None:
    rows = db.execute("SELECT event_id, fixture, family, source, derived_from, ambiguous_lineage, features "
                      "FROM split_registrations WHERE task_id = ? ORDER BY event_id", (task,)).fetchall()
    if not rows:
        return
    _, fixture, family, source, _, _, features = rows[0]
    parents = sorted({p for r in rows for p in json.loads(r[4])})
    ambiguous = int(any(r[5] for r in rows))
    db.execute("INSERT OR REPLACE INTO tasks VALUES (?,?,?,?,?,?,?,?)",
               (task, fixture, family, source, ambiguous, features, json.dumps(parents), len(rows)))


def quarantine_ambiguous(db: sqlite3.Connection, res: SplitResolution, state: SplitState,
                         quarantine: dict[str, list[str]]) -> None:
    """Add the groups of unresolved ambiguous-lineage tasks to ``quarantine`` (reasons by group)."""
    reviewed: set[str] = set()
    for a, b in state.links | state.rejections:
        reviewed.add(a)
        reviewed.add(b)
    for (task,) in db.execute("SELECT DISTINCT task_id FROM split_registrations WHERE ambiguous_lineage = 1 ORDER BY 1"):
        if task in reviewed:
            continue
        g = res.group_of.get(task)
        if g is not None:
            quarantine.setdefault(g, []).append(f"task {task} registered with ambiguous lineage awaits a link or rejection")


def _write_policy_status(db: sqlite3.Connection, res: SplitResolution) -> None:
    """``in_force`` (the head), ``superseded`` (on the primary chain), ``conflict`` (in force
    off the chain, or a second variant of an id), ``pending`` (chain does not reach a root)."""
    forest = res.policies
    in_force = set(forest.in_force)
    chosen: dict[str, SplitPolicy] = {}
    for p in sorted(forest.in_force, key=SplitPolicy.sort_key):
        chosen.setdefault(p.policy_id, p)  # the variant the chain uses (smallest sort key)
    chain = set(forest.chain)
    updates = []
    for policy, eid in _policies(db, ", event_id"):
        pid = policy.policy_id
        if policy not in in_force:
            status = "pending"
        elif pid not in chain or chosen[pid] != policy:
            status = "conflict"
        elif forest.head is not None and policy == forest.head:
            status = "in_force"
        else:
            status = "superseded"
        updates.append((status, eid))
    db.executemany("UPDATE split_policies SET status = ? WHERE event_id = ?", updates)


def _write_reclassifications(db: sqlite3.Connection, res: SplitResolution) -> None:
    ignored = set(res.ignored_reclassifications)
    updates = []
    for eid, task in db.execute("SELECT event_id, task_id FROM split_reclassifications").fetchall():
        g = res.group_of.get(task)
        effect = "ignored" if task in ignored else "moved_to_dev"
        promoted = res.promotions.get(g) if g is not None and effect == "moved_to_dev" else None
        updates.append((g, effect, promoted, eid))
    db.executemany("UPDATE split_reclassifications SET group_id = ?, effect = ?, promoted_group = ? WHERE event_id = ?",
                   updates)


def _write_leaks(db: sqlite3.Connection, res: SplitResolution) -> None:
    rows = []
    for p, route, version in db.execute("SELECT group_id, route, version FROM published_train_groups ORDER BY 1"):
        g = res.group_of.get(p)
        split = res.split_of_group.get(g) if g is not None else None
        if g is None or split is None or split == "train":
            continue
        how = "merged into" if g != p or len(res.keys.get(g, ())) > 1 else "now in"
        rows.append((g, p, route, version, split,
                     f"group {p} was train when {route} v{version} was published; {how} {split} group {g}"))
    db.execute("DELETE FROM split_leaks")
    db.executemany("INSERT INTO split_leaks VALUES (?,?,?,?,?,?)", rows)


# ----------------------------------------------------------------------------------------
# Queries (for admission, export, the CLI)
# ----------------------------------------------------------------------------------------
def split_tables_present(db: sqlite3.Connection) -> bool:
    """True when the ``splits`` projection's tables exist in ``db``."""
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'group_splits'").fetchone() is not None


def execution_task_ids(db: sqlite3.Connection, execution_id: str) -> set[str]:
    """The task(s) of an execution: its ExecutionOpened task, or (a derived view) its parents' tasks.

    An execution opened directly answers with its own task; a derived view follows its
    RecordDerived parent(s) transitively (at most :data:`MAX_LINEAGE_DEPTH` levels, cycles
    cut).  Normally one task; several only when a view was derived from parents of
    different tasks (an inconsistency ``ledger splits check`` reports).
    """
    out: set[str] = set()
    seen = {execution_id}
    frontier = [execution_id]
    for _ in range(MAX_LINEAGE_DEPTH):
        if not frontier:
            break
        nxt: list[str] = []
        for ex in frontier:
            row = db.execute("SELECT task_id FROM execution_tasks WHERE execution_id = ?", (ex,)).fetchone()
            if row is not None:
                out.add(row[0])
                continue
            for (parent,) in db.execute("SELECT parent_execution_id FROM split_derived WHERE derived_execution_id = ? "
                                        "ORDER BY 1", (ex,)):
                if parent not in seen:
                    seen.add(parent)
                    nxt.append(parent)
        frontier = nxt
    return out


def task_split(db: sqlite3.Connection, task_id: str) -> tuple[str | None, str | None, bool]:
    """``(split, group_id, quarantined)`` of a task; ``(None, None, False)`` when it has no group."""
    row = db.execute("SELECT g.group_id, g.split, g.quarantined FROM task_groups t JOIN group_splits g "
                     "ON g.group_id = t.group_id WHERE t.task_id = ?", (task_id,)).fetchone()
    if row is None:
        return (None, None, False)
    return (row[1], row[0], bool(row[2]))


def execution_split(db: sqlite3.Connection, execution_id: str) -> tuple[str | None, str | None, bool]:
    """``(split, group_id, quarantined)`` of an execution or derived view (SPEC §6.3).

    Every execution, request and derived record inherits its task group's split; nothing
    overrides it.  ``split`` is ``None`` while the task is unknown (no ExecutionOpened yet,
    task never registered, linked or named as lineage) or no split policy is in force;
    ``group_id`` is ``None`` when the task has no group.  ``quarantined`` is true while
    the group is quarantined (ambiguous lineage or a pending similarity candidate that
    straddles splits): such records belong in no manifest.  A derived view whose parents
    resolve to different groups answers with the most protected of their splits and
    ``quarantined=True``.  Returns ``(None, None, False)`` when the ``splits`` projection's
    tables are absent from ``db``.
    """
    try:
        tasks = execution_task_ids(db, execution_id)
    except sqlite3.OperationalError:  # the splits projection is not part of this database
        return (None, None, False)
    if not tasks:
        return (None, None, False)
    answers = [task_split(db, t) for t in sorted(tasks)]
    if len(answers) == 1:
        return answers[0]
    groups = sorted({a[1] for a in answers if a[1] is not None})
    splits = [a[0] for a in answers]
    if any(s is None for s in splits) or not groups:
        return (None, groups[0] if groups else None, True)
    return (most_protected(s for s in splits if s is not None), groups[0], True)


def current_split_policy(db: sqlite3.Connection) -> dict | None:
    """The split policy in force (head of the primary supersedes chain), for manifests' datasheets.

    ``{"policy_id", "fractions", "salt", "supersedes", "chain": [...], "conflicts": [...],
    "pending": [...]}`` or ``None`` when no policy is in force.
    """
    if not split_tables_present(db):
        return None
    rows = db.execute("SELECT policy_id, fractions, salt, supersedes, status, strata, group_by FROM split_policies "
                      "ORDER BY policy_id, event_id").fetchall()
    head = [r for r in rows if r[4] == "in_force"]
    if not head:
        return None
    pid, fr, salt, sup, _, strata, group_by = head[0]
    chain: list[str] = [pid]
    by_id = {r[0]: r for r in rows if r[4] in ("in_force", "superseded")}
    cur = sup
    while cur is not None and cur in by_id and cur not in chain:
        chain.insert(0, cur)
        cur = by_id[cur][3]
    out = {"policy_id": pid, "fractions": json.loads(fr), "salt": salt, "supersedes": sup, "chain": chain,
           "conflicts": sorted({r[0] for r in rows if r[4] == "conflict"}),
           "pending": sorted({r[0] for r in rows if r[4] == "pending"})}
    # the options only when declared: a policy without them reads exactly as before (datasheets)
    out.update({k: v for k, v in (("strata", strata), ("group_by", group_by)) if v is not None})
    return out

