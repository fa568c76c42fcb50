"""The store and its log: ``init``, ``status``, ``audit``, ``log head|key|prove``, ``conflicts``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys

from ledger.cli.common import (
    EXIT_OK,
    EXIT_PROBLEM,
    Subparsers,
    add_command,
    error_line,
    paths_of,
    print_json,
)
from ledger.corpus import integrity
from ledger.events.signing import Trust, load_private_key, new_private_key, public_bytes, write_private_key
from ledger.log import open_log
from ledger.log.base import CorruptStore
from ledger.log.paths import check_init_origin, checkpoint_identity, init_origin, store_origin
from ledger.reports.status import status


def register(sub: Subparsers) -> None:
    _add_init(sub)
    _add_status(sub)
    _add_audit(sub)
    _add_log(sub)
    _add_conflicts(sub)


def _add_init(sub: Subparsers) -> None:
    sp = add_command(sub, "init", cmd_init, "create the store, its trust file and checkpoint-signing key")
    sp.add_argument("--origin", metavar="NAME", help="checkpoint origin (and key name), stored in the store "
                    "(default trajectory-ledger/<16 hex of SHA-256 of the checkpoint public key>)")


def cmd_init(args: argparse.Namespace) -> int:
    p = paths_of(args)
    check_init_origin(p, args.origin, new_key=not p.checkpoint_key.exists())  # before anything is created
    log = open_log(p.url, create=True)
    log.close()
    new_key = not p.checkpoint_key.exists()
    if new_key:
        p.checkpoint_key.parent.mkdir(parents=True, exist_ok=True)
        write_private_key(new_private_key(), p.checkpoint_key)
    init_origin(p, public_bytes(load_private_key(p.checkpoint_key)), args.origin, new_key=new_key)
    ident = checkpoint_identity(p)
    if not p.trust.exists():
        Trust().save(p.trust)
    print(f"initialised store {p.url} (trust file {p.trust}, checkpoint key {p.checkpoint_key}, "
          f"origin {ident['origin']}, verifier key {p.checkpoint_vkey})")
    return EXIT_OK


def _add_status(sub: Subparsers) -> None:
    sp = add_command(sub, "status", cmd_status, "counts per projection and the log head")
    sp.add_argument("--json", action="store_true")


def cmd_status(args: argparse.Namespace) -> int:
    p = paths_of(args)
    with open_log(p.url) as log:
        st = status(log, p)
    if args.json:
        print_json(st)
    else:
        for section, values in st.items():
            print(f"{section}: {json.dumps(values, sort_keys=True)}")
    for problem in st.get("problems", ()):  # everything else was printed; the problem is named and exits 1
        error_line(f"ledger: problem: {problem}")
    return EXIT_PROBLEM if st.get("problems") else EXIT_OK


def _add_audit(sub: Subparsers) -> None:
    sp = add_command(sub, "audit", cmd_audit, "re-hash every event and re-check governance signatures")
    sp.add_argument("--json", action="store_true")


def cmd_audit(args: argparse.Namespace) -> int:
    p = paths_of(args)
    try:
        log = open_log(p.url)
    except CorruptStore as exc:  # a damaged index is a finding (exit 1), not bad input
        report = integrity.AuditReport(problems=[str(exc)])
    else:
        from ledger.corpus.erasure import ErasureCheck  # lazy: startup time
        from ledger.projections.registry import store_keystore  # lazy: startup time

        keystore = store_keystore(p)  # opens sealed requests to check their idempotency hashes
        try:
            with log:
                public = public_bytes(load_private_key(p.checkpoint_key)) if p.checkpoint_key.exists() else None
                report = integrity.audit(log, Trust.load(p.trust), checkpoints=p.checkpoints,
                                         origin=store_origin(p, write=False),  # read-only: writes no origin file
                                         public_key=public, databases=[p.db], keystore=keystore,
                                         erasure=ErasureCheck(p, keystore))
        finally:
            if keystore is not None:
                keystore.close()
    if args.json:
        print_json(report.to_json())
    else:
        if report.ok:
            print(f"audit ok: {report.events} events re-hashed, every digest and governance signature verifies; "
                  "index rows, file offsets, SQLite integrity, the projection database against a replay of the log "
                  "and the seen checkpoints check out")
        else:
            if report.first_bad_position is not None:
                print(f"first position whose bytes were changed: {report.first_bad_position}")
            for problem in report.problems:
                print(problem)
        for note in report.notes:
            print(f"note: {note}")
    return EXIT_OK if report.ok else EXIT_PROBLEM


def _add_log(sub: Subparsers) -> None:
    logp = sub.add_parser("log", help="log integrity: signed heads and consistency proofs").add_subparsers(
        dest="log_command", required=True)
    _add_log_head(logp)
    _add_log_key(logp)
    _add_log_prove(logp)


def _add_log_head(logp: Subparsers) -> None:
    sp = logp.add_parser("head", help="print the signed checkpoint (origin, size, root)")
    sp.set_defaults(fn=cmd_log_head)


def cmd_log_head(args: argparse.Namespace) -> int:
    p = paths_of(args)
    key = load_private_key(p.checkpoint_key)
    origin = checkpoint_identity(p)["origin"]  # stores the origin and verifier key of an older store
    with open_log(p.url) as log:
        for note in integrity.log_heads(log, key, origin, record=p.checkpoints, frontiers=p.frontiers):
            sys.stdout.write(note)
    return EXIT_OK


def _add_log_key(logp: Subparsers) -> None:
    sp = logp.add_parser("key", help="print the checkpoint verifier key <origin>+<key hash>+<base64 key> (auditors)")
    sp.set_defaults(fn=cmd_log_key)
    sp.add_argument("--json", action="store_true", help='{"origin", "vkey", "key_hash"}')


def cmd_log_key(args: argparse.Namespace) -> int:
    ident = checkpoint_identity(paths_of(args))  # the public half, derived from the private key
    if args.json:
        print_json(ident)
    else:
        print(ident["vkey"])
    return EXIT_OK


def _add_log_prove(logp: Subparsers) -> None:
    sp = logp.add_parser("prove", help="consistency proof from an older size to the current (or --to) size")
    sp.set_defaults(fn=cmd_log_prove)
    sp.add_argument("--from", dest="from_size", type=int, required=True, metavar="N")
    sp.add_argument("--to", dest="to_size", type=int, metavar="M")
    sp.add_argument("--partition", metavar="STREAM:N", help="Kafka: which partition's tree")


def cmd_log_prove(args: argparse.Namespace) -> int:
    p = paths_of(args)
    with open_log(p.url) as log:
        where = None
        if args.partition:
            stream, _, part = args.partition.rpartition(":")
            where = (stream, int(part))
        print_json(integrity.consistency(log, args.from_size, args.to_size, where))
    return EXIT_OK


def _add_conflicts(sub: Subparsers) -> None:
    add_command(sub, "conflicts", cmd_conflicts, "list the operator queue of conflicting submissions")


def cmd_conflicts(args: argparse.Namespace) -> int:
    with open_log(paths_of(args).url) as log:
        print_json(log.conflicts())
    return EXIT_OK
