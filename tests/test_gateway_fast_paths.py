"""The gateway's O(new tokens) paths (issue 29) record exactly what the reference paths record: prompts assembled as
uint32 arrays, the recorder fed arrays with SHA-256 states kept per path, the ingestor checking a reference to a whole
path from its kept state, the body digest from cached per-message JSON."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import open_log
from ledger.algorithms.prefix_match import tokens_sha256
from ledger.events.validate import validate_line
from ledger.producers import chatml
from ledger.gateway import calls as gateway_module
from ledger.gateway import serve as serve_module
from ledger.gateway.body import body_digest
from ledger.gateway.calls import Gateway, _Headers
from ledger.gateway.store import gateway_db_path
from ledger.gateway.upstream import Completion
from ledger.producers.ingest import IngestError, Ingestor
from ledger.producers.models import load_format
from ledger.producers.models.base import ChatFormat, QwenFormat
from ledger.producers.recorder import Recorder
from tests.test_model_format import CONVERSATION, FAMILIES, KWARGS, READ, _format, tool_turn

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _qwen_histories() -> list[tuple[list[dict], dict, dict | None]]:
    out = chatml.encode("<think>\nhm\n</think>\n\nok") + [chatml.IM_END_ID]
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}
    base = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi é"}]
    return [
        (base, {}, None),
        (base + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}], {2: out}, None),
        (base + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}], {2: out[:-1]},
         {"enable_thinking": False}),
        (base + [call, {"role": "tool", "tool_call_id": "c1", "content": "a"},
                 {"role": "tool", "tool_call_id": "c1", "content": "b"}], {2: []}, None),
        ([{"role": "user", "content": "no system"}], {}, {"enable_thinking": True}),
    ]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_qwen_assemble_array_is_assemble(tools):
    fmt = load_format("qwen3.6-27b")
    for messages, restored, kwargs in _qwen_histories():
        arr = fmt.assemble_array(messages, tools, restored, kwargs)
        assert arr.dtype == np.uint32 and arr.tolist() == fmt.assemble(messages, tools, restored, kwargs)
        assert arr.tolist() == ChatFormat.assemble_array(fmt, messages, tools, restored, kwargs).tolist()
    with pytest.raises(ValueError, match="not supported"):
        fmt.assemble_array(_qwen_histories()[0][0], None, {}, {"other": 1})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_template_assemble_array_is_assemble(family):
    fmt = _format(family)
    out, history = tool_turn(fmt, family)
    for messages, restored in ((CONVERSATION[:2], {}), (history, {2: out}), (history, {2: np.asarray(out)})):
        arr = fmt.assemble_array(messages, [READ], restored, KWARGS)
        assert arr.dtype == np.uint32 and arr.tolist() == fmt.assemble(messages, [READ], restored, KWARGS)


def _reference_body_digest(body) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                                     default=str).encode("utf-8", "surrogatepass")).hexdigest()


def test_body_digest_is_the_canonical_json_digest():
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": "hé \u2028 \"q\""}], "max_tokens": 3},
        {"messages": [{"content": "x", "role": "user"}], "stream": True},  # key order does not matter
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "p"}]},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {}}]},
                      {"role": "tool", "tool_call_id": "c", "content": "r", "x": True},
                      {"role": "tool", "tool_call_id": "c", "content": "r", "x": 1},
                      {"role": "tool", "tool_call_id": "c", "content": "r", "x": 1.0},
                      {"role": "user", "content": "lone \ud800"}], "temperature": 0.5, "tools": TOOLS},
        {"messages": [], "zz": {"b": 1, "a": [2]}},
        {"messages": "not a list"},
        {},
    ]
    for body in bodies:
        assert body_digest(body) == _reference_body_digest(body)
        assert body_digest(body) == _reference_body_digest(body)  # and again, from the cache
    assert body_digest(bodies[2]) != body_digest({**bodies[2], "messages": bodies[2]["messages"][:3]})


# ------------------------------------------------------------------ the recorder: arrays vs lists
def _record_all(tmp_path, name: str, calls, as_array: bool, keep_shas: bool = True) -> tuple[list[str], list[bytes]]:
    tee = io.StringIO()
    log = open_log(str(tmp_path / name), create=True)
    rec = Recorder(log, producer="t", tee=tee, min_prefix=1)
    if not keep_shas:  # the reference path: every reference to a whole path hashes that path in full
        rec._keep_sha = lambda key, sha: None
    rec.open_execution("ex", "task", "2030-01-01T00:00:00Z", "p")
    for rid, inp, out, parent in calls:
        conv = (lambda a: np.asarray(a, dtype=np.uint32)) if as_array else list
        rec.record_request("ex", rid, conv(inp), conv(out), [-0.5] * len(out), parent_request_id=parent)
    rec.flush()
    paths = [rec.ingestor.request_path("ex", rid) for rid, *_ in calls]
    rec.close()
    log.close()
    return tee.getvalue().splitlines(), paths


@st.composite
def _conversations(draw):
    """Recorded calls: each input extends a whole earlier path, a prefix of one, or nothing (a divergence)."""
    tokens = st.lists(st.integers(0, 50), min_size=1, max_size=6)
    calls, paths = [], []
    for i in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["extend", "extend", "prefix", "fresh"])) if paths else "fresh"
        parent = None
        if kind == "fresh":
            inp = draw(tokens)
        else:
            j = draw(st.integers(0, len(paths) - 1))
            cut = len(paths[j]) if kind == "extend" else draw(st.integers(1, len(paths[j])))
            inp = paths[j][:cut] + draw(tokens)
            parent = calls[j][0] if draw(st.booleans()) else None
        out = draw(tokens)
        calls.append((f"r{i}", inp, out, parent))
        paths.append(inp + out)
    return calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=_conversations())
def test_recorder_records_the_same_lines_from_arrays_lists_and_full_hashes(tmp_path_factory, calls):
    tmp = tmp_path_factory.mktemp("rec")
    fast, fast_paths = _record_all(tmp, "a", calls, as_array=True)
    slow, slow_paths = _record_all(tmp, "b", calls, as_array=False, keep_shas=False)
    assert fast == slow and fast_paths == slow_paths
    assert [np.frombuffer(p, "<u4").tolist() for p in fast_paths] == [inp + out for _, inp, out, _ in calls]
    recorded = {rid: inp + out for rid, inp, out, _ in calls}
    for line in map(json.loads, fast):
        ref = line.get("input_prefix")
        if ref is not None:  # the kept SHA-256 state gives the prefix's own hash
            assert ref["sha256"] == tokens_sha256(np.asarray(recorded[ref["request_id"]][:ref["length"]], np.uint32))


def test_recorder_retry_is_a_duplicate_and_other_content_a_conflict(tmp_path):
    log = open_log(str(tmp_path / "s"), create=True)
    rec = Recorder(log, producer="t")
    rec.open_execution("ex", "task", "2030-01-01T00:00:00Z", "p")
    a = np.arange(40, dtype=np.uint32)
    rec.record_request("ex", "r1", a, [1, 2], [-0.1, -0.1])
    rec.record_request("ex", "r2", np.concatenate((a, [1, 2, 3])).astype(np.uint32), [4], [-0.1])
    first = rec.record_request("ex", "r2", list(range(40)) + [1, 2, 3], [4], [-0.1])  # a retry, as a list
    assert first["input_prefix"]["request_id"] == "r1"
    rec.flush()
    assert rec.duplicates == 1
    rec.record_request("ex", "r2", list(range(40)) + [1, 2, 9], [4], [-0.1])  # same id, other content
    with pytest.raises(Exception, match="conflict"):
        rec.flush()
    rec.close()
    log.close()


# ------------------------------------------------------------------ the ingestor's reference check
def _line(rid: str, inp: list[int] | None, out: list[int], ref: dict | None = None, suffix=None) -> dict:
    line = {"type": "request", "execution_id": "ex", "request_id": rid, "output_ids": out,
            "output_logprobs": [-0.1] * len(out), "producer": "t"}
    if ref is None:
        line["input_ids"] = inp
    else:
        line.update(input_prefix=ref, input_suffix_ids=suffix)
    return line


def _ref(rid: str, path: list[int], n: int | None = None, sha: str | None = None) -> dict:
    n = len(path) if n is None else n
    return {"request_id": rid, "length": n, "sha256": sha or tokens_sha256(np.asarray(path[:n], np.uint32))}


def test_ingestor_checks_whole_path_references_from_kept_states(tmp_path):
    log = open_log(str(tmp_path / "s"), create=True)
    ing = Ingestor(log, producer="t", seal=None)
    opened = {"type": "execution_opened", "execution_id": "ex", "task_id": "t", "deadline": "2030-01-01T00:00:00Z",
              "policy": "p", "producer": "t"}
    p1 = list(range(30)) + [7]
    p2 = p1 + [8, 9] + [10]
    p3 = p2 + [11] + [12]
    chain = [opened, _line("r1", list(range(30)), [7]), _line("r2", None, [10], _ref("r1", p1), [8, 9]),
             _line("r3", None, [12], _ref("r2", p2), [11])]
    ev = lambda line: validate_line(line, now_micros=1_700_000_000_000_000, producer="t")  # noqa: E731
    ing.submit([(i, ev(x)) for i, x in enumerate(chain[:3])])  # r2 refers to r1 within one batch
    assert set(ing._shas) == {("ex", "r1"), ("ex", "r2")}  # r1 hashed once, r2's state continued from it
    ing.submit([(4, ev(chain[3]))])  # r3 to r2, from the state kept after that batch
    assert ing._shas[("ex", "r3")].hexdigest() == tokens_sha256(np.asarray(p3, np.uint32))
    assert ing.request_path("ex", "r3") == np.asarray(p3, "<u4").tobytes()
    # a reference to a part of a path, and one to a whole path with a wrong hash
    ing.submit([(5, ev(_line("r4", None, [1], _ref("r3", p3, 5), [2])))])
    with pytest.raises(IngestError, match="sha256 of the first 36 tokens of request 'r3' does not match"):
        ing.submit([(6, ev(_line("r5", None, [1], _ref("r3", p3, sha="0" * 64), [2])))])
    fresh = Ingestor(log, producer="t", seal=None)  # no kept state: the path is hashed once, in full
    fresh.submit([(7, ev(_line("r6", None, [1], _ref("r3", p3), [2])))])
    log.close()


# ------------------------------------------------------------------ the gateway, end to end
REPLIES = ["Sure, reading it.", "<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"a\"}}\n</tool_call>",
           "Done."]


def _conversation(tmp_path, name: str, reference: bool, monkeypatch) -> tuple[list[str], list]:
    if reference:
        monkeypatch.setattr(gateway_module, "_share_inputs", lambda *_: None)  # every call keeps its own input array
        monkeypatch.setattr(QwenFormat, "assemble_array", ChatFormat.assemble_array)
        monkeypatch.setattr(Recorder, "_keep_sha", lambda self, key, sha: None)
        monkeypatch.setattr(gateway_module, "_small_turn", lambda *_: False)  # every turn's work in a thread
    store = tmp_path / name
    from ledger.cli import main as cli_main

    assert cli_main(["--store", str(store), "init"]) == 0
    tee = io.StringIO()
    log = open_log(str(store))
    rec = Recorder(log, producer="gw", tee=tee)
    gw = Gateway(rec, upstream="http://unused", api="vllm", tokenizer_name="qwen3.6-27b",
                 state_db=gateway_db_path(store), model="m")
    turn = iter(range(100))

    async def upstream(prompt, body, prompt_json=None):
        assert isinstance(prompt, np.ndarray) and prompt_json == ",".join(map(str, prompt.tolist())).encode()
        ids = chatml.encode(REPLIES[next(turn) % len(REPLIES)]) + [chatml.IM_END_ID]
        return Completion(ids, [-0.25] * len(ids), "stop")

    gw._upstream = upstream

    async def main() -> None:
        msgs = [{"role": "system", "content": "sys " * 300}, {"role": "user", "content": "go"}]
        for i in range(5):
            h = _Headers("ex", "main", "main", "task", f"r{i}", True, "t", "2030-01-01T00:00:00Z")
            resp = await gw.chat(h, gw.parse_body({"model": "m", "messages": msgs, "tools": TOOLS}))
            sent = msgs
            m = resp["choices"][0]["message"]
            msgs = msgs + [{k: m[k] for k in ("role", "content", "tool_calls") if m.get(k) is not None}]
            msgs += ([{"role": "tool", "tool_call_id": c["id"], "content": "x = 1"} for c in m["tool_calls"]]
                     if m.get("tool_calls") else [{"role": "user", "content": f"next {i}"}])
            if i == 2:  # an edited history: drift, the tree branches
                msgs[1] = {"role": "user", "content": "go (edited)"}
        h = _Headers("ex", "main", "main", "task", "again", True, None, None)  # a resample of the last call
        await gw.chat(h, gw.parse_body({"model": "m", "messages": sent, "tools": TOOLS}))
        await gw.close()

    asyncio.run(main())
    rec.close()
    log.close()
    return tee.getvalue().splitlines(), gw.executions["ex"].calls["main"]


def test_gateway_fast_and_reference_paths_record_identical_lines(tmp_path, monkeypatch):
    seen: list[bool] = []
    real = gateway_module._small_turn
    monkeypatch.setattr(gateway_module, "_small_turn", lambda *a: seen.append(real(*a)) or seen[-1])
    fast, fast_calls = _conversation(tmp_path, "fast", False, monkeypatch)
    assert seen[0] is False and seen.count(True) >= 3  # the first turn in a thread, restored turns on the loop
    slow, slow_calls = _conversation(tmp_path, "slow", True, monkeypatch)
    assert fast == slow
    assert [c.input.tolist() for c in fast_calls] == [c.input.tolist() for c in slow_calls]
    owners = {id(c.input if c.input.base is None else c.input.base) for c in fast_calls}
    assert len(owners) <= 3 < len(fast_calls) == 6  # two branches (and the resample's): inputs share their arrays
    requests = [json.loads(x) for x in fast if json.loads(x)["type"] == "request"]
    assert len(requests) == 6 and sum("input_prefix" in r for r in requests) >= 4


@pytest.mark.parametrize("ids", [[], [0], [9, 10, 99, 100, 262143], [262144, 5, 2**32 - 1], list(range(0, 250000, 997))])
def test_token_id_json_is_the_decimal_text(ids):
    from ledger.gateway.calls import _ids_json

    want = ",".join(map(str, ids)).encode()
    assert _ids_json(ids) == want and _ids_json(np.asarray(ids, dtype=np.uint32)) == want
    assert json.loads(b"[" + want + b"]") == ids


# ------------------------------------------------------------------ validation of packed lists, UTF-8 of a body
_REQUEST = {"type": "request", "execution_id": "ex", "request_id": "r", "output_logprobs": [-0.5], "agent_id": "a",
            "producer": "t"}


@settings(max_examples=50, deadline=None)
@given(inp=st.lists(st.integers(0, 2**32 - 1), max_size=40), out=st.integers(0, 2**32 - 1))
def test_token_list_validates_as_the_plain_list(inp, out):
    from ledger.algorithms.tokens import TokenList

    plain = validate_line({**_REQUEST, "input_ids": inp, "output_ids": [out]}, now_micros=0)
    packed = validate_line({**_REQUEST, "input_ids": TokenList(np.asarray(inp, dtype=np.uint32)),
                            "output_ids": TokenList(np.asarray([out], dtype=np.uint32))}, now_micros=0)
    assert packed == plain and TokenList(np.asarray(inp, dtype=np.uint32)) == inp
    assert json.dumps(TokenList(np.asarray(inp, dtype=np.uint32))) == json.dumps(inp)


def test_token_list_changed_after_it_was_built_is_validated_as_a_list():
    from ledger.algorithms.tokens import TokenList
    from ledger.events.validate import ValidationError

    ids = TokenList(np.asarray([1, 2], dtype=np.uint32))
    ids.append(-1)
    with pytest.raises(ValidationError, match="input_ids"):
        validate_line({**_REQUEST, "input_ids": ids, "output_ids": [1]}, now_micros=0)
    ids[-1] = 7
    assert validate_line({**_REQUEST, "input_ids": ids, "output_ids": [1]}, now_micros=0)["input_ids"] == \
        np.asarray([1, 2, 7], dtype="<u4").tobytes()


_TEXT = st.text(alphabet=st.sampled_from(["a", "é", "\u2028", '"', "\\", "\ud800", "\udfff", "\U0001f600"]), max_size=4)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(st.dictionaries(_TEXT, _JSON, max_size=3), min_size=1, max_size=3),
       extra=st.dictionaries(_TEXT.filter(lambda k: k != "messages"), _JSON, max_size=2))
def test_body_utf8_check_is_the_walk(messages, extra):
    """parse_body's one strict encode of the canonical JSON says what the per-string walk says, and parse_body
    answers exactly as with the walk alone."""
    from ledger.gateway import calls as g

    body = {**extra, "messages": [{**m, "role": "user", "content": m.get("content") if isinstance(
        m.get("content"), (str, list)) or m.get("content") is None else "x"} for m in messages]}
    assert g._all_utf8(body) == g._strings_utf8(body)

    def outcome():
        try:
            return g.Gateway.parse_body(body) is body
        except g.GatewayError as exc:
            return exc.status, exc.message, exc.param

    fast = outcome()
    real, g._all_utf8 = g._all_utf8, lambda _b: False
    try:
        assert outcome() == fast
    finally:
        g._all_utf8 = real


def test_event_loop_is_asyncio_unless_uvloop_is_asked_for_and_importable(monkeypatch):
    import sys

    from ledger.gateway.serve import event_loop, run_loop

    async def kind():
        return type(asyncio.get_running_loop()).__module__

    monkeypatch.delenv("LEDGER_GATEWAY_LOOP", raising=False)
    assert run_loop(kind()).startswith("asyncio")
    monkeypatch.setenv("LEDGER_GATEWAY_LOOP", "uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not importable: asyncio's loop, no error
    loop = event_loop()
    assert type(loop).__module__.startswith("asyncio")
    loop.close()


def test_small_turn_counts_the_new_messages_after_the_last_restored_output(monkeypatch):
    from ledger.gateway.calls import _small_turn

    msgs = [{"role": "system", "content": "s" * 10**6}, {"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x" * 100}]
    assert not _small_turn(msgs, {})  # nothing restored: the whole prompt is new
    assert _small_turn(msgs, {2: "r1"})  # the long system message was rendered by earlier calls
    monkeypatch.setattr(gateway_module, "INLINE_TEXT", 100)
    assert not _small_turn(msgs, {2: "r1"})  # {"content":"x..","role":"user"} is over 100 characters


# ------------------------------------------------------------------ the body digest: kept SHA-256 states
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": _TEXT | st.none()},
                                 optional={"name": _TEXT, "x": _JSON})
_OTHER_KEYS = st.dictionaries(st.sampled_from(["a", "max_tokens", "mess", "messages_", "model", "tools", "zz", "é"]),
                              _JSON, max_size=3)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 6), st.lists(_MESSAGE, max_size=3), _OTHER_KEYS), min_size=1,
                      max_size=8))
def test_body_digest_from_kept_states_is_the_canonical_json_digest(steps):
    """Histories that grow, are cut back, branch and repeat, with keys sorting before and after "messages": each
    body's digest (from a kept state when one matches) and UTF-8 verdict are those of one json.dumps of it."""
    from ledger.gateway import body as gb

    history: list[dict] = []
    for cut, new, other in steps:
        history = history[:cut] + [dict(m) for m in new]  # fresh dicts and strings, as a parsed request has
        body = {**other, "messages": list(history)}
        assert body_digest(body) == _reference_body_digest(body)
        assert gb.body_text(body) == json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        assert gb.all_utf8(body) == gateway_module._strings_utf8(body)


