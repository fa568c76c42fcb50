"""``ledger.train.grpo`` (SPEC 12.4): group-relative advantages, importance ratios, the clipped surrogate,
and ``loss_at_targets`` -- equal to the full-logits ``token_loss`` in value and gradient (float64 within
1e-12, float32 within 1e-6), on random shapes (hypothesis) and on a tiny real Qwen2, without ever
creating a tensor of more than ``chunk × V`` elements."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings, strategies as st  # noqa: E402

from ledger.train import collate_paths, token_logprobs, token_loss  # noqa: E402
from ledger.train.grpo import (  # noqa: E402
    advantages,
    batch_advantages,
    clipped_surrogate,
    importance_ratios,
    loss_at_targets,
    target_logprobs,
)


# ------------------------------------------------------------------ advantages
def test_advantages_are_group_relative_with_the_sample_std():
    adv = advantages({"t1": [1.0, 0.0, 0.0, 1.0], "t2": [0.5, 0.5], "t3": [2.0]})
    std = math.sqrt(sum((r - 0.5) ** 2 for r in [1, 0, 0, 1]) / 3)  # Bessel: N - 1, as torch.std / TRL / verl
    assert torch.allclose(adv["t1"], torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / (std + 1e-6))
    assert adv["t2"].tolist() == [0.0, 0.0]  # no signal, no division by a zero std
    assert adv["t3"].tolist() == [0.0]  # one attempt: nothing to compare it with
    assert [a.tolist() for a in advantages([[3.0, 1.0]], scale="none")] == [[1.0, -1.0]]  # Dr. GRPO: centred only
    with pytest.raises(ValueError, match="scale must be one of std, none"):
        advantages([[1.0]], scale="rank")
    with pytest.raises(ValueError, match="1 reward"):
        advantages([[1.0, float("nan")]])


def _records():
    """Two attempts of one task (rewards 1 and 0), one with two paths, and a third execution of reward 0.5."""
    def rec(ex, member, ids, mask, reward, lp):
        return {"execution_id": ex, "member_id": member, "input_ids": ids, "target_mask": mask,
                "loss_weight": 1 / sum(mask), "reward": reward, "behavior_logprobs": lp}
    return [rec("e1", "r/e1/a", [1, 2, 3, 4], [0, 0, 1, 1], 1.0, [None, None, -0.5, -1.0]),
            rec("e1", "r/e1/b", [1, 2, 5], [0, 0, 1], 1.0, [None, None, -2.0]),
            rec("e2", "r/e2/a", [1, 6, 7], [0, 1, 1], 0.0, [None, -0.1, -0.2]),
            rec("e3", "r/e3/a", [1, 7], [0, 1], 0.5, [None, -0.3])]


def test_batch_advantages_per_target():
    batch = collate_paths(_records())
    adv = batch_advantages(batch, scale="none")
    mean = (1.0 + 0.0 + 0.5) / 3
    assert adv.tolist() == pytest.approx([1 - mean] * 3 + [-mean] * 2 + [0.5 - mean])
    groups = {"e1": "t", "e2": "t", "e3": "u"}
    adv = batch_advantages(batch, groups)
    assert adv[-1].item() == 0.0 and adv[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6))
    bad = collate_paths([dict(r, reward=None) if r["execution_id"] == "e2" else r for r in _records()])
    with pytest.raises(ValueError, match="no reward \\(first 'e2'\\)"):
        batch_advantages(bad)


# ------------------------------------------------------------------ ratios and the surrogate
def test_importance_ratios_from_recorded_logprobs():
    new = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([-1.5, float("nan"), -3.0], dtype=torch.float64)
    mask = torch.tensor([True, False, True])
    r = importance_ratios(new, behaviour, mask)
    assert r.tolist() == pytest.approx([math.exp(0.5), 1.0, 1.0])
    r.sum().backward()
    assert new.grad.tolist() == pytest.approx([math.exp(0.5), 0.0, 1.0])  # no NaN leaks into the gradient
    with pytest.raises(ValueError, match="1 target\\(s\\) have no behaviour log-prob"):
        importance_ratios(new, behaviour)


def test_clipped_surrogate_is_token_loss_rl_objective():
    batch = collate_paths(_records())
    torch.manual_seed(0)
    logits = torch.randn(*batch["input_ids"].shape, 9, dtype=torch.float64)
    lp = token_logprobs(logits, batch)
    adv = batch_advantages(batch)
    for clip in (None, 0.2):
        want = token_loss(logits, batch, advantages=adv, clip=clip)
        got = clipped_surrogate(lp, batch["loss_behavior_logprobs"], adv, batch["loss_weights"], clip=clip)
        assert got.item() == pytest.approx(want.item(), rel=1e-15)
    # asymmetric clip (DAPO): a ratio above 1 + clip_high is cut there for a positive advantage
    r = torch.tensor([2.0], dtype=torch.float64).log()
    assert clipped_surrogate(r, torch.zeros(1, dtype=torch.float64), 1.0, clip=0.2, clip_high=0.3).item() == pytest.approx(-1.3)


# ------------------------------------------------------------------ loss_at_targets = the full-logits loss
def _random_batch(gen, b, t, vocab, n_targets):
    input_ids = torch.randint(0, vocab, (b, t), generator=gen)
    rows = torch.randint(0, b, (n_targets,), generator=gen)
    targets = torch.randint(1, t, (n_targets,), generator=gen)
    preds = torch.clamp(targets - torch.randint(1, 3, (n_targets,), generator=gen), min=0)  # a tree's predecessor too
    return {"input_ids": input_ids, "loss_rows": rows, "loss_targets": targets, "loss_predecessors": preds,
            "loss_weights": torch.rand(n_targets, generator=gen, dtype=torch.float64),
            "loss_behavior_logprobs": -torch.rand(n_targets, generator=gen, dtype=torch.float64)}


def _losses(dtype, b, t, hsize, vocab, n_targets, chunk, bias, rl, seed):
    """(naive, ours) of one random case in ``dtype``, and the float64 naive: (loss, grads of hidden, weight[, bias])
    each.  Weights ~ N(0, 1/H) as a trained head's: logits of order 1."""
    gen = torch.Generator().manual_seed(seed)
    batch = _random_batch(gen, b, t, vocab, n_targets)
    hidden64 = torch.randn(b, t, hsize, generator=gen, dtype=torch.float64)
    weight64 = torch.randn(vocab, hsize, generator=gen, dtype=torch.float64) / math.sqrt(hsize)
    bias64 = torch.randn(vocab, generator=gen, dtype=torch.float64) if bias else None
    adv64 = torch.randn(n_targets, generator=gen, dtype=torch.float64)
    out = []
    for dt, fn in ((dtype, "naive"), (dtype, "ours"), (torch.float64, "naive")):
        hidden = hidden64.to(dt).requires_grad_()
        head = torch.nn.Linear(hsize, vocab, bias=bias, dtype=dt)
        with torch.no_grad():
            head.weight.copy_(weight64)
            if bias:
                head.bias.copy_(bias64)
        kw = {"advantages": adv64.to(dt), "clip": 0.2} if rl else {}
        loss = (token_loss(head(hidden), batch, **kw) if fn == "naive"
                else loss_at_targets(hidden, head, batch, chunk=chunk, **kw))
        assert loss.dtype == dt
        out.append([loss.detach().double(), *(g.double() for g in torch.autograd.grad(loss, [hidden, *head.parameters()]))])
    return out


