"""The TRL bridge (SPEC 11.5): the ledger's exact token ids and masks into TRL's DPO and SFT trainers.

Tested with TRL 1.16.0 and transformers 5.25 (``pyproject.toml`` pins the extra to that TRL).

* **DPO.**  TRL 1.16's ``DPOTrainer`` re-tokenizes text columns in ``_prepare_dataset`` and builds its
  completion mask from lengths: no dataset column can carry pre-tokenized, masked continuations
  into it.  So :class:`DPOTrainer` is a thin subclass that (only) takes :func:`dpo_dataset`'s rows as
  they are, keeps the mask columns, and collates with :class:`DPOCollator`, whose
  ``completion_mask`` is the pair record's ``chosen_mask`` / ``rejected_mask``: TRL's log-prob sums
  then cover exactly the policy's outputs, not the tool results and later prompts a continuation
  carries.  Everything else (losses, reference model, logging) is TRL's own.
* **SFT.**  :func:`sft_dataset` gives ``input_ids`` and ``assistant_masks`` (TRL's name: SFTTrainer
  turns it into ``labels``) from the path records' ``target_mask``; it refuses (naming the count) a
  ``max_length`` that would cut targets, and leaves dummy records out (counted in the dataset's
  ``info.description``).  :class:`WeightedSFTTrainer` also refuses a truncating ``max_length`` and
  replaces TRL's token-mean loss with the path records' objective, Σ 1/L_i × cross-entropy over the
  batch's targets (``loss_weight`` travels through :class:`WeightedSFTCollator`), computed at the target
  positions only (:func:`ledger.train.grpo.loss_at_targets`: the model's forward returns its final hidden
  states and the logits of one position).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import trl as _trl
from datasets import Dataset
from trl.trainer.dpo_trainer import DataCollatorForPreference
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from ledger.train.grpo import DEFAULT_CHUNK, loss_at_targets

__all__ = ["DPOCollator", "DPOTrainer", "WeightedSFTCollator", "WeightedSFTTrainer", "dpo_dataset", "sft_dataset"]

DPO_COLUMNS = ["prompt_ids", "chosen_ids", "rejected_ids", "chosen_mask", "rejected_mask"]


def _policy_mask(rec: Mapping[str, Any], side: str) -> list[int]:
    """A pair record's ``<side>_mask``; records of semantics-2 routes have none, and get it back
    from the log-probs (recorded for policy outputs only, SPEC 6.9)."""
    if f"{side}_mask" in rec:
        return list(rec[f"{side}_mask"])
    return [0 if x is None else 1 for x in rec[f"{side}_logprobs"]]


def dpo_dataset(records: Iterable[Mapping[str, Any]]) -> Dataset:
    """Pair records (SPEC 6.9) -> a ``datasets.Dataset`` of the ids and policy-output masks
    (plus ``member_id``), for :class:`DPOTrainer`."""
    rows = {k: [] for k in ["member_id"] + DPO_COLUMNS}
    for rec in records:
        rows["member_id"].append(rec["member_id"])
        for k in ("prompt_ids", "chosen_ids", "rejected_ids"):
            rows[k].append(list(rec[k]))
        rows["chosen_mask"].append(_policy_mask(rec, "chosen"))
        rows["rejected_mask"].append(_policy_mask(rec, "rejected"))
    return Dataset.from_dict(rows)


class DPOCollator(DataCollatorForPreference):
    """TRL's preference collator with the ledger's masks: ``completion_mask`` is 0 on the prompt and
    the pair's ``chosen_mask`` / ``rejected_mask`` on each continuation.  Never truncates: a
    ``max_length`` shorter than a pair raises (TRL would cut continuation tokens silently)."""

    def __init__(self, pad_token_id: int, max_length: int | None = None, pad_to_multiple_of: int | None = None) -> None:
        super().__init__(pad_token_id=pad_token_id, max_length=None, pad_to_multiple_of=pad_to_multiple_of)
        self.limit = max_length

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().torch_call([{k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in examples])
        masks = [[0] * len(ex["prompt_ids"]) + list(ex[f"{side}_mask"]) for side in ("chosen", "rejected")
                 for ex in examples]
        if self.limit is not None and max(map(len, masks)) > self.limit:
            raise ValueError(f"a pair is {max(map(len, masks))} tokens, over max_length={self.limit}: it would be cut")
        completion = torch.zeros_like(out["completion_mask"])
        for i, m in enumerate(masks):
            completion[i, : len(m)] = torch.tensor(m, dtype=completion.dtype)
        out["completion_mask"] = completion
        return out


def _default_collator(trainer: str, collator: type, processing_class: Any) -> Any:
    """A trainer's own collator, padding with the tokenizer's pad token (its EOS token when it has none)."""
    if processing_class is None:
        raise ValueError(f"{trainer} needs processing_class (its pad token) or a data_collator")
    pad = processing_class.pad_token_id
    return collator(pad_token_id=processing_class.eos_token_id if pad is None else pad)


class DPOTrainer(_trl.DPOTrainer):
    """``trl.DPOTrainer`` on :func:`dpo_dataset` rows as they are (no re-tokenization), collated by
    :class:`DPOCollator` unless another collator is given."""

    def __init__(self, *args, data_collator=None, processing_class=None, **kwargs) -> None:
        if data_collator is None:
            data_collator = _default_collator("DPOTrainer", DPOCollator, processing_class)
        super().__init__(*args, data_collator=data_collator, processing_class=processing_class, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        missing = [c for c in DPO_COLUMNS if c not in (dataset.column_names or [])]
        if missing:
            raise ValueError(f"the {dataset_name} dataset has no {missing} columns: build it with "
                             "ledger.train.trl.dpo_dataset(records)")
        return dataset

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = DPO_COLUMNS + ["ref_chosen_logps", "ref_rejected_logps"]


def _cut_targets(records: list[Mapping[str, Any]], max_length: int | None) -> int:
    if max_length is None:
        return 0
    return sum(sum(r["target_mask"][max_length:]) for r in records)


def sft_dataset(records: Iterable[Mapping[str, Any]], max_length: int | None = None) -> Dataset:
    """Path records (SPEC 7.3) -> ``input_ids``, ``assistant_masks`` (= ``target_mask``) and
    ``loss_weight`` (1/L_i), plus ``member_id`` / ``execution_id``.  Dummy records are left out and
    counted in ``info.description``; a ``max_length`` that would cut targets raises, naming how many."""
    real, dummies = [], 0
    for rec in records:
        if rec.get("dummy") or not rec["input_ids"]:
            dummies += 1
        else:
            real.append(rec)
    cut = _cut_targets(real, max_length)
    if cut:
        total = sum(sum(r["target_mask"]) for r in real)
        raise ValueError(f"max_length={max_length} would cut {cut} of {total} targets; use max_length=None "
                         "(or a trainer that packs, ledger.train.collate_packed)")
    ds = Dataset.from_dict({
        "input_ids": [list(r["input_ids"]) for r in real], "assistant_masks": [list(r["target_mask"]) for r in real],
        "loss_weight": [float(r["loss_weight"]) for r in real], "member_id": [r["member_id"] for r in real],
        "execution_id": [r["execution_id"] for r in real]})
    ds.info.description = f"ledger: {len(real)} path records, {dummies} dummy records left out"
    return ds


class WeightedSFTCollator(DataCollatorForLanguageModeling):
    """TRL's language-modeling collator that also carries each row's ``loss_weight`` (1/L_i)."""

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().torch_call([{k: v for k, v in ex.items() if k != "loss_weight"} for ex in examples])
        out["loss_weight"] = torch.tensor([float(ex["loss_weight"]) for ex in examples], dtype=torch.float64)
        return out


class WeightedSFTTrainer(_trl.SFTTrainer):
    """``trl.SFTTrainer`` with the path records' objective: loss = Σ_rows 1/L_i × Σ_targets CE
    (targets from ``assistant_masks``; 1/L_i from ``loss_weight``), computed in the hidden states' dtype by
    :func:`ledger.train.grpo.loss_at_targets` from the model's final hidden states and its output
    embeddings (``loss_chunk`` targets at a time): no ``[B, T, V]`` logits, so a 250k vocabulary on
    5k-token paths fits.  Refuses a ``max_length`` that would cut targets (TRL's default of 1,024 usually
    does)."""

    def __init__(self, *args, data_collator=None, processing_class=None, loss_chunk: int = DEFAULT_CHUNK,
                 **kwargs) -> None:
        self.loss_chunk = loss_chunk
        if data_collator is None:
            data_collator = _default_collator("WeightedSFTTrainer", WeightedSFTCollator, processing_class)
        super().__init__(*args, data_collator=data_collator, processing_class=processing_class, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if args.max_length is not None and "assistant_masks" in dataset.column_names:
            cut = sum(sum(m[args.max_length:]) for m in dataset["assistant_masks"])
            if cut:
                raise ValueError(f"max_length={args.max_length} would cut {cut} targets of the {dataset_name} "
                                 "dataset; set max_length=None in the SFTConfig")
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "labels", "loss_weight"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weight = inputs.pop("loss_weight")
        labels = inputs.pop("labels")
        # the final hidden states (after the last norm), through the model's own forward (so DDP / PEFT wrappers
        # still apply), with logits for one position only: the loss needs none of the [B, T, V] logits
        outputs = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        rows, preds = (labels[:, 1:] != -100).nonzero(as_tuple=True)
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        hidden = outputs.hidden_states[-1]
        index = {"input_ids": labels.clamp(min=0), "loss_rows": rows, "loss_predecessors": preds, "loss_targets": preds + 1,
                 "loss_weights": weight.to(hidden.dtype)[rows]}
        loss = loss_at_targets(hidden, head, index, chunk=self.loss_chunk)
        return (loss, outputs) if return_outputs else loss
