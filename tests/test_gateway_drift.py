"""Drift accounting end to end (SPEC §7.6): histories the gateway cannot restore byte-exactly,
sent by the official `openai` client through the gateway in front of a real engine. Each
divergence is counted once by cause, with its branch point (message, token) in gateway.db, and
the recorded input is exactly what the engine saw."""

from __future__ import annotations

import sqlite3

import pytest

from ledger.producers import chatml
from ledger.gateway.calls import assemble
from ledger.gateway.store import gateway_db_path
from tests.gateway_helpers import READ_TOOL, TOOL_CALL, RunningGateway, init_store, inputs_of
from tests.test_gateway import _chat, _new_tokens, _reserialised, _status

pytestmark = pytest.mark.timeout(120)

# a fixed answer: its text is fixed, its tokens are whatever spelling the sampler picks
FIXED = ["Done, all the tests pass now and the fix is committed."]


def _led(resp) -> dict:
    return resp.model_extra["ledger"]


def _drift_rows(gw) -> dict[str, tuple]:
    db = sqlite3.connect(gateway_db_path(gw.store))
    try:
        return {r[0]: r[1:] for r in db.execute(
            "SELECT request_id, cause, at_message, at_token, parent_request_id FROM drift")}
    finally:
        db.close()


def test_same_text_other_tokens_is_retokenization_at_the_first_differing_token(gateway):
    """The harness sends an assistant message it wrote itself (a canned answer): the gateway renders
    it with the tokenizer. Later the model produces exactly that answer, spelled by other tokens.
    When the first history continues, the message now equals a recorded output and is restored
    with the model's exact tokens, while the call it extends was recorded with the tokenizer's
    spelling: same text, other IDs — counted as ``retokenization`` where they first differ, and
    the new input is recorded as sent."""
    ex = "ex-retok"
    c = gateway.client(ex)
    h = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Fix the test."}]
    canned = h + [{"role": "assistant", "content": FIXED[0]}, {"role": "user", "content": "Run it again."}]
    p = _chat(c, canned, TOOL_CALL, seed=2)
    q = _chat(c, h, FIXED, seed=3)  # the model gives the canned answer itself (a shorter history: an edit)
    assert q.choices[0].message.content == FIXED[0]
    assert (_led(p)["match"], _led(q)["match"], _led(q)["drift"]) == ("first", "diverged", "edited_history")
    t = p.choices[0].message.tool_calls[0]
    tool = {"role": "tool", "tool_call_id": t.id, "content": "1 passed"}
    d = _chat(c, canned + [_reserialised(p.choices[0].message), tool], FIXED, seed=4)
    assert (_led(d)["match"], _led(d)["parent_request_id"], _led(d)["drift"]) == (
        "extends", _led(p)["request_id"], "retokenization")

    reqs = {r["request_id"]: r for r in gateway.lines(execution=ex)}
    inputs = inputs_of(list(reqs.values()))
    rp, rq, rd = (reqs[_led(x)["request_id"]] for x in (p, q, d))
    h_len = len(inputs[rq["request_id"]])
    assert inputs[rq["request_id"]] == assemble(h, [READ_TOOL], {}) == inputs[rp["request_id"]][:h_len]
    rendered = inputs[rp["request_id"]][h_len:]  # the tokenizer's spelling of the canned answer (+ the rest)
    out_q = rq["output_ids"]
    assert out_q[-1] == chatml.IM_END_ID and rendered[:len(out_q)] != out_q
    split = next(i for i, (x, y) in enumerate(zip(out_q, rendered)) if x != y)
    p_path = inputs[rp["request_id"]] + rp["output_ids"]
    d_in = inputs[rd["request_id"]]
    # the branch point: the first token where the model's spelling leaves the extended call's path
    assert _drift_rows(gateway)[rd["request_id"]] == ("retokenization", None, h_len + split, rp["request_id"])
    assert d_in[:h_len + split] == p_path[:h_len + split] and d_in[h_len + split] != p_path[h_len + split]
    assert chatml.decode(d_in).startswith(chatml.decode(p_path))  # same text throughout
    # what was sent: the model's exact tokens for the canned answer, then p's messages, output and the result
    q_path = inputs[rq["request_id"]] + out_q
    after_canned = h_len + rendered.index(chatml.IM_END_ID) + 1
    assert d_in == q_path + p_path[after_canned:] + _new_tokens([tool])
    assert rd["input_prefix"]["request_id"] == rq["request_id"]  # the tree hangs it under q, where its tokens are
    assert rd["input_prefix"]["length"] == len(q_path)
    st = _status(gateway)["gateway"]
    assert st["drift"] == {"template": 0, "retokenization": 1, "edited_history": 1, "other": 0}
    assert st["by_match"] == {"diverged": 1, "extends": 1, "first": 1}


