"""The replay engine's decoder process (issue 33): a long replay checks digests and decodes on a second core.

Every record's *outcome* -- its decoded event, or the reason it is a dead letter (``digest mismatch``
or the codec's error) -- is a pure function of its bytes and the log's digest (:func:`outcome`).
:class:`Decoder` computes the outcomes of a run's records in a forked process that reads the same
records from its own handle on the log, in order, while the engine applies earlier ones: the engine
then only unpickles each decoded event (a third of the cost of decoding it) and applies exactly what
it would have decoded itself (``tests/test_perf_paths.py`` compares the tables of both paths, dead
letters included).  Each outcome comes back with the record's offset; the engine checks it, and a
process that fails (killed, out of memory, a log it cannot open) leaves the remaining records to be
decoded in place.

The process is forked once per run, only from a process with no other thread (forking a threaded
process may copy a lock another thread holds) and only for an embedded log (:func:`usable`).  It
opens the log anew (``type(log)(log.url)``: a SQLite handle must not cross a fork) and touches no
database or file of the engine's.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
from typing import Iterator, Sequence

from ledger.events.codec import Codec, CodecError, event_digest
from ledger.log.base import Log, LogRecord, Partition

DIGEST_MISMATCH = "digest mismatch"  # the dead-letter reason of an event whose bytes are not the log's digest
CHUNK = 256  # records per message from the process ...
CHUNK_BYTES = 2 << 20  # ... or fewer, once their values reach this size
MIN_RECORDS = 1000  # a run with fewer records to apply decodes in place (forking costs a few ms)


def outcome(codec: Codec, value: bytes, digest: bytes) -> dict | str:
    """What a record contributes to a replay: its decoded event, or (a ``str``) why it is a dead letter."""
    if event_digest(value) != digest:  # SPEC §9 "Replay trusts no byte"
        return DIGEST_MISMATCH
    try:
        return codec.decode(value)
    except CodecError as exc:
        return str(exc)


def usable(log: Log, n_records: int) -> bool:
    """Whether a run of ``n_records`` of ``log`` should use a decoder process: enough records, a second
    CPU, ``fork``, no other thread in this process, and a log that is not Kafka's (whose client runs
    threads of its own)."""
    return (n_records >= MIN_RECORDS and (os.cpu_count() or 1) > 1 and threading.active_count() == 1
            and "fork" in multiprocessing.get_all_start_methods()
            and not str(getattr(log, "url", "kafka://")).startswith("kafka://"))


def _serve(log: Log, codec: Codec, ranges: list[tuple[Partition, int, int]], outbox) -> None:
    """The process: the outcomes of ``ranges``' records, ``(offsets, outcomes)`` a chunk at a time."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process handles ^C and ends this one
    try:
        _send_outcomes(type(log)(log.url), codec, ranges, outbox)
    except Exception:  # noqa: BLE001 - whatever it is, the engine decodes the rest in place
        pass


def _send_outcomes(own: Log, codec: Codec, ranges: list[tuple[Partition, int, int]], outbox) -> None:
    for where, start, end in ranges:
        offsets, out, size = [], [], 0
        for rec in own.read(where, start, end):
            offsets.append(rec.offset)
            out.append(outcome(codec, rec.value, rec.digest))
            size += len(rec.value)
            if len(out) >= CHUNK or size >= CHUNK_BYTES:
                outbox.send_bytes(pickle.dumps((offsets, out), protocol=5))
                offsets, out, size = [], [], 0
        if out:
            outbox.send_bytes(pickle.dumps((offsets, out), protocol=5))


class Decoder:
    """A forked process computing :func:`outcome` of every record of ``ranges`` (``(partition, start,
    end)``, in the order the engine applies them); :meth:`outcomes` yields them for the engine's own
    records, which must be those same records in that order."""

    def __init__(self, log: Log, codec: Codec, ranges: list[tuple[Partition, int, int]]) -> None:
        self.codec = codec
        ctx = multiprocessing.get_context("fork")
        self._outbox, outbox_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve, args=(log, codec, ranges, outbox_w), daemon=True, name="ledger-decoder")
        self._proc.start()
        outbox_w.close()
        self._offsets: list[int] = []
        self._got: list = []
        self._at = 0  # next unread of self._got
        self._broken = False

    def outcomes(self, records: Sequence[LogRecord]) -> Iterator[dict | str]:
        """The outcomes of ``records`` (the next ones of the run, in order)."""
        for rec in records:
            if self._at == len(self._got) and not self._receive():
                self._broken = True
            if self._broken or self._offsets[self._at] != rec.offset:
                self._broken = True
                yield outcome(self.codec, rec.value, rec.digest)  # the process failed: the rest in place
                continue
            ev = self._got[self._at]
            self._got[self._at] = None  # not held past its batch
            self._at += 1
            yield ev

    def _receive(self) -> bool:
        if self._broken:
            return False
        try:
            self._offsets, self._got = pickle.loads(self._outbox.recv_bytes())
        except (EOFError, OSError):
            return False
        self._at = 0
        return bool(self._got)

    def close(self) -> None:
        self._outbox.close()  # a process still writing gets a broken pipe and ends
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
