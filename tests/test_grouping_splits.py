"""Task groups and split assignment (SPEC §6.3, seed 002 §15.4)."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.grouping import Merge, UnionFind, build_groups, group_members
from ledger.algorithms.split_hash import (
    PROTECTION,
    PROTECTION_ORDER,
    SPLITS,
    SplitPolicy,
    SplitPolicyError,
    SplitResolution,
    SplitState,
    assign_split,
    assign_splits,
    merge_split,
    most_protected,
    policy_forest,
    promote_reserve,
    promotion_key,
    resolve_splits,
    screen_candidates,
    split_draw,
    validate_fractions,
)

# ----------------------------------------------------------------------------------------
# Union-find
# ----------------------------------------------------------------------------------------


def test_union_find_group_id_is_smallest_member() -> None:
    uf = UnionFind(["c", "a", "b", "z"])
    assert uf.group_id("c") == "c"
    assert uf.union("c", "b") == Merge(parts=("b", "c"), group_id="b")
    assert uf.union("b", "c") is None
    assert uf.union("z", "c") == Merge(parts=("b", "z"), group_id="b")
    assert uf.group_id("z") == "b"
    assert uf.group_id("a") == "a"
    assert uf.connected("z", "c") and not uf.connected("a", "b")
    assert uf.size("z") == 3
    assert uf.group_count == 2
    assert uf.groups() == {"a": ["a"], "b": ["b", "c", "z"]}
    assert "q" not in uf and len(uf) == 4
    uf.union("q", "r")  # unknown nodes are added
    assert uf.group_id("r") == "q"


def test_union_find_path_compression_long_chain() -> None:
    n = 20_000
    uf = UnionFind()
    for i in range(n - 1):
        uf.union(f"t{i + 1:05d}", f"t{i:05d}")
    assert uf.group_count == 1
    assert uf.group_id("t19999") == "t00000"
    root = uf.find("t19999")
    assert uf._parent["t19999"] == root  # compressed


def test_build_groups_includes_edge_endpoints_and_is_deterministic() -> None:
    mapping = build_groups(["b", "d"], [("b", "a"), ("d", "e")])
    assert mapping == {"a": "a", "b": "a", "d": "d", "e": "d"}
    assert group_members(mapping) == {"a": ["a", "b"], "d": ["d", "e"]}


@settings(max_examples=150, deadline=None)
@given(
    tasks=st.lists(st.sampled_from([f"t{i}" for i in range(15)]), max_size=15),
    edges=st.lists(st.tuples(st.sampled_from([f"t{i}" for i in range(15)]), st.sampled_from([f"t{i}" for i in range(15)])), max_size=20),
    seed=st.integers(0, 2**32 - 1),
)
def test_build_groups_order_independent(tasks: list[str], edges: list[tuple[str, str]], seed: int) -> None:
    ref = build_groups(tasks, edges)
    rnd = random.Random(seed)
    t2, e2 = list(tasks), [(b, a) if rnd.random() < 0.5 else (a, b) for a, b in edges]
    rnd.shuffle(t2)
    rnd.shuffle(e2)
    assert build_groups(t2, e2) == ref
    # Group id is the minimum member, and components agree with a naive closure.
    for gid, members in group_members(ref).items():
        assert gid == min(members)
    nodes = set(tasks) | {x for e in edges for x in e}
    adj: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in edges:
        adj[a].add(b)
        adj[b].add(a)
    for n in nodes:
        seen, todo = {n}, [n]
        while todo:
            for m in adj[todo.pop()]:
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        assert ref[n] == min(seen)


# ----------------------------------------------------------------------------------------
# Fractions and the keyed hash
# ----------------------------------------------------------------------------------------


def test_validate_fractions_accepts_zero_and_float_noise() -> None:
    assert validate_fractions({"train": 0.7, "dev": 0.2, "final_test": 0.1}) == {
        "train": 0.7,
        "dev": 0.2,
        "final_test": 0.1,
        "reserve": 0.0,
    }
    validate_fractions({"train": 0.1, "dev": 0.2, "final_test": 0.7, "reserve": 0})
    validate_fractions({"train": 1, "dev": 0, "final_test": 0})
    validate_fractions({"train": 0.5 + 5e-10, "dev": 0.25, "final_test": 0.25})


@pytest.mark.parametrize(
    ("fractions", "message"),
    [
        ({"train": 0.8, "dev": 0.1, "test": 0.1}, "unknown split name"),
        ({"train": 0.9, "dev": 0.1}, "missing fraction(s) for final_test"),
        ({"train": 1.1, "dev": -0.1, "final_test": 0.0}, "fraction for dev must be >= 0"),
        ({"train": float("nan"), "dev": 0.5, "final_test": 0.5}, "must be finite"),
        ({"train": True, "dev": 0.0, "final_test": 0.0}, "must be a number"),
        ({"train": "0.8", "dev": 0.1, "final_test": 0.1}, "must be a number"),
        ({"train": 0.8, "dev": 0.1, "final_test": 0.05}, "must sum to 1"),
        ({"train": 0.5 + 2e-9, "dev": 0.25, "final_test": 0.25}, "must sum to 1"),
        ([0.8, 0.1, 0.1], "must be a mapping"),
    ],
)
def test_validate_fractions_errors(fractions: object, message: str) -> None:
    with pytest.raises(SplitPolicyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_fractions(fractions)  # type: ignore[arg-type]


def test_assign_split_matches_reference_formula() -> None:
    fractions = {"train": 0.5, "dev": 0.2, "final_test": 0.2, "reserve": 0.1}
    for i in range(2000):
        gid = f"group-{i}"
        digest = hmac.new(b"salt-1", gid.encode(), hashlib.sha256).digest()
        u = int.from_bytes(digest[:8], "big") / 2**64
        expected = "train" if u < 0.5 else "dev" if u < 0.7 else "final_test" if u < 0.9 else "reserve"
        assert split_draw(gid, "salt-1") == int.from_bytes(digest[:8], "big")
        assert assign_split(gid, fractions, "salt-1") == expected


def test_assign_split_zero_fractions_never_chosen_and_salt_matters() -> None:
    ids = [f"g{i}" for i in range(3000)]
    only_test = assign_splits(ids, {"train": 0, "dev": 0, "final_test": 1}, "s")
    assert set(only_test.values()) == {"final_test"}
    no_dev = assign_splits(ids, {"train": 0.5, "dev": 0.0, "final_test": 0.0, "reserve": 0.5}, "s")
    assert set(no_dev.values()) == {"train", "reserve"}
    a = assign_splits(ids, {"train": 0.5, "dev": 0.25, "final_test": 0.25}, "s1")
    b = assign_splits(ids, {"train": 0.5, "dev": 0.25, "final_test": 0.25}, "s2")
    assert a != b
    assert a == assign_splits(reversed(ids), {"train": 0.5, "dev": 0.25, "final_test": 0.25}, "s1")


def test_split_fractions_respected_statistically() -> None:
    fractions = {"train": 0.6, "dev": 0.1, "final_test": 0.2, "reserve": 0.1}
    ids = [f"task-{i:05d}" for i in range(10_000)]
    counts = Counter(assign_splits(ids, fractions, "stat-salt").values())
    for name in SPLITS:
        assert abs(counts[name] / 10_000 - fractions[name]) < 0.02, (name, counts)
    # Through the full resolution (singleton groups: one key each) the same holds.
    res = resolve_splits({t: () for t in ids}, [], [SplitPolicy("p", fractions, "stat-salt")], [])
    assert res.assignment() == assign_splits(ids, fractions, "stat-salt")


def test_protection_order() -> None:
    assert PROTECTION_ORDER == ("final_test", "reserve", "dev", "train")
    assert [PROTECTION[s] for s in PROTECTION_ORDER] == [3, 2, 1, 0]
    assert most_protected(["train", "dev"]) == "dev"
    assert most_protected(["dev", "reserve", "train"]) == "reserve"
    assert merge_split(["reserve", "final_test", "train"]) == "final_test"
    with pytest.raises(ValueError):
        most_protected([])
    with pytest.raises(ValueError):
        most_protected(["train", "test"])


def test_promote_reserve_is_rendezvous_choice() -> None:
    cands = [f"r{i}" for i in range(50)]
    chosen = promote_reserve(cands, "salt", "g-final")
    assert chosen == min(cands, key=lambda c: promotion_key("salt", "g-final", c))
    assert promote_reserve(reversed(cands), "salt", "g-final") == chosen
    # Removing other candidates never changes the choice.
    assert promote_reserve([c for c in cands if c == chosen or c < "r2"], "salt", "g-final") == chosen
    assert promote_reserve([], "salt", "g") is None


# ----------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------
F1 = {"train": 0.4, "dev": 0.2, "final_test": 0.2, "reserve": 0.2}
F2 = {"train": 0.3, "dev": 0.2, "final_test": 0.3, "reserve": 0.2}
F3 = {"train": 0.5, "dev": 0.25, "final_test": 0.25}
F4 = {"train": 0.3, "dev": 0.1, "final_test": 0.15, "reserve": 0.45}

POLICY_POOL = [
    SplitPolicy("p0", F4, "salt-a"),
    SplitPolicy("p1", F2, "salt-a", supersedes="p0"),
    SplitPolicy("p1b", F3, "salt-b", supersedes="p0"),  # competing successor
    SplitPolicy("p2", F1, "salt-c", supersedes="p1"),
    SplitPolicy("px", F3, "salt-x", supersedes="missing"),  # dangling: pending
    SplitPolicy("cy1", F3, "salt-y", supersedes="cy2"),  # cycle: pending
    SplitPolicy("cy2", F3, "salt-y", supersedes="cy1"),
]


def test_policy_forest() -> None:
    forest = policy_forest(reversed(POLICY_POOL))
    assert forest.chain == ("p0", "p1", "p2")
    assert forest.head is not None and forest.head.policy_id == "p2"
    assert {p.policy_id for p in forest.in_force} == {"p0", "p1", "p1b", "p2"}
    assert forest.conflicts == ("p1b",)
    assert forest.pending == ("cy1", "cy2", "px")
    assert policy_forest(POLICY_POOL) == forest
    assert policy_forest([]).head is None
    # The dangling policy comes into force when its parent arrives.
    late = policy_forest([*POLICY_POOL, SplitPolicy("missing", F1, "s", supersedes="p2")])
    assert late.chain == ("p0", "p1", "p2", "missing", "px")


def test_policy_rejects_bad_fractions() -> None:
    with pytest.raises(SplitPolicyError):
        SplitPolicy("p", {"train": 0.5, "dev": 0.5, "final_test": 0.5}, "s")
    p = SplitPolicy("p", {"train": 0.5, "dev": 0.5, "final_test": 0}, "s")
    assert p.fractions["reserve"] == 0.0
    assert hash(p) == hash(SplitPolicy("p", {"train": 0.5, "dev": 0.5, "final_test": 0, "reserve": 0}, "s"))


# ----------------------------------------------------------------------------------------
# Resolution rules
# ----------------------------------------------------------------------------------------


def test_keys_are_ids_a_group_could_have_carried() -> None:
    res = resolve_splits(
        {"a": (), "b": ("a",), "c": (), "d": (), "e": ("z",)},
        [("d", "c")],
        [SplitPolicy("p", F1, "s")],
        [],
    )
    assert res.group_of == {"a": "a", "b": "a", "c": "c", "d": "c", "e": "e", "z": "e"}
    # b derived from a (a < b): never a group of its own.  c, d registered separately.
    # e registered with parent z: the atom {e, z} has min e; z alone never existed.
    assert res.keys == {"a": ("a",), "c": ("c", "d"), "e": ("e",)}
    assert res.base_split["c"] == most_protected([assign_split("c", F1, "s"), assign_split("d", F1, "s")])


def test_no_policy_no_split() -> None:
    res = resolve_splits({"a": ()}, [], [POLICY_POOL[4]], ["a"])
    assert res.split_of("a") is None and res.split_of_group == {}
    assert res.ignored_reclassifications == ("a",)


def _find_group(split: str, fractions: dict[str, float], salt: str, prefix: str, start: int = 0) -> str:
    for i in itertools.count(start):
        gid = f"{prefix}{i:04d}"
        if assign_split(gid, fractions, salt) == split:
            return gid
    raise AssertionError  # pragma: no cover


def test_merge_takes_most_protected_split() -> None:
    fr = {"train": 0.5, "dev": 0.2, "final_test": 0.3}
    t_train = _find_group("train", fr, "s", "a")
    t_test = _find_group("final_test", fr, "s", "b")
    pol = [SplitPolicy("p", fr, "s")]
    before = resolve_splits({t_train: (), t_test: ()}, [], pol, [])
    assert before.split_of(t_train) == "train"
    after = resolve_splits({t_train: (), t_test: ()}, [(t_train, t_test)], pol, [])
    assert after.split_of(t_train) == after.split_of(t_test) == "final_test"
    assert after.group_of[t_test] == t_train  # id: the smallest member


def test_reclassification_moves_to_dev_for_good_and_promotes_reserve() -> None:
    fr = {"train": 0.4, "dev": 0.1, "final_test": 0.3, "reserve": 0.2}
    pol = [SplitPolicy("p", fr, "s")]
    inspected = _find_group("final_test", fr, "s", "t")
    others = [f"u{i:03d}" for i in range(40)]
    regs = {inspected: (), **{o: () for o in others}}
    base = resolve_splits(regs, [], pol, [])
    reserve = sorted(g for g, s in base.split_of_group.items() if s == "reserve")
    assert reserve
    res = resolve_splits(regs, [], pol, [inspected])
    assert res.split_of(inspected) == "dev"
    assert res.reclassified == (inspected,)
    promoted = res.promotions[inspected]
    assert promoted == promote_reserve(reserve, "s", inspected)
    assert res.split_of(promoted) == "final_test"
    # For good: linking the inspected task to another final-test group keeps it in dev.
    other_test = next(o for o in others if base.split_of(o) == "final_test" and o != promoted)
    merged = resolve_splits(regs, [(inspected, other_test)], pol, [inspected])
    assert merged.split_of(other_test) == merged.split_of(inspected) == "dev"
    # A reclassification of a train group changes nothing.
    train_task = next(o for o in others if base.split_of(o) == "train")
    assert resolve_splits(regs, [], pol, [train_task]).ignored_reclassifications == (train_task,)


def test_reclassification_without_reserve_left() -> None:
    fr = {"train": 0.5, "dev": 0.2, "final_test": 0.3}
    pol = [SplitPolicy("p", fr, "s")]
    t = _find_group("final_test", fr, "s", "t")
    res = resolve_splits({t: ()}, [], pol, [t])
    assert res.split_of(t) == "dev" and res.promotions == {} and res.unpromoted == (t,)


def test_multi_key_groups_skew_towards_protection() -> None:
    """A group with k independently registered tasks gets train with probability f**k."""
    fr = {"train": 0.8, "dev": 0.1, "final_test": 0.1}
    pol = [SplitPolicy("p", fr, "skew")]
    regs: dict[str, tuple[str, ...]] = {}
    links = []
    lineage: dict[str, tuple[str, ...]] = {}
    for g in range(4000):
        a, b = f"g{g:05d}a", f"g{g:05d}b"
        regs[a] = ()
        regs[b] = ()
        links.append((a, b))
        lineage[a] = ()
        lineage[b] = (a,)  # b derived from a, registered with its lineage: no extra key
    linked = resolve_splits(regs, links, pol, [])
    derived = resolve_splits(lineage, [], pol, [])
    p_linked = Counter(linked.split_of_group.values())["train"] / 4000
    p_derived = Counter(derived.split_of_group.values())["train"] / 4000
    assert abs(p_linked - 0.8**2) < 0.03
    assert abs(p_derived - 0.8) < 0.03


# ----------------------------------------------------------------------------------------
# Order independence, consistency, monotonicity, stability (property tests)
# ----------------------------------------------------------------------------------------
TASKS = [f"t{i:02d}" for i in range(12)]
task_st = st.sampled_from(TASKS)


@st.composite
def events_st(draw: st.DrawFn) -> list[tuple]:
    """A shuffled mix of registrations, links, rejections, reclassifications and policies."""
    regs = draw(st.lists(st.tuples(st.just("register"), task_st, st.lists(task_st, max_size=2).map(tuple)), max_size=12))
    links = draw(st.lists(st.tuples(st.just("link"), task_st, task_st), max_size=6))
    rejects = draw(st.lists(st.tuples(st.just("reject"), task_st, task_st), max_size=3))
    recl = draw(st.lists(st.tuples(st.just("reclassify"), task_st), max_size=4))
    # Half the time only the reserve-heavy root policy, so reserve groups and promotions
    # are common; otherwise any subset of the pool (chains, forks, pending policies).
    pols = draw(st.one_of(st.just([POLICY_POOL[0]]), st.lists(st.sampled_from(POLICY_POOL), max_size=5, unique=True)))
    events = regs + links + rejects + recl + [("policy", p) for p in pols]
    return draw(st.permutations(events))


def _apply(state: SplitState, event: tuple) -> None:
    kind = event[0]
    if kind == "register":
        state.register(event[1], event[2])
    elif kind == "link":
        state.link(event[1], event[2])
    elif kind == "reject":
        state.reject(event[1], event[2])
    elif kind == "reclassify":
        state.reclassify(event[1])
    else:
        state.declare_policy(event[1])


def _replay(events: list[tuple]) -> SplitResolution:
    state = SplitState()
    for e in events:
        _apply(state, e)
    return state.resolve()


def _check_consistent(res: SplitResolution, events: list[tuple]) -> None:
    """No group spans two splits: every lineage/link edge joins tasks of one split."""
    for t, g in res.group_of.items():
        assert res.split_of(t) == res.split_of_group.get(g)
    for e in events:
        if e[0] == "link":
            assert res.split_of(e[1]) == res.split_of(e[2])
        elif e[0] == "register":
            for parent in e[2]:
                assert res.split_of(e[1]) == res.split_of(parent)
    if res.split_of_group:
        assert set(res.split_of_group) == set(res.group_of.values())
    counts = Counter(res.split_of_group.values())
    assert counts["final_test"] >= 0  # splits are plain labels
    assert set(res.split_of_group.values()) <= set(SPLITS)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events_st(), data=st.data())
def test_final_assignment_is_order_independent(events: list[tuple], data: st.DataObject) -> None:
    ref = _replay(events)
    perm = data.draw(st.permutations(events))
    assert _replay(perm) == ref
    assert _replay(list(reversed(events))) == ref
    _check_consistent(ref, events)
    # The batch function over final sets agrees with the incremental state.
    direct = resolve_splits(
        [(e[1], e[2]) for e in events if e[0] == "register"],
        [(e[1], e[2]) for e in events if e[0] == "link"],
        [e[1] for e in events if e[0] == "policy"],
        [e[1] for e in events if e[0] == "reclassify"],
    )
    assert direct == ref


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events_st())
def test_no_group_moves_to_a_less_protected_split_than_it_held(events: list[tuple]) -> None:
    """Replay in the given order; every intermediate split is <= the final one, except
    reclassification (final_test/reserve -> dev) and a promotion moving to another group
    (final_test -> reserve, never below reserve)."""
    final = _replay(events)
    state = SplitState()
    for e in events:
        _apply(state, e)
        now = state.resolve()
        promoted_now = set(now.promotions.values())
        for t, g_now in now.group_of.items():
            g_final = final.group_of[t]
            if g_now in now.base_split:
                assert PROTECTION[final.base_split[g_final]] >= PROTECTION[now.base_split[g_now]]
            s_now, s_final = now.split_of(t), final.split_of(t)
            if s_now is None:
                continue
            assert s_final is not None
            if PROTECTION[s_final] >= PROTECTION[s_now]:
                continue
            if g_final in final.reclassified:
                assert s_final == "dev" and s_now in ("final_test", "reserve", "dev")
                continue
            assert s_now == "final_test" and s_final == "reserve" and g_now in promoted_now


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=events_st(),
    new=st.lists(
        st.tuples(st.sampled_from([f"u{i:02d}" for i in range(10)]), st.lists(st.sampled_from([f"u{i:02d}" for i in range(10)]), max_size=1)),
        max_size=15,
    ),
    new_links=st.lists(st.tuples(st.sampled_from([f"u{i:02d}" for i in range(10)]), st.sampled_from([f"u{i:02d}" for i in range(10)])), max_size=5),
)
def test_adding_unrelated_tasks_never_moves_an_existing_group(
    events: list[tuple], new: list[tuple[str, list[str]]], new_links: list[tuple[str, str]]
) -> None:
    before = _replay(events)
    extra = [("register", t, tuple(p)) for t, p in new] + [("link", a, b) for a, b in new_links]
    after = _replay(events + extra)
    promoted = set(before.promotions.values()) | set(after.promotions.values())
    for t, g in before.group_of.items():
        assert after.group_of[t] == g
        if g in before.base_split:
            assert after.base_split[g] == before.base_split[g]
        if before.split_of(t) != after.split_of(t):
            # Only a promotion can move: a new reserve group won a rendezvous.
            assert g in promoted
            assert {before.split_of(t), after.split_of(t)} == {"reserve", "final_test"}


def test_adding_unrelated_tasks_without_reserve_moves_nothing() -> None:
    fr = {"train": 0.6, "dev": 0.2, "final_test": 0.2}
    pol = SplitPolicy("p", fr, "s")
    rnd = random.Random(7)
    regs = {f"t{i:04d}": () for i in range(500)}
    links = [(f"t{rnd.randrange(500):04d}", f"t{rnd.randrange(500):04d}") for _ in range(200)]
    recl = [f"t{i:04d}" for i in range(0, 500, 25)]
    before = resolve_splits(regs, links, [pol], recl)
    more = {**regs, **{f"u{i:04d}": () for i in range(2000)}}
    after = resolve_splits(more, links + [("u0001", "u0002")], [pol], recl)
    assert {t: after.split_of(t) for t in regs} == {t: before.split_of(t) for t in regs}


def test_superseding_policy_with_same_salt_and_smaller_train_yields_its_fractions() -> None:
    """With one salt, moving train share to protected splits keeps everyone else in place."""
    p1 = SplitPolicy("p1", {"train": 0.8, "dev": 0.1, "final_test": 0.1}, "s")
    p2 = SplitPolicy("p2", {"train": 0.7, "dev": 0.1, "final_test": 0.2}, "s", supersedes="p1")
    ids = {f"g{i:05d}": () for i in range(5000)}
    res = resolve_splits(ids, [], [p1, p2], [])
    old = resolve_splits(ids, [], [p1], [])
    for g, s in res.split_of_group.items():
        assert PROTECTION[s] >= PROTECTION[old.split_of_group[g]]
    counts = Counter(res.split_of_group.values())
    assert abs(counts["train"] / 5000 - 0.7) < 0.02


# ----------------------------------------------------------------------------------------
# The seed's warning (002 §15.4): random trace-level splits leak
# ----------------------------------------------------------------------------------------


def test_random_trace_split_straddles_83_percent_vs_zero_for_group_split() -> None:
    n_tasks, attempts, train = 1000, 8, 0.8
    expected = 1 - train**attempts - (1 - train) ** attempts
    assert math.isclose(expected, 0.83222528, abs_tol=1e-8)  # "83.2 percent"

    rng = np.random.RandomState(15_4)
    in_train = rng.random_sample((n_tasks, attempts)) < train  # random 80/20 over traces
    straddle = np.mean(in_train.any(axis=1) & ~in_train.all(axis=1))
    assert abs(straddle - expected) < 0.04

    # Group-level: every attempt (execution) inherits its task group's split.
    pol = SplitPolicy("p", {"train": 0.8, "dev": 0.0, "final_test": 0.2}, "seed-002")
    tasks = {f"pool_repair_{i:04d}": () for i in range(n_tasks)}
    res = resolve_splits(tasks, [], [pol], [])
    per_task = {t: {res.split_of(t) for _attempt in range(attempts)} for t in tasks}
    assert sum(len(s) > 1 for s in per_task.values()) == 0
    share_train = Counter(res.split_of_group.values())["train"] / n_tasks
    assert abs(share_train - 0.8) < 0.04


def test_promotion_is_the_only_thing_an_unrelated_task_can_move() -> None:
    """Documented exception: a new reserve group can win the rendezvous; the group it
    displaces goes back from final_test to reserve (still held out, never below)."""
    fr = {"train": 0.4, "dev": 0.1, "final_test": 0.2, "reserve": 0.3}
    pol = [SplitPolicy("p", fr, "s")]
    inspected = _find_group("final_test", fr, "s", "t")
    regs: dict[str, tuple[str, ...]] = {inspected: (), **{f"r{i:03d}": () for i in range(10)}}
    before = resolve_splits(regs, [], pol, [inspected])
    promoted = before.promotions[inspected]
    best = promotion_key("s", inspected, promoted)
    for i in itertools.count():
        new = f"u{i:05d}"
        if assign_split(new, fr, "s") == "reserve" and promotion_key("s", inspected, new) < best:
            break
    after = resolve_splits({**regs, new: ()}, [], pol, [inspected])
    assert after.promotions[inspected] == new
    assert (before.split_of(promoted), after.split_of(promoted)) == ("final_test", "reserve")
    assert {t: after.split_of(t) for t in regs if t != promoted} == {t: before.split_of(t) for t in regs if t != promoted}


def test_screen_candidates_review_and_quarantine() -> None:
    fr = {"train": 0.5, "dev": 0.2, "final_test": 0.3}
    tr = _find_group("train", fr, "s", "a")
    tr2 = _find_group("train", fr, "s", "b")
    dv = _find_group("dev", fr, "s", "c")
    ft = _find_group("final_test", fr, "s", "d")
    state = SplitState()
    state.declare_policy(SplitPolicy("p", fr, "s"))
    for t in (tr, tr2, dv, ft):
        state.register(t)
    state.register("e-child", (ft,))
    state.reject(dv, tr2)
    out = state.screen([(ft, tr), (tr2, tr), (dv, tr2), ("e-child", ft), (tr, "unknown")])
    assert out.review == tuple(sorted([(min(ft, tr), max(ft, tr)), (min(tr, tr2), max(tr, tr2))]))
    assert out.quarantined == (tr,)  # the non-test side of the straddling pair
    assert screen_candidates([(tr, dv)], state.resolve()).quarantined == (tr,)
    # Once reviewed (linked), the pair is never proposed again and the groups merge.
    state.link(ft, tr)
    assert state.screen([(ft, tr)]).review == ()
    assert state.resolve().split_of(tr) == "final_test"
