"""Economics (seed 002 §15.7-15.10): ``credits status``, ``graders``, ``cohort report``, ``telemetry``, ``plan``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import sys

from ledger.cli.common import (
    EXIT_OK,
    Subparsers,
    UsageError,
    add_command,
    as_usage,
    ident,
    paths_of,
    print_json,
    progress_bar,
)
from ledger.events.signing import Trust
from ledger.events.validate import ValidationError
from ledger.log import open_log
from ledger.reports.plan import collector_plan
from ledger.reports.plan import format_plan as format_collector_plan


def register(sub: Subparsers) -> None:
    _add_credits(sub)
    _add_graders(sub)
    _add_cohort(sub)
    _add_telemetry(sub)
    _add_plan(sub)


def _live_db(args: argparse.Namespace):
    """The store's projection database, brought up to date (for read-only reports)."""
    from ledger.corpus.publish import projections  # lazy: startup time
    from ledger.projections.engine import ReplayEngine, connect  # lazy: startup time
    from ledger.projections.registry import store_keystore  # lazy: startup time

    p = paths_of(args)
    keystore = store_keystore(p)  # sealed requests open with the store's data keys
    try:
        with open_log(p.url) as log:
            engine = ReplayEngine(log, connect(p.db), projections(keystore), trust=Trust.load(p.trust))
            engine.run(progress=progress_bar("project"))
    finally:
        if keystore is not None:
            keystore.close()
    return engine.db


def _add_credits(sub: Subparsers) -> None:
    credits = sub.add_parser("credits", help="collection-credit pools (seed 002 15.8.2)").add_subparsers(
        dest="credits_command", required=True)
    _add_credits_status(credits)


def _add_credits_status(credits: Subparsers) -> None:
    sp = credits.add_parser("status", help="credits held, watermark, hard limit, drain and exhaustion times per pool")
    sp.set_defaults(fn=cmd_credits_status)
    sp.add_argument("pool", type=ident, nargs="?", metavar="POOL")
    sp.add_argument("--json", action="store_true")


def cmd_credits_status(args: argparse.Namespace) -> int:
    from ledger.producers.credit_client import format_pool  # lazy: startup time
    from ledger.projections.credits import credit_pools, pool_status  # lazy: startup time

    db = _live_db(args)
    try:
        pools = [args.pool] if args.pool else credit_pools(db)
        out = {name: pool_status(db, name) for name in pools}
    finally:
        db.close()
    if args.pool and out[args.pool] is None:
        raise UsageError(f"no credit pool {args.pool!r} (declare it with a credit_pool_declared event)")
    if args.json:
        print_json(out)
    elif not out:
        print("no credit pool declared")
    else:
        print("\n".join(format_pool(st) for st in out.values()))
    return EXIT_OK


def _add_graders(sub: Subparsers) -> None:
    sp = add_command(sub, "graders", cmd_graders, "evaluator versions against their adequate/inadequate controls: misclassifications, "
             "false acceptance and false rejection rates, calibrated yes/no (SPEC 6.10)")
    sp.add_argument("--json", action="store_true")


def cmd_graders(args: argparse.Namespace) -> int:
    """`ledger graders`: each evaluator version's controls, misclassifications, false acceptance and
    false rejection rates, calibrated yes/no (SPEC 6.10; ledger.projections.verifier.graders)."""
    from ledger.projections.verifier import format_graders, graders  # lazy: startup time

    db = _live_db(args)
    try:
        rows = graders(db)
    finally:
        db.close()
    if args.json:
        print_json(rows)
    else:
        print(format_graders(rows))
    return EXIT_OK


def _add_cohort(sub: Subparsers) -> None:
    cohort = sub.add_parser("cohort", help="collection cohorts (collection_run_id)").add_subparsers(
        dest="cohort_command", required=True)
    _add_cohort_report(cohort)


def _add_cohort_report(cohort: Subparsers) -> None:
    sp = cohort.add_parser("report", help="dispositions of every attempt at a cutoff, emission yield and cost per "
                                          "emitted artifact (seed 002 table 15, equation 5)")
    sp.set_defaults(fn=cmd_cohort_report)
    sp.add_argument("cohort", type=ident, metavar="COHORT", help="the collection_run_id of the attempts")
    sp.add_argument("--cutoff", metavar="T", help="RFC 3339; only events with occurred_at <= T count "
                                                  "(default: the live projections)")
    sp.add_argument("--route", type=ident, action="append", metavar="ROUTE",
                    help="the consumer's route(s) (default: every route)")
    sp.add_argument("--per-task-cap", type=int, metavar="K", help="emit at most K attempts per task (the rest: redundancy)")
    sp.add_argument("--attempts", action="store_true", help="with --json: every attempt's disposition")
    sp.add_argument("--json", action="store_true")


