"""Pure algorithms over plain data: no I/O, no clock, no environment.

Canonical JSON and hashes, packed token bytes, RFC 9162 Merkle trees, C2SP checkpoint
notes, prefix matching, deterministic path draws and loss weights, split hashing, task
grouping, MinHash/LSH, permission resolution, cascade planning, credit and economics
arithmetic, identifiers (escaped natural-key components and safe file names).

May import: the standard library's pure modules, numpy, cryptography (Ed25519 as a pure
function), and other modules of this package. Never ``sqlite3``, ``confluent_kafka``,
``os``, ``pathlib``, file or network I/O, nor any other ``ledger`` subpackage or
``projections`` (enforced by ``tests/test_layering.py``).
"""
