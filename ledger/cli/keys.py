"""Signing keys: ``keys new`` and ``sign`` (governance lines).

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ledger.cli.common import (
    EXIT_OK,
    Subparsers,
    UsageError,
    add_command,
    open_lines,
    out_path,
    paths_of,
    stdin_lines,
    write_error,
)
from ledger.events.catalog import SIGNED_TYPES
from ledger.events.signing import Trust, load_private_key, new_private_key, public_bytes, sign_line, write_private_key
from ledger.producers.ingest import read_json_lines


def register(sub: Subparsers) -> None:
    _add_keys(sub)
    _add_sign(sub)


def _add_keys(sub: Subparsers) -> None:
    keys = sub.add_parser("keys", help="manage signing keys").add_subparsers(dest="keys_command", required=True)
    _add_keys_new(keys)


def _add_keys_new(keys: Subparsers) -> None:
    sp = keys.add_parser("new", help="write a new Ed25519 key and trust it")
    sp.set_defaults(fn=cmd_keys_new)
    sp.add_argument("--out", required=True, metavar="KEYFILE")
    sp.add_argument("--may-sign", metavar="TYPE,...", help=f"governance types it may sign (default: {','.join(SIGNED_TYPES)})")


def cmd_keys_new(args: argparse.Namespace) -> int:
    p = paths_of(args)
    may_sign = [t.strip() for t in args.may_sign.split(",")] if args.may_sign else list(SIGNED_TYPES)
    trust = Trust.load(p.trust)
    key = new_private_key()
    tk = trust.add(public_bytes(key), may_sign)  # validates the types before anything is written
    if not p.trust.parent.is_dir():  # checked before the key is written: no key without its trust entry
        raise UsageError(f"cannot trust the new key in {p.trust}: {p.trust.parent} does not exist "
                         "(run `ledger init` first, or give --trust FILE); nothing written")
    out = out_path(args.out)
    if out is None:  # --out -: the PEM on stdout (pipe it into a secret store), the note on stderr
        with tempfile.TemporaryDirectory(prefix="ledger-key-") as tmp:
            write_private_key(key, Path(tmp) / "key.pem")
            pem = (Path(tmp) / "key.pem").read_bytes()
        trust.save(p.trust)
        sys.stdout.buffer.write(pem)
        sys.stdout.flush()
        print(f"key {tk.key_id} written to stdout; trusted in {p.trust} for {', '.join(may_sign)}", file=sys.stderr)
        return EXIT_OK
    if out.exists():
        raise UsageError(f"{out} already exists; refusing to overwrite a key")
    try:
        write_private_key(key, out)
    except OSError as exc:
        raise write_error(out, exc) from None
    try:
        trust.save(p.trust)
    except OSError as exc:  # a key nobody trusts is not left behind
        out.unlink(missing_ok=True)
        raise write_error(p.trust, exc) from None
    print(f"key {tk.key_id} written to {out}; trusted in {p.trust} for {', '.join(may_sign)}")
    return EXIT_OK


def _add_sign(sub: Subparsers) -> None:
    sp = add_command(sub, "sign", cmd_sign, "sign governance JSON lines (prints the signed lines)")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--key", required=True, metavar="KEYFILE")


def cmd_sign(args: argparse.Namespace) -> int:
    key = load_private_key(Path(args.key))
    stream = stdin_lines() if args.file == "-" else open_lines(args.file)
    out = []
    for _n, obj in read_json_lines(stream):
        out.append(json.dumps(sign_line(obj, key), ensure_ascii=False))
    print("\n".join(out))
    return EXIT_OK
