"""Cascade planner: seed 002 napkin math 15.2, exercise 2, and optimality properties."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.cascade_plan import (
    EXACT_LIMIT,
    Predicate,
    evaluate_order,
    expected_checking_seconds,
    format_plan,
    measure_predicate,
    plan_cascade,
    respects_dependencies,
    route_yield,
    run_cascade,
)

# Seed 002 table 6: one hypothetical end-to-end demonstration route.  record and use run
# first (data dependencies); target reads the test artifacts that out produces.
ROUTE_15_2 = [
    Predicate("record", 0.95, 0.01),
    Predicate("use", 0.90, 0.04),
    Predicate("out", 0.40, 8.0, ("record", "use")),
    Predicate("proc", 0.80, 0.20, ("record", "use")),
    Predicate("target", 0.75, 2.0, ("out",)),
]
DECLARED_15_2 = ["record", "use", "out", "proc", "target"]
CHEAPER_15_2 = ["record", "use", "proc", "out", "target"]


# --------------------------------------------------------------------------- napkin 15.2


def test_napkin_15_2_cost_per_rejection() -> None:
    by = {p.name: p for p in ROUTE_15_2}
    assert by["proc"].cost_per_rejection == pytest.approx(1.0)  # 0.20 s / (1 - 0.8)
    assert round(by["out"].cost_per_rejection, 1) == 13.3  # 8 s / (1 - 0.4)
    assert by["target"].cost_per_rejection == pytest.approx(8.0)  # below out's 13.3 s


def test_napkin_15_2_chosen_order_yield_and_saving() -> None:
    plan = plan_cascade(ROUTE_15_2, DECLARED_15_2)
    assert plan.method == "exact"
    assert list(plan.chosen.order) == CHEAPER_15_2
    # Both proc and out are reached with probability 0.855 = 0.95 * 0.90.
    assert plan.chosen.reach[2] == pytest.approx(0.855)
    assert plan.declared.reach[2] == pytest.approx(0.855)
    # Identical yield 20.52 % in both orders, ~20,520 of 100,000 records.
    assert plan.chosen.route_yield == pytest.approx(0.2052, abs=1e-12)
    assert plan.declared.route_yield == pytest.approx(0.2052, abs=1e-12)
    assert round(100_000 * plan.chosen.route_yield) == 20_520
    # 1.27 s saved per attempted record, by the seed's closed form too.
    closed_form = 0.95 * 0.90 * (8.0 * (1 - 0.8) - 0.20 * (1 - 0.4))
    assert plan.saving_seconds_per_attempted == pytest.approx(closed_form)
    assert round(plan.saving_seconds_per_attempted, 2) == 1.27
    # 16.9 % less verifier slot time.
    assert round(100 * plan.saving_fraction, 1) == 16.9
    # The cheaper order occupies 6.24 s per attempt (the figure napkin 15.6 reuses).
    assert round(plan.chosen.seconds_per_attempted, 2) == 6.24
    assert plan.chosen.seconds_per_attempted == pytest.approx(6.2382)
    assert plan.declared.seconds_per_attempted == pytest.approx(7.5036)
    assert plan.chosen.seconds_per_admitted == pytest.approx(6.2382 / 0.2052)
    assert plan.declared.seconds_per_admitted == pytest.approx(7.5036 / 0.2052)


def test_napkin_15_2_exhaustive_state_space_enumeration() -> None:
    """Equation 1 equals the expectation over all 2^5 outcome vectors, per order,
    and every outcome vector gets the same admission decision under both orders."""
    for order in (DECLARED_15_2, CHEAPER_15_2):
        expected = 0.0
        total_p = 0.0
        for bits in itertools.product([True, False], repeat=len(ROUTE_15_2)):
            outcome = {p.name: b for p, b in zip(ROUTE_15_2, bits)}
            weight = math.prod(p.pass_rate if b else 1 - p.pass_rate for p, b in zip(ROUTE_15_2, bits))
            run = run_cascade(ROUTE_15_2, order, outcome)
            other = run_cascade(ROUTE_15_2, DECLARED_15_2 if order is CHEAPER_15_2 else CHEAPER_15_2, outcome)
            assert run.admitted == other.admitted == all(bits)
            expected += weight * run.slot_seconds
            total_p += weight
        assert total_p == pytest.approx(1.0)
        assert expected == pytest.approx(evaluate_order(ROUTE_15_2, order).seconds_per_attempted)


def test_napkin_15_2_same_admitted_set_by_simulation() -> None:
    """100,000 simulated records with independent outcomes: both orders admit exactly the
    same records, and the cheaper order spends ~16.9 % less slot time."""
    rng = np.random.default_rng(20250215)
    n = 100_000
    rates = np.array([p.pass_rate for p in ROUTE_15_2])
    passes = rng.random((n, len(ROUTE_15_2))) < rates
    admitted: dict[str, set[int]] = {}
    seconds: dict[str, float] = {}
    for label, order in (("declared", DECLARED_15_2), ("cheaper", CHEAPER_15_2)):
        ids: set[int] = set()
        spent = 0.0
        for i in range(n):
            outcome = {p.name: bool(passes[i, j]) for j, p in enumerate(ROUTE_15_2)}
            run = run_cascade(ROUTE_15_2, order, outcome)
            spent += run.slot_seconds
            if run.admitted:
                ids.add(i)
        admitted[label] = ids
        seconds[label] = spent
    assert admitted["declared"] == admitted["cheaper"]
    assert admitted["cheaper"] == set(np.flatnonzero(passes.all(axis=1)).tolist())
    y = 0.2052
    assert abs(len(admitted["cheaper"]) - n * y) < 4 * math.sqrt(n * y * (1 - y))
    saving = 1 - seconds["cheaper"] / seconds["declared"]
    assert saving == pytest.approx(0.169, abs=0.005)
    assert seconds["cheaper"] / n == pytest.approx(6.2382, rel=0.02)


def test_napkin_15_2_target_would_move_ahead_without_its_dependency() -> None:
    """Systems insight: target's 8 s per rejection beats out's 13.3 s, so only the declared
    dependency keeps it last."""
    free = [Predicate(p.name, p.pass_rate, p.slot_seconds, tuple(d for d in p.depends_on if p.name != "target"))
            for p in ROUTE_15_2]
    plan = plan_cascade(free, DECLARED_15_2)
    assert list(plan.chosen.order) == ["record", "use", "proc", "target", "out"]


def test_format_plan_table() -> None:
    text = format_plan(plan_cascade(ROUTE_15_2, DECLARED_15_2))
    assert "record -> use -> proc -> out -> target" in text
    assert "20.5200%" in text
    assert "16.9%" in text
    assert "13.33" in text
    assert "6.238" in text and "7.504" in text
    assert "30.4" in text and "36.57" in text
    assert text.splitlines()[0].split()[:2] == ["#", "predicate"]


# --------------------------------------------------------------------------- exercise 2

EXERCISE_2 = [
    Predicate("use", 0.70, 0.05),
    Predicate("out", 0.50, 30.0),
    Predicate("target", 0.80, 4.0),  # does not need the test result
]


def test_exercise_2_rank_and_order() -> None:
    ranks = {p.name: p.cost_per_rejection for p in EXERCISE_2}
    assert ranks["use"] == pytest.approx(0.05 / 0.3)
    assert ranks["target"] == pytest.approx(20.0)
    assert ranks["out"] == pytest.approx(60.0)
    plan = plan_cascade(EXERCISE_2, ["use", "out", "target"])
    assert list(plan.chosen.order) == ["use", "target", "out"]


def test_exercise_2_costs() -> None:
    plan = plan_cascade(EXERCISE_2, ["use", "out", "target"])
    # current: 0.05 + 0.7*30 + 0.7*0.5*4 = 22.45 s; chosen: 0.05 + 0.7*4 + 0.7*0.8*30 = 19.65 s
    assert plan.declared.seconds_per_attempted == pytest.approx(22.45)
    assert plan.chosen.seconds_per_attempted == pytest.approx(19.65)
    assert plan.chosen.route_yield == pytest.approx(0.28)
    assert plan.declared.seconds_per_admitted == pytest.approx(22.45 / 0.28)  # 80.18 s
    assert plan.chosen.seconds_per_admitted == pytest.approx(19.65 / 0.28)  # 70.18 s
    assert plan.declared.seconds_per_admitted is not None and plan.chosen.seconds_per_admitted is not None
    assert round(plan.declared.seconds_per_admitted, 2) == 80.18
    assert round(plan.chosen.seconds_per_admitted, 2) == 70.18
    assert plan.saving_fraction == pytest.approx(2.8 / 22.45)  # 12.5 %
    assert round(100 * plan.saving_fraction, 1) == 12.5


def test_exercise_2_dropping_a_predicate_is_not_a_saving() -> None:
    """Dropping target lowers seconds per admitted record (60.14 s) but changes the yield
    (0.28 -> 0.35), i.e. it admits a different corpus: not a cost comparison."""
    dropped = evaluate_order([p for p in EXERCISE_2 if p.name != "target"], ["use", "out"])
    assert dropped.seconds_per_attempted == pytest.approx(21.05)
    assert dropped.route_yield == pytest.approx(0.35)
    assert round(dropped.seconds_per_admitted or 0.0, 2) == 60.14
    full = plan_cascade(EXERCISE_2)
    assert dropped.route_yield != pytest.approx(full.chosen.route_yield)
    # Simulated: the records admitted without target are a strict superset.
    rng = np.random.default_rng(7)
    passes = rng.random((20_000, 3)) < np.array([0.7, 0.5, 0.8])
    keep_full = {i for i in range(len(passes)) if passes[i].all()}
    keep_dropped = {i for i in range(len(passes)) if passes[i, 0] and passes[i, 1]}
    assert keep_full < keep_dropped


# --------------------------------------------------------------------------- basics and validation


def test_equation_1_empty_and_single() -> None:
    assert expected_checking_seconds([]) == 0.0
    assert route_yield([]) == 1.0
    assert expected_checking_seconds([Predicate("a", 0.3, 2.0)]) == 2.0


def test_zero_yield_has_no_per_admitted_ratio() -> None:
    cost = evaluate_order([Predicate("a", 0.0, 1.0), Predicate("b", 0.5, 1.0)])
    assert cost.route_yield == 0.0
    assert cost.seconds_per_admitted is None
    assert cost.seconds_per_attempted == 1.0


def test_never_rejecting_predicate_ranks_last() -> None:
    preds = [Predicate("always", 1.0, 0.5), Predicate("free", 1.0, 0.0), Predicate("x", 0.5, 10.0)]
    assert preds[0].cost_per_rejection == math.inf
    assert preds[1].cost_per_rejection == 0.0
    plan = plan_cascade(preds)
    assert plan.chosen.order.index("x") < plan.chosen.order.index("always")


def test_tie_keeps_declared_order() -> None:
    preds = [Predicate("a", 0.5, 1.0), Predicate("b", 0.5, 1.0)]
    plan = plan_cascade(preds, ["b", "a"])
    assert plan.chosen.order == ("b", "a")
    assert plan.saving_seconds_per_attempted == 0.0


@pytest.mark.parametrize(
    "preds, declared, message",
    [
        ([Predicate("a", 0.5, 1.0, ("b",)), Predicate("b", 0.5, 1.0, ("a",))], None, "cycle"),
        ([Predicate("a", 0.5, 1.0, ("zzz",))], None, "unknown"),
        ([Predicate("a", 0.5, 1.0), Predicate("a", 0.4, 1.0)], None, "duplicate"),
        ([Predicate("a", 0.5, 1.0), Predicate("b", 0.5, 1.0, ("a",))], ["b", "a"], "violates"),
        ([Predicate("a", 0.5, 1.0)], ["a", "b"], "permutation"),
    ],
)
def test_plan_validation(preds: list[Predicate], declared: list[str] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_cascade(preds, declared)


@pytest.mark.parametrize("p, t", [(-0.1, 1.0), (1.1, 1.0), (0.5, -1.0), (0.5, math.inf), (math.nan, 1.0)])
def test_predicate_validation(p: float, t: float) -> None:
    with pytest.raises(ValueError):
        Predicate("x", p, t)


def test_measure_predicate() -> None:
    obs = [("pass", 1.0), ("fail", 3.0), ("pending", None), ("pass", 2.0)]
    pred = measure_predicate("out", obs, depends_on=["use"])
    assert pred.pass_rate == pytest.approx(0.5)  # pending stops the cascade like a fail
    assert pred.slot_seconds == pytest.approx(2.0)
    assert pred.depends_on == ("use",)
    assert measure_predicate("none", []).pass_rate == 1.0


def test_large_route_uses_greedy_rank_order() -> None:
    n = EXACT_LIMIT + 2
    preds = [Predicate(f"c{i:02d}", 0.5 + 0.02 * i, 1.0 + (i * 7) % 5) for i in range(n)]
    plan = plan_cascade(preds)
    assert plan.method == "greedy"
    ranks = [plan.predicate(name).cost_per_rejection for name in plan.chosen.order]
    assert ranks == sorted(ranks)


# --------------------------------------------------------------------------- properties


@st.composite
def routes(draw: st.DrawFn, max_n: int = 6) -> list[Predicate]:
    n = draw(st.integers(min_value=1, max_value=max_n))
    topo = draw(st.permutations(list(range(n))))
    preds: list[Predicate] = []
    for i in range(n):
        earlier = [f"q{j}" for j in range(n) if topo.index(j) < topo.index(i)]
        deps = draw(st.lists(st.sampled_from(earlier), unique=True, max_size=2)) if earlier else []
        p = draw(st.one_of(st.just(1.0), st.just(0.0), st.floats(0.0, 1.0)))
        t = draw(st.one_of(st.just(0.0), st.floats(0.0, 10.0)))
        preds.append(Predicate(f"q{i}", p, t, tuple(deps)))
    return preds


def _permissible(preds: list[Predicate]) -> list[tuple[str, ...]]:
    names = [p.name for p in preds]
    return [perm for perm in itertools.permutations(names) if respects_dependencies(preds, perm)]


@settings(max_examples=200, deadline=None)
@given(routes())
def test_chosen_order_is_optimal_among_permissible_orders(preds: list[Predicate]) -> None:
    plan = plan_cascade(preds, _permissible(preds)[0])
    assert respects_dependencies(preds, plan.chosen.order)
    best = min(evaluate_order(preds, perm).seconds_per_attempted for perm in _permissible(preds))
    assert plan.chosen.seconds_per_attempted <= best * (1 + 1e-9) + 1e-15


@settings(max_examples=200, deadline=None)
@given(routes())
def test_yield_is_independent_of_order(preds: list[Predicate]) -> None:
    yields = {evaluate_order(preds, perm).route_yield for perm in _permissible(preds)}
    first = next(iter(yields))
    assert all(math.isclose(y, first, rel_tol=1e-12, abs_tol=1e-15) for y in yields)


@settings(max_examples=200, deadline=None)
@given(routes())
def test_greedy_never_worse_than_declared_and_respects_dependencies(preds: list[Predicate]) -> None:
    declared = _permissible(preds)[-1]
    plan = plan_cascade(preds, declared, method="greedy")
    assert respects_dependencies(preds, plan.chosen.order)
    assert plan.chosen.seconds_per_attempted <= plan.declared.seconds_per_attempted + 1e-12


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 10.0)), min_size=1, max_size=6))
def test_without_dependencies_rank_greedy_is_exact(pts: list[tuple[float, float]]) -> None:
    preds = [Predicate(f"r{i}", p, t) for i, (p, t) in enumerate(pts)]
    exact = plan_cascade(preds, method="exact").chosen.seconds_per_attempted
    greedy = plan_cascade(preds, method="greedy").chosen.seconds_per_attempted
    assert greedy == pytest.approx(exact, rel=1e-9, abs=1e-12)
