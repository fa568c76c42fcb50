"""MinHash signatures and banded LSH for similarity screening (SPEC §6.3, seed 002 §15.4.3).

Pure algorithm: no I/O, no clock; the only randomness is ``numpy.random.RandomState(seed)``
drawing the permutation parameters, exactly as ``datasketch`` draws them.

Compatibility with datasketch
-----------------------------
Signatures are **bit-for-bit identical** to ``datasketch.MinHash(num_perm, seed, scheme)``
fed the same byte strings (checked by the tests for every scheme):

* each shingle (``bytes``) is hashed with SHA-1; the first 4 bytes read little-endian give
  a 32-bit value (8 bytes for ``affine64``) — datasketch's ``sha1_hash32``/``sha1_hash64``;
* ``"affine32"`` (datasketch ≥ 2.0 default): the value is pre-mixed with the MurmurHash3
  32-bit finaliser, then permuted by ``a*h + b mod 2**32`` with odd ``a``; ``a`` and ``b``
  come from ``RandomState(seed).randint(0, 2**31, num_perm, uint32)*2+1`` and
  ``randint(0, 2**32, num_perm, uint32)``; values stored as ``uint32``;
* ``"affine64"``: the same over 64 bits (``uint64``);
* ``"legacy"`` (datasketch < 2.0): ``((a*h + b) mod 2**64) mod (2**61 - 1)`` truncated to
  the low 32 bits, stored as ``uint64``, with ``(a, b)`` drawn in pairs by
  ``randint(1, 2**61-1)`` / ``randint(0, 2**61-1)`` per permutation;
* the signature is the element-wise minimum over the set; an empty set gives the
  all-maximum signature (datasketch's initial state).

Speed comes from batching: the SHA-1 of every shingle of a batch is taken in one list
comprehension (the only Python-level loop; the digests are joined and read with one
``np.frombuffer``), and the permutations are applied to cache-sized chunks of consecutive
documents as one ``(shingles, num_perm)`` outer product, reduced per document with
``np.minimum.reduceat``.

LSH
---
A signature of ``num_perm >= b*r`` values is cut into ``b`` bands of ``r`` rows (the first
``b*r`` values, as datasketch does).  Two items are candidates when all ``r`` rows of at
least one band are equal.  :func:`lsh_candidates` finds every such pair with one
``np.lexsort`` per band; :class:`LSHIndex` is the incremental form.  With independent
components a pair of Jaccard similarity ``s`` becomes a candidate with probability
``1 - (1 - s**r)**b`` (:func:`candidate_probability`), steepest near ``(1/b)**(1/r)``.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from typing import Any, Literal, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from ledger.algorithms.errors import InputError

__all__ = [
    "DEFAULT_NUM_PERM",
    "DEFAULT_SCHEME",
    "DEFAULT_SEED",
    "SCHEMES",
    "LSHIndex",
    "MinHasher",
    "ShingleConfig",
    "candidate_curve",
    "candidate_probability",
    "feature_shingles",
    "format_candidate_curve",
    "jaccard_estimate",
    "lsh_candidate_indices",
    "lsh_candidates",
    "permutations",
    "sha1_hashes",
    "steepest_similarity",
    "text_shingles",
    "token_shingles",
]

Scheme = Literal["affine32", "affine64", "legacy"]
SCHEMES: tuple[str, ...] = ("affine32", "affine64", "legacy")
DEFAULT_SCHEME: Scheme = "affine32"
DEFAULT_NUM_PERM = 128
DEFAULT_SEED = 1

_MERSENNE = np.uint64((1 << 61) - 1)
_MAX32 = np.uint64((1 << 32) - 1)
_DTYPE: dict[str, type[np.unsignedinteger[Any]]] = {"affine32": np.uint32, "affine64": np.uint64, "legacy": np.uint64}
_MAXVAL = {"affine32": (1 << 32) - 1, "affine64": (1 << 64) - 1, "legacy": (1 << 32) - 1}
_FMIX = {
    32: (np.uint32(16), np.uint32(0x85EBCA6B), np.uint32(13), np.uint32(0xC2B2AE35), np.uint32(16)),
    64: (np.uint64(33), np.uint64(0xFF51AFD7ED558CCD), np.uint64(33), np.uint64(0xC4CEB9FE1A85EC53), np.uint64(33)),
}
#: About how many permuted values are materialised at once (cache-sized: ~0.5-1 MB).
_CHUNK_ELEMENTS = 1 << 17

K = TypeVar("K", bound=Hashable)


# ----------------------------------------------------------------------------------------
# Shingles
# ----------------------------------------------------------------------------------------
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True)
class ShingleConfig:
    """How task features become shingles.

    ``kind="word"``: k-grams of ``\\w+`` words (joined by one space);
    ``kind="char"``: k-grams of characters after collapsing whitespace.
    Text is NFC-normalised and, with ``lowercase``, case-folded.  Lists of tokens (ints or
    strings) always give token k-grams.  Version the config with the data: changing it
    changes every signature.
    """

    kind: Literal["word", "char"] = "word"
    k: int = 3
    lowercase: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("word", "char"):
            raise InputError(f"shingle kind must be 'word' or 'char', got {self.kind!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise InputError(f"shingle size k must be a positive int, got {self.k!r}")


def text_shingles(text: str, k: int = 3, kind: Literal["word", "char"] = "word", lowercase: bool = True) -> set[bytes]:
    """UTF-8 shingles of ``text``; a text shorter than ``k`` units gives one shingle.

    Returns the empty set for text without words (``word``) or characters (``char``).
    """
    text = unicodedata.normalize("NFC", text)
    if lowercase:
        text = text.casefold()
    if kind == "word":
        units: list[str] = _WORD.findall(text)
        sep = " "
    elif kind == "char":
        units = list(" ".join(text.split()))
        sep = ""
    else:
        raise InputError(f"shingle kind must be 'word' or 'char', got {kind!r}")
    if not units:
        return set()
    if len(units) <= k:
        return {sep.join(units).encode("utf-8")}
    return {sep.join(units[i : i + k]).encode("utf-8") for i in range(len(units) - k + 1)}


def _token_bytes(tok: int | str) -> bytes:
    if isinstance(tok, bool):
        raise TypeError("tokens must be ints or strings, not bool")
    if isinstance(tok, int):
        return b"\x01" + int(tok).to_bytes(8, "little", signed=True)
    if isinstance(tok, str):
        return b"\x02" + tok.encode("utf-8") + b"\x00"
    raise TypeError(f"tokens must be ints or strings, got {type(tok).__name__}")


def token_shingles(tokens: Sequence[int | str], k: int = 3) -> set[bytes]:
    """Shingles of a token sequence (e.g. tool-call names, token ids): token k-grams.

    Each token is encoded unambiguously (type tag + fixed-width int or NUL-terminated
    UTF-8), so ``[1, 2]`` and ``["1", "2"]`` never collide.
    """
    enc = [_token_bytes(t) for t in tokens]
    if not enc:
        return set()
    if len(enc) <= k:
        return {b"".join(enc)}
    return {b"".join(enc[i : i + k]) for i in range(len(enc) - k + 1)}


def feature_shingles(features: Any, config: ShingleConfig = ShingleConfig()) -> set[bytes]:
    """Shingles of a task's ``features`` (SPEC §7.1 ``task_registered.features``).

    * ``str``: text shingles per ``config`` — a string holding a JSON object or array is
      *not* parsed (pass the parsed value);
    * list/tuple of ints/strings: token shingles;
    * mapping: each key's value shingled recursively, every shingle prefixed with
      ``key + 0x1e`` so that facets (``prompt``, ``patch``, ``tools`` ...) never match
      each other;
    * other JSON scalars: one shingle of their canonical JSON;
    * ``None``: no shingles (the task is not screened).
    """
    if features is None:
        return set()
    if isinstance(features, str):
        return text_shingles(features, config.k, config.kind, config.lowercase)
    if isinstance(features, Mapping):
        out: set[bytes] = set()
        for key in sorted(features, key=str):
            prefix = str(key).encode("utf-8") + b"\x1e"
            out.update(prefix + s for s in feature_shingles(features[key], config))
        return out
    if isinstance(features, (list, tuple)):
        if all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in features):
            return token_shingles(features, config.k)
        out = set()
        for item in features:
            out.update(feature_shingles(item, config))
        return out
    return {json.dumps(features, sort_keys=True, separators=(",", ":")).encode("utf-8")}


# ----------------------------------------------------------------------------------------
# Hashing and permutations (datasketch-compatible)
# ----------------------------------------------------------------------------------------
def sha1_hashes(items: Sequence[bytes], bits: int = 32) -> NDArray[np.unsignedinteger[Any]]:
    """datasketch's ``sha1_hash32``/``sha1_hash64`` for many items, as one array."""
    if bits not in (32, 64):
        raise InputError("bits must be 32 or 64")
    sha1 = hashlib.sha1
    raw = np.frombuffer(b"".join([sha1(x).digest() for x in items]), dtype=np.uint8).reshape(-1, 20)
    width = bits // 8
    return np.ascontiguousarray(raw[:, :width]).view("<u4" if bits == 32 else "<u8").ravel().astype(
        np.uint32 if bits == 32 else np.uint64
    )


