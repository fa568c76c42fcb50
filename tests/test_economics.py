"""Economics and credits: seed 002 napkin math 15.4-15.7, equation 3, pass@k, diversity."""

from __future__ import annotations

import itertools
import math
from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.cascade_plan import Predicate, plan_cascade
from ledger.algorithms.credits import (
    BurstAnalysis,
    CreditPool,
    CreditPoolConfig,
    analyse_timeout_burst,
    apply,
    binding_limit,
    drain_seconds,
    exhaustion_seconds,
    fold,
    high_watermark,
    initial_state,
    staging_limits,
)
from ledger.algorithms.economics import (
    RoundTelemetry,
    active_cost_per_admitted,
    artifact_cost,
    artifact_cost_from_dispositions,
    attempts_per_success,
    cost_per_emitted_artifact,
    coverage_narrowing_warnings,
    distinct_action_sequences,
    informative_task_fraction,
    mean_distinct_per_fixture,
    normalise_action_sequence,
    pass_at_k,
    plan_collector,
    success_probability,
)

MB = 10**6
GB = 10**9

# --------------------------------------------------------------------------- napkin 15.4


def burst_15_4() -> BurstAnalysis:
    return analyse_timeout_burst(
        concurrent_rollouts=1024,
        rollout_seconds=45,
        verifier_slots=512,
        mean_service_seconds=16.875,
        timeout_seconds=120,
        ceiling_bytes=8 * MB,
        capacity_bytes=32 * GB,
        reaction_delay_seconds=30,
    )


def test_napkin_15_4_rates() -> None:
    b = burst_15_4()
    assert round(b.arrival_per_second, 1) == 22.8
    assert round(b.nominal_capacity_per_second, 1) == 30.3
    assert b.nominal_utilization == pytest.approx(0.75)
    assert round(b.burst_capacity_per_second, 1) == 4.3
    assert round(b.growth_records_per_second, 1) == 18.5
    assert round(b.growth_bytes_per_second / MB, 1) == 147.9


def test_napkin_15_4_exhaustion_and_watermark() -> None:
    b = burst_15_4()
    assert round(b.exhaustion_seconds, 1) == 216.3
    assert round(b.exhaustion_seconds / 60, 1) == 3.6
    assert round(b.inflight_bytes / GB, 1) == 8.2
    assert round(b.delay_growth_bytes / GB, 1) == 4.4
    # (32 - 8.192 - 4.437) / 32 = 0.6053: dispatch must stop at or below ~60 % of the store.
    assert b.high_watermark == pytest.approx((32 * GB - 8.192 * GB - 4437.3333 * MB) / (32 * GB))
    assert math.floor(100 * b.high_watermark) == 60
    # Stopping at 60 % leaves room for the in-flight work and the reaction-delay growth.
    assert 0.60 * 32 * GB + b.inflight_bytes + b.delay_growth_bytes <= 32 * GB
    # A store holding records at onset is exhausted sooner, in proportion.
    half = exhaustion_seconds(32 * GB, 8 * MB, b.growth_records_per_second, occupied_bytes=16 * GB)
    assert half == pytest.approx(b.exhaustion_seconds / 2)


def test_rate_model_edges() -> None:
    assert exhaustion_seconds(100, 1, 0.0) == math.inf
    assert exhaustion_seconds(100, 1, -3.0) == math.inf
    assert exhaustion_seconds(100, 1, 5.0, occupied_bytes=200) == 0.0
    assert high_watermark(100, 0, -5.0, 10) == 1.0
    assert high_watermark(100, 80, 5.0, 10) < 0  # no safe watermark: the hard limit must act


# --------------------------------------------------------------------------- exercise 7 (issue 26, wrong result 4)


def burst_exercise_7(**kw: Any) -> BurstAnalysis:
    """Seed 002 exercise 7: sessions finish at 50/s and capture for 120 s (6,000 capturing at
    once), 40 judge slots at 0.6 s that time out at 10 s, 250 kB records, 4 GB and at most
    10,000 outstanding records, a controller that needs 20 s."""
    args: dict[str, Any] = dict(concurrent_rollouts=50 * 120, rollout_seconds=120, verifier_slots=40,
                                mean_service_seconds=0.6, timeout_seconds=10, ceiling_bytes=250_000,
                                capacity_bytes=4 * GB, reaction_delay_seconds=20, record_limit=10_000)
    args.update(kw)
    return analyse_timeout_burst(**args)


