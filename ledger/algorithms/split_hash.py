"""Split assignment for task groups (SPEC §6.3, seed 002 §15.4).

Pure algorithm: no I/O, no clock, no unseeded randomness.

Keyed hash
----------
A group's draw under a policy is ``x = first 8 bytes (big-endian) of
HMAC-SHA256(key=salt, msg=group_id)``, ``u = x / 2**64``.  ``u`` is mapped over the
cumulative fractions in the fixed order ``train, dev, final_test, reserve`` (zero fractions
allowed; they never receive a group).  The comparison is done exactly, on integers: the
cumulative bounds are computed with :class:`fractions.Fraction` from the IEEE values of the
fractions, and the last split with a non-zero fraction takes every remaining ``x``, so no
rounding can leave a group unassigned.  Adding unrelated groups never changes the draw of
an existing one: the draw depends only on the group id and the salt.

Protection order: ``final_test > reserve > dev > train`` (:data:`PROTECTION`).

The split rule (order-independent)
----------------------------------
The ledger's governance events (registrations, links, link rejections, policy
declarations, reclassifications) may be replayed in any order, and the split map must be
the same for every order.  So the split of a group is defined as a function of the
*final sets* of events, never of their history:

1. **Groups.**  Union-find over lineage (``derived_from``) and ``TaskLinked`` pairs; the
   id of a group is its smallest task id (:mod:`ledger.algorithms.grouping`).  Rejections never split.
   (1b) While a policy with ``group_by`` (a registration field: ``family``, ``fixture``,
   ``source``) is in force, tasks registered with the same value of that field are joined
   too; a task registered without the field joins nothing by it.
2. **Keys a group may have held.**  Every registration and every link is an *atom*: the
   task and its ``derived_from`` ids, or the two linked tasks.  Replayed in some order, an
   atom can be processed before everything else that touches it, so at that moment its
   smallest id was the id of a live group; conversely every intermediate group's id is
   the smallest id of one of its atoms.  The *keys* of a group are therefore exactly
   ``{min(atom) : atom in the group}`` — every group id its members could ever have
   carried, in any order of arrival.  (The final group id, the smallest member, is one of
   them.)  A child registered with ``derived_from`` whose id sorts after its parent's adds
   no key of its own: it never was a group without its parent.
   (2b) Under a policy with ``group_by`` F, a registration carrying F = v has the key
   ``"F=v"`` instead (so a family draws once, whatever its size); links keep theirs.
3. **Policies in force.**  Every declared policy whose ``supersedes`` chain reaches a
   root policy (one that supersedes nothing).  Policies whose chain is dangling or cyclic
   are *pending* and count for nothing until the missing link arrives.  Competing
   declarations (two roots, or two policies superseding the same one) are reported as
   conflicts but **all** count, because some order of arrival would have put each of them
   in force; erring towards protection is the safe side.
4. **Base split** of a group = the most protected split that ``assign_split(key, policy)``
   gives over all its keys and all policies in force.  This is monotone: registering,
   linking or declaring more can only raise a group's base split, so no group ever moves
   to a less protected split than one it held in any replay order.
   (4b) A policy with ``strata`` draws nothing: it *allocates* each group once, filling
   each stratum's quota in keyed-hash order, in rounds that follow the governance log
   (:mod:`ledger.algorithms.split_strata`); its allocations join the most-protected rule.
   Only these allocations depend on the order of the log — the same log in any
   interleaving or batching gives the same ones.
5. **Reclassification** (``SplitReclassified``) is applied last.  A group holding a
   reclassified task whose base split is ``final_test`` moves to ``dev`` for good (it stays
   ``dev`` whatever later merges into it, because the merged group contains the inspected
   problem); an inspected ``reserve`` group also moves to ``dev`` (it is no longer unseen).
   A reclassification of a ``train``/``dev`` group, or of an unknown task, changes nothing
   and is reported.
6. **Promotion.**  Each group reclassified out of ``final_test`` promotes one ``reserve``
   group into ``final_test``: taking reclassified groups in id order, each picks, among the
   reserve groups not yet promoted and not reclassified, the one with the smallest
   ``HMAC-SHA256(key=salt, msg=reclassified_group ‖ 0x00 ‖ candidate)`` (rendezvous
   hashing; ``salt`` is the salt of the head of the primary policy chain).

Similarity screening (:func:`screen_candidates`): an LSH candidate pair whose tasks sit in
different groups and that was never reviewed goes to review; while it is pending and its
groups sit in different splits, the less protected group is quarantined.

:class:`SplitState` accumulates the facts in any order and resolves them on demand.

Two consequences worth knowing:

* A group with several keys draws several times and keeps the most protected result, so
  under one policy with train fraction ``f`` a group with ``k`` distinct keys lands in
  train with probability ``f**k``.  Tasks registered with ``derived_from`` a parent whose
  id sorts first add no key; tasks registered independently and linked later each add one.
  This is the price of the never-downgrade rule when the order of arrival is unknown.
* Promotion is the one place where adding unrelated tasks can move a group: a new reserve
  group may win a rendezvous, and the group it displaces returns from ``final_test`` to
  ``reserve``.  It never leaves the held-out side (reserve is never trained on, never
  tuned on).  Base splits never move when unrelated tasks are added.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ledger.algorithms.grouping import UnionFind
from ledger.algorithms.split_policy import (
    FRACTION_TOLERANCE,
    GROUP_BY_FIELDS,
    MAX_NAME,
    PROTECTION,
    PROTECTION_ORDER,
    REQUIRED_SPLITS,
    SPLITS,
    Atom,
    PolicyForest,
    Registration,
    SplitPolicy,
    SplitPolicyError,
    assign_split,
    assign_splits,
    merge_split,
    most_protected,
    policy_forest,
    promote_reserve,
    promotion_key,
    split_draw,
    split_unit,
    validate_fractions,
)
from ledger.algorithms.split_strata import StrataAllocator, feature_labels, field_values, rebuild

__all__ = [
    "FRACTION_TOLERANCE",
    "GROUP_BY_FIELDS",
    "PROTECTION",
    "PROTECTION_ORDER",
    "REQUIRED_SPLITS",
    "SPLITS",
    "PolicyForest",
    "SplitPolicy",
    "Registration",
    "Screening",
    "SplitPolicyError",
    "SplitResolution",
    "SplitState",
    "assign_split",
    "assign_splits",
    "merge_split",
    "most_protected",
    "policy_forest",
    "promote_reserve",
    "promotion_key",
    "resolve_splits",
    "screen_candidates",
    "split_draw",
    "split_unit",
    "validate_fractions",
]

# ----------------------------------------------------------------------------------------
# Resolution over final sets
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitResolution:
    """The split map computed from the final sets of governance facts.

    ``group_of``: task -> group id (every registered, lineage-referenced or linked id).
    ``keys``: group id -> sorted keys (ids the group may have carried, rule 2).
    ``base_split``: group id -> split before reclassification and promotion.
    ``split_of_group``: group id -> final split (empty when no policy is in force).
    ``reclassified``: sorted ids of groups moved to dev by a reclassification.
    ``promotions``: reclassified group id -> promoted reserve group id.
    ``unpromoted``: reclassified-out-of-final_test group ids for which no reserve was left.
    ``ignored_reclassifications``: task ids whose reclassification changed nothing
    (unknown task, or a group that is not final_test/reserve).
    ``policies``: the :class:`PolicyForest` used.
    ``allocations``: every quota decision under the stratified policies in force
    (:class:`ledger.algorithms.split_strata.Allocation`, by ``seq``).
    """

    group_of: dict[str, str]
    keys: dict[str, tuple[str, ...]]
    base_split: dict[str, str]
    split_of_group: dict[str, str]
    reclassified: tuple[str, ...]
    promotions: dict[str, str]
    unpromoted: tuple[str, ...]
    ignored_reclassifications: tuple[str, ...]
    policies: PolicyForest
    allocations: tuple[Any, ...] = ()

    def split_of(self, task_id: str) -> str | None:
        """Split of a task (its group's split); None when unknown or no policy in force."""
        gid = self.group_of.get(task_id)
        return None if gid is None else self.split_of_group.get(gid)

    def assignment(self) -> dict[str, str]:
        """``{task: split}`` for every task with a split."""
        return {t: self.split_of_group[g] for t, g in self.group_of.items() if g in self.split_of_group}

    def members(self) -> dict[str, list[str]]:
        """``{group_id: sorted member task ids}``."""
        out: dict[str, list[str]] = {}
        for t, g in self.group_of.items():
            out.setdefault(g, []).append(t)
        for ms in out.values():
            ms.sort()
        return out


def _atom(task: str, parents: Iterable[str] | str, fields: Mapping[str, Any] | None, features: Any) -> Atom:

    ps = (parents,) if isinstance(parents, str) else parents
    return (task, tuple(sorted(set(ps))), field_values(fields), feature_labels(features))


def _atoms(registrations: Mapping[str, Iterable[str]] | Iterable[Registration]) -> list[Atom]:
    """Registrations as ``(task, parents, group_by fields, stratum labels)`` atoms."""
    items = registrations.items() if isinstance(registrations, Mapping) else registrations
    out: list[Atom] = []
    for item in items:
        task, parents = item[0], item[1]
        parents = (parents,) if isinstance(parents, str) else tuple(parents)
        extra = tuple(item[2:4]) if len(item) > 2 else ()  # type: ignore[arg-type]
        out.append((task, parents, tuple(extra[0]) if extra else (), tuple(extra[1]) if len(extra) > 1 else ()))
    return out


def _keys(atoms: list[Atom], links: list[tuple[str, str]], group_of: Mapping[str, str],
          field: str | None) -> dict[str, set[str]]:
    """Keys of every group under a policy grouping by ``field`` (rule 2; rule 2b for group_by)."""
    out: dict[str, set[str]] = {}
    for task, parents, fields, _ in atoms:
        value = dict(fields).get(field) if field is not None else None
        out.setdefault(group_of[task], set()).add(min((task, *parents)) if value is None else f"{field}={value}")
    for a, b in links:
        out.setdefault(group_of[a], set()).add(min(a, b))
    return out


def _drawn_splits(forest: PolicyForest, atoms: list[Atom], links: list[tuple[str, str]],
                  group_of: Mapping[str, str]) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """``(keys, base)``: every group's keys and its most protected keyed draw over the policies
    in force without ``strata`` (rule 4)."""
    drawn = [p for p in forest.in_force if not p.strata]
    by_field = {f: _keys(atoms, links, group_of, f) for f in ({p.group_by for p in drawn} or {None})}
    merged: dict[str, set[str]] = {}
    for kf in by_field.values():
        for g, ks in kf.items():
            merged.setdefault(g, set()).update(ks)
    base: dict[str, str] = {}
    for f, kf in by_field.items():
        pols = [p for p in drawn if p.group_by == f]
        if not pols:
            continue
        key_split: dict[str, str] = {}
        for g, ks in kf.items():
            for k in ks:
                if k not in key_split:
                    key_split[k] = most_protected(p.assign(k) for p in pols)
            got = most_protected(key_split[k] for k in ks)
            base[g] = got if g not in base else most_protected((base[g], got))
    return {g: tuple(sorted(ks)) for g, ks in merged.items()}, base


def resolve_splits(
    registrations: Mapping[str, Iterable[str]] | Iterable[Registration],
    links: Iterable[tuple[str, str]],
    policies: Iterable[SplitPolicy],
    reclassified: Iterable[str],
    allocations: Iterable[Any] = (),
) -> SplitResolution:
    """Compute the split map from final sets (the rule in the module docstring).

    ``registrations``: ``{task_id: derived_from ids}`` or ``(task_id, derived_from)``
    pairs, or ``(task_id, derived_from, fields, labels)`` with the registration's
    ``group_by`` fields and stratum labels (:func:`ledger.algorithms.split_strata.field_values`,
    :func:`~ledger.algorithms.split_strata.feature_labels`); each distinct item is one atom
    (a task registered twice with different lineage contributes both atoms: either
    registration may have come first).
    ``links``: ``TaskLinked`` pairs.  ``policies``: every declared :class:`SplitPolicy`.
    ``reclassified``: task ids named by ``SplitReclassified``.  Link rejections are not an input: they never change
    groups or splits.  ``allocations``: the quota decisions already taken under policies with
    ``strata`` (:class:`ledger.algorithms.split_strata.Allocation`, log-ordered); a group
    without one is allocated here, in one final round.  The result depends only on these
    sets, not on their order.
    """
    atoms = _atoms(registrations)
    links = list(links)
    forest = policy_forest(policies)
    uf = UnionFind()
    for task, parents, _, _ in atoms:
        uf.add(task)
        for p in parents:
            uf.union(task, p)
    for a, b in links:
        uf.union(a, b)
    by_value: dict[tuple[str, str], str] = {}
    for f in sorted({p.group_by for p in forest.in_force if p.group_by}):  # rule 1b: group_by joins
        for task, _, fields, _ in atoms:
            value = dict(fields).get(f)
            if value is not None:
                uf.union(by_value.setdefault((f, value), task), task)
    group_of = uf.mapping()

    keys, base = _drawn_splits(forest, atoms, links, group_of)
    made: tuple[Any, ...] = ()
    if any(p.strata for p in forest.in_force):

        state = rebuild(atoms, links, forest.in_force, allocations)
        made = tuple(state.allocations)
        for table in state.split_of.values():
            for g, s in table.items():
                base[g] = s if g not in base else most_protected((base[g], s))

    recl_groups: set[str] = set()
    ignored: list[str] = []
    for t in set(reclassified):
        g = group_of.get(t)
        if g is None or base.get(g) not in ("final_test", "reserve"):
            ignored.append(t)
        else:
            recl_groups.add(g)

    final = dict(base)
    for g in recl_groups:
        final[g] = "dev"
    promotions: dict[str, str] = {}
    unpromoted: list[str] = []
    out_of_test = sorted(g for g in recl_groups if base[g] == "final_test")
    if out_of_test:
        assert forest.head is not None
        salt = forest.head.salt
        candidates = {g for g, s in base.items() if s == "reserve" and g not in recl_groups}
        for g in out_of_test:
            chosen = promote_reserve(candidates, salt, g)
            if chosen is None:
                unpromoted.append(g)
                continue
            candidates.discard(chosen)
            promotions[g] = chosen
            final[chosen] = "final_test"

    return SplitResolution(
        group_of=group_of,
        keys=keys,
        base_split=base,
        split_of_group=final,
        reclassified=tuple(sorted(recl_groups)),
        promotions=promotions,
        unpromoted=tuple(unpromoted),
        ignored_reclassifications=tuple(sorted(ignored)),
        policies=forest,
        allocations=made,
    )


@dataclass(frozen=True)
class Screening:
    """Outcome of :func:`screen_candidates`.

    ``review``: sorted candidate pairs to send to review (tasks in different groups, pair
    not yet reviewed).  ``quarantined``: sorted group ids held out of every manifest while
    a pending pair straddles splits — the less protected side of each such pair.
    """

    review: tuple[tuple[str, str], ...]
    quarantined: tuple[str, ...]


def screen_candidates(
    pairs: Iterable[tuple[str, str]],
    resolution: SplitResolution,
    reviewed: Iterable[tuple[str, str]] = (),
) -> Screening:
    """Route LSH candidate pairs (SPEC §6.3 similarity screening).

    A pair whose tasks already share a group needs nothing.  A pair reviewed before (a
    ``TaskLinked`` or ``TaskLinkRejected`` for it, either orientation) is not proposed
    again.  Every other pair goes to review, and while it is pending, if its two groups
    sit in different splits, the less protected group (the non-test side when one side is
    ``final_test``) is quarantined: that is the side a leak would flow into.  Tasks the
    resolution does not know are ignored.  Order-independent.
    """
    done = {(min(a, b), max(a, b)) for a, b in reviewed}
    review: set[tuple[str, str]] = set()
    quarantined: set[str] = set()
    for a, b in pairs:
        pair = (min(a, b), max(a, b))
        ga, gb = resolution.group_of.get(a), resolution.group_of.get(b)
        if ga is None or gb is None or ga == gb or pair in done:
            continue
        review.add(pair)
        sa, sb = resolution.split_of_group.get(ga), resolution.split_of_group.get(gb)
        if sa is not None and sb is not None and sa != sb:
            quarantined.add(ga if PROTECTION[sa] < PROTECTION[sb] else gb)
    return Screening(review=tuple(sorted(review)), quarantined=tuple(sorted(quarantined)))


class SplitState:
    """Accumulates governance facts; :meth:`resolve` gives the split map.

    Every method is idempotent and commutative with every other, so a projection can feed
    events as they arrive (registrations, links, rejections, policies, reclassifications)
    and get the same :class:`SplitResolution` as any other replay order — except the quota
    allocation of a policy with ``strata``, which follows the order of the calls (the
    governance log's order; :mod:`ledger.algorithms.split_strata`).  The resolution is
    cached until the next change.  :meth:`restore` rebuilds a state from final fact sets and
    the allocations already taken.
    """

    def __init__(self) -> None:

        self.registrations: set[Atom] = set()
        self.links: set[tuple[str, str]] = set()
        self.rejections: set[tuple[str, str]] = set()
        self.policies: set[SplitPolicy] = set()
        self.reclassified: set[str] = set()
        self.strata = StrataAllocator()  # dormant (fed nothing) until a stratified policy is in force
        self._live = False
        self._cache: SplitResolution | None = None

    @classmethod
    def restore(cls, registrations: Iterable[tuple[str, Iterable[str], Any, Any]], links: Iterable[tuple[str, str]],
                rejections: Iterable[tuple[str, str]], policies: Iterable[SplitPolicy], reclassified: Iterable[str],
                allocations: Iterable[Any] = ()) -> SplitState:
        """A state holding these facts (registrations as ``(task, parents, fields, features)``)
        whose stratified policies keep ``allocations``; groups without one are allocated now."""

        st = cls()
        for task, parents, fields, features in registrations:
            st.registrations.add(_atom(task, parents, fields, features))
        st.links = {(min(a, b), max(a, b)) for a, b in links}
        st.rejections = {(min(a, b), max(a, b)) for a, b in rejections}
        st.policies, st.reclassified = set(policies), set(reclassified)
        in_force = policy_forest(st.policies).in_force
        st.strata = rebuild(sorted(st.registrations), sorted(st.links), in_force, allocations)
        st._live = any(p.strata for p in in_force)
        return st

    def register(self, task_id: str, derived_from: Iterable[str] = (), fields: Mapping[str, Any] | None = None,
                 features: Any = None) -> None:
        """``TaskRegistered``: a task, its lineage parents, its registration ``fields``
        (``family``, ``fixture``, ``source``) and its ``features`` (a parsed JSON value)."""
        atom = _atom(task_id, derived_from, fields, features)
        if atom not in self.registrations:
            self.registrations.add(atom)
            if self._live:
                self.strata.register(*atom)
            self._cache = None

    def link(self, task_a: str, task_b: str) -> None:
        """``TaskLinked``: the two tasks are the same underlying problem."""
        pair = (min(task_a, task_b), max(task_a, task_b))
        if pair not in self.links:
            self.links.add(pair)
            if self._live:
                self.strata.link(*pair)
            self._cache = None

    def reject(self, task_a: str, task_b: str) -> None:
        """``TaskLinkRejected``: a reviewed non-match; never splits a group."""
        self.rejections.add((min(task_a, task_b), max(task_a, task_b)))

    def declare_policy(self, policy: SplitPolicy) -> None:
        """``SplitPolicyDeclared``."""
        if policy not in self.policies:

            self.policies.add(policy)
            in_force = policy_forest(self.policies).in_force
            if not self._live and any(p.strata for p in in_force):
                # the first stratified policy in force: the state so far is order-free, build it now
                self.strata = rebuild(sorted(self.registrations), sorted(self.links), (), ())
                self._live = True
            if self._live:
                self.strata.set_in_force(in_force)
            self._cache = None

    def reclassify(self, task_id: str) -> None:
        """``SplitReclassified``: the task's group was inspected."""
        self.reclassified.add(task_id)
        self._cache = None

    def reviewed(self, task_a: str, task_b: str) -> bool:
        """True when the pair was already linked or rejected (do not propose it again)."""
        pair = (min(task_a, task_b), max(task_a, task_b))
        return pair in self.links or pair in self.rejections

    def screen(self, pairs: Iterable[tuple[str, str]]) -> Screening:
        """Route similarity candidates against the current split map (:func:`screen_candidates`)."""
        return screen_candidates(pairs, self.resolve(), self.links | self.rejections)

    def resolve(self) -> SplitResolution:
        """The split map of the facts seen so far."""
        if self._cache is None:
            self._cache = resolve_splits(self.registrations, self.links, self.policies, self.reclassified,
                                         self.strata.allocations)
        return self._cache
