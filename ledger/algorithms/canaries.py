"""Canary matching (SPEC §11.2; seed 002 §15.9.3): every occurrence of any of many token
sequences in a packed uint32 array, in one pass over the array.

A canary is a planted synthetic secret, declared as a token sequence; publishing a training
corpus must find every copy of every canary in its members.  Scanning once per canary costs
O(canaries × tokens); :class:`CanaryMatcher` costs O(K × tokens) whatever the number of
canaries:

1. **One pass of window hashes.**  For every start position ``i`` the polynomial hash of the
   window ``tokens[i:i+w]`` is grown one token at a time, ``h_w = h_{w-1} · P + (t + 1)``
   (uint64, wrapping), for ``w = 1 .. K`` (``K = 8``), as whole-array numpy operations.  A
   canary of ``L`` tokens is indexed under the hash of its first ``w = min(L, K)`` tokens.
2. **Probe.**  At each window length some canary uses, the window hashes are mixed into a
   bit table (a few bits per canary): the few positions whose bit is set are looked up
   exactly (``searchsorted`` over the sorted prefix hashes).
3. **Verify.**  A candidate ``(position, canary)`` whose prefix hash matched is compared
   token for token with the whole canary (hash collisions and canaries longer than ``K``
   are settled here), vectorized per canary over its candidates.

There are no false negatives: a true occurrence always has its canary's prefix hash.
:func:`naive_find` (one sliding comparison per canary) is the reference the tests and the
benchmark compare with.  Pure functions over numpy arrays: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ledger.algorithms.errors import InputError
from ledger.algorithms.tokens import U32

__all__ = ["K", "CanaryMatcher", "naive_find", "segment_matches"]

K = 8  # window hashes are grown up to this many tokens
CHUNK = 1 << 15  # start positions hashed at a time (uint64 buffers of 256 KiB, cache-resident)
_P = np.uint64(0x100000001B3)  # odd multiplier of the window hash
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing into the bit table
_EMPTY = np.zeros(0, dtype=np.int64)


def _as_tokens(values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise InputError("a token sequence is one-dimensional")
    return arr.astype(U32, copy=False)


def _prefix_hashes(rows: np.ndarray) -> np.ndarray:
    """Window hash of each row of a (canaries × w) uint64 matrix of ``token + 1`` values."""
    h = rows[:, 0].copy()
    for j in range(1, rows.shape[1]):
        h = h * _P + rows[:, j]
    return h


class _Group:
    """The canaries indexed under windows of ``w`` tokens: sorted prefix hashes, their canary
    indices, and the bit table the window hashes are probed against."""

    __slots__ = ("w", "hashes", "canaries", "table", "shift")

    def __init__(self, w: int, indices: np.ndarray, patterns: list[np.ndarray]) -> None:
        rows = np.stack([patterns[i][:w] for i in indices]).astype(np.uint64) + np.uint64(1)
        h = _prefix_hashes(rows)
        order = np.argsort(h, kind="stable")
        self.w, self.hashes, self.canaries = w, h[order], indices[order]
        bits = int(min(24, max(12, np.ceil(np.log2(len(indices))) + 8)))
        self.shift = np.uint64(64 - bits)
        self.table = np.zeros(1 << bits, dtype=bool)
        self.table[(self.hashes * _MIX) >> self.shift] = True

    def candidates(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, canary) pairs whose window hash ``h[start]`` equals a canary's prefix hash."""
        pos = np.flatnonzero(self.table[(h * _MIX) >> self.shift])
        if pos.size == 0:
            return _EMPTY, _EMPTY
        hv = h[pos]
        lo = np.searchsorted(self.hashes, hv, side="left")
        hi = np.searchsorted(self.hashes, hv, side="right")
        counts = hi - lo
        pos, lo, counts = pos[counts > 0], lo[counts > 0], counts[counts > 0]
        if pos.size == 0:
            return _EMPTY, _EMPTY
        total = int(counts.sum())
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(pos, counts).astype(np.int64), self.canaries[np.repeat(lo, counts) + within]


