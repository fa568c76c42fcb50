"""Replay trusts no byte (SPEC §9; issue 13 item 3).

The replay engine checks every event's bytes against the digest the log recorded before it
applies it: a byte changed in events.dat -- even one that leaves a perfectly decodable event
-- puts that event in ``_dead_letter`` with its position and the reason ``digest mismatch``,
and nothing of it reaches the projection or an exported trainer record.
"""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

from ledger.events.codec import default_codec
from ledger.events.signing import load_private_key, sign_line

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "rl-main"


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), *args], cwd=store.parent,
                          capture_output=True, text=True, timeout=120)


def _world(key) -> list[dict]:
    lines = [{"type": "task_registered", "task_id": "t1", "fixture": "fx@1", "family": "f", "source": "src"}]
    for i, ex in enumerate(("e1", "e2")):
        base = 900000 + 100 * i
        lines += [
            {"type": "execution_opened", "execution_id": ex, "task_id": "t1", "deadline": "2030-01-01T00:00:00Z",
             "policy": "qwen@1"},
            {"type": "request", "execution_id": ex, "request_id": "r1", "input_ids": [11, 12, 13],
             "output_ids": [base + 1, base + 2], "output_logprobs": [-0.5, -0.25]},
            {"type": "tool_payload", "execution_id": ex, "call_id": "c1", "kind": "result",
             "payload": {"stdout": f"all tests passed {ex}"}},
            {"type": "request", "execution_id": ex, "request_id": "r2", "input_ids": [11, 12, 13, base + 1, base + 2, 21],
             "output_ids": [base + 3, base + 4], "output_logprobs": [-0.5, -0.25]},
            {"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"]},
            {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
             "outcome": "scored", "reward": 1.0, "evaluator": "grader@1"},
        ]
    gov = [{"type": "split_policy", "policy_id": "sp1", "fractions": {"train": 0.98, "dev": 0.01, "final_test": 0.01},
            "salt": "s"},
           {"type": "permission", "subject": "source:src", "use": "rl", "action": "grant", "authority": "gov"},
           {"type": "admission_policy", "route": ROUTE, "version": 1, "use": "rl", "split": "train", "j_max": 4}]
    return lines + [sign_line(line, key) for line in gov]


def _store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    assert _cli(store, "init").returncode == 0
    assert _cli(store, "keys", "new", "--out", str(tmp_path / "gov.key")).returncode == 0
    src = tmp_path / "world.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in _world(load_private_key(tmp_path / "gov.key"))))
    r = _cli(store, "ingest", "--no-seal", str(src))  # tokens in the clear: a flip changes a token, not a ciphertext
    assert r.returncode == 0, r.stderr
    return store


def _event(store: Path, event_id: str) -> tuple[int, int, int]:
    db = sqlite3.connect(store / "index.db")
    try:
        return db.execute("SELECT position, file_offset, length FROM events WHERE event_id = ?", (event_id,)).fetchone()
    finally:
        db.close()


def _flip(store: Path, event_id: str, needle: bytes, byte: int, mask: int) -> dict:
    """XOR ``mask`` into byte ``byte`` of the first ``needle`` inside the event's bytes; the
    tampered event must still decode (so only the digest check can stop it): returned decoded."""
    _pos, off, length = _event(store, event_id)
    data = bytearray((store / "events.dat").read_bytes())
    value = bytearray(data[off:off + length])
    at = bytes(value).index(needle) + byte
    value[at] ^= mask
    data[off:off + length] = value
    (store / "events.dat").write_bytes(bytes(data))
    return default_codec().decode(bytes(value))


def _dead_letters(store: Path) -> list[tuple]:
    db = sqlite3.connect(store / "projections.db")
    try:
        return db.execute('SELECT stream, partition, "offset", event_id, error FROM _dead_letter ORDER BY "offset"').fetchall()
    finally:
        db.close()


def _export(store: Path, out: Path) -> list[dict]:
    r = _cli(store, "export", ROUTE, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_flipped_tool_payload_that_still_decodes_is_a_dead_letter(tmp_path):
    store = _store(tmp_path)
    r = _cli(store, "project")
    assert r.stdout.strip() == "applied 16, rejected 0, dead letters 0", r.stdout + r.stderr
    ev = _flip(store, "tool_payload/e1/c1/result", b"all tests passed e1", 4, 0x01)  # "tests" -> "uests"
    assert json.loads(ev["payload"]) == {"stdout": "all uests passed e1"}  # a valid event, other content
    r = _cli(store, "project", "--rebuild")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "applied 15, rejected 0, dead letters 1"
    pos = _event(store, "tool_payload/e1/c1/result")[0]
    assert _dead_letters(store) == [("log", 0, pos, "tool_payload/e1/c1/result", "digest mismatch")]
    db = sqlite3.connect(store / "projections.db")
    payloads = db.execute("SELECT * FROM tool_payloads").fetchall()
    db.close()
    text = repr(payloads)
    assert "uests" not in text and "all tests passed e2" in text and "all tests passed e1" not in text


def test_flipped_output_tokens_never_reach_an_exported_record(tmp_path):
    store = _store(tmp_path)
    assert _cli(store, "project").returncode == 0
    clean = _export(store, tmp_path / "clean.jsonl")
    assert len(clean) == 2 and all(900003 in rec["input_ids"] or 900103 in rec["input_ids"] for rec in clean)
    tampered = {}
    for ex, token in (("e1", 900003), ("e2", 900104)):
        ev = _flip(store, f"request/{ex}/r2", struct.pack("<I", token), 2, 0x40)  # the token's third byte
        new = token ^ (0x40 << 16)
        assert new in struct.unpack(f"<{len(ev['output_ids']) // 4}I", ev["output_ids"])
        tampered[ex] = new
    r = _cli(store, "project", "--rebuild")
    assert r.stdout.strip() == "applied 14, rejected 0, dead letters 2", r.stdout + r.stderr
    assert [(d[3], d[4]) for d in _dead_letters(store)] == [("request/e1/r2", "digest mismatch"),
                                                             ("request/e2/r2", "digest mismatch")]
    records = _export(store, tmp_path / "after.jsonl")
    assert len(records) == 2
    for rec in records:
        assert not set(tampered.values()) & set(rec["input_ids"]), rec
        assert rec["leaf_request_id"] == "r1"  # the tampered leaf r2 was never applied
        base = 900000 if rec["execution_id"] == "e1" else 900100
        assert rec["input_ids"] == [11, 12, 13, base + 1, base + 2]  # r1's path: input and output
