"""A realistic, seeded event stream for scale-out tests, the soak test and benchmarks.

Executions come from :mod:`workloads.synthetic` (token-level coding-agent runs rendered through
the Qwen3.6 tokenizer, with prefix references as the SDK writes them).  Around them the
stream carries the cross-partition facts that make a partitioned replay interesting:

* a governance preamble: split policy (train / dev / final_test), permission grants, two
  routes (``sft`` on train, ``dev-eval`` on dev) and a collection-credit pool;
* per execution, a credit reservation and its disposition release (execution-scoped, but
  the pool's fold spans every partition);
* every ``derive_every``-th execution gets a derived view (RecordDerived + Revalidated on the
  governance topic, parent on some execution partition);
* every ``withdraw_every``-th execution has its task withdrawn afterwards (the withdrawal
  reaches executions on every partition).

Everything is a function of ``(seed, index)``; governance lines are signed with the key given.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Iterator

from ledger.events.catalog import SIGNED_TYPES
from ledger.events.signing import sign_line
from workloads import synthetic as workload

_SIGNED = frozenset(SIGNED_TYPES)
POOL = "staging"


def preamble() -> list[dict[str, Any]]:
    """Governance facts that come first (unsigned; see :func:`sign_all`)."""
    return [
        {"type": "split_policy", "policy_id": "scaleout-p1", "salt": "scaleout",
         "fractions": {"train": 0.8, "dev": 0.1, "final_test": 0.1}},
        {"type": "permission", "subject": "*", "use": "sft", "action": "grant", "authority": "legal"},
        {"type": "permission", "subject": "*", "use": "evaluation", "action": "grant", "authority": "legal"},
        {"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 2,
         "seed": "scaleout", "consumer": "policy-team"},
        {"type": "admission_policy", "route": "dev-eval", "version": 1, "use": "evaluation", "split": "dev",
         "j_max": 1},
        {"type": "credit_pool_declared", "pool": POOL, "capacity_bytes": 64_000_000, "record_ceiling_bytes": 4_000_000,
         "hard_limit": 12},
    ]


def _shift(stamp: str, seconds: float) -> str:
    moment = datetime.fromisoformat(stamp.replace("Z", "+00:00")) + timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def execution_id(seed: int, index: int) -> str:
    return f"exec-{seed}-{index:05d}"


def task_id(seed: int, index: int) -> str:
    return f"task-{seed}-{index // 2:05d}"


def execution_lines(index: int, *, seed: int, turns: int = 14, prefix_references: bool = True) -> list[dict[str, Any]]:
    """One execution (its task registered first when new) plus its credit events."""
    ex, task = execution_id(seed, index), task_id(seed, index)
    events = workload.generate_execution(ex, task, seed=seed * 1_000_003 + index, turns=turns)
    if prefix_references:
        events = list(workload.with_prefix_references(events))
    start = events[0]["occurred_at"]
    end = events[-1]["occurred_at"]
    out: list[dict[str, Any]] = []
    if index % 2 == 0:
        out.append(workload.task_registered(task))
    out.append({"type": "credit_reserved", "execution_id": ex, "pool": POOL, "bytes": 4_000_000,
                "occurred_at": _shift(start, -1)})
    out += events
    out.append({"type": "credit_released", "execution_id": ex, "pool": POOL, "reason": "disposition",
                "occurred_at": _shift(end, 1)})
    return out


def governance_after(index: int, *, seed: int, derive_every: int = 5, withdraw_every: int = 11) -> list[dict[str, Any]]:
    """Cross-partition governance facts that follow execution ``index`` (unsigned)."""
    out: list[dict[str, Any]] = []
    ex = execution_id(seed, index)
    if derive_every and index % derive_every == derive_every - 1:
        view = f"{ex}/redacted"
        out.append({"type": "record_derived", "derived_execution_id": view, "parent_execution_id": ex,
                    "transformation": "redact@1", "withheld_fields": ["metadata"]})
        out.append({"type": "revalidated", "derived_execution_id": view, "verdict": "pass", "evidence": "review"})
    if withdraw_every and index % withdraw_every == withdraw_every - 1 and index >= 4:
        out.append({"type": "withdrawal", "subject": f"task:{task_id(seed, index - 4)}", "reason": "provider request",
                    "authority": "legal"})
    return out


def sign_all(lines: list[dict[str, Any]], key) -> list[dict[str, Any]]:
    """Sign the lines whose type needs a governance signature (SPEC §4.3)."""
    return [sign_line(line, key) if line["type"] in _SIGNED else line for line in lines]


def batches(n_executions: int, *, seed: int, key, turns: int = 14, start: int = 0,
            with_preamble: bool = True, **kw) -> Iterator[list[dict[str, Any]]]:
    """Signed ingest batches: the preamble, then one batch per execution (its governance extras after it)."""
    if with_preamble and start == 0:
        yield sign_all(preamble(), key)
    for index in range(start, start + n_executions):
        yield execution_lines(index, seed=seed, turns=turns)
        extra = governance_after(index, seed=seed, **kw)
        if extra:
            yield sign_all(extra, key)
