"""Audit is complete (SPEC §5, §9 "Audit is complete"; issue 13 item 2).

Besides each event's bytes against its digest, ``ledger audit`` checks positions contiguous
with no index row missing, each index row's event id / type / partition key against the
decoded event, each stored natural key and idempotency hash against the event's own, file offsets contiguous (unindexed trailing bytes named with offset and
length), SQLite's integrity check of index.db and projections.db, and the log against the
signed checkpoints ``ledger log head`` printed (recorded in ``<store>/checkpoints.jsonl``).
Every tamper case below runs the real CLI in a subprocess and must end in exit 1, the
finding on stdout, no traceback; a clean store passes with exit 0.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4096  # the embedded index's SQLite page size (the default)


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _lines(n_exec: int, tag: str = "") -> list[dict]:
    out = []
    for e in range(n_exec):
        ex = f"e{e}{tag}"
        out.append({"type": "execution_opened", "execution_id": ex, "task_id": "t1", "deadline": "2030-01-01T00:00:00Z",
                    "policy": "qwen@1"})
        out += [{"type": "request", "execution_id": ex, "request_id": f"r{r}", "input_ids": list(range(r * 5 + 3)),
                 "output_ids": [4, 5], "output_logprobs": [-0.5, -0.5]} for r in range(3)]
        out.append({"type": "tool_payload", "execution_id": ex, "call_id": "c1", "kind": "result",
                    "payload": {"stdout": f"ok {tag}{e}"}})
        out.append({"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"]})
    return out


def _store(root: Path, n_exec: int = 40, tag: str = "", name: str = "s") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    store = root / name
    assert _cli(store, "init").returncode == 0
    src = root / f"in{tag}.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in _lines(n_exec, tag)))
    r = _cli(store, "ingest", str(src))
    assert r.returncode == 0, r.stderr
    return store


def _audit_finds(store: Path, *expected: str) -> str:
    """Run ``ledger audit``: exit 1, no traceback, each expected text in the findings."""
    r = _cli(store, "audit")
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    assert r.returncode == 1, out
    for text in expected:
        assert text in out, (text, out)
    return out


def _rows(store: Path) -> list[tuple]:
    db = sqlite3.connect(store / "index.db")
    try:
        return db.execute("SELECT position, file_offset, length, event_id FROM events ORDER BY position").fetchall()
    finally:
        db.close()


def _write_index(store: Path, *statements: tuple[str, tuple]) -> None:
    db = sqlite3.connect(store / "index.db", isolation_level=None)
    try:
        db.execute("BEGIN")
        for sql, params in statements:
            db.execute(sql, params)
        db.execute("COMMIT")
    finally:
        db.close()


def _flip3(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(3)
        f.seek(offset)
        f.write(bytes(b ^ 0xA5 for b in old))


def test_a_clean_store_passes(tmp_path):
    store = _store(tmp_path)
    assert _cli(store, "log", "head").returncode == 0
    assert _cli(store, "project").returncode == 0  # projections.db exists and is checked too
    r = _cli(store, "audit", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout) == {"events": 240, "first_bad_position": None, "ok": True, "problems": []}
    r = _cli(store, "audit")
    assert r.returncode == 0 and r.stdout.startswith("audit ok: 240 events re-hashed")


def test_every_tamper_case_is_detected(tmp_path):
    """Each case tampers a fresh copy of one store (whose head was signed and recorded); every one
    is found, and the finding says what and where."""
    base = _store(tmp_path / "base")
    assert _cli(base, "log", "head").returncode == 0
    seen = [json.loads(line) for line in (base / "checkpoints.jsonl").read_text().splitlines()]
    origin = (base / "checkpoint.origin").read_text().strip()  # the store's own (unique per checkpoint key)
    assert origin.startswith("trajectory-ledger/") and len(origin) == len("trajectory-ledger/") + 16
    assert [(s["origin"], s["size"]) for s in seen] == [(origin, 240)]
    rows = _rows(base)
    end = rows[-1][1] + rows[-1][2]
    assert os.path.getsize(base / "events.dat") == end

    # another history of the same store name: a consistent log (digests match its bytes), other events
    other = _store(tmp_path / "other", n_exec=41, tag="x")
    short = _store(tmp_path / "short", n_exec=10)

    def delete_middle(s: Path) -> None:
        _write_index(s, ("DELETE FROM events WHERE position = ?", (120,)))

    def swap_rows(s: Path) -> None:
        a, b = rows[50], rows[51]
        db = sqlite3.connect(s / "index.db")
        da, db_ = [db.execute("SELECT digest FROM events WHERE position = ?", (p,)).fetchone()[0] for p in (50, 51)]
        db.close()
        _write_index(s, ("UPDATE events SET file_offset = ?, length = ?, digest = ? WHERE position = ?", (b[1], b[2], db_, 50)),
                     ("UPDATE events SET file_offset = ?, length = ?, digest = ? WHERE position = ?", (a[1], a[2], da, 51)))

    def garbage(s: Path) -> None:
        with open(s / "events.dat", "ab") as f:
            f.write(b"\x00garbage!")

    def truncate(s: Path) -> None:
        os.truncate(s / "events.dat", end - 7)

    def rewrite(s: Path) -> None:  # history rewritten: more events than the checkpoint, other first 240
        for f in ("events.dat", "index.db"):
            shutil.copy(other / f, s / f)

    def roll_back(s: Path) -> None:  # a consistent, shorter log in place of the signed one
        for f in ("events.dat", "index.db"):
            shutil.copy(short / f, s / f)

    cases = [
        ("delete an index row in the middle", delete_middle,
         ["positions 120..120 have no index row",
          f"position 121 starts at byte {rows[121][1]} of events.dat, but the previous event ends at byte {rows[119][1] + rows[119][2]}"]),
        ("swap two rows' offset/length/digest", swap_rows,
         [f"position 50: the index says event_id {rows[50][3]!r}, the event's is {rows[51][3]!r}",
          f"position 51: the index says event_id {rows[51][3]!r}, the event's is {rows[50][3]!r}",
          "(file offsets not contiguous)"]),
        ("append garbage to events.dat", garbage, [f"9 unindexed bytes at offset {end}"]),
        ("truncate events.dat", truncate,
         [f"is {end - 7} bytes but the index covers {end} (truncated)", "position 239: bytes do not match the recorded digest"]),
        ("rewrite history", rewrite,
         [f"{origin}: the Merkle root over the first 240 events is", "(history rewritten)"]),
        ("roll the log back", roll_back, ["the log holds 60 events, fewer than the 240 of the signed checkpoint"]),
    ]
    # raw 3-byte flips in index.db: every page's header, and bytes inside live rows (an event id's
    # text, a digest) located in the file; each must be a finding, never a traceback
    raw = (base / "index.db").read_bytes()
    assert len(raw) % PAGE == 0 and len(raw) // PAGE >= 10
    offsets = [100] + [p * PAGE for p in range(1, len(raw) // PAGE)]
    db = sqlite3.connect(base / "index.db")
    for pos in (0, 77, 200, 239):
        digest = db.execute("SELECT digest FROM events WHERE position = ?", (pos,)).fetchone()[0]
        offsets.append(raw.index(digest) + 10)
    db.close()
    offsets.append(raw.index(b"request/e17/r1"))
    offsets.append(raw.rindex(b"execution_closed/e33"))
    for off in offsets:
        cases.append((f"3-byte flip at byte {off} of index.db", lambda s, off=off: _flip3(s / "index.db", off), []))

    detected = []
    for i, (name, tamper, expected) in enumerate(cases):
        s = tmp_path / f"case{i}" / "s"
        shutil.copytree(base, s)
        tamper(s)
        out = _audit_finds(s, *expected)
        detected.append(name)
        assert out.strip(), name
    assert len(cases) == 6 + len(offsets) and len(offsets) >= 15
    assert detected == [c[0] for c in cases]  # every tamper case detected


def test_a_damaged_projection_db_is_a_finding_and_one_line_elsewhere(tmp_path):
    store = _store(tmp_path, n_exec=5)
    assert _cli(store, "project").returncode == 0
    _flip3(store / "projections.db", 0)  # the SQLite header string
    out = _audit_finds(store, "projections.db: damaged or not a SQLite database")
    assert str(store / "projections.db") in out
    r = _cli(store, "project")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "projections.db: the projection database is damaged or not a SQLite database" in r.stderr


def test_a_malformed_index_is_one_line_exit_2_for_other_commands(tmp_path):
    store = _store(tmp_path, n_exec=5)
    _flip3(store / "index.db", 0)  # "SQLite format 3" no longer
    _audit_finds(store, f"{store / 'index.db'}: the index is damaged or not a SQLite database")
    for args in (["project"], ["log", "head"], ["ingest", str(tmp_path / "in.jsonl")], ["status"], ["conflicts"]):
        r = _cli(store, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
        assert "index.db: the index is damaged or not a SQLite database" in r.stderr, (args, r.stderr)


def test_a_damaged_page_met_after_open_is_one_line_exit_2(tmp_path):
    store = _store(tmp_path, n_exec=40)
    size = os.path.getsize(store / "index.db")
    _flip3(store / "index.db", size - PAGE)  # the last page's header: read only when the data is reached
    for args in (["project"], ["log", "head"]):
        r = _cli(store, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr == (f"ledger: error: a database of store {store} is damaged (database disk image is "
                            "malformed); run `ledger audit`\n"), args
    _audit_finds(store, "the index is damaged")


def test_checkpoint_records_that_are_not_checkpoints_are_findings(tmp_path):
    store = _store(tmp_path, n_exec=3)
    assert _cli(store, "log", "head").returncode == 0
    line = json.loads((store / "checkpoints.jsonl").read_text())
    forged = dict(line, note=line["note"].replace("\n18\n", "\n17\n"))  # the signature no longer covers it
    with open(store / "checkpoints.jsonl", "a") as f:
        f.write(json.dumps(forged) + "\n" + "not json\n")
    _audit_finds(store, "checkpoints.jsonl line 2: not a valid recorded checkpoint",
                 "checkpoints.jsonl line 3: not a valid recorded checkpoint")


def test_altered_natural_keys_and_idempotency_hashes_are_found(tmp_path):
    """The index's natural key and idempotency hash decide what a retry is (duplicate, conflict,
    new event); audit recomputes both from the event (a sealed request's hash from its plain
    content, opened with the store's data keys) and names an altered row."""
    from ledger.events.validate import validate_line
    from ledger.producers.ingest import submission

    base = _store(tmp_path / "base", n_exec=3)
    assert _cli(base, "audit").returncode == 0  # every stored key and hash (sealed requests too) is the event's
    db = sqlite3.connect(base / "index.db")
    pos = {nk: (p, eid) for p, nk, eid in db.execute("SELECT position, natural_key, event_id FROM events")}
    db.close()
    req_pos, req_id = pos["request/e1/r1"]
    from ledger.events.codec import default_codec
    from ledger.log import open_log

    with open_log(str(base)) as log:
        assert default_codec().decode(next(log.read(start=req_pos)).value)["sealed"] is not None  # stored sealed
    tool_pos, tool_id = pos["tool_payload/e2/c1/result"]
    zero = bytes(32)
    other = {"type": "tool_payload", "execution_id": "e2", "call_id": "c1", "kind": "result", "payload": {"stdout": "forged"}}
    forged = submission(validate_line(other, now_micros=0))
    assert forged.event_id == tool_id and forged.content_hash != zero

    cases = [
        ("natural key of a request", ("UPDATE events SET natural_key = ? WHERE position = ?", ("request/e1/r9", req_pos)),
         f"position {req_pos}: the index says natural key 'request/e1/r9', the event's is 'request/e1/r1'"),
        ("hash of a sealed request", ("UPDATE events SET content_hash = ? WHERE position = ?", (zero, req_pos)),
         f"position {req_pos}: the index's idempotency hash of event {req_id} is not the hash of its content"),
        ("hash of a tool payload, set to a forged retry's", ("UPDATE events SET content_hash = ? WHERE position = ?",
                                                            (forged.content_hash, tool_pos)),
         f"position {tool_pos}: the index's idempotency hash of event {tool_id} is not the hash of its content"),
    ]
    for i, (name, statement, expected) in enumerate(cases):
        s = tmp_path / f"case{i}" / "s"
        shutil.copytree(base, s)
        _write_index(s, statement)
        out = _audit_finds(s, expected)
        assert out.count("idempotency hash") + out.count("natural key") == 1, (name, out)
    # what the forged hash does if nobody audits: the forged retry passes as a duplicate and is dropped
    forged_src = tmp_path / "forged.jsonl"
    forged_src.write_text(json.dumps(other) + "\n")
    r = _cli(tmp_path / "case2" / "s", "ingest", "--json", str(forged_src))
    assert r.returncode == 0 and json.loads(r.stdout)["duplicates"] == 1
    r = _cli(base, "ingest", "--json", str(forged_src))  # on the untouched store it is a conflict
    assert r.returncode != 0 and "same event_id with different content" in r.stdout + r.stderr


def test_a_first_release_store_keeps_its_unescaped_natural_keys_through_audit(tmp_path):
    fixture = ROOT / "tests" / "fixtures" / "release1" / "store"
    s = tmp_path / "s"
    shutil.copytree(fixture, s)
    db = sqlite3.connect(s / "index.db")
    keys = [nk for (nk,) in db.execute("SELECT natural_key FROM events")]
    db.close()
    assert "request/run/7/a" in keys  # execution "run/7", joined unescaped by the first release
    r = _cli(s, "audit", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout
    _write_index(s, ("UPDATE events SET natural_key = ? WHERE natural_key = ?", ("request/run/7/z", "request/run/7/a")))
    _audit_finds(s, "the index says natural key 'request/run/7/z', the event's is 'request/run%2F7/a'")
