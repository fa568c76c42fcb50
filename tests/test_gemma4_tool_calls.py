"""Gemma 4's tool-call family (SPEC §11.3, issue 28): its own argument syntax, written by its real
chat template (``format_argument``: strings between ``<|"|>`` unescaped, bare sorted keys, Jinja's
printing of numbers and ``None``), read back into OpenAI ``tool_calls`` with JSON arguments."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.chat_restore import assistant_key, message_key
from ledger.algorithms.tool_parsers import detect_family, gemma4_arguments, parse_tool_output
from ledger.producers.models.template import compile_template

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "testdata" / "chat-templates"
GEMMA = ["google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"]
AWKWARD = {"cmd": 'echo "hi, {there}" : [x]', "nested": {"deep": {"ok": False, "xs": [1, -2.5, "a,b"]}},
           "n": 0, "flag": True, "none": None, "empty": {}, "list": [], "text": "line1\nline2 'q' \\ é 🙂"}


def _template(name: str) -> str:
    path = TEMPLATES / name
    if not path.exists():
        pytest.skip(f"no shared chat template {path}")
    return path.read_text(encoding="utf-8")


@lru_cache(maxsize=4)
def _compiled(source: str):
    return compile_template(source)


def _render_call(source: str, name: str, args: dict) -> str:
    """The assistant turn the real template writes for one call (arguments as an object, as the
    gateway passes them), as ``transformers`` renders it."""
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}]}]
    text = _compiled(source).render(messages=msgs, add_generation_prompt=False, bos_token="<bos>")
    return text.split("<|turn>model\n", 1)[1]


@pytest.mark.parametrize("name", GEMMA)
def test_both_gemma4_templates_are_detected(name):
    assert detect_family(_template(name)) == "gemma4"


@pytest.mark.parametrize("name", GEMMA)
def test_awkward_values_round_trip_through_the_real_template(name):
    turn = _render_call(_template(name), "run", AWKWARD)
    assert turn.startswith('<|tool_call>call:run{cmd:<|"|>echo "hi, {there}" : [x]<|"|>,empty:{},flag:true,')
    # the plain template opens the tool results after the calls, the interleaved one ends the turn
    assert "none:None" in turn and turn.endswith(("<tool_call|><|tool_response>", "<tool_call|><turn|>\n"))
    parsed = parse_tool_output("gemma4", turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("run", AWKWARD)]
    assert (parsed.content, parsed.malformed) == ("", 0)


def test_output_with_reasoning_content_and_two_calls():
    text = ('<|channel>thought\nneed both files<channel|>Reading.<|tool_call>call:read{path:<|"|>a.py<|"|>}'
            '<tool_call|><|tool_call>call:read{<|"|>path<|"|>: <|"|>b.py<|"|>, n: 3}<tool_call|><|tool_response>')
    p = parse_tool_output("gemma4", text)
    assert (p.reasoning, p.content) == ("need both files", "Reading.")
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("read", '{"path": "a.py"}'),
                                                            ("read", '{"path": "b.py", "n": 3}')]
    assert p.tool_calls[0].text == 'call:read{path:<|"|>a.py<|"|>}'


@pytest.mark.parametrize("bad", ['{path:<|"|>a.py}', "{path}", "{n:1,}", "{n:nan}", "{n:1} extra", "[1]",
                                 '{a:{b:[1,2}}', "{n:two words}"])
def test_malformed_arguments_stay_content(bad):
    text = f"<|tool_call>call:f{bad}<tool_call|>"
    assert gemma4_arguments(bad) is None
    p = parse_tool_output("gemma4", text)
    assert p.tool_calls == () and p.content == text and p.malformed == (1 if bad.endswith("}") else 0)


def test_plain_answer_is_content():
    p = parse_tool_output("gemma4", "The answer is 4.<turn|>")
    assert (p.content, p.tool_calls, p.reasoning) == ("The answer is 4.", (), "")


def test_restoration_by_call_id_compares_arguments_parsed():
    """The parsed call, echoed by a harness with its own key order and spacing under its call id,
    is the same assistant message (the key restoration matches on)."""
    p = parse_tool_output("gemma4", '<|tool_call>call:read{n:2,path:<|"|>b.py<|"|>}<tool_call|>')
    ours = assistant_key(p.content, [{"id": "x1", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in p.tool_calls])
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x1", "type": "function", "function": {"name": "read", "arguments": '{\n "path": "b.py",\n "n": 2}'}}]}
    assert message_key(echoed) == ours
    other = {**echoed, "tool_calls": [{"id": "x1", "function": {"name": "read", "arguments": '{"path": "b.py", "n": 3}'}}]}
    assert message_key(other) != ours


_KEY = st.text(st.characters(blacklist_characters=":,{}[]<|\"", blacklist_categories=("Cs", "Zs", "Cc")),
               min_size=1, max_size=6)
_LEAF = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
         | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12).filter(lambda s: '<|"|>' not in s))
_VALUE = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEY, inner, max_size=3),
                      max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEY, _VALUE, max_size=5))
def test_any_json_arguments_round_trip_through_the_template(args):
    """Invariant: what the real template writes for JSON arguments, the parser reads back equal."""
    turn = _render_call(_template(GEMMA[0]), "f", args)
    parsed = parse_tool_output("gemma4", turn)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", args)]
