"""``token_loss`` (SPEC 11.5): Σ weight × cross-entropy, each target predicted by its predecessor's logits.

The same function serves path batches and packed batches (the collators give the loss index),
so a packed batch's loss equals the sum over its path records' losses.  For RL, ``advantages``
turns it into the importance-weighted (optionally clipped) surrogate with ratios from the
recorded ``behavior_logprobs``; the per-target weights stay 1/L_i (seed 000), so the
per-execution normalisation does not change with the objective.
"""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = ["token_logprobs", "token_loss"]


def token_logprobs(logits: torch.Tensor, batch: Mapping) -> torch.Tensor:
    """Per target of the batch's loss index: log p(target | its predecessor's logits)."""
    rows, preds, targets = batch["loss_rows"], batch["loss_predecessors"], batch["loss_targets"]
    ids = batch["input_ids"][rows, targets]
    logp = torch.log_softmax(logits[rows, preds], dim=-1)
    return logp.gather(-1, ids[:, None]).squeeze(-1)


def token_loss(logits: torch.Tensor, batch: Mapping, *, advantages: torch.Tensor | float | None = None,
               clip: float | None = None) -> torch.Tensor:
    """``-Σ w · log p`` over the batch's targets (a sum: the weights already normalise each
    execution).  With ``advantages`` (per target, or one number): ``-Σ w · A · r`` where
    ``r = exp(log p - behavior_logprob)``, and with ``clip`` = ε PPO's
    ``-Σ w · min(r·A, clamp(r, 1-ε, 1+ε)·A)``.  A target without a recorded behaviour log-prob
    cannot have a ratio: asking for one raises."""
    lp = token_logprobs(logits, batch)
    w = batch["loss_weights"].to(lp.dtype)
    if advantages is None:
        return -(w * lp).sum()
    behavior = batch["loss_behavior_logprobs"].to(lp.dtype)
    if torch.isnan(behavior).any():
        raise ValueError(f"{int(torch.isnan(behavior).sum())} target(s) have no behaviour log-prob: no importance ratio")
    adv = torch.as_tensor(advantages, dtype=lp.dtype)
    ratio = torch.exp(lp - behavior)
    surrogate = ratio * adv
    if clip is not None:
        surrogate = torch.minimum(surrogate, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    return -(w * surrogate).sum()
