"""Stored events back to JSON lines with the ingest field names (the inverse of :mod:`ledger.events.validate`).

``ingest_line(ev)`` takes an event record as the codec decodes it from the log (``event_type``, packed
token bytes, microsecond timestamps, canonical-JSON strings) and returns the JSON line ``ledger ingest``
takes for it: ``type``, the header (``event_id``, ``occurred_at`` as RFC 3339, ``producer``, a governance
event's ``signature``) and the type's fields, each converted back (token ids and log-probs as JSON arrays,
JSON values as JSON, timestamps as RFC 3339).  Fields that are null (optional and absent) are left out;
defaults that ingest filled in (``agent_id: "main"``, empty lists) are kept: they are what the log holds.
``validate_line(ingest_line(ev))`` gives ``ev`` back (``tests/test_events_cli.py`` checks every event of
the README's corpus), except for the header fields ingest stamped, which come back as given.

A sealed request (SPEC §6.4) must be unsealed first (:func:`ledger.log.sealing.unseal`); its ``sealed``
field is never part of a line.

May import: ``ledger.algorithms`` and ``ledger.events`` (as the package says).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ledger.algorithms.tokens import unpack_logprobs, unpack_tokens
from ledger.events import validate as V

__all__ = ["ingest_line"]


def _token_list(v: bytes) -> list[int]:
    return unpack_tokens(v).tolist()


def _logprob_list(v: bytes) -> list[float]:
    return unpack_logprobs(v).tolist()


def _criteria(v: list[dict]) -> list[dict]:
    return [{k: (json.loads(x) if k == "evidence" and x is not None else x) for k, x in c.items() if x is not None}
            for c in v]


def _replacements(v: dict) -> dict:
    return {rid: {k: _token_list(x) for k, x in rep.items() if x is not None} for rid, rep in v.items()}


# converter of validate -> its inverse; lambdas of FIELDS are named by (type, field) below
_BY_CONVERTER: dict[Callable, Callable[[Any], Any]] = {
    V.timestamp_micros: V.format_micros, V.tokens: _token_list, V.logprobs: _logprob_list,
    V._json_value: json.loads, V._json_object: json.loads, V._predicates: json.loads,
    V._criteria: _criteria, V._replacements: _replacements,
}
_BY_FIELD: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("canary", "token_ids"): _token_list, ("collection_manifest", "configuration"): json.loads,
}
_INVERSE: dict[str, dict[str, Callable[[Any], Any] | None]] = {
    etype: {name: _BY_FIELD.get((etype, name), _BY_CONVERTER.get(conv)) for name, conv, _, _ in specs}
    for etype, specs in V.FIELDS.items()
}


def ingest_line(ev: dict) -> dict:
    """The JSON line of stored event ``ev`` (module doc).  Raises ``KeyError`` for an unknown event type."""
    etype = ev["event_type"]
    out: dict[str, Any] = {"type": etype, "event_id": ev["event_id"], "occurred_at": V.format_micros(ev["occurred_at"]),
                           "producer": ev["producer"]}
    if ev.get("signature") is not None:
        out["signature"] = {k: x for k, x in ev["signature"].items() if x is not None}
    for name, inverse in _INVERSE[etype].items():
        value = ev.get(name)
        if value is None:
            continue
        out[name] = value if inverse is None else inverse(value)
    return out
