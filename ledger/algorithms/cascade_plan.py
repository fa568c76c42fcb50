"""Verifier-cascade planning (SPEC §6.5; seed 002 §15.5.3, napkin math 15.2, exercise 2).

A route's admission predicates run in sequence and evaluation stops at the first
non-pass.  Each predicate ``k`` has a pass rate ``p_k`` (conditional on being reached) and
an occupied slot time ``t_k`` (seconds, conditional on being reached).

* **Equation 1** (expected checking time per *attempted* record, short-circuit)::

      T = sum_k t_k * prod_{j<k} p_j          (empty product = 1)

* **Route yield** (the displayed relation under equation 1)::

      Y = prod_k p_k

  ``Y`` does not depend on the order: reordering changes how much work is spent, never
  which records pass all predicates.
* **Checking time per admitted record**: ``T / Y`` (the cost-over-acceptance form of
  the seed's equation 1.2); undefined (``None``) when ``Y == 0``, in which case callers
  report total slot time consumed instead.
* **Equation 2** (exchange rule for two adjacent independent predicates ``a``, ``b``)::

      run a before b  <=>  t_a / (1 - p_a) < t_b / (1 - p_b)

  i.e. sort by *cost per rejection* ``t / (1 - p)`` ascending.  A predicate that never
  rejects (``p == 1``) has infinite cost per rejection (or 0 when it is also free).

Declared dependencies (``depends_on``) constrain the permissible orders: a predicate runs
only after every predicate it depends on.  With dependencies the plain sort is no
longer enough, so :func:`plan_cascade` searches:

* ``n <= EXACT_LIMIT`` (14): an **exact** dynamic programme over subsets.  Because the
  reach probability of the next stage is the product of the pass rates of the predicates
  already run, *whatever their order*, the cheapest completion from a set ``S`` of
  already-run predicates depends on ``S`` alone:
  ``f(S) = min_{i available after S} [ t_i * prod_{j in S} p_j + f(S + {i}) ]``.
  This is an exhaustive search over all linear extensions of the precedence order (it
  explores every prefix set once, ``O(2^n * n)``), so it is provably optimal for *any*
  dependency graph — strictly stronger than enumerating the ``n!`` permutations for
  ``n <= 8`` and much cheaper.
* larger routes: **greedy** — repeatedly run the available predicate with the smallest
  ``t / (1 - p)`` — followed by adjacent exchanges (equation 2) while they lower ``T``
  and respect the dependencies.  Without dependencies this is exactly the seed's optimal
  rank order; with general precedence constraints it is a heuristic (the problem
  contains ``1|prec|sum w_j C_j`` as the limit ``p_j -> 1`` and is NP-hard in general;
  Monma & Sidney's decomposition solves series-parallel graphs exactly).  The plan
  records which method produced it.

All of this assumes the predicates' outcomes are independent (or that ``p_k`` were
measured under the order being priced): with correlated predicates the conditional pass
rates must be re-measured per order (seed §15.5.3).  Everything here is pure: no I/O, no
clock, no randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from ledger.algorithms.errors import InputError

__all__ = [
    "EXACT_LIMIT",
    "Predicate",
    "OrderCost",
    "CascadePlan",
    "CascadeRun",
    "cost_per_rejection",
    "expected_checking_seconds",
    "route_yield",
    "seconds_per_admitted",
    "evaluate_order",
    "respects_dependencies",
    "plan_cascade",
    "run_cascade",
    "measure_predicate",
    "format_plan",
]

EXACT_LIMIT = 14
"""Largest route solved exactly by the subset dynamic programme."""

_REL_TOL = 1e-12


@dataclass(frozen=True)
class Predicate:
    """One admission predicate of a route.

    ``pass_rate`` is ``p_k`` (probability of *pass* given the predicate is reached;
    fail, pending and unknown all stop the cascade, so they all count as non-pass) and
    ``slot_seconds`` is ``t_k`` (expected occupied verifier slot seconds when reached).
    ``depends_on`` names predicates that must run earlier (data dependencies, containment
    rules such as "governance before running untrusted code").
    """

    name: str
    pass_rate: float
    slot_seconds: float
    depends_on: tuple[str, ...] = ()
    family: str | None = None
    repetitions: tuple[int, str, int] | None = None  # (runs, aggregate, k) of a repeated verifier (SPEC §6.8)
    attempt_pass_rate: float | None = None  # passes per recorded attempt of a repeated verifier

    def __post_init__(self) -> None:
        if not self.name:
            raise InputError("predicate name must be non-empty")
        if not (0.0 <= self.pass_rate <= 1.0) or math.isnan(self.pass_rate):
            raise InputError(f"{self.name}: pass_rate must be in [0, 1], got {self.pass_rate!r}")
        if not (self.slot_seconds >= 0.0) or math.isinf(self.slot_seconds):
            raise InputError(f"{self.name}: slot_seconds must be finite and >= 0, got {self.slot_seconds!r}")
        if not isinstance(self.depends_on, tuple):
            object.__setattr__(self, "depends_on", tuple(self.depends_on))
        if self.name in self.depends_on:
            raise InputError(f"{self.name}: a predicate cannot depend on itself")

    @property
    def cost_per_rejection(self) -> float:
        """``t / (1 - p)``, the rank of equation 2 (see :func:`cost_per_rejection`)."""
        return cost_per_rejection(self.pass_rate, self.slot_seconds)


def cost_per_rejection(pass_rate: float, slot_seconds: float) -> float:
    """Seed equation 2's rank ``t / (1 - p)``: slot seconds spent per rejection caused.

    A predicate that never rejects (``p == 1``) ranks last (``inf``) unless it is free
    (``t == 0``), in which case it costs nothing wherever it runs and ranks ``0``.
    """
    if pass_rate >= 1.0:
        return 0.0 if slot_seconds == 0.0 else math.inf
    return slot_seconds / (1.0 - pass_rate)


def expected_checking_seconds(predicates: Sequence[Predicate]) -> float:
    """Seed equation 1: ``T = sum_k t_k prod_{j<k} p_j`` for predicates in run order."""
    total = 0.0
    reach = 1.0
    for pred in predicates:
        total += pred.slot_seconds * reach
        reach *= pred.pass_rate
    return total


def route_yield(predicates: Iterable[Predicate]) -> float:
    """Route yield ``Y = prod_k p_k`` (order-independent)."""
    y = 1.0
    for pred in predicates:
        y *= pred.pass_rate
    return y


def seconds_per_admitted(predicates: Sequence[Predicate]) -> float | None:
    """Expected checking seconds per *admitted* record, ``T / Y`` (``None`` if ``Y == 0``)."""
    y = route_yield(predicates)
    if y <= 0.0:
        return None
    return expected_checking_seconds(predicates) / y


@dataclass(frozen=True)
class OrderCost:
    """The price of one run order (equation 1 and the yield)."""

    order: tuple[str, ...]
    reach: tuple[float, ...]
    """Probability that each stage (same positions as ``order``) is reached."""
    seconds_per_attempted: float
    route_yield: float
    seconds_per_admitted: float | None


def _index(predicates: Sequence[Predicate]) -> dict[str, Predicate]:
    by_name: dict[str, Predicate] = {}
    for pred in predicates:
        if pred.name in by_name:
            raise InputError(f"duplicate predicate name {pred.name!r}")
        by_name[pred.name] = pred
    for pred in predicates:
        for dep in pred.depends_on:
            if dep not in by_name:
                raise InputError(f"{pred.name}: depends on unknown predicate {dep!r}")
    return by_name


def _ordered(predicates: Sequence[Predicate], order: Sequence[str]) -> list[Predicate]:
    by_name = _index(predicates)
    if sorted(order) != sorted(by_name):
        raise InputError(f"order {list(order)!r} is not a permutation of {sorted(by_name)!r}")
    return [by_name[name] for name in order]


def respects_dependencies(predicates: Sequence[Predicate], order: Sequence[str]) -> bool:
    """True when every predicate in ``order`` comes after all of its ``depends_on``."""
    by_name = _index(predicates)
    seen: set[str] = set()
    for name in order:
        if any(dep not in seen for dep in by_name[name].depends_on):
            return False
        seen.add(name)
    return True


def evaluate_order(predicates: Sequence[Predicate], order: Sequence[str] | None = None) -> OrderCost:
    """Price ``order`` (default: the sequence as given) with equation 1 and the yield."""
    names = [p.name for p in predicates] if order is None else list(order)
    seq = _ordered(predicates, names)
    reach: list[float] = []
    r = 1.0
    for pred in seq:
        reach.append(r)
        r *= pred.pass_rate
    return OrderCost(
        order=tuple(names),
        reach=tuple(reach),
        seconds_per_attempted=expected_checking_seconds(seq),
        route_yield=route_yield(seq),
        seconds_per_admitted=seconds_per_admitted(seq),
    )


@dataclass(frozen=True)
class CascadePlan:
    """A chosen order compared with the declared one (same predicates, same admitted set)."""

    predicates: tuple[Predicate, ...]
    declared: OrderCost
    chosen: OrderCost
    method: str
    """``"exact"`` (subset dynamic programme, optimal) or ``"greedy"`` (heuristic)."""
    saving_seconds_per_attempted: float = field(init=False)
    saving_fraction: float = field(init=False)
    """Share of the declared order's slot time the chosen order saves (0 when T == 0)."""

    def __post_init__(self) -> None:
        saving = self.declared.seconds_per_attempted - self.chosen.seconds_per_attempted
        object.__setattr__(self, "saving_seconds_per_attempted", saving)
        base = self.declared.seconds_per_attempted
        object.__setattr__(self, "saving_fraction", saving / base if base > 0 else 0.0)

    def predicate(self, name: str) -> Predicate:
        for pred in self.predicates:
            if pred.name == name:
                return pred
        raise KeyError(name)


