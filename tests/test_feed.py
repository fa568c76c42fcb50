"""The online feed (SPEC §11.6): admitted members in admission order, groups, staleness, exactly-once per
consumer through acknowledged ``batch_consumed`` events, and which step trained which record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ledger
from ledger.corpus.export import trainer_records
from ledger.events.validate import ValidationError, validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.registry import open_engine

from .helpers import closed, opened, request, signed_store

ROOT = Path(__file__).resolve().parents[1]
T0 = "2026-01-01T00:00:00Z"


# ------------------------------------------------------------------ a store with a route
def governance(signer) -> list[dict]:
    lines = [{"type": "split_policy", "policy_id": "p1", "salt": "s", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}},
             {"type": "permission", "subject": "*", "use": "rl", "action": "grant", "authority": "legal"},
             {"type": "admission_policy", "route": "grpo", "version": 1, "use": "rl", "split": "train", "j_max": 2}]
    return [signer.sign(line) for line in lines]


def execution(ex: str, task: str = "t1", *, run: str = "run-1", pv: int | None = None, minutes: float = 1.0,
              reward: float = 1.0, assessed: bool = True) -> list[dict]:
    """An execution with two leaves (two members on a j_max=2 route), closed ``minutes`` after it opened."""
    extra = {"policy_version": pv} if pv is not None else {}
    closing = closed(ex)
    closing["occurred_at"] = (datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=minutes)).isoformat()
    lines = [{"type": "task_registered", "task_id": task}, opened(ex, task, collection_run_id=run, occurred_at=T0, **extra),
             request(ex, "r1", [1, 2, 3], [4, 5]), request(ex, "r2", [1, 2, 3, 4, 5, 6], [7, 8]),
             request(ex, "r3", [1, 2, 3, 9], [10, 11]), closing]
    return lines + (finish(ex, reward) if assessed else [])


def finish(ex: str, reward: float = 1.0) -> list[dict]:
    return [{"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1", "outcome": "scored",
             "reward": reward, "evaluator": "grader@1"}, {"type": "execution_finalized", "execution_id": ex}]


class Store:
    def __init__(self, root: Path, url: str | None = None) -> None:
        self.signer, self.paths, self.key = signed_store(root)
        if url is not None:  # Kafka: the trust file of the embedded store, the log on the broker
            from ledger.log.paths import store_paths

            self.paths = store_paths(url, db=str(root / "projections.db"), trust=str(self.paths.trust))
            open_log(url, create=True).close()
        self.log = open_log(self.paths.url)
        self.ingestor = Ingestor(self.log, self.signer.trust)
        self.append(governance(self.signer))

    def append(self, lines: list[dict]) -> None:
        report = self.ingestor.ingest_lines(list(enumerate(lines, 1)))
        assert not report.conflicts

    def admitted(self, route: str = "grpo") -> dict[str, str]:
        """member id -> digest of every record `ledger export` would write now."""
        db_path = self.paths.db.with_name(f"check-{time.monotonic_ns()}.db")
        engine = open_engine(self.log, db_path, self.signer.trust)
        engine.run()
        try:
            return {r["member_id"]: r["digest"] for r in trainer_records(engine.db, route)}
        finally:
            engine.db.close()

    def feed(self, consumer: str = "trainer", **kw) -> ledger.Feed:
        return ledger.Feed(self.paths, "grpo", consumer, trust=self.signer.trust, **kw)

    def close(self) -> None:
        self.log.close()


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.close()


def members(batch) -> list[str]:
    return [r["member_id"] for r in batch.records]


# ------------------------------------------------------------------ events and validation
def test_batch_consumed_validation_names_the_field():
    base = {"type": "batch_consumed", "consumer": "c", "route": "grpo", "step": 1,
            "members": [{"member_id": "grpo/e1/r1", "digest": "ab" * 32}]}
    ev = validate_line(base, now_micros=1)
    assert ev["event_id"] == "batch_consumed/c/1" and ev["disposition"] is None
    stale = validate_line({**base, "disposition": "stale"}, now_micros=1)
    assert stale["event_id"].startswith("batch_consumed/c/stale/")
    for bad, field, message in [({"members": []}, "members", "non-empty list"),
                                ({"members": [{"member_id": "m"}]}, "members", "members[0] needs exactly member_id and digest"),
                                ({"members": [{"member_id": "m", "digest": "XY"}]}, "members", "64 lowercase hex"),
                                ({"members": [base["members"][0]] * 2}, "members", "listed twice"),
                                ({"step": -1}, "step", ">= 0"), ({"disposition": "dropped"}, "disposition", "trained"),
                                ({"policy_version": "7"}, "policy_version", "integer")]:
        with pytest.raises(ValidationError) as exc:
            validate_line({**base, **bad}, line=3, now_micros=1)
        assert exc.value.field == field and message in str(exc.value) and str(exc.value).startswith("line 3")


def test_execution_opened_policy_version_is_optional_and_checked():
    line = opened("e1")
    assert validate_line(line, now_micros=1)["policy_version"] is None  # older lines stay valid
    assert validate_line({**line, "policy_version": 4}, now_micros=1)["policy_version"] == 4
    for bad in (-1, "4", 1.5, True):
        with pytest.raises(ValidationError) as exc:
            validate_line({**line, "policy_version": bad}, line=2, now_micros=1)
        assert exc.value.field == "policy_version"


def test_checkpoint_trained_may_name_consumer_steps():
    base = {"type": "checkpoint_trained", "checkpoint_id": "ck1"}
    ev = validate_line({**base, "consumer_steps": [{"consumer": "c", "step": 3}]}, now_micros=1)
    assert ev["manifests"] == [] and ev["consumer_steps"] == [{"consumer": "c", "step": 3}]
    with pytest.raises(ValidationError) as exc:
        validate_line(base, now_micros=1)
    assert exc.value.field == "manifests"
    with pytest.raises(ValidationError) as exc:
        validate_line({**base, "consumer_steps": [{"consumer": "c"}]}, now_micros=1)
    assert exc.value.field == "consumer_steps"


# ------------------------------------------------------------------ order, records, exactly once
def test_feed_yields_export_records_in_admission_order_and_resumes_after_the_last_ack(store):
    store.append(execution("e2"))
    store.append(execution("e1"))
    feed = store.feed()
    store.append(execution("e3"))
    got = list(feed.batches(follow=False))
    assert [b.executions for b in got] == [["e1"], ["e2"], ["e3"]]  # e1 and e2 closed at once: by id; then e3
    assert [members(b) for b in got][0] == ["grpo/e1/r2", "grpo/e1/r3"]
    admitted = store.admitted()
    assert {r["member_id"]: r["digest"] for b in got for r in b.records} == admitted  # exactly export's records
    assert feed.ack(got[0], step=1) == {"event_id": "batch_consumed/trainer/1", "appended": 1, "duplicates": 0}
    assert feed.ack(got[0], step=1)["duplicates"] == 1  # a retried ack
    with pytest.raises(ledger.FeedError, match="already acknowledged step 1"):
        feed.ack(got[1], step=1)
    rep = feed.report()
    assert rep["counts"] == {"trained": 2, "stale": 0, "delivered": 4, "held": 0, "waiting": 0, "pending": 0}
    feed.close()
    again = store.feed()  # a restart: the unacknowledged batches are delivered again, in order
    assert again.last_step == 1
    assert [b.executions for b in again.batches(follow=False)] == [["e2"], ["e3"]]
    with pytest.raises(ledger.FeedError, match="already being fed"):
        store.feed()
    again.close()


def test_dummies_come_whole_with_their_execution(store):
    store.append(execution("d1", reward=0.0, assessed=False) + [
        {"type": "assessment", "assessment_id": "a1", "execution_id": "d1", "artifact_version": "v1",
         "outcome": "not_assessable", "evaluator": "grader@1"}, {"type": "execution_finalized", "execution_id": "d1"}])
    with store.feed() as feed:
        (batch,) = list(feed.batches(follow=False))
    assert members(batch) == ["grpo/d1/dummy"] and batch.records[0]["dummy"] is True


# ------------------------------------------------------------------ groups
def test_task_groups_complete_or_marked_partial(store):
    store.append(execution("a1", "tA") + execution("b1", "tB") + execution("a2", "tA") + execution("c1", "tC", run="run-2"))
    with store.feed(group_by="task", group_size=2, group_timeout=0.3) as feed:
        first = feed.next_batch()
        assert first.executions == ["a1", "a2"] and first.partial is False
        assert first.group == {"by": "task", "split": "train", "task_id": "tA", "collection_run_ids": ["run-1"]}
        assert feed.next_batch() is None  # tB and tC wait for a second attempt
        assert feed.report()["counts"]["waiting"] == 4
        time.sleep(0.35)
        partial = [feed.next_batch(), feed.next_batch()]
        assert [(b.executions, b.partial) for b in partial] == [(["b1"], True), (["c1"], True)]
    with store.feed("whole-runs", group_by="task") as feed:  # without a size: every decided attempt of the task
        store.append(execution("a3", "tA", assessed=False))
        feed.refresh()
        assert [b.executions for b in feed.batches(follow=False)] == [["b1"], ["c1"]]  # tA waits for a3
        store.append(finish("a3"))
        feed.refresh()
        assert [b.executions for b in feed.batches(follow=False)] == [["a1", "a2", "a3"]]


def _age_queue(feed, seconds: float) -> None:
    """Pretend the feed observed its queued executions ``seconds`` earlier (a group timeout without the wait)."""
    feed.db.execute("UPDATE feed_queue SET observed_at = observed_at - ?", (seconds,))
    feed._queue = None
    feed.refresh()


def test_task_groups_fill_across_collection_runs(store):
    """SPEC 12.4: a group of N attempts of one task, wherever they were collected (four runs here); the
    group timeout is finite by default (300 s)."""
    store.append(execution("a1", "tA", run="run-1") + execution("b1", "tB", run="run-1")
                 + execution("a2", "tA", run="run-2") + execution("a3", "tA", run="run-3"))
    with store.feed(group_by="task", group_size=4) as feed:
        assert feed.group_timeout == ledger.corpus.feed.DEFAULT_GROUP_TIMEOUT == 300.0
        assert feed.next_batch() is None  # tA has three attempts, tB one
        store.append(execution("a4", "tA", run="run-4"))
        feed.refresh()
        batch = feed.next_batch()
        assert batch.executions == ["a1", "a2", "a3", "a4"] and batch.partial is False and len(batch.records) == 8
        assert batch.group == {"by": "task", "split": "train", "task_id": "tA",
                               "collection_run_ids": ["run-1", "run-2", "run-3", "run-4"]}
        assert feed.next_batch() is None
        _age_queue(feed, 299)
        assert feed.next_batch() is None  # tB waits out the default timeout...
        _age_queue(feed, 2)
        late = feed.next_batch()  # ...and is then yielded partial
        assert (late.executions, late.partial, late.group["collection_run_ids"]) == (["b1"], True, ["run-1"])
    with store.feed("no-timeout", group_by="task", group_size=4, group_timeout=None) as feed:
        _age_queue(feed, 10 ** 6)
        assert [b.executions for b in feed.batches(follow=False)] == [["a1", "a2", "a3", "a4"]]  # tB: never
    with pytest.raises(ledger.FeedError, match="group_timeout is a number of seconds"):
        store.feed("bad", group_by="task", group_timeout=-1)


def test_readme_corpus_task_groups_span_its_collection_runs(tmp_path, capsys):
    """The README's corpus: three tasks, two attempts each, every attempt in its own collection run.
    `--group-by task --group-size 2` fills three groups across runs (per run, none would ever fill);
    `--group-size 4` (docs/train.md's) cannot fill: the three tasks wait, then come partial."""
    from ledger.cli import main

    from .helpers import readme_store

    s = readme_store(tmp_path)
    with ledger.Feed(s, "rl-main", "pairs", group_by="task", group_size=2) as feed:
        got = list(feed.batches(follow=False))
    # observed in one catch-up, so in close order (the task closed last first); each group spans two runs
    assert sorted((b.group["task_id"], sorted(b.executions), b.partial, sorted(b.group["collection_run_ids"]))
                  for b in got) == [
        ("task-7-0000", ["exec-7-0000", "exec-7-0001"], False, ["run-internal-bugbash-16", "run-internal-bugbash-17"]),
        ("task-7-0001", ["exec-7-0002", "exec-7-0003"], False, ["run-curated-regressions-18", "run-curated-regressions-19"]),
        ("task-7-0002", ["exec-7-0004", "exec-7-0005"], False, ["run-internal-bugbash-20", "run-internal-bugbash-21"])]
    assert [len(b.records) for b in got] == [8, 8, 8]  # four paths per execution (j_max 4)
    with ledger.Feed(s, "rl-main", "fours", group_by="task", group_size=4) as feed:
        assert feed.next_batch() is None and feed.report()["counts"]["waiting"] == 24
        _age_queue(feed, 301)
        assert [(len(b.executions), b.partial) for b in feed.batches(follow=False)] == [(2, True)] * 3
    capsys.readouterr()
    assert main(["--store", s, "feed", "rl-main", "--consumer", "cli", "--group-by", "task", "--group-size", "2"]) == 0
    out = capsys.readouterr()
    headers = [json.loads(line) for line in out.err.splitlines()]
    assert [len(h["executions"]) for h in headers] == [2, 2, 2] and not any(h["partial"] for h in headers)
    assert len(out.out.splitlines()) == 24
    assert main(["--store", s, "feed", "rl-main", "--consumer", "cli2", "--group-by", "task", "--group-size", "4",
                 "--group-timeout", "0"]) == 0
    assert [json.loads(line)["partial"] for line in capsys.readouterr().err.splitlines()] == [True] * 3
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(SystemExit) as exc:
            main(["--store", s, "feed", "rl-main", "--consumer", "x", "--group-timeout", bad])
        assert exc.value.code == 2
    assert "is not a number of seconds >= 0 (or 'never')" in capsys.readouterr().err


# ------------------------------------------------------------------ staleness
def _versions(store):
    # policy versions 1..4; completion times 0.5, 10, 0.5, 30 minutes
    store.append(execution("v1", "slow", pv=1, minutes=10) + execution("v2", "fast", pv=2, minutes=0.5)
                 + execution("v3", "fast", pv=3, minutes=0.5) + execution("v4", "slow", pv=4, minutes=30))


def test_staleness_held_reported_and_yielded_oldest_first(store):
    _versions(store)
    with store.feed(max_staleness=1, policy_version=4) as feed:
        rep = feed.report()
        assert rep["counts"]["held"] == 4 and rep["counts"]["pending"] == 4  # v1, v2 are > 1 behind version 4
        assert rep["staleness"] == {"by_task": {"fast": {"held": 2}, "slow": {"held": 2}},
                                    "by_completion_time": {"5-15m": {"held": 2}, "<1m": {"held": 2}}}
        got = list(feed.batches(follow=False))
        # observed together: by close time (v2 and v3 after 30 s, v1 after 10 min, v4 after 30 min), nothing dropped
        assert [(b.executions, b.stale) for b in got] == [(["v2"], True), (["v3"], False), (["v1"], True), (["v4"], False)]
        feed.ack([got[0], got[2]], step=1)
        rep = feed.report()
        assert rep["staleness"]["by_task"] == {"fast": {"trained_stale": 2}, "slow": {"trained_stale": 2}}


def test_stale_disposition_is_on_the_log(store):
    _versions(store)
    with store.feed(max_staleness=1, policy_version=4, stale_policy="stale") as feed:
        got = list(feed.batches(follow=False))
        assert [b.executions for b in got] == [["v3"], ["v4"]]
    with store.feed() as feed:  # a restart without a bound: the stale decision held
        assert [b.executions for b in feed.batches(follow=False)] == [["v3"], ["v4"]]
        rep = feed.report()
        assert rep["counts"]["stale"] == 4
        assert rep["staleness"]["by_completion_time"] == {"5-15m": {"stale": 2}, "<1m": {"stale": 2}}
    rows = [r for r in store.log.read(("log", 0)) if r.event_type == "batch_consumed"]
    assert [r.event_id.startswith("batch_consumed/trainer/stale/") for r in rows] == [True, True]  # v2, then v1


# ------------------------------------------------------------------ provenance
def test_withdrawal_after_consumption_names_the_consumer_step(store):
    from ledger.corpus.withdraw import format_impact, impact_report

    store.append(execution("e1", "t1") + execution("e2", "t2"))
    with store.feed() as feed:
        b1, b2 = feed.batches(follow=False)
        feed.ack(b1, step=7, checkpoint_id="ck-7")
    store.append([store.signer.sign({"type": "checkpoint_trained", "checkpoint_id": "ck-9",
                                     "consumer_steps": [{"consumer": "trainer", "step": 9}]}),
                  store.signer.sign({"type": "withdrawal", "subject": "task:t1", "reason": "r", "authority": "legal"}),
                  store.signer.sign({"type": "withdrawal", "subject": "task:t2", "reason": "r", "authority": "legal"})])
    rep = impact_report(store.paths, "task:t1")
    assert rep["consumer_steps"] == [{"consumer": "trainer", "route": "grpo", "step": 7, "checkpoint_ids": ["ck-7", "ck-9"],
                                      "members": [{"member_id": "grpo/e1/r2", "execution_id": "e1"},
                                                  {"member_id": "grpo/e1/r3", "execution_id": "e1"}]}]
    assert "trainer step 7 on grpo: 2 members (checkpoints: ck-7, ck-9)" in format_impact(rep)
    assert impact_report(store.paths, "task:t2")["consumer_steps"] == []  # delivered, never acknowledged
    with store.feed() as feed:
        assert list(feed.batches(follow=False)) == []
        rep = feed.report()
        assert rep["withdrawn_executions"] == ["e2"] and rep["counts"]["trained"] == 2


def test_status_shows_consumer_lag(store):
    from ledger.reports.status import status

    store.append(execution("e1") + execution("e2"))
    with store.feed() as feed:
        feed.ack(next(iter(feed.batches(follow=False))), step=1)
    open_engine(store.log, store.paths.db, store.signer.trust).run()
    st = status(store.log, store.paths)
    assert st["consumers"] == {"trainer": {"route": "grpo", "last_step": 1, "admitted": 4, "consumed": 2, "lag": 2}}


# ------------------------------------------------------------------ a consumer process killed mid-training
CONSUMER = """
import json, os, sys, time
import ledger
from ledger.log.paths import store_paths
url, db, out, idle = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
paths = store_paths(url, db=db, trust=sys.argv[5])
feed = ledger.Feed(paths, "grpo", "trainer", poll_interval=0.02)
with open(out, "a") as fh:
    for batch in feed.batches(idle_timeout=idle):
        step = (feed.last_step or 0) + 1
        fh.write(json.dumps({"step": step, "members": [r["member_id"] for r in batch.records]}) + "\\n")
        fh.flush()
        os.fsync(fh.fileno())
        time.sleep(0.01)  # the training step
        feed.ack(batch, step=step)
"""


def _consumer(store: Store, out: Path, idle: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CONSUMER, store.paths.url, str(store.paths.db), str(out), str(idle),
                             str(store.paths.trust)], env=env, cwd=str(out.parent))


