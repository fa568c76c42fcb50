"""Tests for path selection (SPEC §6.5 Targets) and the per-execution normalised loss."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.loss import (
    ExecutionTargets,
    PathRecord,
    execution_loss,
    execution_masks,
    node_offsets,
    normalized_loss,
    trainer_loss,
)
from ledger.algorithms.path_draws import (
    DEFAULT_PRIORITY,
    Draw,
    Leaf,
    TreeView,
    class_order,
    draw_u,
    draw_word,
    execution_targets,
    leaves_of,
    loss_weights,
    path_nodes,
    path_target_mask,
    select_paths,
)

# --------------------------------------------------------------------------- helpers


def make_tree(
    parents: list[int], candidates: list[list[int]], classes: dict[int, str] | None = None
) -> TreeView:
    """Build a TreeView; ``classes`` maps leaf node id -> role class (default main/task)."""
    parent = np.array(parents, dtype=np.int64)
    cand = [np.array(c, dtype=np.uint8) for c in candidates]
    seg_len = np.array([len(c) for c in cand], dtype=np.int64)
    classes = classes or {}
    leaves = [Leaf(int(v), f"r{int(v)}", classes.get(int(v), "main/task")) for v in leaves_of(parent)]
    return TreeView(parent=parent, seg_len=seg_len, candidate=cand, leaves=leaves)


def summary(draws: list[Draw]) -> list[tuple[int, dict[int, list[int]]]]:
    return [(d.leaf.node_id, {n: a.tolist() for n, a in d.targets.items()}) for d in draws]


Summary = list[tuple[int, dict[int, list[int]]]]


def reference_select(
    tree: TreeView, j_max: int, priority: Sequence[str], seed: str, execution_id: str
) -> Summary:
    """Naive set-based transcription of SPEC §6.5 steps 2–4 (exact rational arithmetic)."""
    parent = [int(p) for p in tree.parent]
    cand = {v: {int(i) for i in np.flatnonzero(c)} for v, c in enumerate(tree.candidate)}
    claimed: dict[int, set[int]] = {v: set() for v in cand}
    leaves = sorted(tree.leaves, key=lambda lf: lf.node_id)
    order = class_order({lf.role_class for lf in leaves}, priority)
    out: Summary = []
    while len(out) < j_max:
        unm: dict[int, int] = {
            lf.node_id: sum(len(cand[v] - claimed[v]) for v in path_nodes(parent, lf)) for lf in leaves
        }
        pick = None
        for cls in order:
            members = [lf for lf in leaves if lf.role_class == cls]
            total = sum(unm[lf.node_id] for lf in members)
            if total == 0:
                continue
            r = math.floor(Fraction(draw_word(seed, execution_id, len(out)), 2**64) * total)
            acc = 0
            for lf in members:
                acc += unm[lf.node_id]
                if acc > r:
                    pick = lf
                    break
            break
        if pick is None:
            break
        targets: dict[int, list[int]] = {}
        for v in path_nodes(parent, pick):
            fresh = cand[v] - claimed[v]
            if fresh:
                targets[v] = sorted(fresh)
            claimed[v] |= set(range(len(tree.candidate[v])))  # mask the whole path
        out.append((pick.node_id, targets))
    return out


# --------------------------------------------------------------------------- hand-built trees


def test_draw_word_recipe_is_pinned() -> None:
    assert draw_word("route-seed", "exec-1", 0) == 0xA70323EA2F5A73E1
    assert draw_word("route-seed", "exec-1", 1) == 0x2618C8529B800CF2
    assert draw_u("route-seed", "exec-1", 0) == 0xA70323EA2F5A73E1 / 2**64


def test_priority_forces_order_and_shared_prefix_counted_once() -> None:
    #  0 (cand 2,3) ─┬─ 1 main/task  (cand 0,1,2)
    #                └─ 2 sub/task   (cand 1)
    #  3 main/summary (cand 0..4)
    tree = make_tree(
        [-1, 0, 0, -1],
        [[0, 0, 1, 1], [1, 1, 1], [0, 1], [1, 1, 1, 1, 1]],
        {1: "main/task", 2: "sub/task", 3: "main/summary"},
    )
    draws = select_paths(tree, j_max=10, seed="s", execution_id="e")
    assert summary(draws) == [
        (1, {0: [2, 3], 1: [0, 1, 2]}),
        (3, {3: [0, 1, 2, 3, 4]}),
        (2, {2: [1]}),  # node 0 is already masked: its targets stay with draw 0
    ]
    assert [d.draw_index for d in draws] == [0, 1, 2]
    assert execution_targets(draws) == 11
    assert loss_weights(draws) == pytest.approx(1 / 11)
    assert summary(select_paths(tree, j_max=2, seed="s", execution_id="e")) == summary(draws)[:2]


def test_token_proportional_draws_with_pinned_variates() -> None:
    #  0 (cand 2 of 3) ─┬─ 1 (cand 4)   path 6
    #                   └─ 2 (cand 2)   path 4
    #  3 (cand 10)                      path 10
    tree = make_tree([-1, 0, 0, -1], [[1, 1, 0], [1, 1, 1, 1], [1, 1], [1] * 10])
    # u0 = 0.6524: floor(u0 * 20) = 13, cumulative [6, 10, 20] -> node 3.
    # u1 = 0.1488: counts now [6, 4, 0], floor(u1 * 10) = 1 -> node 1.
    # then only node 2 has unmasked targets.
    draws = select_paths(tree, j_max=10, seed="route-seed", execution_id="exec-1")
    assert summary(draws) == [
        (3, {3: list(range(10))}),
        (1, {0: [0, 1], 1: [0, 1, 2, 3]}),
        (2, {2: [0, 1]}),
    ]
    assert [m.tolist() for m in map(lambda d: path_target_mask(tree, d), draws)] == [
        [1] * 10,
        [1, 1, 0, 1, 1, 1, 1],
        [0, 0, 0, 1, 1],
    ]


def test_leaf_without_unmasked_targets_is_never_drawn() -> None:
    # Leaf 1's only candidates live in the shared node 0: once leaf 2 is drawn it has none.
    tree = make_tree([-1, 0, 0], [[1, 1], [0, 0], [1]])
    firsts = set()
    for i in range(40):
        got = summary(select_paths(tree, j_max=5, seed="x", execution_id=f"e{i}"))
        firsts.add(got[0][0])
        if got[0][0] == 2:
            assert got == [(2, {0: [0, 1], 2: [0]})]
        else:
            assert got == [(1, {0: [0, 1]}), (2, {2: [0]})]
    assert firsts == {1, 2}


def test_unknown_classes_come_after_priority_sorted() -> None:
    assert class_order({"zeta/x", "sub/task", "alpha/y", "main/task"}) == [
        "main/task", "sub/task", "alpha/y", "zeta/x"]
    tree = make_tree([-1, -1, -1], [[1], [1], [1]], {0: "zeta/x", 1: "alpha/y", 2: "sub/summary"})
    assert [d.leaf.node_id for d in select_paths(tree, j_max=3, seed="s", execution_id="e")] == [2, 1, 0]
    custom = select_paths(tree, j_max=3, priority=["zeta/x"], seed="s", execution_id="e")
    assert [d.leaf.node_id for d in custom] == [0, 1, 2]


def test_no_candidates_no_draws_and_zero_weight() -> None:
    tree = make_tree([-1, 0, 0], [[0, 0], [0], [0, 0, 0]])
    assert select_paths(tree, j_max=4, seed="s", execution_id="e") == []
    assert execution_targets([]) == 0 and loss_weights([]) == 0.0
    assert select_paths(make_tree([-1], [[1]]), j_max=0, seed="s", execution_id="e") == []


def test_invalid_trees_are_refused() -> None:
    tree = make_tree([-1, 0], [[1], [1]])
    interior = TreeView(tree.parent, tree.seg_len, tree.candidate, [Leaf(0, "r0", "main/task")])
    with pytest.raises(ValueError, match="children"):
        select_paths(interior, j_max=1, seed="s", execution_id="e")
    dup = TreeView(tree.parent, tree.seg_len, tree.candidate, [tree.leaves[0], tree.leaves[0]])
    with pytest.raises(ValueError, match="twice"):
        select_paths(dup, j_max=1, seed="s", execution_id="e")
    bad_parent = TreeView(np.array([-1, 1]), tree.seg_len, tree.candidate, tree.leaves)
    with pytest.raises(ValueError, match="parent"):
        select_paths(bad_parent, j_max=1, seed="s", execution_id="e")
    bad_len = TreeView(tree.parent, np.array([1, 2]), tree.candidate, tree.leaves)
    with pytest.raises(ValueError, match="candidate"):
        select_paths(bad_len, j_max=1, seed="s", execution_id="e")
    with pytest.raises(ValueError):
        select_paths(tree, j_max=-1, seed="s", execution_id="e")


def test_path_nodes_and_leaves_of() -> None:
    parent = np.array([-1, 0, 1, 0, -1, 4], dtype=np.int64)
    assert leaves_of(parent).tolist() == [2, 3, 5]
    assert path_nodes(parent, 2) == [0, 1, 2]
    assert path_nodes(parent, Leaf(5, "r", "main/task")) == [4, 5]


# --------------------------------------------------------------------------- properties

ALL_CLASSES = list(DEFAULT_PRIORITY) + ["other/x"]


@st.composite
def random_trees(draw: st.DrawFn) -> TreeView:
    n = draw(st.integers(1, 25))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    cands = [draw(st.lists(st.integers(0, 1), max_size=8)) for _ in range(n)]
    parent = np.array(parents, dtype=np.int64)
    leaves = [Leaf(int(v), f"req-{int(v)}", draw(st.sampled_from(ALL_CLASSES))) for v in leaves_of(parent)]
    leaves = draw(st.permutations(leaves))
    return TreeView(
        parent=parent,
        seg_len=np.array([len(c) for c in cands], dtype=np.int64),
        candidate=[np.array(c, dtype=np.uint8) for c in cands],
        leaves=list(leaves),
    )


def unmasked_per_leaf(tree: TreeView, masked: set[int]) -> dict[int, int]:
    return {
        lf.node_id: sum(int(tree.candidate[v].sum()) for v in path_nodes(tree.parent, lf) if v not in masked)
        for lf in tree.leaves
    }


PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(tree=random_trees(), j_max=st.integers(0, 12), seed=st.text(max_size=6), ex=st.text(max_size=6))
def test_matches_naive_reference(tree: TreeView, j_max: int, seed: str, ex: str) -> None:
    assert summary(select_paths(tree, j_max=j_max, seed=seed, execution_id=ex)) == reference_select(
        tree, j_max, DEFAULT_PRIORITY, seed, ex)


@PROPS
@given(tree=random_trees(), j_max=st.integers(0, 12), seed=st.text(max_size=6))
def test_invariants(tree: TreeView, j_max: int, seed: str) -> None:
    draws = select_paths(tree, j_max=j_max, seed=seed, execution_id="exec")
    assert len(draws) <= j_max  # cap
    seen: set[tuple[int, int]] = set()
    masked: set[int] = set()
    order = class_order({lf.role_class for lf in tree.leaves})
    for k, d in enumerate(draws):
        assert d.draw_index == k
        path = path_nodes(tree.parent, d.leaf)
        # priority: no leaf of a higher class still had unmasked targets
        unm = unmasked_per_leaf(tree, masked)
        rank = order.index(d.leaf.role_class)
        assert all(unm[lf.node_id] == 0 for lf in tree.leaves if order.index(lf.role_class) < rank)
        assert unm[d.leaf.node_id] > 0 and d.n_targets == unm[d.leaf.node_id]
        for node, pos in d.targets.items():
            assert node in path and node not in masked
            assert pos.size and np.all(tree.candidate[node][pos] == 1)  # only candidates
            for p in pos.tolist():
                assert (node, p) not in seen  # disjoint across draws
                seen.add((node, p))
        masked.update(path)
    assert execution_targets(draws) == len(seen)
    all_candidates = {(v, int(p)) for v, c in enumerate(tree.candidate) for p in np.flatnonzero(c)}
    if len(draws) < j_max:  # stopped because nothing unmasked remains
        assert seen == all_candidates  # every node lies on some leaf path
    else:
        assert seen <= all_candidates


@PROPS
@given(tree=random_trees(), seed=st.text(max_size=6), shuffle_seed=st.integers(0, 2**32))
def test_deterministic_and_leaf_order_free(tree: TreeView, seed: str, shuffle_seed: int) -> None:
    a = select_paths(tree, j_max=5, seed=seed, execution_id="e1")
    b = select_paths(tree, j_max=5, seed=seed, execution_id="e1")
    shuffled = list(tree.leaves)
    random.Random(shuffle_seed).shuffle(shuffled)
    c = select_paths(TreeView(tree.parent, tree.seg_len, tree.candidate, shuffled), j_max=5, seed=seed,
                     execution_id="e1")
    assert [d.as_key() for d in a] == [d.as_key() for d in b] == [d.as_key() for d in c]


# --------------------------------------------------------------------------- distribution


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution for integer ``df`` (closed forms)."""
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= (x / 2) / k
            total += term
        return math.exp(-x / 2) * total
    total = math.erfc(math.sqrt(x / 2))
    term = math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    for k in range(1, (df + 1) // 2):
        total += term
        term *= x / (2 * k + 1)
    return total


def test_chi2_sf_closed_form() -> None:
    assert chi2_sf(7.814727903251178, 3) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(9.487729036781154, 4) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)


