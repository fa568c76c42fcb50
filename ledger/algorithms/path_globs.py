"""Protected-path globs (SPEC §6.10, seed 002 §15.5.2): which changed paths a task's
patch-admission policy forbids.  Pure functions, no I/O.

**Paths** are repository-relative POSIX paths as a diff names them.  They are normalised
before matching: a leading ``/`` and ``./`` segments are dropped, repeated ``/`` collapse,
and ``..`` segments are resolved, so ``src/../tests/test_x.py`` is ``tests/test_x.py``.  A
path that climbs above the repository root (``../x``) is *outside* the repository and
always counts as a protected change (:data:`OUTSIDE`).

**Globs** are matched against the whole normalised path (anchored at the repository root,
case-sensitive), segment by segment:

* ``*`` matches any run of characters within one segment (never ``/``); ``?`` one
  character other than ``/``; ``[abc]`` / ``[a-z]`` / ``[!abc]`` a character class (never
  ``/``); an unterminated ``[`` is a literal.
* ``**`` as a whole segment matches zero or more segments: ``tests/**`` matches ``tests``
  and everything below it, ``**/conftest.py`` a ``conftest.py`` at any depth,
  ``a/**/b`` ``a/b`` and ``a/x/y/b``.  ``**`` inside a segment (``a**b``) is the same as ``*``.
* A glob without ``/`` is still anchored: ``pyproject.toml`` is only the top-level file
  (write ``**/pyproject.toml`` for any depth).  A trailing ``/`` means the directory and
  everything below it (``tests/`` = ``tests/**``); a leading ``/`` is ignored.

A changed path **violates** a policy ``(protected, allowed)`` when it matches a protected
glob and no allowed glob.  A task may carry several policies (one per registration that
declares paths); a path must satisfy every one of them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable, Sequence

__all__ = ["OUTSIDE", "compile_glob", "matches", "normalize_path", "violations"]

OUTSIDE = "(outside the repository)"  # the "glob" a path escaping the root violates


def normalize_path(path: str) -> str | None:
    """The normalised form of ``path``, or ``None`` when it climbs above the repository root."""
    out: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not out:
                return None
            out.pop()
        else:
            out.append(seg)
    return "/".join(out)


def _segment(seg: str) -> str:
    """Regex for one glob segment (no ``/`` inside)."""
    i, n, out = 0, len(seg), []
    while i < n:
        c = seg[i]
        i += 1
        if c == "*":
            while i < n and seg[i] == "*":
                i += 1
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i
            if j < n and seg[j] in "!^":
                j += 1
            if j < n and seg[j] == "]":
                j += 1
            while j < n and seg[j] != "]":
                j += 1
            if j >= n:  # unterminated: a literal "["
                out.append(re.escape(c))
                continue
            body = seg[i:j].replace("\\", "\\\\")
            i = j + 1
            if body[:1] in ("!", "^"):
                out.append("[^/" + body[1:] + "]")
            else:
                out.append("(?!/)[" + body + "]")
        else:
            out.append(re.escape(c))
    return "".join(out)


@lru_cache(maxsize=4096)
def compile_glob(glob: str) -> re.Pattern:
    """The compiled, anchored regular expression of ``glob`` (see the module notes)."""
    g = glob.strip("/") if not glob.endswith("/") else glob.strip("/") + "/**"
    segs = [s for s in g.split("/") if s not in ("", ".")]
    if not segs:
        return re.compile(r".*\Z", re.DOTALL)
    rx = ""
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == "**":
            if last:
                rx = ".*" if i == 0 else rx[:-1] + "(?:/.*)?"
            else:
                rx += "(?:[^/]+/)*"
        else:
            rx += _segment(seg) + ("" if last else "/")
    return re.compile(rx + r"\Z", re.DOTALL)


def matches(path: str, glob: str) -> bool:
    """Whether the (normalised) ``path`` matches ``glob``."""
    return compile_glob(glob).match(path) is not None


def violations(changed_paths: Iterable[str],
               policies: Sequence[tuple[Sequence[str], Sequence[str]]]) -> list[tuple[str, str]]:
    """``(path, protected glob)`` for every changed path some policy forbids, sorted by path.

    ``policies``: ``[(protected_globs, allowed_globs), ...]``.  A path outside the repository is
    reported with :data:`OUTSIDE` whenever any policy protects anything."""
    out: dict[str, str] = {}
    active = [(list(p), list(a)) for p, a in policies if p]
    if not active:
        return []
    for raw in changed_paths:
        path = normalize_path(raw)
        if path is None:
            out.setdefault(raw, OUTSIDE)
            continue
        for protected, allowed in active:
            hit = next((g for g in protected if matches(path, g)), None)
            if hit is not None and not any(matches(path, g) for g in allowed):
                out.setdefault(path, hit)
                break
    return sorted(out.items())
