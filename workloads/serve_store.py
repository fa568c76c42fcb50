"""A store of many small executions for ``ledger serve`` list benchmarks (issue 32 item 4).

``lines(n)`` yields a governance preamble (split policy, permission, an ``rl`` route), ``n // 4``
tasks over eight sources, and per execution an ``execution_opened`` (Qwen3.6 tokenizer, one of
25 collection runs), one request of a few tokens, its closure and an assessment; finally one
source is withdrawn with ``erase`` (every eighth task: its executions are erased).  Governance
lines are signed with ``key``.  Everything is a function of ``(n, index)``.
"""

from __future__ import annotations

from typing import Any, Iterator

from workloads.scenario import sign_all

AT = "2030-01-02T00:00:00Z"


def preamble() -> list[dict[str, Any]]:
    return [{"type": "split_policy", "policy_id": "serve-p1", "salt": "serve",
             "fractions": {"train": 0.8, "dev": 0.1, "final_test": 0.1}},
            {"type": "permission", "subject": "*", "use": "rl", "action": "grant", "authority": "legal"},
            {"type": "admission_policy", "route": "rl", "version": 1, "use": "rl", "split": "train", "j_max": 1,
             "consumer": "policy-team"}]


def execution(i: int, n_tasks: int) -> list[dict[str, Any]]:
    ex, task = f"ex-{i:06d}", f"task-{i % n_tasks:05d}"
    out = [1000 + i % 97, 2000 + i % 89, 248046]
    return [{"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": "2099-01-01T00:00:00Z",
             "policy": "qwen@1", "tokenizer": "Qwen3.6", "collection_run_id": f"run-{i % 25:02d}", "occurred_at": AT},
            {"type": "request", "execution_id": ex, "request_id": "r1", "input_ids": [248045, 872, 198, 100 + i % 50],
             "output_ids": out, "output_logprobs": [-0.5] * len(out), "occurred_at": AT},
            {"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"],
             "occurred_at": AT},
            {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
             "outcome": "scored", "reward": float(i % 3 == 0), "evaluator": "tests@1"}]


def lines(n: int, key) -> Iterator[dict[str, Any]]:
    n_tasks = max(1, n // 4)
    yield from sign_all(preamble(), key)
    for t in range(n_tasks):
        yield {"type": "task_registered", "task_id": f"task-{t:05d}", "source": f"src-{t % 8}"}
    for i in range(n):
        yield from execution(i, n_tasks)
    yield from sign_all([{"type": "withdrawal", "subject": "source:src-3", "reason": "provider request",
                          "authority": "legal", "erase": True}], key)
