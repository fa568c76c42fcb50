"""C2SP signed notes and transparency-log checkpoints, signed with Ed25519 (pure; no I/O).

A checkpoint (https://c2sp.org/tlog-checkpoint) is the note text::

    <origin>\\n
    <tree size in decimal, no leading zeroes>\\n
    <base64 of the 32-byte RFC 9162 root hash>\\n

and a signed note (https://c2sp.org/signed-note) appends a blank line and one line per
signature::

    — <key name> <base64(4-byte key ID || Ed25519 signature of the note text)>\\n

where key ID = SHA-256(key name || 0x0A || 0x01 || 32-byte public key)[:4]. A verifier
key is written ``<name>+<8 hex digits of the key ID>+<base64(0x01 || public key)>``
(the ``golang.org/x/mod/sumdb/note`` format), so notes made here verify with the Go
tooling and witnesses, and theirs verify here.

Every failure raises :class:`NoteError` (a ``ValueError``) saying what is wrong.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from ledger.algorithms.errors import IntegrityError

__all__ = [
    "Checkpoint",
    "NoteError",
    "key_id",
    "make_checkpoint",
    "open_note",
    "parse_checkpoint",
    "parse_vkey",
    "sign_checkpoint",
    "sign_note",
    "verify_checkpoint",
    "vkey",
]

ED25519_TYPE = 0x01
"""signed-note signature type identifier byte for Ed25519."""

MAX_SIGNATURES = 100
"""Most signature lines accepted in one note (the spec requires at least 16)."""

_SIGNATURE_PREFIX = "\u2014 "  # em dash, space
_ROOT_SIZE = 32
_SIZE_LINE = re.compile(r"0|[1-9][0-9]*")


class NoteError(IntegrityError):
    """A signed note or checkpoint is malformed, or its signature does not verify."""


class Checkpoint(NamedTuple):
    """The three mandatory fields of a checkpoint."""

    origin: str
    size: int
    root: bytes


# ---------------------------------------------------------------------------- helpers


def _b64decode(text: str, what: str) -> bytes:
    """Decode canonical standard base64 (RFC 4648 §4), or raise NoteError naming ``what``."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise NoteError(f"{what} is not valid base64: {text!r}") from None
    if base64.b64encode(raw).decode("ascii") != text:
        raise NoteError(f"{what} is not canonical base64: {text!r}")
    return raw


def _check_name(name: str) -> None:
    """Raise NoteError unless ``name`` is a valid key name (non-empty, no spaces or '+')."""
    if not name:
        raise NoteError("key name is empty")
    for char in name:
        if char.isspace() or char == "+" or char < " ":
            raise NoteError(f"key name {name!r} contains {char!r} (no spaces, '+' or controls)")


def _check_text(text: str, what: str) -> None:
    """Raise NoteError unless ``text`` ends in a newline and has no other control chars."""
    if not text.endswith("\n"):
        raise NoteError(f"{what} does not end with a newline")
    for char in text:
        if char < " " and char != "\n":
            raise NoteError(f"{what} contains the control character {char!r}")


def _public_key(public_key_bytes: bytes) -> Ed25519PublicKey:
    """Load a raw 32-byte Ed25519 public key, or raise NoteError."""
    if len(public_key_bytes) != 32:
        raise NoteError(f"Ed25519 public key has {len(public_key_bytes)} bytes, expected 32")
    return Ed25519PublicKey.from_public_bytes(bytes(public_key_bytes))


# -------------------------------------------------------------------------------- keys


def key_id(name: str, public_key_bytes: bytes) -> bytes:
    """Return the 4-byte signed-note key ID of an Ed25519 key with this name."""
    _check_name(name)
    _public_key(public_key_bytes)
    material = name.encode("utf-8") + b"\n" + bytes([ED25519_TYPE]) + bytes(public_key_bytes)
    return hashlib.sha256(material).digest()[:4]


def vkey(name: str, public_key_bytes: bytes) -> str:
    """Return the verifier key string ``<name>+<hex key ID>+<base64(0x01 || key)>``."""
    encoded = base64.b64encode(bytes([ED25519_TYPE]) + bytes(public_key_bytes)).decode("ascii")
    return f"{name}+{key_id(name, public_key_bytes).hex()}+{encoded}"


def parse_vkey(verifier_key: str) -> tuple[str, bytes]:
    """Parse a verifier key string into ``(name, 32-byte public key)``, checking its ID."""
    parts = verifier_key.split("+", 2)
    if len(parts) != 3:
        raise NoteError(f"verifier key {verifier_key!r} is not <name>+<id>+<key>")
    name, id_hex, encoded = parts
    _check_name(name)
    if not re.fullmatch(r"[0-9a-f]{8}", id_hex):
        raise NoteError(f"verifier key ID {id_hex!r} is not 8 lowercase hex digits")
    raw = _b64decode(encoded, "verifier key")
    if len(raw) != 33 or raw[0] != ED25519_TYPE:
        raise NoteError("verifier key is not an Ed25519 key (type 0x01 and 32 bytes)")
    public_key_bytes = raw[1:]
    if key_id(name, public_key_bytes).hex() != id_hex:
        raise NoteError(f"verifier key ID {id_hex} does not match the name and key")
    return name, public_key_bytes