def _check_acyclic(predicates: Sequence[Predicate]) -> None:
    by_name = _index(predicates)
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        mark = state.get(name, 0)
        if mark == 2:
            return
        if mark == 1:
            raise InputError("dependency cycle: " + " -> ".join(trail + [name]))
        state[name] = 1
        for dep in by_name[name].depends_on:
            visit(dep, trail + [name])
        state[name] = 2

    for pred in predicates:
        visit(pred.name, [])


def _exact_order(preds: Sequence[Predicate]) -> list[int]:
    """Optimal order by dynamic programming over the set of predicates already run."""
    n = len(preds)
    pos = {p.name: i for i, p in enumerate(preds)}
    need = [sum(1 << pos[d] for d in p.depends_on) for p in preds]
    full = (1 << n) - 1
    # reach[S] = prod_{j in S} p_j, built incrementally from the lowest set bit.
    reach = [1.0] * (1 << n)
    for mask in range(1, 1 << n):
        low = mask & -mask
        reach[mask] = reach[mask ^ low] * preds[low.bit_length() - 1].pass_rate
    best = [math.inf] * (1 << n)
    choice = [-1] * (1 << n)
    best[full] = 0.0
    for mask in range(full - 1, -1, -1):
        r = reach[mask]
        b = math.inf
        c = -1
        for i in range(n):  # declared order => ties go to the earliest declared predicate
            bit = 1 << i
            if mask & bit or (need[i] & mask) != need[i]:
                continue
            rest = best[mask | bit]
            if rest == math.inf:
                continue
            cost = preds[i].slot_seconds * r + rest
            if c < 0 or cost < b - _REL_TOL * abs(b):
                b, c = cost, i
        best[mask] = b
        choice[mask] = c
    order: list[int] = []
    mask = 0
    while mask != full:
        i = choice[mask]
        if i < 0:  # pragma: no cover - acyclicity was checked
            raise InputError("no order satisfies the dependencies")
        order.append(i)
        mask |= 1 << i
    return order


