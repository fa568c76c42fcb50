"""Tests for ledger.algorithms.checkpoint: C2SP signed notes and checkpoints, incl. Go interop vectors."""

from __future__ import annotations

import base64
from collections.abc import Callable

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from ledger.algorithms.checkpoint import (
    MAX_SIGNATURES,
    Checkpoint,
    NoteError,
    key_id,
    make_checkpoint,
    open_note,
    parse_checkpoint,
    parse_vkey,
    sign_checkpoint,
    sign_note,
    verify_checkpoint,
    vkey,
)
from ledger.algorithms.merkle import root

# golang.org/x/mod/sumdb/note documentation example (a different implementation).
GO_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
GO_NOTE = (
    GO_TEXT + "\n— PeterNeumann "
    "x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
)
# Real checkpoints of the Go checksum database, and its published verifier key.
SUMDB_VKEY = "sum.golang.org+033de0ae+Ac4zctda0e5eza+HJyk9SxEdh+s3Ux18htTTAD8OuAn8"
SUMDB_NOTE = (
    "go.sum database tree\n6476701\nmb8QLQIs0Z0yP5Cstq6guj87oXWeC9gEM8oVikmm9Wk=\n\n"
    "— sum.golang.org Az3grsLX85Gz+s1SiTbgkuqxgItqFq7gsMUEyVnrsa9LM7Us9S+1xbFIGu95949rj4n"
    "PRYfvimWEPWL+o3GeoWwOoAw=\n"
)
SUMDB_COSIGNED_NOTE = (
    "go.sum database tree\n15067302\ngJyioq6dwR9n+NjEWORfYmH+ubeYm3kH42BBQ0bTpYI=\n\n"
    "— sum.golang.org Az3grp1rvWOs5NKlr/xR4GLN/CDyzzakmt1o61uSxYKpK1SerqOP2ClbX/peKUZjYny"
    "omH5Xz7GZG3TpB7OeKn4E2ww=\n"
    "— test.example.com qTGhC/xIPQ0AXKHK6Y+9ypRfuvMZWPjRXM8NiOg5M1WREn07VQXyuIXM3NRNav3ie"
    "VFLUqDRK77PWDmL6w8w84UqeAw=\n"
)
# Example of c2sp.org/signed-note.
SPEC_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
SPEC_NOTE = (
    "This is an example message.\n\n— example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXpp"
    "zi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n"
)

NAME = "ledger.example/log"
ROOT = root([b"a", b"b", b"c"])


def _go_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(base64.b64decode(GO_SKEY.split("+", 4)[4])[1:])


@pytest.fixture(scope="module")
def private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


