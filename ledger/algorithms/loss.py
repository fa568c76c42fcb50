"""Numpy reference of the per-execution normalised loss (SPEC §6.5 step 4; seed 000,
"Why the Loss Is Normalized Per Execution").

For execution *i* with drawn paths ``r ∈ R_i`` and disjoint fixed target sets ``T_r``,
``T_i = ⋃ T_r`` and ``L_i = |T_i| = Σ |T_r|``.  Each target token has coefficient
``1/L_i``; an execution with ``L_i = 0`` (no targets, or a zero-reward dummy) contributes 0
but still counts in the batch, and the batch loss is the mean over executions::

    loss = (1/N) Σ_i [ L_i > 0 ] (1/L_i) Σ_{t ∈ T_i} ℓ_t

Per-token losses ``ℓ_t`` may already include importance ratios and clipping; those are
per token and do not touch the denominator.  Two equivalent forms are given:

* :func:`normalized_loss` works on execution-level token positions (e.g. the tree's stored
  tokens, flattened), with one boolean mask per path;
* :func:`trainer_loss` works on trainer records (SPEC §7.3): per path, per-position losses,
  ``target_mask`` and ``loss_weight``; it is what a trainer computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ledger.algorithms.errors import InputError
from ledger.algorithms.path_draws import Draw, TreeView

__all__ = [
    "ExecutionTargets",
    "PathRecord",
    "execution_loss",
    "execution_masks",
    "node_offsets",
    "normalized_loss",
    "trainer_loss",
]


@dataclass(frozen=True)
class ExecutionTargets:
    """One execution of a batch, in execution-level token positions.

    ``token_losses`` (float, ``[n_tokens]``) is the loss of every token position of the
    execution (only target positions are read); ``path_masks`` holds one 0/1 or boolean
    ``[n_tokens]`` mask per drawn path, marking that path's fixed targets.  The masks must
    be disjoint.  A dummy or target-less execution has no masks (or only empty ones).
    """

    token_losses: np.ndarray
    path_masks: Sequence[np.ndarray] = ()


@dataclass(frozen=True)
class PathRecord:
    """What a trainer sees per exported path: per-position losses of the path's
    ``input_ids``, its ``target_mask`` and its ``loss_weight`` (1/L_i, or 0)."""

    token_losses: np.ndarray
    target_mask: np.ndarray
    loss_weight: float


def execution_loss(execution: ExecutionTargets) -> tuple[float, int]:
    """(Σ_{t∈T_i} ℓ_t / L_i, L_i) for one execution; (0.0, 0) when it has no targets.

    Raises ``ValueError`` if two path masks share a position or a mask has the wrong shape.
    """
    losses = np.asarray(execution.token_losses, dtype=np.float64)
    union = np.zeros(losses.shape[0], dtype=bool)
    total = 0
    for mask in execution.path_masks:
        m = np.asarray(mask).astype(bool)
        if m.shape != union.shape:
            raise InputError(f"path mask of shape {m.shape} for {union.shape[0]} tokens")
        if np.any(union & m):
            raise InputError("path target sets overlap")
        union |= m
        total += int(m.sum())
    if total == 0:
        return 0.0, 0
    return float(losses[union].sum()) / total, total


def normalized_loss(executions: Sequence[ExecutionTargets]) -> float:
    """Batch loss: mean over executions of their normalised losses (0 for L_i = 0)."""
    if not executions:
        raise InputError("empty batch")
    return sum(execution_loss(e)[0] for e in executions) / len(executions)


def trainer_loss(records: Iterable[PathRecord], n_executions: int) -> float:
    """Trainer-side form: Σ_records loss_weight · Σ_t target_mask·ℓ, divided by the number of
    executions in the batch (dummies included)."""
    if n_executions <= 0:
        raise InputError("n_executions must be positive")
    total = 0.0
    for rec in records:
        m = np.asarray(rec.target_mask).astype(bool)
        total += rec.loss_weight * float(np.asarray(rec.token_losses, dtype=np.float64)[m].sum())
    return total / n_executions


def node_offsets(tree: TreeView) -> np.ndarray:
    """Start of each node's segment in the flattened stored tokens (segments in id order)."""
    seg = np.asarray(tree.seg_len, dtype=np.int64)
    return np.concatenate(([0], np.cumsum(seg)[:-1])).astype(np.int64) if seg.size else seg


def execution_masks(tree: TreeView, draws: Iterable[Draw]) -> list[np.ndarray]:
    """One boolean mask per draw over the tree's flattened stored tokens (see
    :func:`node_offsets`), for :class:`ExecutionTargets`."""
    offsets = node_offsets(tree)
    n_tokens = int(np.asarray(tree.seg_len, dtype=np.int64).sum())
    out: list[np.ndarray] = []
    for d in draws:
        m = np.zeros(n_tokens, dtype=bool)
        for node, pos in d.targets.items():
            m[int(offsets[node]) + pos] = True
        out.append(m)
    return out
