"""The prefix tree of an execution as a server-rendered SVG (``ledger serve``, SPEC §6.1).

One bar per tree node, laid out like a branch graph: a node starts where its parent ends; its
first child continues on the parent's row, every further child (a divergence: a compaction,
a sub-agent, a resampled output) opens a row below.  A bar's width grows with the square root
of its token count (a 20,000-token system prompt and a 40-token output both stay readable)
and is split into spans coloured by token class:

* ``context`` — not a policy target candidate (prompts, tool results, reconstructed or
  non-policy outputs);
* ``target`` — a target token fixed by a path drawn on the selected route;
* ``not-selected`` — a policy target candidate that no drawn path of the selected route
  fixed (every candidate, when the selected route did not admit the execution);
* ``output`` — a policy target candidate, when no route is selected (an execution admitted
  nowhere still shows which tokens the policy generated).

One colour scheme (:data:`TREE_CSS`, :func:`legend_html`) on every page.  Each bar is labelled
(request id, agent, tokens, targets) where the row leaves room, and links to the decoded text of
a conversation through it (:mod:`ledger.view.text`).

Hovering a bar shows its ``<title>``: the token counts and the requests that end on it with
the tool calls they emitted and consumed.  Pure formatting over the read API's objects.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

CONTEXT, TARGET, NOT_SELECTED, OUTPUT = 0, 1, 2, 3
CLASS_NAMES = {CONTEXT: "context", TARGET: "target", NOT_SELECTED: "not-selected", OUTPUT: "output"}
CLASS_LABELS = {CONTEXT: "context (prompt, tool result, non-policy text: no loss)",
                TARGET: "loss target (fixed by a path drawn on the route)",
                NOT_SELECTED: "policy output not selected on the route",
                OUTPUT: "policy output (no route selected)"}
ROW_H, BAR_H, GAP, MARGIN = 32, 16, 2, 6
LABEL_CHAR_PX = 6.4
FIT_WIDTH, MAX_ZOOM = 1300.0, 8.0  # small trees are drawn wider, up to MAX_ZOOM times
_PREVIEW = 160


@dataclass
class NodeClasses:
    """Per node: the class of every token (uint8 array of CONTEXT / TARGET / NOT_SELECTED)."""

    classes: list[np.ndarray]

    def counts(self, node_id: int) -> dict[str, int]:
        c = self.classes[node_id]
        return {name: int(np.count_nonzero(c == k)) for k, name in CLASS_NAMES.items()}


def token_classes(loaded, targets_by_leaf: dict[str, np.ndarray] | None = None) -> NodeClasses:
    """Token classes of a :class:`projections.tree.LoadedTree`; ``targets_by_leaf`` maps a
    drawn path's leaf request id to its fixed target positions (indices into the path).
    ``None`` (no route selected): policy candidates are ``output``; a mapping (even empty):
    candidates no drawn path fixed are ``not-selected``."""
    other = OUTPUT if targets_by_leaf is None else NOT_SELECTED
    classes = [np.where(n.target != 0, other, CONTEXT).astype(np.uint8) for n in loaded.nodes]
    for leaf, positions in (targets_by_leaf or {}).items():
        if leaf not in loaded.requests:
            continue
        offset = 0
        pos = np.asarray(positions, dtype=np.int64)
        for nid in loaded.path_nodes(loaded.requests[leaf].node_id):
            n = loaded.nodes[nid].tokens.shape[0]
            local = pos[(pos >= offset) & (pos < offset + n)] - offset
            classes[nid][local] = TARGET
            offset += n
    return NodeClasses(classes)


def _width(tokens: int) -> float:
    return max(3.0, 0.9 * float(np.sqrt(tokens)))


def layout(loaded) -> tuple[dict[int, float], dict[int, float], dict[int, int], int]:
    """x, width and row of every node, and the number of rows."""
    x: dict[int, float] = {}
    w: dict[int, float] = {}
    row: dict[int, int] = {}
    next_row = 0
    stack: list[tuple[int, int | None]] = []
    roots = loaded.children.get(None, [])
    for i, c in enumerate(reversed(roots)):
        stack.append((c, None if i < len(roots) - 1 else 0))
    if roots:
        next_row = 1
    while stack:
        nid, r = stack.pop()
        if r is None:
            r, next_row = next_row, next_row + 1
        node = loaded.nodes[nid]
        row[nid] = r
        w[nid] = _width(node.tokens.shape[0])
        x[nid] = 0.0 if node.parent is None else x[node.parent] + w[node.parent] + GAP
        kids = loaded.children.get(nid, [])
        for i, c in enumerate(reversed(kids)):  # the first child is popped first and keeps this row
            stack.append((c, r if i == len(kids) - 1 else None))
    right = max((x[n] + w[n] for n in x), default=0.0)
    zoom = min(MAX_ZOOM, FIT_WIDTH / right) if right else 1.0
    if zoom > 1.0:  # a small tree: widen it to the page (widths stay proportional to the square root)
        x = {n: v * zoom for n, v in x.items()}
        w = {n: v * zoom for n, v in w.items()}
    return x, w, row, next_row


def _preview(payload) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, sort_keys=True)
    text = " ".join(text.split())
    return text if len(text) <= _PREVIEW else text[:_PREVIEW] + "…"


def node_title(loaded, nid: int, counts: dict[str, int], by_node: dict, tools: dict) -> str:
    n = loaded.nodes[nid]
    lines = [f"node #{nid}: {n.tokens.shape[0]:,} tokens (context {counts['context']:,}, target {counts['target']:,}, "
             f"not selected {counts['not-selected']:,}, policy output {counts['output']:,}); recorded by "
             f"{n.origin_request_id}"]
    for r in by_node.get(nid, []):
        lines.append(f"request {r.request_id}: agent {r.agent_id}, {r.role_class}, generator {r.generator}"
                     f"{', reconstructed' if r.reconstructed else ''}; input {r.input_len:,} + output {r.output_len:,} tokens")
        entry = tools.get(r.request_id, {})
        for side in ("emitted", "consumed"):
            for p in entry.get(side, []):
                what = "no cached payload (capture gap)" if p["kind"] is None else f"{p['kind']}: {_preview(p['payload'])}"
                lines.append(f"  tool {side} {p['call_id']} {what}")
    return "\n".join(lines)


def node_label(loaded, nid: int, counts: dict[str, int], by_node: dict) -> str:
    """The label drawn under a bar: the requests ending on it, their agent, tokens and targets."""
    reqs = by_node.get(nid, [])
    rid = reqs[0].request_id if reqs else ""
    rid = rid if len(rid) <= 14 else f"{rid[:4]}…{rid[-6:]}"  # a long message id: its ends (the title has it whole)
    who = (f"{rid}{f' +{len(reqs) - 1}' if len(reqs) > 1 else ''} · {reqs[0].agent_id[:16]}" if reqs else f"#{nid}")
    tgt = f" · {counts['target']:,} tgt" if counts["target"] else ""
    return f"{who} · {loaded.nodes[nid].tokens.shape[0]:,} tok{tgt}"


def _label_room(x: dict[int, float], w: dict[int, float], row: dict[int, int]) -> dict[int, float]:
    """Pixels from a bar's start to the next bar on its row (a label never runs into it)."""
    by_row: dict[int, list[int]] = {}
    for n in x:
        by_row.setdefault(row[n], []).append(n)
    room = {}
    for ids in by_row.values():
        ids.sort(key=lambda n: x[n])
        for a, b in zip(ids, ids[1:] + [None]):
            room[a] = (x[b] - x[a] - 8) if b is not None else 10_000.0
    return room


