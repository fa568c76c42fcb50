"""The trajectory ledger: an event-sourced record ledger with an immutable log."""

from .log import open_log

__all__ = ["open_log"]
__version__ = "0.1.0"
