"""Tree packing of one execution's admitted paths (SPEC §7.5; seed 000 "deferred
materialization").

Pure numpy, no I/O.  Input: a prefix tree (``parent[i]``, ``-1`` for a child of the virtual
root; ``tokens[i]`` the segment of node ``i``), the drawn paths as *members* (each a leaf
node, in member order = draw order) and each member's fixed targets as positions within its
own root-to-leaf path (SPEC §7.3 ``target_mask`` positions), plus the execution's weight
1/L_i.  Output (:class:`Packed`): the admitted subtree laid out once, depth first:

* ``input_ids`` — each admitted node's tokens once; a node's children in member order (a
  child comes before its siblings when an earlier member's path runs through it);
* ``position_ids`` — each token's position on its own root-to-leaf path;
* ``node_spans`` ``[n_spans, 3]`` — ``start, end`` (end exclusive) and the parent span's
  index (``-1`` for a child of the root; ``null`` in the exported record);
* ``tin``/``tout`` — depth-first entry/exit indices per token: ``tin[k] = k`` and ``tout[k]``
  is one past the last token of ``k``'s subtree, so ``q`` may attend to ``k`` iff
  ``tin[k] <= tin[q] < tout[k]`` (``k`` is ``q`` or one of its ancestors);
* ``targets`` ``[n_targets, 2]`` — ``(target_index, predecessor_index)`` sorted by target:
  the predecessor is the packed index whose logits predict the target (the previous token of
  its span, or for a span's first token the last token of its nearest non-empty ancestor span;
  ``-1`` when the target
  opens a path, which nothing predicts); ``weights`` the matching 1/L_i.

Every target must lie on a node whose *first* covering member (in member order) is the
member that claims it — exactly what admission produces, since a draw masks its whole path
(§6.5 step 3) — so :func:`unpack` recovers each member's ``target_mask`` from the order
alone.  :func:`pack` refuses anything else (overlapping or misattributed targets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ledger.algorithms.errors import InputError

__all__ = ["Packed", "UnpackedPath", "attention_mask", "check", "layout", "pack", "path_spans", "predecessors", "unpack"]


@dataclass(frozen=True, eq=False)
class Packed:
    """One execution's admitted subtree, packed (see the module notes)."""

    input_ids: np.ndarray  # uint32 [N]
    position_ids: np.ndarray  # int64 [N]
    node_spans: np.ndarray  # int64 [S, 3]: start, end, parent span (-1: root)
    tin: np.ndarray  # int64 [N]
    tout: np.ndarray  # int64 [N]
    targets: np.ndarray  # int64 [T, 2]: target index, predecessor index (-1: none)
    weights: np.ndarray  # float64 [T]
    member_spans: np.ndarray  # int64 [M]: each member's leaf span
    span_nodes: np.ndarray  # int64 [S]: the tree node id of each span


@dataclass(frozen=True, eq=False)
class UnpackedPath:
    """One member's path record rebuilt from a packed sequence (SPEC §7.3 fields)."""

    input_ids: np.ndarray  # uint32
    target_mask: np.ndarray  # uint8
    weights: np.ndarray  # float64 per position: the target's weight, 0 elsewhere
    indices: np.ndarray  # int64 per position: its packed index


def _path(parent: np.ndarray, leaf: int) -> list[int]:
    out: list[int] = []
    node = int(leaf)
    while node >= 0:
        if len(out) >= parent.shape[0]:
            raise InputError("the tree has a cycle")
        out.append(node)
        node = int(parent[node])
    out.reverse()
    return out


def _parent_last(starts: np.ndarray, ends: np.ndarray, par_span: np.ndarray) -> np.ndarray:
    """Per span: the packed index of the last token *before* it on its own path (the last
    token of the nearest non-empty ancestor span), ``-1`` when nothing precedes it.  Spans
    are in preorder, so parents come first."""
    out = [-1] * int(par_span.shape[0])
    st, en, ps = starts.tolist(), ends.tolist(), par_span.tolist()
    for i, p in enumerate(ps):
        if p >= 0:
            if p >= i:
                raise InputError(f"span {i}: parent {p} does not come before it")
            out[i] = en[p] - 1 if en[p] > st[p] else out[p]
    return np.asarray(out, dtype=np.int64)


