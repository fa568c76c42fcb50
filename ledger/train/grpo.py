"""``ledger.train.grpo`` (SPEC 12.4): group-relative advantages, importance ratios from the recorded
behaviour log-probs, the clipped surrogate, and a loss computed only at target positions.

* :func:`advantages` -- GRPO's group-relative advantage of each attempt: ``(r - mean(group)) /
  (std(group) + eps)``.  The std is the *sample* std (Bessel's N-1, as ``torch.std``; TRL's
  ``GRPOTrainer`` and verl's ``compute_grpo_outcome_advantage`` use the same), ``eps`` = 1e-6; a group of
  one attempt has advantage 0 (nothing to compare it with), a group whose rewards are all equal has
  advantage 0 everywhere (no signal, and no division by a zero std).  ``scale="none"`` is Dr. GRPO's
  choice (Liu et al. 2025, "Understanding R1-Zero-Like Training"): centred only, because dividing by
  the std up-weights groups that are almost all right or all wrong.  (Dr. GRPO's other change, no
  per-sequence length normalisation, is already the ledger's: every target weighs 1/L_i per execution.)
  :func:`batch_advantages` gives them per target of a collated batch (a feed batch with
  ``group_by="task"`` is one group).
* :func:`importance_ratios` -- ``exp(new - behaviour)`` where ``mask`` holds, 1 elsewhere.  The
  behaviour log-probs are the ones the ledger recorded for each output token (``behavior_logprobs``
  of a path record, per token; ``loss_behavior_logprobs`` of a collated batch, per target; NaN where
  none was recorded -- a ratio asked for there raises).
* :func:`clipped_surrogate` -- PPO/GRPO's ``-Σ w · min(r·A, clamp(r, 1-ε_low, 1+ε_high)·A)`` (a sum:
  the ledger's weights already normalise each execution; ``clip_high`` is DAPO's asymmetric bound).
* :func:`loss_at_targets` / :func:`target_logprobs` -- the log-prob of each target token from the
  last hidden states and the LM head, computed in chunks of ``chunk`` targets by a
  ``torch.autograd.Function`` that recomputes each chunk's logits in backward (as Liger Kernel's
  fused linear cross-entropy and Apple's cut-cross-entropy do): logits ``[T, V]`` are never
  materialised, not even for the targets, so peak memory is ``chunk × V`` (plus the head's own
  gradient), independent of the sequence length.  ``loss_at_targets(hidden, head, batch)`` equals
  ``token_loss(head(hidden), batch)`` in value and gradient (``tests/test_grpo.py``: float64 within
  1e-12, float32 within 1e-6).  The head is a plain linear map (``weight [V, H]``, optional bias):
  models that scale or soft-cap their logits (Gemma 2's ``final_logit_softcapping``, Cohere's
  ``logit_scale``) need that applied first, which this function does not do.

Torch is imported at module level, as in every module of ``ledger.train`` (the ``[train]`` extra):
nothing outside this package imports it, so the core package stays torch-free.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import torch

__all__ = ["advantages", "batch_advantages", "clipped_surrogate", "importance_ratios", "loss_at_targets",
           "target_logprobs"]

SCALES = ("std", "none")
DEFAULT_CHUNK = 256  # targets per chunk: 256 × 248,070 float32 logits = 254 MB


def _group_advantages(rewards: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
    if rewards.numel() == 0:
        return rewards
    if torch.isnan(rewards).any():
        raise ValueError(f"{int(torch.isnan(rewards).sum())} reward(s) are missing (NaN): no advantage")
    centred = rewards - rewards.mean()
    if scale == "none" or rewards.numel() < 2:
        return centred
    return centred / (rewards.std() + eps)


def advantages(rewards_by_group: Mapping[Hashable, Sequence[float]] | Sequence[Sequence[float]], *,
               scale: str = "std", eps: float = 1e-6, dtype: torch.dtype = torch.float64):
    """Group-relative advantages (module doc): for a mapping group -> rewards, the same mapping to
    advantage tensors; for a sequence of groups, a list of tensors in the same order.
    ``scale="std"`` (GRPO) divides by the group's sample std + ``eps``; ``scale="none"`` (Dr. GRPO)
    only centres."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, not {scale!r}")

    def one(rewards) -> torch.Tensor:
        return _group_advantages(torch.as_tensor(rewards, dtype=dtype).reshape(-1), scale, eps)

    if isinstance(rewards_by_group, Mapping):
        return {g: one(r) for g, r in rewards_by_group.items()}
    return [one(r) for r in rewards_by_group]


