"""Split policies and their hash draws (SPEC 6.3): the declared fractions, the protection order,
:class:`SplitPolicy` and its forest, and the keyed draws that put a group into a split.

The lower half of :mod:`ledger.algorithms.split_hash` (which resolves whole task sets over these):
:mod:`ledger.algorithms.split_strata` builds on this module, and ``split_hash`` builds on both, so
the three import one way only.  Every name here is re-exported by ``split_hash``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from types import MappingProxyType
from typing import Any

from ledger.algorithms.errors import InputError

#: Splits in hash-interval order: ``u`` is mapped over cumulative fractions in this order.
SPLITS: tuple[str, ...] = ("train", "dev", "final_test", "reserve")
#: Fractions a policy must name (``reserve`` is optional and defaults to 0).
REQUIRED_SPLITS: tuple[str, ...] = ("train", "dev", "final_test")
#: Protection rank: higher is more protected.  final_test > reserve > dev > train.
PROTECTION: Mapping[str, int] = MappingProxyType({"train": 0, "dev": 1, "reserve": 2, "final_test": 3})
#: Splits from most to least protected.
PROTECTION_ORDER: tuple[str, ...] = ("final_test", "reserve", "dev", "train")
#: Allowed deviation of the sum of fractions from 1.
FRACTION_TOLERANCE = 1e-9
#: Registration fields a policy may ``group_by`` (the string fields of TaskRegistered).
GROUP_BY_FIELDS: tuple[str, ...] = ("family", "fixture", "source")
#: Longest ``strata`` feature name.
MAX_NAME = 256

_TWO64 = 1 << 64

#: One ``TaskRegistered``: the task id and its ``derived_from`` ids, optionally followed by its
#: ``group_by`` fields and stratum labels (``((name, value), ...)`` each).
Registration = tuple[Any, ...]
#: A registration normalised: ``(task, parents, fields, labels)``.
Atom = tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]


class SplitPolicyError(InputError):
    """Invalid split fractions or policy."""


# ----------------------------------------------------------------------------------------
# Fractions and the keyed hash
# ----------------------------------------------------------------------------------------
def validate_fractions(fractions: Mapping[str, Any]) -> dict[str, float]:
    """Check split fractions and return them normalised to all four splits.

    Rules: a mapping naming at least ``train``, ``dev`` and ``final_test`` (``reserve``
    optional), no other names, each value a finite real number ``>= 0`` (booleans are
    refused), summing to 1 within :data:`FRACTION_TOLERANCE`.  Zero is allowed.

    Raises :class:`SplitPolicyError` with a message naming the offending split.
    """
    if not isinstance(fractions, Mapping):
        raise SplitPolicyError(f"fractions must be a mapping of split name to number, got {type(fractions).__name__}")
    unknown = sorted(str(k) for k in fractions if k not in SPLITS)
    if unknown:
        raise SplitPolicyError(f"unknown split name(s) {', '.join(unknown)}; expected {', '.join(SPLITS)}")
    missing = [s for s in REQUIRED_SPLITS if s not in fractions]
    if missing:
        raise SplitPolicyError(f"missing fraction(s) for {', '.join(missing)} (reserve is the only optional split)")
    out: dict[str, float] = {}
    for name in SPLITS:
        value = fractions.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SplitPolicyError(f"fraction for {name} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise SplitPolicyError(f"fraction for {name} must be finite, got {value!r}")
        if value < 0:
            raise SplitPolicyError(f"fraction for {name} must be >= 0, got {value!r}")
        out[name] = value
    total = math.fsum(out.values())
    if abs(total - 1.0) > FRACTION_TOLERANCE:
        raise SplitPolicyError(
            f"fractions must sum to 1 (within {FRACTION_TOLERANCE:g}), got {total!r} "
            f"({', '.join(f'{k}={v!r}' for k, v in out.items())})"
        )
    return out


@lru_cache(maxsize=1024)
def _bounds(fractions: tuple[float, ...]) -> tuple[tuple[str, int], ...]:
    """Exact exclusive upper bounds of each non-empty split on the ``[0, 2**64)`` scale."""
    nonzero = [i for i, f in enumerate(fractions) if f > 0]
    last = nonzero[-1]
    acc = Fraction(0)
    out: list[tuple[str, int]] = []
    for i in nonzero:
        acc += Fraction(fractions[i])
        # For integer x: x < acc * 2**64  <=>  x < ceil(acc * 2**64).
        bound = _TWO64 if i == last else min(_TWO64, math.ceil(acc * _TWO64))
        out.append((SPLITS[i], bound))
    return tuple(out)


def split_draw(group_id: str, salt: str) -> int:
    """The 64-bit draw of a group: first 8 bytes (big-endian) of HMAC-SHA256(salt, id)."""
    digest = hmac.new(salt.encode("utf-8"), group_id.encode("utf-8"), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big")


def split_unit(group_id: str, salt: str) -> float:
    """``u = split_draw(group_id, salt) / 2**64`` in ``[0, 1]`` (for display and plots)."""
    return split_draw(group_id, salt) / _TWO64


def _assign(draw: int, bounds: tuple[tuple[str, int], ...]) -> str:
    for name, bound in bounds:
        if draw < bound:
            return name
    return bounds[-1][0]  # unreachable: the last bound is 2**64


def assign_split(group_id: str, fractions: Mapping[str, float], salt: str) -> str:
    """Split of ``group_id`` under ``fractions`` and ``salt`` (keyed hash, see module doc)."""
    fr = validate_fractions(fractions)
    return _assign(split_draw(group_id, salt), _bounds(tuple(fr[s] for s in SPLITS)))


def assign_splits(group_ids: Iterable[str], fractions: Mapping[str, float], salt: str) -> dict[str, str]:
    """``{group_id: split}`` for many groups under one policy (validates once)."""
    fr = validate_fractions(fractions)
    bounds = _bounds(tuple(fr[s] for s in SPLITS))
    return {g: _assign(split_draw(g, salt), bounds) for g in group_ids}


# ----------------------------------------------------------------------------------------
# Protection
# ----------------------------------------------------------------------------------------
def most_protected(splits: Iterable[str]) -> str:
    """The most protected of ``splits`` (final_test > reserve > dev > train).

    Raises ValueError for an empty input or an unknown split name.
    """
    best: str | None = None
    for s in splits:
        if s not in PROTECTION:
            raise InputError(f"unknown split {s!r}; expected one of {', '.join(SPLITS)}")
        if best is None or PROTECTION[s] > PROTECTION[best]:
            best = s
    if best is None:
        raise InputError("most_protected() of no splits")
    return best


def merge_split(parts_splits: Iterable[str]) -> str:
    """Split of a merged group: the most protected split among its parts (SPEC §6.3)."""
    return most_protected(parts_splits)


# ----------------------------------------------------------------------------------------
# Reserve promotion
# ----------------------------------------------------------------------------------------
def promotion_key(salt: str, reclassified_group: str, candidate: str) -> bytes:
    """Rendezvous key of ``candidate`` for replacing ``reclassified_group`` in final_test."""
    msg = reclassified_group.encode("utf-8") + b"\x00" + candidate.encode("utf-8")
    return hmac.new(salt.encode("utf-8"), msg, hashlib.sha256).digest()


def promote_reserve(reserve_group_ids: Iterable[str], salt: str, reclassified_group: str) -> str | None:
    """Choose the reserve group promoted into final_test when ``reclassified_group`` leaves it.

    Deterministic and independent of the order of ``reserve_group_ids``: the candidate
    with the smallest :func:`promotion_key` (ties, which need a SHA-256 collision, by id).
    Returns None when there is no candidate.
    """
    best: tuple[bytes, str] | None = None
    for cand in reserve_group_ids:
        key = (promotion_key(salt, reclassified_group, cand), cand)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]


# ----------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitPolicy:
    """A ``SplitPolicyDeclared`` event: fractions (validated), salt, superseded policy id, and
    the optional ``strata`` (a task feature name: quota allocation per stratum, see
    :mod:`ledger.algorithms.split_strata`) and ``group_by`` (a registration field, one of
    :data:`GROUP_BY_FIELDS`: tasks sharing its value form one group)."""

    policy_id: str
    fractions: Mapping[str, float]
    salt: str
    supersedes: str | None = None
    strata: str | None = None
    group_by: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy_id, str) or not self.policy_id:
            raise SplitPolicyError("policy_id must be a non-empty string")
        if not isinstance(self.salt, str):
            raise SplitPolicyError("salt must be a string")
        if self.supersedes is not None and not isinstance(self.supersedes, str):
            raise SplitPolicyError("supersedes must be a policy id string or None")
        if self.strata is not None and (not isinstance(self.strata, str) or not self.strata
                                        or len(self.strata) > MAX_NAME):
            raise SplitPolicyError(f"strata must be a task feature name (a non-empty string of at most {MAX_NAME} "
                                   f"characters) or None, got {self.strata!r}")
        if self.group_by is not None and self.group_by not in GROUP_BY_FIELDS:
            raise SplitPolicyError(f"group_by must be one of {', '.join(GROUP_BY_FIELDS)} or None, got {self.group_by!r}")
        object.__setattr__(self, "fractions", MappingProxyType(validate_fractions(self.fractions)))

    def __hash__(self) -> int:
        return hash((self.policy_id, tuple(self.fractions.items()), self.salt, self.supersedes, self.strata,
                     self.group_by))

    def sort_key(self) -> tuple[str, tuple[float, ...], str, str, str, str]:
        """Total order used to break ties deterministically."""
        return (self.policy_id, tuple(self.fractions[s] for s in SPLITS), self.salt, self.supersedes or "",
                self.strata or "", self.group_by or "")

    def variant(self) -> str:
        """Short digest of the whole declaration: tells apart two variants of one policy id."""
        body = repr(self.sort_key()).encode("utf-8")
        return hashlib.sha256(body).hexdigest()[:16]

    def assign(self, group_id: str) -> str:
        """Split of ``group_id`` under this policy."""
        return _assign(split_draw(group_id, self.salt), _bounds(tuple(self.fractions[s] for s in SPLITS)))


@dataclass(frozen=True)
class PolicyForest:
    """Which declared policies are in force (see module doc, rule 3).

    ``in_force``: every policy whose supersedes chain reaches a root, ordered by
    (depth, policy sort key).  ``chain``: the primary chain, root to head, following the
    smallest policy id at each fork.  ``head``: its last policy (None if nothing is in
    force).  ``conflicts``: ids of in-force policies off the primary chain or declared
    twice with different content.  ``pending``: ids whose chain is dangling or cyclic.
    """

    in_force: tuple[SplitPolicy, ...]
    chain: tuple[str, ...]
    head: SplitPolicy | None
    conflicts: tuple[str, ...]
    pending: tuple[str, ...]


def policy_forest(policies: Iterable[SplitPolicy]) -> PolicyForest:
    """Resolve declared policies into the set in force; independent of input order.

    A declaration is in force when it supersedes nothing (a root) or supersedes an id
    that has a declaration in force: a breadth-first walk down from the roots, so
    dangling and cyclic chains are never reached and stay pending.
    """
    unique = set(policies)
    by_parent: dict[str | None, list[SplitPolicy]] = {}
    for p in unique:
        by_parent.setdefault(p.supersedes, []).append(p)
    depth: dict[str, int] = {}
    in_force: list[tuple[int, SplitPolicy]] = []
    frontier: list[str | None] = [None]
    level = 0
    while frontier:
        nxt: set[str] = set()
        for parent in frontier:
            for p in by_parent.get(parent, ()):
                if p.policy_id in depth and depth[p.policy_id] < level:
                    # Already in force at a shallower depth: this variant is in force too,
                    # but it opens no new branch.
                    in_force.append((level, p))
                    continue
                depth.setdefault(p.policy_id, level)
                in_force.append((level, p))
                nxt.add(p.policy_id)
        frontier = sorted(nxt)
        level += 1
    in_force.sort(key=lambda dp: (dp[0], dp[1].sort_key()))

    children: dict[str | None, set[str]] = {}
    for _, p in in_force:
        children.setdefault(p.supersedes, set()).add(p.policy_id)
    chain: list[str] = []
    step = sorted(children.get(None, ()))
    while step:
        nxt_id = next((c for c in step if c not in chain), None)
        if nxt_id is None:
            break
        chain.append(nxt_id)
        step = sorted(children.get(nxt_id, ()))
    head = None
    if chain:
        head = min((p for _, p in in_force if p.policy_id == chain[-1]), key=SplitPolicy.sort_key)
    on_chain = set(chain)
    variant_count: dict[str, int] = {}
    for _, p in in_force:
        variant_count[p.policy_id] = variant_count.get(p.policy_id, 0) + 1
    conflicts = sorted(
        {p.policy_id for _, p in in_force if p.policy_id not in on_chain}
        | {pid for pid, n in variant_count.items() if n > 1}
    )
    pending = sorted({p.policy_id for p in unique} - set(depth))
    return PolicyForest(
        in_force=tuple(p for _, p in in_force),
        chain=tuple(chain),
        head=head,
        conflicts=tuple(conflicts),
        pending=tuple(pending),
    )