@pytest.fixture(scope="module")
def public_key(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes_raw()


@pytest.fixture(scope="module")
def signed(private_key: Ed25519PrivateKey) -> str:
    return sign_checkpoint(make_checkpoint(NAME, 3, ROOT), NAME, private_key)


# ------------------------------------------------------------------- interoperability


def test_go_key_vectors() -> None:
    public = _go_private_key().public_key().public_bytes_raw()
    assert vkey("PeterNeumann", public) == GO_VKEY
    assert key_id("PeterNeumann", public).hex() == "c74f20a3"
    assert parse_vkey(GO_VKEY) == ("PeterNeumann", public)


def test_go_signature_is_reproduced_byte_for_byte() -> None:
    assert sign_note(GO_TEXT, "PeterNeumann", _go_private_key()) == GO_NOTE
    assert open_note(GO_NOTE, *parse_vkey(GO_VKEY)) == GO_TEXT


def test_signed_note_spec_example() -> None:
    assert open_note(SPEC_NOTE, *parse_vkey(SPEC_VKEY)) == "This is an example message.\n"


def test_real_sumdb_checkpoints_verify() -> None:
    name, public = parse_vkey(SUMDB_VKEY)
    checkpoint = verify_checkpoint(SUMDB_NOTE, name, public)
    assert checkpoint.origin == "go.sum database tree" and checkpoint.size == 6476701
    assert checkpoint.root == base64.b64decode("mb8QLQIs0Z0yP5Cstq6guj87oXWeC9gEM8oVikmm9Wk=")
    # A witness cosignature by a key we do not know is ignored.
    assert verify_checkpoint(SUMDB_COSIGNED_NOTE, name, public).size == 15067302


# ------------------------------------------------------------------------- round trip


def test_round_trip(signed: str, public_key: bytes) -> None:
    body = make_checkpoint(NAME, 3, ROOT)
    assert body == f"{NAME}\n3\n{base64.b64encode(ROOT).decode()}\n"
    assert signed.startswith(body + "\n— " + NAME + " ")
    expected = Checkpoint(NAME, 3, ROOT)
    assert verify_checkpoint(signed, NAME, public_key) == expected
    assert parse_checkpoint(signed) == parse_checkpoint(body) == expected
    origin, size, root_hash = expected
    assert (origin, size, root_hash) == (NAME, 3, ROOT)


def test_empty_tree_and_extension_lines(private_key: Ed25519PrivateKey, public_key: bytes) -> None:
    empty = sign_checkpoint(make_checkpoint(NAME, 0, root([])), NAME, private_key)
    assert verify_checkpoint(empty, NAME, public_key) == Checkpoint(NAME, 0, root([]))
    extended = make_checkpoint(NAME, 3, ROOT) + "extension line\n"
    assert verify_checkpoint(sign_checkpoint(extended, NAME, private_key), NAME, public_key) == (
        Checkpoint(NAME, 3, ROOT)
    )


def test_vkey_round_trip(public_key: bytes) -> None:
    text = vkey(NAME, public_key)
    name, id_hex, _ = text.split("+", 2)
    assert name == NAME and id_hex == key_id(NAME, public_key).hex()
    assert parse_vkey(text) == (NAME, public_key)


def test_several_signatures(private_key: Ed25519PrivateKey, public_key: bytes) -> None:
    other = Ed25519PrivateKey.from_private_bytes(bytes(32))
    body = make_checkpoint(NAME, 3, ROOT)
    cosigned = (
        sign_note(body, NAME, private_key) + sign_note(body, "witness", other).split("\n\n")[1]
    )
    assert verify_checkpoint(cosigned, NAME, public_key) == Checkpoint(NAME, 3, ROOT)
    other_public = other.public_key().public_bytes_raw()
    assert verify_checkpoint(cosigned, "witness", other_public).size == 3


# ---------------------------------------------------------------------------- tamper


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) >= 1
    return text.replace(old, new, 1)


TAMPERS: dict[str, Callable[[str], str]] = {
    "size": lambda note: _replace_once(note, "\n3\n", "\n4\n"),
    "origin": lambda note: "x" + note,
    "root": lambda note: _replace_once(
        note, base64.b64encode(ROOT).decode(), base64.b64encode(root([b"a"])).decode()
    ),
    "signature": lambda note: note[:-10] + ("A" if note[-10] != "A" else "B") + note[-9:],
    "signer name": lambda note: _replace_once(note, f"— {NAME} ", "— other.example/log "),
    "hyphen for em dash": lambda note: _replace_once(note, "— ", "- "),
    "no blank line": lambda note: _replace_once(note, "\n\n", "\n"),
    "no final newline": lambda note: note[:-1],
    "no signatures": lambda note: note.split("\n\n")[0] + "\n\n",
    "control character": lambda note: _replace_once(note, "\n3\n", "\n3\r\n"),
    "extra field": lambda note: note[:-1] + " extra\n",
}


@pytest.mark.parametrize("tamper", TAMPERS.values(), ids=TAMPERS.keys())
def test_tampered_note_is_rejected(
    tamper: Callable[[str], str], signed: str, public_key: bytes
) -> None:
    with pytest.raises(NoteError):
        verify_checkpoint(tamper(signed), NAME, public_key)


def test_wrong_key_or_name_is_rejected(signed: str, public_key: bytes) -> None:
    stranger = Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key().public_bytes_raw()
    with pytest.raises(NoteError, match="no signature by"):
        verify_checkpoint(signed, NAME, stranger)
    with pytest.raises(NoteError, match="no signature by"):
        verify_checkpoint(signed, "other.example/log", public_key)


def test_bad_signature_from_trusted_key_rejects_note(signed: str, public_key: bytes) -> None:
    text, line = signed.split("\n\n")
    raw = bytearray(base64.b64decode(line.split(" ")[2]))
    raw[-1] ^= 1
    forged = f"— {NAME} {base64.b64encode(bytes(raw)).decode()}\n"
    with pytest.raises(NoteError, match="does not verify"):
        verify_checkpoint(f"{text}\n\n{line}{forged}", NAME, public_key)