def batch_advantages(batch: Mapping[str, Any], groups: Mapping[str, Hashable] | None = None, *,
                     scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Per target of a collated batch (``loss_rewards``, ``loss_executions``): the advantage of its
    execution within its group.  ``groups`` maps execution id -> group (default: the whole batch is
    one group, as a feed batch with ``group_by="task"`` is).  An execution's reward is the one its
    records carry; two different rewards for one execution raise."""
    rewards, ex_index = batch["loss_rewards"], batch["loss_executions"]
    executions = list(batch["executions"])
    missing = sorted({executions[i] for i in ex_index[torch.isnan(rewards)].tolist()})
    if missing:
        raise ValueError(f"{len(missing)} execution(s) have no reward (first {missing[0]!r}): no advantage")
    reward_of: dict[int, float] = {}
    for i, r in zip(ex_index.tolist(), rewards.tolist()):
        if reward_of.setdefault(i, r) != r:
            raise ValueError(f"execution {executions[i]!r} carries two rewards ({reward_of[i]} and {r})")
    by_group: dict[Hashable, list[int]] = {}
    for i in sorted(reward_of):
        by_group.setdefault(None if groups is None else groups[executions[i]], []).append(i)
    adv = advantages({g: [reward_of[i] for i in idx] for g, idx in by_group.items()}, scale=scale, eps=eps,
                     dtype=rewards.dtype)
    per_execution = torch.zeros(len(executions), dtype=rewards.dtype)
    for g, idx in by_group.items():
        per_execution[torch.tensor(idx, dtype=torch.long)] = adv[g]
    return per_execution[ex_index]


def importance_ratios(new_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(new - behaviour)`` where ``mask`` (default: everywhere), exactly 1 elsewhere (and no
    gradient there).  ``behaviour_logprobs`` are the recorded ones (NaN where none was recorded):
    a NaN under the mask raises, naming how many."""
    behaviour = behaviour_logprobs.to(new_logprobs.dtype)
    mask = torch.ones_like(behaviour, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    missing = torch.isnan(behaviour) & mask
    if missing.any():
        raise ValueError(f"{int(missing.sum())} target(s) have no behaviour log-prob: no importance ratio")
    diff = torch.where(mask, new_logprobs - torch.nan_to_num(behaviour, nan=0.0), torch.zeros_like(new_logprobs))
    return torch.exp(diff)


def clipped_surrogate(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor | float,
                      weights: torch.Tensor | None = None, *, clip: float | None = 0.2, clip_high: float | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """The clipped GRPO/PPO surrogate to minimise: ``-Σ w · min(r·A, clamp(r, 1-clip, 1+clip_high)·A)``
    with ``r`` = :func:`importance_ratios` (``clip_high`` defaults to ``clip``; ``clip=None``: the
    unclipped ``-Σ w · r·A``).  ``weights`` default to 1; positions outside ``mask`` count nothing."""
    ratio = importance_ratios(logprobs, behaviour_logprobs, mask)
    adv = torch.as_tensor(advantages, dtype=logprobs.dtype)
    surrogate = ratio * adv
    if clip is not None:
        high = clip if clip_high is None else clip_high
        surrogate = torch.minimum(surrogate, torch.clamp(ratio, 1 - clip, 1 + high) * adv)
    w = torch.ones_like(logprobs) if weights is None else weights.to(logprobs.dtype)
    if mask is not None:
        w = torch.where(mask.to(torch.bool), w, torch.zeros_like(w))
    return -(w * surrogate).sum()


# ------------------------------------------------------------------ the loss at target positions
def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)


class _TargetLogprobs(torch.autograd.Function):
    """log p(target) = logit[target] - logsumexp(logits), chunk by chunk; backward recomputes each chunk's
    logits: d lp / d logits = onehot(target) - softmax."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk):
        out = torch.empty(h.shape[0], dtype=h.dtype, device=h.device)
        lse = torch.empty_like(out)
        for s in range(0, h.shape[0], chunk):
            logits = _chunk_logits(h[s:s + chunk], weight, bias)
            picked = logits.gather(-1, targets[s:s + chunk, None]).squeeze(-1)
            top = logits.amax(dim=-1, keepdim=True)
            # logsumexp in place (torch.logsumexp would allocate a second chunk x V tensor)
            lse[s:s + chunk] = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))
            out[s:s + chunk] = picked - lse[s:s + chunk]
            del logits
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        h, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        grad = grad.to(h.dtype)
        for s in range(0, h.shape[0], ctx.chunk):
            hc, g = h[s:s + ctx.chunk], grad[s:s + ctx.chunk]
            d = _chunk_logits(hc, weight, bias)
            d.sub_(lse[s:s + ctx.chunk, None]).exp_().mul_(-g[:, None])  # -g · softmax
            d.scatter_add_(-1, targets[s:s + ctx.chunk, None], g[:, None])  # + g · onehot(target)
            if grad_h is not None:
                torch.mm(d, weight, out=grad_h[s:s + ctx.chunk])
            if grad_w is not None:
                grad_w.addmm_(d.T, hc)
            if grad_b is not None:
                grad_b.add_(d.sum(0))
            del d
        return grad_h, grad_w, grad_b, None, None


def _head(lm_head: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(lm_head, torch.Tensor):
        return lm_head, None
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"lm_head is a weight tensor [V, H] or a linear module with .weight, not {type(lm_head).__name__}")
    return weight, getattr(lm_head, "bias", None)


def target_logprobs(hidden: torch.Tensor, lm_head: Any, batch: Mapping[str, Any], chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Per target of the batch's loss index: log p(target | the hidden state of its predecessor), from
    ``hidden`` ``[B, T, H]`` (the final hidden states, after the last norm: ``model.base_model(...)
    .last_hidden_state``) and ``lm_head`` (``model.get_output_embeddings()``, or its weight ``[V, H]``),
    ``chunk`` targets at a time (module doc).  Equals ``token_logprobs(lm_head(hidden), batch)``."""
    if chunk < 1:
        raise ValueError(f"chunk is at least 1, not {chunk}")
    weight, bias = _head(lm_head)
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} is not the head's input size {weight.shape[1]}")
    rows, preds, targets = batch["loss_rows"], batch["loss_predecessors"], batch["loss_targets"]
    h = hidden[rows, preds]
    ids = batch["input_ids"][rows, targets].to(device=hidden.device)
    if bias is not None:
        bias = bias.to(hidden.dtype)
    return _TargetLogprobs.apply(h, weight.to(hidden.dtype), bias, ids, int(chunk))


def loss_at_targets(hidden: torch.Tensor, lm_head: Any, batch: Mapping[str, Any], chunk: int = DEFAULT_CHUNK, *,
                    advantages: torch.Tensor | float | None = None, clip: float | None = None,
                    clip_high: float | None = None) -> torch.Tensor:
    """:func:`ledger.train.token_loss` without the logits: ``-Σ w · log p`` over the batch's targets, or with
    ``advantages`` (per target, e.g. :func:`batch_advantages`, or one number) the (``clip``: clipped)
    surrogate of :func:`clipped_surrogate` with ratios against the recorded ``loss_behavior_logprobs``;
    the weights are the batch's 1/L_i.  Only ``chunk × V`` logits exist at any time (module doc)."""
    lp = target_logprobs(hidden, lm_head, batch, chunk)
    w = batch["loss_weights"].to(lp.dtype)
    if advantages is None:
        return -(w * lp).sum()
    return clipped_surrogate(lp, batch["loss_behavior_logprobs"], advantages, w, clip=clip, clip_high=clip_high)
