"""The `ledger` command line (SPEC §7.2).  Every command calls a library function a Python
user could call too; this module only parses arguments and prints.

Exit codes: 0 success, 1 a verification found a problem, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from . import integrity
from .config import StorePaths, origin_name, store_paths
from .events import SIGNED_TYPES
from .ingest import IngestError, Ingestor, read_json_lines
from .log import LogError, open_log
from .signing import SignatureError, Trust, load_private_key, new_private_key, public_bytes, sign_line, write_private_key
from .validate import ValidationError

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input or usage: exit 2 with the message."""


def _paths(args: argparse.Namespace) -> StorePaths:
    return store_paths(args.store, db=args.db, trust=getattr(args, "trust", None))


def _progress(label: str) -> Callable[[int, int], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        pct = 100 * done / total if total else 100
        bar = "#" * int(pct // 4)
        sys.stderr.write(f"\r{label} [{bar:<25}] {done}/{total} ({pct:5.1f}%)")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


# ------------------------------------------------------------------ commands
def cmd_init(args: argparse.Namespace) -> int:
    p = _paths(args)
    log = open_log(p.url, create=True)
    log.close()
    if not p.checkpoint_key.exists():
        p.checkpoint_key.parent.mkdir(parents=True, exist_ok=True)
        write_private_key(new_private_key(), p.checkpoint_key)
    if not p.trust.exists():
        Trust().save(p.trust)
    print(f"initialised store {p.url} (trust file {p.trust}, checkpoint key {p.checkpoint_key})")
    return EXIT_OK


def cmd_ingest(args: argparse.Namespace) -> int:
    p = _paths(args)
    trust = Trust.load(p.trust)
    stream = sys.stdin if args.file == "-" else _open_text(args.file)
    with open_log(p.url) as log:
        report = Ingestor(log, trust, producer=args.producer).ingest_lines(read_json_lines(stream))
    out = report.to_json()
    if args.json:
        _print_json(out)
    else:
        print(f"appended {out['appended']}, duplicate {out['duplicates']}, conflicting {out['conflicting']}")
        for c in out["conflicts"]:
            print(f"  conflict: {c['event_id']}: {c['reason']} (existing position {c['existing_position']})")
    return EXIT_PROBLEM if out["conflicting"] else EXIT_OK


def cmd_import_atif(args: argparse.Namespace) -> int:
    from .atif_import import import_atif

    p = _paths(args)
    with open_log(p.url) as log:
        summary = import_atif([Path(f) for f in args.files], Ingestor(log, Trust.load(p.trust), producer="atif-import"))
    _print_json(summary)
    return EXIT_OK


def cmd_project(args: argparse.Namespace) -> int:
    from projections.registry import open_engine

    p = _paths(args)
    with open_log(p.url) as log:
        engine = open_engine(log, p.db, Trust.load(p.trust))
        if args.rebuild:
            engine.rebuild()
        stats = engine.run(progress=_progress("project"))
    print(f"applied {stats.applied}, rejected {stats.rejected}, dead letters {stats.dead_letters}")
    return EXIT_OK


def cmd_tree(args: argparse.Namespace) -> int:
    from projections.engine import connect
    from projections.tree import tree_json, tree_text

    db = connect(_paths(args).db)
    try:
        if args.json:
            _print_json(tree_json(db, args.execution_id))
        else:
            print(tree_text(db, args.execution_id))
    except KeyError as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from .status import status

    p = _paths(args)
    with open_log(p.url) as log:
        st = status(log, p)
    if args.json:
        _print_json(st)
    else:
        for section, values in st.items():
            print(f"{section}: {json.dumps(values, sort_keys=True)}")
    return EXIT_OK


def cmd_keys_new(args: argparse.Namespace) -> int:
    p = _paths(args)
    may_sign = [t.strip() for t in args.may_sign.split(",")] if args.may_sign else list(SIGNED_TYPES)
    trust = Trust.load(p.trust)
    key = new_private_key()
    tk = trust.add(public_bytes(key), may_sign)  # validates the types before anything is written
    out = Path(args.out)
    if out.exists():
        raise UsageError(f"{out} already exists; refusing to overwrite a key")
    write_private_key(key, out)
    trust.save(p.trust)
    print(f"key {tk.key_id} written to {out}; trusted in {p.trust} for {', '.join(may_sign)}")
    return EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    key = load_private_key(Path(args.key))
    stream = sys.stdin if args.file == "-" else _open_text(args.file)
    out = []
    for _n, obj in read_json_lines(stream):
        out.append(json.dumps(sign_line(obj, key), ensure_ascii=False))
    print("\n".join(out))
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    p = _paths(args)
    with open_log(p.url) as log:
        report = integrity.audit(log, Trust.load(p.trust))
    if args.json:
        _print_json(report.to_json())
    else:
        if report.ok:
            print(f"audit ok: {report.events} events re-hashed, every digest and governance signature verifies")
        else:
            if report.first_bad_position is not None:
                print(f"first position whose bytes were changed: {report.first_bad_position}")
            for problem in report.problems:
                print(problem)
    return EXIT_OK if report.ok else EXIT_PROBLEM


def cmd_log_head(args: argparse.Namespace) -> int:
    p = _paths(args)
    key = load_private_key(p.checkpoint_key)
    with open_log(p.url) as log:
        for note in integrity.log_heads(log, key, origin_name(p.url)):
            sys.stdout.write(note)
    return EXIT_OK


def cmd_log_prove(args: argparse.Namespace) -> int:
    p = _paths(args)
    with open_log(p.url) as log:
        where = None
        if args.partition:
            stream, _, part = args.partition.rpartition(":")
            where = (stream, int(part))
        try:
            _print_json(integrity.consistency(log, args.from_size, args.to_size, where))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return EXIT_OK


def cmd_conflicts(args: argparse.Namespace) -> int:
    with open_log(_paths(args).url) as log:
        _print_json(log.conflicts())
    return EXIT_OK


def _open_text(path: str):
    try:
        return open(path, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


# ------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ledger", description="Trajectory ledger: event-sourced records for agent training.")
    ap.add_argument("--store", help="store URL: a directory (embedded) or kafka://HOST:PORT/PREFIX "
                                    "(default $LEDGER_STORE, else ./ledger-data)")
    ap.add_argument("--db", help="projection database (default inside the embedded store, else ./projections.db)")
    ap.add_argument("--trust", help="trust file (default <store>/trust.json)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    add("init", cmd_init, "create the store, its trust file and checkpoint-signing key")
    sp = add("ingest", cmd_ingest, "validate JSON-lines events and append them atomically")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--producer", default="ledger-ingest", help="producer name stamped on lines without one")
    sp.add_argument("--json", action="store_true")
    sp = add("import-atif", cmd_import_atif, "import ATIF trajectories (with per-step token IDs) as events")
    sp.add_argument("files", nargs="+", metavar="FILE")
    sp = add("project", cmd_project, "bring every projection up to date")
    sp.add_argument("--rebuild", action="store_true", help="drop the projection database and replay from zero")
    sp = add("tree", cmd_tree, "show an execution's prefix tree")
    sp.add_argument("execution_id")
    sp.add_argument("--json", action="store_true", help="the contract JSON shape (SPEC 7.2)")
    sp = add("status", cmd_status, "counts per projection and the log head")
    sp.add_argument("--json", action="store_true")
    keys = sub.add_parser("keys", help="manage signing keys").add_subparsers(dest="keys_command", required=True)
    sp = keys.add_parser("new", help="write a new Ed25519 key and trust it")
    sp.set_defaults(fn=cmd_keys_new)
    sp.add_argument("--out", required=True, metavar="KEYFILE")
    sp.add_argument("--may-sign", metavar="TYPE,...", help=f"governance types it may sign (default: {','.join(SIGNED_TYPES)})")
    sp = add("sign", cmd_sign, "sign governance JSON lines (prints the signed lines)")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--key", required=True, metavar="KEYFILE")
    sp = add("audit", cmd_audit, "re-hash every event and re-check governance signatures")
    sp.add_argument("--json", action="store_true")
    logp = sub.add_parser("log", help="log integrity: signed heads and consistency proofs").add_subparsers(
        dest="log_command", required=True)
    sp = logp.add_parser("head", help="print the signed checkpoint (origin, size, root)")
    sp.set_defaults(fn=cmd_log_head)
    sp = logp.add_parser("prove", help="consistency proof from an older size to the current (or --to) size")
    sp.set_defaults(fn=cmd_log_prove)
    sp.add_argument("--from", dest="from_size", type=int, required=True, metavar="N")
    sp.add_argument("--to", dest="to_size", type=int, metavar="M")
    sp.add_argument("--partition", metavar="STREAM:N", help="Kafka: which partition's tree")
    add("conflicts", cmd_conflicts, "list the operator queue of conflicting submissions")
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (UsageError, ValidationError, IngestError, SignatureError, LogError) as exc:
        label = "error" if not isinstance(exc, IngestError) else "refused (nothing appended)"
        print(f"ledger: {label}: {exc}", file=sys.stderr)
        if isinstance(exc, IngestError) and len(exc.errors) > 1:
            for e in exc.errors:
                print(f"  {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
