"""Lineage, use permissions and withdrawal (SPEC §6.4, §4.3; seed 002 §15.9).

Covers: the pure permission rules (deny by default, revocation beats grant, supersedes),
order independence (every permutation of a permission set; every interleaving of two
partitions through the projection), the seed's redaction scenario
(``trace_r19_01_redacted_v1``) end to end, withdrawal of a source after a manifest exists
(`ledger impact`), revoke-then-regrant, `ledger withdraw`, and forged or unsigned
governance written straight to the log (embedded and Kafka).
"""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.permissions import decide, effective, resolve
from ledger.algorithms.tokens import unpack_tokens
from ledger.cli import main as cli
from ledger.corpus import manifest as M
from ledger.corpus.integrity import audit
from ledger.events.codec import default_codec
from ledger.events.signing import load_private_key, new_private_key, sign_line
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.log.base import LogRecord
from ledger.log.paths import store_paths
from ledger.producers.ingest import Ingestor, submission
from ledger.projections.assessment import AssessmentProjection, execution_score
from ledger.projections.engine import Applied, ReplayEngine, canonical_dump, connect
from ledger.projections.governance import (
    GovernanceProjection,
    covering_subjects,
    derived_requests,
    derived_views,
    erased,
    execution_task,
    impact,
    lineage_chain,
    lineage_of,
    permitted,
    view_state,
    withdrawals_covering,
    withdrawn,
)
from ledger.projections.manifests import ManifestsProjection

from .helpers import Signer, closed, numbered, opened, request
from .r19_trace import PLACEHOLDER, R19_PATH, R19_REQUESTS
from .r19_trace import redact as _redact

GOV_TABLES = ("gov_tasks", "gov_executions", "lineage", "lineage_replacements", "revalidations", "permission_events",
              "permission_status", "withdrawals", "withdrawn_executions", "sealed_keys")


# ============================================================================ helpers
def perm(subject: str, use: str, action: str, event_id: str | None = None, supersedes: str | None = None,
         authority: str = "legal") -> dict:
    line = {"type": "permission", "subject": subject, "use": use, "action": action, "authority": authority}
    if supersedes:
        line["supersedes"] = supersedes
    if event_id:
        line["event_id"] = event_id
    return line


def withdrawal(subject: str, reason: str = "provider revoked consent", erase: bool = False) -> dict:
    line = {"type": "withdrawal", "subject": subject, "reason": reason, "authority": "data-governance"}
    if erase:
        line["erase"] = True
    return line


def task(tid: str, source: str | None) -> dict:
    line = {"type": "task_registered", "task_id": tid, "family": "repair"}
    if source:
        line["source"] = source
    return line


def gov_dump(db: sqlite3.Connection) -> str:
    out = []
    for t in GOV_TABLES:
        rows = db.execute(f"SELECT * FROM {t}").fetchall()
        out.append(t + ":" + "\n".join(sorted(repr(r) for r in rows)))
    return "\n".join(out)


class Store:
    """An embedded log + trusted signer + an engine over the given projections."""

    def __init__(self, tmp: Path, projections=None, url: str | None = None) -> None:
        self.signer = Signer()
        self.log = open_log(url or str(tmp / "store"), create=True)
        self.db = connect(tmp / "p.db")
        self.engine = ReplayEngine(self.log, self.db, projections or [GovernanceProjection()], trust=self.signer.trust)

    def ingest(self, lines: list[dict]) -> None:
        signed = [self.signer.sign(l) if l["type"] in ("permission", "withdrawal", "manifest_published") else l
                  for l in lines]
        rep = Ingestor(self.log, self.signer.trust).ingest_lines(numbered(signed))
        assert not rep.conflicts, rep.conflicts
        self.engine.run()


# ============================================================================ pure rules
def E(eid, subject, use, action, supersedes=None):
    return {"event_id": eid, "subject": subject, "use": use, "action": action, "supersedes": supersedes}


