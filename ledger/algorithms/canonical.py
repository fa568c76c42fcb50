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

from ledger.algorithms.errors import InputError


def canonical_json(obj: Any) -> bytes:
    """Return the canonical UTF-8 JSON encoding of ``obj``."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def canonical_str(obj: Any) -> str:
    """Canonical JSON as ``str`` (for storing JSON values inside Avro string fields)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def json_or_text(text: str | None) -> Any:
    """A stored JSON text decoded (free-form values are kept as canonical JSON strings), the text itself
    when it is not JSON, None for None."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_digest(obj: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


# ------------------------------------------------------------------ duplicate keys (SPEC 11.7)
class DuplicateKeyError(InputError):
    """A JSON object names one key twice (``{"a": 1, "a": 2}``): refused, never "the last one wins"."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r} in a JSON object (each key may appear once)")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook`` refusing a repeated key (:class:`DuplicateKeyError`)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKeyError(next(k for k, _v in pairs if k in seen or seen.add(k)))
    return d


_SHORT = 2048  # characters: longer texts always take the hook (its cost per object is small beside the parse)


def loads_unique(text: str | bytes, **kw: Any) -> Any:
    """``json.loads`` refusing duplicate keys at any depth.

    The hook costs a Python call per object: next to a long text's parse that is nothing, but it
    would double a small event's.  So a short text whose only object is the top-level one (one
    ``{``) is parsed at C speed and the hook runs only when :func:`_keys_upper_bound` says the
    text may hold more keys than the object decoded to."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    braces = text.count("{") if len(text) <= _SHORT else 2
    if braces > 1:
        return json.loads(text, object_pairs_hook=unique_keys, **kw)
    obj = json.loads(text, **kw)
    if braces == 1 and type(obj) is dict and text.count(":") > len(obj) and _keys_upper_bound(text) > len(obj):
        return json.loads(text, object_pairs_hook=unique_keys, **kw)
    return obj


def _keys_upper_bound(text: str) -> int:
    """At least the number of object keys written in ``text``: each key's closing quote is followed
    by ``:`` or by JSON whitespace, so counting those pairs (C speed) never counts fewer.  (Each key
    also has its own ``:``, so ``text.count(":")`` is a first, cruder bound: colons inside strings,
    as in a timestamp, only make it larger.)"""
    return (text.count('":') + text.count('" ') + text.count('"\t') + text.count('"\n')
            + text.count('"\r'))
