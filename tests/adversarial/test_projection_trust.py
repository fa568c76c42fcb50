"""A tampered projection never reaches a signed manifest (SPEC 11.7; issue 27 items 3 and 7).

``projections.db`` is derived state, and every figure of a manifest comes from it.  A value
changed there with raw sqlite3 (a target mask, a reward, a member row, a tree node's tokens) or
a byte changed in the file: ``ledger audit`` replays the log to the database's positions and
names the database, the table, the row and the column (exit 1); ``manifest publish`` builds from
the replay and refuses (exit 1) naming the table and the member, and signs and writes nothing:
no manifest file, no Croissant file, no archived copy, no ManifestPublished on the log.  The
embedded index's ``governance`` column flipped: audit names the position.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from ledger.events.signing import load_private_key, sign_line

ROUTE = "rl-main"
MEMBER = f"{ROUTE}/e1/r2"


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), *args], cwd=store.parent,
                          capture_output=True, text=True, timeout=180)


def _world(key) -> list[dict]:
    lines = [{"type": "task_registered", "task_id": "t1", "fixture": "fx@1", "family": "f", "source": "src"}]
    for i, ex in enumerate(("e1", "e2")):
        base = 900000 + 100 * i
        lines += [
            {"type": "execution_opened", "execution_id": ex, "task_id": "t1", "deadline": "2030-01-01T00:00:00Z",
             "policy": "qwen@1"},
            {"type": "request", "execution_id": ex, "request_id": "r1", "input_ids": [11, 12, 13],
             "output_ids": [base + 1, base + 2], "output_logprobs": [-0.5, -0.25]},
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


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A sealed store with route rl-main, projected, manifest v1 published; audit passes."""
    root = tmp_path_factory.mktemp("trust")
    store = root / "store"
    assert _cli(store, "init").returncode == 0
    assert _cli(store, "keys", "new", "--out", str(root / "gov.key")).returncode == 0
    src = root / "world.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in _world(load_private_key(root / "gov.key"))))
    assert _cli(store, "ingest", str(src)).returncode == 0
    r = _cli(store, "manifest", "publish", ROUTE, "--key", str(root / "gov.key"), "--out", str(root / "v1.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert [m["member_id"] for m in json.loads((root / "v1.json").read_text())["members"]] == [MEMBER, f"{ROUTE}/e2/r2"]
    r = _cli(store, "audit")
    assert r.returncode == 0 and "the projection database against a replay of the log" in r.stdout, r.stdout + r.stderr
    db = sqlite3.connect(store / "projections.db")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every row in the main file (the raw-byte case reads it)
    db.close()
    return store


def _copy(base: Path, to: Path) -> Path:
    shutil.copytree(base.parent, to)
    return to / "store"


def _sql(store: Path, sql: str, *args) -> None:
    db = sqlite3.connect(store / "projections.db", isolation_level=None)
    try:
        assert db.execute(sql, args).rowcount == 1, sql
    finally:
        db.close()


def _one(store: Path, sql: str, *args):
    db = sqlite3.connect(store / "projections.db")
    try:
        return db.execute(sql, args).fetchone()
    finally:
        db.close()


def _flip_byte(blob: bytes, at: int = 0) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1:]


def _targets(s: Path) -> None:
    blob = _one(s, "SELECT targets FROM admitted_paths WHERE member_id = ?", MEMBER)[0]
    _sql(s, "UPDATE admitted_paths SET targets = ? WHERE member_id = ?", _flip_byte(blob), MEMBER)


def _tree_tokens(s: Path) -> None:
    node, blob = _one(s, "SELECT node_id, tokens FROM tree_nodes WHERE execution_id = 'e1' ORDER BY node_id DESC")
    _sql(s, "UPDATE tree_nodes SET tokens = ? WHERE execution_id = 'e1' AND node_id = ?", _flip_byte(blob), node)


def _raw_tree_bytes(s: Path) -> None:
    """A byte of a token blob changed in the file itself (SQLite's integrity check cannot see it)."""
    blob = _one(s, "SELECT tokens FROM tree_nodes WHERE execution_id = 'e1' ORDER BY length(tokens) DESC")[0]
    raw = bytearray((s / "projections.db").read_bytes())
    assert raw.count(blob) == 1
    raw[raw.index(blob)] ^= 0x01
    (s / "projections.db").write_bytes(bytes(raw))


CASES = [
    ("target mask blob", _targets, "admitted_paths", "has targets = <"),
    ("reward of a member path", lambda s: _sql(s, "UPDATE admitted_paths SET reward = 0.25 WHERE member_id = ?", MEMBER),
     "admitted_paths", "has reward = 0.25 where the log gives 1.0"),
    ("execution reward", lambda s: _sql(s, "UPDATE execution_scores SET reward = 0.5 WHERE execution_id = 'e1'"),
     "execution_scores", "has reward = 0.5 where the log gives 1.0"),
    ("member row deleted", lambda s: _sql(s, "DELETE FROM admitted_paths WHERE member_id = ?", MEMBER),
     "admitted_paths", "0 row(s) the log does not derive, 1 row(s) it derives missing"),
    ("admission row's state", lambda s: _sql(s, "UPDATE admission SET state = 'rejected' WHERE execution_id = 'e2'"),
     "admission", "has state = 'rejected' where the log gives 'admitted'"),
    ("tree node tokens", _tree_tokens, "tree_nodes", "has tokens = <"),
    ("a byte of a token blob in the file", _raw_tree_bytes, "tree_nodes", "has tokens = <"),
]


@pytest.mark.parametrize("name,tamper,table,detail", CASES, ids=[c[0] for c in CASES])
def test_a_tampered_projection_fails_audit_and_is_never_signed(base, tmp_path, name, tamper, table, detail):
    s = _copy(base, tmp_path / "c")
    tamper(s)
    r = _cli(s, "audit")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out
    assert f"{s / 'projections.db'}: table {table}: " in r.stdout and detail in r.stdout, out
    assert "ledger project --rebuild" in r.stdout

    index = (s / "index.db").read_bytes()
    key = str(s.parent / "gov.key")
    r = _cli(s, "manifest", "publish", ROUTE, "--key", key, "--out", str(tmp_path / "v2.json"))
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out
    assert "does not match a replay of the log; nothing was signed or written" in r.stderr
    assert f"table {table}: " in r.stderr and detail in r.stderr, out
    assert not list(tmp_path.glob("v2*")) and not (s / "manifests" / ROUTE / "v2.json").exists()
    assert (s / "index.db").read_bytes() == index  # no ManifestPublished appended
    r = _cli(s, "manifest", "publish", ROUTE, "--key", key, "--out", "-", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False and r.stdout.count("{") >= 1
    assert (s / "index.db").read_bytes() == index

    r = _cli(s, "project", "--rebuild")  # derived state: the rebuild from the log repairs it
    assert r.returncode == 0, r.stderr
    assert _cli(s, "audit").returncode == 0
    r = _cli(s, "manifest", "publish", ROUTE, "--key", key, "--out", str(tmp_path / "v2.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "v2.json").read_text())["merkle"] == json.loads((s.parent / "v1.json").read_text())["merkle"]


def test_publish_names_the_members_a_tampered_database_would_sign(base, tmp_path):
    s = _copy(base, tmp_path / "c")
    _targets(s)
    r = _cli(s, "manifest", "publish", ROUTE, "--key", str(s.parent / "gov.key"), "--out", str(tmp_path / "v2.json"))
    assert r.returncode == 1, r.stdout + r.stderr
    v1 = {m["member_id"]: m["digest"] for m in json.loads((s.parent / "v1.json").read_text())["members"]}
    lines = [line.strip() for line in r.stderr.splitlines()]
    changed = [line for line in lines if line.startswith(f"{s / 'projections.db'} would sign member {MEMBER} with digest ")]
    assert len(changed) == 1 and changed[0].endswith(f"; the log derives {v1[MEMBER]}"), r.stderr
    assert not [line for line in lines if f"{ROUTE}/e2/r2" in line]  # the untouched member is not named

    s2 = _copy(base, tmp_path / "d")
    _sql(s2, "DELETE FROM admitted_paths WHERE member_id = ?", MEMBER)
    r = _cli(s2, "manifest", "publish", ROUTE, "--key", str(s2.parent / "gov.key"), "--out", str(tmp_path / "x.json"))
    assert r.returncode == 1
    assert f"{s2 / 'projections.db'} would leave out member {MEMBER}, which the log admits at this position" in r.stderr


def test_every_changed_cell_of_every_table_is_found(base, tmp_path):
    """The comparison itself, exhaustively: one value changed in any column of the first row of
    every non-empty projection table is reported, naming that table and no other."""
    from ledger.corpus.publish import projections
    from ledger.events.signing import Trust
    from ledger.log import open_log
    from ledger.projections.engine import ReplayEngine, connect_scratch, table_differences
    from ledger.projections.registry import store_keystore
    from ledger.log.paths import store_paths

    paths = store_paths(str(base))
    keystore = store_keystore(paths)
    fresh = connect_scratch()
    with open_log(paths.url) as log:
        ReplayEngine(log, fresh, projections(keystore), trust=Trust.load(paths.trust)).run()
    keystore.close()
    work = tmp_path / "w.db"
    checked = 0
    tables = [t for (t,) in fresh.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE "
                                          "'sqlite_%' AND name != '_projection_schema'")]
    for table in tables:
        row = fresh.execute(f'SELECT * FROM "{table}" LIMIT 1').fetchone()
        if row is None:
            continue
        cols = [r[1] for r in fresh.execute(f'PRAGMA table_info("{table}")')]
        for i, col in enumerate(cols):
            src = sqlite3.connect(paths.db)
            dst = sqlite3.connect(work)
            src.backup(dst)
            src.close()
            where = " AND ".join(f'"{c}" IS ?' for c in cols)
            n = 0
            for value in _others(row[i]):  # the first one the table's constraints (CHECK, UNIQUE) accept
                try:
                    n = dst.execute(f'UPDATE "{table}" SET "{col}" = ? WHERE {where}', (value, *row)).rowcount
                    dst.commit()
                    break
                except sqlite3.IntegrityError:
                    continue
            dst.close()
            assert n == 1, (table, col)
            fresh.execute("ATTACH DATABASE ? AS t", (str(work),))
            try:
                found = [d.table for d in table_differences(fresh, "t")]
            finally:
                fresh.execute("DETACH DATABASE t")
            assert found == [table], (table, col, found)
            checked += 1
            work.unlink()
    fresh.close()
    assert checked >= 150  # every column of every non-empty table of the store (~30 tables)


def _others(v) -> list:
    """Different values of the same kind, most likely first."""
    if isinstance(v, bytes):
        return [_flip_byte(v) if v else b"\x00"]
    if isinstance(v, (int, float)):
        return [v + 1000003, -v - 7, 1 - v if v in (0, 1) else 0]
    if isinstance(v, str):
        return [v + "x"] + [w for w in ("rejected", "dummy", "pending", "scored", "admitted", "excluded", "fail", "pass",
                                        "train", "dev") if w != v]
    return [1, "x"]


def test_a_flipped_governance_column_in_the_index_is_found(base, tmp_path):
    s = _copy(base, tmp_path / "c")
    db = sqlite3.connect(s / "index.db", isolation_level=None)
    gov_pos = db.execute("SELECT position FROM events WHERE event_type = 'permission'").fetchone()[0]
    req_pos = db.execute("SELECT position FROM events WHERE event_type = 'request' ORDER BY position").fetchone()[0]
    db.execute("UPDATE events SET governance = 0 WHERE position = ?", (gov_pos,))
    db.execute("UPDATE events SET governance = 1 WHERE position = ?", (req_pos,))
    db.close()
    r = _cli(s, "audit")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out
    assert f"position {gov_pos}: the index says governance 0, the event's type permission is 1 (index row altered)" in out
    assert f"position {req_pos}: the index says governance 1, the event's type request is 0 (index row altered)" in out
    assert out.count("the index says governance") == 2


def test_a_database_made_by_other_code_is_not_compared_but_noted(base, tmp_path):
    """Another release's projection database (fingerprints differ) is rebuilt by the next replay
    engine before anything reads it: audit notes it and passes; a value changed in it never
    reaches a manifest (publish rebuilds it first)."""
    s = _copy(base, tmp_path / "c")
    _sql(s, "UPDATE _projection_schema SET fingerprint = 'older' WHERE projection = 'tree'")
    _targets(s)
    r = _cli(s, "audit", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["ok"] and len(rep["notes"]) == 1, r.stdout + r.stderr
    assert "not compared with the log: projection(s) tree made by other code" in rep["notes"][0]
    r = _cli(s, "manifest", "publish", ROUTE, "--key", str(s.parent / "gov.key"), "--out", str(tmp_path / "v2.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "v2.json").read_text())["merkle"] == json.loads((s.parent / "v1.json").read_text())["merkle"]