def test_deny_by_default_and_grant_through_any_covering_subject():
    subjects = ["execution:e1", "task:t1", "source:acme", "*"]
    assert decide(resolve([]), subjects, "sft") == ("fail", "no grant covers sft for execution:e1, task:t1, source:acme, * "
                                                            "(deny by default)")
    for subj in subjects:
        verdict, reason = decide(resolve([E("g", subj, "sft", "grant")]), subjects, "sft")
        assert verdict == "pass" and subj in reason
    assert decide(resolve([E("g", "*", "*", "grant")]), subjects, "rl")[0] == "pass"
    assert decide(resolve([E("g", "source:other", "sft", "grant")]), subjects, "sft")[0] == "fail"
    assert decide(resolve([E("g", "source:acme", "rl", "grant")]), subjects, "sft")[0] == "fail"
    with pytest.raises(ValueError, match="unknown use"):
        decide([], subjects, "cooking")


def test_revocation_beats_grant_and_only_a_naming_grant_lifts_it():
    subjects = ["execution:e1", "task:t1", "source:acme", "*"]
    g = E("g1", "execution:e1", "sft", "grant")  # most specific grant
    r = E("r1", "source:acme", "sft", "revoke")  # broader revocation still wins
    assert decide(resolve([g, r]), subjects, "sft")[0] == "fail"
    assert decide(resolve([g, E("r*", "*", "*", "revoke")]), subjects, "sft")[0] == "fail"
    # a plain new grant does not lift it; naming another id does not either
    assert decide(resolve([g, r, E("g2", "source:acme", "sft", "grant")]), subjects, "sft")[0] == "fail"
    assert decide(resolve([g, r, E("g3", "source:acme", "sft", "grant", supersedes="g1")]), subjects, "sft")[0] == "fail"
    # a grant of a different subject naming it lifts nothing
    assert decide(resolve([g, r, E("g4", "task:t1", "sft", "grant", supersedes="r1")]), subjects, "sft")[0] == "fail"
    lifted = resolve([g, r, E("g5", "source:acme", "sft", "grant", supersedes="r1")])
    assert decide(lifted, subjects, "sft")[0] == "pass"
    assert next(e for e in lifted if e.event_id == "r1").status == "lifted"
    # a '*' grant may lift an 'sft' revocation of the same subject; an 'rl' grant may not
    assert decide(resolve([r, E("g6", "source:acme", "*", "grant", supersedes="r1")]), subjects, "sft")[0] == "pass"
    assert decide(resolve([g, r, E("g7", "source:acme", "rl", "grant", supersedes="r1")]), subjects, "sft")[0] == "fail"
    # a new revocation (another id) denies again until a grant names it
    again = [g, r, E("g5", "source:acme", "sft", "grant", supersedes="r1"), E("r2", "source:acme", "sft", "revoke")]
    assert decide(resolve(again), subjects, "sft")[0] == "fail"
    # a route for every use is denied by the revocation of any use and needs a '*' grant
    assert decide(resolve([E("g", "*", "*", "grant"), E("r", "task:t1", "rl", "revoke")]), subjects, "*")[0] == "fail"
    assert decide(resolve([E("g", "*", "sft", "grant")]), subjects, "*")[0] == "fail"


_SUBJECTS = ["execution:e1", "execution:e2", "task:t1", "source:acme", "*"]
_USES = ["sft", "rl", "*"]


@st.composite
def permission_sets(draw):
    n = draw(st.integers(1, 12))
    events = []
    for i in range(n):
        action = draw(st.sampled_from(["grant", "revoke"]))
        sup = None
        if action == "grant" and i and draw(st.booleans()):
            sup = f"p{draw(st.integers(0, n))}"  # may name a revocation, a grant, itself or nothing yet
        events.append(E(f"p{i}", draw(st.sampled_from(_SUBJECTS)), draw(st.sampled_from(_USES)), action, sup))
    return events


@settings(max_examples=150, deadline=None)
@given(permission_sets(), st.randoms(use_true_random=False))
def test_effective_permissions_are_the_same_for_every_permutation(events, rnd):
    ref_resolved, ref_effective = resolve(events), effective(events)
    subjects = ["execution:e1", "task:t1", "source:acme", "*"]
    ref = {u: decide(ref_resolved, subjects, u) for u in ("sft", "rl", "*")}
    for _ in range(6):
        perm_ = list(events)
        rnd.shuffle(perm_)
        assert resolve(perm_) == ref_resolved
        assert effective(perm_) == ref_effective
        assert {u: decide(resolve(perm_), subjects, u) for u in ("sft", "rl", "*")} == ref


