"""Appending events: ``ingest`` (and its alias ``ingest-sealed``), ``import-atif``, ``finalize``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ledger.cli.common import (
    EXIT_OK,
    EXIT_PROBLEM,
    Subparsers,
    UsageError,
    add_command,
    open_lines,
    paths_of,
    print_json,
    stdin_lines,
)
from ledger.events.signing import Trust
from ledger.log import open_log
from ledger.producers.finalize import finalize_due
from ledger.producers.ingest import Ingestor, read_json_lines


_INGEST_WRITER_HELP = ("Kafka: an exclusive writer name (one process at a time): a new process of that name aborts a "
                       "transaction a killed one left open instead of readers waiting for the broker's timeout")


def register(sub: Subparsers) -> None:
    _add_ingest(sub)
    _add_import_atif(sub)
    _add_finalize(sub)
    _add_ingest_sealed(sub)


def _add_ingest(sub: Subparsers) -> None:
    sp = add_command(sub, "ingest", cmd_ingest, "validate JSON-lines events and append them atomically (request tokens sealed)")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--producer", default="ledger-ingest", help="producer name stamped on lines without one")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--per", choices=("execution", "task", "source"), default="execution",
                    help="whose data key seals request tokens (default: execution, the finest grain; erasing any "
                         "covering subject destroys it)")
    sp.add_argument("--no-seal", action="store_true",
                    help="store request tokens in the clear (public data); `withdraw --erase` then refuses these records")
    sp.add_argument("--writer", metavar="NAME", help=_INGEST_WRITER_HELP)


def cmd_ingest(args: argparse.Namespace) -> int:
    p = paths_of(args)
    trust = Trust.load(p.trust)
    stream = stdin_lines() if args.file == "-" else open_lines(args.file)
    seal = None if getattr(args, "no_seal", False) else getattr(args, "per", "execution")
    with open_log(p.url, writer=args.writer) as log:
        ingestor = Ingestor(log, trust, producer=args.producer, seal=seal)
        try:
            report = ingestor.ingest_lines(read_json_lines(stream))
        finally:
            ingestor.close()
    out = report.to_json()
    if args.json:
        print_json(out)
    else:
        sealing = f"request tokens sealed per {seal}; keys in {p.data_keys}" if seal else "request tokens NOT sealed (--no-seal)"
        print(f"appended {out['appended']}, duplicate {out['duplicates']}, conflicting {out['conflicting']} ({sealing})")
        for c in out["conflicts"]:
            print(f"  conflict: {c['event_id']}: {c['reason']} (existing position {c['existing_position']})")
    return EXIT_PROBLEM if out["conflicting"] else EXIT_OK


def _add_ingest_sealed(sub: Subparsers) -> None:
    sp = add_command(sub, "ingest-sealed", cmd_ingest_sealed, "alias of `ingest` (which seals request tokens by default)")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--per", choices=("execution", "task", "source"), default="execution",
                    help="which subject's key seals a request (default: execution, the finest grain)")
    sp.add_argument("--producer", default="ledger-ingest", help="producer name stamped on lines without one")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--writer", metavar="NAME", help=_INGEST_WRITER_HELP)


def cmd_ingest_sealed(args: argparse.Namespace) -> int:
    """`ledger ingest-sealed`: kept for compatibility; `ledger ingest` seals by default now."""
    return cmd_ingest(args)


def _add_import_atif(sub: Subparsers) -> None:
    sp = add_command(sub, "import-atif", cmd_import_atif, "import ATIF trajectories (with per-step token IDs) as events")
    sp.add_argument("files", nargs="+", metavar="FILE")


def cmd_import_atif(args: argparse.Namespace) -> int:
    from ledger.producers.atif_import import import_atif  # lazy: startup time

    p = paths_of(args)
    with open_log(p.url) as log:
        ingestor = Ingestor(log, Trust.load(p.trust), producer="atif-import")  # request tokens sealed per execution
        try:
            summary = import_atif([Path(f) for f in args.files], ingestor)
        finally:
            ingestor.close()
    print_json(summary)
    return EXIT_OK


def _add_finalize(sub: Subparsers) -> None:
    sp = add_command(sub, "finalize", cmd_finalize, "emit ExecutionFinalized for executions past their deadline (reads the clock)")
    sp.add_argument("--due", action="store_true")


def cmd_finalize(args: argparse.Namespace) -> int:
    from ledger.projections.engine import connect  # lazy: startup time

    if not args.due:
        raise UsageError("say --due to finalize every execution whose deadline has passed")
    p = paths_of(args)
    with open_log(p.url) as log:
        due, report = finalize_due(connect(p.db), Ingestor(log, Trust.load(p.trust), producer="ledger-finalize"))
    print(f"finalized {report.appended} execution(s) past their deadline ({report.duplicates} already finalized)")
    for ex in due:
        print(f"  {ex}")
    return EXIT_OK
