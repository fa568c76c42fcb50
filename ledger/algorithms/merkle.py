"""RFC 9162 Merkle tree hashing (SHA-256): tree heads, proofs and their verification.

Pure functions, no I/O. The tree is the one of RFC 6962 / RFC 9162 §2.1:

* leaf hash  = SHA-256(0x00 || leaf data)
* node hash  = SHA-256(0x01 || left || right)
* a tree of ``n > 1`` leaves splits at ``k``, the largest power of two below ``n``;
  the empty tree hashes to SHA-256 of the empty string.

Three ways to obtain a root, for three situations:

* :func:`root` / :func:`root_from_leaf_hashes` hash a whole list once, level by level;
* :class:`CompactRange` keeps the O(log n) frontier of an append-only log, so each
  append costs O(log n) and the root is always available;
* :class:`MerkleLevels` keeps every perfect subtree hash of a tree of ``n`` leaves, so the
  root, inclusion proofs and consistency proofs for *any* size ``<= n`` cost O(log n).

Verification (:func:`verify_inclusion`, :func:`verify_consistency` and the
``root_from_*`` helpers) follows transparency-dev/merkle's ``proof`` package and raises
:class:`ProofError` with the reason. One deliberate edge rule (see the shared test
vectors): a consistency proof *from* size 0 is rejected, since RFC 6962 defines
consistency proofs only for ``0 < size1 <= size2``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from ledger.algorithms.errors import InputError, IntegrityError

__all__ = [
    "EMPTY_ROOT",
    "HASH_SIZE",
    "CompactRange",
    "MerkleLevels",
    "ProofError",
    "consistency_proof",
    "inclusion_proof",
    "leaf_hash",
    "leaf_hashes",
    "node_hash",
    "root",
    "root_from_consistency_proof",
    "root_from_inclusion_proof",
    "root_from_leaf_hashes",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE = 32
"""Size in bytes of every hash in the tree (SHA-256)."""

EMPTY_ROOT: bytes = hashlib.sha256(b"").digest()
"""Root hash of the empty tree: SHA-256 of the empty string."""

_sha256 = hashlib.sha256


class ProofError(IntegrityError):
    """A Merkle inclusion or consistency proof is malformed or does not verify."""


# --------------------------------------------------------------------------- hashing


def leaf_hash(data: bytes) -> bytes:
    """Return the RFC 9162 leaf hash SHA-256(0x00 || data)."""
    return _sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """Return the RFC 9162 interior node hash SHA-256(0x01 || left || right)."""
    return _sha256(b"\x01" + left + right).digest()


def leaf_hashes(leaves_data: Iterable[bytes]) -> list[bytes]:
    """Return the leaf hash of every item of ``leaves_data``, in order."""
    sha = _sha256
    return [sha(b"\x00" + data).digest() for data in leaves_data]


def _fold_levels(level: Sequence[bytes]) -> bytes:
    """Reduce a non-empty level of subtree hashes to the root, one level at a time.

    Adjacent pairs are combined; an odd last node is carried up unchanged. That is the
    same tree as RFC 9162's split at the largest power of two: the carried node is the
    root of the ragged right edge, which is only ever combined as a right child.
    """
    sha = _sha256
    while len(level) > 1:
        pairs = iter(level)  # zip(pairs, pairs) yields consecutive pairs, dropping an odd tail
        parents = [
            sha(b"\x01" + left + right).digest() for left, right in zip(pairs, pairs, strict=False)
        ]
        if len(level) & 1:
            parents.append(level[-1])
        level = parents
    return level[0]


def root(leaves_data: Sequence[bytes]) -> bytes:
    """Return the RFC 9162 tree hash of the leaves ``leaves_data`` (raw leaf data).

    The leaf level and the first node level are hashed in one pass (no intermediate
    list of leaf hashes), the remaining levels by :func:`_fold_levels`.
    """
    n = len(leaves_data)
    if n == 0:
        return EMPTY_ROOT
    sha = _sha256
    pairs = iter(leaves_data)
    level = [
        sha(b"\x01" + sha(b"\x00" + left).digest() + sha(b"\x00" + right).digest()).digest()
        for left, right in zip(pairs, pairs, strict=False)
    ]
    if n & 1:
        level.append(leaf_hash(leaves_data[n - 1]))
    return _fold_levels(level)


def root_from_leaf_hashes(hashes: Sequence[bytes]) -> bytes:
    """Return the RFC 9162 tree hash of a tree whose leaf hashes are ``hashes``."""
    if not hashes:
        return EMPTY_ROOT
    return _fold_levels(hashes)


# ------------------------------------------------------------------ proof generation


def inclusion_proof(index: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """Return the inclusion proof (RFC 9162 ``PATH``) of leaf ``index`` in the whole tree.

    Builds a :class:`MerkleLevels` (O(n) hashing); build one yourself to serve many
    proofs from the same tree.
    """
    return MerkleLevels(leaf_hashes).inclusion_proof(index)


def consistency_proof(old_size: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """Return the consistency proof (RFC 9162 ``PROOF``) from ``old_size`` to the whole tree.

    Builds a :class:`MerkleLevels` (O(n) hashing); build one yourself to serve many
    proofs from the same tree.
    """
    return MerkleLevels(leaf_hashes).consistency_proof(old_size)


class MerkleLevels:
    """Every perfect-subtree hash of a tree, built once; roots and proofs for any size.

    Level ``h`` holds, as one contiguous ``bytes``, the hashes of the ``n >> h`` perfect
    subtrees of ``2**h`` leaves that start at multiples of ``2**h`` (level 0 = the leaf
    hashes). Any RFC 9162 subtree of a tree of size ``<= n`` is a right-folded run of
    those, so :meth:`root`, :meth:`inclusion_proof` and :meth:`consistency_proof` cost
    O(log n) hash operations each. Memory: about ``2 * 32 * n`` bytes.
    """

    __slots__ = ("_levels", "_size")

    def __init__(self, leaf_hashes: Sequence[bytes]) -> None:
        """Build all levels from the leaf hashes (``n - 1`` node hashes)."""
        level = list(leaf_hashes)
        if level and set(map(len, level)) != {HASH_SIZE}:
            bad = next(i for i, value in enumerate(level) if len(value) != HASH_SIZE)
            raise InputError(f"leaf hash {bad} has {len(level[bad])} bytes, expected {HASH_SIZE}")
        sha = _sha256
        levels: list[bytes] = []
        while level:
            levels.append(b"".join(level))
            pairs = iter(level)
            level = [
                sha(b"\x01" + left + right).digest()
                for left, right in zip(pairs, pairs, strict=False)
            ]
        self._levels: tuple[bytes, ...] = tuple(levels)
        self._size = len(leaf_hashes)

    @classmethod
    def from_leaves(cls, leaves_data: Iterable[bytes]) -> MerkleLevels:
        """Build from raw leaf data (hashing each leaf first)."""
        return cls(leaf_hashes(leaves_data))

    @property
    def size(self) -> int:
        """Number of leaves ``n``."""
        return self._size

    def __len__(self) -> int:
        return self._size

    def _checked_size(self, size: int | None) -> int:
        """Return ``size`` (default: ``n``) after checking ``0 <= size <= n``."""
        if size is None:
            return self._size
        if not 0 <= size <= self._size:
            raise InputError(f"tree size {size} is outside 0..{self._size}")
        return size

    def _subtree(self, start: int, end: int) -> bytes:
        """Return MTH(D[start:end]) for an RFC 9162 subtree (``start < end``).

        ``start`` is a multiple of the largest power of two ``<= end - start``, so the
        range splits into perfect subtrees of decreasing size (the binary digits of the
        width), whose hashes are folded from the right.
        """
        width = end - start
        pieces: list[bytes] = []
        while width:
            height = width.bit_length() - 1
            offset = (start >> height) * HASH_SIZE
            pieces.append(self._levels[height][offset : offset + HASH_SIZE])
            start += 1 << height
            width -= 1 << height
        result = pieces.pop()
        while pieces:
            result = node_hash(pieces.pop(), result)
        return result

    def frontier(self, size: int | None = None) -> CompactRange:
        """The :class:`CompactRange` of the first ``size`` leaves (default: all): one stored
        perfect-subtree hash per set bit of ``size``, no hashing."""
        size = self._checked_size(size)
        hashes, lo = [], 0
        for height in range(size.bit_length() - 1, -1, -1):
            if size >> height & 1:
                at = (lo >> height) * HASH_SIZE
                hashes.append(self._levels[height][at : at + HASH_SIZE])
                lo += 1 << height
        return CompactRange.from_bytes(size, b"".join(hashes))

    def root(self, size: int | None = None) -> bytes:
        """Return the tree hash of the first ``size`` leaves (default: all)."""
        size = self._checked_size(size)
        return self._subtree(0, size) if size else EMPTY_ROOT

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """Return the RFC 9162 inclusion proof of leaf ``index`` in the tree of ``size``."""
        size = self._checked_size(size)
        if not 0 <= index < size:
            raise InputError(f"leaf index {index} is outside 0..{size - 1} (tree size {size})")
        path: list[bytes] = []  # collected root-first, returned leaf-first
        lo, hi = 0, size
        while hi - lo > 1:
            k = 1 << ((hi - lo - 1).bit_length() - 1)
            if index < lo + k:
                path.append(self._subtree(lo + k, hi))
                hi = lo + k
            else:
                path.append(self._subtree(lo, lo + k))
                lo += k
        path.reverse()
        return path

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        """Return the RFC 9162 consistency proof from ``old_size`` to ``new_size``.

        Requires ``0 < old_size <= new_size`` (default ``new_size``: all leaves); equal
        sizes give the empty proof.
        """
        new_size = self._checked_size(new_size)
        if not 0 < old_size <= new_size:
            raise InputError(
                f"consistency proofs need 0 < old_size <= new_size, got {old_size} -> {new_size}"
            )
        proof: list[bytes] = []  # collected root-first, returned leaf-first
        lo, hi, old_is_whole_subtree = 0, new_size, True
        while old_size != hi:
            k = 1 << ((hi - lo - 1).bit_length() - 1)
            if old_size - lo <= k:
                proof.append(self._subtree(lo + k, hi))
                hi = lo + k
            else:
                proof.append(self._subtree(lo, lo + k))
                lo += k
                old_is_whole_subtree = False
        if not old_is_whole_subtree:
            proof.append(self._subtree(lo, hi))
        proof.reverse()
        return proof


# --------------------------------------------------------------------------- frontier


class CompactRange:
    """The frontier of an append-only tree: the perfect-subtree roots covering [0, size).

    There is one hash per set bit of ``size``, largest (leftmost) subtree first, so an
    append costs at most log2(n) node hashes (amortised one) and :meth:`root` O(log n).
    :meth:`to_bytes` / :meth:`from_bytes` persist the frontier as the concatenation of
    those hashes (the size is stored by the caller).
    """

    __slots__ = ("_hashes", "_size")

    def __init__(self) -> None:
        """Start with the empty tree."""
        self._size = 0
        self._hashes: list[bytes] = []

    @property
    def size(self) -> int:
        """Number of leaves appended so far."""
        return self._size

    @property
    def hashes(self) -> tuple[bytes, ...]:
        """The perfect-subtree roots, largest first."""
        return tuple(self._hashes)

    def append(self, leaf_hash: bytes) -> None:
        """Append one leaf, given by its leaf hash (see :func:`leaf_hash`)."""
        if len(leaf_hash) != HASH_SIZE:
            raise InputError(f"leaf hash has {len(leaf_hash)} bytes, expected {HASH_SIZE}")
        merged, size, hashes = leaf_hash, self._size, self._hashes
        while size & 1:
            merged = node_hash(hashes.pop(), merged)
            size >>= 1
        hashes.append(merged)
        self._size += 1

    def extend(self, leaf_hashes: Iterable[bytes]) -> None:
        """Append several leaves, given by their leaf hashes."""
        for value in leaf_hashes:
            self.append(value)

    def root(self) -> bytes:
        """Return the tree hash of all leaves appended so far."""
        if not self._hashes:
            return EMPTY_ROOT
        result = self._hashes[-1]
        for left in reversed(self._hashes[:-1]):
            result = node_hash(left, result)
        return result

    def to_bytes(self) -> bytes:
        """Serialise the frontier: the concatenated subtree roots, largest first."""
        return b"".join(self._hashes)

    @classmethod
    def from_bytes(cls, size: int, data: bytes) -> CompactRange:
        """Rebuild the frontier of a tree of ``size`` leaves from :meth:`to_bytes` output."""
        if size < 0:
            raise InputError(f"tree size must be non-negative, got {size}")
        expected = size.bit_count() * HASH_SIZE
        if len(data) != expected:
            raise InputError(f"a frontier of size {size} has {expected} bytes, got {len(data)}")
        frontier = cls()
        frontier._size = size
        frontier._hashes = [bytes(data[i : i + HASH_SIZE]) for i in range(0, expected, HASH_SIZE)]
        return frontier

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompactRange):
            return NotImplemented
        return self._size == other._size and self._hashes == other._hashes

    def __repr__(self) -> str:
        return f"CompactRange(size={self._size}, root={self.root().hex()})"


# ----------------------------------------------------------------------- verification


def _check_proof_hash(what: str, value: bytes) -> None:
    """Raise ProofError unless ``value`` is a HASH_SIZE-byte hash."""
    if len(value) != HASH_SIZE:
        raise ProofError(f"{what} has {len(value)} bytes, expected {HASH_SIZE}")


def _check_proof(proof: Sequence[bytes]) -> None:
    """Raise ProofError unless every proof element is a HASH_SIZE-byte hash."""
    for position, value in enumerate(proof):
        _check_proof_hash(f"proof[{position}]", value)


def _decompose_inclusion(index: int, size: int) -> tuple[int, int]:
    """Split an inclusion proof length into (inner, border) parts.

    ``inner`` hashes lie below the point where the paths to ``index`` and to the last
    leaf ``size - 1`` meet; the remaining ``border`` hashes are left siblings along the
    tree's right border.
    """
    inner = (index ^ (size - 1)).bit_length()
    border = (index >> inner).bit_count()
    return inner, border


def _chain_inner(seed: bytes, proof: Sequence[bytes], index: int) -> bytes:
    """Hash ``seed`` up through ``proof``; bit ``i`` of ``index`` says seed's side."""
    for i, sibling in enumerate(proof):
        seed = node_hash(sibling, seed) if (index >> i) & 1 else node_hash(seed, sibling)
    return seed


