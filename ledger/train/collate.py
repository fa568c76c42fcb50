"""Collators (SPEC 11.5): records -> the tensors a causal LM and :func:`ledger.train.token_loss` take.

Both collators describe the loss the same way, as flat index tensors over the batch's targets:
``loss_rows`` / ``loss_targets`` (where the target token is), ``loss_predecessors`` (the position
whose logits predict it: ``target - 1`` on a path, the recorded predecessor in a packed record —
a child's first token is predicted by its parent's last token), ``loss_weights`` (1/L_i),
``loss_behavior_logprobs`` (NaN where none was recorded), ``loss_rewards`` and
``loss_executions`` (index into ``executions``).  A target with no predecessor (position 0 of
a path) can be predicted by no logits: it is left out and counted in ``unpredicted_targets``.
Dummy records hold no tokens: they are skipped and counted in ``dummies``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["block_mask", "collate_packed", "collate_paths", "tree_mask"]


def _floats(values: Sequence[Any] | None, n: int, dtype) -> torch.Tensor:
    if values is None:
        return torch.full((n,), float("nan"), dtype=dtype)
    return torch.tensor([float("nan") if v is None else v for v in values], dtype=dtype)


def _execution_index(ids: list[str]) -> tuple[list[str], dict[str, int]]:
    order: dict[str, int] = {}
    for ex in ids:
        order.setdefault(ex, len(order))
    return list(order), order


def _loss_index(out: dict, rows, targets, preds, weights, behavior, rewards, executions) -> dict:
    keep = preds >= 0
    out.update(loss_rows=rows[keep], loss_targets=targets[keep], loss_predecessors=preds[keep],
               loss_weights=weights[keep], loss_behavior_logprobs=behavior[keep], loss_rewards=rewards[keep],
               loss_executions=executions[keep], unpredicted_targets=int((~keep).sum()))
    return out


def collate_paths(records: Sequence[Mapping[str, Any]], *, pad_token_id: int = 0,
                  dtype: torch.dtype = torch.float64, mask: str = "2d") -> dict:
    """Path records (SPEC 7.3) -> right-padded ``input_ids``, ``attention_mask``, ``labels`` (-100
    outside the targets), per-token ``weights`` (1/L_i on targets), ``behavior_logprobs`` (NaN where
    null), per-row ``rewards`` and ``execution_index``, plus the loss index (module doc).
    ``attention_mask`` is HF's 2D padding mask (``mask="2d"``), or the causal-and-padding mask as
    ``[B, 1, T, T]`` (``"bool"`` or ``"additive"``, as :func:`collate_packed` gives the tree mask;
    CPU SDPA runs float64 backward several times faster on an explicit mask)."""
    real = [r for r in records if not r.get("dummy") and r["input_ids"]]
    width = max((len(r["input_ids"]) for r in real), default=0)
    b = len(real)
    executions, index = _execution_index([r["execution_id"] for r in real])
    out: dict[str, Any] = {
        "input_ids": torch.full((b, width), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, width), dtype=torch.long),
        "labels": torch.full((b, width), -100, dtype=torch.long),
        "weights": torch.zeros((b, width), dtype=dtype),
        "behavior_logprobs": torch.full((b, width), float("nan"), dtype=dtype),
        "rewards": _floats([r.get("reward") for r in real], b, dtype),
        "execution_index": torch.tensor([index[r["execution_id"]] for r in real], dtype=torch.long),
        "executions": executions, "member_ids": [r["member_id"] for r in real],
        "dummies": len(records) - len(real),
    }
    for i, r in enumerate(real):
        n = len(r["input_ids"])
        ids = torch.tensor(r["input_ids"], dtype=torch.long)
        target = torch.tensor(r["target_mask"], dtype=torch.bool)
        out["input_ids"][i, :n] = ids
        out["attention_mask"][i, :n] = 1
        out["labels"][i, :n] = torch.where(target, ids, -100)
        out["weights"][i, :n] = target.to(dtype) * r["loss_weight"]
        out["behavior_logprobs"][i, :n] = _floats(r["behavior_logprobs"], n, dtype)
    if mask != "2d":
        pad = out["attention_mask"].bool()
        causal = torch.ones((width, width), dtype=torch.bool).tril()[None] & pad[:, None, :] & pad[:, :, None]
        causal |= torch.eye(width, dtype=torch.bool)[None]  # padding rows attend to themselves: no NaN rows
        out["attention_mask"] = _as_mask(causal[:, None], mask, dtype)
    rows, targets = (out["labels"] != -100).nonzero(as_tuple=True)
    return _loss_index(out, rows, targets, targets - 1, out["weights"][rows, targets],
                       out["behavior_logprobs"][rows, targets], out["rewards"][rows],
                       out["execution_index"][rows])


def _as_mask(allowed: torch.Tensor, mask: str, dtype: torch.dtype) -> torch.Tensor:
    if mask == "bool":
        return allowed
    if mask == "additive":
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"mask is 'additive' or 'bool' (collate_paths also '2d'), not {mask!r}")


def tree_mask(tin: torch.Tensor, tout: torch.Tensor) -> torch.Tensor:
    """The tree attention rule of SPEC 7.5 as a dense boolean ``[q, k]`` matrix:
    q may attend to k ⇔ tin[k] ≤ tin[q] < tout[k]."""
    return (tin[None, :] <= tin[:, None]) & (tin[:, None] < tout[None, :])


def block_mask(tin: torch.Tensor, tout: torch.Tensor):
    """The same rule as a FlexAttention ``BlockMask`` (None where this torch has no FlexAttention)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # optional extra [train]
    except ImportError:  # pragma: no cover - torch < 2.5
        return None
    n = int(tin.shape[0])

    def mask_mod(b, h, q, k):
        return (tin[k] <= tin[q]) & (tin[q] < tout[k])

    return create_block_mask(mask_mod, 1, 1, n, n, device=str(tin.device))