def test_exercise_7_the_record_limit_binds_and_sizes_the_watermark() -> None:
    b = burst_exercise_7()
    assert b.nominal_utilization == pytest.approx(0.75) and b.burst_capacity_per_second == 4.0
    assert b.growth_records_per_second == 46.0 and b.growth_bytes_per_second == 11.5 * MB
    recs, byts = b.limits["records"], b.limits["bytes"]
    assert round(byts.exhaustion_seconds, 1) == 347.8 and f"{100 * byts.high_watermark:.1f}" == "56.8"
    assert round(recs.exhaustion_seconds, 1) == 217.4 and f"{100 * recs.high_watermark:.1f}" == "30.8"
    # 10,000 records - 6,000 from sessions already capturing - 46/s x 20 s during the controller's delay
    assert (recs.inflight, recs.delay_growth) == (6000, 920) and recs.high_watermark == pytest.approx(0.308)
    assert b.binding_limit == "records" and b.exhaustion_seconds == recs.exhaustion_seconds
    assert b.high_watermark == recs.high_watermark
    # without a record limit only the bytes are modelled (napkin 15.4's reading)
    only_bytes = burst_exercise_7(record_limit=None)
    assert only_bytes.binding_limit == "bytes" and list(only_bytes.limits) == ["bytes"]
    assert round(only_bytes.exhaustion_seconds, 1) == 347.8


def test_napkin_15_4_bytes_still_bind_with_its_record_limit() -> None:
    b = analyse_timeout_burst(concurrent_rollouts=1024, rollout_seconds=45, verifier_slots=512,
                              mean_service_seconds=16.875, timeout_seconds=120, ceiling_bytes=8 * MB,
                              capacity_bytes=32 * GB, reaction_delay_seconds=30, record_limit=5000)
    assert b.binding_limit == "bytes" and round(b.exhaustion_seconds, 1) == 216.3
    assert b.high_watermark == burst_15_4().high_watermark
    assert round(b.limits["records"].exhaustion_seconds, 1) == round(5000 / b.growth_records_per_second, 1)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 10**12), ceiling=st.integers(1, 10**8), records=st.integers(0, 10**7),
       growth=st.floats(0.01, 1e4), inflight=st.integers(0, 10**6), delay=st.floats(0, 600),
       occupied=st.integers(0, 10**6))
def test_the_binding_limit_is_reached_first_and_has_the_smaller_watermark(capacity, ceiling, records, growth,
                                                                         inflight, delay, occupied) -> None:
    """Whatever the inputs, the binding limit is the one exhausted first, and its watermark (as a
    number of records) is the smaller one: dispatch stopped there leaves room in both limits."""
    lim = staging_limits(capacity_bytes=capacity, ceiling_bytes=ceiling, record_limit=records,
                         growth_records_per_second=growth, inflight_records=inflight, reaction_delay_seconds=delay,
                         occupied_records=occupied)
    name = binding_limit(capacity, ceiling, records)
    other = "bytes" if name == "records" else "records"
    assert lim[name].exhaustion_seconds <= lim[other].exhaustion_seconds * (1 + 1e-9)
    # (a watermark <= 0 means none is safe: compared as 0)
    in_records = {k: max(0.0, lim[k].high_watermark) * lim[k].capacity / (1 if k == "records" else ceiling)
                  for k in lim}
    assert in_records[name] <= in_records[other] + 1e-6 * max(1.0, abs(in_records[other]))


# --------------------------------------------------------------------------- napkin 15.5

CEILING_15_5 = 2 * 1024 * 1024  # "about 2.10 MB"


def test_napkin_15_5_credit_pool_refuses_when_full() -> None:
    assert round(CEILING_15_5 / MB, 2) == 2.10
    pool = CreditPool(CreditPoolConfig(credits=12, ceiling_bytes=CEILING_15_5))
    staged = [pool.reserve(f"staged-{i}") for i in range(4)]
    running = [pool.reserve(f"run-{i}") for i in range(8)]
    assert all(d.kind == "grant" for d in staged + running)
    assert round(4 * CEILING_15_5 / MB, 2) == 8.39
    assert round(8 * CEILING_15_5 / MB, 2) == 16.78
    assert pool.reserved_bytes == 25_165_824
    assert round(pool.reserved_bytes / MB, 2) == 25.17
    assert pool.free_credits == 0
    extra = pool.reserve("one-more")
    assert extra.kind == "refuse" and extra.reason == "no_credit"
    assert pool.reserved_bytes == 25_165_824  # a refusal reserves nothing
    # Drain: ceil(12 / 2) = 6 waves of 10 s.
    assert math.ceil(12 / 2) == 6
    assert drain_seconds(12, 2, 10.0) == 60.0
    assert drain_seconds(12, 3, 10.0) == 40.0  # more verifiers: faster drain, same byte bound