def test_branch_navigation_restores_the_extended_calls_tokens(gateway):
    """A chat UI's branch navigation: answer A, a follow-up on A, then "regenerate" gives B with the
    same text spelled by other tokens; the user goes back to A's branch and continues. The history
    cannot tell A from B; the call it extends (the follow-up) was recorded on A's tokens, so A's
    are restored: no drift, and the new input extends the follow-up's path exactly."""
    ex = "ex-branch"
    c = gateway.client(ex)
    h = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Fix the test."}]
    a = _chat(c, h, FIXED, seed=1)
    follow = h + [_reserialised(a.choices[0].message), {"role": "user", "content": "Run it again."}]
    f = _chat(c, follow, TOOL_CALL, seed=2)
    b = _chat(c, h, FIXED, seed=3)  # regenerate
    assert b.choices[0].message.content == a.choices[0].message.content
    assert (_led(f)["match"], _led(b)["match"], _led(b)["drift"]) == ("extends", "resample", None)
    t = f.choices[0].message.tool_calls[0]
    tool = {"role": "tool", "tool_call_id": t.id, "content": "1 passed"}
    d = _chat(c, follow + [_reserialised(f.choices[0].message), tool], FIXED, seed=4)
    assert (_led(d)["match"], _led(d)["parent_request_id"], _led(d)["drift"]) == ("extends", _led(f)["request_id"], None)

    reqs = {r["request_id"]: r for r in gateway.lines(execution=ex)}
    inputs = inputs_of(list(reqs.values()))
    ra, rf, rb, rd = (reqs[_led(x)["request_id"]] for x in (a, f, b, d))
    assert ra["output_ids"] != rb["output_ids"]
    assert chatml.decode(ra["output_ids"]) == chatml.decode(rb["output_ids"])
    f_path = inputs[rf["request_id"]] + rf["output_ids"]
    assert inputs[rd["request_id"]] == f_path + _new_tokens([tool])
    assert (rd["input_prefix"]["request_id"], rd["input_prefix"]["length"]) == (rf["request_id"], len(f_path))
    assert rd["request_id"] not in _drift_rows(gateway)
    st = _status(gateway)["gateway"]
    assert st["drift"] == {"template": 0, "retokenization": 0, "edited_history": 0, "other": 0}
    assert st["by_match"] == {"extends": 2, "first": 1, "resample": 1}


def test_regenerate_then_continue_does_not_drift(gateway):
    """Answer A, "regenerate" gives B (same text, other tokens), the user continues under B: the
    history extends both equally; the gateway takes the latest (B, the one a UI shows) as the
    parent and restores B's tokens — the same call, so no spurious ``retokenization``."""
    ex = "ex-regen"
    c = gateway.client(ex)
    h = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Fix the test."}]
    a = _chat(c, h, FIXED, seed=1)
    b = _chat(c, h, FIXED, seed=3)  # regenerate
    nxt = {"role": "user", "content": "Thanks, now add a test."}
    n = _chat(c, h + [_reserialised(b.choices[0].message), nxt], FIXED, seed=5)
    assert (_led(b)["match"], _led(n)["match"], _led(n)["parent_request_id"], _led(n)["drift"]) == (
        "resample", "extends", _led(b)["request_id"], None)

    reqs = {r["request_id"]: r for r in gateway.lines(execution=ex)}
    inputs = inputs_of(list(reqs.values()))
    ra, rb, rn = (reqs[_led(x)["request_id"]] for x in (a, b, n))
    assert ra["output_ids"] != rb["output_ids"]
    b_path = inputs[rb["request_id"]] + rb["output_ids"]
    assert inputs[rn["request_id"]] == b_path + _new_tokens([nxt])
    assert (rn["input_prefix"]["request_id"], rn["input_prefix"]["length"]) == (rb["request_id"], len(b_path))
    assert _drift_rows(gateway) == {}
    assert _status(gateway)["gateway"]["by_match"] == {"extends": 1, "first": 1, "resample": 1}


