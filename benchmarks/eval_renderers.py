"""PrimeIntellect's `renderers` (PyPI) against Hugging Face `apply_chat_template` and the gateway's
own model layer (`ledger.producers.models`) on the real templates of ../shared/testdata: exactness,
incremental rendering, tool-call parsing, time per turn at 40 messages. Not one of `python -m
benchmarks`: `renderers` is no dependency of the ledger (docs/dependencies.md says why). Run it in
a throwaway venv that has `renderers`, `httpx` (renderers imports it without declaring it) and
`transformers` (no torch), with the project's packages visible after the venv's own:

    python -m venv /tmp/rv && /tmp/rv/bin/pip install renderers==0.1.12 httpx transformers
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/rv/lib/python3.11/site-packages/zz.pth
    PYTHONPATH=. /tmp/rv/bin/python benchmarks/eval_renderers.py /tmp/renderers.json

The llama.cpp test vocabularies are older releases of each family's vocabulary: special tokens a
hand-coded renderer insists on and they lack are added to the tokenizer (listed per family), for
all three renderings alike. A model's completion is the assistant turn as the template writes it,
up to its end-of-turn token."""
import json
import sys
import time
from pathlib import Path

import renderers
from renderers import create_renderer
from transformers import PreTrainedTokenizerFast

from ledger.producers.models import load_format

SHARED = Path(__file__).resolve().parents[2] / "shared" / "testdata"
T, V = SHARED / "chat-templates", SHARED / "tokenizers"
CASES = [  # family, template, vocabulary, renderers config
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", "ggml-vocab-qwen2.gguf", renderers.Qwen3RendererConfig()),
    ("qwen3.5", "Qwen3.5-4B.jinja", "ggml-vocab-qwen35.gguf", renderers.Qwen35RendererConfig()),
    ("llama-3", "meta-llama-Llama-3.1-8B-Instruct.jinja", "ggml-vocab-llama-bpe.gguf", renderers.Llama3RendererConfig()),
    ("gemma4", "google-gemma-4-31B-it.jinja", "ggml-vocab-gemma-4.gguf", renderers.Gemma4RendererConfig()),
    ("gemma4-interleaved", "google-gemma-4-31B-it-interleaved.jinja", "ggml-vocab-gemma-4.gguf",
     renderers.Gemma4RendererConfig()),
    ("default/mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "ggml-vocab-llama-spm.gguf",
     renderers.DefaultRendererConfig()),
    ("default/phi-3.5", "microsoft-Phi-3.5-mini-instruct.jinja", "ggml-vocab-phi-3.gguf",
     renderers.DefaultRendererConfig()),
]
TOOLS = [{"type": "function", "function": {"name": "read", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}, "required": ["path"]}}}]


def conversation(n_pairs: int, ids: str = "call"):
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix x.py, please."}]
    for k in range(n_pairs):
        cid = f"{ids}{k:05d}"[:9] if ids == "mistral" else f"{ids}_{k}"
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "read", "arguments": {"path": f"src/m{k}.py", "n": k}}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "name": "read", "content": f"line {k}: def f{k}(): return {k}"})
    msgs.append({"role": "assistant", "content": "Done: the bug was in m0.py."})
    msgs.append({"role": "user", "content": "Thanks!"})
    return msgs


def hf_tokenizer(fmt):
    sp = fmt.special
    tok = PreTrainedTokenizerFast(tokenizer_object=fmt.tokenizer, chat_template=fmt.template_source,
                                  bos_token=sp.get("bos_token"), eos_token=sp.get("eos_token"))
    return tok


def build(vocab, tpl, cfg):
    """The format, HF tokenizer and renderer; special tokens a hand-coded renderer insists on that the
    llama.cpp test vocabulary lacks (an older release of the family's vocabulary) are added to it."""
    import re
    from ledger.producers.models.template import TemplateFormat
    from tokenizers import AddedToken

    added = []
    while True:
        base = load_format(str(V / vocab), chat_template=str(T / tpl))
        if added:
            base.tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
        fmt = TemplateFormat(base.tokenizer, base.template_source, name=base.name, special=base.special,
                             eos_ids=[i for i in base.end_of_turn])
        tok = hf_tokenizer(fmt)
        try:
            return fmt, tok, create_renderer(tok, cfg), added
        except AssertionError as exc:
            m = re.search(r"Special token '([^']+)' not found", str(exc))
            if not m or len(added) > 20:
                raise
            added.append(m.group(1))


