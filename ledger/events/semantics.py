"""Semantics versions of the projection rules (SPEC §10).

A route records the semantics version in force when it was ingested (``admission_policy``
events carry ``semantics``, stamped at ingest when the producer gives none; events written
before versions existed carry none and are version 1).  Projections apply the rules of the
route's version, so a replay by a newer release keeps an old route on its old rules and
every manifest ever published still rebuilds to the same root under ``manifest verify
--deep``.  docs/semantics.md lists what each version changed; :data:`CHANGES` is the
same list in code.
"""

from __future__ import annotations

__all__ = ["CHANGES", "CURRENT", "LEGACY", "accepts_declared", "of_route"]

LEGACY = 1  # routes ingested before semantics versions existed
CURRENT = 3

# Tests only (tests/conftest.py ``earlier_release``): ingest as releases 1-2 did, which accepted a
# declared version up to their own.  Nothing in the ledger sets it; a producer cannot reach it.
EMULATE_EARLIER_RELEASE = False

CHANGES: dict[int, str] = {
    1: "first release: SPEC §6.5 admission as written (latest verifier verdict wins, selections only turn "
       "context_only requests into context, any split on any route); member ids join route/execution/leaf unescaped",
    2: "use-specific admission (SPEC §6.8): training routes read only train, evaluation routes carry no targets; "
       "min_reward (sft default 1.0) and required_criteria; selected_request_ids decide targets and reach derived "
       "views (replaced outputs stay context until revalidated by verified_request_ids); hard negatives never carry "
       "sft targets; outcome_scope branch; per_task_cap; repeated verifiers aggregate over attempts and inconsistent "
       "verdicts are unknown; preference routes emit pairs (SPEC §6.9); member id components escaped (SPEC §9); "
       "SPEC §6.10 evidence, each rule acting only through its own new event or route option: collection_id campaigns and required capture, protected_paths, calibrated_evaluators (grader controls never admitted), the feedback predicate, capability_gap, fault-injection coverage in the datasheet",
    3: "third release (SPEC §11.1-11.2): the version is the ledger's stamp (a declared semantics is refused); "
       "a path's reward is the deepest branch-scoped counting score on it on every route (reward, sft min_reward per "
       "path, preference sides); derived views inherit the parent's selection and role for every request they did "
       "not replace (a hard negative stays one in every view); one member per lineage family (the most derived "
       "view whose revalidation passed, else the root; the others are redundancy, 'superseded by <execution>'); "
       "rejections filed under the failing check's family; every member carries its lineage (part of its digest)",
}


def accepts_declared(declared: int) -> bool:
    """Whether ingest takes a line that declares ``declared`` (not this release's version): never,
    except where a test emulates an earlier release's ingest."""
    return EMULATE_EARLIER_RELEASE and 1 <= declared <= CURRENT


def of_route(value) -> int:
    """The semantics version an ``admission_policy`` event records (absent: :data:`LEGACY`)."""
    return LEGACY if value is None else int(value)