def pack(parent: Sequence[int] | np.ndarray, tokens: Sequence[np.ndarray], member_leaves: Sequence[int],
         member_targets: Sequence[np.ndarray], weight: float) -> Packed:
    """Pack the members' paths of a tree into one depth-first sequence (SPEC §7.5).

    ``member_targets[m]`` holds positions within member ``m``'s root-to-leaf path.  Raises
    ``ValueError`` on a malformed tree, a target off its path, or targets that are not
    attributed to the first member covering their node.
    """
    parent = np.asarray(parent, dtype=np.int64)
    n = parent.shape[0]
    if len(tokens) != n:
        raise InputError(f"{len(tokens)} token segments for {n} nodes")
    if len(member_targets) != len(member_leaves):
        raise InputError(f"{len(member_targets)} target sets for {len(member_leaves)} members")
    if n and (parent.max() >= n or parent.min() < -1):
        raise InputError("parent index out of range")
    seg = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=n)
    # Admitted subtree, children in first-cover (member) order; owner = first covering member.
    owner = np.full(n, -1, dtype=np.int64)
    kids: dict[int, list[int]] = {-1: []}
    paths: list[list[int]] = []
    for m, leaf in enumerate(member_leaves):
        leaf = int(leaf)
        if not 0 <= leaf < n:
            raise InputError(f"member {m}: leaf node {leaf} out of range")
        path = _path(parent, leaf)
        paths.append(path)
        for v in path:
            if owner[v] < 0:
                owner[v] = m
                kids.setdefault(int(parent[v]), []).append(v)
    # Depth-first preorder (iterative).
    order: list[int] = []
    stack = list(reversed(kids[-1]))
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(kids.get(v, ())))
    span_nodes = np.array(order, dtype=np.int64)
    s = span_nodes.shape[0]
    span_of_node = np.full(n, -1, dtype=np.int64)
    span_of_node[span_nodes] = np.arange(s, dtype=np.int64)
    lens = seg[span_nodes]
    ends = np.cumsum(lens)
    starts = ends - lens
    par_node = parent[span_nodes] if s else np.zeros(0, dtype=np.int64)
    par_span = np.where(par_node >= 0, span_of_node[np.maximum(par_node, 0)], -1)
    # Path offset (depth in tokens) of each span, and the end of its subtree; preorder puts
    # parents before children, so one forward and one backward pass suffice.
    depth = np.zeros(s, dtype=np.int64)
    sub_end = ends.copy()
    ps, ln, dp, se = par_span.tolist(), lens.tolist(), [0] * s, ends.tolist()
    for i in range(s):
        p = ps[i]
        if p >= 0:
            dp[i] = dp[p] + ln[p]
    for i in range(s - 1, -1, -1):
        p = ps[i]
        if p >= 0 and se[i] > se[p]:
            se[p] = se[i]
    depth[:] = dp
    sub_end[:] = se
    total = int(ends[-1]) if s else 0
    input_ids = (np.concatenate([np.asarray(tokens[v], dtype=np.uint32) for v in order]) if s
                 else np.zeros(0, dtype=np.uint32))
    tok_span = np.repeat(np.arange(s, dtype=np.int64), lens)
    idx = np.arange(total, dtype=np.int64)
    position_ids = depth[tok_span] + (idx - starts[tok_span])
    tout = sub_end[tok_span]
    # Targets: path positions -> packed indices, checked against first-cover ownership.
    found = []
    for m, (path, tg) in enumerate(zip(paths, member_targets)):
        tg = np.asarray(tg, dtype=np.int64)
        if tg.size == 0:
            continue
        spans = span_of_node[np.array(path, dtype=np.int64)]
        cum = np.cumsum(lens[spans])
        if tg.min() < 0 or tg.max() >= (cum[-1] if cum.size else 0):
            raise InputError(f"member {m}: target position outside its path")
        k = np.searchsorted(cum, tg, side="right")
        on = spans[k]
        if np.any(owner[span_nodes[on]] != m):
            raise InputError(f"member {m}: a target lies on a node first covered by an earlier member")
        found.append(starts[on] + tg - (cum[k] - lens[on]))
    tidx = np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)
    if tidx.size and np.any(tidx[1:] == tidx[:-1]):
        raise InputError("a target is claimed twice")
    ts = tok_span[tidx]
    first = tidx == starts[ts]
    pred = np.where(first, _parent_last(starts, ends, par_span)[ts], tidx - 1)
    targets = np.stack([tidx, pred], axis=1) if tidx.size else np.zeros((0, 2), dtype=np.int64)
    return Packed(
        input_ids=input_ids, position_ids=position_ids,
        node_spans=np.stack([starts, ends, par_span], axis=1) if s else np.zeros((0, 3), dtype=np.int64),
        tin=idx, tout=tout, targets=targets.astype(np.int64), weights=np.full(tidx.shape[0], float(weight)),
        member_spans=span_of_node[np.array([int(x) for x in member_leaves], dtype=np.int64)] if len(member_leaves)
        else np.zeros(0, dtype=np.int64),
        span_nodes=span_nodes)