def first_draw_counts(tree: TreeView, n: int) -> Counter[int]:
    return Counter(select_paths(tree, j_max=1, seed="chi2", execution_id=f"exec-{i}")[0].leaf.node_id
                   for i in range(n))


def chi2_pvalue(observed: Counter[int], probs: dict[int, float], n: int) -> float:
    stat = sum((observed[k] - n * p) ** 2 / (n * p) for k, p in probs.items())
    return chi2_sf(stat, len(probs) - 1)


def test_first_draw_is_token_proportional_disjoint_leaves() -> None:
    counts = [5, 10, 20, 65]
    # leaves also hold context tokens: only candidates weigh
    tree = make_tree([-1] * 4, [[1] * c + [0] * 7 for c in counts])
    n = 20_000
    observed = first_draw_counts(tree, n)
    assert set(observed) == {0, 1, 2, 3}
    assert chi2_pvalue(observed, {i: c / 100 for i, c in enumerate(counts)}, n) > 0.001


def test_first_draw_is_token_proportional_shared_prefix() -> None:
    # 0 (10 cand) ─┬─ 1 (10 cand): path 20
    #              └─ 2 (30 cand): path 40
    # 3 (50 cand):                 path 50
    tree = make_tree([-1, 0, 0, -1], [[1] * 10, [1] * 10, [1] * 30, [1] * 50])
    n = 11_000
    observed = first_draw_counts(tree, n)
    assert chi2_pvalue(observed, {1: 20 / 110, 2: 40 / 110, 3: 50 / 110}, n) > 0.001


