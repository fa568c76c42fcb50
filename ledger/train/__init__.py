"""Trainer API (SPEC 11.5; optional extra ``[train]``): read a published corpus into PyTorch and TRL.

``ManifestDataset`` (the signature, the exact member set and every digest), ``ExecutionBatchSampler``
(whole executions per batch under a token budget), ``collate_paths`` / ``collate_packed`` (dense
tree mask; a FlexAttention ``BlockMask`` where torch supports it) and ``token_loss`` (Σ weight ×
cross-entropy at each target's predecessor), and ``loss_at_targets`` (the same loss from the last
hidden states and the LM head, never materialising the logits, ``ledger.train.grpo`` with GRPO's
advantages, ratios and clipped surrogate, SPEC 12.4).  ``ledger.train.trl`` bridges to TRL's DPO and
SFT trainers.

May import ledger.corpus and below (and torch, transformers, trl, datasets: only this package
does).  Nothing in the core package imports it, so ``ledger`` stays torch-free.
"""

from ledger.train.collate import collate_packed, collate_paths, tree_mask
from ledger.train.data import ExecutionBatchSampler, ManifestDataset, ManifestError, MemberSetError, features
from ledger.train.grpo import loss_at_targets, target_logprobs
from ledger.train.loss import token_logprobs, token_loss

__all__ = ["ExecutionBatchSampler", "ManifestDataset", "ManifestError", "MemberSetError", "collate_packed", "collate_paths", "features",
           "loss_at_targets", "target_logprobs", "token_logprobs", "token_loss", "tree_mask"]
