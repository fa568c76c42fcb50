"""Who may do what on the gateway (SPEC 12.3): an admin token and one token per execution.

- The **admin token** opens and closes executions, reads ``/metrics`` and may call into any
  execution. ``ledger gateway`` keeps it in ``<store>/gateway.token`` (mode 0600, created on first
  start) unless ``--token-file FILE`` names one; rotate it by restarting with a new file.
- ``POST /executions/{id}/ledger/open`` answers a fresh **execution token** (256 bits, URL-safe).
  Only its SHA-256 is kept (the ``execution_tokens`` table of ``gateway.db``, shared by every
  worker and by a restarted gateway); the token itself is never recorded, logged or projected.
- A call needs ``Authorization: Bearer T`` or ``x-api-key: T`` (Gemini clients: ``x-goog-api-key``).
  No token or an unknown one is 401; another execution's token is 403.

The admin token is compared with :func:`hmac.compare_digest`; an execution token is looked up by
its SHA-256, so the comparison never touches the token's own bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ledger.algorithms.errors import InputError

__all__ = ["Auth", "Denied", "TOKEN_FILE", "admin_token", "read_token_file", "request_token"]

TOKEN_FILE = "gateway.token"
_SCHEMA = "CREATE TABLE IF NOT EXISTS execution_tokens (token_sha256 TEXT PRIMARY KEY, execution_id TEXT NOT NULL)"


@dataclass(frozen=True)
class Denied:
    """A refused request: 401 (no or unknown credential) or 403 (another execution's)."""

    status: int
    message: str


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def read_token_file(path: str | Path) -> str:
    """The token a file holds (its first line; InputError naming the file when it cannot be read or is empty)."""
    p = Path(path)
    try:
        token = p.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the gateway token file {p}: {exc}") from None
    if not token or any(c.isspace() for c in token):
        raise InputError(f"the gateway token file {p} holds no token (one line of non-space characters)")
    return token


def admin_token(path: str | Path, *, create: bool = True) -> str:
    """The admin token in ``path``; with ``create``, a new one is written there (mode 0600) when the
    file does not exist."""
    p = Path(path)
    if create and not p.exists():
        token = secrets.token_urlsafe(32)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it meanwhile: use theirs
            return read_token_file(p)
        except OSError as exc:
            raise InputError(f"cannot create the gateway token file {p}: {exc}") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
        return token
    return read_token_file(p)


def request_token(headers: Mapping[str, str]) -> str | None:
    """The credential a request carries: ``Authorization: Bearer T``, ``x-api-key`` or ``x-goog-api-key``."""
    auth = headers.get("Authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    for name in ("x-api-key", "x-goog-api-key"):
        value = headers.get(name)
        if value and value.strip():
            return value.strip()
    return None


class Auth:
    """The gateway's credentials: ``admin`` None means authentication is off (``--no-auth``)."""

    def __init__(self, admin: str | None, db_path: Path | None = None) -> None:
        self.admin = admin
        self._db = None
        if admin is not None and db_path is not None:
            self._db = sqlite3.connect(db_path, check_same_thread=False, timeout=30.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
            self._db.commit()
        self._lock = threading.Lock()
        self._known: dict[str, str] = {}  # token sha256 -> execution id

    @classmethod
    def off(cls) -> "Auth":
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self.admin is not None

    def is_admin(self, token: str | None) -> bool:
        return token is not None and self.admin is not None and hmac.compare_digest(
            token.encode("utf-8", "surrogatepass"), self.admin.encode("utf-8", "surrogatepass"))

    def issue(self, execution_id: str) -> str:
        """A fresh token for ``execution_id`` (kept as its SHA-256 only)."""
        token = secrets.token_urlsafe(32)
        digest = _digest(token)
        with self._lock:
            if self._db is not None:
                self._db.execute("INSERT INTO execution_tokens VALUES (?, ?)", (digest, execution_id))
                self._db.commit()
            self._known[digest] = execution_id
        return token

    def execution_of(self, token: str) -> str | None:
        digest = _digest(token)
        with self._lock:
            ex = self._known.get(digest)
            if ex is None and self._db is not None:
                row = self._db.execute("SELECT execution_id FROM execution_tokens WHERE token_sha256 = ?",
                                       (digest,)).fetchone()
                if row is not None:
                    ex = self._known[digest] = row[0]
        return ex

    def check(self, token: str | None, execution_id: str | None, *, admin_only: bool = False) -> Denied | None:
        """None when the request may go on; else why not. ``execution_id`` None: any valid token will do."""
        if not self.enabled or self.is_admin(token):
            return None
        if token is None:
            return Denied(401, "no credential: send the execution's token as Authorization: Bearer TOKEN or x-api-key")
        if admin_only:
            return Denied(401, "this endpoint needs the gateway's admin token (Authorization: Bearer ADMIN)")
        owner = self.execution_of(token)
        if owner is None:
            return Denied(401, "invalid credential: not a token this gateway issued")
        if execution_id is not None and owner != execution_id:
            return Denied(403, f"this token belongs to another execution, not to {execution_id!r}")
        return None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
