"""A loaded prefix tree as the path-draw input (:class:`ledger.algorithms.path_draws.TreeView`).

One implementation of the shape every target rule shares -- parent links, segment lengths and
the candidate leaves (childless nodes owned by a request) -- used by
:func:`projections.tree.tree_view` and by admission's first-release and use-specific views, which
differ only in the candidate masks they pass in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ledger.algorithms.path_draws import Leaf, TreeView

if TYPE_CHECKING:  # the tree projection imports this module: no import back at run time
    from ledger.projections.tree import LoadedTree


def owned_leaves(t: "LoadedTree") -> list[Leaf]:
    """The childless nodes of ``t`` that a request owns (in seq order, the first request mapped
    to a node owns it), in node order."""
    owner: dict[int, object] = {}
    for r in t.requests.values():
        owner.setdefault(r.node_id, r)
    return [Leaf(n.node_id, owner[n.node_id].request_id, owner[n.node_id].role_class)
            for n in t.nodes if n.node_id not in t.children and n.node_id in owner]


def view_of(t: "LoadedTree", candidate: list[np.ndarray]) -> TreeView:
    """``t`` as a :class:`TreeView` with the per-node ``candidate`` masks given."""
    parent = np.array([-1 if n.parent is None else n.parent for n in t.nodes], dtype=np.int64)
    seg_len = np.array([n.tokens.shape[0] for n in t.nodes], dtype=np.int64)
    return TreeView(parent=parent, seg_len=seg_len, candidate=candidate, leaves=owned_leaves(t))
