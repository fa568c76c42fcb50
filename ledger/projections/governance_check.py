"""Re-verification of governance signatures on replay (SPEC §4.3).

A governance event that reached the log without a trusted signature (a rogue producer
writing to Kafka directly) is ignored by every projection and reported by `ledger audit`.
"""

from __future__ import annotations

import json

from ledger.events import semantics
from ledger.events.catalog import EVENT_TYPES
from ledger.events.signing import SignatureError, Trust
from ledger.events.validate import ValidationError, validate_line

_IGNORED = {"event_id", "occurred_at", "producer", "stamped", "signature", "signed_body"}


def governance_problem(ev: dict, trust: Trust) -> str | None:
    """Why ``ev`` must be ignored, or ``None`` when it may take effect."""
    et = EVENT_TYPES.get(ev["event_type"])
    if et is None or not et.governance:
        return None
    sig, body = ev.get("signature"), ev.get("signed_body")
    if sig is None:
        return "unsigned governance event" if et.signed else None
    if body is None:
        return "signature without signed_body"
    try:
        trust.verify(et.type, body.encode("utf-8"), sig)
        obj = json.loads(body)
        # the semantics version is stamped at ingest (unsigned): re-check the body under the rules
        # the event was accepted with, not under this release's
        in_force = semantics.of_route(ev.get("semantics")) if et.type == "admission_policy" else None
        signed = validate_line(obj, now_micros=ev["occurred_at"], route_semantics=in_force, on_log=True)
    except (SignatureError, ValidationError, ValueError) as exc:
        return f"governance signature rejected: {exc}"
    stamped = set(signed["stamped"]) | ({"semantics"} if et.type == "admission_policy" else set())
    if et.type == "canary" and "token_ids" in (ev.get("stamped") or ()):
        stamped.add("token_ids")  # a text canary's tokens, stamped at ingest (SPEC 11.2): not in the signed body
    mismatch = [k for k, v in signed.items() if k not in _IGNORED and k not in stamped and ev.get(k) != v]
    if mismatch:
        return f"signed body disagrees with the event on {', '.join(sorted(mismatch))}"
    return None
