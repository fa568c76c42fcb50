"""Trainer API (SPEC 11.5): ManifestDataset, ExecutionBatchSampler, the collators and token_loss on a
tiny real Hugging Face causal LM (float64): packed loss and gradients equal the path loss and
gradients within 1e-12, on the demo workload and the Claude Code sessions."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ledger.corpus.export import trainer_records  # noqa: E402
from ledger.corpus.packed import packed_records  # noqa: E402
from ledger.train import collate_packed, collate_paths, token_loss, tree_mask  # noqa: E402
from tests.test_tree_pack import EV, SMALL_SESSIONS, _claude_db, _synthetic_db  # noqa: E402
from tests.train_models import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.usefixtures("earlier_release")  # the tree-pack tests' first-release routes (SPEC §10)


def _dense_vocab(paths, packed):
    """The ids the records use, renumbered 0..V-1 (a bijection, so the model's vocabulary stays
    tiny; the losses compared are the same function of the same sequences)."""
    ids = sorted({t for r in paths for t in r["input_ids"]} | {t for r in packed for t in r["input_ids"]})
    to = {t: i for i, t in enumerate(ids)}
    paths = [dict(r, input_ids=[to[t] for t in r["input_ids"]]) for r in paths]
    packed = [dict(r, input_ids=[to[t] for t in r["input_ids"]]) for r in packed]
    return paths, packed, len(ids)


def _loss_and_grads(model, batches, **collate):
    """Σ token_loss over micro-batches (one execution's records each, as a trainer with a token
    budget would), and the accumulated gradients."""
    model.zero_grad()
    total = 0.0
    for batch in batches:
        if batch["input_ids"].numel() == 0:  # a dummy record alone: nothing to run (collate counted it)
            assert batch["dummies"] == 1
            continue
        forward = {"attention_mask": batch["attention_mask"]}
        if "position_ids" in batch:
            forward["position_ids"] = batch["position_ids"]
        loss = token_loss(model(input_ids=batch["input_ids"], **forward).logits, batch)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_packed_equals_paths_on_a_real_model(db) -> dict:
    paths = list(trainer_records(db, "sft", evidence=EV))
    packed = list(packed_records(db, "sft", evidence=EV))
    paths, packed, vocab = _dense_vocab(paths, packed)
    model = tiny_qwen2(vocab, seed=1, max_positions=1 + max(len(r["input_ids"]) for r in paths))
    path_batches = [collate_paths([r], mask="bool") for r in paths]
    packed_batches = [collate_packed([r], mask="bool") for r in packed]
    n_targets = sum(b["loss_targets"].shape[0] for b in path_batches)
    assert n_targets == sum(b["loss_targets"].shape[0] for b in packed_batches)  # the same targets, each once
    loss_path, g_path = _loss_and_grads(model, path_batches)
    loss_packed, g_packed = _loss_and_grads(model, packed_batches)
    assert loss_path > 0.5 * sum(b["input_ids"].numel() > 0 for b in packed_batches)  # a real loss (≈ log V per execution), not a vacuous zero
    assert abs(loss_packed - loss_path) <= 1e-12 * abs(loss_path), (loss_packed, loss_path)
    worst = 0.0
    for name, g in g_path.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        err = (g_packed[name] - g).abs().max().item() / scale
        worst = max(worst, err)
    assert worst <= 1e-12, worst
    # the predecessors matter: HF's one-position shift on the packed sequence gives another loss
    naive = 0.0
    with torch.no_grad():
        for kb in packed_batches:
            if kb["input_ids"].numel() == 0:
                continue
            logits = model(input_ids=kb["input_ids"], attention_mask=kb["attention_mask"],
                           position_ids=kb["position_ids"]).logits
            naive += token_loss(logits, dict(kb, loss_predecessors=kb["loss_targets"] - 1)).item()
    return {"targets": n_targets, "packed_tokens": sum(len(r["input_ids"]) for r in packed),
            "path_tokens": sum(len(r["input_ids"]) for r in paths), "naive_gap": abs(naive - loss_path)}


def _demo_db(tmp_path, executions: int, j_max: int):
    """The demo's workload (workloads.synthetic, as examples/demo.py and tests/test_tree_pack.py)."""
    from tests.test_admission import route
    from tests.test_tree_pack import _project_sealed
    from workloads import synthetic

    events = list(synthetic.with_prefix_references(synthetic.generate(executions, seed=5, turns=synthetic.MIN_TURNS)))
    return _project_sealed(tmp_path, [route("sft", j_max=j_max)] + events, "syn")


