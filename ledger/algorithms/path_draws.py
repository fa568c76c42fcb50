"""Path selection for admitted executions (SPEC §6.5 *Targets*, steps 2–4).

Pure algorithm, no I/O.  The input is a :class:`TreeView` of one execution's prefix tree
(SPEC §6.1) whose per-token ``candidate`` flags already encode step 1 (provenance masking
plus TargetSelection context-only requests).  :func:`select_paths` then repeats, until
``j_max`` paths are drawn or no unmasked target remains:

1. take the highest-priority role class that still has a leaf with unmasked targets;
2. draw one of that class's leaves with probability proportional to its number of
   currently unmasked targets, using ``u = sha256(seed ‖ 0x00 ‖ execution ‖ 0x00 ‖ draw
   index)[:8] / 2**64`` and cumulative counts over the class's leaves sorted by node id;
3. fix that path's targets to its still-unmasked candidate tokens;
4. mask the whole path.

Because a draw masks whole root-to-leaf paths, masking is per node and all-or-nothing, and
the masked node set is always closed under "ancestor of".  The implementation exploits
this: the tree's leaves are laid out in depth-first order so that every node's subtree is
a contiguous slice of leaves; per-leaf unmasked counts live in one ``int64`` array, and
masking a node subtracts its candidate count from its leaf slice.  A draw walks up from
the drawn leaf only until it meets an already-masked node, so the whole selection costs
O(nodes + leaves·classes·draws) numpy work, independent of the number of tokens except for
one ``flatnonzero`` per targeted node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ledger.algorithms.errors import InputError

__all__ = [
    "DEFAULT_PRIORITY",
    "Draw",
    "Leaf",
    "TreeView",
    "class_order",
    "draw_u",
    "draw_word",
    "execution_targets",
    "leaves_of",
    "loss_weight",
    "loss_weights",
    "path_nodes",
    "path_target_mask",
    "select_paths",
    "validate_tree",
]

#: Default role priority (SPEC §6.5 step 2): main-agent task-driving turns first, then main
#: summaries, then delegated sub-agent task turns, then sub-agent summaries.
DEFAULT_PRIORITY: tuple[str, ...] = ("main/task", "main/summary", "sub/task", "sub/summary")


@dataclass(frozen=True)
class Leaf:
    """A candidate leaf: a tree leaf node and the request whose node it is."""

    node_id: int
    request_id: str
    role_class: str  # "main/task" | "main/summary" | "sub/task" | "sub/summary"


@dataclass(frozen=True)
class TreeView:
    """One execution's prefix tree, reduced to what path selection needs.

    ``parent[i]`` is the parent node id of node ``i`` (``-1`` for children of the virtual
    root); node ids are ``0..n-1`` in creation order, so ``parent[i] < i``.  ``seg_len[i]``
    is the number of tokens in node ``i``'s segment and ``candidate[i]`` (``uint8``, length
    ``seg_len[i]``) flags the policy-target candidates in it.  ``leaves`` lists the candidate
    leaves (tree leaves, i.e. nodes without children) with their request and role class.
    """

    parent: np.ndarray
    seg_len: np.ndarray
    candidate: list[np.ndarray]
    leaves: list[Leaf]


@dataclass(frozen=True, eq=False)
class Draw:
    """One drawn path and the targets fixed on it.

    ``targets`` maps node id -> sorted ``int64`` positions within that node's segment; it
    holds only nodes with at least one target, in root-to-leaf order.  The arrays are
    read-only.  Two draws compare by :meth:`as_key` (arrays make ``==`` ambiguous).
    """

    leaf: Leaf
    draw_index: int
    targets: dict[int, np.ndarray]

    @property
    def n_targets(self) -> int:
        """|T_r|: number of target tokens fixed on this path."""
        return int(sum(int(a.size) for a in self.targets.values()))

    def as_key(self) -> tuple[int, str, str, int, tuple[tuple[int, tuple[int, ...]], ...]]:
        """A hashable, comparable summary (leaf, draw index and every target position)."""
        return (
            self.leaf.node_id,
            self.leaf.request_id,
            self.leaf.role_class,
            self.draw_index,
            tuple((n, tuple(int(p) for p in a)) for n, a in self.targets.items()),
        )


# --------------------------------------------------------------------------- tree helpers


def leaves_of(parent: np.ndarray) -> np.ndarray:
    """Node ids (ascending, ``int64``) of the tree's leaves: nodes that are nobody's parent."""
    parent = np.asarray(parent, dtype=np.int64)
    has_child = np.zeros(parent.shape[0], dtype=bool)
    has_child[parent[parent >= 0]] = True
    return np.flatnonzero(~has_child).astype(np.int64)


def path_nodes(parent: np.ndarray | Sequence[int], leaf: int | Leaf) -> list[int]:
    """Node ids on the root-to-``leaf`` path, root side first (the virtual root excluded)."""
    node = leaf.node_id if isinstance(leaf, Leaf) else int(leaf)
    n = len(parent)
    if not 0 <= node < n:
        raise InputError(f"node {node} out of range 0..{n - 1}")
    out: list[int] = []
    while node >= 0:
        out.append(node)
        node = int(parent[node])
    out.reverse()
    return out


def validate_tree(tree: TreeView) -> None:
    """Raise ``ValueError`` unless ``tree`` is well formed (shapes, parent order, leaves)."""
    parent = np.asarray(tree.parent)
    seg_len = np.asarray(tree.seg_len)
    n = parent.shape[0]
    if parent.ndim != 1 or seg_len.shape != (n,):
        raise InputError("parent and seg_len must be 1-D arrays of equal length")
    if len(tree.candidate) != n:
        raise InputError(f"candidate has {len(tree.candidate)} entries for {n} nodes")
    if n and (np.any(parent < -1) or np.any(parent >= np.arange(n))):
        bad = int(np.flatnonzero((parent < -1) | (parent >= np.arange(n)))[0])
        raise InputError(f"node {bad}: parent {int(parent[bad])} must be -1 or a smaller node id")
    if np.any(seg_len < 0):
        raise InputError("negative segment length")
    for i, c in enumerate(tree.candidate):
        if c.shape != (int(seg_len[i]),):
            raise InputError(f"node {i}: candidate has shape {c.shape}, segment has {int(seg_len[i])} tokens")
    is_leaf = np.zeros(n, dtype=bool)
    is_leaf[leaves_of(parent)] = True
    seen: set[int] = set()
    for leaf in tree.leaves:
        if not 0 <= leaf.node_id < n:
            raise InputError(f"leaf {leaf.request_id!r}: node {leaf.node_id} out of range")
        if not is_leaf[leaf.node_id]:
            raise InputError(f"leaf {leaf.request_id!r}: node {leaf.node_id} has children")
        if leaf.node_id in seen:
            raise InputError(f"node {leaf.node_id} listed as a leaf twice")
        seen.add(leaf.node_id)


def class_order(classes: Iterable[str], priority: Sequence[str] = DEFAULT_PRIORITY) -> list[str]:
    """Classes in draw priority: ``priority`` order first, then any other class sorted."""
    present = set(classes)
    ordered = [c for c in dict.fromkeys(priority) if c in present]
    return ordered + sorted(present.difference(priority))


# --------------------------------------------------------------------------- randomness


def draw_word(seed: str, execution_id: str, draw_index: int) -> int:
    """The 64-bit word of draw ``draw_index``: first 8 bytes (big endian) of
    SHA-256(``f"{seed}\\x00{execution_id}\\x00{draw_index}"``)."""
    digest = hashlib.sha256(f"{seed}\x00{execution_id}\x00{draw_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def draw_u(seed: str, execution_id: str, draw_index: int) -> float:
    """The uniform variate ``u = draw_word(...) / 2**64`` in [0, 1)."""
    return draw_word(seed, execution_id, draw_index) / 2**64


def _pick(word: int, counts: np.ndarray) -> int:
    """Index ``k`` with ``cum[k-1] <= floor(u * total) < cum[k]``, ``u = word / 2**64``.

    ``floor(u * total)`` is computed exactly in integers as ``(word * total) >> 64``, so the
    choice never depends on float rounding.  Zero-count entries are never chosen.
    """
    cum = np.cumsum(counts, dtype=np.int64)
    total = int(cum[-1])
    r = (word * total) >> 64
    return int(np.searchsorted(cum, r, side="right"))


# --------------------------------------------------------------------------- selection


def select_paths(
    tree: TreeView,
    *,
    j_max: int,
    priority: Sequence[str] = DEFAULT_PRIORITY,
    seed: str,
    execution_id: str,
) -> list[Draw]:
    """Draw up to ``j_max`` paths of ``tree`` and fix their disjoint target sets (§6.5).

    Returns the draws in draw order (``draw_index`` 0, 1, …).  The result depends only on
    the tree, ``j_max``, ``priority``, ``seed`` and ``execution_id`` — not on the order of
    ``tree.leaves``.  Tree leaves missing from ``tree.leaves`` are never drawn (their
    tokens can still become targets through a drawn path that shares them).
    """
    if j_max < 0:
        raise InputError(f"j_max must be >= 0, got {j_max}")
    validate_tree(tree)
    parent = np.asarray(tree.parent, dtype=np.int64)
    n = parent.shape[0]
    if j_max == 0 or not tree.leaves:
        return []

    counts = [int(np.count_nonzero(c)) for c in tree.candidate]  # candidates per node

    # Depth-first leaf layout: node v's subtree covers leaf slots [start[v], start[v] + nleaf[v]).
    # (Plain Python lists: per-node scalar work is faster on lists than on numpy arrays.)
    all_leaves = leaves_of(parent)
    par = np.where(parent < 0, n, parent).tolist()  # slot n = virtual root
    nleaf = [0] * (n + 1)
    for v in all_leaves.tolist():
        nleaf[v] = 1
    for v in range(n - 1, -1, -1):  # children before parents
        nleaf[par[v]] += nleaf[v]
    start_l = [0] * (n + 1)
    next_slot = [0] * (n + 1)
    path_count = [0] * (n + 1)  # candidates on root..v
    for v in range(n):  # parents before children; siblings in id order
        p = par[v]
        start_l[v] = next_slot[p]
        next_slot[p] += nleaf[v]
        next_slot[v] = start_l[v]
        path_count[v] = path_count[p] + counts[v]
    start = np.array(start_l, dtype=np.int64)

    unmasked = np.zeros(len(all_leaves), dtype=np.int64)  # per leaf slot
    unmasked[start[all_leaves]] = np.array(path_count, dtype=np.int64)[all_leaves]
    masked = [False] * n

    leaves_sorted = sorted(tree.leaves, key=lambda lf: lf.node_id)
    by_class: dict[str, list[Leaf]] = {}
    for lf in leaves_sorted:
        by_class.setdefault(lf.role_class, []).append(lf)
    classes = [(by_class[c], start[np.array([lf.node_id for lf in by_class[c]], dtype=np.int64)])
               for c in class_order(by_class, priority)]

    draws: list[Draw] = []
    while len(draws) < j_max:
        chosen: Leaf | None = None
        for members, slots in classes:
            weights = unmasked[slots]
            if weights.any():
                chosen = members[_pick(draw_word(seed, execution_id, len(draws)), weights)]
                break
        if chosen is None:
            break
        # Newly masked nodes: from the leaf up to (excluding) the first masked ancestor.
        fresh: list[int] = []
        v = chosen.node_id
        while v < n and not masked[v]:
            fresh.append(v)
            v = par[v]
        targets: dict[int, np.ndarray] = {}
        for v in reversed(fresh):
            masked[v] = True
            c = counts[v]
            if c:
                pos = np.flatnonzero(tree.candidate[v]).astype(np.int64)
                pos.setflags(write=False)
                targets[v] = pos
                unmasked[start_l[v]:start_l[v] + nleaf[v]] -= c
        draws.append(Draw(leaf=chosen, draw_index=len(draws), targets=targets))
    return draws


# --------------------------------------------------------------------------- weights


def execution_targets(draws: Iterable[Draw]) -> int:
    """L_i = |T_i| = Σ_r |T_r| (the draws' target sets are disjoint by construction)."""
    return sum(d.n_targets for d in draws)


def loss_weights(draws: Iterable[Draw]) -> float:
    """The loss weight 1/L_i shared by every target token of the execution; 0.0 if L_i = 0.

    One number per execution (every drawn path of the execution carries the same weight),
    so a trainer that sums ``weight · loss`` over target tokens and divides by the number of
    executions in the batch averages per execution, however the targets are split into paths.
    """
    total = execution_targets(draws)
    return 1.0 / total if total else 0.0


#: Singular alias of :func:`loss_weights`.
loss_weight = loss_weights


def path_target_mask(tree: TreeView, draw: Draw) -> np.ndarray:
    """``uint8`` 0/1 mask over the concatenated root-to-leaf path of ``draw`` (SPEC §7.3
    ``target_mask``): 1 exactly at this path's fixed targets."""
    nodes = path_nodes(tree.parent, draw.leaf)
    lens = np.asarray(tree.seg_len, dtype=np.int64)[nodes]
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))
    mask = np.zeros(int(lens.sum()), dtype=np.uint8)
    for node, off in zip(nodes, offsets):
        pos = draw.targets.get(node)
        if pos is not None:
            mask[int(off) + pos] = 1
    return mask