# ============================================================================ convergence
def _v(line: dict, n: int) -> dict:
    ev = validate_line(line, line=n, now_micros=1_700_000_000_000_000 + n)
    if line["type"] in ("permission", "withdrawal"):  # the engine verified signatures before projections
        ev["signature"], ev["signed_body"] = None, None
    return ev


def _partitions(seed: int) -> tuple[list[dict], list[dict]]:
    """An executions partition and a governance partition with cross-partition dependencies."""
    rng = random.Random(seed)
    ex_lines, gov_lines = [], []
    for i in range(6):
        ex_lines.append(opened(f"e{i}", f"t{i % 3}"))
        ex_lines.append(request(f"e{i}", "r1", [1, 2, 3], [4]))
    for t in range(3):
        gov_lines.append(task(f"t{t}", f"src{t % 2}"))
    gov_lines.append({"type": "record_derived", "derived_execution_id": "e0v", "parent_execution_id": "e0",
                      "transformation": "redact@1", "replacements": {"r1": {"output_ids": [9]}}})
    gov_lines.append({"type": "record_derived", "derived_execution_id": "e0vv", "parent_execution_id": "e0v",
                      "transformation": "redact@2"})
    gov_lines.append({"type": "revalidated", "derived_execution_id": "e0v", "verdict": "pass", "reward": 0.25})
    subjects = ["source:src0", "source:src1", "task:t1", "execution:e3", "execution:e0v", "*"]
    rev_ids = []
    for k in range(8):
        action = rng.choice(["grant", "grant", "revoke"])
        eid = f"perm-{k}"
        sup = rng.choice(rev_ids) if action == "grant" and rev_ids and rng.random() < 0.5 else None
        gov_lines.append(perm(rng.choice(subjects), rng.choice(["sft", "rl", "*"]), action, eid, sup))
        if action == "revoke":
            rev_ids.append(eid)
    gov_lines.append(withdrawal(rng.choice(["source:src1", "task:t2", "execution:e0"]), erase=rng.random() < 0.5))
    return ([_v(l, n) for n, l in enumerate(ex_lines)], [_v(l, 100 + n) for n, l in enumerate(gov_lines)])


def _replay(ex_events, gov_events, order: list[bool], cuts: set[int]) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    proj = GovernanceProjection()
    proj.create(db)
    offsets = {"executions": 0, "governance": 0}
    queues = {"executions": list(ex_events), "governance": list(gov_events)}
    for step, take_gov in enumerate(order):
        stream = "governance" if take_gov else "executions"
        ev = queues[stream].pop(0)
        rec = LogRecord(stream, 0, offsets[stream], "", ev["event_id"], ev["event_type"], b"", b"")
        offsets[stream] += 1
        proj.apply(db, Applied(ev, rec))
        if step in cuts:
            proj.finish(db)
    proj.finish(db)
    return db


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3), st.randoms(use_true_random=False))
def test_every_interleaving_of_two_partitions_converges(seed, rnd):
    ex_events, gov_events = _partitions(seed)
    reference = _replay(ex_events, gov_events, [False] * len(ex_events) + [True] * len(gov_events), set())
    ref_dump = gov_dump(reference)
    ids = [f"e{i}" for i in range(6)] + ["e0v", "e0vv"]
    ref_answers = {(e, u): permitted(reference, e, u) for e in ids for u in ("sft", "rl")}
    ref_answers.update({e: (withdrawn(reference, e), erased(reference, e), view_state(reference, e)) for e in ids})
    for e in ids:  # the bulk-maintained table agrees with the per-execution query
        assert {r[0] for r in reference.execute("SELECT withdrawal_event_id FROM withdrawn_executions WHERE execution_id = ?",
                                                (e,))} == {w["event_id"] for w in withdrawals_covering(reference, e)}
    for _ in range(4):
        order = [True] * len(gov_events) + [False] * len(ex_events)
        rnd.shuffle(order)
        n = len(order)
        cuts = {rnd.randrange(n) for _ in range(rnd.randrange(4))}
        db = _replay(ex_events, gov_events, order, cuts)
        assert gov_dump(db) == ref_dump
        answers = {(e, u): permitted(db, e, u) for e in ids for u in ("sft", "rl")}
        answers.update({e: (withdrawn(db, e), erased(db, e), view_state(db, e)) for e in ids})
        assert answers == ref_answers


