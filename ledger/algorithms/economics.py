"""Collection economics and loop telemetry (seed 002 §15.7, §15.8.3, §15.10.3; SPEC §6.7).

* **Equation 3** (informative-task fraction): with ``k`` independent attempts that each
  pass with probability ``p``, a group carries contrast (at least one success and one
  failure) with probability ``1 - (1 - p)^k - p^k``; a success filter harvests a fixture
  with probability ``1 - (1 - p)^k``.
* **Equation 4** (planning rate): ``R = min(A / g, W / T, B / S)`` attempts/s for ``A``
  accelerators spending ``g`` accelerator-seconds per attempt, ``W`` verifier slots at
  ``T`` slot-seconds per attempt (equation 1), and write bandwidth ``B`` charged at the
  record ceiling ``S``.  The smallest term is the binding stage; the planned admitted
  rate is ``R * Y`` for route yield ``Y``.
* **Equation 5** (cost per emitted artifact): ``cohort cost / emitted artifacts`` =
  (cost per attempt) / (emission yield); with zero artifacts the loss is reported, not
  divided.
* pass@k (the unbiased estimator from ``n`` samples with ``c`` correct), distinct
  normalised action sequences per fixture, and the coverage-narrowing warning rules of
  §15.7.2.

Pure functions and dataclasses only: no I/O, no clock.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

from ledger.algorithms.errors import InputError

__all__ = [
    "DISPOSITIONS",
    "CHECK_FAMILIES",
    "family_of",
    "ArtifactCost",
    "cost_per_emitted_artifact",
    "artifact_cost",
    "artifact_cost_from_dispositions",
    "STAGES",
    "CollectorPlan",
    "plan_collector",
    "ActiveCost",
    "active_cost_per_admitted",
    "success_probability",
    "informative_task_fraction",
    "attempts_per_success",
    "pass_at_k",
    "normalise_action",
    "normalise_action_sequence",
    "distinct_action_sequences",
    "mean_distinct_per_fixture",
    "RoundTelemetry",
    "NarrowingWarning",
    "coverage_narrowing_warnings",
]

# --------------------------------------------------------------------------- equation 5

DISPOSITIONS = ("emitted", "assessed_not_selected", "ineligible", "pending", "unknown")
"""Every initiated attempt has exactly one of these at the cutoff (seed table 15, SPEC §6.7)."""


CHECK_FAMILIES = {
    "outcome": "outcome", "required_criteria": "outcome", "calibrated_evaluators": "outcome", "feedback": "outcome",
    "protected_paths": "process", "target_suitability": "target_suitability",
    "capability_gap": "permitted_use", "grader_control": "permitted_use", "per_task_cap": "redundancy",
    "lineage_family": "redundancy",  # semantics 3: one member per lineage family (superseded by a view)
}
"""SPEC §11.1 "Dispositions by family": the family of each check the ledger itself runs and names in
``admission.predicate`` (ledger/projections/admission.py: the use gate's ``outcome`` = min_reward / outcome
scope, ``required_criteria``, ``calibrated_evaluators``, a hard negative's ``target_suitability``;
``protected_paths``; the capability-gap and grader-control use conditions; the retention cap).  A
predicate the route declares keeps its declared family."""


def family_of(predicate: str | None, declared: dict[str, str]) -> str:
    """The family of the check named ``predicate`` on a route whose predicates have ``declared`` families."""
    name = predicate or ""
    return declared.get(name) or CHECK_FAMILIES.get(name, "")


def cost_per_emitted_artifact(cohort_cost: float, emitted: int) -> float | None:
    """Seed equation 5: ``cohort cost / emitted artifacts`` (``None`` when none emitted)."""
    if emitted < 0:
        raise InputError("emitted must be >= 0")
    if emitted == 0:
        return None
    return cohort_cost / emitted


@dataclass(frozen=True)
class ArtifactCost:
    """Equation 5 with its two factors: cost per attempt over emission yield."""

    cohort_cost: float
    attempts: int
    emitted: int
    emission_yield: float
    cost_per_attempt: float | None
    cost_per_artifact: float | None
    """``None`` when nothing was emitted: the cohort cost is then the reported loss."""


def artifact_cost(cohort_cost: float, attempts: int, emitted: int) -> ArtifactCost:
    """Cost per emitted artifact for a cohort of ``attempts`` initiated attempts."""
    if attempts < 0 or emitted < 0 or emitted > attempts:
        raise InputError("need 0 <= emitted <= attempts")
    return ArtifactCost(
        cohort_cost=cohort_cost,
        attempts=attempts,
        emitted=emitted,
        emission_yield=emitted / attempts if attempts else 0.0,
        cost_per_attempt=cohort_cost / attempts if attempts else None,
        cost_per_artifact=cost_per_emitted_artifact(cohort_cost, emitted),
    )


def artifact_cost_from_dispositions(cohort_cost: float, dispositions: Mapping[str, int]) -> ArtifactCost:
    """Equation 5 from a disposition table in which every attempt appears exactly once.

    Keys must come from :data:`DISPOSITIONS`; the attempt count is their sum.
    """
    unknown = set(dispositions) - set(DISPOSITIONS)
    if unknown:
        raise InputError(f"unknown dispositions {sorted(unknown)!r}; expected {DISPOSITIONS!r}")
    if any(v < 0 for v in dispositions.values()):
        raise InputError("disposition counts must be >= 0")
    attempts = sum(dispositions.values())
    return artifact_cost(cohort_cost, attempts, dispositions.get("emitted", 0))


# --------------------------------------------------------------------------- equation 4

STAGES = ("generation", "assessment", "storage")


@dataclass(frozen=True)
class CollectorPlan:
    """Equation 4 for one collector: stage ceilings, the binding stage, planned rates."""

    stage_rates: Mapping[str, float]
    """Attempts per second each stage sustains on its own."""
    binding: str
    """The stage with the smallest ceiling (first in :data:`STAGES` order on ties)."""
    attempt_rate: float
    """``R = min(...)`` attempts per second (idealised; credits and scheduling may lower it)."""
    route_yield: float
    admitted_rate: float
    """Planned admitted records per second, ``R * Y``."""
    unused_generation_fraction: float
    """Share of generation capacity left idle, ``1 - R / (A / g)``."""
    verifier_slots_to_match_generation: int
    """``ceil((A / g) * T)``: slots at which assessment stops binding below generation."""
    bandwidth_to_match_generation: float
    """``(A / g) * S`` bytes/s: write bandwidth at which storage stops binding below generation."""


def plan_collector(
    *,
    accelerators: int,
    generation_seconds_per_attempt: float,
    verifier_slots: int,
    checking_seconds_per_attempt: float,
    write_bytes_per_second: float,
    record_ceiling_bytes: float,
    route_yield: float,
) -> CollectorPlan:
    """Seed equation 4: ``R = min(A / g, W / T, B / S)`` and the admitted rate ``R * Y``."""
    if generation_seconds_per_attempt <= 0 or record_ceiling_bytes <= 0:
        raise InputError("generation seconds and record ceiling must be > 0")
    if not (0.0 <= route_yield <= 1.0):
        raise InputError("route_yield must be in [0, 1]")
    generation = accelerators / generation_seconds_per_attempt
    assessment = math.inf if checking_seconds_per_attempt <= 0 else verifier_slots / checking_seconds_per_attempt
    storage = write_bytes_per_second / record_ceiling_bytes
    rates = {"generation": generation, "assessment": assessment, "storage": storage}
    binding = min(STAGES, key=lambda s: (rates[s], STAGES.index(s)))
    rate = rates[binding]
    return CollectorPlan(
        stage_rates=rates,
        binding=binding,
        attempt_rate=rate,
        route_yield=route_yield,
        admitted_rate=rate * route_yield,
        unused_generation_fraction=1.0 - rate / generation if generation > 0 else 0.0,
        verifier_slots_to_match_generation=math.ceil(generation * checking_seconds_per_attempt - 1e-9),
        bandwidth_to_match_generation=generation * record_ceiling_bytes,
    )


@dataclass(frozen=True)
class ActiveCost:
    """Active-resource charge (only occupied accelerator and verifier time is billed)."""

    generation_cost_per_attempt: float
    checking_cost_per_attempt: float
    cost_per_attempt: float
    cost_per_admitted: float | None
    checking_share: float
    """Checking's share of the cost per attempt (and so per admitted record)."""


