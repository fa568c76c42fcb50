"""Opaque identifiers (SPEC §4.3, §9 "Identifiers are opaque"): natural keys and file names.

Natural keys join components with ``/``.  Each component is escaped first, so no two
distinct tuples share a key: ``%``, ``/`` and the control characters (U+0000-U+001F,
U+007F-U+009F) become ``%XX`` (upper-case hex of their UTF-8 bytes); every other character,
any Unicode included, stays as it is.  An id without those characters keeps exactly the key
it always had (old logs' keys stay valid): ``key_component("r1") == "r1"``.

File names (``file_name``) are URL percent-encoding with nothing kept but ``A-Z a-z 0-9 _ . - ~``
(the same bytes as ``urllib.parse.quote(s, safe="")``, so existing names are unchanged), with
``.`` and ``..`` escaped too (a route ``..`` stays inside its folder), ``""`` named ``%``, and names longer than
:data:`MAX_FILE_NAME` bytes cut and suffixed with ``%~`` and 32 hex digits of the id's SHA-256
(``%~`` never occurs in an uncut name, so a cut name cannot equal another id's name).

Length (SPEC 11.7): an identifier is at most :data:`MAX_ID_BYTES` (1,024) bytes of UTF-8 *after*
escaping as a natural-key component (``"a/b"`` counts 5 bytes, ``"ü"`` 2); :func:`id_problem`
says why a longer one is refused.  Every id field of an event, the gateway's execution and request
ids and the CLI arguments naming ids are checked against it.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

MAX_FILE_NAME = 200  # bytes; file systems allow 255, leaving room for temporary-file affixes
MAX_ID_BYTES = 1024  # an identifier's UTF-8 bytes once escaped as a natural-key component (SPEC 11.7)
_ID_FAST = MAX_ID_BYTES // 6  # no character escapes to more than 6 bytes (U+0080..U+009F -> %C2%80)

_KEY_UNSAFE = re.compile("[%/\x00-\x1f\x7f-\x9f]")
_NAME_SAFE = re.compile(r"[A-Za-z0-9_.\-~]*")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-~]")


def _pct(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


def key_component(value: Any) -> str:
    """One natural-key component, escaped (``str(value)`` first, as the catalog always did)."""
    s = value if isinstance(value, str) else str(value)
    if _KEY_UNSAFE.search(s) is None:
        return s
    return _KEY_UNSAFE.sub(lambda m: _pct(m.group()), s)


def join_key(*parts: Any) -> str:
    """``prefix/comp1/comp2...`` with every component escaped (see module doc)."""
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    if _KEY_UNSAFE.search("".join(strs)) is None:  # nothing to escape in any component (the common case)
        return "/".join(strs)
    return "/".join(key_component(p) for p in strs)


def split_key(key: str) -> list[str]:
    """Inverse of :func:`join_key` (components as strings)."""
    return [_unescape(p) for p in key.split("/")]


def _unescape(part: str) -> str:
    if "%" not in part:
        return part
    raw = re.sub(rb"%([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]), part.encode("utf-8", "surrogatepass"))
    return raw.decode("utf-8", "surrogatepass")


def file_name(value: Any, max_bytes: int = MAX_FILE_NAME) -> str:
    """A safe single path component for an id (see module doc); never ``""``, ``.``, ``..`` or a
    name containing ``/`` or NUL, never longer than ``max_bytes``."""
    s = value if isinstance(value, str) else str(value)
    name = s if _NAME_SAFE.fullmatch(s) else _NAME_UNSAFE.sub(lambda m: _pct(m.group()), s)
    if name in ("", ".", ".."):
        return {"": "%", ".": "%2E", "..": "%2E%2E"}[name]
    if len(name) <= max_bytes:
        return name
    digest = hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    cut = max_bytes - 2 - len(digest)
    head = name[:cut]
    pct = head.rfind("%", max(0, cut - 2))
    if pct != -1:  # do not split a %XX escape
        head = head[:pct]
    return f"{head}%~{digest}"


def id_bytes(value: str) -> int:
    """UTF-8 bytes of ``value`` escaped as a natural-key component (what :data:`MAX_ID_BYTES` bounds)."""
    return len(key_component(value).encode("utf-8", "surrogatepass"))


def id_problem(value: str) -> str | None:
    """Why ``value`` is not an acceptable identifier length, or ``None`` (the common short id
    costs one ``len``)."""
    if len(value) <= _ID_FAST:
        return None
    n = id_bytes(value)
    if n <= MAX_ID_BYTES:
        return None
    return f"identifier too long: {n:,} bytes escaped (UTF-8), the limit is {MAX_ID_BYTES:,}"