def test_packed_equals_paths_on_a_tiny_qwen2_branching_fixture(tmp_path):
    """tests/test_export.py's store: three members share prefixes (and a dummy is counted apart)."""
    from tests.test_export import build

    n = assert_packed_equals_paths_on_a_real_model(build(tmp_path))
    assert (n["packed_tokens"], n["path_tokens"], n["targets"]) == (17, 30, 10)


def test_packed_equals_paths_on_a_tiny_qwen2_demo_workload_bounded(tmp_path):
    """One execution of the demo workload, one draw (the full workload below is slow: ~60 s on 2 cores)."""
    n = assert_packed_equals_paths_on_a_real_model(_demo_db(tmp_path, 1, j_max=1))
    assert n["packed_tokens"] == n["path_tokens"] > 1000


@pytest.mark.slow
def test_packed_equals_paths_on_a_tiny_qwen2_demo_workload(tmp_path):
    n = assert_packed_equals_paths_on_a_real_model(_synthetic_db(tmp_path))
    assert n["packed_tokens"] < n["path_tokens"]
    assert n["naive_gap"] > 1e-6  # two samples of one prompt: a first output token's predecessor is not t - 1


def test_packed_equals_paths_on_a_tiny_qwen2_claude_code_bounded(tmp_path):
    n = assert_packed_equals_paths_on_a_real_model(_claude_db(tmp_path, ("tool_heavy.jsonl",)))
    assert n["packed_tokens"] == n["path_tokens"] == 1969


@pytest.mark.slow
def test_packed_equals_paths_on_a_tiny_qwen2_claude_code_sessions(tmp_path):
    """Both small sessions, the sub-agent's included, cut to the calls whose input is at most 6,000 tokens:
    whole, the sub-agent session packs into one ~40k-token record whose dense float64 attention asks for a
    13.3 GB tensor (killed at 22.7 GB RSS on this 23 GB machine)."""
    n = assert_packed_equals_paths_on_a_real_model(_claude_db(tmp_path, SMALL_SESSIONS, max_input_tokens=6000))
    assert n["packed_tokens"] < n["path_tokens"]


def test_tree_mask_and_block_mask_agree():
    tin = torch.tensor([0, 1, 2, 3, 4])
    tout = torch.tensor([5, 5, 3, 5, 5])  # A=[0,1] -> B=[2] and A -> D=[3,4]
    m = tree_mask(tin, tout)
    assert m.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    kb = collate_packed([{"execution_id": "e", "input_ids": [1, 2, 3, 4, 5], "position_ids": [0, 1, 2, 2, 3],
                          "node_spans": [[0, 2, None], [2, 3, 0], [3, 5, 0]], "tin": tin.tolist(), "tout": tout.tolist(),
                          "targets": [[2, 1, 0.25], [3, 1, 0.25], [4, 3, 0.25]],
                          "members": [{"member_id": "r/e/b", "leaf_node_index": 1},
                                      {"member_id": "r/e/d", "leaf_node_index": 2}]}], mask="bool", flex=True)
    assert kb["attention_mask"][0, 0].tolist() == m.tolist()
    assert kb["loss_predecessors"].tolist() == [1, 1, 3] and kb["loss_targets"].tolist() == [2, 3, 4]
    if kb["block_mask"] is not None:
        dense = kb["block_mask"].to_dense()  # block granularity: every block of this tiny mask is partial
        assert dense.shape[-1] >= 1
