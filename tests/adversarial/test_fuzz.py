"""Fuzzing `ledger ingest` (SPEC §9 "No tracebacks"; issue 13).

Hypothesis writes JSON-lines files -- random JSON values, plausible events with a field
deleted or replaced, random bytes, deep nesting, huge and non-finite numbers, lone
surrogates -- and runs them through the CLI's ``main()`` in-process against one store.
Whatever the file holds: no traceback and no ``internal error`` (every bad input has its own
message), the exit code is 0, 1 or 2, a refusal is one ``ledger:`` line first, and unless the
exit is 0 the log is unchanged (event count and the bytes of events.dat).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ledger.cli import main as cli
from ledger.log import open_log

from ..helpers import DEADLINE, closed, opened, request

# ------------------------------------------------------------------ strategies
_scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                       max_leaves=10)
_weird = st.sampled_from([
    "", " ", "x" * 5000, -1, 0, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, 1.5, True, None, [], {}, [None], ["a"], [-1],
    [2 ** 40], "2030-13-45T99:00:00Z", "not-a-date", "e1", "r1", "\u0000", "\u202e", "\U0001F600",
])

TEMPLATES = [
    opened("e1"),
    opened("fz-{n}"),
    request("e1", "r1", [1, 2, 3], [4, 5]),
    request("e1", "r{n}", [1, 2, 3, 4, 5], [6]),
    request("e1", "p{n}", [], [7], input_prefix={"request_id": "r1", "tokens": 5}),
    closed("e1"),
    {"type": "tool_payload", "execution_id": "e1", "call_id": "c{n}", "kind": "call", "content": {"name": "ls"}},
    {"type": "assessment", "assessment_id": "a{n}", "execution_id": "e1", "artifact_version": "v1",
     "outcome": "scored", "reward": 0.5, "evaluator": "g@1"},
    {"type": "task_registered", "task_id": "t{n}", "fixture": "fx@1", "family": "f", "source": "s",
     "features": {"text": "hello"}},
    {"type": "cost_recorded", "execution_id": "e1", "cost_id": "k{n}", "usd": 0.01},
    {"type": "execution_opened", "execution_id": "fz-{n}", "task_id": "t1", "deadline": DEADLINE, "policy": "p@1",
     "collection_run_id": "run-1"},
]


@st.composite
def plausible_events(draw) -> str:
    """A catalog-shaped event with one field deleted, replaced by a random/odd value, or added."""
    ev = json.loads(json.dumps(draw(st.sampled_from(TEMPLATES))).replace("{n}", str(draw(st.integers(0, 10 ** 6)))))
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["delete", "replace", "weird", "add"]))
        field = draw(st.sampled_from(sorted(ev)))
        if op == "delete":
            ev.pop(field, None)
        elif op == "replace":
            ev[field] = draw(_values)
        elif op == "weird":
            ev[field] = draw(_weird)
        else:
            ev[draw(st.text(min_size=1, max_size=8))] = draw(_values)
    return json.dumps(ev, ensure_ascii=draw(st.booleans()))


def _surrogate_line(draw) -> str:
    """A plausible event whose id (or any string) carries a lone surrogate escape."""
    text = json.dumps(draw(st.sampled_from(TEMPLATES)))
    esc = draw(st.sampled_from(["\\ud800", "\\udfff", "\\udc00x", "\\ud83d", "a\\ude00", "\\ud83d\\ude00"]))
    return text.replace('"e1"', f'"{esc}"', 1) if '"e1"' in text else text.replace('"t1"', f'"{esc}"', 1)


@st.composite
def lines(draw) -> bytes:
    kind = draw(st.sampled_from(["json", "event", "event", "event", "bytes", "deep", "number", "surrogate"]))
    if kind == "json":
        return json.dumps(draw(_values)).encode()
    if kind == "event":
        return draw(plausible_events()).encode("utf-8", "surrogatepass")
    if kind == "bytes":
        return draw(st.binary(max_size=80))
    if kind == "deep":
        d = draw(st.integers(60, 3000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        inner = opener * d + ("1" if opener != "[" else "") + closer * d
        where = draw(st.sampled_from(["bare", "features"]))
        if where == "bare":
            return inner.encode()
        return ('{"type": "task_registered", "task_id": "td", "fixture": "f@1", "family": "f", "features": {"x": '
                + inner + "}}").encode()
    if kind == "number":
        num = draw(st.sampled_from(["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9" * 5000, "1" + "0" * 30,
                                    "18446744073709551616", "-9223372036854775809", "1e-400", "0.1e1", "-0"]))
        field = draw(st.sampled_from(["input_ids", "output_ids", "output_logprobs", "reward", "usd"]))
        base = draw(st.sampled_from([TEMPLATES[2], TEMPLATES[7], TEMPLATES[9]]))
        text = json.dumps({**base, field: None})
        if field in ("input_ids", "output_ids", "output_logprobs"):
            return text.replace(f'"{field}": null', f'"{field}": [1, {num}]').encode()
        return text.replace(f'"{field}": null', f'"{field}": {num}').encode()
    return _surrogate_line(draw).encode()


# ------------------------------------------------------------------ the property
@pytest.fixture
def store(tmp_path, monkeypatch):
    s = tmp_path / "store"
    monkeypatch.setenv("LEDGER_STORE", str(s))
    assert cli(["init"]) == 0
    (tmp_path / "seed.jsonl").write_text(json.dumps(opened("e1")) + "\n"
                                         + json.dumps(request("e1", "r1", [1, 2, 3], [4, 5])) + "\n")
    assert cli(["ingest", str(tmp_path / "seed.jsonl")]) == 0
    return s


def _state(store: Path) -> tuple[int, bytes]:
    with open_log(str(store)) as log:
        return log.size(), (store / "events.dat").read_bytes()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(lines(), min_size=1, max_size=4), trailing_newline=st.booleans())
def test_ingest_never_tracebacks(store, tmp_path, capsys, batch, trailing_newline):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(batch) + (b"\n" if trailing_newline else b""))
    before = _state(store)
    capsys.readouterr()
    code = cli(["ingest", str(path)])
    event(f"exit {code}")
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "internal error" not in err, err  # every bad input has a message of its own
    assert code in (0, 1, 2)
    if code == 2:
        assert err.startswith("ledger: ") and err.endswith("\n")
    if code != 0:
        assert _state(store) == before  # refused or conflicting: nothing appended