def hf_ids(tok, msgs, tools, gp=True):
    out = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gp, tokenize=True, return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def timed(fn, reps=3):
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        r = fn()
        best = min(best, time.perf_counter() - t)
    return r, best


def main():
    report = {}
    for family, tpl, vocab, cfg in CASES:
        row = {}
        fmt, tok, r, added = build(vocab, tpl, cfg)
        if added:
            row["special_tokens_added_to_test_vocab"] = added
        row["renderer"] = type(r).__name__
        msgs = conversation(19, "mistral" if "mistral" in family else "call")  # 40 messages
        assert len(msgs) == 42
        msgs40 = msgs[:40]  # ends with a tool result: the next turn is the model's
        # exactness on every prefix that ends where the model is to answer (after user/tool)
        ends = [i for i in range(2, 41) if msgs[i - 1]["role"] in ("user", "tool")]
        eq_ours = eq_r = 0
        first_r_diff = None
        for i in ends:
            ref = hf_ids(tok, msgs[:i], TOOLS)
            ours = fmt.assemble(msgs[:i], TOOLS, {})
            try:
                theirs = r.render_ids(msgs[:i], tools=TOOLS, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001
                theirs = f"{type(exc).__name__}: {exc}"
            eq_ours += ours == ref
            eq_r += theirs == ref
            if theirs != ref and first_r_diff is None:
                if isinstance(theirs, str):
                    first_r_diff = theirs[:200]
                else:
                    k = next((j for j, (a, b) in enumerate(zip(ref, theirs)) if a != b), min(len(ref), len(theirs)))
                    first_r_diff = f"at {i} msgs, token {k}: ref {fmt.decode(ref[k:k+8])!r} renderers {fmt.decode(theirs[k:k+8])!r}"
        row["exact_vs_hf"] = {"ours": f"{eq_ours}/{len(ends)}", "renderers": f"{eq_r}/{len(ends)}"}
        if first_r_diff:
            row["renderers_first_diff"] = first_r_diff
        # incremental: each turn's prompt from the previous prompt + completion + new messages
        completions = {}
        turn_prompts = []
        for i in ends:
            turn_prompts.append(hf_ids(tok, msgs[:i], TOOLS))
        for a, b in zip(ends, ends[1:]):  # the assistant message at index a: the model's completion
            tp = fmt.render_text(msgs[:a], TOOLS, True)
            tf = fmt.render_text(msgs[:a + 1], TOOLS, False)
            L = len(tp) if tf.startswith(tp) else next(j for j, (x, y) in enumerate(zip(tp, tf)) if x != y)
            while L and tf[L - 1] not in "\n>":  # not inside a special token's text
                L -= 1
            comp = fmt.encode(tf[L:])
            k = next((j for j, t in enumerate(comp) if t in fmt.end_of_turn), None)
            completions[a] = comp[:k + 1] if k is not None else None
        counts = {"ours_extends": 0, "renderers_extends": 0, "ours_eq_renderers": 0, "ours_eq_hf_full": 0,
                  "renderers_eq_hf_full": 0, "renderers_none": 0}
        n_bridge = 0
        t_bridge = t_ours = 0.0
        restored = {}
        prev = None
        prev_first = fmt.assemble(msgs[:ends[0]], TOOLS, {})
        for (a, b), prompt_b in zip(zip(ends, ends[1:]), turn_prompts[1:]):
            comp = completions[a]
            if comp is None:
                continue
            restored[a] = comp
            if prev is None:
                prev = fmt.assemble(msgs[:a], TOOLS, {j: c for j, c in restored.items() if j < a})
            n_bridge += 1
            t0 = time.perf_counter()
            try:
                br = r.bridge_to_next_turn(prev, comp, msgs[a + 1:b], tools=TOOLS)
            except Exception:  # noqa: BLE001
                br = None
            t_bridge += time.perf_counter() - t0
            br_ids = list(br.token_ids) if br is not None else None
            t0 = time.perf_counter()
            ours = fmt.assemble(msgs[:b], TOOLS, dict(restored))
            t_ours += time.perf_counter() - t0
            head = prev + comp
            counts["ours_extends"] += ours[:len(head)] == head
            counts["renderers_extends"] += br_ids is not None and br_ids[:len(head)] == head
            counts["renderers_none"] += br_ids is None
            counts["ours_eq_renderers"] += ours == br_ids
            counts["ours_eq_hf_full"] += ours == prompt_b
            counts["renderers_eq_hf_full"] += br_ids == prompt_b
            prev = ours
        row["incremental"] = {k: f"{v}/{n_bridge}" for k, v in counts.items()}
        # speed at 40 messages (best of 3): one full render, one turn
        _, t_full_hf = timed(lambda: hf_ids(tok, msgs40, TOOLS))
        _, t_full_r = timed(lambda: r.render_ids(msgs40, tools=TOOLS, add_generation_prompt=True))
        fmt._encode_cached.cache_clear()
        _, t_ours_cold = timed(lambda: fmt.assemble(msgs40, TOOLS, {}), reps=1)
        restored40 = {j: c for j, c in restored.items() if j < 40}
        _, t_ours_turn = timed(lambda: fmt.assemble(msgs40, TOOLS, restored40))
        row["ms_at_40_messages"] = {"hf_full": round(t_full_hf * 1e3, 2), "renderers_full": round(t_full_r * 1e3, 2),
                                    "ours_full_cold": round(t_ours_cold * 1e3, 2),
                                    "ours_turn_restored_warm": round(t_ours_turn * 1e3, 2),
                                    "renderers_bridge_mean": round(t_bridge / max(n_bridge, 1) * 1e3, 3),
                                    "ours_turn_mean": round(t_ours / max(n_bridge, 1) * 1e3, 3)}
        # tool-call parsing of the first assistant turn as the template writes it (the family's syntax)
        first = completions.get(ends[0]) or fmt.encode(fmt.render_text(msgs[:3], TOOLS, False)[
            len(fmt.render_text(msgs[:2], TOOLS, True)):])
        want = [("read", {"path": "src/m0.py", "n": 0})]
        mine = fmt.parse_output(first, TOOLS)
        row["first_call_text"] = fmt.decode(first)[:90]
        row["parse_first_call"] = {"ours": [(c.name, json.loads(c.arguments)) for c in mine.tool_calls] == want}
        try:
            pr = r.parse_response(first, tools=TOOLS, prompt_ids=prev_first)
            got = [(c.name, c.arguments if isinstance(c.arguments, dict) else json.loads(c.arguments))
                   for c in (pr.tool_calls or [])]
            row["parse_first_call"]["renderers"] = got == want or repr(got)[:120]
        except Exception as exc:  # noqa: BLE001
            row["parse_first_call"]["renderers"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        # one turn at 40 messages, best of 5: ours (restored, tokenizer cache warm) vs the bridge
        last_a = max((a for a in restored if a < 39), default=None)
        if last_a is not None:
            prev39 = fmt.assemble(msgs[:last_a], TOOLS, {j: c for j, c in restored.items() if j < last_a})
            _, tb = timed(lambda: r.bridge_to_next_turn(prev39, restored[last_a], msgs[last_a + 1:40], tools=TOOLS), 5)
            _, to = timed(lambda: fmt.assemble(msgs40, TOOLS, restored40), 5)
            row["last_turn_ms_best_of_5"] = {"ours": round(to * 1e3, 3), "renderers_bridge": round(tb * 1e3, 3)}
        report[family] = row
        print(family, json.dumps(row), flush=True)
    Path(sys.argv[1] if len(sys.argv) > 1 else "renderers-eval.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