def test_credit_release_rules() -> None:
    pool = CreditPool(CreditPoolConfig(credits=2, ceiling_bytes=10))
    assert pool.reserve("a").kind == "grant"
    assert pool.reserve("b").kind == "grant"
    assert pool.reserve("c").kind == "refuse"
    # Verification alone is not a disposition: the credit stays held.
    d = pool.release("a", "verified")
    assert d.kind == "ignored" and d.reason == "release_requires_disposition_or_ack"
    assert pool.free_credits == 0
    assert pool.release("a", "disposition").kind == "release"
    assert pool.release("a", "disposition").reason == "not_held"  # never freed twice
    assert pool.release("zzz", "handoff_ack").reason == "not_held"
    assert pool.free_credits == 1
    assert pool.reserve("a").reason == "closed"  # a closed run never gets a new credit
    dup = pool.reserve("b")
    assert dup.kind == "grant" and dup.reason == "duplicate"  # retry returns the decision
    assert pool.release("b", "handoff_ack").kind == "release"
    assert pool.reserve("c", expected_bytes=11).reason == "over_ceiling"
    assert pool.reserve("c", expected_bytes=10).kind == "grant"


def test_credit_watermark_slows_then_hard_limit_refuses() -> None:
    cfg = CreditPoolConfig(credits=10, ceiling_bytes=1, high_watermark=0.6)
    pool = CreditPool(cfg)
    kinds = [pool.reserve(f"r{i}").kind for i in range(11)]
    assert kinds == ["grant"] * 6 + ["slow"] * 4 + ["refuse"]
    assert pool.state.above_watermark
    # Byte capacity can be the hard limit rather than the credit count.
    small = CreditPoolConfig(credits=10, ceiling_bytes=4, capacity_bytes=10)
    assert small.hard_limit == 2


def test_credit_state_is_a_fold_of_its_events() -> None:
    pool = CreditPool(CreditPoolConfig(credits=3, ceiling_bytes=5))
    pool.reserve("x")
    pool.reserve("y")
    pool.release("x", "disposition")
    pool.reserve("z")
    cfg = pool.config
    assert fold(cfg, pool.events) == pool.state
    assert reduce(apply, pool.events, initial_state(cfg)) == pool.state
    assert pool.state.last is not None and pool.state.last.id == "z"
    assert dict(pool.state.counts) == {"grant": 3, "release": 1}
    with pytest.raises(ValueError):
        apply(initial_state(cfg), {"op": "explode", "id": "x"})
    with pytest.raises(ValueError):
        apply(initial_state(cfg), {"op": "reserve"})
    alias = apply(initial_state(cfg), {"event_type": "credit_reserved", "id": "q"})
    assert "q" in alias.held


