"""The producer SDK (SPEC §7.4): prefix references, same events as `ledger ingest`, retries,
back-pressure, error surfacing."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ledger.events.codec import default_codec
from ledger.events.validate import ValidationError
from ledger.log import open_log
from ledger.producers.ingest import Ingestor, read_json_lines
from ledger.producers.recorder import Recorder, RecorderError
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.tree import TreeProjection, load_tree, request_path, tree_stats
from workloads import synthetic as workload

DEADLINE = "2030-01-01T00:00:00Z"


def replay(log, tmp_path: Path, name: str = "p.db"):
    db = connect(tmp_path / name)
    stats = ReplayEngine(log, db, [TreeProjection()]).run()
    assert stats.rejected == 0 and stats.dead_letters == 0
    return db


def record_events(rec: Recorder, events, *, occurred_at: bool = False) -> None:
    """Feed workload JSON lines through the SDK (numpy arrays for the token IDs)."""
    for e in events:
        kw = {"occurred_at": e.get("occurred_at", "2025-01-01T00:00:00Z")} if occurred_at else {}
        t = e["type"]
        if t == "execution_opened":
            rec.open_execution(e["execution_id"], e["task_id"], e["deadline"], e["policy"], tokenizer=e.get("tokenizer"),
                               origin=e.get("origin"), collection_run_id=e.get("collection_run_id"),
                               metadata=e.get("metadata"), **kw)
        elif t == "request":
            opts = {k: e[k] for k in ("agent_tier", "turn_kind", "generator", "parent_request_id",
                                      "consumed_tool_call_ids", "emitted_tool_call_ids", "model", "finish_reason", "reconstructed") if k in e}
            rec.record_request(e["execution_id"], e["request_id"], np.asarray(e["input_ids"], dtype=np.int64),
                               np.asarray(e["output_ids"], dtype=np.uint32), np.asarray(e["output_logprobs"]) if "output_logprobs" in e else None,
                               e.get("agent_id", "main"), **opts, **kw)
        elif t == "tool_payload":
            rec.cache_tool_payload(e["execution_id"], e["call_id"], e["kind"], e["payload"], **kw)
        elif t == "execution_closed":
            rec.close_execution(e["execution_id"], e["status"], e.get("artifact_versions", ()), **kw)
        elif t == "assessment":
            rec.record_assessment(e["execution_id"], e["assessment_id"], e["artifact_version"], e["outcome"],
                                  e["evaluator"], e.get("reward"), criteria=e.get("criteria"), **kw)
        else:
            rec.emit({**{k: v for k, v in e.items() if k != "occurred_at"}, **kw})


@pytest.fixture(scope="module")
def events():
    return list(workload.generate(2, seed=11, turns=workload.MIN_TURNS))


def test_recorder_writes_prefix_references_and_the_tree_is_exact(tmp_path, events):
    log = open_log(str(tmp_path / "store"), create=True)
    tee = io.StringIO()
    with Recorder(log, tee=tee) as rec:
        record_events(rec, events)
    lines = [json.loads(x) for x in tee.getvalue().splitlines()]
    reqs = [x for x in lines if x["type"] == "request"]
    assert sum("input_prefix" in x for x in reqs) >= len(reqs) - 6  # only first calls of each agent/compaction restart
    db = replay(log, tmp_path)
    for e in events:
        if e["type"] == "request":
            assert request_path(db, e["execution_id"], e["request_id"]).tolist() == e["input_ids"] + e["output_ids"]
    # the same events without prefix references take far more log bytes
    full = open_log(str(tmp_path / "full"), create=True)
    Ingestor(full).ingest_lines(list(enumerate(events, 1)))
    ref_bytes = (tmp_path / "store" / "events.dat").stat().st_size
    full_bytes = (tmp_path / "full" / "events.dat").stat().st_size
    assert ref_bytes * 2 < full_bytes  # O(turns) vs O(turns²); 13 turns here
    db2 = replay(full, tmp_path, "full.db")
    ex = events[1]["execution_id"]
    assert tree_stats(db, ex) == tree_stats(db2, ex)


def test_reference_is_the_longest_common_prefix_with_the_agents_previous_call(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    with Recorder(log, min_prefix=1) as rec:
        rec.open_execution("e", "t", DEADLINE, "p")
        base = list(range(100, 140))
        rec.record_request("e", "r1", base, [1, 2, 3], [-0.1] * 3)
        line = rec.record_request("e", "r2", base + [1, 2, 9], [4], [-0.2])  # diverges inside r1's output
        assert line["input_prefix"]["request_id"] == "r1" and line["input_prefix"]["length"] == 42
        assert line["input_suffix_ids"] == [9] and "input_ids" not in line
        sub = rec.record_request("e", "s1", base[:30] + [7], [8], [-0.3], "helper", agent_tier="sub",
                                 parent_request_id="r2")  # first call of a sub-agent: the parent's path
        assert sub["input_prefix"]["request_id"] == "r2" and sub["input_prefix"]["length"] == 30
        fresh = rec.record_request("e", "x", [5, 5], [6], [-0.4], "other")
        assert "input_ids" in fresh
    db = replay(log, tmp_path)
    assert request_path(db, "e", "r2").tolist() == base + [1, 2, 9, 4]
    assert request_path(db, "e", "s1").tolist() == base[:30] + [7, 8]


def test_recorder_stores_exactly_what_ledger_ingest_of_its_lines_stores(tmp_path, events):
    from ledger.log.sealing import KeyStore, is_sealed

    a = open_log(str(tmp_path / "a"), create=True)
    tee = io.StringIO()
    ks = KeyStore(tmp_path / "keys.db")  # one key store: sealing is deterministic under the same key
    with Recorder(a, tee=tee, keystore=ks) as rec:
        record_events(rec, events, occurred_at=True)  # explicit times: byte-identical events
    b = open_log(str(tmp_path / "b"), create=True)
    report = Ingestor(b, keystore=ks).ingest_lines(read_json_lines(io.StringIO(tee.getvalue())))
    assert report.appended == a.size() == len(events)
    va = [r.value for r in a.read()]
    vb = [r.value for r in b.read()]
    assert va == vb
    codec = default_codec()
    sealed = [is_sealed(codec.decode(v)) for v, r in zip(va, a.read()) if r.event_type == "request"]
    assert sealed and all(sealed)  # the recorder seals request tokens by default
    # without explicit times only the stamped occurred_at differs
    c = open_log(str(tmp_path / "c"), create=True)
    tee2 = io.StringIO()
    with Recorder(c, tee=tee2, keystore=ks) as rec:
        record_events(rec, events[:40])
    d = open_log(str(tmp_path / "d"), create=True)
    Ingestor(d, keystore=ks).ingest_lines(read_json_lines(io.StringIO(tee2.getvalue())))
    for rc, rd in zip(c.read(), d.read()):
        ec, ed = codec.decode(rc.value), codec.decode(rd.value)
        assert ec.pop("occurred_at") <= ed.pop("occurred_at") and ec == ed
        assert ec["stamped"] == ["occurred_at", "event_id"] and ec["producer"] == "recorder"


def test_retries_are_duplicates_not_new_events(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    inp, out = list(range(50)), [7, 8]

    def session(rec: Recorder) -> None:
        rec.open_execution("e", "t", DEADLINE, "p")
        rec.record_request("e", "r1", inp, out, [-0.5, -0.5])
        rec.record_request("e", "r2", inp + out + [3], [9], [-0.1])
        rec.cache_tool_payload("e", "c1", "result", {"ok": True})

    with Recorder(log) as rec:
        session(rec)
        rec.flush()
        size = log.size()
        rec.record_request("e", "r2", np.array(inp + out + [3]), [9], [-0.1])  # same process retry
        rec.flush()
        assert log.size() == size and rec.duplicates == 1
    with Recorder(log) as rec2:  # a restarted producer retries everything
        session(rec2)
    assert log.size() == size and rec2.duplicates == 4 and rec2.appended == 0
    # different content under the same id: a conflict, reported, nothing overwritten
    with pytest.raises(RecorderError, match="conflict"):
        with Recorder(log) as rec3:
            rec3.record_request("e", "r1", inp, [7, 9], [-0.5, -0.5])
    assert log.size() == size
    db = replay(log, tmp_path)
    assert request_path(db, "e", "r1").tolist() == inp + out


def test_errors_surface_on_the_next_call_and_flush(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    rec = Recorder(log)
    rec.record_request("never-opened", "r1", [1], [2], [-0.1])
    with pytest.raises(RecorderError, match="never opened"):
        rec.flush()
    rec.record_request("never-opened", "r2", [1], [2], [-0.1])
    rec._q.join()  # the writer has handled it (without raising here)
    with pytest.raises(RecorderError):
        rec.open_execution("e", "t", DEADLINE, "p")  # the next call raises the pending error
    rec.open_execution("e", "t", DEADLINE, "p")
    rec.close()
    assert log.size() == 1
    # validation errors raise at the call, before anything is queued
    with Recorder(log) as rec:
        with pytest.raises(ValidationError, match="output_logprobs"):
            rec.record_request("e", "r1", [1], [2])  # policy output without log-probs
        with pytest.raises(ValueError, match="token IDs"):
            rec.record_request("e", "r1", np.array([-1, 2]), [2], [-0.1])
        with pytest.raises(ValueError):
            rec.record_request("e", "r1", [1.5], [2], [-0.1])
        rec.record_request("e", "r1", [1, 2, 3], [4], [-0.1])  # the failed attempts left no state behind
    assert log.size() == 2


class _GatedLog:
    """Delegates to a real log; appends wait until the gate opens."""

    def __init__(self, log, gate: threading.Event) -> None:
        self._log, self._gate = log, gate
        self.max_batch = 0

    def append(self, batch):
        self._gate.wait()
        self.max_batch = max(self.max_batch, len(batch))
        return self._log.append(batch)

    def __getattr__(self, name):
        return getattr(self._log, name)


def test_bounded_in_flight_buffer_blocks_producers(tmp_path):
    gate = threading.Event()
    log = _GatedLog(open_log(str(tmp_path / "store"), create=True), gate)
    rec = Recorder(log, max_in_flight=3)
    done = []
    sizes = []

    def producer():
        rec.open_execution("e", "t", DEADLINE, "p")
        for i in range(12):
            rec.cache_tool_payload("e", f"c{i}", "result", i)
            sizes.append(rec.in_flight)
        done.append(True)

    th = threading.Thread(target=producer)
    th.start()
    time.sleep(0.3)
    assert th.is_alive() and not done  # blocked: the writer is stuck, the buffer is full
    assert rec.in_flight <= 3 and max(sizes, default=0) <= 3
    gate.set()
    th.join(10)
    assert done
    rec.close()
    assert log.size() == 13
    assert log.max_batch > 1  # the writer drains what is queued in batches


def test_context_manager_flushes_and_close_is_idempotent(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    with Recorder(log) as rec:
        rec.open_execution("e", "t", DEADLINE, "p", metadata={"a": 1})
        rec.record_request("e", "r1", np.arange(10), np.arange(3), np.full(3, -0.25, dtype=np.float32))
        rec.close_execution("e", "timeout", ["v1"])
    rec.close()
    assert log.size() == 3
    with pytest.raises(RuntimeError, match="closed"):
        rec.cache_tool_payload("e", "c", "call", 1)
    db = replay(log, tmp_path)
    t = load_tree(db, "e")
    assert t.path("r1").tolist() == list(range(10)) + [0, 1, 2]
    assert t.nodes[0].logprobs[-3:].tolist() == [-0.25] * 3


def test_retry_after_close_is_a_duplicate(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    with Recorder(log) as rec:
        rec.open_execution("e", "t", DEADLINE, "p")
        rec.record_request("e", "r1", list(range(40)), [1], [-0.1])
        rec.record_request("e", "r2", list(range(40)) + [1, 2], [3], [-0.1])
        rec.close_execution("e")
        rec.flush()
        size = log.size()
        rec.record_request("e", "r2", list(range(40)) + [1, 2], [3], [-0.1])  # late retry
        rec.close_execution("e")
    assert log.size() == size and rec.duplicates == 2
