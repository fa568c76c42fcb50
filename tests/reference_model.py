"""A tiny numpy transformer used to prove the tree-packed format (SPEC §7.5) trains exactly
like the path records (§7.3): embedding (token + learned position), one single-head
self-attention layer with a residual connection, an output projection and a weighted
cross-entropy — forward and a hand-written backward, in float64.

The attention mask is the tree rule "q may attend to k ⇔ tin[k] ≤ tin[q] < tout[k]"; a path
record is the special case ``tin = arange(L)``, ``tout = L`` (plain causal attention).  The
loss of a sequence is ``Σ weight · CE(logits[predecessor], token[target])``.  Attention is
computed in blocks of query rows and only over the key columns some query of the block may
see, so memory stays at O(block · N) for sequences of tens of thousands of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 128
PARAMS = ("E", "P", "Wq", "Wk", "Wv", "Wo", "U")


@dataclass
class Model:
    E: np.ndarray  # [V, d] token embedding (token id mod V: a hashed vocabulary)
    P: np.ndarray  # [max_pos, d] position embedding
    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    Wo: np.ndarray  # [d, d]
    U: np.ndarray  # [d, V] output projection

    @classmethod
    def random(cls, *, vocab: int = 97, dim: int = 16, max_pos: int = 1024, seed: int = 0) -> "Model":
        rng = np.random.default_rng(seed)
        s = 1.0 / np.sqrt(dim)
        return cls(E=rng.normal(0, 1, (vocab, dim)), P=rng.normal(0, 0.5, (max_pos, dim)),
                   Wq=rng.normal(0, 2 * s, (dim, dim)), Wk=rng.normal(0, 2 * s, (dim, dim)),
                   Wv=rng.normal(0, s, (dim, dim)), Wo=rng.normal(0, s, (dim, dim)), U=rng.normal(0, s, (dim, vocab)))

    def zeros(self) -> dict[str, np.ndarray]:
        return {k: np.zeros_like(getattr(self, k)) for k in PARAMS}


def _blocks(n: int):
    for a in range(0, n, BLOCK):
        yield a, min(n, a + BLOCK)


def _block_keys(tin: np.ndarray, tout: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Key columns some query in [a, b) may attend to, and the [b-a, len(cols)] mask."""
    tq = tin[a:b, None]
    mask = (tin[None, :b] <= tq) & (tq < tout[None, :b])
    cols = np.flatnonzero(mask.any(axis=0))
    return cols, mask[:, cols]


def loss_and_grads(m: Model, ids, pos, tin, tout, targets, weights, grads: dict | None = None) -> float:
    """Loss of one sequence; adds d loss / d parameter into ``grads`` (if given).

    ``targets``: [T, 2] (target index, predecessor index); a target with predecessor ``-1``
    (nothing predicts it) is skipped."""
    ids = np.asarray(ids, dtype=np.int64) % m.E.shape[0]
    pos = np.asarray(pos, dtype=np.int64)
    tin = np.asarray(tin, dtype=np.int64)
    tout = np.asarray(tout, dtype=np.int64)
    t = np.asarray(targets, dtype=np.int64).reshape(-1, 2)
    w = np.asarray(weights, dtype=np.float64)
    keep = t[:, 1] >= 0
    t, w = t[keep], w[keep]
    n, d = ids.shape[0], m.E.shape[1]
    if n == 0 or t.shape[0] == 0:
        return 0.0
    scale = 1.0 / np.sqrt(d)
    x = m.E[ids] + m.P[pos]
    q, k, v = x @ m.Wq, x @ m.Wk, x @ m.Wv
    o = np.zeros((n, d))
    for a, b in _blocks(n):
        cols, mask = _block_keys(tin, tout, a, b)
        s = np.where(mask, (q[a:b] @ k[cols].T) * scale, -np.inf)
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        o[a:b] = p @ v[cols]
    h = x + o @ m.Wo
    pred, y = t[:, 1], ids[t[:, 0]]
    z = h[pred] @ m.U  # [T, V]
    zmax = z.max(axis=1, keepdims=True)
    lse = zmax[:, 0] + np.log(np.exp(z - zmax).sum(axis=1))
    loss = float(np.sum(w * (lse - z[np.arange(z.shape[0]), y])))
    if grads is None:
        return loss
    # ---- backward
    dz = np.exp(z - lse[:, None])
    dz[np.arange(z.shape[0]), y] -= 1.0
    dz *= w[:, None]
    grads["U"] += h[pred].T @ dz
    dh = np.zeros((n, d))
    np.add.at(dh, pred, dz @ m.U.T)  # a position shared by siblings predicts several targets
    grads["Wo"] += o.T @ dh
    do = dh @ m.Wo.T
    dx = dh.copy()
    dq, dk, dv = np.zeros((n, d)), np.zeros((n, d)), np.zeros((n, d))
    for a, b in _blocks(n):
        cols, mask = _block_keys(tin, tout, a, b)
        s = np.where(mask, (q[a:b] @ k[cols].T) * scale, -np.inf)
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        dv[cols] += p.T @ do[a:b]
        dp = do[a:b] @ v[cols].T
        ds = p * (dp - np.sum(dp * p, axis=1, keepdims=True)) * scale
        dq[a:b] += ds @ k[cols]
        dk[cols] += ds.T @ q[a:b]
    grads["Wq"] += x.T @ dq
    grads["Wk"] += x.T @ dk
    grads["Wv"] += x.T @ dv
    dx += dq @ m.Wq.T + dk @ m.Wk.T + dv @ m.Wv.T
    np.add.at(grads["E"], ids, dx)
    np.add.at(grads["P"], pos, dx)
    return loss


def path_loss(m: Model, input_ids, target_mask, loss_weight: float, grads: dict | None = None) -> float:
    """One path record (SPEC §7.3) under plain causal attention: position j's target is
    predicted by position j - 1."""
    n = len(input_ids)
    j = np.flatnonzero(np.asarray(target_mask, dtype=np.int64))
    targets = np.stack([j, j - 1], axis=1) if j.size else np.zeros((0, 2), dtype=np.int64)
    return loss_and_grads(m, input_ids, np.arange(n), np.arange(n), np.full(n, n), targets,
                          np.full(j.shape[0], float(loss_weight)), grads)


def packed_loss(m: Model, rec: dict, grads: dict | None = None) -> float:
    """One packed record (SPEC §7.5), read exactly as a tree-attention trainer would."""
    t = rec["targets"]
    targets = np.array([[i, -1 if p is None else p] for i, p, _ in t], dtype=np.int64).reshape(-1, 2)
    return loss_and_grads(m, rec["input_ids"], rec["position_ids"], rec["tin"], rec["tout"], targets,
                          np.array([w for _, _, w in t], dtype=np.float64), grads)
