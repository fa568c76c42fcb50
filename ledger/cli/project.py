"""Projections: ``project`` (once, ``--follow`` a Kafka log, ``--merge-shards``) and ``tree``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from ledger.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    UsageError,
    add_command,
    as_usage,
    error_line,
    ident,
    paths_of,
    print_json,
    progress_bar,
    projected_db,
)
from ledger.events.signing import Trust
from ledger.log import LogError, open_log


def register(sub: Subparsers) -> None:
    _add_project(sub)
    _add_tree(sub)


def _add_project(sub: Subparsers) -> None:
    sp = add_command(sub, "project", cmd_project, "bring every projection up to date")
    sp.add_argument("--rebuild", action="store_true", help="drop the projection database and replay from zero")
    sp.add_argument("--follow", action="store_true",
                    help="Kafka: keep running and apply new events as they arrive (SIGTERM/SIGINT: finish the batch, exit 0)")
    sp.add_argument("--group", metavar="NAME", help="with --follow: join consumer group NAME and project only the "
                                                    "executions partitions it assigns (state per partition in --state-dir)")
    sp.add_argument("--state-dir", metavar="DIR", help="with --group: partition shards executions-<p>.db, on storage every "
                                                       "projector of the group reaches (default ./projector-state)")
    sp.add_argument("--merge-shards", metavar="DIR", help="merge the partition shards in DIR into --db (equal to a "
                                                          "single-process replay) and exit")
    sp.add_argument("--skip-table", action="append", metavar="TABLE", help="with --merge-shards: leave TABLE out")
    sp.add_argument("--batch", type=int, default=500, metavar="N", help="with --follow: records per transaction")
    sp.add_argument("--stats", metavar="FILE", help="with --follow: keep FILE updated with throughput, positions, "
                                                   "latency and peak RSS (JSON)")
    sp.add_argument("--idle-exit", type=float, metavar="SECONDS", help="with --follow: exit after SECONDS without records")
    sp.add_argument("--throttle", type=float, default=0.0, metavar="SECONDS",
                    help="with --follow: sleep after every batch (testing: a slow projector)")
    sp.add_argument("--extra-projection", action="append", metavar="MODULE:CLASS",
                    help="with --follow: also maintain this projection (plugins, tests)")
    sp.add_argument("--consumer-config", action="append", metavar="KEY=VALUE",
                    help="with --follow: librdkafka consumer setting (e.g. session.timeout.ms=10000)")
    sp.add_argument("--journal-mode", choices=("wal", "delete"), default="wal",
                    help="with --follow: SQLite journal of the state files (delete: state on a network filesystem)")
    sp.add_argument("--json", action="store_true", help="with --merge-shards: the merge report as JSON")


def cmd_project(args: argparse.Namespace) -> int:
    from ledger.projections.registry import open_engine, store_keystore  # lazy: startup time

    if args.merge_shards:
        return _merge_shards(args)
    if args.follow:
        return _follow(args)
    if args.group:
        raise UsageError("--group needs --follow (a consumer-group member keeps following the log)")
    p = paths_of(args)
    keystore = store_keystore(p)  # opens sealed requests; None when this store never sealed any
    try:
        with open_log(p.url) as log:
            engine = open_engine(log, p.db, Trust.load(p.trust), keystore=keystore)
            if args.rebuild:
                engine.rebuild()
            stats = engine.run(progress=progress_bar("project"))
            scrubbed = engine.scrub()
    finally:
        if keystore is not None:
            keystore.close()
    print(f"applied {stats.applied}, rejected {stats.rejected}, dead letters {stats.dead_letters}")
    if not scrubbed:
        error_line(f"ledger: note: {p.db}: another process keeps its WAL open, so the WAL of an erase purge could not "
                    "be truncated yet; the next `ledger project` does it (`ledger audit` reports it meanwhile)")
    return EXIT_OK


def _follow(args: argparse.Namespace) -> int:
    """``project --follow [--group NAME --state-dir DIR]``: a projector process (ledger.runtime.projector)."""
    import logging  # lazy: startup time

    from ledger.runtime.projector import Projector, load_projection  # lazy: startup time
    from ledger.projections.registry import all_projections, store_keystore  # lazy: startup time

    p = paths_of(args)
    if not p.is_kafka:
        raise UsageError("--follow needs a Kafka store (--store kafka://HOST:PORT/PREFIX); the embedded log has one "
                         "writer and is projected with `ledger project`")
    if args.rebuild:
        raise UsageError("--rebuild cannot be combined with --follow (delete the state and start the projector)")
    with as_usage(ValueError, ImportError, AttributeError):  # a MODULE:CLASS or KEY=VALUE that does not hold
        extra = [load_projection(spec) for spec in args.extra_projection or []]
        config = dict(_key_value(kv) for kv in args.consumer_config or [])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="ledger projector[%(process)d] %(levelname)s %(message)s")
    logging.getLogger("ledger.log").setLevel(logging.WARNING)
    keystore = store_keystore(p)
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.getLogger("ledger.projector").info("signal %d: finishing the current batch, then leaving", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def factory() -> list:
        return [*all_projections(keystore=keystore), *[type(x)() for x in extra]]

    state_dir = args.state_dir or "projector-state"
    try:
        projector = Projector(p.url, Trust.load(p.trust), group=args.group, state_dir=state_dir if args.group else None,
                              db=None if args.group else p.db, projections_factory=factory, batch=args.batch,
                              throttle=args.throttle, stats_path=args.stats, consumer_config=config,
                              journal_mode=args.journal_mode)
        stats = projector.run(stop, idle_exit=args.idle_exit)
    except (ValueError, RuntimeError) as exc:  # a state directory of another log, a database held by another projector
        if isinstance(exc, LogError):
            raise
        print(f"ledger: projector stopped: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if keystore is not None:
            keystore.close()
    lat = stats.latency_ms()
    print(f"applied {stats.applied}, rejected {stats.rejected}, dead letters {stats.dead_letters}"
          + (f"; produce-to-applied latency p50 {lat['p50']} ms, p99 {lat['p99']} ms" if lat.get("n") else ""))
    return EXIT_OK


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    for conv in (int, float):
        try:
            return key, conv(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def _merge_shards(args: argparse.Namespace) -> int:
    """``project --merge-shards DIR [--db OUT]``: one projection database from the partition shards."""
    from ledger.projections.shards import merge_shards  # lazy: startup time

    if args.follow or args.group or args.rebuild:
        raise UsageError("--merge-shards cannot be combined with --follow, --group or --rebuild")
    p = paths_of(args)
    report = merge_shards(args.merge_shards, p.db, skip_tables=args.skip_table or ())  # MergeError: exit 1 (main)
    lag = {}
    if p.is_kafka:
        try:
            with open_log(p.url) as log:
                for (stream, part), end in log.end_offsets().items():
                    have = report.positions.get(f"{stream}:{part}", 0)
                    if end > have:
                        lag[f"{stream}:{part}"] = end - have
        except LogError as exc:
            lag = {"unknown": str(exc)}
    out = {**report.to_json(), "behind_log_end": lag}
    if args.json:
        print_json(out)
    else:
        print(f"merged {len(report.shards)} shards into {p.db} at governance offset {report.governance_position}; "
              f"positions {json.dumps(report.positions, sort_keys=True)}"
              + (f"; behind the log end: {json.dumps(lag, sort_keys=True)}" if lag else ""))
    return EXIT_OK


def _add_tree(sub: Subparsers) -> None:
    sp = add_command(sub, "tree", cmd_tree, "show an execution's prefix tree")
    sp.add_argument("execution_id", type=ident)
    sp.add_argument("--json", action="store_true", help="the contract JSON shape (SPEC 7.2)")


def cmd_tree(args: argparse.Namespace) -> int:
    from ledger.projections.tree import tree_json, tree_text  # lazy: startup time

    db = projected_db(args, "executions")
    with as_usage(KeyError):
        if args.json:
            print_json(tree_json(db, args.execution_id))
        else:
            print(tree_text(db, args.execution_id))
    return EXIT_OK