def _greedy_order(preds: Sequence[Predicate]) -> list[int]:
    """Rank greedy among available predicates, then improving adjacent exchanges."""
    n = len(preds)
    pos = {p.name: i for i, p in enumerate(preds)}
    deps = [{pos[d] for d in p.depends_on} for p in preds]
    done: set[int] = set()
    order: list[int] = []
    while len(order) < n:
        avail = [i for i in range(n) if i not in done and deps[i] <= done]
        nxt = min(avail, key=lambda i: (preds[i].cost_per_rejection, i))
        order.append(nxt)
        done.add(nxt)
    improved = True
    while improved:  # equation 2 applied to adjacent pairs; T strictly falls, so it ends
        improved = False
        for k in range(n - 1):
            a, b = order[k], order[k + 1]
            if a in deps[b]:
                continue
            pa, pb = preds[a], preds[b]
            here = pa.slot_seconds + pa.pass_rate * pb.slot_seconds
            swapped = pb.slot_seconds + pb.pass_rate * pa.slot_seconds
            if swapped < here - _REL_TOL * here:
                order[k], order[k + 1] = b, a
                improved = True
    return order


def plan_cascade(
    predicates: Sequence[Predicate],
    declared_order: Sequence[str] | None = None,
    method: str = "auto",
) -> CascadePlan:
    """Choose the cheapest permissible order (equations 1 and 2 under dependencies).

    ``declared_order`` defaults to the order of ``predicates``; it must itself respect
    the dependencies.  ``method`` is ``"auto"`` (exact up to :data:`EXACT_LIMIT`
    predicates, greedy beyond), ``"exact"`` or ``"greedy"``.
    """
    preds = tuple(predicates)
    _index(preds)
    _check_acyclic(preds)
    declared = [p.name for p in preds] if declared_order is None else list(declared_order)
    _ordered(preds, declared)
    if not respects_dependencies(preds, declared):
        raise InputError(f"declared order {declared!r} violates the declared dependencies")
    if method == "auto":
        method = "exact" if len(preds) <= EXACT_LIMIT else "greedy"
    if method == "exact":
        if len(preds) > 24:
            raise InputError("exact planning is limited to 24 predicates")
        idx = _exact_order(preds)
    elif method == "greedy":
        idx = _greedy_order(preds)
    else:
        raise InputError(f"unknown method {method!r}")
    chosen = [preds[i].name for i in idx]
    declared_cost = evaluate_order(preds, declared)
    chosen_cost = evaluate_order(preds, chosen)
    base = declared_cost.seconds_per_attempted
    if chosen_cost.seconds_per_attempted >= base - _REL_TOL * base:
        # No gain (a tie, or a greedy result that is worse): keep the declared order.
        chosen_cost = declared_cost
    return CascadePlan(predicates=preds, declared=declared_cost, chosen=chosen_cost, method=method)