def path_spans(node_spans: np.ndarray, leaf_span: int) -> list[int]:
    """Span indices from the root to ``leaf_span`` (root side first)."""
    par = np.asarray(node_spans, dtype=np.int64)[:, 2]
    out: list[int] = []
    v = int(leaf_span)
    while v >= 0:
        if len(out) > par.shape[0]:
            raise InputError("node_spans has a cycle")
        out.append(v)
        v = int(par[v])
    out.reverse()
    return out


def unpack(packed: Packed) -> list[UnpackedPath]:
    """Every member's path record: input_ids, target_mask, per-position weights (exactly the
    inputs of :func:`pack`)."""
    spans = np.asarray(packed.node_spans, dtype=np.int64).reshape(-1, 3)
    s = spans.shape[0]
    starts, ends = spans[:, 0], spans[:, 1]
    tgt = np.asarray(packed.targets, dtype=np.int64).reshape(-1, 2)[:, 0]
    w = np.asarray(packed.weights, dtype=np.float64)
    n_tok = int(np.asarray(packed.input_ids).shape[0])
    if s and (starts.min() < 0 or ends.max() > n_tok or np.any(ends < starts)):
        raise InputError("node_spans out of range")
    if tgt.size and (tgt.min() < 0 or tgt.max() >= n_tok):
        raise InputError("target index out of range")
    owner = np.full(s, -1, dtype=np.int64)
    chains = []
    for m, leaf in enumerate(np.asarray(packed.member_spans, dtype=np.int64).tolist()):
        chain = path_spans(spans, leaf)
        chains.append(chain)
        for v in chain:
            if owner[v] < 0:
                owner[v] = m
    lens = ends - starts
    tok_span = np.repeat(np.arange(s, dtype=np.int64), lens) if s else np.zeros(0, dtype=np.int64)
    tgt_owner = owner[tok_span[tgt]] if tgt.size else np.zeros(0, dtype=np.int64)
    ids = np.asarray(packed.input_ids, dtype=np.uint32)
    out = []
    for m, chain in enumerate(chains):
        sel = np.concatenate([np.arange(starts[v], ends[v], dtype=np.int64) for v in chain]) if chain \
            else np.zeros(0, dtype=np.int64)
        where = np.full(n_tok, -1, dtype=np.int64)  # packed index -> position on this path
        where[sel] = np.arange(sel.shape[0], dtype=np.int64)
        mine = tgt_owner == m
        pos = where[tgt[mine]]
        if np.any(pos < 0):
            raise InputError(f"member {m}: a target is off its path")
        mask = np.zeros(sel.shape[0], dtype=np.uint8)
        mask[pos] = 1
        weights = np.zeros(sel.shape[0], dtype=np.float64)
        weights[pos] = w[mine]
        out.append(UnpackedPath(ids[sel], mask, weights, sel))
    return out


def attention_mask(tin: np.ndarray, tout: np.ndarray) -> np.ndarray:
    """Dense boolean ``[q, k]`` tree mask: ``tin[k] <= tin[q] < tout[k]`` (for small tests
    and reference models; a trainer builds a block mask from the same two arrays)."""
    tin = np.asarray(tin, dtype=np.int64)
    tout = np.asarray(tout, dtype=np.int64)
    return (tin[None, :] <= tin[:, None]) & (tin[:, None] < tout[None, :])


