"""Merkle root over 1M digests vs hashing the same bytes with hashlib (SPEC §8)."""

from __future__ import annotations

import hashlib
import os

from ledger.algorithms import merkle

from .common import print_table, row, timed


def run(n: int = 1_000_000) -> list[dict]:
    leaves = [os.urandom(32) for _ in range(n)]
    t_root = timed(lambda: merkle.root(leaves), 2)
    sha = hashlib.sha256
    t_hash = timed(lambda: [sha(x).digest() for x in leaves], 2)
    return [row(f"RFC 9162 root over {n:,} digests", n / t_root, n / t_hash, "leaves/s (vs one hashlib call per leaf)", 0.5)]


if __name__ == "__main__":
    print_table(run())
