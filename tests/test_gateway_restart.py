"""The capture gateway across a restart (SPEC §7.6, issue 17): restoration state and the
idempotency map survive the process — `ledger gateway` is SIGKILLed after answering and a new
process on the same store continues the conversation (official `openai` client, real engine)."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import time

import pytest

from ledger.cli import main as cli_main
from ledger.producers import chatml
from ledger.gateway.store import gateway_db_path
from tests.gateway_helpers import (ANSWER, TOOL_CALL, GatewayProcess, RunningGateway, init_store,
                                   log_requests)
from tests.test_gateway import _chat, _new_tokens, _reserialised, _status

pytestmark = pytest.mark.timeout(180)


def _rid(name: str) -> dict:
    return {"extra_headers": {"X-Ledger-Request-Id": name}}


def test_restart_continues_the_chain_and_answers_retries_identically(tmp_path, engine):
    store = init_store(tmp_path / "store")
    ex = "ex-restart"
    t0 = time.monotonic()
    a = GatewayProcess(store, engine.url)
    main, sub = a.client(ex), a.client(ex, agent="searcher", tier="sub")
    history = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix x.py."}]
    r1 = _chat(main, history, TOOL_CALL, seed=1, **_rid("c1"))
    t1 = r1.choices[0].message.tool_calls[0]
    s1 = _chat(sub, [{"role": "user", "content": "find tests"}], ANSWER, tools=(), seed=2, **_rid("s1"))
    history += [_reserialised(r1.choices[0].message), {"role": "tool", "tool_call_id": t1.id, "content": "x = 1"}]
    r2 = _chat(main, history, TOOL_CALL, seed=3, **_rid("c2"))
    t2 = r2.choices[0].message.tool_calls[0]
    calls_before = engine.calls
    a.kill()  # SIGKILL right after the answers: nothing in memory survives

    t_restart = time.monotonic()
    b = GatewayProcess(store, engine.url)
    restart_s = time.monotonic() - t_restart
    main, sub = b.client(ex), b.client(ex, agent="searcher", tier="sub")
    # retried completed ids: the identical answers, from the log + gateway.db, no engine call
    assert _chat(main, history, TOOL_CALL, seed=3, **_rid("c2")).model_dump() == r2.model_dump()
    assert _chat(main, history[:2], TOOL_CALL, seed=1, **_rid("c1")).model_dump() == r1.model_dump()
    assert _chat(sub, [{"role": "user", "content": "find tests"}], ANSWER, tools=(), seed=2,
                 **_rid("s1")).model_dump() == s1.model_dump()
    assert engine.calls == calls_before
    # the conversation continues: restored output tokens, same chain, no spurious branch
    history += [_reserialised(r2.choices[0].message),
                {"role": "tool", "tool_call_id": t2.id, "content": s1.choices[0].message.content}]
    r3 = _chat(main, history, ANSWER, seed=4, **_rid("c3"))
    led = r3.model_extra["ledger"]
    assert (led["match"], led["parent_request_id"], led["drift"]) == ("extends", "c2", None)
    s2 = _chat(sub, [{"role": "user", "content": "find tests"}, _reserialised(s1.choices[0].message),
                     {"role": "user", "content": "and more"}], ANSWER, tools=(), seed=5, **_rid("s2"))
    assert (s2.model_extra["ledger"]["match"], s2.model_extra["ledger"]["parent_request_id"]) == ("extends", "s1")
    assert _chat(main, history, ANSWER, seed=4, **_rid("c3")).model_dump() == r3.model_dump()
    assert engine.calls == calls_before + 2
    st = _status_of(store)
    b.stop()
    elapsed = time.monotonic() - t0

    reqs = log_requests(store, ex)
    assert [r["request_id"] for r in reqs] == ["c1", "s1", "c2", "c3", "s2"]  # each once: nothing recorded twice
    m = {r["request_id"]: r for r in reqs}
    assert m["c3"]["input"] == m["c2"]["input"] + m["c2"]["output"] + _new_tokens(history[5:6])
    assert m["c3"]["input_prefix"]["request_id"] == "c2"
    assert m["c3"]["input_prefix"]["length"] == len(m["c2"]["input"]) + len(m["c2"]["output"])
    assert m["s2"]["input_prefix"]["request_id"] == "s1"
    assert m["s2"]["input"] == m["s1"]["input"] + m["s1"]["output"] + _new_tokens(
        [{"role": "user", "content": "and more"}])
    # the restored think block is in c3's input though the harness never sent it back
    assert chatml.decode(m["c3"]["input"]).count("</think>") == 2
    assert m["c3"]["consumed_tool_call_ids"] == [t2.id]  # t1's result was cached before the restart
    assert m["c2"]["consumed_tool_call_ids"] == [t1.id]
    assert st["drift"] == {"template": 0, "retokenization": 0, "edited_history": 0, "other": 0}
    assert st["calls"] == 5 and st["by_match"] == {"extends": 3, "first": 2}
    print(f"\nrestart: new gateway process ready in {restart_s:.2f}s; whole test {elapsed:.2f}s")


def _status_of(store) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["--store", str(store), "status", "--json"]) == 0
    return json.loads(buf.getvalue())["gateway"]


def test_state_without_a_log_record_is_dropped_on_load(tmp_path, engine):
    """A crash between committing a call's state and writing its events leaves a gateway.db row
    whose request is not on the log: the next gateway drops it (counts included) and serves the
    id as a new call."""
    store = init_store(tmp_path / "store")
    gw = RunningGateway(store, engine.url, "vllm")
    try:
        c = gw.client("ex-stale")
        first = _chat(c, [{"role": "user", "content": "hi"}], ANSWER, tools=(), seed=1, **_rid("k1"))
    finally:
        gw.close()
    db = sqlite3.connect(gateway_db_path(store))
    row = db.execute("SELECT * FROM state WHERE request_id = 'k1'").fetchone()
    db.execute("INSERT INTO state VALUES (?,?,?,?,?,?,?)", (row[0], "k2", *row[2:]))
    db.execute("INSERT INTO calls VALUES ('ex-stale', 'k2', 'first')")
    db.execute("INSERT INTO drift VALUES ('ex-stale', 'k2', 'main', 'other', 0, 0, NULL)")
    db.commit()
    db.close()
    gw = RunningGateway(store, engine.url, "vllm")
    try:
        c = gw.client("ex-stale")
        calls = engine.calls
        assert _chat(c, [{"role": "user", "content": "hi"}], ANSWER, tools=(), seed=1,
                     **_rid("k1")).model_dump() == first.model_dump()
        r = _chat(c, [{"role": "user", "content": "hi"}, _reserialised(first.choices[0].message),
                      {"role": "user", "content": "again"}], ANSWER, tools=(), seed=2, **_rid("k2"))
        assert engine.calls == calls + 1
        assert (r.model_extra["ledger"]["match"], r.model_extra["ledger"]["parent_request_id"]) == ("extends", "k1")
        st = _status(gw)["gateway"]
        assert st["calls"] == 2 and st["by_match"] == {"extends": 1, "first": 1} and st["drift"]["other"] == 0
    finally:
        gw.close()
    assert [x["request_id"] for x in log_requests(store, "ex-stale")] == ["k1", "k2"]


def test_a_request_on_the_log_without_gateway_state_is_409(tmp_path, engine):
    """A request id another producer recorded (no gateway.db state) is not answered or re-recorded."""
    import openai

    from ledger import open_log
    from ledger.producers.recorder import Recorder

    store = init_store(tmp_path / "store")
    log = open_log(str(store))
    with Recorder(log, producer="other") as rec:
        rec.open_execution("ex-other", task_id="t", deadline="2030-01-01T00:00:00Z", policy="tiny")
        rec.record_request("ex-other", "r1", [1, 2, 3], [4], [-0.5])
    log.close()
    gw = RunningGateway(store, engine.url, "vllm")
    try:
        with pytest.raises(openai.ConflictError, match="no state for it in gateway.db"):
            _chat(gw.client("ex-other"), [{"role": "user", "content": "x"}], ANSWER, tools=(), **_rid("r1"))
    finally:
        gw.close()
    assert [x["request_id"] for x in log_requests(store, "ex-other")] == ["r1"]


def test_withdraw_erase_deletes_the_restoration_state_of_the_erased_execution(tmp_path, engine):
    """The state rows hold digests of the erased messages: `withdraw --erase` deletes them; another
    execution's rows stay."""
    store = init_store(tmp_path / "store")
    gw = RunningGateway(store, engine.url, "vllm")
    try:
        for ex in ("ex-gone", "ex-kept"):
            _chat(gw.client(ex), [{"role": "user", "content": f"hi {ex}"}], ANSWER, tools=(), seed=1, **_rid(f"{ex}-1"))
    finally:
        gw.close()
    path = gateway_db_path(store)
    count = "SELECT execution_id, COUNT(*) FROM state GROUP BY 1 ORDER BY 1"
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute(count).fetchall() == [("ex-gone", 1), ("ex-kept", 1)]
    assert cli_main(["--store", str(store), "keys", "new", "--out", str(tmp_path / "gov.key")]) == 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["--store", str(store), "withdraw", "execution:ex-gone", "--reason", "erasure request",
                         "--key", str(tmp_path / "gov.key"), "--erase", "--json"]) == 0
    assert json.loads(buf.getvalue())["erase"]["gateway_state_rows_deleted"] == 1
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute(count).fetchall() == [("ex-kept", 1)]