@dataclass(frozen=True)
class CascadeRun:
    """One record through a cascade with short-circuit evaluation."""

    admitted: bool
    slot_seconds: float
    evaluated: tuple[str, ...]
    stopped_at: str | None
    """First non-passing predicate, ``None`` when admitted."""


def run_cascade(
    predicates: Sequence[Predicate],
    order: Sequence[str],
    outcomes: Mapping[str, bool],
) -> CascadeRun:
    """Evaluate one record whose per-predicate outcomes are known (``True`` = pass).

    Used to show that reordering never changes the admitted set: admission is the
    conjunction of all outcomes, whatever the order; only the work differs.
    """
    seq = _ordered(predicates, order)
    spent = 0.0
    evaluated: list[str] = []
    for pred in seq:
        spent += pred.slot_seconds
        evaluated.append(pred.name)
        if not outcomes[pred.name]:
            return CascadeRun(False, spent, tuple(evaluated), pred.name)
    return CascadeRun(True, spent, tuple(evaluated), None)


def measure_predicate(
    name: str,
    observations: Iterable[tuple[str, float | None]],
    depends_on: Sequence[str] = (),
    family: str | None = None,
) -> Predicate:
    """Estimate ``p`` and ``t`` from ``(verdict, slot_seconds)`` observations.

    ``p`` = passes / observations (fail, pending and unknown all stop the cascade);
    ``t`` = mean of the reported slot seconds (observations without one are skipped;
    0 when none reported).  With no observations the predicate is priced as
    ``p = 1, t = 0`` (it neither rejects nor costs anything known).  Measured under one
    order, the rate is conditional on the predicates that ran before it.
    """
    n = passes = timed = 0
    seconds = 0.0
    for verdict, slot in observations:
        n += 1
        if verdict == "pass":
            passes += 1
        if slot is not None:
            timed += 1
            seconds += float(slot)
    p = passes / n if n else 1.0
    t = seconds / timed if timed else 0.0
    return Predicate(name=name, pass_rate=p, slot_seconds=t, depends_on=tuple(depends_on), family=family)