def test_body_digest_of_a_grown_history_hashes_only_its_new_messages(monkeypatch):
    from ledger.gateway import body as gb

    fed: list[int] = []
    real = gb._encode
    monkeypatch.setattr(gb, "_encode", lambda text: fed.append(len(text)) or real(text))
    msgs = [{"role": "system", "content": "s" * 10**5}, {"role": "user", "content": "go"}]
    body = {"model": "m", "messages": msgs, "tools": TOOLS}
    assert body_digest(body) == _reference_body_digest(body) and sum(fed) > 10**5
    for turn in range(3):
        msgs += [{"role": "assistant", "content": f"ok {turn}"}, {"role": "user", "content": f"more {turn}"}]
        fed.clear()
        assert body_digest({"model": "m", "messages": list(msgs), "tools": TOOLS}) == \
            _reference_body_digest({"model": "m", "messages": msgs, "tools": TOOLS})
        assert sum(fed) < 1000  # the two new messages and the tools, not the 100k-character system prompt
    for other, fresh in (({"model": "other"}, False), ({"max_tokens": 3}, True)):
        fed.clear()  # "model" sorts after "messages", "max_tokens" before: only the latter changes the head
        body = {"model": "m", "messages": msgs, "tools": TOOLS, **other}
        assert body_digest(body) == _reference_body_digest(body)
        assert (sum(fed) > 10**5) == fresh


