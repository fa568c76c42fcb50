"""The trajectory ledger: an event-sourced record ledger with an immutable log."""

from .log import open_log
from .recorder import Recorder

__all__ = ["Recorder", "open_log"]
__version__ = "0.1.0"