def _fmt_seconds(x: float | None) -> str:
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:.4g}"


def format_plan(plan: CascadePlan) -> str:
    """A plain-text table of the chosen order and the comparison with the declared one."""
    rows = [("#", "predicate", "p", "t (s)", "t/(1-p) (s)", "reached", "after")]
    for k, (name, reach) in enumerate(zip(plan.chosen.order, plan.chosen.reach), start=1):
        pred = plan.predicate(name)
        rows.append(
            (
                str(k),
                name,
                f"{pred.pass_rate:.4g}",
                _fmt_seconds(pred.slot_seconds),
                _fmt_seconds(pred.cost_per_rejection),
                f"{reach:.4f}",
                ",".join(pred.depends_on) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    d, c = plan.declared, plan.chosen
    lines += [
        "",
        f"method: {plan.method}",
        f"declared order: {' -> '.join(d.order)}",
        f"chosen order:   {' -> '.join(c.order)}",
        f"route yield: {c.route_yield:.4%} (identical for every order)",
        "expected slot seconds per attempted record: "
        f"chosen {_fmt_seconds(c.seconds_per_attempted)}, declared {_fmt_seconds(d.seconds_per_attempted)}",
        "expected slot seconds per admitted record:  "
        f"chosen {_fmt_seconds(c.seconds_per_admitted)}, declared {_fmt_seconds(d.seconds_per_admitted)}",
        f"saving vs declared order: {_fmt_seconds(plan.saving_seconds_per_attempted)} s per attempted record "
        f"({plan.saving_fraction:.1%})",
    ]
    for pred in plan.predicates:
        if pred.repetitions is not None:
            lines.append(repetition_note(pred))
    return "\n".join(lines)


def false_pass_bound(p: float, runs: int) -> float:
    """Seed 002 §15.5.2: a defective candidate that passes one run with probability ``p`` passes
    "rerun until it passes" within ``runs`` tries with probability ``1 - (1 - p)^runs``."""
    return 1.0 - (1.0 - p) ** runs


def aggregate_acceptance(p: float, runs: int, aggregate: str, k: int) -> float:
    """Probability that ``runs`` independent attempts passing with ``p`` each meet the aggregate
    (``all``: every run passes; ``k_of_n``: at least ``k`` pass)."""
    need = runs if aggregate == "all" else k
    return sum(math.comb(runs, j) * p ** j * (1.0 - p) ** (runs - j) for j in range(need, runs + 1))


def repetition_note(pred: Predicate) -> str:
    runs, aggregate, k = pred.repetitions  # type: ignore[misc]
    p = pred.attempt_pass_rate
    rule = "all" if aggregate == "all" else f"{k} of {runs}"
    if p is None:
        return (f"{pred.name}: {runs} runs ({rule}); no attempts recorded yet, false-pass bound 1-(1-p)^{runs} "
                "for a per-run false-pass probability p")
    return (f"{pred.name}: {runs} runs ({rule}); per-attempt pass rate p = {p:.4g}: rerunning until a pass would accept "
            f"with false-pass bound {false_pass_bound(p, runs):.3f} = 1-(1-p)^{runs}; the declared aggregate accepts "
            f"with {aggregate_acceptance(p, runs, aggregate, k):.3f}")
