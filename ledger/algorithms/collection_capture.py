"""Required capture of a collection campaign and late declarations (SPEC 6.10; seed 002 15.3.1).

Pure functions over plain data: the vocabulary a ``collection_manifest`` may name in
``required_capture``, what an execution's capture lacks against it, and which declarations
came after sampling began.
"""

from __future__ import annotations

from typing import Iterable, Mapping

ROLE_CLASSES = ("main/task", "main/summary", "sub/task", "sub/summary")
REQUIRED_CAPTURE = ROLE_CLASSES + ("tool_results", "logprobs")
CONFIGURATION_KEYS = ("sampler", "prompt_version", "tool_versions", "variation", "attempt_selection")


def unknown_capture(names: Iterable[str]) -> list[str]:
    """The names of ``names`` outside the closed vocabulary, in order."""
    return [n for n in names if n not in REQUIRED_CAPTURE]


def missing_capture(required: Iterable[str], *, role_classes: Iterable[str], calls_without_result: Iterable[str],
                    outputs_without_logprobs: Iterable[str], limit: int = 3) -> list[str]:
    """What an execution's record lacks against ``required``, each item naming it:
    ``role class sub/task``, ``result of tool call c1``, ``log-probs of request r3``."""
    have = set(role_classes)
    out: list[str] = []
    req = list(dict.fromkeys(required))
    out += [f"role class {r}" for r in req if r in ROLE_CLASSES and r not in have]
    if "tool_results" in req:
        calls = sorted(calls_without_result)
        out += [f"result of tool call {c}" for c in calls[:limit]] + ([f"... {len(calls) - limit} more"] if len(calls) > limit else [])
    if "logprobs" in req:
        rids = sorted(outputs_without_logprobs)
        out += [f"log-probs of request {r}" for r in rids[:limit]] + ([f"... {len(rids) - limit} more"] if len(rids) > limit else [])
    return out


def late_declarations(first_execution_at: int | None, declarations: Iterable[Mapping]) -> list[dict]:
    """The declarations (each with ``occurred_at`` in micros) strictly after the campaign's first
    execution was opened, by ``occurred_at`` (the stored event time, so replay gives the same
    answer whatever the partition interleaving); none when no execution was opened yet."""
    if first_execution_at is None:
        return []
    return [dict(d) for d in sorted(declarations, key=lambda d: (d["occurred_at"], d.get("declaration", ""),
                                                                 str(d.get("id", "")), d.get("version", 0)))
            if d["occurred_at"] > first_execution_at]