def test_branch_navigation_after_a_restart_restores_the_extended_calls_tokens(tmp_path, engine):
    """Answer A, a follow-up on A, a regenerate B (same text, other tokens), then SIGKILL: the new
    process restores A's tokens for the follow-up's branch (the plan each call was built with is
    in gateway.db), so the continuation extends the follow-up exactly — no drift — and its prefix
    reference (Recorder.resume) is the follow-up's whole path."""
    from tests.test_gateway_drift import FIXED

    store = init_store(tmp_path / "store")
    ex = "ex-restart-branch"
    a = GatewayProcess(store, engine.url)
    c = a.client(ex)
    h = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Fix the test."}]
    ra = _chat(c, h, FIXED, seed=1, **_rid("a"))
    follow = h + [_reserialised(ra.choices[0].message), {"role": "user", "content": "Run it again."}]
    rf = _chat(c, follow, TOOL_CALL, seed=2, **_rid("f"))
    rb = _chat(c, h, FIXED, seed=3, **_rid("b"))
    assert rb.choices[0].message.content == ra.choices[0].message.content
    a.kill()

    b = GatewayProcess(store, engine.url)
    try:
        t = rf.choices[0].message.tool_calls[0]
        tool = {"role": "tool", "tool_call_id": t.id, "content": "1 passed"}
        rd = _chat(b.client(ex), follow + [_reserialised(rf.choices[0].message), tool], FIXED, seed=4, **_rid("d"))
        assert (rd.model_extra["ledger"]["match"], rd.model_extra["ledger"]["parent_request_id"],
                rd.model_extra["ledger"]["drift"]) == ("extends", "f", None)
    finally:
        b.stop()
    reqs = {r["request_id"]: r for r in log_requests(store, ex)}
    assert reqs["a"]["output"] != reqs["b"]["output"]
    f_path = reqs["f"]["input"] + reqs["f"]["output"]
    assert reqs["d"]["input"] == f_path + _new_tokens([tool])
    assert (reqs["d"]["input_prefix"]["request_id"], reqs["d"]["input_prefix"]["length"]) == ("f", len(f_path))
