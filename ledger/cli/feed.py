"""The online feed (SPEC 11.6): ``feed ROUTE``, ``feed report ROUTE``, ``feed ack``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from ledger.algorithms.canonical import canonical_json
from ledger.cli.common import (
    EXIT_OK,
    EXIT_PROBLEM,
    Subparsers,
    UsageError,
    add_command,
    flush_stdout,
    open_lines,
    paths_of,
    print_json,
    stdin_lines,
)
from ledger.corpus.export import DigestMismatch, member_digest
from ledger.corpus.feed import DEFAULT_GROUP_TIMEOUT, Feed
from ledger.corpus.feed_report import format_report
from ledger.events.signing import Trust
from ledger.log import open_log
from ledger.producers.ingest import Ingestor, read_json_lines


def register(sub: Subparsers) -> None:
    _add_feed(sub)


def _add_feed(sub: Subparsers) -> None:
    sp = add_command(sub, "feed", cmd_feed, "online feed (SPEC 11.6): `feed ROUTE` prints a route's admitted trainer records as they "
             "are admitted (JSON lines, batch headers on stderr); `feed ack` acknowledges a trained batch; "
             "`feed report ROUTE` says what happened to every admitted member")
    sp.add_argument("words", nargs="+", metavar="ROUTE | ack | report ROUTE")
    sp.add_argument("--consumer", required=True, metavar="NAME", help="the trainer's name: its position and acks")
    sp.add_argument("--follow", action="store_true", help="keep following the log (SIGTERM: stop after the batch)")
    sp.add_argument("--idle-exit", type=float, metavar="SECONDS", help="with --follow: exit after SECONDS without a batch")
    sp.add_argument("--group-by", choices=("execution", "task"), default="execution",
                    help="a batch is one execution (default) or the attempts of one task, from any collection run")
    sp.add_argument("--group-size", type=int, metavar="N", help="with --group-by task: N attempts per group")
    sp.add_argument("--group-timeout", type=_seconds, default=DEFAULT_GROUP_TIMEOUT, metavar="SECONDS",
                    help=f"yield an incomplete group after SECONDS, marked partial (default {DEFAULT_GROUP_TIMEOUT:g}; "
                         "'never' waits for ever)")
    sp.add_argument("--max-staleness", type=int, metavar="K", help="hold members more than K policy versions behind")
    sp.add_argument("--stale-policy", choices=("yield", "stale"), default="yield",
                    help="yield held members oldest-first (marked stale), or give them the disposition stale on the log")
    sp.add_argument("--policy-version", type=int, metavar="V", help="the trainer's current policy version")
    sp.add_argument("--ack", action="store_true", help="acknowledge each batch at the next step once it is written "
                    "and flushed to stdout (stdout is then what was consumed: a file, a durable pipe)")
    sp.add_argument("--feed-db", metavar="PATH", help="the consumer's projection database (default <store>/feeds/NAME.db)")
    sp.add_argument("--step", type=int, metavar="N", help="feed ack: the step the batch was trained at")
    sp.add_argument("--batch", metavar="FILE|-", help="feed ack: the trainer records of the batch (JSON lines)")
    sp.add_argument("--checkpoint-id", metavar="ID", help="feed ack: the checkpoint this step produced")
    sp.add_argument("--json", action="store_true")


def _seconds(text: str) -> float | None:
    """argparse type of --group-timeout: seconds >= 0, or ``never`` (None)."""
    if text.strip().lower() == "never":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0 (or 'never')")
    return value


def cmd_feed(args: argparse.Namespace) -> int:
    """``ledger feed ROUTE``, ``ledger feed report ROUTE``, ``ledger feed ack`` (the first word picks the mode)."""
    words = list(args.words)
    if words[0] == "ack":
        if len(words) != 1:
            raise UsageError("usage: ledger feed ack --consumer NAME --step N --batch FILE")
        return _feed_ack(args)
    if words[0] == "report":
        if len(words) != 2:
            raise UsageError("usage: ledger feed report ROUTE --consumer NAME")
        return _feed_report(args, words[1])
    if len(words) != 1:
        raise UsageError(f"usage: ledger feed ROUTE --consumer NAME [--follow] (got {' '.join(words)!r})")
    return _feed_run(args, words[0])


def _open_feed(args: argparse.Namespace, route: str) -> Feed:
    return Feed(paths_of(args), route, args.consumer, group_by=args.group_by, group_size=args.group_size,
                max_staleness=args.max_staleness, group_timeout=args.group_timeout, stale_policy=args.stale_policy,
                policy_version=args.policy_version, db=args.feed_db)


def _feed_run(args: argparse.Namespace, route: str) -> int:
    """Trainer records on stdout, one JSON line each (exactly `ledger export`'s); one header line per batch on
    stderr.  With --ack each batch is acknowledged at the next step once it is written and flushed."""
    stopping = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        feed = _open_feed(args, route)
        try:
            _write_batches(args, feed, stop=lambda: bool(stopping))
        finally:
            feed.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


def _write_batches(args: argparse.Namespace, feed: Feed, stop) -> None:
    for batch in feed.batches(follow=args.follow, idle_timeout=args.idle_exit, stop=stop):
        sys.stdout.write("".join(canonical_json(r).decode("utf-8") + "\n" for r in batch.records))
        flush_stdout()
        step = None
        if args.ack:
            step = (feed.last_step or 0) + 1
            feed.ack(batch, step=step)
        print(json.dumps({**batch.header(), "acknowledged_step": step}, sort_keys=True), file=sys.stderr, flush=True)


def _feed_report(args: argparse.Namespace, route: str) -> int:
    feed = _open_feed(args, route)
    try:
        rep = feed.report()
    finally:
        feed.close()
    if args.json:
        print_json(rep)
    else:
        print(format_report(rep))
    return EXIT_OK


def _feed_ack(args: argparse.Namespace) -> int:
    """``ledger feed ack --consumer NAME --step N --batch FILE``: FILE holds the trainer records trained at step N
    (as `ledger feed` printed them); every digest is checked, then one batch_consumed is appended."""
    if args.step is None or args.batch is None:
        raise UsageError("ledger feed ack needs --step N and --batch FILE")
    members, routes = [], set()
    stream = stdin_lines() if args.batch == "-" else open_lines(args.batch)
    try:
        for n, rec in read_json_lines(stream):
            if not isinstance(rec, dict) or not {"member_id", "digest", "route"} <= set(rec):
                raise UsageError(f"{args.batch} line {n}: not a trainer record (member_id, digest, route)")
            actual = member_digest(rec)
            if actual != rec["digest"]:
                raise UsageError(str(DigestMismatch(rec["member_id"], rec["digest"], actual)))
            members.append({"member_id": rec["member_id"], "digest": rec["digest"]})
            routes.add(rec["route"])
    finally:
        if args.batch != "-":
            stream.close()
    if len(routes) != 1:
        raise UsageError(f"{args.batch}: a batch holds the records of one route (found {len(routes)})")
    line = {"type": "batch_consumed", "consumer": args.consumer, "route": routes.pop(), "step": args.step,
            "members": sorted(members, key=lambda m: m["member_id"].encode("utf-8"))}
    for k in ("checkpoint_id", "policy_version"):
        if getattr(args, k) is not None:
            line[k] = getattr(args, k)
    p = paths_of(args)
    # not the feed's writer name: a trainer reading a live `ledger feed --follow` acknowledges with this command
    # while the feed runs, and would fence it
    with open_log(p.url) as log:
        report = Ingestor(log, Trust.load(p.trust), producer=f"ledger-feed/{args.consumer}").ingest_lines([(1, line)])
    if report.conflicts:
        print(f"conflict: step {args.step} of consumer {args.consumer} is already acknowledged with other members "
              f"({report.conflicts[0]['existing_position']}); nothing appended", file=sys.stderr)
        return EXIT_PROBLEM
    print(f"step {args.step} of {args.consumer}: {len(members)} members "
          + ("acknowledged" if report.appended else "already acknowledged (duplicate)"))
    return EXIT_OK