# ============================================================================ seed scenario
def r19_lines() -> list[dict]:
    """trace_r19_01 (seed 002 §15.6.2 / §15.9 / §15.10): refused edit e2, schema query e3,
    corrected edit e4, test summary e5, final summary e6; the prompt and observations carry
    a private path that redaction replaces (token data: tests/r19_trace.py)."""
    ex = "trace_r19_01"
    return [
        task("repair_schema_t1", "repo_acme"),
        opened(ex, "repair_schema_t1", collection_run_id="collection_run_r19_01", origin="production"),
        *(request(ex, rid, inp, out) if gen == "policy" else
          request(ex, rid, inp, out, generator=gen, output_logprobs=None) for rid, (inp, out, gen) in R19_REQUESTS.items()),
        closed(ex, versions=("ws_r19", "ws_r20")),
        {"type": "assessment", "assessment_id": "repair_accept_v1", "execution_id": ex, "artifact_version": "ws_r20",
         "outcome": "scored", "reward": 1.0, "evaluator": "repair_accept@1"},
        perm("source:repo_acme", "sft", "grant"),
    ]


def requests_of(log, execution_id: str) -> list[dict]:
    """The execution's requests as recorded, opened with the store's data keys (ingest seals by default)."""
    from ledger.log.sealing import StoreKeyStore, store_keys_path, unseal

    codec, keys = default_codec(), StoreKeyStore(store_keys_path(log.url))
    out = [ev if ev.get("sealed") is None else unseal(ev, keys)
           for where in log.partitions() for rec in log.read(where) if rec.event_type == "request"
           for ev in [codec.decode(rec.value)] if ev["execution_id"] == execution_id]
    keys.close()
    return out


