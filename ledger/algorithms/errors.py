"""The one root of every error the ledger raises on purpose (SPEC 12.5).

Every exception class in ``ledger`` derives from :class:`LedgerError` through one of the
classes below, which say what kind of wrong it is; the CLI and the HTTP edges translate
these once (exit code / status) instead of command by command:

- :class:`InputError`: what the caller gave is wrong (a bad argument, a malformed event, a
  file that is not what it says). CLI exit 2, HTTP 400.  Also a ``ValueError``, so code that
  caught the ``ValueError`` these used to be keeps working.
- :class:`IntegrityError`: stored or shipped content does not match what proves it (a digest,
  a signature, the log). CLI exit 1 (a verification found a problem).  Also a ``ValueError``.
- :class:`StateError`: the request is well formed but the state of the store, log or service
  forbids it now (a closed execution, a fenced writer, a broker that is away). CLI exit 2,
  HTTP 409 / 503.  Also a ``RuntimeError``.

Pure: no imports beyond the standard library.
"""

from __future__ import annotations


class LedgerError(Exception):
    """The root: ``except ledger.LedgerError`` catches every error the ledger raises on purpose."""


class InputError(LedgerError, ValueError):
    """What the caller gave is wrong; the message names what and where."""


class IntegrityError(LedgerError, ValueError):
    """Content does not match what proves it (digest, signature, Merkle root, the log)."""


class StateError(LedgerError, RuntimeError):
    """Well formed, but the current state of the store, log or service forbids it."""


__all__ = ["InputError", "IntegrityError", "LedgerError", "StateError"]