# --------------------------------------------------------------------------- loss


def test_loss_reassigning_targets_among_paths_is_invariant() -> None:
    rng = np.random.default_rng(7)
    losses = rng.random(50)
    targets = rng.choice(50, size=20, replace=False)
    other = ExecutionTargets(rng.random(9), [np.arange(9) < 4])

    def split(k: int, seed: int) -> ExecutionTargets:
        labels = np.random.default_rng(seed).integers(0, k, size=targets.size)
        masks = []
        for j in range(k):
            m = np.zeros(50, dtype=bool)
            m[targets[labels == j]] = True
            masks.append(m)
        return ExecutionTargets(losses, masks)

    base = normalized_loss([split(1, 0), other])
    for k, s in [(2, 1), (3, 2), (7, 3), (20, 4)]:
        assert normalized_loss([split(k, s), other]) == pytest.approx(base, rel=1e-12)
    # changing which targets are admitted changes the loss
    fewer = np.zeros(50, dtype=bool)
    fewer[targets[1:]] = True
    assert normalized_loss([ExecutionTargets(losses, [fewer]), other]) != pytest.approx(base, rel=1e-9)


def test_loss_empty_execution_counts_but_contributes_zero() -> None:
    e = ExecutionTargets(np.array([1.0, 2.0, 3.0, 4.0]), [np.array([1, 0, 1, 0])])
    assert execution_loss(e) == (2.0, 2)
    dummy = ExecutionTargets(np.zeros(0))
    empty_paths = ExecutionTargets(np.array([5.0]), [np.array([0])])
    assert normalized_loss([e]) == 2.0
    assert normalized_loss([e, dummy]) == 1.0
    assert normalized_loss([e, dummy, empty_paths]) == pytest.approx(2 / 3)
    assert trainer_loss([PathRecord(e.token_losses, e.path_masks[0], 0.5)], n_executions=2) == 1.0
    with pytest.raises(ValueError, match="overlap"):
        execution_loss(ExecutionTargets(np.ones(3), [np.array([1, 1, 0]), np.array([0, 1, 0])]))