def test_body_digest_is_exact_when_kept_states_are_evicted(monkeypatch):
    from ledger.gateway import body as gb

    monkeypatch.setattr(gb, "STATES_KEPT", 2)
    sessions = [[{"role": "system", "content": f"s{i}"}] for i in range(4)]
    for turn in range(3):
        for msgs in sessions:
            msgs.append({"role": "user", "content": f"t{turn} \ud800"})
            body = {"messages": list(msgs), "stream": False}
            assert body_digest(body) == _reference_body_digest(body)
            assert not gb.all_utf8(body)
    assert len(gb._states) <= 2


def test_keep_heap_sets_glibc_malloc_unless_asked_not_to(monkeypatch):
    import platform

    monkeypatch.setenv("LEDGER_GATEWAY_MALLOC", "default")
    assert serve_module.keep_heap() is False
    monkeypatch.delenv("LEDGER_GATEWAY_MALLOC")
    assert serve_module.keep_heap() is (platform.libc_ver()[0] == "glibc")


def test_turn_text_is_one_object_per_content():
    """A long system prompt parsed anew each request renders to the same str object: the tokenizer's cache finds it
    by its kept hash (no copy and hash of the whole turn per call); the text is the template's."""
    a, b = "x" * 1000, "".join(["x"] * 1000)
    assert a is not b
    assert chatml._turn_text("system", a) is chatml._turn_text("system", b)
    assert chatml._turn_text("system", b) == f"{chatml.IM_START}system\n{a}{chatml.IM_END}\n"
    assert chatml._turn_text("user", ["p"]) == f"{chatml.IM_START}user\n['p']{chatml.IM_END}\n"
    msgs = [{"role": "system", "content": b}, {"role": "user", "content": "hi"}]
    assert chatml.render_array(msgs).tolist() == chatml.render_prompt(msgs)