_events = st.lists(
    st.one_of(
        st.fixed_dictionaries({"op": st.just("reserve"), "id": st.sampled_from("abcdefg")}),
        st.fixed_dictionaries(
            {
                "op": st.just("release"),
                "id": st.sampled_from("abcdefg"),
                "reason": st.sampled_from(["disposition", "handoff_ack", "verified", "timeout"]),
            }
        ),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_events, st.integers(0, 5), st.floats(0.0, 1.0))
def test_credit_pool_invariants(events: list[dict[str, str]], credits: int, watermark: float) -> None:
    cfg = CreditPoolConfig(credits=credits, ceiling_bytes=7, high_watermark=watermark)
    state = initial_state(cfg)
    released: list[str] = []
    for event in events:
        before = state
        state = apply(state, event)
        assert len(state.held) <= cfg.hard_limit
        assert state.reserved_bytes <= cfg.capacity
        assert state.reserved_bytes == 7 * len(state.held)
        assert state.last is not None
        if state.last.kind == "release":
            assert event["reason"] in ("disposition", "handoff_ack")
            assert event["id"] in before.held and event["id"] not in state.held
            released.append(event["id"])
        else:
            assert set(state.held) >= set(before.held)
    assert len(released) == len(set(released))  # no run is released twice
    assert fold(cfg, events) == state


# --------------------------------------------------------------------------- napkin 15.6

ROUTE_15_2 = [
    Predicate("record", 0.95, 0.01),
    Predicate("use", 0.90, 0.04),
    Predicate("out", 0.40, 8.0, ("record", "use")),
    Predicate("proc", 0.80, 0.20, ("record", "use")),
    Predicate("target", 0.75, 2.0, ("out",)),
]


def test_napkin_15_6_binding_stage_and_rate() -> None:
    cheaper = plan_cascade(ROUTE_15_2).chosen
    plan = plan_collector(
        accelerators=64,
        generation_seconds_per_attempt=60,
        verifier_slots=4,
        checking_seconds_per_attempt=cheaper.seconds_per_attempted,
        write_bytes_per_second=200 * MB,
        record_ceiling_bytes=8 * MB,
        route_yield=cheaper.route_yield,
    )
    assert round(plan.stage_rates["generation"], 2) == 1.07
    assert round(plan.stage_rates["assessment"], 2) == 0.64
    assert plan.stage_rates["storage"] == pytest.approx(25.0)
    assert plan.binding == "assessment"
    assert plan.verifier_slots_to_match_generation == 7
    assert round(100 * plan.unused_generation_fraction, 1) == 39.9
    assert plan.admitted_rate == pytest.approx(plan.attempt_rate * 0.2052)
    # With the 7 slots, assessment no longer binds: generation does.
    seven = plan_collector(
        accelerators=64,
        generation_seconds_per_attempt=60,
        verifier_slots=7,
        checking_seconds_per_attempt=cheaper.seconds_per_attempted,
        write_bytes_per_second=200 * MB,
        record_ceiling_bytes=8 * MB,
        route_yield=cheaper.route_yield,
    )
    assert seven.binding == "generation"
    assert seven.unused_generation_fraction == pytest.approx(0.0)


def test_napkin_15_6_active_resource_charge() -> None:
    cost = active_cost_per_admitted(
        generation_seconds_per_attempt=60,
        accelerator_price_per_hour=2.50,
        checking_seconds_per_attempt=6.24,
        slot_price_per_hour=0.04,
        route_yield=0.2052,
    )
    assert round(cost.generation_cost_per_attempt, 3) == 0.042
    assert round(cost.cost_per_admitted or 0.0, 2) == 0.20
    assert round(100 * cost.checking_share, 1) == 0.2
    halved = active_cost_per_admitted(
        generation_seconds_per_attempt=60,
        accelerator_price_per_hour=2.50,
        checking_seconds_per_attempt=6.24,
        slot_price_per_hour=0.04,
        route_yield=0.1026,
    )
    assert halved.cost_per_admitted == pytest.approx(2 * (cost.cost_per_admitted or 0.0))
    assert round(halved.cost_per_admitted or 0.0, 2) == 0.41


def test_exercise_6_research_collector_storage_binds() -> None:
    """Seed exercise 6 (answers computed here, the seed prints none): storage binds."""
    preds = [
        Predicate("record", 0.98, 0.02),
        Predicate("use", 0.60, 6.0),
        Predicate("out", 0.70, 3.0),
        Predicate("target", 0.90, 2.0),
    ]
    route = plan_cascade(preds).chosen
    assert list(route.order) == ["record", "out", "use", "target"]  # ranks 1, 10, 15, 20
    assert route.seconds_per_attempted == pytest.approx(0.02 + 0.98 * 3 + 0.98 * 0.7 * 6 + 0.98 * 0.7 * 0.6 * 2)
    assert route.route_yield == pytest.approx(0.37044)
    plan = plan_collector(
        accelerators=32,
        generation_seconds_per_attempt=40,
        verifier_slots=16,
        checking_seconds_per_attempt=route.seconds_per_attempted,
        write_bytes_per_second=500 * MB,
        record_ceiling_bytes=1 * GB,
        route_yield=route.route_yield,
    )
    assert plan.binding == "storage"
    assert round(plan.admitted_rate * 3600, 1) == 666.8
    assert plan.bandwidth_to_match_generation == pytest.approx(800 * MB)
    assert round(0.8 * route.route_yield * 3600, 1) == 1066.9


# --------------------------------------------------------------------------- napkin 15.7

TABLE_15 = {"emitted": 15, "assessed_not_selected": 470, "ineligible": 10, "pending": 3, "unknown": 2}


def test_napkin_15_7_twenty_dollars_per_artifact() -> None:
    cost = artifact_cost_from_dispositions(300.0, TABLE_15)
    assert cost.attempts == 500
    assert cost.emission_yield == pytest.approx(0.03)
    assert cost.cost_per_attempt == pytest.approx(0.60)
    assert cost.cost_per_artifact == pytest.approx(20.0)
    assert cost_per_emitted_artifact(300.0, 15) == pytest.approx(20.0)
    # Raising the emission yield to 6 % halves the unit price to $10.
    assert artifact_cost(300.0, 500, 30).cost_per_artifact == pytest.approx(10.0)


def test_equation_5_zero_artifacts_reports_the_loss() -> None:
    cost = artifact_cost(300.0, 500, 0)
    assert cost.cost_per_artifact is None and cost.cohort_cost == 300.0
    assert cost_per_emitted_artifact(12.0, 0) is None
    with pytest.raises(ValueError):
        artifact_cost_from_dispositions(1.0, {"emitted": 1, "lost": 2})
    with pytest.raises(ValueError):
        artifact_cost(1.0, 2, 3)


# --------------------------------------------------------------------------- equation 3, pass@k


def test_equation_3_seed_numbers() -> None:
    assert round(success_probability(0.05, 8), 2) == 0.34
    assert round(attempts_per_success(0.05, 8)) == 24  # "about 24 attempts"
    assert round(informative_task_fraction(0.05, 8), 2) == 0.34
    assert round(informative_task_fraction(0.50, 8), 2) == 0.99
    assert round(informative_task_fraction(0.95, 8), 2) == 0.34
    assert informative_task_fraction(0.3, 1) == 0.0
    assert attempts_per_success(0.0, 8) == math.inf


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.data())
def test_pass_at_k_matches_subset_enumeration(n: int, data: st.DataObject) -> None:
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    frac = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(frac)


