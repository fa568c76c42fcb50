"""Packed token and log-probability buffers (SPEC §4.1).

Token IDs travel as little-endian uint32 bytes and log-probabilities as little-endian
float32 bytes: one ``numpy.frombuffer`` decodes a whole request, no Python loop per token.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np

U32 = np.dtype("<u4")
F32 = np.dtype("<f4")
MAX_TOKEN_ID = 2**32 - 1


class TokenList(list):
    """Token IDs as the JSON array a line carries (a ``list``, equal to the plain list), built from a uint32 array
    whose packed bytes it keeps: validation takes them instead of re-packing the list, so a producer holding the
    IDs as an array (the recorder) spares an O(tokens) list-to-array conversion per request.  Every uint32 is a
    valid token ID.  Meant to be validated as built (the recorder builds it right before): a list whose length
    changed since is validated as a plain list."""

    __slots__ = ("packed",)

    def __init__(self, ids: np.ndarray) -> None:
        arr = np.ascontiguousarray(ids, dtype=U32)
        super().__init__(arr.tolist())
        self.packed = arr.tobytes()


def pack_tokens(ids: Iterable[int] | np.ndarray) -> bytes:
    """Pack token IDs as little-endian uint32 bytes (caller validated the range)."""
    return np.asarray(ids, dtype=U32).tobytes()


def unpack_tokens(data: bytes | None) -> np.ndarray:
    """Token IDs as a read-only uint32 array (empty for ``None``)."""
    if not data:
        return np.zeros(0, dtype=U32)
    return np.frombuffer(data, dtype=U32)


def pack_logprobs(values: Iterable[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=F32).tobytes()


def unpack_logprobs(data: bytes | None) -> np.ndarray:
    if not data:
        return np.zeros(0, dtype=F32)
    return np.frombuffer(data, dtype=F32)


def tokens_sha256(packed: bytes) -> str:
    """SHA-256 (hex) of packed tokens: the hash a prefix reference carries (SPEC §4.2)."""
    return hashlib.sha256(packed).hexdigest()


def token_count(packed: bytes | None) -> int:
    return len(packed) // 4 if packed else 0