def _fit(text: str, px: float) -> str:
    n = int(px / LABEL_CHAR_PX)
    return "" if n < 4 else (text if len(text) <= n else text[:n - 1] + "…")


def tree_svg(loaded, classes: NodeClasses, tools: dict | None = None,
             href: Callable[[int], str | None] | None = None) -> str:
    """The SVG document (inline in the page); one ``<g class="node">`` per node, labelled, and a
    link (``href(node_id)``) to its decoded text."""
    tools = tools or {}
    x, w, row, rows = layout(loaded)
    room = _label_room(x, w, row)
    by_node: dict[int, list] = {}
    for r in loaded.requests.values():
        by_node.setdefault(r.node_id, []).append(r)
    width = MARGIN * 2 + max((x[n] + w[n] for n in x), default=0.0) + 160
    height = MARGIN * 2 + max(rows, 1) * ROW_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="tree" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="prefix tree of {html.escape(loaded.execution_id)}">']
    # connectors first, so the bars cover their ends
    for node in loaded.nodes:
        if node.parent is None:
            if row[node.node_id] == 0:
                continue
            px, py = MARGIN, MARGIN + BAR_H / 2
        else:
            px, py = MARGIN + x[node.parent] + w[node.parent], MARGIN + row[node.parent] * ROW_H + BAR_H / 2
        cy = MARGIN + row[node.node_id] * ROW_H + BAR_H / 2
        if row[node.node_id] != (row[node.parent] if node.parent is not None else 0):
            out.append(f'<path class="branch" d="M{px - 1:.1f},{py:.1f} V{cy:.1f} H{MARGIN + x[node.node_id]:.1f}"/>')
    for node in loaded.nodes:
        nid = node.node_id
        counts = classes.counts(nid)
        ntok = node.tokens.shape[0]
        bx, by = MARGIN + x[nid], MARGIN + row[nid] * ROW_H
        reqs = " ".join(r.request_id for r in by_node.get(nid, []))
        out.append(f'<g class="node" id="node-{nid}" data-node-id="{nid}" data-tokens="{ntok}" '
                   f'data-context="{counts["context"]}" data-target="{counts["target"]}" '
                   f'data-not-selected="{counts["not-selected"]}" data-output="{counts["output"]}" '
                   f'data-requests="{html.escape(reqs)}">')
        out.append(f"<title>{html.escape(node_title(loaded, nid, counts, by_node, tools))}</title>")
        link = href(nid) if href else None
        if link:
            out.append(f'<a href="{html.escape(link)}">')
        out.extend(_bar(classes.classes[nid], ntok, bx, by, w[nid]))
        label = _fit(node_label(loaded, nid, counts, by_node), room[nid])
        if label:
            out.append(f'<text class="label" x="{bx:.1f}" y="{by + BAR_H + 10:.1f}">{html.escape(label)}</text>')
        if link:
            out.append("</a>")
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _bar(c: np.ndarray, ntok: int, bx: float, by: float, width: float) -> list[str]:
    if ntok == 0:
        return [f'<rect class="context" x="{bx:.1f}" y="{by:.1f}" width="{width:.1f}" height="{BAR_H}"/>']
    edges = np.flatnonzero(np.diff(c)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [ntok]])
    scale = width / ntok
    return [f'<rect class="{CLASS_NAMES[int(c[s])]}" x="{bx + s * scale:.2f}" y="{by:.1f}" '
            f'width="{max((e - s) * scale, 0.3):.2f}" height="{BAR_H}"/>' for s, e in zip(starts.tolist(), ends.tolist())]