def _producer(store: Store, n: int, pause: float) -> threading.Thread:
    def run() -> None:
        for i in range(n):
            store.append(execution(f"e{i:03d}", f"t{i % 5}", pv=i // 4))
            time.sleep(pause)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_lines(path: Path, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"the consumer wrote fewer than {n} steps in {timeout} s")


def _trained(store: Store) -> dict[int, list[str]]:
    """step -> member ids of every trained batch_consumed on the log."""
    from ledger.events.codec import default_codec

    codec = default_codec()
    out = {}
    for where in store.log.partitions():
        for rec in store.log.read(where):
            if rec.event_type == "batch_consumed":
                ev = codec.decode(rec.value)
                assert ev["step"] not in out
                out[ev["step"]] = [m["member_id"] for m in ev["members"]]
    return out


def _exactly_once_across_a_kill(store: Store, tmp_path: Path, n: int, pause: float) -> None:
    out = tmp_path / "steps.jsonl"
    producer = _producer(store, n, pause)
    first = _consumer(store, out, idle=30)
    _wait_lines(out, 4)
    first.send_signal(signal.SIGKILL)  # mid-training: the step being trained may not be acknowledged
    first.wait(10)
    producer.join(60)
    second = _consumer(store, out, idle=5)  # generous under a loaded CI machine: it exits once idle that long
    assert second.wait(90) == 0
    trained = _trained(store)
    admitted = store.admitted()
    flat = [m for step in sorted(trained) for m in trained[step]]
    assert sorted(flat) == sorted(admitted) and len(flat) == len(set(flat))  # every admitted member exactly once
    assert sorted(trained) == list(range(1, len(trained) + 1))
    seen: dict[int, list[str]] = {}
    for line in out.read_text().splitlines():  # a step the kill interrupted is trained again under the same number
        rec = json.loads(line)
        seen[rec["step"]] = rec["members"]
    assert {s: sorted(m) for s, m in seen.items()} == {s: sorted(m) for s, m in trained.items()}


def test_every_admitted_member_exactly_once_across_a_sigkill(tmp_path, store):
    _exactly_once_across_a_kill(store, tmp_path, n=24, pause=0.03)


def test_feed_on_kafka(tmp_path, kafka_url):
    store = Store(tmp_path, kafka_url)
    try:
        _exactly_once_across_a_kill(store, tmp_path, n=10, pause=0.05)
        store.append([store.signer.sign({"type": "withdrawal", "subject": "task:t1", "reason": "r", "authority": "legal"})])
        from ledger.corpus.withdraw import impact_report

        steps = impact_report(store.paths, "task:t1")["consumer_steps"]
        assert sorted(m["execution_id"] for s in steps for m in s["members"]) == ["e001", "e001", "e006", "e006"]
    finally:
        store.close()


# A consumer killed after producing its acknowledgement and before committing the Kafka transaction.  Seen in
# CI (stop 36): the SIGKILL above landed there; the transaction stayed open for the broker's transaction timeout
# (60 s), holding every read_committed reader of its partition back, so the restarted consumer's own commits
# stayed unreadable, its projection kept saying "last step 3", it numbered the next batch 4 again and its
# acknowledgement conflicted with its own step 4.  Now the feed's log is an exclusive writer (its transactional
# id follows the consumer's name: opening it aborts what the dead process left open) and a feed counts its own
# acknowledgements until the projection shows them.
DIES_BEFORE_COMMIT = CONSUMER.replace("feed = ledger.Feed", """import ledger.log.kafka as kafka_log
_commit = kafka_log.KafkaLog._commit
def _dying_commit(self, producer):
    with open(out) as fh:
        if sum(1 for _ in fh) >= 4:  # the fourth step's acknowledgement: produced, never committed
            producer.flush(10)
            os.kill(os.getpid(), 9)
    return _commit(self, producer)
kafka_log.KafkaLog._commit = _dying_commit
feed = ledger.Feed""")


def test_feed_on_kafka_restarts_after_a_consumer_killed_inside_its_acknowledgement(tmp_path, kafka_url):
    store = Store(tmp_path, kafka_url)
    out = tmp_path / "steps.jsonl"
    try:
        producer = _producer(store, 8, 0.05)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        first = subprocess.Popen([sys.executable, "-c", DIES_BEFORE_COMMIT, store.paths.url, str(store.paths.db), str(out),
                                  "30", str(store.paths.trust)], env=env, cwd=str(out.parent))
        assert first.wait(90) == -signal.SIGKILL
        producer.join(60)
        second = _consumer(store, out, idle=5)
        assert second.wait(90) == 0  # was: FeedError "already acknowledged step 4 with other members"
        trained = _trained(store)  # readable now, not after the dead transaction's 60 s timeout
        flat = [m for step in sorted(trained) for m in trained[step]]
        assert sorted(flat) == sorted(store.admitted()) and len(flat) == len(set(flat))
        assert sorted(trained) == list(range(1, 9))
        seen = {}
        for line in out.read_text().splitlines():
            rec = json.loads(line)
            seen[rec["step"]] = rec["members"]
        assert seen == trained
    finally:
        store.close()


def test_feed_on_kafka_counts_its_own_acks_while_another_transaction_holds_readers_back(tmp_path, kafka_url):
    """Another producer's open transaction (a process killed mid-append, until the broker times it out) hides
    this feed's committed acknowledgements from its own projection: steps still count up and nothing is
    delivered twice."""
    from ledger.events.codec import default_codec

    store = Store(tmp_path, kafka_url)
    other = open_log(store.paths.url)
    try:
        store.append(execution("e1") + execution("e2") + execution("e3"))
        with store.feed() as feed:
            feed.ack(feed.next_batch(), step=1)
            step1 = next(r for where in store.log.partitions() for r in store.log.read(where)
                         if r.event_type == "batch_consumed")
            producer = other._producer_handle()  # an identical copy of step 1 in its partition: readers skip it
            producer.begin_transaction()
            producer.produce(other.executions_topic, key=step1.key.encode(), value=step1.value, partition=step1.partition)
            producer.flush(10)
            steps = []
            for batch in feed.batches(follow=False):
                steps.append((feed.last_step or 0) + 1)
                feed.ack(batch, step=steps[-1])  # was: FeedError at the second, numbered 2 again
            assert steps == [2, 3] and feed.last_step == 3
            producer.commit_transaction(10)
            feed.refresh()
            assert list(feed.batches(follow=False)) == [] and feed.last_step == 3
        codec, trained = default_codec(), {}
        for where in store.log.partitions():
            for rec in store.log.read(where):
                if rec.event_type == "batch_consumed":
                    ev = codec.decode(rec.value)
                    trained.setdefault(ev["step"], set()).update(m["member_id"].split("/")[1] for m in ev["members"])
        assert trained == {1: {"e1"}, 2: {"e2"}, 3: {"e3"}}
    finally:
        other.close()
        store.close()


# ------------------------------------------------------------------ any interleaving: yielded = admitted
def _producer_lines(signer) -> list[dict]:
    return (governance(signer) + execution("x1", "tA") + execution("x2", "tA", run="r2")
            + execution("x3", "tB", reward=0.0, assessed=False)
            + [{"type": "assessment", "assessment_id": "a1", "execution_id": "x3", "artifact_version": "v1",
                "outcome": "not_assessable", "evaluator": "grader@1"}]
            + execution("x4", "tC", assessed=False))  # never assessed: never admitted


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), cuts=st.lists(st.integers(1, 30), min_size=1, max_size=5),
       group_by=st.sampled_from(["execution", "task"]))