def _chain_inner_right(seed: bytes, proof: Sequence[bytes], index: int) -> bytes:
    """Like :func:`_chain_inner` but only through left siblings (the older tree's path)."""
    for i, sibling in enumerate(proof):
        if (index >> i) & 1:
            seed = node_hash(sibling, seed)
    return seed


def _chain_border_right(seed: bytes, proof: Sequence[bytes]) -> bytes:
    """Hash ``seed`` as the right child of every hash in ``proof``."""
    for sibling in proof:
        seed = node_hash(sibling, seed)
    return seed


def root_from_inclusion_proof(
    leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes]
) -> bytes:
    """Return the root implied by an inclusion proof of ``leaf_hash`` at ``index``.

    Raises :class:`ProofError` if the arguments or the proof's shape are invalid.
    """
    if index < 0 or size < 0:
        raise ProofError(f"leaf index ({index}) and tree size ({size}) must be non-negative")
    if index >= size:
        raise ProofError(f"leaf index {index} is not below tree size {size}")
    _check_proof_hash("leaf hash", leaf_hash)
    _check_proof(proof)
    inner, border = _decompose_inclusion(index, size)
    if len(proof) != inner + border:
        raise ProofError(
            f"inclusion proof has {len(proof)} hashes, but leaf {index} of a tree of "
            f"size {size} needs {inner + border}"
        )
    return _chain_border_right(_chain_inner(leaf_hash, proof[:inner], index), proof[inner:])


