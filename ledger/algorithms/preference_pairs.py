"""Preference pairs (SPEC §6.9; seed 002 §15.2.3, §15.5.1, §15.6.1, §15.10): pure functions, no I/O.

A pair (chosen, rejected) is formed only where both sides continue from one **decision
point**: requests whose input token sequences are byte-identical -- independent samples from
one context inside one execution, or requests of two executions of the same task with
identical inputs.  A **side** is the root-to-leaf path of one execution's tree through one
of those requests; its reward is the counting reward of that path (the deepest
branch-scoped score on it, else the execution's).

Ordering and evidence, for two sides ``a`` and ``b`` of one decision point:

* a declared ``hard_negative`` side is never chosen; two hard negatives form no pair;
* the chosen side has the higher reward, or an equal one when the rejected side is a
  declared hard negative (a hard negative without a valid reward can be rejected by any
  side with one);
* the pair cites in ``criterion`` what makes the rejected side worse: the first ``fail``
  criterion of its counting assessment (when its reward is strictly lower), else
  ``hard_negative:<selection_id>``; with neither, there is no pair.

Two sides of one lineage (an execution and its derived views, or two views of one
record) are one recorded sample and never pair across executions.  Both continuations
must be non-empty: ``prompt_ids`` is the longest common token prefix of the two paths and
each side's continuation starts at the first differing token.

**Draws.**  Valid pairs are ranked per chosen side's execution by ``sha256(seed ‖ 0x00 ‖
chosen execution ‖ 0x00 ‖ member id)`` (ties by member id) and the first ``j_max`` are
kept, so the result depends only on the candidate set, never on the order in which it was
assembled.  Candidate executions in no drawn pair are **unassigned comparison candidates**,
each with the reason it got furthest to (no side, no partner, no ordering, no evidence, no
differing continuation, not drawn).

Tokens are ``uint32`` numpy arrays (views of packed little-endian bytes), log-probs
``float32`` with NaN where a position is not a policy output; the hot path (input keys,
common prefixes) is hashing and numpy comparisons, never Python lists of ints.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ledger.algorithms.identifiers import join_key
from ledger.algorithms.prefix_match import common_prefix

__all__ = ["DecisionMember", "Pair", "PairSet", "Side", "common_prefix", "decision_groups", "form_pairs",
           "input_key", "order_sides", "VALID", "pair_member_id", "pair_rank", "REASONS"]

# Why a candidate execution is in no pair, from least to most advanced (the furthest one is reported).
REASONS = (
    "no side",  # no root-to-leaf path carries a reward (and none is a declared hard negative)
    "no partner",  # no other sample continues from a byte-identical input
    "no ordering",  # every partner has the same reward and neither side is a declared hard negative
    "no evidence",  # a lower reward without a fail criterion or a hard_negative declaration
    "no differing continuation",  # the two paths are equal, or one contains the other
    "not drawn",  # valid pairs exist but the j_max cap of their chosen execution left them out
)
VALID = -1  # order_sides: a justified ordering with evidence


@dataclass(frozen=True, eq=False)
class Side:
    """One root-to-leaf path of one candidate execution."""

    execution_id: str
    leaf_request_id: str
    lineage: str  # the original execution at the top of the lineage chain (itself for an original)
    tokens: np.ndarray  # uint32, root to leaf
    logprobs: np.ndarray  # float32, NaN where the position is not a policy output
    reward: float | None  # counting reward of the path (None only for a hard negative without one)
    fail_criteria: tuple[str, ...] = ()  # names of `fail` criteria of the path's counting assessment, in order
    hard_negative: str | None = None  # selection id of the hard_negative TargetSelection covering the path


@dataclass(frozen=True)
class DecisionMember:
    """A request at a decision point and the sides (indices into the side list) below it."""

    execution_id: str
    request_id: str
    sides: tuple[int, ...]


@dataclass(frozen=True)
class Pair:
    member_id: str
    chosen: int  # side index
    rejected: int  # side index
    prompt_tokens: int  # longest common prefix of the two paths
    criterion: str
    rank: str  # hex rank of the draw (sha256 prefix)


@dataclass
class PairSet:
    pairs: list[Pair] = field(default_factory=list)  # drawn pairs, in member_id byte order
    unassigned: dict[str, str] = field(default_factory=dict)  # candidate execution -> reason
    considered: int = 0  # distinct side pairs examined (for measurements)


# ---------------------------------------------------------------------------- keys


def input_key(tokens: np.ndarray | bytes | memoryview) -> bytes:
    """SHA-256 of a request's input as packed little-endian uint32 bytes (equal keys = byte-identical inputs)."""
    if isinstance(tokens, np.ndarray):
        tokens = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    return hashlib.sha256(bytes(tokens)).digest()


