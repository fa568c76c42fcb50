"""Withdrawals and erasure: ``withdraw SUBJECT`` (``--erase``, ``--resume``) and ``impact SUBJECT``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse

from ledger.cli.common import (
    EXIT_OK,
    EXIT_PROBLEM,
    Subparsers,
    UsageError,
    add_command,
    error_line,
    ident,
    paths_of,
    print_json,
    progress_bar,
)


def register(sub: Subparsers) -> None:
    _add_withdraw(sub)
    _add_impact(sub)


def _add_withdraw(sub: Subparsers) -> None:
    sp = add_command(sub, "withdraw", cmd_withdraw, "sign and ingest a withdrawal of SUBJECT (--erase also destroys its data keys)")
    sp.add_argument("subject", type=ident, metavar="SUBJECT", nargs="?", help="source:ID, task:ID, execution:ID or *")
    sp.add_argument("--reason")
    sp.add_argument("--key", metavar="KEYFILE", help="Ed25519 key trusted to sign withdrawal")
    sp.add_argument("--erase", action="store_true",
                    help="crypto-shred: destroy the covered data keys, purge every projection database and gateway.db")
    sp.add_argument("--resume", action="store_true",
                    help="finish the steps of earlier erasures (of SUBJECT, or all) that could not be done; appends nothing")
    sp.add_argument("--wait", type=float, metavar="SECONDS",
                    help="how long an erase waits for a busy file before reporting it (default 30)")
    sp.add_argument("--authority", help="who withdraws (default: key:<key id>)")
    sp.add_argument("--json", action="store_true")


def cmd_withdraw(args: argparse.Namespace) -> int:
    from ledger.corpus.withdraw import format_impact, resume, withdraw  # lazy: startup time

    p = paths_of(args)
    if args.wait is not None and not 0 <= args.wait <= 86400:
        raise UsageError(f"--wait must be between 0 and 86400 seconds, got {args.wait:g}")
    if args.resume:
        if args.reason or args.key or args.erase or args.authority:
            raise UsageError("--resume takes only an optional SUBJECT (and --wait, --json): it appends nothing")
    elif args.subject is None or args.reason is None or args.key is None:
        raise UsageError("withdraw needs SUBJECT, --reason and --key (or --resume to finish earlier erasures)")
    if args.resume:
        out = {"subject": args.subject, "resumed": True, "erase": resume(p, args.subject, wait=args.wait,
                                                                          progress=progress_bar("project"))}
    else:
        out = withdraw(p, args.subject, reason=args.reason, key=args.key, erase=args.erase,
                       authority=args.authority, wait=args.wait, progress=progress_bar("project"))
    failed = (out.get("erase") or {}).get("failed") or []
    if args.json:
        print_json(out)
    elif out.get("conflicts"):
        for c in out["conflicts"]:
            print(f"conflict: {c['event_id']}: {c['reason']} (existing position {c['existing_position']}); nothing appended, "
                  "no key touched")
    else:
        _print_withdrawal(out, format_impact)
    for f in failed:
        error_line(f"ledger: erase not finished: {f['step']}: {f['file']}: {f['error']}")
    if failed:
        error_line("ledger: every other erase step was done; run `ledger withdraw --resume` when the file is free "
                    "(or repaired) to finish")
    return EXIT_PROBLEM if out.get("conflicts") or failed else EXIT_OK


def _print_withdrawal(out: dict, format_impact) -> None:
    if not out.get("resumed"):
        state = "appended" if out["appended"] else "already on the log (duplicate)"
        print(f"withdrawal {out.get('event_id')} {state}")
    erase = out["erase"]
    if erase is not None:
        for d in erase["destroyed"]:
            print(f"destroyed data key {d['key_id']} of {d['subject']}")
        for k in erase["not_destroyed"]:
            print(f"NOT destroyed: key {k['key_id']}: {k['why']}")
        if erase.get("projections_rebuilt"):
            print("projection database rebuilt from the log (no decrypted copy of erased tokens remains in it)")
        for f in erase.get("projection_files", []):
            print(f"{f}: up to date, no erased token payload left in it")
        if erase.get("gateway_state_rows_deleted"):
            print(f"gateway restoration state of the erased executions deleted ({erase['gateway_state_rows_deleted']} rows)")
        if out.get("resumed") and not erase.get("failed"):
            print("every erase step is complete")
    if "impact" in out:
        print(format_impact(out["impact"]))


def _add_impact(sub: Subparsers) -> None:
    sp = add_command(sub, "impact", cmd_impact, "list the executions, derived views, manifest versions and members SUBJECT touches")
    sp.add_argument("subject", type=ident, metavar="SUBJECT", help="source:ID, task:ID, execution:ID or *")
    sp.add_argument("--json", action="store_true")


def cmd_impact(args: argparse.Namespace) -> int:
    from ledger.corpus.withdraw import format_impact, impact_report  # lazy: startup time

    rep = impact_report(paths_of(args), args.subject, progress=progress_bar("project"))
    if args.json:
        print_json(rep)
    else:
        print(format_impact(rep))
    return EXIT_OK