def _max_rel(x, y):
    return (x - y).abs().max().item() / max(y.abs().max().item(), 1e-300)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(2, 24), hsize=st.integers(1, 16), vocab=st.integers(2, 300),
       n_targets=st.integers(0, 40), chunk=st.integers(1, 50), bias=st.booleans(), rl=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_loss_at_targets_equals_full_logits_float64(b, t, hsize, vocab, n_targets, chunk, bias, rl, seed):
    """Value and every gradient (hidden, weight, bias) within 1e-12 of the full-logits loss, elementwise
    relative to the largest."""
    naive, ours, _ = _losses(torch.float64, b, t, hsize, vocab, n_targets, chunk, bias, rl, seed)
    assert abs(ours[0].item() - naive[0].item()) <= 1e-12 * max(1.0, abs(naive[0].item()))
    for g, gn in zip(ours[1:], naive[1:]):
        assert _max_rel(g, gn) <= 1e-12 or gn.abs().max().item() == 0 == g.abs().max().item()


@pytest.mark.parametrize("shape", [(1, 64, 16, 1000, 50, 7), (2, 300, 64, 5000, 400, 128), (1, 33, 8, 257, 33, 256)])
@pytest.mark.parametrize("rl", [False, True])
def test_loss_at_targets_equals_full_logits_float32(shape, rl):
    """float32: the value within 1e-6 of the full-logits loss, each gradient within 1e-6 in norm; elementwise
    the float32 full-logits gradient is itself ~1e-6 from the float64 truth (summation over V in float32),
    so there the chunked one must be as close to the truth as it (within 2x)."""
    b, t, hsize, vocab, n_targets, chunk = shape
    naive, ours, truth = _losses(torch.float32, b, t, hsize, vocab, n_targets, chunk, True, rl, sum(shape))
    assert abs(ours[0].item() - naive[0].item()) <= 1e-6 * max(1.0, abs(naive[0].item()))
    for g, gn, gt in zip(ours[1:], naive[1:], truth[1:]):
        assert ((g - gn).norm() / gn.norm()).item() <= 1e-6
        assert _max_rel(g, gt) <= 2 * _max_rel(gn, gt) + 1e-7, (_max_rel(g, gt), _max_rel(gn, gt))


