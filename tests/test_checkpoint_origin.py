"""The checkpoint origin and verifier key of a store (issue 12): `ledger init --origin`, the
stored origin (unique per key, stable across moves), `ledger log key`, `status --json`.

The checkpoints `ledger log head` prints are verified here from the `ledger log key` text
alone, by an independent reading of the signed-note format with `cryptography` (not
ledger.algorithms.checkpoint)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ledger.cli import main
from ledger.corpus.integrity import log_heads
from ledger.events.signing import load_private_key, public_bytes
from ledger.log import open_log


def _run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _key(capsys, store: str) -> dict:
    code, out, err = _run(capsys, "--store", store, "log", "key", "--json")
    assert code == 0, err
    return json.loads(out)


def _independent_verify(vkey_line: str, note: str) -> tuple[str, int, bytes]:
    """Verify a signed checkpoint from the verifier-key text only: name+hex8+base64(0x01||key)."""
    name, id_hex, b64 = vkey_line.split("+", 2)  # the base64 may hold "+" too
    raw = base64.b64decode(b64, validate=True)
    assert len(raw) == 33 and raw[0] == 0x01
    pub = raw[1:]
    assert hashlib.sha256(name.encode() + b"\n\x01" + pub).digest()[:4].hex() == id_hex
    text, _, sigs = note.partition("\n\n")
    text += "\n"
    (line,) = sigs.splitlines()
    signer, sig_b64 = line.removeprefix("\u2014 ").split(" ")
    assert signer == name
    sig = base64.b64decode(sig_b64, validate=True)
    assert sig[:4].hex() == id_hex
    Ed25519PublicKey.from_public_bytes(pub).verify(sig[4:], text.encode())  # raises InvalidSignature
    origin, size, root = text.splitlines()
    return origin, int(size), base64.b64decode(root)


def _events(tmp_path: Path, n: int = 3, first: int = 0) -> str:
    """A JSON-lines file of ``n`` opened-and-closed executions ``e{first}`` ... (its path)."""
    src = tmp_path / f"in-{first}.jsonl"
    lines = []
    for e in range(first, first + n):
        lines.append({"type": "execution_opened", "execution_id": f"e{e}", "task_id": "t1",
                      "deadline": "2030-01-01T00:00:00Z", "policy": "qwen@1"})
        lines.append({"type": "execution_closed", "execution_id": f"e{e}", "status": "completed",
                      "artifact_versions": ["v1"]})
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(src)


def test_two_stores_named_store_get_different_origins_and_a_move_keeps_it(tmp_path, capsys):
    a, b = tmp_path / "a" / "store", tmp_path / "b" / "store"
    for s in (a, b):
        assert _run(capsys, "--store", str(s), "init")[0] == 0
    ka, kb = _key(capsys, str(a)), _key(capsys, str(b))
    pub_a = public_bytes(load_private_key(a / "checkpoint.key"))
    assert ka["origin"] == "trajectory-ledger/" + hashlib.sha256(pub_a).hexdigest()[:16]
    assert ka["origin"] != kb["origin"]
    assert ka["vkey"] == f"{ka['origin']}+{ka['key_hash']}+" + base64.b64encode(b"\x01" + pub_a).decode()
    assert (a / "checkpoint.vkey").read_text() == ka["vkey"] + "\n"
    assert (a / "checkpoint.origin").read_text() == ka["origin"] + "\n"
    code, out, _ = _run(capsys, "--store", str(a), "log", "key")
    assert code == 0 and out == ka["vkey"] + "\n"
    # no secret anywhere but the key file
    secret = load_private_key(a / "checkpoint.key").private_bytes_raw()
    for f in ("checkpoint.vkey", "checkpoint.origin"):
        data = (a / f).read_bytes()
        assert b"PRIVATE" not in data and secret not in data and base64.b64encode(secret) not in data
    # moving the store keeps its origin and key
    moved = tmp_path / "elsewhere" / "renamed"
    shutil.move(str(a), moved)
    assert _key(capsys, str(moved)) == ka


def test_origin_flag_is_honoured_and_bad_origins_are_refused(tmp_path, capsys):
    s = tmp_path / "s"
    assert _run(capsys, "--store", str(s), "init", "--origin", "example.com/my-log")[0] == 0
    k = _key(capsys, str(s))
    assert k["origin"] == "example.com/my-log" and k["vkey"].startswith("example.com/my-log+")
    assert _run(capsys, "--store", str(s), "init", "--origin", "example.com/my-log")[0] == 0  # idempotent
    code, _, err = _run(capsys, "--store", str(s), "init", "--origin", "other")
    assert code == 2 and err == ("ledger: error: the store already has origin 'example.com/my-log' "
                                 f"({s / 'checkpoint.origin'}); an origin never changes (its published "
                                 "checkpoints name it)\n")
    assert _key(capsys, str(s))["origin"] == "example.com/my-log"
    bad = {"": "origin is empty", "a b": "origin 'a b' contains ' '", "a+b": "origin 'a+b' contains '+'",
           "a\nb": "origin 'a\\nb' contains '\\n'", "x\tb": "origin 'x\\tb' contains '\\t'",
           "o" * 201: "origin has 201 characters, at most 200"}
    for i, (origin, why) in enumerate(bad.items()):
        fresh = tmp_path / f"bad{i}"
        code, out, err = _run(capsys, "--store", str(fresh), "init", "--origin", origin)
        assert code == 2 and out == "" and err.startswith(f"ledger: error: {why}") and err.count("\n") == 1, err
        assert not fresh.exists()  # nothing created
    assert _run(capsys, "--store", str(tmp_path / "ok"), "init", "--origin", "o" * 200)[0] == 0


def test_log_key_verifies_log_head_independently_and_status_shows_it(tmp_path, capsys):
    s = str(tmp_path / "store")
    assert _run(capsys, "--store", s, "init")[0] == 0
    assert _run(capsys, "--store", s, "ingest", _events(tmp_path))[0] == 0
    k = _key(capsys, s)
    code, note, _ = _run(capsys, "--store", s, "log", "head")
    assert code == 0
    origin, size, root = _independent_verify(k["vkey"], note)
    code, out, _ = _run(capsys, "--store", s, "status", "--json")
    st = json.loads(out)
    assert st["checkpoint_vkey"] == k["vkey"] and st["checkpoint_origin"] == k["origin"] == origin
    assert (size, root.hex()) == (6, st["log"]["head"]["log:0"]["root"]) and st["log"]["events"] == 6
    forged = note.replace("\n6\n", "\n5\n")
    with pytest.raises(InvalidSignature):
        _independent_verify(k["vkey"], forged)


def test_an_older_store_keeps_its_folder_origin_and_its_checkpoints_verify(tmp_path, capsys):
    """A store made before origins were stored (no checkpoint.origin / .vkey): its checkpoints were
    signed under trajectory-ledger/<folder>; that origin is kept (written on first use)."""
    s = tmp_path / "old-store"
    assert _run(capsys, "--store", str(s), "init")[0] == 0
    assert _run(capsys, "--store", str(s), "ingest", _events(tmp_path))[0] == 0
    (s / "checkpoint.origin").unlink()
    (s / "checkpoint.vkey").unlink()
    with open_log(str(s)) as log:  # what the old `ledger log head` recorded
        (old_note,) = log_heads(log, load_private_key(s / "checkpoint.key"), "trajectory-ledger/old-store",
                                record=s / "checkpoints.jsonl")
    code, out, err = _run(capsys, "--store", str(s), "audit")  # read-only: writes nothing
    assert code == 0, out + err
    assert not (s / "checkpoint.origin").exists()
    st = json.loads(_run(capsys, "--store", str(s), "status", "--json")[1])
    assert st["checkpoint_origin"] == "trajectory-ledger/old-store"
    k = _key(capsys, str(s))  # first use: the derived origin is stored
    assert k["origin"] == "trajectory-ledger/old-store"
    assert (s / "checkpoint.origin").read_text() == "trajectory-ledger/old-store\n"
    assert _independent_verify(k["vkey"], old_note)[0] == "trajectory-ledger/old-store"
    # --origin cannot rename an older store whose checkpoints name the derived origin
    (s / "checkpoint.origin").unlink()
    code, _, err = _run(capsys, "--store", str(s), "init", "--origin", "new-name")
    assert code == 2 and "has recorded checkpoints" in err
    moved = tmp_path / "moved"
    assert _run(capsys, "--store", str(s), "log", "head")[0] == 0  # stores the origin again
    shutil.move(str(s), moved)
    assert _key(capsys, str(moved))["origin"] == "trajectory-ledger/old-store"
    code, out, err = _run(capsys, "--store", str(moved), "audit")
    assert code == 0, out + err


@pytest.mark.kafka
def test_kafka_store_origin_is_keyed_by_its_checkpoint_key(kafka_url, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a Kafka store's side files are in the working directory
    assert _run(capsys, "--store", kafka_url, "init")[0] == 0
    k = _key(capsys, kafka_url)
    pub = public_bytes(load_private_key(tmp_path / "checkpoint.key"))
    assert k["origin"] == "trajectory-ledger/" + hashlib.sha256(pub).hexdigest()[:16]
    assert (tmp_path / "checkpoint.vkey").read_text() == k["vkey"] + "\n"
    assert _run(capsys, "--store", kafka_url, "ingest", _events(tmp_path))[0] == 0
    code, out, _ = _run(capsys, "--store", kafka_url, "log", "head")
    assert code == 0
    notes = _split_notes(out)
    assert len(notes) >= 2  # one checkpoint per partition, all signed by the one key named by the origin
    origins = {_independent_verify(k["vkey"], note)[0] for note in notes}
    assert len(origins) == len(notes) and all(o.startswith(k["origin"] + "/") for o in origins)


def _split_notes(text: str) -> list[str]:
    """Concatenated signed notes (each ends with its one signature line) -> the notes."""
    notes, current = [], []
    for line in text.splitlines(keepends=True):
        current.append(line)
        if line.startswith("\u2014 "):
            notes.append("".join(current))
            current = []
    assert not current
    return notes