@given(st.data())
def test_any_single_character_change_is_rejected(
    signed: str, public_key: bytes, draw: st.DataObject
) -> None:
    position = draw.draw(st.integers(0, len(signed) - 1), label="position")
    char = draw.draw(st.sampled_from("A0+/= \n-—x"), label="char")
    if signed[position] == char:
        return
    with pytest.raises(NoteError):
        verify_checkpoint(signed[:position] + char + signed[position + 1 :], NAME, public_key)


def test_too_many_signatures_are_rejected(signed: str, public_key: bytes) -> None:
    text, line = signed.split("\n\n")
    with pytest.raises(NoteError, match="at most"):
        verify_checkpoint(text + "\n\n" + line * (MAX_SIGNATURES + 1), NAME, public_key)


# ------------------------------------------------------------------------ malformed


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (f"{NAME}\n3\n", "origin, a tree size and a root"),
        (f"\n3\n{base64.b64encode(ROOT).decode()}\n", "origin line is empty"),
        (f"{NAME}\n03\n{base64.b64encode(ROOT).decode()}\n", "leading zeroes"),
        (f"{NAME}\n-3\n{base64.b64encode(ROOT).decode()}\n", "leading zeroes"),
        (f"{NAME}\n٣\n{base64.b64encode(ROOT).decode()}\n", "leading zeroes"),
        (f"{NAME}\n3\n{base64.b64encode(ROOT[:31]).decode()}\n", "31 bytes"),
        (f"{NAME}\n3\n{base64.b64encode(ROOT).decode()[:-1]}\n", "base64"),
        (f"{NAME}\n3\n{base64.b64encode(ROOT).decode()[:-2]}x=\n", "base64"),
        (f"{NAME}\n3\n{base64.b64encode(ROOT).decode()}", "newline"),
        (f"{NAME}\t\n3\n{base64.b64encode(ROOT).decode()}\n", "control character"),
    ],
)
def test_malformed_checkpoint_bodies(
    body: str, reason: str, private_key: Ed25519PrivateKey
) -> None:
    with pytest.raises(NoteError, match=reason):
        parse_checkpoint(body)
    with pytest.raises(NoteError, match=reason):
        sign_checkpoint(body, NAME, private_key)


def test_make_checkpoint_validates() -> None:
    with pytest.raises(NoteError, match="origin"):
        make_checkpoint("", 1, ROOT)
    with pytest.raises(NoteError, match="origin"):
        make_checkpoint("a\nb", 1, ROOT)
    with pytest.raises(NoteError, match="tree size"):
        make_checkpoint(NAME, -1, ROOT)
    with pytest.raises(NoteError, match="tree size"):
        make_checkpoint(NAME, True, ROOT)
    with pytest.raises(NoteError, match="root hash"):
        make_checkpoint(NAME, 1, ROOT[:16])


@pytest.mark.parametrize("name", ["", "a b", "a+b", "a\u00a0b", "a\nb"])
def test_invalid_key_names(name: str, private_key: Ed25519PrivateKey, public_key: bytes) -> None:
    with pytest.raises(NoteError, match="key name"):
        sign_checkpoint(make_checkpoint(NAME, 3, ROOT), name, private_key)
    with pytest.raises(NoteError, match="key name"):
        vkey(name, public_key)


@pytest.mark.parametrize(
    "text",
    [
        "PeterNeumann+c74f20a3",  # missing key
        "PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # wrong ID
        "PeterNeumann+C74F20A3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # upper-case ID
        "PeterNeumann+c74f20a3+AhpcuQcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # wrong type
        "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10",  # short key
        "Peter+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # wrong name
    ],
)
def test_invalid_vkeys(text: str) -> None:
    with pytest.raises(NoteError):
        parse_vkey(text)


def test_sign_note_requires_final_newline(private_key: Ed25519PrivateKey) -> None:
    with pytest.raises(NoteError, match="newline"):
        sign_note("no newline", NAME, private_key)


def test_public_key_length_is_checked(signed: str) -> None:
    with pytest.raises(NoteError, match="31 bytes"):
        verify_checkpoint(signed, NAME, bytes(31))
