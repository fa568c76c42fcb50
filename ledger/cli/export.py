"""Trainer records out: ``export ROUTE`` (SPEC 7.3) and ``export-atif EXECUTION`` (SPEC 7.7).

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from ledger.cli.common import (
    EXIT_OK,
    Subparsers,
    UsageError,
    add_command,
    as_usage,
    atomic_out,
    ident,
    out_path,
    paths_of,
    print_json,
    projected_db,
    write_error,
)
from ledger.corpus.export import export
from ledger.corpus.preference_export import is_pair_route


def register(sub: Subparsers) -> None:
    _add_export_atif(sub)
    _add_export(sub)


def _add_export(sub: Subparsers) -> None:
    sp = add_command(sub, "export", cmd_export, "export a route's trainer records (SPEC 7.3) with digests")
    sp.add_argument("route", type=ident)
    sp.add_argument("--out", required=True, metavar="FILE")
    sp.add_argument("--format", choices=["jsonl", "parquet", "tree", "packed", "packed-parquet"], default="jsonl",
                    help="packed / packed-parquet: one tree-packed record per execution (SPEC 7.5)")


def cmd_export(args: argparse.Namespace) -> int:
    from ledger.projections.admission import current_routes  # lazy: startup time

    out = out_path(args.out)
    db = projected_db(args, "routes")
    if args.route not in current_routes(db):
        raise UsageError(f"no route {args.route!r} (declared: {', '.join(sorted(current_routes(db))) or 'none'})")

    if args.format not in ("jsonl", "parquet") and is_pair_route(db, args.route):
        raise UsageError(f"route {args.route!r} is a preference route: its members are pairs (SPEC 6.9); use "
                         f"--format jsonl or parquet, not {args.format}")
    if out is None:  # --out -: the records on stdout, the summary on stderr
        if args.format in ("parquet", "packed-parquet"):  # parquet needs a seekable file: write one, then copy it out
            with tempfile.TemporaryDirectory(prefix="ledger-export-") as tmp:
                summary = export(db, args.route, Path(tmp) / "export.parquet", args.format)
                with open(Path(tmp) / "export.parquet", "rb") as fh:
                    shutil.copyfileobj(fh, sys.stdout.buffer)
        else:
            summary = export(db, args.route, sys.stdout, args.format)
        sys.stdout.flush()
        print(json.dumps(summary, indent=2, sort_keys=True), file=sys.stderr)
        return EXIT_OK
    with atomic_out(out) as target:
        summary = export(db, args.route, target, args.format)
    print_json(summary)
    return EXIT_OK


def _add_export_atif(sub: Subparsers) -> None:
    sp = add_command(sub, "export-atif", cmd_export_atif, "write an execution as ATIF trajectories with exact token IDs (SPEC 7.7)")
    sp.add_argument("execution_id", type=ident)
    sp.add_argument("--out", required=True, metavar="FILE|-", help="root trajectory file (further branches go to "
                    "FILE-stem.cont-N.json beside it); - writes one document, branches inline, to stdout")


def cmd_export_atif(args: argparse.Namespace) -> int:
    from ledger.corpus.atif_export import build_atif  # lazy: startup time
    from ledger.projections.registry import store_keystore  # lazy: startup time

    out = out_path(args.out)
    db = projected_db(args, "executions")
    keystore = store_keystore(paths_of(args))  # recognises an execution whose data key was destroyed
    try:
        with as_usage(KeyError):  # no such execution
            result = build_atif(db, args.execution_id, keystore=keystore, root_name=None if out is None else out.name)
    finally:
        db.close()
        if keystore is not None:
            keystore.close()
    summary = dict(result.summary)
    if out is None:  # --out -: one document (branches inline) on stdout, the summary on stderr
        sys.stdout.write(json.dumps(result.root, ensure_ascii=False) + "\n")
        sys.stdout.flush()
        print(json.dumps(summary, indent=2, sort_keys=True), file=sys.stderr)
        return EXIT_OK
    files = [(out if name is None else out_path(str(out.parent / name)), doc) for name, doc in result.documents]
    with contextlib.ExitStack() as stack:  # every file to a temporary beside it; renamed only when all are written
        targets = [(p, stack.enter_context(atomic_out(p)), doc) for p, doc in files]
        for p, target, doc in targets:
            try:
                with open(target, "w", encoding="utf-8") as fh:
                    json.dump(doc, fh, ensure_ascii=False, indent=1)
                    fh.write("\n")
            except OSError as exc:
                raise write_error(p, exc) from None
    summary["files"] = [str(p) for p, _ in files]
    print_json(summary)
    return EXIT_OK
