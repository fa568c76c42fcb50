"""Splits and similarity screening (SPEC 6.3): ``splits check|show``, ``similarity candidates|curve``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse

from ledger.cli.common import (
    EXIT_OK,
    EXIT_PROBLEM,
    Subparsers,
    UsageError,
    paths_of,
    print_json,
    progress_bar,
)


def register(sub: Subparsers) -> None:
    _add_splits(sub)
    _add_similarity(sub)


def _add_splits(sub: Subparsers) -> None:
    splits = sub.add_parser("splits", help="task groups and split assignments (SPEC 6.3)").add_subparsers(
        dest="splits_command", required=True)
    _add_splits_check(splits)
    _add_splits_show(splits)


def _add_splits_check(splits: Subparsers) -> None:
    sp = splits.add_parser("check", help="exit 1 and list offenders if a group spans two splits or a record "
                                         "disagrees with its group's split")
    sp.set_defaults(fn=cmd_splits_check)
    sp.add_argument("--json", action="store_true")


def cmd_splits_check(args: argparse.Namespace) -> int:
    from ledger.reports.splits_report import check_store, format_check  # lazy: startup time

    rep = check_store(paths_of(args), progress=progress_bar("project"))
    if args.json:
        print_json(rep.to_json())
    else:
        print(format_check(rep))
    return EXIT_OK if rep.ok else EXIT_PROBLEM


def _add_splits_show(splits: Subparsers) -> None:
    sp = splits.add_parser("show", help="group, task and trajectory counts per split")
    sp.set_defaults(fn=cmd_splits_show)
    sp.add_argument("--json", action="store_true")


def cmd_splits_show(args: argparse.Namespace) -> int:
    from ledger.reports.splits_report import format_show, show_store  # lazy: startup time

    out = show_store(paths_of(args), progress=progress_bar("project"))
    if args.json:
        print_json(out)
    else:
        print(format_show(out))
    return EXIT_OK


def _add_similarity(sub: Subparsers) -> None:
    sim = sub.add_parser("similarity", help="MinHash/LSH similarity screening of task features").add_subparsers(
        dest="similarity_command", required=True)
    _add_similarity_candidates(sim)
    _add_similarity_curve(sim)


def _add_similarity_candidates(sim: Subparsers) -> None:
    sp = sim.add_parser("candidates", help="the review queue of candidate near-duplicate task pairs")
    sp.set_defaults(fn=cmd_similarity_candidates)
    sp.add_argument("--status", choices=("pending", "linked", "rejected", "all"), default="all")
    sp.add_argument("--json", action="store_true")


def cmd_similarity_candidates(args: argparse.Namespace) -> int:
    from ledger.reports.splits_report import candidates_store, format_candidates  # lazy: startup time

    status = None if args.status == "all" else args.status
    rows = candidates_store(paths_of(args), status, progress=progress_bar("project"))
    if args.json:
        print_json(rows)
    else:
        print(format_candidates(rows))
    return EXIT_OK


def _add_similarity_curve(sim: Subparsers) -> None:
    sp = sim.add_parser("curve", help="candidate probability 1-(1-s^r)^b of the LSH configuration")
    sp.set_defaults(fn=cmd_similarity_curve)
    sp.add_argument("--bands", type=int, metavar="B", help="bands (default 32)")
    sp.add_argument("--rows", type=int, metavar="R", help="rows per band (default 4)")
    sp.add_argument("--num-perm", type=int, metavar="N", help="MinHash permutations (default 128)")
    sp.add_argument("--points", type=int, default=11, help="similarities shown (default 11)")
    sp.add_argument("--records", type=int, metavar="N", help="plan a screen of N records (seed 002 exercise 8): per band "
                    "design the false candidates, recall, fits-budget, standard error and signature bytes")
    sp.add_argument("--budget", type=int, metavar="PAIRS", help="candidate pairs reviewers can inspect per pass")
    sp.add_argument("--similarity-of-unrelated", dest="s0", type=float, metavar="S0",
                    help="Jaccard similarity of unrelated pairs (default 0.1)")
    sp.add_argument("--similarity-of-relatives", dest="s1", type=float, metavar="S1",
                    help="Jaccard similarity of true relatives: recall is reported at it (default 0.8)")
    sp.add_argument("--relatives", type=int, metavar="K", help="true relative pairs among the N records (default 0)")
    sp.add_argument("--bytes-per-value", type=int, metavar="B", help="bytes per signature component (default 4)")
    sp.add_argument("--json", action="store_true")


def cmd_similarity_curve(args: argparse.Namespace) -> int:
    """``ledger similarity curve``: the candidate curve of the screening configuration, or with
    ``--records N [--budget PAIRS]`` the review load of each band design (seed 002 exercise 8)."""
    from ledger.reports.splits_report import curve_doc, curve_text, plan_doc, plan_text  # lazy: startup time

    planning = {"--budget": args.budget, "--similarity-of-unrelated": args.s0, "--similarity-of-relatives": args.s1,
                "--relatives": args.relatives, "--bytes-per-value": args.bytes_per_value}
    given = [k for k, v in planning.items() if v is not None]
    if args.records is None and given:
        raise UsageError(f"{given[0]} needs --records N (the corpus to plan the screen for)")
    if args.records is not None:
        kw = {k: v for k, v in (("similarity_of_unrelated", args.s0), ("similarity_of_relatives", args.s1),
                                ("relatives", args.relatives), ("bytes_per_value", args.bytes_per_value))
              if v is not None}
        doc = plan_doc(args.records, args.budget, bands=args.bands, rows=args.rows, num_perm=args.num_perm, **kw)
        text = plan_text(doc) if not args.json else ""
    else:
        doc = curve_doc(args.bands, args.rows, args.num_perm, args.points) if args.json else {}
        text = curve_text(args.bands, args.rows, args.num_perm, args.points) if not args.json else ""
    if args.json:
        print_json(doc)
    else:
        print(text)
    return EXIT_OK