class CanaryMatcher:
    """Every occurrence of any of ``patterns`` (non-empty uint32 sequences) in one pass."""

    def __init__(self, patterns: Sequence) -> None:
        self.patterns = [_as_tokens(p) for p in patterns]
        if any(p.size == 0 for p in self.patterns):
            raise InputError("a canary has at least one token")
        self.lengths = np.array([p.size for p in self.patterns], dtype=np.int64)
        self.max_len = int(self.lengths.max()) if self.patterns else 0
        width = np.minimum(self.lengths, K)
        self.groups = [_Group(int(w), np.flatnonzero(width == w), self.patterns) for w in np.unique(width)]

    def find(self, tokens, *, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, canaries)``: every occurrence, ordered by start then canary index.
        The window hashes are computed ``chunk`` start positions at a time (cache-sized
        buffers, updated in place); the result does not depend on ``chunk``."""
        hay = _as_tokens(tokens)
        if not self.groups or hay.size == 0:
            return _EMPTY, _EMPTY
        starts, canaries = [_EMPTY], [_EMPTY]
        for c0 in range(0, hay.size, chunk):
            for s, c in self._candidates(hay[c0:c0 + chunk + self.groups[-1].w - 1]):
                keep = s < chunk  # a window starting in the overlap belongs to the next chunk
                starts.append(s[keep] + c0)
                canaries.append(c[keep])
        return self._verified(hay, np.concatenate(starts), np.concatenate(canaries))

    def _candidates(self, part: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Candidate (start, canary) arrays of the windows starting in ``part``, per group."""
        t = part.astype(np.uint64) + np.uint64(1)
        h = t.copy()
        out = []
        w = 1
        for group in self.groups:  # ascending window lengths
            while w < group.w and w < t.size:
                w += 1
                hv = h[: t.size - w + 1]  # windows of w tokens start at 0 .. size - w
                np.multiply(hv, _P, out=hv)
                np.add(hv, t[w - 1:], out=hv)
            if w < group.w:
                break
            out.append(group.candidates(h[: t.size - w + 1]))
        return out

    def _verified(self, hay: np.ndarray, starts: np.ndarray, canaries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidates whose whole canary is at their start (compared token for token)."""
        if starts.size == 0:
            return _EMPTY, _EMPTY
        ok = np.zeros(starts.size, dtype=bool)
        order = np.argsort(canaries, kind="stable")
        bounds = np.flatnonzero(np.diff(canaries[order])) + 1
        for idx in np.split(order, bounds):
            pattern = self.patterns[int(canaries[idx[0]])]
            fits = idx[starts[idx] + pattern.size <= hay.size]
            if fits.size:
                windows = hay[starts[fits][:, None] + np.arange(pattern.size)]
                ok[fits[(windows == pattern).all(axis=1)]] = True
        starts, canaries = starts[ok], canaries[ok]
        order = np.lexsort((canaries, starts))
        return starts[order], canaries[order]


def segment_matches(matcher: CanaryMatcher, tokens, bounds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Occurrences in a concatenation of segments (``bounds``: the segments' start offsets,
    ascending, the first 0): ``(segment, offset in it, canary)`` of every occurrence lying
    wholly inside one segment (a copy spanning two segments is no copy)."""
    hay = _as_tokens(tokens)
    starts, canaries = matcher.find(hay)
    if starts.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    bounds = np.asarray(bounds, dtype=np.int64)
    seg = np.searchsorted(bounds, starts, side="right") - 1
    ends = np.append(bounds, hay.size)[seg + 1]
    inside = starts + matcher.lengths[canaries] <= ends
    seg, starts, canaries = seg[inside], starts[inside], canaries[inside]
    return seg, starts - bounds[seg], canaries


def naive_find(patterns: Sequence, tokens) -> tuple[np.ndarray, np.ndarray]:
    """The reference: one sliding numpy comparison per canary (O(canaries × tokens)).
    Same result and order as :meth:`CanaryMatcher.find`."""
    hay = _as_tokens(tokens)
    starts, canaries = [], []
    for i, p in enumerate(_as_tokens(p) for p in patterns):
        if p.size == 0 or p.size > hay.size:
            continue
        cand = np.flatnonzero(hay[: hay.size - p.size + 1] == p[0])
        for j in range(1, p.size):
            cand = cand[hay[cand + j] == p[j]]
        starts.append(cand.astype(np.int64))
        canaries.append(np.full(cand.size, i, dtype=np.int64))
    if not starts:
        return _EMPTY, _EMPTY
    s, c = np.concatenate(starts), np.concatenate(canaries)
    order = np.lexsort((c, s))
    return s[order], c[order]