def decision_groups(requests: Iterable[tuple[str, str, bytes, str]]) -> list[list[tuple[str, str]]]:
    """Group ``(execution_id, request_id, input_key, scope)`` by ``(scope, input_key)``; the
    groups with two or more requests are the decision points.  ``scope`` is the task id (so
    only executions of one task meet).  Groups and their members come sorted."""
    by: dict[tuple[str, bytes], list[tuple[str, str]]] = {}
    for ex, rid, key, scope in requests:
        by.setdefault((scope, key), []).append((ex, rid))
    return [sorted(v) for _k, v in sorted(by.items()) if len(v) >= 2]


def pair_member_id(route: str, chosen: Side, rejected: Side) -> str:
    """``route/chosen execution/chosen leaf/rejected execution/rejected leaf`` (components escaped)."""
    return join_key(route, chosen.execution_id, chosen.leaf_request_id, rejected.execution_id,
                    rejected.leaf_request_id)


def pair_rank(seed: str, chosen_execution: str, member_id: str) -> str:
    """The deterministic draw key of a pair (hex; lower draws first)."""
    h = hashlib.sha256()
    h.update(seed.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(chosen_execution.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(member_id.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- ordering


def order_sides(a: Side, b: Side) -> tuple[int, str, str | None]:
    """Decide one comparison: ``(stage, detail, criterion)``.

    ``stage`` is :data:`VALID` for a justified ordering with evidence -- then ``detail`` is
    ``"a"`` or ``"b"`` (the chosen side) and ``criterion`` the cited evidence -- else the
    index in :data:`REASONS` of why there is no pair (2 no ordering, 3 no evidence) and
    ``detail`` the reason in words.
    """
    ha, hb = a.hard_negative is not None, b.hard_negative is not None
    if ha and hb:
        return 2, "no justified ordering: both sides are declared hard negatives", None
    if ha or hb:
        chosen, rejected, tag = (b, a, "b") if ha else (a, b, "a")
        if chosen.reward is None:
            return 2, "no justified ordering: the side that could be chosen has no valid reward", None
        if rejected.reward is not None and rejected.reward > chosen.reward:
            return 2, ("no justified ordering: the declared hard negative has the higher reward (a hard negative "
                       "is never chosen)"), None
        if rejected.reward is not None and rejected.reward < chosen.reward and rejected.fail_criteria:
            return VALID, tag, rejected.fail_criteria[0]
        return VALID, tag, f"hard_negative:{rejected.hard_negative}"
    ra, rb = a.reward, b.reward
    if ra is None or rb is None:
        return 2, "no justified ordering: a side has no valid reward", None
    if ra == rb:
        return 2, f"no justified ordering: equal rewards ({ra:g}) and neither side is a declared hard_negative", None
    chosen, rejected, tag = (a, b, "a") if ra > rb else (b, a, "b")
    if rejected.fail_criteria:
        return VALID, tag, rejected.fail_criteria[0]
    return 3, (f"no evidence: the lower-reward side ({rejected.execution_id}/{rejected.leaf_request_id}, reward "
               f"{rejected.reward:g}) records no fail criterion and no hard_negative selection declares it"), None


# ---------------------------------------------------------------------------- pairs


def form_pairs(route: str, sides: Sequence[Side], groups: Iterable[Sequence[DecisionMember]], *, seed: str,
               j_max: int, candidates: Mapping[str, str | None] | None = None) -> PairSet:
    """Every justified pair of ``sides`` at the decision points ``groups``, drawn per chosen
    execution (at most ``j_max``), and the unassigned candidates with their reasons.

    ``candidates``: every candidate execution -> ``None`` when it has sides, else the reason
    it has none (executions of ``sides`` are candidates in any case).
    """
    out = PairSet()
    best: dict[str, tuple[int, str]] = {}  # execution -> (stage, reason)

    def note(ex: str, stage: int, why: str) -> None:
        cur = best.get(ex)
        if cur is None or stage > cur[0] or (stage == cur[0] and why < cur[1]):
            best[ex] = (stage, why)

    no_partner = ("no partner: no other sample continues from a byte-identical input (in this execution or in "
                  "another execution of the same task)")
    for ex, why in sorted((candidates or {}).items()):
        if why is None:
            note(ex, 1, no_partner)
        else:
            note(ex, 0, why)
    for s in sides:
        note(s.execution_id, 1, no_partner)
    seen: set[tuple[int, int]] = set()
    valid: dict[str, list[tuple[str, str, int, int, str]]] = {}  # chosen execution -> (rank, member id, c, r, criterion)
    for group in groups:
        members = list(group)
        for i in range(len(members)):
            mi = members[i]
            for j in range(i + 1, len(members)):
                mj = members[j]
                if mi.execution_id != mj.execution_id and \
                        sides_lineage(sides, mi.sides) & sides_lineage(sides, mj.sides):
                    continue  # one recorded sample seen through two views
                for x in mi.sides:
                    for y in mj.sides:
                        if x == y:
                            continue
                        key = (x, y) if x < y else (y, x)
                        if key in seen:
                            continue
                        seen.add(key)
                        a, b = sides[key[0]], sides[key[1]]
                        stage, detail, criterion = order_sides(a, b)
                        if stage != VALID:
                            note(a.execution_id, stage, detail)
                            note(b.execution_id, stage, detail)
                            continue
                        c, r = (key[0], key[1]) if detail == "a" else (key[1], key[0])
                        mid = pair_member_id(route, sides[c], sides[r])
                        rank = pair_rank(seed, sides[c].execution_id, mid)
                        valid.setdefault(sides[c].execution_id, []).append((rank, mid, c, r, criterion))
    out.considered = len(seen)
    drawn_execs: set[str] = set()
    for ex in sorted(valid):
        taken = 0
        for rank, mid, c, r, criterion in sorted(valid[ex]):
            sc, sr = sides[c], sides[r]
            if taken >= j_max and all(e in drawn_execs or best[e][0] >= 5 for e in (sc.execution_id, sr.execution_id)):
                continue  # nothing left to learn about these executions: skip the comparison
            lcp = common_prefix(sc.tokens, sr.tokens)
            if lcp >= sc.tokens.shape[0] or lcp >= sr.tokens.shape[0]:
                why = "no differing continuation: one path equals or contains the other"
                note(sc.execution_id, 4, why)
                note(sr.execution_id, 4, why)
                continue
            if taken >= j_max:
                why = f"not drawn: j_max cap ({j_max} pairs per chosen execution)"
                note(sc.execution_id, 5, why)
                note(sr.execution_id, 5, why)
                continue
            taken += 1
            out.pairs.append(Pair(mid, c, r, lcp, criterion, rank))
            drawn_execs.update((sc.execution_id, sr.execution_id))
    out.pairs.sort(key=lambda p: p.member_id.encode("utf-8", "surrogatepass"))
    out.unassigned = {ex: why for ex, (_stage, why) in sorted(best.items()) if ex not in drawn_execs}
    return out


def sides_lineage(sides: Sequence[Side], idx: Sequence[int]) -> set[str]:
    return {sides[i].lineage for i in idx}