@lru_cache(maxsize=32)
def _permutations_cached(num_perm: int, seed: int, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.RandomState(seed)
    if scheme == "legacy":
        pairs = np.array(
            [
                (gen.randint(1, _MERSENNE, dtype=np.uint64), gen.randint(0, _MERSENNE, dtype=np.uint64))
                for _ in range(num_perm)
            ],
            dtype=np.uint64,
        ).T
        a, b = pairs[0].copy(), pairs[1].copy()
    elif scheme in ("affine32", "affine64"):
        width = 32 if scheme == "affine32" else 64
        dtype = _DTYPE[scheme]
        a = gen.randint(0, 1 << (width - 1), num_perm, dtype=dtype) * dtype(2) + dtype(1)
        b = gen.randint(0, 1 << width, num_perm, dtype=dtype)
    else:
        raise InputError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b


def permutations(
    num_perm: int = DEFAULT_NUM_PERM, seed: int = DEFAULT_SEED, scheme: str = DEFAULT_SCHEME
) -> tuple[np.ndarray, np.ndarray]:
    """Permutation parameters ``(a, b)`` exactly as ``datasketch.MinHash`` draws them."""
    if not isinstance(num_perm, int) or num_perm < 1:
        raise InputError("num_perm must be a positive int")
    return _permutations_cached(num_perm, seed, scheme)


def _fmix(hv: np.ndarray, width: int) -> np.ndarray:
    s1, m1, s2, m2, s3 = _FMIX[width]
    hv = hv ^ (hv >> s1)
    hv = hv * m1
    hv = hv ^ (hv >> s2)
    hv = hv * m2
    return hv ^ (hv >> s3)


class MinHasher:
    """Computes MinHash signatures identical to ``datasketch.MinHash(num_perm, seed, scheme)``."""

    def __init__(
        self, num_perm: int = DEFAULT_NUM_PERM, seed: int = DEFAULT_SEED, scheme: str = DEFAULT_SCHEME
    ) -> None:
        if scheme not in SCHEMES:
            raise InputError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        self.num_perm = num_perm
        self.seed = seed
        self.scheme = scheme
        self.a, self.b = permutations(num_perm, seed, scheme)
        self.dtype = _DTYPE[scheme]
        self.max_value = self.dtype(_MAXVAL[scheme])
        self._bits = 64 if scheme == "affine64" else 32

    def __repr__(self) -> str:
        return f"MinHasher(num_perm={self.num_perm}, seed={self.seed}, scheme={self.scheme!r})"

    def empty(self) -> np.ndarray:
        """Signature of the empty set (all maximum values, datasketch's initial state)."""
        return np.full(self.num_perm, self.max_value, dtype=self.dtype)

    def _premix(self, hv: np.ndarray) -> np.ndarray:
        """Per-item work done once, before the permutations (the affine schemes' fmix)."""
        if self.scheme == "legacy":
            return hv.astype(np.uint64)
        return _fmix(hv.astype(self.dtype), self._bits)

    def _permute(self, mixed: np.ndarray) -> np.ndarray:
        """``(n,)`` pre-mixed hashes -> ``(n, num_perm)`` permuted hashes (in place ops)."""
        phv = np.multiply.outer(mixed, self.a)
        phv += self.b
        if self.scheme == "legacy":
            phv %= _MERSENNE
            phv &= _MAX32
        return phv

    def signature(self, shingles: Iterable[bytes]) -> np.ndarray:
        """Signature of one set of shingles (``bytes``)."""
        return self.signature_matrix([shingles])[0]

    def signature_matrix(self, docs: Sequence[Iterable[bytes]]) -> np.ndarray:
        """Signatures of many shingle sets as one ``(len(docs), num_perm)`` array.

        All shingles of the batch are hashed in one pass; the permutations are applied to
        cache-sized chunks of consecutive documents (about ``2**17`` values each) as one
        outer product and reduced per document with ``np.minimum.reduceat``.
        """
        docs_list = [d if isinstance(d, (list, tuple)) else list(d) for d in docs]
        n = len(docs_list)
        out = np.full((n, self.num_perm), self.max_value, dtype=self.dtype)
        lengths = np.fromiter(map(len, docs_list), dtype=np.int64, count=n)
        total = int(lengths.sum())
        if total == 0:
            return out
        mixed = self._premix(sha1_hashes(list(chain.from_iterable(docs_list)), self._bits))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // self.num_perm)
        doc = 0
        while doc < n:
            # Consecutive documents holding about rows_per_chunk shingles (at least one).
            stop = int(np.searchsorted(ends, starts[doc] + rows_per_chunk, side="right"))
            stop = min(max(stop, doc + 1), n)
            lo, hi = int(starts[doc]), int(ends[stop - 1])
            if hi > lo:
                sel = np.arange(doc, stop)
                nonempty = sel[lengths[doc:stop] > 0]
                phv = self._permute(mixed[lo:hi])
                out[nonempty] = np.minimum.reduceat(phv, starts[nonempty] - lo, axis=0)
            doc = stop
        return out

    def signatures(self, docs: Mapping[K, Iterable[bytes]]) -> dict[K, np.ndarray]:
        """``{id: signature}`` for a mapping of shingle sets (rows of one batch matrix)."""
        keys = list(docs)
        mat = self.signature_matrix([docs[k] for k in keys])
        return {k: mat[i] for i, k in enumerate(keys)}

    def feature_signatures(
        self, features: Mapping[K, Any], config: ShingleConfig = ShingleConfig()
    ) -> dict[K, np.ndarray]:
        """Signatures of task features; items whose features give no shingle are skipped."""
        shingled = {k: feature_shingles(v, config) for k, v in features.items()}
        return self.signatures({k: s for k, s in shingled.items() if s})


def jaccard_estimate(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Fraction of equal components: the MinHash estimate of the Jaccard similarity."""
    if sig_a.shape != sig_b.shape:
        raise InputError("signatures must have the same length")
    return float(np.count_nonzero(sig_a == sig_b)) / float(sig_a.size)


# ----------------------------------------------------------------------------------------
# Banded LSH
# ----------------------------------------------------------------------------------------
def _check_bands(num_perm: int, b: int, r: int) -> None:
    if not isinstance(b, int) or not isinstance(r, int) or b < 1 or r < 1:
        raise InputError(f"bands b and rows r must be positive ints, got b={b!r}, r={r!r}")
    if b * r > num_perm:
        raise InputError(f"b*r = {b}*{r} = {b * r} exceeds the signature length {num_perm}")


def lsh_candidate_indices(matrix: np.ndarray, b: int, r: int) -> np.ndarray:
    """Candidate pairs of rows of a ``(n, num_perm)`` signature matrix.

    Returns an ``(m, 2)`` int64 array of row-index pairs ``i < j``, sorted, each pair once:
    rows ``i`` and ``j`` agree on all ``r`` values of at least one of the ``b`` bands.
    """
    if matrix.ndim != 2:
        raise InputError("matrix must be 2-dimensional (items x num_perm)")
    n, num_perm = matrix.shape
    _check_bands(num_perm, b, r)
    if n < 2:
        return np.empty((0, 2), dtype=np.int64)
    codes: list[np.ndarray] = []
    for band in range(b):
        cols = matrix[:, band * r : (band + 1) * r]
        order = np.lexsort(cols.T[::-1])
        srt = cols[order]
        new_run = np.empty(n, dtype=bool)
        new_run[0] = True
        np.any(srt[1:] != srt[:-1], axis=1, out=new_run[1:])
        run_id = np.cumsum(new_run) - 1
        run_len = np.bincount(run_id)
        in_multi = run_len[run_id] > 1
        if not in_multi.any():
            continue
        members = order[in_multi]
        rid = run_id[in_multi]
        max_len = int(run_len.max())
        for d in range(1, max_len):
            same = rid[:-d] == rid[d:]
            if not same.any():
                break
            x, y = members[:-d][same], members[d:][same]
            lo, hi = np.minimum(x, y), np.maximum(x, y)
            codes.append(lo * n + hi)
    if not codes:
        return np.empty((0, 2), dtype=np.int64)
    uniq = np.unique(np.concatenate(codes))
    return np.stack([uniq // n, uniq % n], axis=1)


def lsh_candidates(signatures: Mapping[K, np.ndarray], b: int, r: int) -> set[tuple[K, K]]:
    """Candidate pairs ``(id_a, id_b)`` with ``id_a < id_b`` from banded LSH.

    Same pairs as inserting every signature into ``datasketch.MinHashLSH(params=(b, r))``
    and querying each one.  Ids should be mutually orderable (e.g. all strings); if they
    are not, pairs are oriented by insertion order instead.
    """
    try:
        keys: list[K] = sorted(signatures)  # type: ignore[type-var]
    except TypeError:
        keys = list(signatures)
    if len(keys) < 2:
        return set()
    matrix = np.stack([np.asarray(signatures[k]) for k in keys])
    pairs = lsh_candidate_indices(matrix, b, r)
    return {(keys[i], keys[j]) for i, j in pairs.tolist()}


class LSHIndex:
    """Incremental banded LSH index (b bands x r rows) for a projection fed one task at a time.

    :meth:`insert` returns the keys already in the index that share a band bucket with the
    new signature, so a replay yields each candidate pair exactly once, when its second
    member arrives.
    """

    def __init__(self, b: int, r: int) -> None:
        _check_bands(b * r, b, r)
        self.b, self.r = b, r
        self._buckets: list[dict[bytes, list[Any]]] = [{} for _ in range(b)]
        self._bands: dict[Any, tuple[bytes, ...]] = {}

    def _band_keys(self, signature: np.ndarray) -> tuple[bytes, ...]:
        sig = np.ascontiguousarray(signature)
        if sig.ndim != 1 or sig.size < self.b * self.r:
            raise InputError(f"signature must be 1-D with at least b*r = {self.b * self.r} values")
        return tuple(sig[i * self.r : (i + 1) * self.r].tobytes() for i in range(self.b))

    def query(self, signature: np.ndarray) -> set[Any]:
        """Keys sharing at least one band bucket with ``signature``."""
        out: set[Any] = set()
        for table, key in zip(self._buckets, self._band_keys(signature)):
            out.update(table.get(key, ()))
        return out

    def insert(self, key: Hashable, signature: np.ndarray) -> set[Any]:
        """Add ``key``; return the keys already indexed that are candidates with it."""
        if key in self._bands:
            raise InputError(f"key {key!r} is already in the index")
        bands = self._band_keys(signature)
        found: set[Any] = set()
        for table, band in zip(self._buckets, bands):
            bucket = table.setdefault(band, [])
            found.update(bucket)
            bucket.append(key)
        self._bands[key] = bands
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._bands

    def __len__(self) -> int:
        return len(self._bands)

    def candidate_pairs(self) -> set[tuple[Any, Any]]:
        """Every candidate pair in the index, each oriented ``(smaller, larger)``."""
        out: set[tuple[Any, Any]] = set()
        for table in self._buckets:
            for bucket in table.values():
                if len(bucket) < 2:
                    continue
                ordered = sorted(bucket)
                for i, x in enumerate(ordered):
                    for y in ordered[i + 1 :]:
                        out.add((x, y))
        return out


# ----------------------------------------------------------------------------------------
# Candidate probability curve
# ----------------------------------------------------------------------------------------
def candidate_probability(s: float | np.ndarray, b: int, r: int) -> float | np.ndarray:
    """``1 - (1 - s**r)**b``: chance that a pair of Jaccard similarity ``s`` is a candidate."""
    _check_bands(b * r, b, r)
    arr = np.asarray(s, dtype=np.float64)
    if np.any((arr < 0) | (arr > 1)) or np.any(np.isnan(arr)):
        raise InputError("similarity must lie in [0, 1]")
    with np.errstate(divide="ignore"):
        # expm1/log1p keep precision for small s; s = 1 gives log1p(-1) = -inf -> p = 1.
        p = -np.expm1(b * np.log1p(-(arr**r))) + 0.0
    return float(p) if np.ndim(s) == 0 else cast(np.ndarray, p)


def steepest_similarity(b: int, r: int) -> float:
    """``(1/b)**(1/r)``: the similarity near which the candidate curve is steepest."""
    _check_bands(b * r, b, r)
    return float((1.0 / b) ** (1.0 / r))


def candidate_curve(b: int, r: int, points: int = 21) -> list[tuple[float, float]]:
    """``[(s, candidate_probability(s, b, r))]`` at ``points`` evenly spaced similarities."""
    if points < 2:
        raise InputError("points must be >= 2")
    grid = np.linspace(0.0, 1.0, points)
    probs = np.asarray(candidate_probability(grid, b, r))
    return [(float(s), float(p)) for s, p in zip(grid, probs)]


def format_candidate_curve(b: int, r: int, points: int = 11, width: int = 40) -> str:
    """A small text table and bar chart of the candidate probability curve (for reports)."""
    lines = [
        f"LSH b={b} bands x r={r} rows: P(candidate | s) = 1 - (1 - s^{r})^{b}; "
        f"steepest near s={steepest_similarity(b, r):.3f}"
    ]
    lines.append("    s   P(candidate)")
    for s, p in candidate_curve(b, r, points):
        lines.append(f"  {s:4.2f}   {p:8.4f}  {'#' * int(round(p * width))}")
    return "\n".join(lines)
