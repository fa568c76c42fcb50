"""The trajectory ledger: an event-sourced record ledger with an immutable log.

The package face (SPEC §7.4): ``open_log(url)`` opens a log (embedded or Kafka),
``Recorder`` is the harness SDK, ``read_records(path, manifest=None)`` is the trainer reader
that iterates an export's records checking every digest, every record's structure and (given
a manifest) the exact member set, ``read_packed(path, manifest=None)`` the same for a
tree-packed export (SPEC §7.5); ``Feed(store, route, consumer)`` the online feed of a route's admitted
members for a trainer that trains while collection goes on (SPEC §11.6).  What the readers raise is one hierarchy (SPEC §11.5):
``DigestMismatch`` (and its ``PackedDigestMismatch`` and ``MemberSetMismatch``) for content
that does not match a digest or a manifest, ``RecordError`` (and ``PackedRecordError``) for a
record that breaks its format's rules, both ``ReadError``s (``ValueError``s).  Everything else
lives in the layers below (see ``docs/DESIGN.md``): ``ledger.algorithms``, ``ledger.events``,
``ledger.log``, ``ledger.projections``, ``ledger.producers``, ``ledger.runtime``, ``ledger.gateway``,
``ledger.corpus``, ``ledger.reports``, ``ledger.view``; ``ledger.cli`` is the command line.  Every error
raised on purpose is a ``LedgerError`` (``ledger.algorithms.errors``), through the class that says
what kind of wrong it is: ``InputError`` (a ``ValueError``: the caller's input is wrong),
``IntegrityError`` (a ``ValueError``: content does not match its digest, signature or proof; a
``DigestMismatch`` is one, a ``RecordError`` an ``InputError``) or ``StateError`` (a ``RuntimeError``:
the store, log or service forbids it now).  No two exception classes share a name.
"""

from ledger.algorithms.errors import InputError, IntegrityError, LedgerError, StateError
from ledger.corpus.export import read_records
from ledger.corpus.feed import Batch, Feed, FeedError
from ledger.corpus.packed import PackedDigestMismatch, PackedRecordError, read_packed
from ledger.corpus.records import DigestMismatch, MemberSetMismatch, ReadError, RecordError
from ledger.log import open_log
from ledger.producers.recorder import Recorder

__all__ = ["Batch", "DigestMismatch", "Feed", "FeedError", "InputError", "IntegrityError", "LedgerError",
           "MemberSetMismatch", "PackedDigestMismatch", "PackedRecordError", "StateError", "ReadError", "RecordError", "Recorder", "open_log", "read_packed", "read_records"]
__version__ = "0.1.0"