def legend_html(route: str | None, *, clickable: bool = True) -> str:
    """The one legend of token classes (tree bars and decoded text share it)."""
    shown = [CONTEXT, TARGET, NOT_SELECTED] if route else [CONTEXT, OUTPUT]
    items = "".join(f'<span class="sw {CLASS_NAMES[k]}"></span>{html.escape(CLASS_LABELS[k])}' for k in shown)
    where = f"route <b>{html.escape(route)}</b>" if route else "no route selected"
    tail = " · click a bar for its decoded text" if clickable else ""
    return (f'<p class="legend" id="legend">{items}<br><span class="muted">colours for {where} · bar width ∝ √tokens · '
            f"label: request, agent, tokens, targets · hover a bar for its requests and tool calls{tail}</span></p>")


TREE_CSS = """
svg.tree { background: #fff; }
svg.tree .context { fill: #b8c2cc; }
svg.tree .target { fill: #2e8b57; }
svg.tree .not-selected { fill: #e3a21a; }
svg.tree .output { fill: #4a78a8; }
svg.tree .branch { fill: none; stroke: #7a8793; stroke-width: 1; }
svg.tree text.label { font: 10px system-ui, sans-serif; fill: #3d4852; }
svg.tree g.node:hover rect { stroke: #1f2d3d; stroke-width: 0.8; }
.legend .sw { display: inline-block; width: 0.9em; height: 0.9em; margin: 0 0.3em 0 1em; vertical-align: middle; }
.legend .sw:first-child { margin-left: 0; }
.legend .context { background: #b8c2cc; } .legend .target { background: #2e8b57; }
.legend .not-selected { background: #e3a21a; } .legend .output { background: #4a78a8; }
"""