# ------------------------------------------------------------------------ signed notes


def sign_note(text: str, name: str, private_key: Ed25519PrivateKey) -> str:
    """Sign ``text`` (which must end in a newline) and return the signed note."""
    _check_text(text, "note text")
    public_key_bytes = private_key.public_key().public_bytes_raw()
    signature = key_id(name, public_key_bytes) + private_key.sign(text.encode("utf-8"))
    return f"{text}\n{_SIGNATURE_PREFIX}{name} {base64.b64encode(signature).decode('ascii')}\n"


def _split_note(note: str) -> tuple[str, list[str]]:
    """Split a signed note into its text (with final newline) and its signature lines."""
    _check_text(note, "signed note")
    separator = note.rfind("\n\n")
    if separator < 0:
        raise NoteError("signed note has no blank line before its signatures")
    text, signature_block = note[: separator + 1], note[separator + 2 :]
    lines = signature_block.split("\n")[:-1]
    if not lines:
        raise NoteError("signed note has no signature lines")
    if len(lines) > MAX_SIGNATURES:
        raise NoteError(f"signed note has {len(lines)} signatures, at most {MAX_SIGNATURES}")
    return text, lines


def open_note(note: str, name: str, public_key_bytes: bytes) -> str:
    """Verify a signed note against one trusted Ed25519 key; return the note text.

    Signatures by other keys (another name or key ID) are ignored, as the spec
    requires; the note is rejected unless the trusted key signed it, and rejected if
    any signature claiming to be by the trusted key fails to verify.
    """
    public_key = _public_key(public_key_bytes)
    expected_id = key_id(name, public_key_bytes)
    text, lines = _split_note(note)
    message = text.encode("utf-8")
    verified = False
    for number, line in enumerate(lines, start=1):
        if not line.startswith(_SIGNATURE_PREFIX):
            raise NoteError(f"signature line {number} does not start with an em dash and space")
        fields = line[len(_SIGNATURE_PREFIX) :].split(" ")
        if len(fields) != 2:
            raise NoteError(f"signature line {number} is not '— <name> <signature>'")
        signer, encoded = fields
        _check_name(signer)
        signature = _b64decode(encoded, f"signature {number}")
        if len(signature) < 5:
            raise NoteError(f"signature {number} is too short ({len(signature)} bytes)")
        if signer != name or signature[:4] != expected_id:
            continue
        try:
            public_key.verify(signature[4:], message)
        except InvalidSignature:
            raise NoteError(
                f"signature {number} by {name} ({expected_id.hex()}) does not verify"
            ) from None
        verified = True
    if not verified:
        raise NoteError(f"signed note has no signature by {name} ({expected_id.hex()})")
    return text


# ------------------------------------------------------------------------- checkpoints


def make_checkpoint(origin: str, size: int, root: bytes) -> str:
    """Return the checkpoint note text for ``origin`` at tree ``size`` with ``root``."""
    if not origin or any(char < " " for char in origin):
        raise NoteError(f"origin {origin!r} must be non-empty, without control characters")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise NoteError(f"tree size must be a non-negative integer, got {size!r}")
    if len(root) != _ROOT_SIZE:
        raise NoteError(f"root hash has {len(root)} bytes, expected {_ROOT_SIZE}")
    return f"{origin}\n{size}\n{base64.b64encode(root).decode('ascii')}\n"


def _parse_body(text: str) -> Checkpoint:
    """Parse checkpoint note text; extension lines after the root are allowed, ignored."""
    _check_text(text, "checkpoint")
    lines = text[:-1].split("\n")
    if len(lines) < 3:
        raise NoteError("checkpoint needs an origin, a tree size and a root hash line")
    origin, size_line, root_line, *extensions = lines
    if not origin:
        raise NoteError("checkpoint origin line is empty")
    if not _SIZE_LINE.fullmatch(size_line):
        raise NoteError(
            f"checkpoint tree size {size_line!r} is not a decimal without leading zeroes"
        )
    root = _b64decode(root_line, "checkpoint root hash")
    if len(root) != _ROOT_SIZE:
        raise NoteError(f"checkpoint root hash has {len(root)} bytes, expected {_ROOT_SIZE}")
    if any(not line for line in extensions):
        raise NoteError("checkpoint has an empty extension line")
    return Checkpoint(origin, int(size_line), root)


def parse_checkpoint(note: str) -> Checkpoint:
    """Parse a checkpoint, bare or signed, WITHOUT verifying any signature.

    Use :func:`verify_checkpoint` for anything that must be trusted.
    """
    separator = note.rfind("\n\n")
    return _parse_body(note if separator < 0 else note[: separator + 1])


def sign_checkpoint(body: str, name: str, private_key: Ed25519PrivateKey) -> str:
    """Check that ``body`` is a checkpoint, sign it, and return the signed note."""
    _parse_body(body)
    return sign_note(body, name, private_key)


def verify_checkpoint(note: str, name: str, public_key_bytes: bytes) -> Checkpoint:
    """Verify a signed checkpoint against one trusted key and return its fields."""
    return _parse_body(open_note(note, name, public_key_bytes))
