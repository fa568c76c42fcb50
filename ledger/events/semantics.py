"""Semantics versions of the projection rules (SPEC §10).

A route records the semantics version in force when it was ingested (``admission_policy``
events carry ``semantics``, stamped at ingest when the producer gives none; events written
before versions existed carry none and are version 1).  Projections apply the rules of the
route's version, so a replay by a newer release keeps an old route on its old rules and
every manifest ever published still rebuilds to the same root under ``manifest verify
--deep``.  The README's changelog lists what each version changed; :data:`CHANGES` is the
same list in code.
"""

from __future__ import annotations

__all__ = ["CHANGES", "CURRENT", "LEGACY", "of_route"]

LEGACY = 1  # routes ingested before semantics versions existed
CURRENT = 2

CHANGES: dict[int, str] = {
    1: "first release: SPEC §6.5 admission as written (latest verifier verdict wins, selections only turn "
       "context_only requests into context, any split on any route); member ids join route/execution/leaf unescaped",
    2: "use-specific admission (SPEC §6.8): training routes read only train, evaluation routes carry no targets; "
       "min_reward (sft default 1.0) and required_criteria; selected_request_ids decide targets and reach derived "
       "views (replaced outputs stay context until revalidated by verified_request_ids); hard negatives never carry "
       "sft targets; outcome_scope branch; per_task_cap; repeated verifiers aggregate over attempts and inconsistent "
       "verdicts are unknown; preference routes emit pairs (SPEC §6.9); member id components escaped (SPEC §9); "
       "SPEC §6.10 evidence, each rule acting only through its own new event or route option: collection_id campaigns and required capture, protected_paths, calibrated_evaluators (grader controls never admitted), the feedback predicate, capability_gap, fault-injection coverage in the datasheet",
}


def of_route(value) -> int:
    """The semantics version an ``admission_policy`` event records (absent: :data:`LEGACY`)."""
    return LEGACY if value is None else int(value)
