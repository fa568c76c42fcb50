"""Event-type registry (SPEC §4.2, §4.3, §7.1).

For each JSON-lines ``type``: its Avro record, whether it lives on the governance topic,
whether it must be signed, its partition key and its natural key (the default
``event_id``, so a retried submission gets the same id).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

from ledger.algorithms.identifiers import join_key


@dataclass(frozen=True)
class EventType:
    type: str  # JSON-lines type name
    record: str  # Avro record name
    governance: bool  # governance topic (totally ordered on Kafka)
    signed: bool  # must carry a trusted Ed25519 signature (SPEC §4.3)
    key_field: str  # partition key field
    natural_key: Callable[[dict], str]


def _content_key(prefix: str, *fields: str) -> Callable[[dict], str]:
    """Natural key = named fields + a short hash of the content (for types with no identity)."""

    def key(ev: dict) -> str:
        content = sorted([(k, v) for k, v in ev.items() if k not in _HEADER_SET and not isinstance(v, bytes)])
        h = hashlib.sha256(repr(content).encode("utf-8")).hexdigest()[:16]
        return join_key(prefix, *(ev[f] for f in fields), h)

    return key


def _key(prefix: str, *fields: str) -> Callable[[dict], str]:
    if len(fields) == 1:
        (f1,) = fields
        return lambda ev: join_key(prefix, ev[f1])
    return lambda ev: join_key(prefix, *[ev[f] for f in fields])


def _pair_key(prefix: str) -> Callable[[dict], str]:
    return lambda ev: join_key(prefix, *sorted((ev["task_a"], ev["task_b"])))


def _predicate_key(ev: dict) -> str:
    """(execution, route, predicate, verifier, attempt) for a repeated verifier's attempt (SPEC §4.3), so a
    second verdict for one attempt is a conflict.  Without ``attempt`` the key keeps the first release's
    form, which names the verdict: old logs keep their keys (audit compares them), and differing verdicts
    of one verifier are all recorded, so admission can report them as inconsistent (SPEC §6.8)."""
    if ev.get("attempt") is not None:
        return join_key("predicate_evaluated", ev["execution_id"], ev["route"], ev["predicate"], ev["verifier"],
                        "attempt", str(ev["attempt"]))
    return join_key("predicate_evaluated", ev["execution_id"], ev["route"], ev["predicate"], ev["verifier"], ev["verdict"])


def _feedback_key(ev: dict) -> str:
    """(execution, signal) (SPEC 4.3); a ``rating`` adds a short hash of its content, so distinct
    ratings of one execution are distinct events while a retried one keeps its key (a producer that
    repeats an identical rating on purpose gives each its own ``event_id``)."""
    if ev.get("signal") == "rating":
        return _content_key("production_feedback", "execution_id", "signal")(ev)
    return join_key("production_feedback", ev["execution_id"], ev["signal"])


def _batch_key(ev: dict) -> str:
    """(consumer, step) for a trained batch (SPEC 11.6), so a retried acknowledgement is a duplicate and another
    batch under the same step a conflict.  Members given the disposition ``stale`` are not a training step: their
    key adds the disposition and a short hash of the content, so each distinct set is its own fact and a retry
    of one keeps its key."""
    if ev.get("disposition") in (None, "trained"):
        return join_key("batch_consumed", ev["consumer"], str(ev["step"]))
    return _content_key("batch_consumed", "consumer", "disposition")(ev)


HEADER_FIELDS = ("event_id", "event_type", "occurred_at", "producer", "stamped", "signature", "signed_body")
_HEADER_SET = frozenset(HEADER_FIELDS)

_T = EventType
EVENT_TYPES: dict[str, EventType] = {
    t.type: t
    for t in [
        _T("execution_opened", "ExecutionOpened", False, False, "execution_id", _key("execution_opened", "execution_id")),
        _T("request", "RequestRecorded", False, False, "execution_id", _key("request", "execution_id", "request_id")),
        _T("tool_payload", "ToolPayloadCached", False, False, "execution_id", _key("tool_payload", "execution_id", "call_id", "kind")),
        _T("execution_closed", "ExecutionClosed", False, False, "execution_id", _key("execution_closed", "execution_id")),
        _T("assessment", "AssessmentRecorded", False, False, "execution_id", _key("assessment", "execution_id", "assessment_id")),
        _T("execution_finalized", "ExecutionFinalized", False, False, "execution_id", _key("execution_finalized", "execution_id")),
        _T("target_selection", "TargetSelection", False, False, "execution_id", _key("target_selection", "execution_id", "selection_id")),
        _T("predicate_evaluated", "PredicateEvaluated", False, False, "execution_id", _predicate_key),
        _T("cost_recorded", "CostRecorded", False, False, "execution_id", _content_key("cost_recorded", "execution_id")),
        _T("task_registered", "TaskRegistered", True, False, "task_id", _key("task_registered", "task_id")),
        _T("task_linked", "TaskLinked", True, False, "task_a", _pair_key("task_linked")),
        _T("task_link_rejected", "TaskLinkRejected", True, False, "task_a", _pair_key("task_link_rejected")),
        _T("split_policy", "SplitPolicyDeclared", True, True, "policy_id", _key("split_policy", "policy_id")),
        _T("split_reclassified", "SplitReclassified", True, True, "task_id", _key("split_reclassified", "task_id")),
        _T("record_derived", "RecordDerived", True, False, "derived_execution_id", _key("record_derived", "derived_execution_id")),
        _T("revalidated", "Revalidated", True, False, "derived_execution_id", _key("revalidated", "derived_execution_id")),
        _T("permission", "PermissionChanged", True, True, "subject", _content_key("permission", "subject", "use", "action")),
        _T("withdrawal", "Withdrawn", True, True, "subject",
           lambda ev: join_key("withdrawal", ev["subject"]) + ("/erase" if ev.get("erase") else "")),
        _T("admission_policy", "AdmissionPolicyDeclared", True, True, "route", _key("admission_policy", "route", "version")),
        _T("manifest_published", "ManifestPublished", True, True, "route", _key("manifest_published", "route", "version")),
        # collection credits (seed 002 §15.8.2; ledger/projections/credits.py, ledger/producers/credit_client.py)
        _T("credit_reserved", "CreditReserved", False, False, "execution_id", _key("credit_reserved", "pool", "execution_id")),
        _T("credit_released", "CreditReleased", False, False, "execution_id", _key("credit_released", "pool", "execution_id")),
        _T("credit_pool_declared", "CreditPoolDeclared", True, False, "pool", _key("credit_pool_declared", "pool")),
        # verifier integrity (SPEC §6.10; ledger/projections/verifier.py).  grader_control is execution-scoped, not governance:
        # it is a fact about one control execution, partitioned with that execution's assessments
        _T("artifact_diff", "ArtifactDiffRecorded", False, False, "execution_id",
           _key("artifact_diff", "execution_id", "artifact_version")),
        _T("grader_control", "GraderControlDeclared", False, False, "execution_id",
           _key("grader_control", "execution_id", "evaluator")),
        # evidence for verifier integrity (SPEC 6.10; ledger/projections/evidence.py): fault injection, production
        # feedback, counterfactual probes of the intervention ladder
        _T("fault_injected", "FaultInjected", False, False, "execution_id", _key("fault_injected", "execution_id", "injection_id")),
        _T("production_feedback", "ProductionFeedbackRecorded", False, False, "execution_id", _feedback_key),
        _T("counterfactual_probe", "CounterfactualProbeRecorded", False, False, "task_id",
           _key("counterfactual_probe", "task_id", "probe_id")),
        # collection manifests and model checkpoints (SPEC 6.10; ledger/projections/collections.py)
        _T("collection_manifest", "CollectionManifestDeclared", True, True, "collection_id",
           _key("collection_manifest", "collection_id", "version")),
        _T("checkpoint_trained", "CheckpointTrained", True, True, "checkpoint_id", _key("checkpoint_trained", "checkpoint_id")),
        # canaries: planted synthetic secrets a training manifest must not contain (SPEC 11.2; ledger/projections/canaries.py)
        _T("canary", "CanaryDeclared", True, True, "canary_id", _key("canary", "canary_id")),
        # online feed: a consumer's acknowledged batches (SPEC 11.6; ledger/projections/consumers.py, ledger/corpus/feed.py)
        _T("batch_consumed", "BatchConsumed", False, False, "consumer", _batch_key),
    ]
}

SIGNED_TYPES = tuple(t.type for t in EVENT_TYPES.values() if t.signed)


def event_type(name: str) -> EventType:
    try:
        return EVENT_TYPES[name]
    except KeyError:
        raise KeyError(f"unknown event type {name!r} (known: {', '.join(sorted(EVENT_TYPES))})") from None


def partition_key(ev: dict) -> str:
    return str(ev[EVENT_TYPES[ev["event_type"]].key_field])


def natural_key(ev: dict) -> str:
    """The event's natural key: components escaped and joined with ``/`` (SPEC §4.3, §9;
    :mod:`ledger.algorithms.identifiers`), so distinct tuples never share a key."""
    return EVENT_TYPES[ev["event_type"]].natural_key(ev)


def key_of(event_type: str, **fields: Any) -> str:
    """The natural key an event of ``event_type`` with ``fields`` has: the one way to build a
    key for a lookup (``key_of("request", execution_id=ex, request_id=rid)``), never an f-string."""
    return natural_key({"event_type": event_type, **fields})