def test_loss_at_targets_on_a_tiny_qwen2():
    """hidden = model.base_model(...).last_hidden_state, head = model.get_output_embeddings(): the same loss
    and every parameter's gradient as token_loss(model(...).logits) (float64, 1e-12)."""
    pytest.importorskip("transformers")
    from tests.train_models import tiny_qwen2

    model = tiny_qwen2(64, seed=3)
    batch = collate_paths([dict(r, input_ids=[i * 7 % 64 for i in r["input_ids"]]) for r in _records()])
    forward = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    results = []
    for naive in (True, False):
        model.zero_grad()
        if naive:
            loss = token_loss(model(**forward).logits, batch)
        else:
            hidden = model.base_model(**forward).last_hidden_state
            loss = loss_at_targets(hidden, model.get_output_embeddings(), batch, chunk=2)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l1, g1), (l2, g2) = results
    assert l1 > 1.0 and abs(l1 - l2) <= 1e-12 * l1
    for name, g in g1.items():
        assert (g2[name] - g).abs().max().item() <= 1e-12 * g.abs().max().item(), name


def test_loss_at_targets_never_creates_more_than_chunk_logits():
    """Every tensor an op creates in forward and backward (seen by a dispatch mode) has at most chunk × V
    elements: 3,000 positions × V = 4,000 would be 12M; the largest is 64 × 4,000."""
    dispatch = pytest.importorskip("torch.utils._python_dispatch")

    class Largest(dispatch.TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(x, torch.Tensor):
                    Largest.largest = max(Largest.largest, x.numel())
            return out

    t, vocab, hsize, chunk = 3000, 4000, 8, 64
    gen = torch.Generator().manual_seed(0)
    batch = _random_batch(gen, 1, t, vocab, t - 1)
    hidden = torch.randn(1, t, hsize, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hsize, generator=gen, requires_grad=True)
    with Largest():
        loss_at_targets(hidden, weight, batch, chunk=chunk).backward()
    assert Largest.largest == chunk * vocab, Largest.largest
    assert hidden.grad is not None and weight.grad is not None


def test_target_logprobs_refuses_bad_inputs():
    batch = collate_paths(_records())
    hidden = torch.zeros(*batch["input_ids"].shape, 4)
    with pytest.raises(ValueError, match="hidden size 4 is not the head's input size 5"):
        target_logprobs(hidden, torch.zeros(10, 5), batch)
    with pytest.raises(ValueError, match="chunk is at least 1"):
        target_logprobs(hidden, torch.zeros(10, 4), batch, chunk=0)
    with pytest.raises(TypeError, match="lm_head is a weight tensor"):
        target_logprobs(hidden, object(), batch)
    with pytest.raises(ValueError, match="no behaviour log-prob"):
        loss_at_targets(hidden, torch.zeros(10, 4), collate_paths([dict(r, behavior_logprobs=None) for r in _records()]),
                        advantages=1.0)


def test_advantages_from_a_feed_group_of_the_readme_corpus(tmp_path):
    """SPEC 12.4: a feed batch with group_by="task" (two attempts of one task from two collection runs) ->
    per-target advantages; the README's rewards are 1, 1 / 0, 0 / 1, 1 per task: no signal anywhere, so 0;
    a group that mixes tasks 7-0000 and 7-0001 (rewards 1, 1, 0, 0) gives ±1/(std+eps)."""
    import ledger
    from tests.helpers import readme_store

    s = readme_store(tmp_path)
    with ledger.Feed(s, "rl-main", "grpo", group_by="task", group_size=2) as feed:
        groups = list(feed.batches(follow=False))
    assert len(groups) == 3 and all(len(set(r["task_id"] for r in g.records)) == 1 for g in groups)
    for g in groups:
        batch = collate_paths(g.records)
        assert batch_advantages(batch).abs().max().item() == 0.0
    batch = collate_paths([r for g in groups for r in g.records if r["task_id"] in ("task-7-0000", "task-7-0001")])
    adv = batch_advantages(batch)
    std = math.sqrt(4 / 3 * 0.25)  # rewards 1, 1, 0, 0: sample std
    rewards = batch["loss_rewards"]
    assert torch.allclose(adv, (rewards - 0.5) / (std + 1e-6))
    assert set(adv.sign().tolist()) == {1.0, -1.0}
