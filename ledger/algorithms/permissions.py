"""Effective use permissions as a function of the SET of permission events (SPEC §6.4).

Pure: no I/O, no clock, no order.  The inputs are PermissionChanged events (dicts with at
least ``event_id``, ``subject``, ``use``, ``action`` and optional ``supersedes``); the
output depends only on which events are in the set, never on the order they arrived in,
so every interleaving of log partitions converges to the same permissions.

Rules
-----
* **Deny by default.**  A record may serve use ``U`` only if an effective grant for ``U``
  (or for ``*``) covers it through one of its subjects (``execution:ID``, ``task:ID``,
  ``source:ID`` or ``*``) and no effective revocation covers it.
* **Revocation beats grant** whatever the order of arrival: a revocation of ``U`` (or of
  ``*``) on any covering subject denies ``U``, even if a grant on the same or a more
  specific subject exists.
* **A grant lifts a revocation only by naming it**: grant ``G`` lifts revocation ``R`` iff
  ``G.supersedes == R.event_id``, ``G.subject == R.subject`` and ``G.use`` is ``R.use`` or
  ``*``.  A ``supersedes`` that names anything else (a grant, a revocation of another
  subject or a narrower use, an unknown id) lifts nothing; it is reported in the note.  A
  lifted revocation stays in the history (status ``lifted``); a later, new revocation
  (another event id) denies again until a grant names *it*.
* ``supersedes`` on a revocation has no effect (a revocation wins anyway).
* A grant or revocation for use ``*`` covers every use; a route whose use is ``*`` is
  covered only by a grant for ``*`` and is denied by a revocation of any use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ledger.algorithms.errors import InputError

USES = ("sft", "preference", "rl", "evaluation", "publication")
ALL = "*"


@dataclass(frozen=True, order=True)
class Entry:
    """One permission event and what it does in the current set."""

    subject: str
    use: str
    action: str  # grant | revoke
    event_id: str
    status: str  # effective | lifted
    note: str = ""
    lifted_by: str | None = None
    authority: str = ""


def _norm(events: Iterable[Mapping]) -> dict[str, Mapping]:
    """Deduplicate by event id (the log's idempotency makes equal ids equal content)."""
    out: dict[str, Mapping] = {}
    for ev in events:
        eid = ev["event_id"]
        if eid not in out or _sort_key(ev) < _sort_key(out[eid]):
            out[eid] = ev  # a conflicting duplicate cannot reach the log; keep a deterministic one anyway
    return out


def _sort_key(ev: Mapping) -> tuple:
    return (ev["subject"], ev["use"], ev["action"], ev.get("supersedes") or "", ev.get("authority") or "")


def resolve(events: Iterable[Mapping]) -> list[Entry]:
    """Every permission event with its status, sorted (subject, use, action, event_id)."""
    evs = _norm(events)
    lifters: dict[str, list[str]] = {}
    notes: dict[str, str] = {}
    for eid, ev in evs.items():
        if ev["action"] != "grant" or not ev.get("supersedes"):
            continue
        target = evs.get(ev["supersedes"])
        if target is None:
            notes[eid] = f"supersedes {ev['supersedes']}, which is not (yet) on the log: lifts nothing"
        elif target["action"] != "revoke":
            notes[eid] = f"supersedes {ev['supersedes']}, which is not a revocation: lifts nothing"
        elif target["subject"] != ev["subject"] or ev["use"] not in (target["use"], ALL):
            notes[eid] = (f"supersedes {ev['supersedes']} ({target['subject']} {target['use']}), which it does not cover "
                          f"({ev['subject']} {ev['use']}): lifts nothing")
        else:
            lifters.setdefault(ev["supersedes"], []).append(eid)
            notes[eid] = f"lifts revocation {ev['supersedes']}"
    out = []
    for eid, ev in evs.items():
        lifted_by = min(lifters[eid]) if eid in lifters else None
        status = "lifted" if (ev["action"] == "revoke" and lifted_by is not None) else "effective"
        note = notes.get(eid, "")
        if ev["action"] == "revoke" and ev.get("supersedes"):
            note = "supersedes on a revocation has no effect"
        if lifted_by is not None:
            note = f"lifted by grant {lifted_by}"
        out.append(Entry(ev["subject"], ev["use"], ev["action"], eid, status, note, lifted_by, ev.get("authority") or ""))
    out.sort()
    return out


def effective(events: Iterable[Mapping]) -> dict[tuple[str, str], str]:
    """(subject, use) -> ``"revoke"`` if an unlifted revocation exists, else ``"grant"``.

    Pairs with neither an effective grant nor an effective revocation are absent (deny by
    default).  Equal sets of events give equal dictionaries, whatever the order."""
    out: dict[tuple[str, str], str] = {}
    for e in resolve(events):
        if e.status != "effective":
            continue
        key = (e.subject, e.use)
        if e.action == "revoke" or key not in out:
            out[key] = e.action
    return dict(sorted(out.items()))


def _use_matches(entry_use: str, use: str, action: str) -> bool:
    if entry_use == ALL or entry_use == use:
        return True
    # a route for every use is denied by the revocation of any one use
    return use == ALL and action == "revoke"


def decide(entries: Sequence[Entry], subjects: Sequence[str], use: str, *, describe: str | None = None) -> tuple[str, str]:
    """``("pass"|"fail", reason)`` for ``use`` of a record covered by ``subjects``.

    ``subjects`` lists the record's covering subjects, most specific first (e.g. the
    execution, its parent views, the task, the source, ``*``); the reason names the first
    deciding event in that order (ties broken by event id)."""
    if use != ALL and use not in USES:
        raise InputError(f"unknown use {use!r} (known: {', '.join(USES)}, *)")
    order = {s: i for i, s in enumerate(dict.fromkeys(subjects))}
    covering = sorted((e for e in entries if e.status == "effective" and e.subject in order),
                      key=lambda e: (order[e.subject], e.event_id))
    for e in covering:
        if e.action == "revoke" and _use_matches(e.use, use, "revoke"):
            return "fail", f"use {use} revoked on {e.subject} by {e.event_id} ({e.authority or 'no authority'})"
    for e in covering:
        if e.action == "grant" and _use_matches(e.use, use, "grant"):
            return "pass", f"use {use} granted on {e.subject} by {e.event_id} ({e.authority or 'no authority'})"
    what = describe or ", ".join(order)
    return "fail", f"no grant covers {use} for {what} (deny by default)"
