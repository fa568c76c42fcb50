"""Build a PyTorch FlexAttention block mask from one tree-packed record (SPEC §7.5).

    python examples/flex_attention.py packed.jsonl      # from `ledger export ROUTE --format packed`

The mask rule is the record's own: q may attend to k  <=>  tin[k] <= tin[q] < tout[k].
Logits at ``predecessor_index`` predict ``target_index``, weighted by ``weight`` (1/L_i).
Needs torch >= 2.5 (``torch.nn.attention.flex_attention``); the ledger itself does not.
"""

from __future__ import annotations

import sys

from ledger import read_packed

try:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
except ImportError:  # pragma: no cover - optional
    torch = None


def block_mask(rec: dict, device: str = "cpu"):
    tin = torch.tensor(rec["tin"], device=device)
    tout = torch.tensor(rec["tout"], device=device)

    def tree(b, h, q, k):
        return (tin[k] <= tin[q]) & (tin[q] < tout[k])

    n = len(rec["input_ids"])
    return create_block_mask(tree, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)


def loss_inputs(rec: dict, device: str = "cpu"):
    """(input_ids, position_ids, predecessor rows, target ids, weights) as tensors."""
    t = [x for x in rec["targets"] if x[1] is not None]
    ids = torch.tensor(rec["input_ids"], device=device)
    return (ids, torch.tensor(rec["position_ids"], device=device), torch.tensor([x[1] for x in t], device=device),
            ids[torch.tensor([x[0] for x in t], device=device, dtype=torch.long)],
            torch.tensor([x[2] for x in t], device=device, dtype=torch.float32))


if __name__ == "__main__":
    if torch is None:
        sys.exit("examples/flex_attention.py: torch is not installed (pip install torch)")
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/flex_attention.py PACKED.jsonl")
    for rec in read_packed(sys.argv[1]):
        if rec["input_ids"]:
            print(rec["execution_id"], block_mask(rec))