def test_any_interleaving_yields_the_admitted_set(tmp_path_factory, seed, cuts, group_by):
    import random

    from .helpers import interleave

    root = tmp_path_factory.mktemp("interleave")
    signer, paths, _key = signed_store(root)
    lines = interleave(_producer_lines(signer), random.Random(seed))
    with open_log(paths.url) as log:
        ingestor = Ingestor(log, signer.trust)
        feed = None
        yielded: list[str] = []
        step = start = 0
        for end in sorted({min(c, len(lines)) for c in cuts} | {len(lines)}):
            if end > start:
                ingestor.ingest_lines(list(enumerate(lines[start:end], 1)))
                start = end
            if feed is None:
                try:
                    feed = ledger.Feed(paths, "grpo", "t", group_by=group_by, group_timeout=0 if group_by == "task" else None,
                                       trust=signer.trust)
                except ledger.FeedError:  # the route is not on the log yet
                    continue
            feed.refresh()
            for batch in feed.batches(follow=False):
                step += 1
                feed.ack(batch, step=step)
                yielded += [r["member_id"] for r in batch.records]
        engine = open_engine(log, root / "check.db", signer.trust)
        engine.run()
        admitted = sorted(r["member_id"] for r in trainer_records(engine.db, "grpo"))
        engine.db.close()
        feed.close()
    assert sorted(yielded) == admitted == ["grpo/x1/r2", "grpo/x1/r3", "grpo/x2/r2", "grpo/x2/r3", "grpo/x3/dummy"]


