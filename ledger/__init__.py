"""The trajectory ledger: an event-sourced record ledger with an immutable log.

The package face (SPEC §7.4): ``open_log(url)`` opens a log (embedded or Kafka),
``Recorder`` is the harness SDK, ``read_records(path)`` is the trainer reader that iterates
an export's records and checks every digest, ``read_packed(path)`` the same for a
tree-packed export (SPEC §7.5), ``Feed(store, route, consumer)`` the online feed of a route's admitted
members for a trainer that trains while collection goes on (SPEC §11.6).  Everything else lives in the layers below
(see ``docs/DESIGN.md``): ``ledger.algorithms``, ``ledger.events``, ``ledger.log``,
``projections``, ``ledger.producers``, ``ledger.runtime``, ``ledger.corpus``,
``ledger.reports``; ``ledger.cli`` is the command line.
"""

from ledger.corpus.export import read_records
from ledger.corpus.feed import Batch, Feed, FeedError
from ledger.corpus.packed import read_packed
from ledger.log import open_log
from ledger.producers.recorder import Recorder

__all__ = ["Batch", "Feed", "FeedError", "Recorder", "open_log", "read_packed", "read_records"]
__version__ = "0.1.0"