def test_seed_redaction_scenario_trace_r19_01_redacted_v1(tmp_path):
    from ledger.projections.tree import TreeProjection

    s = Store(tmp_path, [TreeProjection(), GovernanceProjection(), AssessmentProjection()])
    lines = r19_lines()
    s.ingest(lines)
    parent, view = "trace_r19_01", "trace_r19_01_redacted_v1"
    reqs = {l["request_id"]: l for l in lines if l["type"] == "request"}
    replacements = {rid: {"input_ids": _redact(r["input_ids"])} for rid, r in reqs.items() if rid != "e1"}
    replacements["e1"] = {"input_ids": _redact(reqs["e1"]["input_ids"])}
    replacements["e3"]["output_ids"] = _redact(reqs["e3"]["output_ids"])
    s.ingest([{"type": "record_derived", "derived_execution_id": view, "parent_execution_id": parent,
               "transformation": "path_redaction@v1", "replacements": replacements,
               "withheld_fields": ["observation.private_path"]}])

    # a new identity, a parent reference and a reverse reference on the parent
    assert lineage_of(s.db, view)["parent_execution_id"] == parent
    assert lineage_of(s.db, view)["withheld_fields"] == ["observation.private_path"]
    assert derived_views(s.db, parent) == [view] and lineage_chain(s.db, view) == [view, parent]
    assert s.db.execute("SELECT derived_execution_id, parent_execution_id, transformation FROM lineage").fetchall() == [
        (view, parent, "path_redaction@v1")]
    # same task (hence task group and split) and the parent's permissions
    assert execution_task(s.db, view) == "repair_schema_t1"
    assert covering_subjects(s.db, view) == [f"execution:{view}", f"execution:{parent}", "task:repair_schema_t1",
                                             "source:repo_acme", "*"]
    assert permitted(s.db, view, "sft")[0] == "pass"
    verdict, reason = permitted(s.db, view, "publication")
    assert verdict == "fail" and reason.startswith("no grant covers publication")
    # the parent's pass does not carry over: pending until Revalidated
    assert view_state(s.db, parent)["reward"] == 1.0
    st_ = view_state(s.db, view)
    assert (st_["parent"], st_["revalidated"], st_["reward"]) == (parent, None, None)
    assert execution_score(s.db, view).state == "pending"

    # the view's own requests: redacted tokens, no private path left, replaced outputs are context only
    vreqs = derived_requests(s.db, view, requests_of(s.log, parent))
    assert [r["request_id"] for r in vreqs] == ["e1", "e2", "e3", "e4", "e5", "e6"]
    for r in vreqs:
        toks = unpack_tokens(r["input_ids"]).tolist() + unpack_tokens(r["output_ids"]).tolist()
        assert r["execution_id"] == view and r["input_prefix"] is None
        assert not any(toks[i:i + 3] == R19_PATH for i in range(len(toks)))
    e3 = next(r for r in vreqs if r["request_id"] == "e3")
    assert unpack_tokens(e3["output_ids"]).tolist() == [50] + PLACEHOLDER
    assert e3["reconstructed"] and e3["output_logprobs"] is None
    e4 = next(r for r in vreqs if r["request_id"] == "e4")
    assert not e4["reconstructed"] and unpack_tokens(e4["output_ids"]).tolist() == [60, 61]

    # revalidation: pass carries the parent's valid reward over; a failed view stays out
    s.ingest([{"type": "revalidated", "derived_execution_id": view, "verdict": "pass",
               "evidence": {"review": "schema inspection still justified"}},
              {"type": "record_derived", "derived_execution_id": f"{view}_bad", "parent_execution_id": parent,
               "transformation": "path_redaction@v0", "replacements": {"e3": {"output_ids": [50]}}},
              {"type": "revalidated", "derived_execution_id": f"{view}_bad", "verdict": "fail",
               "evidence": {"review": "file names the agent needed were stripped"}}])
    st_ = view_state(s.db, view)
    assert (st_["revalidated"], st_["reward"]) == ("pass", 1.0)
    assert execution_score(s.db, view).state == "scored" and execution_score(s.db, view).reward == 1.0
    bad = view_state(s.db, f"{view}_bad")
    assert (bad["revalidated"], bad["reward"]) == ("fail", None)
    assert execution_score(s.db, f"{view}_bad").state == "excluded"

    # a withdrawal of the source reaches the raw trace and both views
    assert not withdrawn(s.db, view)
    s.ingest([withdrawal("source:repo_acme")])
    assert withdrawn(s.db, parent) and withdrawn(s.db, view) and withdrawn(s.db, f"{view}_bad")
    assert not erased(s.db, view)
    rep = impact(s.db, "source:repo_acme")
    assert rep["executions"] == [parent] and rep["derived_views"] == [view, f"{view}_bad"]
    assert rep["tasks"] == ["repair_schema_t1"] and rep["note"] == "no manifests published"

    # rebuild from the log: byte-identical tables
    before = canonical_dump(s.db)
    s.engine.rebuild()
    s.engine.run()
    assert canonical_dump(s.db) == before


# ============================================================================ permissions end to end
def test_permission_revoked_then_regranted_with_supersedes(tmp_path):
    s = Store(tmp_path)
    s.ingest([task("t1", "acme"), opened("e1", "t1"), perm("source:acme", "sft", "grant")])
    assert permitted(s.db, "e1", "sft")[0] == "pass"
    s.ingest([perm("task:t1", "sft", "revoke", event_id="rev-1")])
    verdict, reason = permitted(s.db, "e1", "sft")
    assert verdict == "fail" and "revoked on task:t1 by rev-1" in reason
    s.ingest([perm("task:t1", "sft", "grant", event_id="plain-regrant")])  # does not name the revocation
    assert permitted(s.db, "e1", "sft")[0] == "fail"
    s.ingest([perm("task:t1", "sft", "grant", event_id="regrant", supersedes="rev-1")])
    assert permitted(s.db, "e1", "sft")[0] == "pass"
    assert s.db.execute("SELECT status, note FROM permission_status WHERE event_id = 'rev-1'").fetchone() == (
        "lifted", "lifted by grant regrant")
    assert permitted(s.db, "e1", "rl")[0] == "fail"  # other uses still denied by default


