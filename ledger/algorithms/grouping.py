"""Task groups: union-find over task ids (SPEC §6.3, seed 002 §15.4.1).

Pure algorithm, no I/O.  A task group collects every task connected to another by lineage
(``derived_from``) or by a reviewed ``TaskLinked``.  Links only ever merge groups: a
``TaskLinkRejected`` records a reviewed non-match and never splits anything, so the group
map is simply the connected components of the undirected graph whose nodes are the task
ids (plus every id an edge mentions) and whose edges are the lineage and link pairs.

The id of a group is its **smallest task id** in Python string order (code-point order),
so it depends only on the group's members, never on the order in which registrations and
links arrived.  Two entry points:

* :func:`build_groups` — batch: ``{task: group_id}`` for a set of tasks and edges;
* :class:`UnionFind` — incremental: union by size with path compression (amortised
  near-constant time per operation), tracking each component's smallest member so
  :meth:`UnionFind.group_id` is O(α(n)).

Both are order-independent: any permutation of the same tasks and edges yields the same
mapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = ["Merge", "UnionFind", "build_groups", "group_members"]


class Merge(NamedTuple):
    """What :meth:`UnionFind.union` did when it joined two distinct groups.

    ``parts`` are the group ids of the two groups before the merge (sorted), ``group_id``
    the id of the merged group (the smaller of the two).
    """

    parts: tuple[str, str]
    group_id: str


class UnionFind:
    """Incremental union-find over string task ids.

    Nodes are added implicitly by :meth:`add`, :meth:`union` and :meth:`find`.  The
    structure never splits a component; that matches the ledger rule that links only ever
    merge groups.
    """

    __slots__ = ("_parent", "_size", "_min")

    def __init__(self, nodes: Iterable[str] = (), edges: Iterable[tuple[str, str]] = ()) -> None:
        self._parent: dict[str, str] = {}
        self._size: dict[str, int] = {}
        self._min: dict[str, str] = {}
        for node in nodes:
            self.add(node)
        for a, b in edges:
            self.union(a, b)

    # -- basic operations -------------------------------------------------------------
    def add(self, node: str) -> bool:
        """Add ``node`` as a singleton group; return False when it was already known."""
        if node in self._parent:
            return False
        self._parent[node] = node
        self._size[node] = 1
        self._min[node] = node
        return True

    def find(self, node: str) -> str:
        """Return the internal root of ``node``'s component (adding it if unknown).

        Full path compression: every node on the walked path is re-pointed at the root.
        The root is an implementation detail; use :meth:`group_id` for the stable id.
        """
        parent = self._parent
        if node not in parent:
            self.add(node)
            return node
        root = node
        while parent[root] != root:
            root = parent[root]
        while parent[node] != root:
            parent[node], node = root, parent[node]
        return root

    def union(self, a: str, b: str) -> Merge | None:
        """Join the groups of ``a`` and ``b``.

        Returns a :class:`Merge` describing the two previous group ids when two distinct
        groups were joined, or None when ``a`` and ``b`` were already in one group.
        """
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return None
        ga, gb = self._min[ra], self._min[rb]
        if self._size[ra] < self._size[rb]:
            ra, rb = rb, ra
        self._parent[rb] = ra
        self._size[ra] += self._size.pop(rb)
        merged = min(ga, gb)
        self._min[ra] = merged
        del self._min[rb]
        return Merge(parts=(merged, max(ga, gb)), group_id=merged)

    # -- queries ----------------------------------------------------------------------
    def group_id(self, node: str) -> str:
        """The deterministic id of ``node``'s group: its smallest member."""
        return self._min[self.find(node)]

    def connected(self, a: str, b: str) -> bool:
        """True when ``a`` and ``b`` are known and in the same group."""
        if a not in self._parent or b not in self._parent:
            return a == b and a in self._parent
        return self.find(a) == self.find(b)

    def size(self, node: str) -> int:
        """Number of members in ``node``'s group."""
        return self._size[self.find(node)]

    def mapping(self) -> dict[str, str]:
        """``{node: group_id}`` for every known node."""
        return {node: self.group_id(node) for node in self._parent}

    def groups(self) -> dict[str, list[str]]:
        """``{group_id: sorted members}`` for every group."""
        return group_members(self.mapping())

    def __contains__(self, node: object) -> bool:
        return node in self._parent

    def __len__(self) -> int:
        return len(self._parent)

    def __iter__(self) -> Iterator[str]:
        return iter(self._parent)

    @property
    def group_count(self) -> int:
        """Number of distinct groups."""
        return len(self._min)


def build_groups(tasks: Iterable[str], edges: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Map every task (and every id an edge mentions) to its group id.

    ``edges`` are undirected pairs: lineage ``(child, parent)`` for each ``derived_from``
    entry and ``(task_a, task_b)`` for each ``TaskLinked``.  The result is independent of
    the order of ``tasks`` and ``edges``; a group's id is its smallest member.
    """
    return UnionFind(tasks, edges).mapping()


def group_members(mapping: dict[str, str]) -> dict[str, list[str]]:
    """Invert ``{task: group_id}`` into ``{group_id: sorted members}``."""
    out: dict[str, list[str]] = {}
    for task, gid in mapping.items():
        out.setdefault(gid, []).append(task)
    for members in out.values():
        members.sort()
    return out