def verify_inclusion(
    leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes
) -> None:
    """Check that ``leaf_hash`` is leaf ``index`` of the tree of ``size`` with ``root``.

    Raises :class:`ProofError` with the reason when it is not.
    """
    computed = root_from_inclusion_proof(leaf_hash, index, size, proof)
    if computed != root:
        raise ProofError(
            f"inclusion proof for leaf {index} of tree size {size} gives root "
            f"{computed.hex()}, expected {bytes(root).hex()}"
        )


def root_from_consistency_proof(
    size1: int, size2: int, proof: Sequence[bytes], root1: bytes
) -> bytes:
    """Check ``proof`` against the old tree (``size1``, ``root1``); return the new root.

    The returned hash is the root of the tree of ``size2`` that the proof commits to;
    an auditor compares it with the new tree head. Raises :class:`ProofError` if the
    sizes or the proof's shape are invalid or the proof does not reproduce ``root1``.
    """
    if size1 < 0 or size2 < 0:
        raise ProofError(f"tree sizes must be non-negative, got {size1} and {size2}")
    if size2 < size1:
        raise ProofError(f"size2 ({size2}) is smaller than size1 ({size1})")
    if size1 == 0:
        raise ProofError("consistency proofs from the empty tree are not defined (size1 = 0)")
    if size1 == size2:
        if proof:
            raise ProofError(
                f"size1 = size2 = {size1}, so the proof must be empty, got {len(proof)} hashes"
            )
        return root1
    if not proof:
        raise ProofError(f"empty consistency proof for size {size1} -> {size2}")
    _check_proof_hash("root1", root1)
    _check_proof(proof)

    # The proof is, in effect, the inclusion proof of the old tree's last perfect
    # subtree (height `shift`) in the new tree, prefixed by that subtree's hash unless
    # the old tree *is* that subtree (size1 a power of two: its hash is root1).
    inner, border = _decompose_inclusion(size1 - 1, size2)
    shift = (size1 & -size1).bit_length() - 1
    inner -= shift
    if size1 == 1 << shift:
        seed, rest = root1, proof
    else:
        seed, rest = proof[0], proof[1:]
    if len(rest) != inner + border:
        raise ProofError(
            f"consistency proof has {len(proof)} hashes, but size {size1} -> {size2} needs "
            f"{len(proof) - len(rest) + inner + border}"
        )
    mask = (size1 - 1) >> shift
    old_root = _chain_border_right(_chain_inner_right(seed, rest[:inner], mask), rest[inner:])
    if old_root != root1:
        raise ProofError(
            f"consistency proof gives old root {old_root.hex()} for size {size1}, "
            f"expected {bytes(root1).hex()}"
        )
    return _chain_border_right(_chain_inner(seed, rest[:inner], mask), rest[inner:])


def verify_consistency(
    size1: int, size2: int, proof: Sequence[bytes], root1: bytes, root2: bytes
) -> None:
    """Check that the tree (``size2``, ``root2``) extends the tree (``size1``, ``root1``).

    Raises :class:`ProofError` with the reason when it does not (including size1 = 0,
    see the module docstring).
    """
    computed = root_from_consistency_proof(size1, size2, proof, root1)
    if computed != root2:
        raise ProofError(
            f"consistency proof gives new root {computed.hex()} for size {size2}, "
            f"expected {bytes(root2).hex()}"
        )
