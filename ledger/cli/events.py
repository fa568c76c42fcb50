"""The decoded log for auditors (SPEC 12.4): ``events [--type T]... [--execution E] [--json]``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys

from ledger.cli.common import EXIT_OK, EXIT_PROBLEM, Subparsers, add_command, error_line, ident, paths_of
from ledger.corpus.log_lines import log_lines
from ledger.log import open_log
from ledger.projections.registry import store_keystore


def register(sub: Subparsers) -> None:
    sp = add_command(sub, "events", cmd_events, "the decoded log (SPEC 12.4): one JSON line per event with the ingest "
                     "field names (type, event_id, occurred_at, ...; tokens as id arrays, sealed requests opened), "
                     "in log order; --type and --execution select")
    sp.add_argument("--type", dest="types", action="append", metavar="T",
                    help="only events of type T (repeat for several)")
    sp.add_argument("--execution", type=ident, metavar="E", help="only the events that name execution E")
    sp.add_argument("--json", action="store_true", help="JSON lines (without: position, type and event id per line)")


def cmd_events(args: argparse.Namespace) -> int:
    """Every selected event on stdout; an event that cannot be read is named on stderr (exit 1)."""
    p = paths_of(args)
    keystore = store_keystore(p)
    problems = 0
    try:
        with open_log(p.url) as log:
            for item in log_lines(log, types=args.types, execution=args.execution, keystore=keystore):
                if item.line is None:
                    problems += 1
                    error_line(f"ledger: {item.problem}")
                elif args.json:
                    sys.stdout.write(json.dumps(item.line, ensure_ascii=False, separators=(",", ":")) + "\n")
                else:
                    sys.stdout.write(f"{item.position}\t{item.line['type']}\t{item.line['event_id']}\n")
    finally:
        if keystore is not None:
            keystore.close()
    return EXIT_PROBLEM if problems else EXIT_OK