def test_regrant_arriving_before_the_revocation_it_names_gives_the_same_state(tmp_path):
    a = Store(tmp_path / "a")
    b = Store(tmp_path / "b")
    base = [task("t1", "acme"), opened("e1", "t1"), perm("source:acme", "sft", "grant")]
    rev, regrant = perm("task:t1", "sft", "revoke", event_id="rev-1"), perm("task:t1", "sft", "grant", "g", "rev-1")
    a.ingest(base + [rev])
    a.ingest([regrant])
    b.ingest(base + [regrant])
    assert permitted(b.db, "e1", "sft")[0] == "pass"  # names an id not on the log yet: lifts nothing, still a grant
    b.ingest([rev])
    assert permitted(a.db, "e1", "sft") == permitted(b.db, "e1", "sft")
    assert permitted(a.db, "e1", "sft")[0] == "pass"
    assert a.db.execute("SELECT * FROM permission_status ORDER BY event_id").fetchall() == \
        b.db.execute("SELECT * FROM permission_status ORDER BY event_id").fetchall()


# ============================================================================ withdrawal + manifests
def _manifest_records(route: str, members: list[tuple[str, str]]) -> list[dict]:
    out = []
    for ex, leaf in members:
        rec = {"member_id": f"{route}/{ex}/{leaf}", "execution_id": ex, "task_id": "t", "group_id": "t", "split": "train",
               "route": route, "leaf_request_id": leaf, "role_class": "main/task", "input_ids": [1, 2, 3],
               "target_mask": [0, 1, 1], "behavior_logprobs": [None, -0.5, -0.5], "loss_weight": 0.5,
               "execution_target_tokens": 2, "reward": 1.0, "dummy": False}
        rec["digest"] = M.member_digest(rec)
        out.append(rec)
    return out


def _world() -> list[dict]:
    return [task("ta", "acme"), task("tb", "beta"), opened("ea1", "ta"), opened("ea2", "ta"), opened("eb1", "tb"),
            {"type": "record_derived", "derived_execution_id": "ea1v", "parent_execution_id": "ea1",
             "transformation": "redact@1"},
            perm("*", "sft", "grant")]


def test_withdrawal_of_a_source_after_a_published_manifest(tmp_path):
    s = Store(tmp_path, [GovernanceProjection(), ManifestsProjection()])
    s.ingest(_world())
    doc = M.sign_manifest(M.build_manifest(_manifest_records("sft", [("ea1", "r1"), ("ea1v", "r1"), ("eb1", "r1")]),
                                           route="sft", version=1, route_version=1, log_position=7), s.signer.key)
    s.ingest([{"type": "manifest_published", "route": "sft", "version": 1, "route_version": 1,
               "root": doc["merkle"]["root"], "size": doc["merkle"]["size"], "log_position": 7,
               "manifest_sha256": M.document_sha256(doc)}])
    docs = {("sft", 1): doc}
    s.ingest([withdrawal("source:acme", "provider revoked training permission")])
    assert [withdrawn(s.db, e) for e in ("ea1", "ea2", "ea1v", "eb1")] == [True, True, True, False]
    assert permitted(s.db, "eb1", "sft")[0] == "pass"
    rep = impact(s.db, "source:acme", lambda row: docs.get((row["route"], row["version"])))
    assert rep["withdrawn"] and rep["tasks"] == ["ta"]
    assert rep["executions"] == ["ea1", "ea2"] and rep["derived_views"] == ["ea1v"]
    assert rep["manifests"] == [{"route": "sft", "version": 1, "members": [
        {"member_id": "sft/ea1/r1", "execution_id": "ea1"}, {"member_id": "sft/ea1v/r1", "execution_id": "ea1v"}]}]
    assert rep["members"] == 2 and "note" not in rep
    # the log authenticates the archive: a doctored document is not trusted
    forged = dict(doc, members=[m for m in doc["members"] if m["execution_id"] != "ea1"])
    rep2 = impact(s.db, "source:acme", lambda row: forged)
    assert rep2["manifests"] == [] and rep2["unverifiable_manifests"][0]["why"].startswith("archived document does not")
    rep3 = impact(s.db, "source:acme")
    assert rep3["unverifiable_manifests"][0]["why"].startswith("manifest document not available")
    # an execution-level subject touches only itself and its views
    rep4 = impact(s.db, "execution:ea1", lambda row: docs.get((row["route"], row["version"])))
    assert rep4["executions"] == ["ea1"] and rep4["derived_views"] == ["ea1v"] and rep4["members"] == 2


