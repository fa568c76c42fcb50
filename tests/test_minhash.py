"""MinHash + banded LSH screening (SPEC §6.3, §8; seed 002 §15.4.3) against datasketch."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from datasketch import MinHash, MinHashLSH
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.minhash import (
    SCHEMES,
    LSHIndex,
    MinHasher,
    ShingleConfig,
    candidate_curve,
    candidate_probability,
    feature_shingles,
    format_candidate_curve,
    jaccard_estimate,
    lsh_candidate_indices,
    lsh_candidates,
    permutations,
    sha1_hashes,
    steepest_similarity,
    text_shingles,
    token_shingles,
)


def _datasketch_sig(shingles: list[bytes], num_perm: int, seed: int, scheme: str) -> np.ndarray:
    m = MinHash(num_perm=num_perm, seed=seed, scheme=scheme)
    m.update_batch(shingles)
    return m.hashvalues


def _corpus(n: int, seed: int = 3) -> dict[str, list[bytes]]:
    """Shingle sets with many near-duplicates (edits of earlier documents)."""
    rng = np.random.RandomState(seed)
    docs: list[list[int]] = []
    for _ in range(n):
        if docs and rng.random_sample() < 0.5:
            base = docs[rng.randint(len(docs))]
            keep = [w for w in base if rng.random_sample() > rng.uniform(0.0, 0.4)]
            docs.append(keep + list(rng.randint(0, 5000, rng.randint(0, 8))))
        else:
            docs.append(list(rng.randint(0, 5000, rng.randint(5, 60))))
    return {f"doc-{i:04d}": [f"w{w}".encode() for w in d] for i, d in enumerate(docs)}


# ----------------------------------------------------------------------------------------
# Signatures identical to datasketch
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("num_perm", "seed"), [(128, 1), (64, 42), (7, 0)])
def test_permutations_match_datasketch(scheme: str, num_perm: int, seed: int) -> None:
    a, b = permutations(num_perm, seed, scheme)
    ref = MinHash(num_perm=num_perm, seed=seed, scheme=scheme).permutations
    assert np.array_equal(a, ref[0]) and np.array_equal(b, ref[1])
    assert a.dtype == np.asarray(ref[0]).dtype


@pytest.mark.parametrize("scheme", SCHEMES)
def test_signature_matrix_identical_to_datasketch(scheme: str) -> None:
    corpus = _corpus(400)
    docs = list(corpus.values())
    docs[5] = []  # an empty set: datasketch's initial (all-max) state
    docs[6] = [b"only"]
    docs[7] = docs[8] = [f"big{i}".encode() for i in range(3000)]  # spans several chunks
    hasher = MinHasher(128, 1, scheme)
    mat = hasher.signature_matrix(docs)
    ref = np.stack([m.hashvalues for m in MinHash.bulk(docs, num_perm=128, seed=1, scheme=scheme)])
    assert mat.dtype == ref.dtype
    assert np.array_equal(mat, ref)
    assert np.array_equal(hasher.empty(), MinHash(num_perm=128, seed=1, scheme=scheme).hashvalues)


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.binary(max_size=12), max_size=30),
    seed=st.integers(0, 2**31 - 1),
    num_perm=st.integers(1, 40),
    scheme=st.sampled_from(SCHEMES),
)
def test_signature_identical_to_datasketch_property(items: list[bytes], seed: int, num_perm: int, scheme: str) -> None:
    ours = MinHasher(num_perm, seed, scheme).signature(items)
    assert np.array_equal(ours, _datasketch_sig(items, num_perm, seed, scheme))


def test_signature_of_set_ignores_order_and_duplicates() -> None:
    h = MinHasher(32, 5)
    assert np.array_equal(h.signature([b"a", b"b", b"a"]), h.signature({b"b", b"a"}))


def test_signatures_mapping_and_sha1_hashes() -> None:
    from datasketch.hashfunc import sha1_hash32, sha1_hash64

    items = [b"", b"x", "ünïcode".encode()]
    assert sha1_hashes(items, 32).tolist() == [sha1_hash32(x) for x in items]
    assert sha1_hashes(items, 64).tolist() == [sha1_hash64(x) for x in items]
    sigs = MinHasher(16, 1).signatures({"a": [b"1"], "b": [b"2", b"3"]})
    assert set(sigs) == {"a", "b"} and sigs["a"].shape == (16,)


def test_jaccard_estimate_is_unbiased_enough() -> None:
    a = {f"x{i}".encode() for i in range(0, 300)}
    b = {f"x{i}".encode() for i in range(100, 400)}
    true = len(a & b) / len(a | b)  # 0.5
    h = MinHasher(512, 9)
    est = jaccard_estimate(h.signature(a), h.signature(b))
    assert abs(est - true) < 4 * math.sqrt(true * (1 - true) / 512)


# ----------------------------------------------------------------------------------------
# LSH candidates identical to datasketch MinHashLSH
# ----------------------------------------------------------------------------------------


def _datasketch_pairs(corpus: dict[str, list[bytes]], num_perm: int, b: int, r: int, scheme: str) -> set[tuple[str, str]]:
    lsh = MinHashLSH(num_perm=num_perm, params=(b, r))
    mhs = {k: MinHash(num_perm=num_perm, seed=1, scheme=scheme) for k in corpus}
    for k, m in mhs.items():
        m.update_batch(corpus[k])
        lsh.insert(k, m)
    out: set[tuple[str, str]] = set()
    for k, m in mhs.items():
        for other in lsh.query(m):
            if other != k:
                out.add((min(k, other), max(k, other)))
    return out


@pytest.mark.parametrize(("b", "r", "scheme"), [(32, 4, "affine32"), (16, 8, "affine32"), (20, 5, "legacy"), (8, 2, "affine64"), (2, 10, "affine32")])
def test_lsh_candidates_identical_to_datasketch(b: int, r: int, scheme: str) -> None:
    corpus = _corpus(600)
    corpus["doc-dup-a"] = corpus["doc-dup-b"] = [b"same", b"set"]
    corpus["doc-empty-1"] = corpus["doc-empty-2"] = []
    sigs = MinHasher(128, 1, scheme).signatures(corpus)
    ours = lsh_candidates(sigs, b, r)
    ref = _datasketch_pairs(corpus, 128, b, r, scheme)
    assert ours == ref
    assert ("doc-dup-a", "doc-dup-b") in ours and ("doc-empty-1", "doc-empty-2") in ours
    assert len(ours) > 10  # the corpus really has near-duplicates

    # Incremental index: same pairs, each reported once when its second member arrives.
    index = LSHIndex(b, r)
    reported: list[tuple[str, str]] = []
    for k in sorted(sigs):
        reported.extend((min(k, o), max(k, o)) for o in index.insert(k, sigs[k]))
    assert len(reported) == len(set(reported)) and set(reported) == ref
    assert index.candidate_pairs() == ref
    assert len(index) == len(sigs) and "doc-0000" in index
    assert index.query(sigs["doc-dup-a"]) >= {"doc-dup-a", "doc-dup-b"}


@settings(max_examples=80, deadline=None)
@given(
    matrix=st.integers(1, 40).flatmap(
        lambda n: st.lists(st.lists(st.integers(0, 2), min_size=12, max_size=12), min_size=n, max_size=n)
    ),
    br=st.sampled_from([(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1), (5, 2)]),
)
def test_lsh_candidate_indices_match_brute_force(matrix: list[list[int]], br: tuple[int, int]) -> None:
    b, r = br
    m = np.array(matrix, dtype=np.uint32)
    got = {tuple(p) for p in lsh_candidate_indices(m, b, r).tolist()}
    want = {
        (i, j)
        for i, j in itertools.combinations(range(len(m)), 2)
        if any(np.array_equal(m[i, k * r : (k + 1) * r], m[j, k * r : (k + 1) * r]) for k in range(b))
    }
    assert got == want


def test_lsh_argument_checks() -> None:
    sig = MinHasher(16, 1).signature([b"a"])
    with pytest.raises(ValueError, match="exceeds"):
        lsh_candidates({"a": sig, "b": sig}, 5, 4)
    with pytest.raises(ValueError):
        LSHIndex(0, 4)
    assert lsh_candidates({"a": sig}, 4, 4) == set()
    index = LSHIndex(4, 4)
    index.insert("a", sig)
    with pytest.raises(ValueError, match="already"):
        index.insert("a", sig)


# ----------------------------------------------------------------------------------------
# Candidate probability curve
# ----------------------------------------------------------------------------------------


def test_candidate_probability_values() -> None:
    # Seed 002 §15.4.3: 32 bands x 4 rows retrieves s = 0.5 with probability 87.3 %,
    # and retrieval is virtually certain at s = 0.8.
    assert candidate_probability(0.5, 32, 4) == pytest.approx(1 - (1 - 0.5**4) ** 32, rel=1e-12)
    assert round(candidate_probability(0.5, 32, 4), 3) == 0.873
    assert candidate_probability(0.8, 32, 4) > 0.9999
    assert candidate_probability(0.0, 32, 4) == 0.0
    assert candidate_probability(1.0, 32, 4) == 1.0
    assert candidate_probability(0.9, 1, 1) == pytest.approx(0.9)
    assert candidate_probability(1e-4, 20, 1) == pytest.approx(1 - (1 - 1e-4) ** 20, rel=1e-9)
    arr = candidate_probability(np.array([0.0, 0.25, 0.5, 1.0]), 16, 8)
    assert isinstance(arr, np.ndarray) and np.all(np.diff(arr) >= 0)
    assert steepest_similarity(32, 4) == pytest.approx((1 / 32) ** 0.25)
    with pytest.raises(ValueError):
        candidate_probability(1.5, 4, 4)
    with pytest.raises(ValueError):
        candidate_probability(0.5, 0, 4)


def test_candidate_curve_and_text() -> None:
    curve = candidate_curve(32, 4, points=11)
    assert len(curve) == 11 and curve[0] == (0.0, 0.0) and curve[-1] == (1.0, 1.0)
    assert all(p2 >= p1 for (_, p1), (_, p2) in zip(curve, curve[1:]))
    text = format_candidate_curve(32, 4)
    assert "b=32" in text and "0.50     0.8732" in text


def test_empirical_candidate_rate_follows_curve() -> None:
    """Pairs of known Jaccard similarity become candidates at about the predicted rate."""
    b, r, trials = 16, 4, 400
    rng = np.random.RandomState(0)
    hits = 0
    h = MinHasher(b * r, 11)
    for t in range(trials):
        base = [f"t{t}-{i}".encode() for i in range(60)]
        other = base[:40] + [f"t{t}-x{i}".encode() for i in range(20)]  # J = 40/80 = 0.5
        rng.shuffle(other)
        hits += bool(lsh_candidate_indices(h.signature_matrix([base, other]), b, r).size)
    p = candidate_probability(0.5, b, r)
    assert abs(hits / trials - p) < 4 * math.sqrt(p * (1 - p) / trials) + 0.01


# ----------------------------------------------------------------------------------------
# Shingles
# ----------------------------------------------------------------------------------------


def test_text_shingles() -> None:
    assert text_shingles("The pool  LEAKS sockets", k=2) == {b"the pool", b"pool leaks", b"leaks sockets"}
    assert text_shingles("one two", k=3) == {b"one two"}
    assert text_shingles("  ", k=3) == set()
    assert text_shingles("abcd", k=3, kind="char") == {b"abc", b"bcd"}
    assert text_shingles("Ab", k=1, kind="char", lowercase=False) == {b"A", b"b"}
    with pytest.raises(ValueError):
        text_shingles("x", kind="line")  # type: ignore[arg-type]


def test_token_and_feature_shingles() -> None:
    assert token_shingles([1, 2, 3], k=2) != token_shingles(["1", "2", "3"], k=2)
    assert len(token_shingles([5, 6, 7, 8], k=3)) == 2
    cfg = ShingleConfig(k=2)
    feats = {"prompt": "fix the pool leak", "tools": ["bash", "edit", "bash"]}
    sh = feature_shingles(feats, cfg)
    assert b"prompt\x1efix the" in sh
    assert all(s.startswith((b"prompt\x1e", b"tools\x1e")) for s in sh)
    # Facets never match each other.
    assert not feature_shingles({"a": "x y"}, cfg) & feature_shingles({"b": "x y"}, cfg)
    assert feature_shingles(None) == set()
    assert feature_shingles(3.5) == {b"3.5"}
    with pytest.raises(ValueError):
        ShingleConfig(k=0)
    sigs = MinHasher(16, 1).feature_signatures({"t1": {"prompt": "a b c"}, "t2": None, "t3": ""}, cfg)
    assert set(sigs) == {"t1"}  # tasks without features are not screened


def test_benchmark_smoke() -> None:
    from benchmarks.bench_minhash import format_rows, run

    rows = run(n=300, repeats=1)
    checks = {r["name"]: r["ratio"] for r in rows if r["unit"] == "bool"}
    assert checks and all(v == 1.0 for v in checks.values())
    assert {"name", "value", "baseline", "ratio", "unit"} <= set(rows[0])
    assert "tasks/s" in format_rows(rows)
