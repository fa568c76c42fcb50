"""The decoded log as JSON lines with the ingest field names, for auditors (SPEC 12.4, ``ledger events``).

``log_lines(log, types=..., execution=..., keystore=...)`` reads the log in order (partition by
partition) and yields one :class:`LogLine` per event: its position and the JSON line
:func:`ledger.events.lines.ingest_line` makes of it (``type``, ``event_id``, ``occurred_at``, ...).

* ``types``: only these event types (the index names each record's type: the others are not decoded).
* ``execution``: only the events that name that execution (``execution_id``, or a derivation's
  ``derived_execution_id`` / ``parent_execution_id``).
* Sealed requests are opened with ``keystore`` (the store's ``data-keys.db``): the line holds their tokens.
  A request whose data key was destroyed (erased, SPEC §6.4) keeps its metadata and carries
  ``"erased": true`` instead of tokens; without a key store, ``"sealed": true``.
* An event that does not decode (or a ciphertext that does not open) is a ``LogLine`` with ``line``
  None and ``problem`` naming it; ``ledger audit`` says more.

An unknown type or an execution the log never opened nor derived raises :class:`EventsError` before
anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from ledger.algorithms.errors import InputError
from ledger.events.catalog import EVENT_TYPES
from ledger.events.codec import Codec, CodecError, default_codec
from ledger.events.lines import ingest_line
from ledger.log.base import Log
from ledger.log.sealing import SealError, unseal

__all__ = ["EventsError", "LogLine", "log_lines"]

_SEALED_FIELDS = ("input_ids", "input_suffix_ids", "output_ids", "output_logprobs")


class EventsError(InputError):
    """``ledger events`` was asked for something the log cannot have (an unknown type or execution)."""


@dataclass(frozen=True)
class LogLine:
    position: str
    line: dict | None
    problem: str | None = None


def _check(log: Log, types: list[str] | None, execution: str | None) -> None:
    unknown = sorted(set(types or ()) - set(EVENT_TYPES))
    if unknown:
        raise EventsError(f"unknown event type {unknown[0]!r} (known: {', '.join(sorted(EVENT_TYPES))})")
    if execution is not None:
        keys = [EVENT_TYPES["execution_opened"].natural_key({"event_type": "execution_opened", "execution_id": execution}),
                EVENT_TYPES["record_derived"].natural_key({"event_type": "record_derived",
                                                           "derived_execution_id": execution})]
        if all(log.lookup(k) is None for k in keys):
            raise EventsError(f"no execution {execution!r} in the log (never opened nor derived)")


def _names(ev: dict, execution: str) -> bool:
    return execution in (ev.get("execution_id"), ev.get("derived_execution_id"), ev.get("parent_execution_id"))


def _line(ev: dict, keystore) -> dict:
    """The ingest line of ``ev``, a sealed request opened (or marked erased / sealed)."""
    if ev.get("sealed") is None:
        return ingest_line(ev)
    plain = unseal(ev, keystore) if keystore is not None else None
    if plain is not None:
        return ingest_line(plain)
    line = {k: v for k, v in ingest_line(ev).items() if k not in _SEALED_FIELDS}
    line["erased" if keystore is not None else "sealed"] = True
    return line


def log_lines(log: Log, *, types: Iterable[str] | None = None, execution: str | None = None, keystore=None,
              codec: Codec | None = None) -> Iterator[LogLine]:
    """The log's events as ingest lines (module doc)."""
    wanted = None if types is None else list(types)
    _check(log, wanted, execution)
    codec = codec or default_codec()
    many = len(log.partitions()) > 1
    for where in log.partitions():
        for rec in log.read(where):
            if wanted is not None and rec.event_type not in wanted:
                continue
            if execution is not None and rec.key != execution and rec.event_type != "record_derived":
                continue  # every event naming an execution is keyed by it, but a derivation's parent
            position = f"{rec.stream}:{rec.partition}:{rec.offset}" if many else str(rec.offset)
            try:
                ev = codec.decode(rec.value)
                if execution is not None and not _names(ev, execution):
                    continue
                yield LogLine(position, _line(ev, keystore))
            except (CodecError, SealError, ValueError, KeyError) as exc:
                yield LogLine(position, None, f"position {position}: event {rec.event_id} cannot be read "
                                              f"({type(exc).__name__}: {exc})")