def test_withdrawal_covers_views_derived_before_their_parent_is_known(tmp_path):
    s = Store(tmp_path)
    s.ingest([withdrawal("task:tx")])
    s.ingest([task("tx", "s"), opened("x1", "tx"),
              {"type": "record_derived", "derived_execution_id": "v1", "parent_execution_id": "x1", "transformation": "t"},
              {"type": "record_derived", "derived_execution_id": "v2", "parent_execution_id": "v1", "transformation": "t"}])
    assert [withdrawn(s.db, e) for e in ("x1", "v1", "v2")] == [True, True, True]
    assert s.db.execute("SELECT execution_id FROM withdrawn_executions ORDER BY 1").fetchall() == [("v1",), ("v2",), ("x1",)]


# ============================================================================ CLI
@pytest.fixture()
def cli_store(tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.setenv("LEDGER_STORE", str(store))
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", str(tmp_path / "gov.key"), "--may-sign", "withdrawal,permission"]) == 0
    key = load_private_key(tmp_path / "gov.key")
    lines = [sign_line(l, key) if l["type"] == "permission" else l for l in _world()]
    (tmp_path / "world.jsonl").write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    assert cli(["ingest", str(tmp_path / "world.jsonl")]) == 0
    return tmp_path


def test_cli_withdraw_and_impact(cli_store, capsys):
    tmp = cli_store
    capsys.readouterr()
    assert cli(["impact", "source:acme"]) == 0
    out = capsys.readouterr().out
    assert "(not withdrawn)" in out and "executions (2): ea1, ea2" in out and "derived views (1): ea1v" in out
    assert "no manifests published" in out
    # another helper publishes manifests into manifest_members: impact lists the touched members
    db = sqlite3.connect(store_paths(str(tmp / "store")).db)
    db.execute("CREATE TABLE IF NOT EXISTS manifest_members (route TEXT, version INTEGER, member_id TEXT, execution_id TEXT)")
    db.executemany("INSERT INTO manifest_members VALUES (?,?,?,?)",
                   [("sft", 1, "sft/ea1/r1", "ea1"), ("sft", 1, "sft/eb1/r1", "eb1"), ("sft", 2, "sft/ea1v/r2", "ea1v")])
    db.commit()
    db.close()
    assert cli(["withdraw", "source:acme", "--reason", "license withdrawn", "--key", str(tmp / "gov.key"),
                "--authority", "legal@acme"]) == 0
    out = capsys.readouterr().out
    assert "withdrawal withdrawal/source:acme appended" in out and "(withdrawn)" in out
    assert "sft v1: 1 members" in out and "sft v2: 1 members" in out and "sft/ea1v/r2 (execution ea1v)" in out
    assert cli(["impact", "source:acme", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["withdrawn"] and rep["withdrawals"][0]["authority"] == "legal@acme" and rep["members"] == 2
    # a retry is a duplicate (exit 0); different content for the same subject is a conflict (exit 1)
    assert cli(["withdraw", "source:acme", "--reason", "license withdrawn", "--key", str(tmp / "gov.key"),
                "--authority", "legal@acme"]) == 0
    assert "already on the log" in capsys.readouterr().out
    assert cli(["withdraw", "source:acme", "--reason", "other", "--key", str(tmp / "gov.key")]) == 1
    assert "conflict" in capsys.readouterr().out
    # bad input: exit 2
    assert cli(["withdraw", "acme", "--reason", "x", "--key", str(tmp / "gov.key")]) == 2
    assert cli(["impact", "nonsense"]) == 2
    # a key not allowed to sign withdrawals is refused at ingest (nothing appended)
    assert cli(["keys", "new", "--out", str(tmp / "perm.key"), "--may-sign", "permission"]) == 0
    assert cli(["withdraw", "task:tb", "--reason", "x", "--key", str(tmp / "perm.key")]) == 2
    assert "not allowed to sign withdrawal" in capsys.readouterr().err
    assert cli(["audit"]) == 0


# ============================================================================ forged governance
@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def log_url(request, tmp_path) -> str:
    if request.param == "kafka":
        return request.getfixturevalue("kafka_url")
    return str(tmp_path / "store")


def _raw(line: dict, signature: dict | None = None, body: str | None = None) -> dict:
    ev = validate_line({k: v for k, v in line.items() if k != "signature"}, line=1, now_micros=1_700_000_000_000_000)
    ev["signature"], ev["signed_body"] = signature, body
    return ev


def test_forged_and_unsigned_governance_on_the_log_is_ignored_and_audited(tmp_path, log_url):
    from ledger.events.signing import signing_body

    s = Store(tmp_path, [GovernanceProjection()], url=log_url)
    s.ingest([task("t1", "acme"), opened("e1", "t1"), opened("e2", "t1")])
    rogue = new_private_key()
    forged_line = sign_line(perm("*", "*", "grant", authority="rogue"), rogue)
    honest = s.signer.sign(perm("execution:e2", "sft", "grant"))
    tampered = _raw(honest, honest["signature"], signing_body(honest).decode())
    tampered["subject"] = "*"  # content changed after signing
    tampered["event_id"] = "tampered-1"
    bad = [
        _raw(perm("*", "*", "grant", authority="nobody")),  # unsigned grant
        _raw(withdrawal("source:acme")),  # unsigned withdrawal
        _raw(forged_line, forged_line["signature"], signing_body(forged_line).decode()),  # untrusted key
        _raw(sign_line(withdrawal("execution:e1"), rogue), sign_line(withdrawal("execution:e1"), rogue)["signature"],
             signing_body(withdrawal("execution:e1")).decode()),
        tampered,
    ]
    res = s.log.append([submission(ev, default_codec()) for ev in bad])  # bypassing ingest
    assert len(res.appended) == 5
    s.engine.run()
    assert permitted(s.db, "e1", "sft")[0] == "fail" and permitted(s.db, "e2", "sft")[0] == "fail"
    assert not withdrawn(s.db, "e1")
    assert s.db.execute("SELECT COUNT(*) FROM permission_events").fetchone()[0] == 0
    assert s.db.execute("SELECT COUNT(*) FROM withdrawals").fetchone()[0] == 0
    rejected = s.db.execute("SELECT event_type, projection, reason FROM _rejected ORDER BY event_type, reason").fetchall()
    assert len(rejected) == 5 and all(r[1] == "engine" for r in rejected)
    reasons = " | ".join(r[2] for r in rejected)
    assert "unsigned governance event" in reasons and "is not in the trust file" in reasons
    assert "signed body disagrees with the event on subject" in reasons
    rep = audit(s.log, s.signer.trust)
    assert not rep.ok and len(rep.problems) == 5
    # the honest event itself is accepted through ingest and takes effect
    s.ingest([perm("execution:e2", "sft", "grant")])
    assert permitted(s.db, "e2", "sft")[0] == "pass" and permitted(s.db, "e1", "sft")[0] == "fail"
    s.log.close()


def test_rebuild_is_byte_identical_with_all_registered_projections(tmp_path):
    from ledger.projections.registry import all_projections

    s = Store(tmp_path, all_projections())
    s.ingest(_world() + [withdrawal("task:tb", erase=True), perm("task:ta", "rl", "revoke", event_id="r"),
                         perm("task:ta", "rl", "grant", event_id="g", supersedes="r"),
                         {"type": "revalidated", "derived_execution_id": "ea1v", "verdict": "pass", "reward": 0.5}])
    assert any(p.name == "governance" for p in s.engine.projections)
    before = canonical_dump(s.db)
    s.engine.rebuild()
    s.engine.run()
    assert canonical_dump(s.db) == before
    assert erased(s.db, "eb1") and not erased(s.db, "ea1")
    assert view_state(s.db, "ea1v")["reward"] == 0.5