# ------------------------------------------------------------------ the command line
def test_cli_feed_ack_and_report(store, tmp_path, capsys):
    from ledger.cli import main

    store.append(execution("e1") + execution("e2"))
    base = ["--store", store.paths.url, "feed"]
    assert main(base + ["grpo", "--consumer", "cli"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [json.loads(x)["member_id"] for x in lines] == ["grpo/e1/r2", "grpo/e1/r3", "grpo/e2/r2", "grpo/e2/r3"]
    headers = [json.loads(x) for x in err.splitlines()]
    assert [(h["executions"], h["acknowledged_step"]) for h in headers] == [(["e1"], None), (["e2"], None)]
    batch = tmp_path / "b1.jsonl"
    batch.write_text("\n".join(lines[:2]) + "\n")
    assert main(base + ["ack", "--consumer", "cli", "--step", "1", "--batch", str(batch)]) == 0
    assert main(base + ["ack", "--consumer", "cli", "--step", "1", "--batch", str(batch)]) == 0
    assert "already acknowledged (duplicate)" in capsys.readouterr().out
    other = tmp_path / "b2.jsonl"
    other.write_text("\n".join(lines[2:]) + "\n")
    assert main(base + ["ack", "--consumer", "cli", "--step", "1", "--batch", str(other)]) == 1
    assert "already acknowledged with other members" in capsys.readouterr().err
    tampered = json.loads(lines[2])
    tampered["reward"] = 0.5
    other.write_text(json.dumps(tampered) + "\n")
    assert main(base + ["ack", "--consumer", "cli", "--step", "2", "--batch", str(other)]) == 2
    assert "digest" in capsys.readouterr().err
    assert main(base + ["grpo", "--consumer", "cli", "--ack"]) == 0  # only e2 is left; acknowledged at step 2
    out, err = capsys.readouterr()
    assert [json.loads(x)["execution_id"] for x in out.splitlines()] == ["e2", "e2"]
    assert json.loads(err)["acknowledged_step"] == 2
    assert main(base + ["report", "grpo", "--consumer", "cli", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["last_step"] == 2 and rep["counts"]["trained"] == 4
    assert main(base + ["nosuch", "--consumer", "cli"]) == 2
    assert "no route 'nosuch'" in capsys.readouterr().err


# ------------------------------------------------------------------ the documented loop (docs/train.md)
def _readme_loop() -> str:
    text = (ROOT / "docs" / "train.md").read_text()
    section = text[text.index("## Train while you collect"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    return code[:code.index("```")]


def test_readme_async_rl_loop_runs(store, capsys):
    code = _readme_loop()
    assert len(code.strip().splitlines()) <= 16  # "a 15-line async RL loop" (and its import)
    trained: list[list[str]] = []
    producer = threading.Thread(target=lambda: [store.append(execution(f"r{i}", "tA" if i % 2 else "tB", pv=0))
                                                for i in range(8)], daemon=True)
    env = {"STORE": store.paths.url, "STEPS_PER_VERSION": 1, "IDLE": 1.5, "publish_weights": lambda v: None,
           "train_step": lambda records: trained.append([r["member_id"] for r in records]),
           "save_checkpoint": lambda step: f"ck-{step}"}
    producer.start()
    exec(compile(code, "docs/train.md", "exec"), env)
    producer.join()
    assert sorted(m for batch in trained for m in batch) == sorted(store.admitted())
    assert [len(batch) for batch in trained] == [8, 8]  # two tasks, 4 attempts of 2 paths each
    assert "'trained': 16" in capsys.readouterr().out
    assert sorted(_trained(store)) == [1, 2]


def test_leak_report_names_the_consumer_step_that_trained_a_held_out_record(store):
    from ledger.reports.splits_report import check

    store.append(execution("e1", "t1"))
    with store.feed() as feed:
        feed.ack(next(iter(feed.batches(follow=False))), step=3, checkpoint_id="ck-3")
    store.append([store.signer.sign({"type": "split_policy", "policy_id": "p2", "salt": "s", "supersedes": "p1",
                                     "fractions": {"train": 0.0, "dev": 0.0, "final_test": 1.0}})])
    engine = open_engine(store.log, store.paths.db, store.signer.trust)
    engine.run()
    leaks = [o for o in check(engine.db).offenders if o["kind"] == "consumed_leak"]
    assert [(o["subject"], o["consumer"], o["step"], o["checkpoint_ids"]) for o in leaks] == [
        ("grpo/e1/r2", "trainer", 3, ["ck-3"]), ("grpo/e1/r3", "trainer", 3, ["ck-3"])]
    assert "trained by consumer trainer at step 3 (grpo); execution e1 is now in final_test" in leaks[0]["detail"]


def test_cli_follow_stops_on_sigterm(store):
    store.append(execution("e1"))
    proc = subprocess.Popen([sys.executable, "-m", "ledger.cli", "--store", store.paths.url, "feed", "grpo", "--consumer",
                             "follower", "--follow", "--ack"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert json.loads(first)["member_id"] == "grpo/e1/r2"
    time.sleep(0.3)  # waiting for the next batch now
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()  # the first batch's other line (already buffered) and nothing more
    err = proc.stderr.read()
    assert proc.wait(20) == 0 and [json.loads(x)["member_id"] for x in rest.splitlines()] == ["grpo/e1/r3"]
    assert json.loads(err.splitlines()[0])["acknowledged_step"] == 1


def test_scale_out_merge_keeps_every_consumer_batch(kafka_url, tmp_path):
    """batch_consumed is partitioned by consumer: merged partition shards hold the union, equal to one replay."""
    from ledger.runtime.projector import catch_up_shard
    from ledger.projections.engine import connect
    from ledger.projections.shards import merge_shards

    store = Store(tmp_path, f"{kafka_url}&partitions=3")
    try:
        for i in range(4):
            store.append(execution(f"m{i}", f"t{i}"))
        for consumer in ("c1", "c2", "c3"):
            with store.feed(consumer) as feed:
                for step, batch in enumerate(feed.batches(follow=False), 1):
                    feed.ack(batch, step=step)
        for p in range(3):
            catch_up_shard(store.log, tmp_path / "shards", p, store.signer.trust)
        merge_shards(tmp_path / "shards", tmp_path / "merged.db")
        single = open_engine(store.log, tmp_path / "single.db", store.signer.trust)
        single.run()
        merged = connect(tmp_path / "merged.db")
        query = "SELECT consumer, step, member_id FROM consumed_members ORDER BY 1, 2, 3"
        assert merged.execute(query).fetchall() == single.db.execute(query).fetchall()
        assert len(merged.execute(query).fetchall()) == 3 * 8
    finally:
        store.close()


def test_an_erasure_leaves_no_decrypted_tokens_in_the_feed_database(store):
    from ledger.corpus.withdraw import withdraw

    store.append(execution("e1", "t1") + execution("e2", "t2"))
    with store.feed() as feed:
        first = next(iter(feed.batches(follow=False)))
        feed.ack(first, step=1)
        tokens = "SELECT COUNT(*) FROM tree_nodes WHERE execution_id = ?"
        assert feed.db.execute(tokens, ("e1",)).fetchone()[0] > 0
        withdraw(store.paths, "execution:e1", reason="consent revoked", key=store.key, erase=True)
        feed.refresh()
        assert feed.db.execute(tokens, ("e1",)).fetchone()[0] == 0  # rebuilt from the log: the key is gone
        assert [b.executions for b in feed.batches(follow=False)] == [["e2"]]
        assert feed.last_step == 1


def test_a_second_batch_for_a_step_that_bypassed_ingest_is_rejected(tmp_path):
    from ledger.log.base import LogRecord
    from ledger.projections.consumers import ConsumersProjection, consumed
    from ledger.projections.engine import Applied, Rejected, connect

    db = connect(tmp_path / "c.db")
    proj = ConsumersProjection()
    proj.create(db)
    line = {"type": "batch_consumed", "consumer": "c", "route": "grpo", "step": 1,
            "members": [{"member_id": "grpo/e1/r1", "digest": "ab" * 32}]}
    first = validate_line(line, now_micros=1)
    rec = LogRecord("t.executions", 0, 5, "c", first["event_id"], "batch_consumed", b"", b"")
    proj.apply(db, Applied(first, rec))
    proj.apply(db, Applied(first, rec))  # delivered twice: applied once
    other = validate_line({**line, "event_id": "forged", "members": [{"member_id": "grpo/e2/r1", "digest": "cd" * 32}]},
                          now_micros=1)
    with pytest.raises(Rejected, match="already acknowledged step 1"):
        proj.apply(db, Applied(other, rec))
    assert consumed(db, "c") == {"grpo/e1/r1": (1, "trained")}
