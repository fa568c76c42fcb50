"""What every command group of the CLI shares: exit codes, the usage error, the store paths of the global
options, argument types, printing, and ``--out FILE|-`` (SPEC §9: no half-written output).

May import: every layer below the CLI (like the rest of ``ledger.cli``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

from ledger.algorithms.errors import InputError
from ledger.algorithms.identifiers import id_problem
from ledger.log.paths import StorePaths, store_paths

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

Subparsers = argparse._SubParsersAction  # what ``add_subparsers`` returns: a command group's ``register`` adds to it
Handler = Callable[[argparse.Namespace], int]


class UsageError(InputError):
    """Bad input or usage: exit 2 with the message."""


def add_command(sub: Subparsers, name: str, fn: Handler, help: str) -> argparse.ArgumentParser:
    """A command ``name`` run by ``fn``, its help also its description."""
    sp = sub.add_parser(name, help=help, description=help)
    sp.set_defaults(fn=fn)
    return sp


def add_subcommand(group: Subparsers, name: str, fn: Handler, help: str) -> argparse.ArgumentParser:
    """A subcommand ``name`` of a group (``ledger log head``), run by ``fn``."""
    sp = group.add_parser(name, help=help)
    sp.set_defaults(fn=fn)
    return sp


@contextlib.contextmanager
def as_usage(*types: type[BaseException]) -> Iterator[None]:
    """Inside: a builtin error a library call raises for a bad argument (``KeyError``: no such route or execution;
    a ``ValueError`` or ``OSError`` of a parser or loader) becomes a UsageError naming it (exit 2).  Errors of the
    ``LedgerError`` tree are translated by ``ledger.cli.main`` alone."""
    try:
        yield
    except types as exc:
        raise UsageError(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc)) from None


def paths_of(args: argparse.Namespace) -> StorePaths:
    """The store of the global options ``--store``, ``--db``, ``--trust``."""
    return store_paths(args.store, db=args.db, trust=getattr(args, "trust", None))


def progress_bar(label: str) -> Callable[[int, int], None] | None:
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


def ident(text: str) -> str:
    """argparse type of an argument naming an id (route, execution, subject, member, pool, cohort):
    at most MAX_ID_BYTES escaped (SPEC 11.7), else a usage error (exit 2) before anything runs."""
    why = id_problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}...: {why}")
    return text


def print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def projected_db(args: argparse.Namespace, table: str):
    """The projection database, refusing one ``ledger project`` never built (no ``table``)."""
    from ledger.projections.engine import connect  # lazy: startup time

    path = paths_of(args).db
    db = connect(path)
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is None:
        db.close()
        raise UsageError(f"the projection database {path} has not been built (no {table} table): run `ledger project` first")
    return db


def open_lines(path: str):
    """FILE as bytes: read_json_lines decodes each line itself and names the line that is not UTF-8."""
    try:
        return open(path, "rb")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def stdin_lines():
    return getattr(sys.stdin, "buffer", sys.stdin)


def out_path(out: str, flag: str = "--out", *, makes_parent: bool = False) -> Path | None:
    """None for ``-`` (stdout); else the path, checked before any work is done (``makes_parent``:
    the command creates a missing folder itself)."""
    if out == "-":
        return None
    if not out.strip():
        raise UsageError(f"{flag} is empty: name a file (or - for stdout)")
    p = Path(out)
    if p.is_dir():
        raise UsageError(f"{flag} {out} is a directory; name a file")
    if not p.parent.is_dir() and not (makes_parent and not p.parent.exists()):
        why = "is not a directory" if p.parent.exists() else "does not exist"
        raise UsageError(f"{flag} {out}: folder {p.parent} {why}")
    return p


def write_error(out: str | Path, exc: OSError, note: str = " (nothing written)") -> UsageError:
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    return UsageError(f"cannot write {out}: {why}{note}")


@contextlib.contextmanager
def atomic_out(p: Path):
    """Yield where to write ``p``: a temporary file beside it that replaces it on success and
    is removed on failure (a device or FIFO such as /dev/full is written in place).  An
    OSError becomes a one-line UsageError naming ``p``."""
    if p.is_symlink():
        p = p.resolve()  # replace the file it points to, not the link
    if p.exists() and not p.is_file():
        try:
            yield p
        except OSError as exc:
            raise write_error(p, exc, "") from None
        return
    tmp = p.parent / f".{p.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies, as for open()
        yield tmp
        os.replace(tmp, p)
    except OSError as exc:
        raise write_error(p, exc) from None
    finally:
        tmp.unlink(missing_ok=True)


def flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        discard_stdout()
        raise UsageError(f"cannot write to stdout: {os.strerror(exc.errno) if exc.errno else exc}") from None


def discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what it still buffers goes nowhere, so the flush
    at interpreter exit cannot fail a second time (and print a traceback-like warning)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (pytest's capture)
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


def error_line(text: str) -> None:
    """One line on stderr, whatever the text holds (newlines folded, unencodable characters escaped)."""
    text = " ".join(text.splitlines())
    try:
        sys.stderr.write(text.encode("utf-8", "backslashreplace").decode("utf-8") + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or full: nothing more can be said
        pass