def test_pass_at_k_basics() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0
    assert 0.0 < pass_at_k(10_000, 1, 100) < 1.0
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)


# --------------------------------------------------------------------------- diversity


def test_distinct_normalised_action_sequences() -> None:
    runs: dict[str, list[list[Any]]] = {
        "fx1": [
            [{"tool": "Read", "args": {"path": "a.py"}}, {"tool": "Edit"}, {"tool": "bash"}],
            [{"tool": "read", "args": {"path": "b.py"}}, {"tool": "edit"}, {"tool": "Bash"}],
            [{"tool": "read"}, {"tool": "bash"}, {"tool": "bash"}, {"tool": "edit"}],
        ],
        "fx2": [["  Run   tests", "edit"], ["run tests", "EDIT"]],
    }
    counts = distinct_action_sequences(runs)
    assert counts == {"fx1": 2, "fx2": 1}
    assert mean_distinct_per_fixture(counts) == 1.5
    assert distinct_action_sequences(runs, include_args=True)["fx1"] == 3
    assert normalise_action_sequence(["a", "a", "b", "a"], collapse_repeats=True) == ("a", "b", "a")


def test_diversity_falls_while_held_out_flat_warns() -> None:
    rounds = [
        RoundTelemetry(1, distinct_sequences=6.0, held_out_score=0.40, pass_at_1=0.30, pass_at_k=0.70,
                       train_acceptance=0.50),
        # diversity -33 %, held-out +0.005 (flat), pass@1 up, pass@k flat, training up
        RoundTelemetry(2, distinct_sequences=4.0, held_out_score=0.405, pass_at_1=0.40, pass_at_k=0.70,
                       train_acceptance=0.60),
        # diversity falls again but held-out rises: pruned retries, no warning
        RoundTelemetry(3, distinct_sequences=3.0, held_out_score=0.45, pass_at_1=0.45, pass_at_k=0.75,
                       train_acceptance=0.62),
    ]
    warnings = coverage_narrowing_warnings(rounds)
    assert {(w.rule, w.round) for w in warnings} == {
        ("diversity_falls_held_out_flat", 2),
        ("pass1_up_passk_flat", 2),
        ("train_up_held_out_flat", 2),
    }
    # a small (< 10 %) diversity dip with a flat held-out score is tolerated
    mild = [RoundTelemetry(1, 10.0, 0.5), RoundTelemetry(2, 9.5, 0.5)]
    assert coverage_narrowing_warnings(mild) == []
    # a window compares with rounds further back
    assert [w.round for w in coverage_narrowing_warnings(rounds, window=2)] == []
