"""Tests for ledger.algorithms.merkle: shared RFC 6962/9162 vectors, RFC definitions, properties."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.merkle import (
    EMPTY_ROOT,
    CompactRange,
    MerkleLevels,
    ProofError,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    leaf_hashes,
    node_hash,
    root,
    root_from_consistency_proof,
    root_from_inclusion_proof,
    root_from_leaf_hashes,
    verify_consistency,
    verify_inclusion,
)

VECTOR_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "testdata" / "merkle"
INCLUSION_FILES = sorted((VECTOR_DIR / "inclusion").rglob("*.json"))
CONSISTENCY_FILES = sorted((VECTOR_DIR / "consistency").rglob("*.json"))

# The tree behind the vectors (VECTOR_DIR/README.md).
VECTOR_LEAVES = [
    bytes.fromhex(h)
    for h in [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
VECTOR_ROOT = "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"


def _vector_id(path: Path) -> str:
    return str(path.relative_to(VECTOR_DIR))


def _b64(value: str | None) -> bytes:
    return base64.b64decode(value) if value else b""


def _load(path: Path) -> dict[str, Any]:
    vector: dict[str, Any] = json.loads(path.read_text())
    vector["proof"] = [_b64(h) for h in vector["proof"] or []]
    return vector


# ------------------------------------------------------------ RFC 9162 reference model


def _split(n: int) -> int:
    """Largest power of two strictly below n (n > 1)."""
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(data: list[bytes]) -> bytes:
    """MTH, recursively, exactly as RFC 9162 §2.1.1 states it."""
    if not data:
        return EMPTY_ROOT
    if len(data) == 1:
        return leaf_hash(data[0])
    k = _split(len(data))
    return node_hash(ref_mth(data[:k]), ref_mth(data[k:]))


def ref_path(m: int, data: list[bytes]) -> list[bytes]:
    """PATH(m, D[n]) of RFC 9162 §2.1.3.1."""
    if len(data) == 1:
        return []
    k = _split(len(data))
    if m < k:
        return [*ref_path(m, data[:k]), ref_mth(data[k:])]
    return [*ref_path(m - k, data[k:]), ref_mth(data[:k])]


def ref_subproof(m: int, data: list[bytes], whole: bool) -> list[bytes]:
    """SUBPROOF(m, D[n], b) of RFC 9162 §2.1.4.1."""
    if m == len(data):
        return [] if whole else [ref_mth(data)]
    k = _split(len(data))
    if m <= k:
        return [*ref_subproof(m, data[:k], whole), ref_mth(data[k:])]
    return [*ref_subproof(m - k, data[k:], False), ref_mth(data[:k])]


def _flip(value: bytes, bit: int) -> bytes:
    bit %= len(value) * 8
    flipped = bytearray(value)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


leaf_lists = st.lists(st.binary(max_size=40), max_size=80)
sized_leaves = st.lists(st.binary(max_size=8), min_size=1, max_size=150)


# --------------------------------------------------------------------- shared vectors


def test_vector_directory_is_complete() -> None:
    every_file = sorted(VECTOR_DIR.rglob("*.json"))
    assert len(INCLUSION_FILES) > 50 and len(CONSISTENCY_FILES) > 50
    assert every_file == sorted(INCLUSION_FILES + CONSISTENCY_FILES)


def test_vector_tree_root() -> None:
    assert root(VECTOR_LEAVES).hex() == VECTOR_ROOT
    assert ref_mth(VECTOR_LEAVES).hex() == VECTOR_ROOT


@pytest.mark.parametrize("path", INCLUSION_FILES, ids=_vector_id)
def test_inclusion_vector(path: Path) -> None:
    v = _load(path)
    args = (_b64(v["leafHash"]), v["leafIdx"], v["treeSize"], v["proof"], _b64(v["root"]))
    if v["wantErr"]:
        with pytest.raises(ProofError):
            verify_inclusion(*args)
    else:
        verify_inclusion(*args)


@pytest.mark.parametrize("path", CONSISTENCY_FILES, ids=_vector_id)
def test_consistency_vector(path: Path) -> None:
    v = _load(path)
    args = (v["size1"], v["size2"], v["proof"], _b64(v["root1"]), _b64(v["root2"]))
    if v["wantErr"]:
        with pytest.raises(ProofError):
            verify_consistency(*args)
    else:
        verify_consistency(*args)


def _happy_paths_over_vector_tree(files: list[Path], size_key: str) -> list[Path]:
    levels = MerkleLevels.from_leaves(VECTOR_LEAVES)
    chosen = []
    for path in files:
        v = json.loads(path.read_text())
        root_key = "root" if size_key == "treeSize" else "root2"
        size = v[size_key]
        if not v["wantErr"] and size <= 8 and _b64(v[root_key]) == levels.root(size):
            chosen.append(path)
    return chosen


@pytest.mark.parametrize(
    "path", _happy_paths_over_vector_tree(INCLUSION_FILES, "treeSize"), ids=_vector_id
)
def test_generated_inclusion_proof_equals_vector(path: Path) -> None:
    v = _load(path)
    levels = MerkleLevels.from_leaves(VECTOR_LEAVES)
    assert levels.inclusion_proof(v["leafIdx"], v["treeSize"]) == v["proof"]


@pytest.mark.parametrize(
    "path", _happy_paths_over_vector_tree(CONSISTENCY_FILES, "size2"), ids=_vector_id
)
def test_generated_consistency_proof_equals_vector(path: Path) -> None:
    v = _load(path)
    levels = MerkleLevels.from_leaves(VECTOR_LEAVES)
    assert levels.consistency_proof(v["size1"], v["size2"]) == v["proof"]


# ------------------------------------------------------------------------------ roots


def test_empty_and_single_leaf_trees() -> None:
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert root([]) == root_from_leaf_hashes([]) == MerkleLevels([]).root() == EMPTY_ROOT
    assert CompactRange().root() == EMPTY_ROOT
    assert root([b"x"]) == leaf_hash(b"x") == MerkleLevels([leaf_hash(b"x")]).root()


@given(leaf_lists)
def test_iterative_root_equals_recursive_definition(data: list[bytes]) -> None:
    expected = ref_mth(data)
    assert root(data) == expected
    assert root_from_leaf_hashes(leaf_hashes(data)) == expected


@given(leaf_lists)
def test_levels_root_every_prefix(data: list[bytes]) -> None:
    levels = MerkleLevels.from_leaves(data)
    assert levels.size == len(levels) == len(data)
    for size in range(len(data) + 1):
        assert levels.root(size) == ref_mth(data[:size])


@given(leaf_lists)
def test_compact_range_equals_root_for_every_prefix(data: list[bytes]) -> None:
    frontier = CompactRange()
    assert frontier.size == 0
    for size, value in enumerate(leaf_hashes(data), start=1):
        frontier.append(value)
        assert frontier.size == size
        assert len(frontier.hashes) == size.bit_count()
        assert frontier.root() == root(data[:size])
        restored = CompactRange.from_bytes(size, frontier.to_bytes())
        assert restored == frontier and restored.root() == frontier.root()
    bulk = CompactRange()
    bulk.extend(leaf_hashes(data))
    assert bulk == frontier


@given(leaf_lists)
def test_levels_frontier_is_the_compact_range_of_every_prefix(data: list[bytes]) -> None:
    """The frontier read off the built levels (``ledger log head`` saves it) equals the one grown
    leaf by leaf, for every size, and extending it gives the root of the longer tree."""
    levels, grown = MerkleLevels.from_leaves(data), CompactRange()
    for size in range(len(data) + 1):
        assert levels.frontier(size) == grown and levels.frontier(size).root() == root(data[:size])
        if size < len(data):
            grown.append(leaf_hash(data[size]))
    assert levels.frontier() == grown
    with pytest.raises(ValueError):
        levels.frontier(len(data) + 1)


# ----------------------------------------------------------------------------- proofs


@settings(max_examples=150)
@given(sized_leaves, st.data())
def test_inclusion_proofs_follow_rfc_and_verify(data: list[bytes], draw: st.DataObject) -> None:
    levels = MerkleLevels.from_leaves(data)
    size = draw.draw(st.integers(1, len(data)), label="size")
    index = draw.draw(st.integers(0, size - 1), label="index")
    proof = levels.inclusion_proof(index, size)
    assert proof == ref_path(index, data[:size])
    tree_root = ref_mth(data[:size])
    leaf = leaf_hash(data[index])
    verify_inclusion(leaf, index, size, proof, tree_root)
    assert root_from_inclusion_proof(leaf, index, size, proof) == tree_root
    if size == len(data):
        assert inclusion_proof(index, leaf_hashes(data)) == proof

    bit = draw.draw(st.integers(0, 255), label="bit")
    with pytest.raises(ProofError):
        verify_inclusion(_flip(leaf, bit), index, size, proof, tree_root)
    with pytest.raises(ProofError):
        verify_inclusion(leaf, index, size, proof, _flip(tree_root, bit))
    if proof:
        position = draw.draw(st.integers(0, len(proof) - 1), label="position")
        tampered = list(proof)
        tampered[position] = _flip(tampered[position], bit)
        with pytest.raises(ProofError):
            verify_inclusion(leaf, index, size, tampered, tree_root)
        with pytest.raises(ProofError, match="hashes"):
            verify_inclusion(leaf, index, size, proof[:-1], tree_root)
    with pytest.raises(ProofError, match="hashes"):
        verify_inclusion(leaf, index, size, [*proof, leaf], tree_root)


@settings(max_examples=150)
@given(sized_leaves, st.data())
def test_consistency_proofs_follow_rfc_and_verify(data: list[bytes], draw: st.DataObject) -> None:
    levels = MerkleLevels.from_leaves(data)
    size2 = draw.draw(st.integers(1, len(data)), label="size2")
    size1 = draw.draw(st.integers(1, size2), label="size1")
    proof = levels.consistency_proof(size1, size2)
    assert proof == ref_subproof(size1, data[:size2], True)
    root1, root2 = ref_mth(data[:size1]), ref_mth(data[:size2])
    verify_consistency(size1, size2, proof, root1, root2)
    assert root_from_consistency_proof(size1, size2, proof, root1) == root2
    if size2 == len(data):
        assert consistency_proof(size1, leaf_hashes(data)) == proof

    bit = draw.draw(st.integers(0, 255), label="bit")
    with pytest.raises(ProofError):
        verify_consistency(size1, size2, proof, _flip(root1, bit), root2)
    with pytest.raises(ProofError):
        verify_consistency(size1, size2, proof, root1, _flip(root2, bit))
    if proof:
        position = draw.draw(st.integers(0, len(proof) - 1), label="position")
        tampered = list(proof)
        tampered[position] = _flip(tampered[position], bit)
        with pytest.raises(ProofError):
            verify_consistency(size1, size2, tampered, root1, root2)
        with pytest.raises(ProofError):
            verify_consistency(size1, size2, proof[:-1], root1, root2)
    with pytest.raises(ProofError):
        verify_consistency(size1, size2, [*proof, root1], root1, root2)


def test_all_proofs_of_a_larger_tree() -> None:
    data = [i.to_bytes(4, "big") for i in range(300)]
    levels = MerkleLevels.from_leaves(data)
    roots = [levels.root(size) for size in range(301)]
    frontier = CompactRange()
    for size in range(1, 301):
        frontier.append(leaf_hash(data[size - 1]))
        assert frontier.root() == roots[size]
        for index in range(0, size, 7):
            proof = levels.inclusion_proof(index, size)
            verify_inclusion(leaf_hash(data[index]), index, size, proof, roots[size])
        for old in range(1, size + 1, 5):
            proof = levels.consistency_proof(old, size)
            verify_consistency(old, size, proof, roots[old], roots[size])


# ----------------------------------------------------------------- argument checking


def test_generation_rejects_bad_arguments() -> None:
    levels = MerkleLevels.from_leaves([b"a", b"b", b"c"])
    with pytest.raises(ValueError, match="outside"):
        levels.root(4)
    with pytest.raises(ValueError, match="leaf index"):
        levels.inclusion_proof(3)
    with pytest.raises(ValueError, match="leaf index"):
        levels.inclusion_proof(-1)
    with pytest.raises(ValueError, match="old_size"):
        levels.consistency_proof(0)
    with pytest.raises(ValueError, match="old_size"):
        levels.consistency_proof(3, 2)
    assert levels.consistency_proof(3) == []
    with pytest.raises(ValueError, match="leaf hash 1 has 31 bytes"):
        MerkleLevels([bytes(32), bytes(31)])


def test_verification_rejects_bad_arguments() -> None:
    leaf = leaf_hash(b"a")
    with pytest.raises(ProofError, match="non-negative"):
        verify_inclusion(leaf, -1, 1, [], leaf)
    with pytest.raises(ProofError, match="not below tree size"):
        verify_inclusion(leaf, 0, 0, [], EMPTY_ROOT)
    with pytest.raises(ProofError, match=r"proof\[0\] has 3 bytes"):
        verify_inclusion(leaf, 0, 2, [b"abc"], leaf)
    with pytest.raises(ProofError, match="empty tree"):
        verify_consistency(0, 0, [], EMPTY_ROOT, EMPTY_ROOT)
    with pytest.raises(ProofError, match="smaller"):
        verify_consistency(2, 1, [], leaf, leaf)
    with pytest.raises(ProofError, match="root1 has"):
        verify_consistency(1, 2, [leaf], b"short", leaf)


def test_compact_range_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="33 bytes"):
        CompactRange().append(bytes(33))
    with pytest.raises(ValueError, match="frontier of size 3 has 64 bytes"):
        CompactRange.from_bytes(3, bytes(32))
    with pytest.raises(ValueError, match="non-negative"):
        CompactRange.from_bytes(-1, b"")