def cmd_cohort_report(args: argparse.Namespace) -> int:
    from ledger.reports.cohort import cohort_report, format_cohort  # lazy: startup time

    try:
        with as_usage(KeyError):  # no such route, no executions projected
            rep = cohort_report(paths_of(args), args.cohort, cutoff=args.cutoff, routes=args.route or None,
                                per_task_cap=args.per_task_cap, include_attempts=args.attempts,
                                progress=progress_bar("replay"))
    except ValidationError as exc:  # the one event-field value of the command line
        raise UsageError(f"--cutoff: {exc}") from None
    if rep["attempts"] == 0:
        print(f"ledger: no attempts in cohort {args.cohort!r} (collection_run_id) at the cutoff", file=sys.stderr)
    if args.json:
        print_json(rep)
    else:
        print(format_cohort(rep))
    return EXIT_OK


def _add_telemetry(sub: Subparsers) -> None:
    sp = add_command(sub, "telemetry", cmd_telemetry, "self-improvement loop telemetry per fixture and round (seed 002 15.7)")
    sp.add_argument("--threshold", type=float, default=1.0, help="pass = reward >= THRESHOLD (default 1.0)")
    sp.add_argument("--k", type=int, help="k of pass@k (default: the scored attempts of each fixture and round)")
    sp.add_argument("--retention-cap", type=int, metavar="N", help="flag fixtures with more than N retained per round")
    sp.add_argument("--held-out", default="dev,final_test", metavar="SPLITS", help="held-out splits (default dev,final_test)")
    sp.add_argument("--include-args", action="store_true", help="tool arguments are part of a normalised action")
    sp.add_argument("--collapse-repeats", action="store_true", help="consecutive identical actions count once")
    sp.add_argument("--json", action="store_true")


def cmd_telemetry(args: argparse.Namespace) -> int:
    from ledger.reports.telemetry import format_telemetry, loop_telemetry  # lazy: startup time

    db = _live_db(args)
    try:
        rep = loop_telemetry(db, threshold=args.threshold, k=args.k, retention_cap=args.retention_cap,
                             held_out_splits=[s.strip() for s in args.held_out.split(",") if s.strip()],
                             include_args=args.include_args, collapse_repeats=args.collapse_repeats)
    finally:
        db.close()
    if args.json:
        print_json(rep)
    else:
        print(format_telemetry(rep))
    return EXIT_OK


def _add_plan(sub: Subparsers) -> None:
    sp = add_command(sub, "plan", cmd_plan, "binding stage and planned admitted rate of a collector (seed 002 equation 4)")
    sp.add_argument("--accelerators", type=int, required=True, metavar="A")
    sp.add_argument("--gen-seconds", type=float, required=True, metavar="G", help="accelerator-seconds per attempt")
    sp.add_argument("--verifier-slots", type=int, required=True, metavar="W")
    sp.add_argument("--check-seconds", type=float, metavar="T", help="slot-seconds of checking per attempt (equation 1)")
    sp.add_argument("--yield", dest="route_yield", type=float, metavar="Y", help="route yield (admitted / attempted)")
    sp.add_argument("--route", type=ident, metavar="ROUTE",
                    help="take --check-seconds / --yield from ROUTE's measured cascade plan")
    sp.add_argument("--record-ceiling", required=True, metavar="SIZE", help="per-record ceiling, e.g. 8MB (MB = 10^6 B)")
    sp.add_argument("--write-bandwidth", required=True, metavar="SIZE", help="sustained store writes per second, e.g. 200MB")
    sp.add_argument("--accelerator-price", type=float, metavar="USD_PER_H", help="price an accelerator-hour")
    sp.add_argument("--slot-price", type=float, metavar="USD_PER_H", help="price a verifier slot-hour")
    sp.add_argument("--json", action="store_true")


def cmd_plan(args: argparse.Namespace) -> int:
    check, yld = args.check_seconds, args.route_yield
    if args.route:
        from ledger.projections.admission import cascade_plan  # lazy: startup time

        db = _live_db(args)
        try:
            with as_usage(KeyError):  # no such route
                cp = cascade_plan(db, args.route).chosen
        finally:
            db.close()
        check = cp.seconds_per_attempted if check is None else check
        yld = cp.route_yield if yld is None else yld
    if check is None or yld is None:
        raise UsageError("give --check-seconds and --yield (or --route ROUTE to take them from its measured cascade)")
    plan = collector_plan(accelerators=args.accelerators, gen_seconds=args.gen_seconds,
                          verifier_slots=args.verifier_slots, check_seconds=check, route_yield=yld,
                          record_ceiling=args.record_ceiling, write_bandwidth=args.write_bandwidth,
                          accelerator_price=args.accelerator_price, slot_price=args.slot_price)
    if args.json:
        print_json(plan)
    else:
        print(format_collector_plan(plan))
    return EXIT_OK