def layout(node_spans: np.ndarray, n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``position_ids, tin, tout`` implied by ``node_spans`` (what :func:`pack` writes), after
    checking that the spans tile ``[0, n_tokens)`` in depth-first preorder."""
    spans = np.asarray(node_spans, dtype=np.int64).reshape(-1, 3)
    s = spans.shape[0]
    starts, ends, par = spans[:, 0], spans[:, 1], spans[:, 2]
    if s == 0:
        if n_tokens:
            raise InputError("tokens without spans")
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    if starts[0] != 0 or ends[-1] != n_tokens or np.any(starts[1:] != ends[:-1]) or np.any(ends < starts):
        raise InputError("node_spans do not tile the packed sequence in order")
    stack: list[int] = []
    ps, ln = par.tolist(), (ends - starts).tolist()
    dp = [0] * s
    for i, p in enumerate(ps):
        while stack and stack[-1] != p:
            stack.pop()
        if p != -1:
            if not stack:
                raise InputError(f"span {i}: parent {p} is not an open ancestor (spans are not depth-first)")
            dp[i] = dp[p] + ln[p]
        stack.append(i)
    se = ends.tolist()
    for i in range(s - 1, -1, -1):
        p = ps[i]
        if p >= 0 and se[i] > se[p]:
            se[p] = se[i]
    lens = ends - starts
    tok_span = np.repeat(np.arange(s, dtype=np.int64), lens)
    idx = np.arange(n_tokens, dtype=np.int64)
    position_ids = np.asarray(dp, dtype=np.int64)[tok_span] + (idx - starts[tok_span])
    return position_ids, idx, np.asarray(se, dtype=np.int64)[tok_span]


def predecessors(node_spans: np.ndarray, target_index: np.ndarray) -> np.ndarray:
    """The packed index whose logits predict each target (``-1`` if none), from the spans."""
    spans = np.asarray(node_spans, dtype=np.int64).reshape(-1, 3)
    t = np.asarray(target_index, dtype=np.int64)
    if t.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts, ends, par = spans[:, 0], spans[:, 1], spans[:, 2]
    if t.min() < 0 or (ends.shape[0] and t.max() >= ends[-1]) or not ends.shape[0]:
        raise InputError("target index outside the packed sequence")
    ts = np.searchsorted(ends, t, side="right")  # the (non-empty) span holding each target
    return np.where(t == starts[ts], _parent_last(starts, ends, par)[ts], t - 1)


def check(n_tokens: int, position_ids, node_spans, tin, tout, targets, leaf_spans) -> None:
    """Check that a packed record is self-consistent (what :func:`pack` writes): the spans tile
    the sequence in depth-first preorder, ``position_ids``/``tin``/``tout`` are the ones the
    spans imply, targets are strictly increasing in range with the predecessor
    :func:`predecessors` gives and lie on a member's path, and every member leaf is a span.
    ``targets`` is ``[T, 2]`` (target, predecessor with ``-1`` for none).  Raises
    ``ValueError`` naming the first inconsistency."""
    spans = np.asarray(node_spans, dtype=np.int64).reshape(-1, 3)
    pos, tin_e, tout_e = layout(spans, n_tokens)
    for name, got, want in (("position_ids", position_ids, pos), ("tin", tin, tin_e), ("tout", tout, tout_e)):
        got = np.asarray(got, dtype=np.int64)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise InputError(f"{name} do not match node_spans")
    t = np.asarray(targets, dtype=np.int64).reshape(-1, 2)
    if t.shape[0]:
        if np.any(t[1:, 0] <= t[:-1, 0]):
            raise InputError("targets are not strictly increasing")
        if not np.array_equal(predecessors(spans, t[:, 0]), t[:, 1]):
            raise InputError("a target's predecessor_index is not the token before it on its path")
    leaves = np.asarray(leaf_spans, dtype=np.int64)
    s = spans.shape[0]
    if leaves.size and (leaves.min() < 0 or leaves.max() >= s):
        raise InputError("a member's leaf_node_index is not a span")
    covered = np.zeros(s, dtype=bool)
    for leaf in leaves.tolist():
        covered[path_spans(spans, leaf)] = True
    if t.shape[0]:
        tok_span = np.searchsorted(spans[:, 1], t[:, 0], side="right")
        if not covered[tok_span].all():
            raise InputError("a target lies on no member's path")
