"""Production feedback as an outcome predicate (SPEC §6.10; seed 002 §15.7.3, Table 11).

The ledger-computed predicate ``feedback`` (family ``outcome``) reads an execution's latest
consented production signal -- the one with the greatest ``(occurred_at, event_id)``, an order
independent of log order.  Signals without a ``consent_ref`` are not evidence and are ignored.

* ``accepted`` -> pass; ``rating`` -> pass when ``value >= RATING_PASS`` (ratings are normalised
  to [0, 1]), else fail;
* ``abandoned``, ``corrected_mid_task`` -> fail;
* ``edited`` -> unknown (an edit may be a correction, style, or changed requirements: the edit must
  be checked against the task before it labels anything, Table 11);
* no consented signal -> pending.

Feedback is an outcome condition only: it runs inside the cascade after ``permitted_use``, so it
never admits a record that has no permission.  Pure: plain tuples in, a verdict out.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["RATING_PASS", "SIGNALS", "feedback_verdict"]

SIGNALS = ("accepted", "edited", "corrected_mid_task", "abandoned", "rating")
RATING_PASS = 0.8


def feedback_verdict(signals: Iterable[tuple[int, str, str, float | None, str | None]]) -> tuple[str, str, str | None]:
    """``signals``: ``(occurred_at, event_id, signal, value, consent_ref)``.  Returns
    ``(verdict, reason, missing_evidence)``."""
    consented = [s for s in signals if s[4]]
    if not consented:
        return "pending", "no consented production feedback", "production_feedback with consent_ref"
    at, eid, signal, value, consent = max(consented, key=lambda s: (s[0], s[1]))
    where = f"{signal} ({eid}, consent {consent})"
    if signal == "accepted":
        return "pass", f"latest feedback: {where}", None
    if signal == "rating":
        if value is not None and value >= RATING_PASS:
            return "pass", f"latest feedback: rating {value:g} >= {RATING_PASS:g} ({eid})", None
        return "fail", f"latest feedback: rating {value if value is None else format(value, 'g')} below {RATING_PASS:g} ({eid})", None
    if signal == "edited":
        return "unknown", f"latest feedback: {where}; an edit must be checked against the task before it labels the " \
                          "output", "check of the edited output"
    return "fail", f"latest feedback: {where}", None