def _member_rewards(rec: Mapping[str, Any], starts: torch.Tensor, targets: torch.Tensor) -> list:
    """Per target: the reward of the member that owns its span (the first member covering it,
    SPEC 7.5); NaN when the record carries no member rewards (packed records before SPEC 11.5)."""
    spans = rec["node_spans"]
    owner: dict[int, Any] = {}
    for m in rec["members"]:
        s = m["leaf_node_index"]
        while s is not None:
            owner.setdefault(s, m.get("reward"))
            s = spans[s][2]
    span_of = torch.searchsorted(starts, targets, right=True) - 1
    # an empty span shares its start with the next: searchsorted(right) picks the last, a non-empty one
    return [owner.get(int(s)) for s in span_of.tolist()]


def collate_packed(records: Sequence[Mapping[str, Any]], *, mask: str = "additive", dtype: torch.dtype = torch.float64,
                   flex: bool = False) -> dict:
    """Packed records (SPEC 7.5) concatenated into one row: ``input_ids`` and ``position_ids``
    ``[1, N]``, ``attention_mask`` ``[1, 1, N, N]`` — the tree mask, block-diagonal across records,
    ``"additive"`` (0 / the dtype's minimum, for eager and SDPA attention) or ``"bool"`` — and, with
    ``flex``, a FlexAttention ``block_mask``; ``behavior_logprobs`` in packed order when the records
    carry them; the loss index (module doc) from each record's ``targets``."""
    real = [r for r in records if r["input_ids"]]
    executions, index = _execution_index([r["execution_id"] for r in real])
    ids, pos, tin, tout, tg, pr, w, beh, rew, exi = [], [], [], [], [], [], [], [], [], []
    off = 0
    for r in real:
        n = len(r["input_ids"])
        ids.append(torch.tensor(r["input_ids"], dtype=torch.long))
        pos.append(torch.tensor(r["position_ids"], dtype=torch.long))
        tin.append(torch.tensor(r["tin"], dtype=torch.long) + off)
        tout.append(torch.tensor(r["tout"], dtype=torch.long) + off)
        t = torch.tensor([x[0] for x in r["targets"]], dtype=torch.long)
        tg.append(t + off)
        pr.append(torch.tensor([-1 if x[1] is None else x[1] + off for x in r["targets"]], dtype=torch.long))
        w.append(torch.tensor([x[2] for x in r["targets"]], dtype=dtype))
        lp = _floats(r.get("behavior_logprobs"), n, dtype)
        beh.append(lp[t])
        starts = torch.tensor([s[0] for s in r["node_spans"]], dtype=torch.long)
        rew.append(_floats(_member_rewards(r, starts, t), t.shape[0], dtype))
        exi.append(torch.full((t.shape[0],), index[r["execution_id"]], dtype=torch.long))
        off += n
    cat = (lambda xs, dt=torch.long: torch.cat(xs) if xs else torch.zeros(0, dtype=dt))
    tin_all, tout_all = cat(tin), cat(tout)
    attn = _as_mask(tree_mask(tin_all, tout_all), mask, dtype)
    out: dict[str, Any] = {
        "input_ids": cat(ids)[None], "position_ids": cat(pos)[None], "attention_mask": attn[None, None],
        "tin": tin_all, "tout": tout_all, "executions": executions,
        "member_ids": [m["member_id"] for r in real for m in r["members"]], "dummies": len(records) - len(real),
    }
    if any("behavior_logprobs" in r for r in real):
        out["behavior_logprobs"] = cat([_floats(r.get("behavior_logprobs"), len(r["input_ids"]), dtype) for r in real],
                                       dtype)[None]
    if flex:
        out["block_mask"] = block_mask(tin_all, tout_all)
    targets = cat(tg)
    return _loss_index(out, torch.zeros_like(targets), targets, cat(pr), cat(w, dtype), cat(beh, dtype),
                       cat(rew, dtype), cat(exi))
