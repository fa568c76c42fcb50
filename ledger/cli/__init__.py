"""The `ledger` command line (SPEC §7.2).  Every command calls a library function a Python
user could call too; the CLI only parses arguments and prints.

One module per command group, each defining its commands' parsers beside their handlers
(``register(subparsers)``): ``store`` (init, status, audit, log, conflicts), ``ingest`` (ingest,
ingest-sealed, import-atif, finalize), ``keys`` (keys, sign), ``project`` (project, tree),
``admission`` (cascade, admission), ``export`` (export, export-atif), ``governance`` (withdraw,
impact), ``feed``, ``manifest``, ``gateway`` (gateway, run), ``serve`` (report, serve), ``splits``
(splits, similarity), ``economics`` (credits, graders, cohort, telemetry, plan), ``events`` (the decoded
log for auditors); ``common`` holds
what they share.  This module assembles them: the global options, the groups, and ``main``, the
one place where errors become exit codes and one line on stderr.

Exit codes: 0 success, 1 a verification found a problem, 2 bad input or usage.

May import: every layer (it is the top one); nothing imports it but the console script.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys

from ledger.algorithms.errors import IntegrityError, LedgerError
from ledger.cli import (
    admission,
    economics,
    events,
    export,
    feed,
    gateway,
    governance,
    ingest,
    keys,
    manifest,
    project,
    serve,
    splits,
    store,
)
from ledger.cli.common import (
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    Subparsers,
    UsageError,
    discard_stdout,
    error_line,
    flush_stdout,
)
from ledger.cli.gateway import _gateway_of  # noqa: F401 - re-exported: tests build a gateway from parsed arguments
from ledger.corpus.manifest import ManifestError
from ledger.events.signing import SignatureError
from ledger.log import store_url
from ledger.producers.ingest import IngestError
from ledger.projections.shards import MergeError

__all__ = ["EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "UsageError", "build_parser", "main"]

GROUPS = (store, ingest, keys, project, admission, export, governance, feed, manifest, gateway, serve, splits,
          economics, events)
# The order `ledger --help` lists the commands in (the groups register by topic; the listing keeps the order
# users know).
COMMAND_ORDER = ("init", "ingest", "import-atif", "export-atif", "project", "tree", "status", "gateway", "run", "keys",
                 "sign", "audit", "log", "events", "conflicts", "cascade", "admission", "export", "finalize", "withdraw",
                 "impact", "feed", "ingest-sealed", "manifest", "report", "serve", "splits", "similarity", "credits",
                 "graders", "cohort", "telemetry", "plan")

# The edge: every error a command lets out, translated here once.  (class, exit code, label of the line
# ``ledger: LABEL: message``); the first class that matches wins, so the specific ones come first.
ERRORS: tuple[tuple[type[BaseException], int, str | None], ...] = (
    (IngestError, EXIT_USAGE, "refused (nothing appended)"),  # InputError; each bad line follows on its own line
    (SignatureError, EXIT_USAGE, "error"),  # an IntegrityError, but a badly signed submission is refused input
    (MergeError, EXIT_PROBLEM, "cannot merge"),  # StateError: partition shards that do not make one database
    (ManifestError, EXIT_PROBLEM, None),  # `manifest prove`: not a member, a manifest that does not hold
    (IntegrityError, EXIT_PROBLEM, "error"),  # a verification found a problem
    (LedgerError, EXIT_USAGE, "error"),  # InputError (and UsageError), StateError, the rest of the tree
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ledger", description="Trajectory ledger: event-sourced records for agent training.")
    ap.add_argument("--store", help="store URL: a directory (embedded) or kafka://HOST:PORT/PREFIX "
                                    "(default $LEDGER_STORE, else ./ledger-data)")
    ap.add_argument("--db", help="projection database (default inside the embedded store, else ./projections.db)")
    ap.add_argument("--trust", help="trust file (default <store>/trust.json)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    _order(sub, COMMAND_ORDER)
    return ap


def _order(sub: Subparsers, names: tuple[str, ...]) -> None:
    """List the commands in ``names``' order in the help and in argparse's "invalid choice" message."""
    assert sorted(names) == sorted(sub.choices), "COMMAND_ORDER must name every command once"
    rank = {name: i for i, name in enumerate(names)}
    sub._choices_actions.sort(key=lambda action: rank[action.dest])  # the help's command list
    parsers = dict(sub.choices)
    sub.choices.clear()
    sub.choices.update((name, parsers[name]) for name in names)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
        flush_stdout()  # `> /dev/full`: fail here, with a message, not at interpreter exit
        return code
    except BrokenPipeError:  # `ledger tree X | head`: the reader left; not an error
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        error_line("ledger: interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - the edge (SPEC §9 "No tracebacks"): one line, an exit code
        return _report(exc, args)


def _report(exc: Exception, args: argparse.Namespace) -> int:
    """One line on stderr naming ``exc`` (an IngestError adds one per bad line) and the exit code."""
    for cls, code, label in ERRORS:
        if isinstance(exc, cls):
            error_line(f"ledger: {exc}" if label is None else f"ledger: {label}: {exc}")
            if isinstance(exc, IngestError) and len(exc.errors) > 1:
                for e in exc.errors:
                    error_line(f"  {e}")
            return code
    if isinstance(exc, sqlite3.DatabaseError):  # a database of the store damaged after it opened (SPEC §9)
        error_line(f"ledger: error: a database of store {store_url(getattr(args, 'store', None))} is damaged "
                   f"({exc}); run `ledger audit`")
        return EXIT_USAGE
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
        # a write through an open stream failed (a full disk, a full stdout): name it; whatever
        # stdout still buffers goes to /dev/null so the flush at exit cannot fail again
        discard_stdout()
        error_line(f"ledger: error: cannot write output: {os.strerror(exc.errno)}")
        return EXIT_USAGE
    error_line(f"ledger: internal error: {type(exc).__name__}: {exc}")  # the safety net: a bug, named
    return EXIT_USAGE