def active_cost_per_admitted(
    *,
    generation_seconds_per_attempt: float,
    accelerator_price_per_hour: float,
    checking_seconds_per_attempt: float,
    slot_price_per_hour: float,
    route_yield: float,
) -> ActiveCost:
    """Napkin math 15.6: (generation + checking cost per attempt) / yield (eq. 1.2 form).

    Under active-resource accounting the charge does not depend on which stage binds:
    adding verifier slots raises the rate, not the cost per record.
    """
    gen = generation_seconds_per_attempt / 3600.0 * accelerator_price_per_hour
    chk = checking_seconds_per_attempt / 3600.0 * slot_price_per_hour
    per_attempt = gen + chk
    return ActiveCost(
        generation_cost_per_attempt=gen,
        checking_cost_per_attempt=chk,
        cost_per_attempt=per_attempt,
        cost_per_admitted=per_attempt / route_yield if route_yield > 0 else None,
        checking_share=chk / per_attempt if per_attempt > 0 else 0.0,
    )


# --------------------------------------------------------------------------- equation 3, pass@k


def _check_pk(p: float, k: int) -> None:
    if not (0.0 <= p <= 1.0):
        raise InputError("p must be in [0, 1]")
    if k < 1:
        raise InputError("k must be >= 1")


def success_probability(p: float, k: int) -> float:
    """Probability that at least one of ``k`` independent attempts passes: ``1 - (1-p)^k``."""
    _check_pk(p, k)
    return 1.0 - (1.0 - p) ** k


