"""Canonical JSON (SPEC §6.6) and the hashes built on it.

Canonical JSON is ``json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)`` encoded as UTF-8: keys sorted, no whitespace.  Every digest the
ledger publishes (member digests, manifest signatures, governance signatures) is computed
over these bytes, so an outside verifier needs nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Return the canonical UTF-8 JSON encoding of ``obj``."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def canonical_str(obj: Any) -> str:
    """Canonical JSON as ``str`` (for storing JSON values inside Avro string fields)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_digest(obj: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()