def test_assistant_message_edited_by_the_client_branches_there_once(gateway):
    """The harness edits the model's tool call (other argument value): the message no longer is
    one the gateway produced, so it is rendered afresh — ``edited_history`` at that message, the
    tree branching at the start of that assistant turn; the next call extends the edited branch
    with no further drift."""
    ex = "ex-edit-assistant"
    c = gateway.client(ex)
    h = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Read the file."}]
    r1 = _chat(c, h, TOOL_CALL, seed=11)
    t1 = r1.choices[0].message.tool_calls[0]
    edited = _reserialised(r1.choices[0].message)
    edited["tool_calls"][0]["function"]["arguments"] = '{"path": "other.py", "n": 4}'
    h2 = h + [edited, {"role": "tool", "tool_call_id": t1.id, "content": "y = 2"}]
    r2 = _chat(c, h2, TOOL_CALL, seed=12)
    assert (_led(r2)["match"], _led(r2)["parent_request_id"], _led(r2)["drift"]) == (
        "diverged", _led(r1)["request_id"], "edited_history")
    t2 = r2.choices[0].message.tool_calls[0]
    h3 = h2 + [_reserialised(r2.choices[0].message), {"role": "tool", "tool_call_id": t2.id, "content": "z"}]
    r3 = _chat(c, h3, TOOL_CALL, seed=13)
    assert (_led(r3)["match"], _led(r3)["parent_request_id"], _led(r3)["drift"]) == (
        "extends", _led(r2)["request_id"], None)

    reqs = gateway.lines(execution=ex)
    inputs = inputs_of(reqs)
    i1, i2, i3 = (inputs[r["request_id"]] for r in reqs)
    # branch point: right after r1's input (its generation prompt), where r1's output began
    assert _drift_rows(gateway)[reqs[1]["request_id"]] == ("edited_history", 2, len(i1), reqs[0]["request_id"])
    assert i2[:len(i1)] == i1 and i2[len(i1)] != reqs[0]["output_ids"][0]
    assert i2 == assemble(h2, [READ_TOOL], {})  # nothing restored: the edited message rendered afresh
    fresh = chatml.decode(i2[len(i1):])
    assert fresh.startswith('<tool_call>\n{"name": "read", "arguments": {"path": "other.py", "n": 4}}\n</tool_call>')
    assert "<think>" not in fresh
    assert i3 == i2 + reqs[1]["output_ids"] + _new_tokens(h3[5:])
    assert (reqs[1]["input_prefix"]["request_id"], reqs[1]["input_prefix"]["length"]) == (reqs[0]["request_id"], len(i1))
    st = _status(gateway)["gateway"]
    assert st["drift"] == {"template": 0, "retokenization": 0, "edited_history": 1, "other": 0}


def test_report_has_gateway_drift_by_cause(tmp_path, engine):
    """`ledger report` shows the gateway's divergences by cause (a table-only section), and leaves
    the section out for a store no gateway recorded into."""
    import re

    from ledger.cli import main as cli_main

    store = init_store(tmp_path / "store")
    gw = RunningGateway(store, engine.url, "vllm")
    try:
        c = gw.client("ex-report")
        h = [{"role": "user", "content": "task"}]
        r1 = _chat(c, h, TOOL_CALL, seed=41)
        t1 = r1.choices[0].message.tool_calls[0]
        h += [_reserialised(r1.choices[0].message), {"role": "tool", "tool_call_id": t1.id, "content": "r"}]
        other = {"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}
        r2 = _chat(c, h, FIXED, tools=(READ_TOOL, other), seed=42)
        assert _led(r2)["drift"] == "template"
        edited = [h[0], {**h[1], "content": "I will read it."}, h[2]]
        assert _led(_chat(c, edited, FIXED, seed=43))["drift"] == "edited_history"
        r4 = _chat(c, h + [_reserialised(r2.choices[0].message), {"role": "user", "content": "thanks"}], FIXED,
                   tools=(READ_TOOL, other), seed=44)
        assert (_led(r4)["match"], _led(r4)["drift"]) == ("extends", None)
    finally:
        gw.close()
    assert cli_main(["--store", str(store), "report", "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "index.html").read_text()
    section = page.split("<h2 id='gateway'>", 1)[1].split("<h2", 1)[0]
    assert "Capture gateway drift by cause" in section and "No data" not in section
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(<td>.*?)</tr>", section)]
    assert rows == [["template", "1", "0.25"], ["retokenization", "0", "0"], ["edited_history", "1", "0.25"],
                    ["other", "0", "0"], ["all causes", "2", "0.5"],
                    ["diverged", "1"], ["extends", "2"], ["first", "1"], ["all calls", "4"]]
    bare = init_store(tmp_path / "bare")
    assert cli_main(["--store", str(bare), "report", "--out", str(tmp_path / "rep2")]) == 0
    assert "id='gateway'" not in (tmp_path / "rep2" / "index.html").read_text()