def informative_task_fraction(p: float, k: int) -> float:
    """Seed equation 3: ``1 - (1-p)^k - p^k``, the chance a group of ``k`` mixes outcomes.

    For ``k == 1`` a single attempt never carries contrast, and the formula gives 0.
    """
    _check_pk(p, k)
    if k == 1:
        return 0.0
    return max(0.0, 1.0 - (1.0 - p) ** k - p**k)


def attempts_per_success(p: float, k: int) -> float:
    """Attempts spent per harvested success when a batch of ``k`` keeps at most one.

    ``k / (1 - (1-p)^k)``; ``inf`` when ``p == 0``.
    """
    s = success_probability(p, k)
    return math.inf if s == 0 else k / s


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` passed.

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021): the probability that a random
    subset of ``k`` of the ``n`` samples contains at least one pass.  Exact integer
    binomials, so no overflow or cancellation for large ``n``.
    """
    if n < 1 or not (0 <= c <= n) or not (1 <= k <= n):
        raise InputError("need n >= 1, 0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --------------------------------------------------------------------------- diversity

_NAME_KEYS = ("tool", "name", "type", "action")
_ARG_KEYS = ("args", "arguments", "input", "parameters")


def normalise_action(action: Any, include_args: bool = False) -> str:
    """Normalise one action for diversity counting.

    * a string: whitespace collapsed, lower-cased;
    * a mapping: its tool name (first of ``tool``/``name``/``type``/``action``),
      lower-cased; with ``include_args`` also the canonical JSON of its arguments
      (``args``/``arguments``/``input``/``parameters``);
    * anything else: ``str(action)`` normalised like a string.

    The default deliberately drops arguments: two runs that called the same tools in the
    same order followed the same routine even if file paths or ids differ.
    """
    if isinstance(action, Mapping):
        name = next((action[k] for k in _NAME_KEYS if k in action), None)
        text = " ".join(str(name if name is not None else "").split()).lower()
        if include_args:
            args = next((action[k] for k in _ARG_KEYS if k in action), None)
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            text += json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return text
    return " ".join(str(action).split()).lower()


def normalise_action_sequence(
    actions: Iterable[Any],
    *,
    include_args: bool = False,
    collapse_repeats: bool = False,
    key: Callable[[Any], Hashable] | None = None,
) -> tuple[Hashable, ...]:
    """Normalise a run's actions into a hashable sequence.

    ``key`` replaces :func:`normalise_action`.  ``collapse_repeats`` merges consecutive
    identical actions (so retries of one call count once); it is off by default, because
    the seed reads a drop caused by pruned retries alongside held-out scores instead of
    hiding it.
    """
    norm = key if key is not None else (lambda a: normalise_action(a, include_args=include_args))
    out: list[Hashable] = []
    for action in actions:
        item = norm(action)
        if collapse_repeats and out and out[-1] == item:
            continue
        out.append(item)
    return tuple(out)


def distinct_action_sequences(
    runs_by_fixture: Mapping[str, Iterable[Iterable[Any]]],
    **options: Any,
) -> dict[str, int]:
    """Number of distinct normalised action sequences per fixture (seed §15.7.2)."""
    return {
        fixture: len({normalise_action_sequence(run, **options) for run in runs})
        for fixture, runs in runs_by_fixture.items()
    }


def mean_distinct_per_fixture(counts: Mapping[str, int]) -> float:
    """Mean of :func:`distinct_action_sequences` over fixtures (0 for no fixtures)."""
    return sum(counts.values()) / len(counts) if counts else 0.0


@dataclass(frozen=True)
class RoundTelemetry:
    """One self-improvement round's coverage signals (seed §15.7.2).

    ``distinct_sequences`` is the mean number of distinct normalised action sequences per
    fixture (compare rounds over the same fixtures and the same attempts per fixture);
    scores are fractions in [0, 1].
    """

    round: int
    distinct_sequences: float
    held_out_score: float
    pass_at_1: float | None = None
    pass_at_k: float | None = None
    train_acceptance: float | None = None


@dataclass(frozen=True)
class NarrowingWarning:
    rule: str
    round: int
    since_round: int
    detail: str


def coverage_narrowing_warnings(
    rounds: Sequence[RoundTelemetry],
    *,
    window: int = 1,
    min_diversity_drop: float = 0.10,
    flat_tolerance: float = 0.01,
) -> list[NarrowingWarning]:
    """Warnings that the loop is over-specialising, comparing each round with ``window`` back.

    Rules (``d`` = distinct sequences, ``h`` = held-out score, ``tol`` = ``flat_tolerance``,
    an absolute tolerance on scores):

    * ``diversity_falls_held_out_flat`` — the primary rule: ``d_now <= (1 -
      min_diversity_drop) * d_then`` **and** ``h_now - h_then <= tol``.  A diversity drop
      that comes with a held-out gain may be pruned retries; with a flat (or falling)
      held-out score it means the policy is concentrating on familiar routines.
    * ``pass1_up_passk_flat`` — ``pass@1`` rose by more than ``tol`` while ``pass@k``
      changed by at most ``tol`` (or fell): probability mass is concentrating.
    * ``train_up_held_out_flat`` — training-fixture acceptance rose by more than ``tol``
      while ``h_now - h_then <= tol``.

    Rounds are taken in ``round`` order; ``None`` signals skip their rule.
    """
    if window < 1:
        raise InputError("window must be >= 1")
    ordered = sorted(rounds, key=lambda r: r.round)
    warnings: list[NarrowingWarning] = []
    for i in range(window, len(ordered)):
        now, then = ordered[i], ordered[i - window]
        held_gain = now.held_out_score - then.held_out_score
        held_flat = held_gain <= flat_tolerance
        if then.distinct_sequences > 0 and held_flat and (
            now.distinct_sequences <= (1.0 - min_diversity_drop) * then.distinct_sequences
        ):
            drop = 1.0 - now.distinct_sequences / then.distinct_sequences
            warnings.append(
                NarrowingWarning(
                    "diversity_falls_held_out_flat",
                    now.round,
                    then.round,
                    f"distinct sequences per fixture fell {drop:.1%} "
                    f"({then.distinct_sequences:g} -> {now.distinct_sequences:g}) while held-out "
                    f"changed {held_gain:+.3f}",
                )
            )
        if None not in (now.pass_at_1, then.pass_at_1, now.pass_at_k, then.pass_at_k):
            d1 = float(now.pass_at_1) - float(then.pass_at_1)  # type: ignore[arg-type]
            dk = float(now.pass_at_k) - float(then.pass_at_k)  # type: ignore[arg-type]
            if d1 > flat_tolerance and dk <= flat_tolerance:
                warnings.append(
                    NarrowingWarning(
                        "pass1_up_passk_flat",
                        now.round,
                        then.round,
                        f"pass@1 {d1:+.3f} while pass@k {dk:+.3f}",
                    )
                )
        if now.train_acceptance is not None and then.train_acceptance is not None:
            dt = now.train_acceptance - then.train_acceptance
            if dt > flat_tolerance and held_flat:
                warnings.append(
                    NarrowingWarning(
                        "train_up_held_out_flat",
                        now.round,
                        then.round,
                        f"training acceptance {dt:+.3f} while held-out {held_gain:+.3f}",
                    )
                )
    return warnings