def path_records(tree: TreeView, draws: list[Draw], node_losses: list[np.ndarray]) -> list[PathRecord]:
    w = loss_weights(draws)
    return [PathRecord(np.concatenate([node_losses[v] for v in path_nodes(tree.parent, d.leaf)]),
                       path_target_mask(tree, d), w) for d in draws]


@settings(max_examples=100, deadline=None)
@given(tree=random_trees(), seeds=st.tuples(st.text(max_size=4), st.text(max_size=4)), j_max=st.integers(1, 6))
def test_trainer_records_match_reference_and_split_invariance(tree: TreeView, seeds: tuple[str, str],
                                                              j_max: int) -> None:
    rng = np.random.default_rng(len(tree.parent))
    node_losses = [rng.random(int(s)) for s in tree.seg_len]
    flat = np.concatenate(node_losses) if node_losses else np.zeros(0)
    dummy = ExecutionTargets(np.zeros(0))
    results = []
    for seed in seeds:
        for cap in (j_max, 10_000):
            draws = select_paths(tree, j_max=cap, seed=seed, execution_id="e")
            ref = normalized_loss([ExecutionTargets(flat, execution_masks(tree, draws)), dummy])
            got = trainer_loss(path_records(tree, draws, node_losses), n_executions=2)
            assert got == pytest.approx(ref, rel=1e-12, abs=1e-15)
            if cap == 10_000:
                results.append(ref)
    # Uncapped, every candidate is a target whatever the seed: different path splits of one
    # target set give the same loss.
    assert results[0] == pytest.approx(results[1], rel=1e-12, abs=1e-15)


def test_node_offsets() -> None:
    tree = make_tree([-1, 0, -1], [[1, 0], [1, 1, 1], [0]])
    assert node_offsets(tree).tolist() == [0, 2, 5]
