"""Stratified and grouped split allocation (SPEC §11.2; seed 002 §15.4.1, Table 4).

Pure algorithm: no I/O, no clock, no unseeded randomness.

A split policy may name

* ``group_by`` — a registration field (``family``, ``fixture`` or ``source``): while the
  policy is in force, every task registered with the same value of that field joins one
  task group (the field value is an extra union-find edge).  "Transfer to new repository
  families" (Table 4) declares ``group_by: "family"`` and whole families land on one side.
  A task registered without the field joins no group by it.
* ``strata`` — a task feature name (a key of the ``features`` object of
  ``task_registered``): the policy then *fills each stratum's quota* instead of drawing
  every group independently.

Stratum of a task and of a group
--------------------------------
A task's value for feature ``name`` is ``features[name]`` when ``features`` is a JSON
object and the value is a string (the label is the string itself), a number or a boolean
(the label is its canonical JSON text, so ``3`` and ``"3"`` share a stratum) of at most
:data:`MAX_LABEL` characters.  Anything else — no ``features``, a list, a missing key,
``null``, an object or list value, a longer text — gives no value.  A task registered
twice keeps the smaller label.  The stratum of a group is the **smallest label** (code-point
order) among its members' values; a group none of whose members has a value falls in the
stratum ``None`` (shown ``(none)``), which is filled like any other.

Quota filling (the allocation rule)
-----------------------------------
Allocation under a stratified policy ``P`` is a decision taken once per group, at a point
of the governance log, and never revisited:

1. **Rounds.**  When ``P`` comes into force, every existing group is allocated in one round;
   afterwards, each governance event that creates new groups (a registration or link of
   ids never seen before) allocates them in a round of its own.  A group formed by merging
   allocated groups is not allocated again: it keeps the most protected split of its parts
   (merges only ever raise, as everywhere in the split map).
2. **Order within a round.**  The round's groups are taken in ascending keyed draw
   ``HMAC-SHA256(salt, group_id)`` (:func:`ledger.algorithms.split_hash.split_draw`; ties by
   id): the salt decides which groups of a round go where.
3. **Quota.**  Each group goes, in its stratum, to the split with the largest *deficit*
   ``f_k * (n + 1) - c_k``, where ``n`` is the number of allocations made so far in the
   stratum under ``P`` and ``c_k`` how many of them went to split ``k`` (only splits with
   ``f_k > 0``; ties go to the most protected split).  Computed exactly on integers.  So
   every stratum's counts track its quota: after ``n`` allocations each split holds
   ``c_k < f_k * n + 1`` and (tested) more than ``f_k * n - 1``.  Counts are counts of
   allocations: a later merge of two allocated groups gives no quota back.

Consequences: the same log — any interleaving of the other partitions, any batching, any
number of catch-up runs or rebuilds — gives the same allocation, because the rounds follow
the totally ordered governance topic.  A group once allocated never moves to a less
protected split, and adding tasks later never moves an existing group (new groups fill the
remaining deficits).  A *different* log order (the governance lines shuffled) may allocate
differently: that is inherent to any quota, which depends on who came first.  Policies
without ``strata`` keep the order-free keyed draw.

:class:`StrataAllocator` is the incremental, log-ordered state; :func:`allocate_round` the
rule it applies, also used by :func:`ledger.algorithms.split_hash.resolve_splits` to
allocate, as one final round, any group a caller gave no allocation for (the batch API's
meaning: the policy declared after everything else).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from functools import lru_cache
from typing import Any, NamedTuple

from ledger.algorithms.canonical import canonical_str
from ledger.algorithms.grouping import UnionFind
from ledger.algorithms.split_policy import (
    GROUP_BY_FIELDS,
    PROTECTION,
    SPLITS,
    SplitPolicy,
    most_protected,
    split_draw,
)

__all__ = [
    "MAX_LABEL",
    "Allocation",
    "StrataAllocator",
    "allocate_round",
    "feature_labels",
    "field_values",
    "group_label",
    "quota_split",
    "rebuild",
]

#: Longest feature value that names a stratum (strata are categories, not texts).
MAX_LABEL = 256


class Allocation(NamedTuple):
    """One quota decision: ``key`` (the group id when it was allocated) went to ``split``
    as allocation number ``seq`` (0, 1, ... over the whole state) in ``stratum`` under the
    policy ``policy_id`` (declaration digest ``variant``, :meth:`SplitPolicy.variant`)."""

    policy_id: str
    variant: str
    key: str
    stratum: str | None
    split: str
    seq: int


Labels = tuple[tuple[str, str], ...]
Fields = tuple[tuple[str, str], ...]


def feature_labels(features: Any) -> Labels:
    """``((name, label), ...)`` sorted, for every feature that names a stratum (module doc)."""
    if not isinstance(features, Mapping):
        return ()
    out = []
    for name, value in features.items():
        if isinstance(value, str):
            label = value
        elif isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            label = canonical_str(value)
        else:
            continue
        if len(label) <= MAX_LABEL:
            out.append((str(name), label))
    return tuple(sorted(out))


def field_values(fields: Mapping[str, Any] | None) -> Fields:
    """``((field, value), ...)`` for the ``group_by`` fields a registration carries (non-empty strings)."""
    if not fields:
        return ()
    return tuple((f, fields[f]) for f in GROUP_BY_FIELDS if isinstance(fields.get(f), str) and fields[f])


def group_label(labels: Iterable[Labels], name: str) -> str | None:
    """The stratum of a group under feature ``name``: the smallest label among its members."""
    best: str | None = None
    for lab in labels:
        for n, v in lab:
            if n == name and (best is None or v < best):
                best = v
    return best


@lru_cache(maxsize=256)
def _weights(fractions: tuple[float, ...]) -> tuple[int, ...]:
    """Integer weights proportional to the fractions (exact: IEEE values as fractions)."""
    exact = [Fraction(f) for f in fractions]
    den = math.lcm(*(f.denominator for f in exact))
    return tuple(int(f * den) for f in exact)


def quota_split(weights: tuple[int, ...], counts: list[int]) -> int:
    """Index (in :data:`SPLITS` order) of the split with the largest deficit ``w_k (n+1) / W - c_k``
    (``W`` = sum of weights, ``n`` = sum of counts); only ``w_k > 0``; ties to the most protected."""
    total, n = sum(weights), sum(counts)
    best, best_key = -1, None
    for k, w in enumerate(weights):
        if w <= 0:
            continue
        key = (w * (n + 1) - counts[k] * total, PROTECTION[SPLITS[k]])
        if best_key is None or key > best_key:
            best, best_key = k, key
    return best


def allocate_round(policy: SplitPolicy, groups: Mapping[str, str | None], counts: dict[str | None, list[int]],
                   seq: int) -> list[Allocation]:
    """Allocate ``groups`` (``{group_id: stratum}``) under ``policy`` in ascending keyed draw.

    ``counts`` (``{stratum: [count per split in SPLITS order]}``) is updated in place;
    allocations are numbered from ``seq``.
    """
    weights = _weights(tuple(policy.fractions[s] for s in SPLITS))
    variant = policy.variant()
    out = []
    for g in sorted(groups, key=lambda g: (split_draw(g, policy.salt), g)):
        stratum = groups[g]
        c = counts.setdefault(stratum, [0] * len(SPLITS))
        k = quota_split(weights, c)
        c[k] += 1
        out.append(Allocation(policy.policy_id, variant, g, stratum, SPLITS[k], seq))
        seq += 1
    return out


def rebuild(atoms: Iterable[tuple[str, Iterable[str], Fields, Labels]], links: Iterable[tuple[str, str]],
            in_force: Iterable[SplitPolicy], allocations: Iterable[Allocation]) -> "StrataAllocator":
    """The allocation state of final fact sets whose stratified policies already took
    ``allocations`` (any group still without one is allocated in one round per policy)."""
    state = StrataAllocator()
    for task, parents, fields, labels in atoms:
        state.register(task, parents, fields, labels, allocate=False)
    for a, b in links:
        state.link(a, b, allocate=False)
    state.set_in_force(in_force, allocate=False)
    state.restore(allocations)
    return state


class StrataAllocator:
    """Log-ordered allocation state of the stratified policies in force (module doc).

    Fed the governance facts **in log order** (:meth:`register`, :meth:`link`,
    :meth:`set_in_force`); :attr:`allocations` lists every decision, :attr:`fresh` the ones
    not yet taken by :meth:`drain`.  :meth:`rebuild` restores the state from the final fact
    sets plus the allocations already made (a projection restarting).
    """

    def __init__(self) -> None:
        self.uf = UnionFind()
        self.in_force: frozenset[SplitPolicy] = frozenset()
        self.fields_active: set[str] = set()
        self.by_value: dict[tuple[str, str], list[str]] = {}  # (field, value) -> tasks, first = anchor
        self.labels: dict[str, Labels] = {}  # task -> merged labels of its registrations
        self.split_of: dict[SplitPolicy, dict[str, str]] = {}  # stratified policy -> group id -> split
        self.counts: dict[SplitPolicy, dict[str | None, list[int]]] = {}
        self.allocations: list[Allocation] = []
        self.fresh: list[Allocation] = []

    # -- facts, in log order -------------------------------------------------------------
    def register(self, task: str, parents: Iterable[str], fields: Fields = (), labels: Labels = (),
                 *, allocate: bool = True) -> None:
        parents = list(parents)
        self._note(task, fields, labels)
        self.uf.add(task)
        for p in parents:
            self._union(task, p)
        for f, v in fields:
            if f in self.fields_active:
                self._union(task, self.by_value[(f, v)][0])
        if allocate:
            self._allocate([task, *parents])

    def link(self, a: str, b: str, *, allocate: bool = True) -> None:
        self._union(a, b)
        if allocate:
            self._allocate([a, b])

    def set_in_force(self, in_force: Iterable[SplitPolicy], *, allocate: bool = True) -> None:
        """The policies in force now (a superset of the last call's: in force is monotone)."""
        self.in_force = frozenset(in_force)
        for f in sorted({p.group_by for p in self.in_force if p.group_by} - self.fields_active):
            self.fields_active.add(f)
            for (field, _), tasks in sorted(self.by_value.items()):
                if field == f:
                    for t in tasks[1:]:
                        self._union(tasks[0], t)
        for p in sorted((p for p in self.in_force if p.strata and p not in self.split_of), key=SplitPolicy.sort_key):
            self.split_of[p], self.counts[p] = {}, {}
            if allocate:
                self._round(p, self.uf.groups())

    def drain(self) -> list[Allocation]:
        out, self.fresh = self.fresh, []
        return out

    # -- restoring ----------------------------------------------------------------------
    def restore(self, allocations: Iterable[Allocation]) -> None:
        """Take back allocations made earlier (after facts were fed with ``allocate=False``);
        then allocate, as one round per policy, any group still without one."""
        by_variant = {(p.policy_id, p.variant()): p for p in self.split_of}
        for a in sorted(allocations, key=lambda a: a.seq):
            p = by_variant.get((a.policy_id, a.variant))
            if p is None or a.key not in self.uf:
                continue
            g = self.uf.group_id(a.key)
            have = self.split_of[p].get(g)
            self.split_of[p][g] = a.split if have is None else most_protected((have, a.split))
            self.counts[p].setdefault(a.stratum, [0] * len(SPLITS))[SPLITS.index(a.split)] += 1
            self.allocations.append(a)
        members = self.uf.groups()
        for p in sorted(self.split_of, key=SplitPolicy.sort_key):
            missing = {g: ms for g, ms in members.items() if g not in self.split_of[p]}
            if missing:
                self._round(p, missing)

    # -- internals ----------------------------------------------------------------------
    def _note(self, task: str, fields: Fields, labels: Labels) -> None:
        for f, v in fields:
            tasks = self.by_value.setdefault((f, v), [])
            if task not in tasks:
                tasks.append(task)
        if labels:
            merged = dict(self.labels.get(task, ()))
            for n, v in labels:
                if n not in merged or v < merged[n]:
                    merged[n] = v
            self.labels[task] = tuple(sorted(merged.items()))

    def _union(self, a: str, b: str) -> None:
        m = self.uf.union(a, b)
        if m is None:
            return
        keep, drop = m.parts
        for table in self.split_of.values():
            gone = table.pop(drop, None)
            if gone is not None:
                have = table.get(keep)
                table[keep] = gone if have is None else most_protected((have, gone))

    def _allocate(self, touched: list[str]) -> None:
        """Allocate the groups of ``touched`` that have none yet (groups made of new ids only)."""
        for p in sorted(self.split_of, key=SplitPolicy.sort_key):
            new: dict[str, list[str]] = {}
            for t in touched:
                g = self.uf.group_id(t)
                if g not in self.split_of[p]:
                    new.setdefault(g, []).append(t)
            if new:
                self._round(p, new)

    def _round(self, p: SplitPolicy, members: Mapping[str, list[str]]) -> None:
        assert p.strata is not None
        strata = {g: group_label((self.labels.get(t, ()) for t in ms), p.strata) for g, ms in members.items()}
        seq = self.allocations[-1].seq + 1 if self.allocations else 0
        made = allocate_round(p, strata, self.counts[p], seq)
        for a in made:
            self.split_of[p][a.key] = a.split
        self.allocations += made
        self.fresh += made
