"""Corpus manifests: ``manifest publish|verify|prove|diff``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from ledger.cli.common import (
    EXIT_OK,
    EXIT_PROBLEM,
    Subparsers,
    ident,
    out_path,
    paths_of,
    print_json,
    progress_bar,
    write_error,
)


def register(sub: Subparsers) -> None:
    _add_manifest(sub)


def _add_manifest(sub: Subparsers) -> None:
    man = sub.add_parser("manifest", help="corpus manifests: publish, verify, prove membership, diff").add_subparsers(
        dest="manifest_command", required=True)
    _add_manifest_publish(man)
    _add_manifest_verify(man)
    _add_manifest_prove(man)
    _add_manifest_diff(man)


def _add_manifest_publish(man: Subparsers) -> None:
    sp = man.add_parser("publish", help="build, sign and record the next manifest version of ROUTE")
    sp.set_defaults(fn=cmd_manifest_publish)
    sp.add_argument("route", type=ident, metavar="ROUTE")
    sp.add_argument("--key", required=True, metavar="KEYFILE", help="Ed25519 key trusted to sign manifest_published")
    sp.add_argument("--out", required=True, metavar="FILE", help="manifest JSON (a Croissant JSON-LD goes beside it)")
    sp.add_argument("--consumer", metavar="NAME", help="declared consumer (default: the route's)")
    sp.add_argument("--json", action="store_true")


def cmd_manifest_publish(args: argparse.Namespace) -> int:
    from ledger.corpus.publish import CanaryEscaped, ProjectionMismatch, publish  # lazy: startup time

    out = out_path(args.out, makes_parent=True)  # publish creates a missing folder
    with contextlib.ExitStack() as stack:
        if out is None:  # --out -: the manifest on stdout (no Croissant file), the summary on stderr
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ledger-publish-"))) / "manifest.json"
            to_stdout = True
        else:
            to_stdout = False
        try:
            pub = publish(paths_of(args), args.route, key=args.key, out=out, consumer=args.consumer,
                          progress=progress_bar("project"))
        except CanaryEscaped as exc:  # SPEC 11.2: nothing signed, nothing written
            return _canary_refusal(exc, args.json)
        except ProjectionMismatch as exc:  # SPEC 11.7: nothing signed, nothing written
            return _mismatch_refusal(exc, args.route, args.json)
        except OSError as exc:
            raise write_error(args.out, exc) from None
        if to_stdout:
            sys.stdout.write(out.read_text(encoding="utf-8"))
            sys.stdout.flush()
    note = sys.stderr if to_stdout else sys.stdout
    if args.json:
        print(json.dumps(pub.to_json(), indent=2, sort_keys=True), file=note)
    else:
        print(f"published {pub.route} v{pub.version}: {pub.size} members, root {pub.root}, log position "
              f"{json.dumps(pub.log_position)}", file=note)
        if to_stdout:
            where = "stdout (no Croissant file)"
        elif pub.croissant_path is None:
            where = f"{pub.path} (a device or pipe: written through, no Croissant file)"
        else:
            where = f"{pub.path}\n  croissant {pub.croissant_path}"
        print(f"  manifest {where}\n  archived {pub.archive_path}", file=note)
    return EXIT_OK


def _canary_refusal(exc, as_json: bool) -> int:
    """`manifest publish` refused: a declared canary is in the training corpus (exit 1)."""
    if as_json:
        print_json({"ok": False, "route": exc.route, "canary_occurrences": exc.count,
                     "escapes": [e.to_json() for e in exc.escapes]})
    else:
        print(f"ledger: manifest not published: {exc}", file=sys.stderr)
    return EXIT_PROBLEM


def _mismatch_refusal(exc, route: str, as_json: bool) -> int:
    """`manifest publish` refused: the projection database is not what the log derives (exit 1)."""
    if as_json:
        print_json({"ok": False, "route": route, "database": exc.path, "problems": exc.problems})
    else:
        print(f"ledger: manifest not published: {exc.path} does not match a replay of the log; nothing was signed "
              "or written:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
    return EXIT_PROBLEM


def _add_manifest_verify(man: Subparsers) -> None:
    sp = man.add_parser("verify", help="check signature, root and counts (--deep: replay the log and rebuild)")
    sp.set_defaults(fn=cmd_manifest_verify)
    sp.add_argument("file", metavar="FILE")
    sp.add_argument("--deep", action="store_true", help="replay the log to the manifest's position and demand the same root")
    sp.add_argument("--records", metavar="FILE", help="an export (any format) that must be exactly the manifest's members: "
                                                     "no duplicate, missing or extra one, every digest the published one, "
                                                     "every record within its format's rules")
    sp.add_argument("--json", action="store_true")


def cmd_manifest_verify(args: argparse.Namespace) -> int:
    from ledger.corpus.publish import verify_file  # lazy: startup time

    rep = verify_file(args.file, paths_of(args), deep=args.deep, progress=progress_bar("replay"), records=args.records)
    if args.json:
        print_json(rep.to_json())
    elif rep.ok:
        print(f"manifest ok: {rep.route} v{rep.version} ({'deep: ' if rep.deep else ''}{'; '.join(rep.checks)})")
    else:
        name = f"{rep.route} v{rep.version}" if rep.route is not None else args.file
        print(f"manifest FAILED verification: {name}")
        for problem in rep.problems:
            print(f"  {problem}")
    return EXIT_OK if rep.ok else EXIT_PROBLEM


def _add_manifest_prove(man: Subparsers) -> None:
    sp = man.add_parser("prove", help="RFC 9162 inclusion proof of MEMBER_ID (exit 1 if not a member)")
    sp.set_defaults(fn=cmd_manifest_prove)
    sp.add_argument("file", metavar="FILE")
    sp.add_argument("member_id", type=ident, metavar="MEMBER_ID")


def cmd_manifest_prove(args: argparse.Namespace) -> int:
    from ledger.corpus.publish import prove_file  # lazy: startup time

    print_json(prove_file(args.file, args.member_id))  # not a member: ManifestError, exit 1 (main)
    return EXIT_OK


def _add_manifest_diff(man: Subparsers) -> None:
    sp = man.add_parser("diff", help="members removed, added and changed from A to B, with reasons")
    sp.set_defaults(fn=cmd_manifest_diff)
    sp.add_argument("a", metavar="A")
    sp.add_argument("b", metavar="B")
    sp.add_argument("--json", action="store_true")


def cmd_manifest_diff(args: argparse.Namespace) -> int:
    from ledger.corpus.publish import diff_files  # lazy: startup time

    d = diff_files(args.a, args.b, paths_of(args))
    if args.json:
        print_json(d)
        return EXIT_OK
    a, b = d["a"], d["b"]
    print(f"{a['route']} v{a['version']} ({a['size']} members) -> {b['route']} v{b['version']} ({b['size']} members): "
          f"{d['summary']['removed']} removed, {d['summary']['added']} added, {d['summary']['changed']} changed, "
          f"{d['unchanged']} unchanged (reasons from {d['reasons_from']})")
    for side, sign in (("removed", "-"), ("added", "+")):
        for m in d[side]:
            print(f"  {sign} {m['member_id']}: {', '.join(m['reasons'])}")
    for m in d["changed"]:
        print(f"  ~ {m['member_id']}: {', '.join(m['reasons'])}")
    for name in ("a", "b"):
        for problem in d["verification"][name]:
            print(f"  note: {name.upper()} does not verify: {problem}")
    return EXIT_OK
