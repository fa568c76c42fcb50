"""Ed25519 keys, the trust file, and governance signatures (SPEC §4.3, §7.2).

A governance line is signed over the canonical JSON of the line as the producer wrote it,
minus ``signature`` and minus every field the ledger stamps at ingest.  The ledger keeps
those exact bytes in the event (``signed_body``) so every replay can re-verify the
signature against the trust file and check that the body says what the event says.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from ledger.algorithms.canonical import canonical_json
from ledger.algorithms.errors import IntegrityError
from ledger.events.catalog import EVENT_TYPES, SIGNED_TYPES


class SignatureError(IntegrityError):
    """A signature is missing, malformed, untrusted or does not verify."""


def key_id(public_key: bytes) -> str:
    """Hex of the first 8 bytes of SHA-256 of the raw 32-byte public key."""
    return hashlib.sha256(public_key).digest()[:8].hex()


def public_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def new_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def write_private_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write a PEM PKCS#8 private key readable only by its owner (refuses to overwrite)."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise SignatureError(f"key file {path} does not exist") from None
    except ValueError as exc:
        raise SignatureError(f"key file {path} is not a PEM PKCS#8 private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"key file {path} does not hold an Ed25519 key")
    return key


@dataclass
class TrustedKey:
    key_id: str
    public_key: bytes
    may_sign: list[str]


@dataclass
class Trust:
    """The trust file: which public keys may sign which governance event types."""

    keys: dict[str, TrustedKey] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "Trust":
        path = Path(path)
        if not path.exists():
            return cls()
        try:
            doc = json.loads(path.read_text())
            keys = {}
            for k in doc["keys"]:
                raw = base64.b64decode(k["public_key"], validate=True)
                if len(raw) != 32 or key_id(raw) != k["key_id"]:
                    raise ValueError(f"key {k['key_id']}: public_key does not match key_id")
                keys[k["key_id"]] = TrustedKey(k["key_id"], raw, list(k["may_sign"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise SignatureError(f"trust file {path} is malformed: {exc}") from None
        return cls(keys)

    def to_json(self) -> dict:
        return {"keys": [{"key_id": k.key_id, "public_key": base64.b64encode(k.public_key).decode(),
                          "may_sign": k.may_sign} for k in self.keys.values()]}

    def save(self, path: Path) -> None:
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)

    def add(self, public_key: bytes, may_sign: list[str]) -> TrustedKey:
        bad = [t for t in may_sign if t not in SIGNED_TYPES]
        if bad:
            raise SignatureError(f"cannot allow {bad}: signable types are {', '.join(SIGNED_TYPES)}")
        tk = TrustedKey(key_id(public_key), public_key, list(may_sign))
        self.keys[tk.key_id] = tk
        return tk

    def verify(self, event_type: str, body: bytes, signature: Any) -> str:
        """Verify ``signature`` ({key_id, value}) over ``body``; return the key id or raise."""
        if not isinstance(signature, dict) or not isinstance(signature.get("key_id"), str) or not isinstance(signature.get("value"), str):
            raise SignatureError("signature must be an object {key_id, value}")
        tk = self.keys.get(signature["key_id"])
        if tk is None:
            raise SignatureError(f"key {signature['key_id']} is not in the trust file")
        if event_type not in tk.may_sign:
            raise SignatureError(f"key {tk.key_id} is not allowed to sign {event_type}")
        try:
            raw = base64.b64decode(signature["value"], validate=True)
            Ed25519PublicKey.from_public_bytes(tk.public_key).verify(raw, body)
        except (InvalidSignature, ValueError):
            raise SignatureError(f"signature by key {tk.key_id} does not verify") from None
        return tk.key_id


def signing_body(line: dict, stamped: list[str] | tuple[str, ...] = ()) -> bytes:
    """Canonical JSON of a line minus ``signature`` and the fields stamped at ingest."""
    return canonical_json({k: v for k, v in line.items() if k != "signature" and k not in stamped})


def sign_line(line: dict, key: Ed25519PrivateKey) -> dict:
    """Return ``line`` with a ``signature`` over its canonical body (as `ledger sign` prints)."""
    if line.get("type") not in EVENT_TYPES:
        raise SignatureError(f"unknown event type {line.get('type')!r}")
    body = signing_body(line)
    sig = {"key_id": key_id(public_bytes(key)), "value": base64.b64encode(key.sign(body)).decode()}
    return {**line, "signature": sig}


def sign_bytes(data: bytes, key: Ed25519PrivateKey) -> dict:
    """Signature object {algorithm, key_id, value} over arbitrary bytes (manifests)."""
    return {"algorithm": "ed25519", "key_id": key_id(public_bytes(key)), "value": base64.b64encode(key.sign(data)).decode()}
