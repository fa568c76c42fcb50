"""Replay engine: atomic checkpoints, rebuild identity, dead letters, kill safety (SPEC §3, §9)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ledger.events.signing import Trust
from ledger.log import open_log
from ledger.log.base import Submission
from ledger.producers.ingest import Ingestor
from ledger.projections.engine import ReplayEngine, canonical_dump, connect
from ledger.projections.registry import all_projections

from .counting import CountingProjection
from .helpers import Signer, numbered, opened, request

ROOT = Path(__file__).resolve().parents[1]


def make_log(path, n_exec=20, n_req=5):
    log = open_log(str(path), create=True)
    lines = []
    for e in range(n_exec):
        lines.append(opened(f"e{e}"))
        lines += [request(f"e{e}", f"r{i}", list(range(i * 3)), [100 + i]) for i in range(n_req)]
    Ingestor(log).ingest_lines(numbered(lines))
    return log


def engine(log, db_path, trust=None):
    return ReplayEngine(log, connect(db_path), [*all_projections(), CountingProjection()], trust=trust)


def test_rebuild_gives_byte_identical_tables(tmp_path):
    log = make_log(tmp_path / "s")
    e1 = engine(log, tmp_path / "a.db")
    e1.run()
    e2 = engine(log, tmp_path / "b.db")
    e2.run()
    e1.rebuild()
    e1.run()
    assert canonical_dump(e1.db) == canonical_dump(e2.db)
    assert e1.db.execute("SELECT MAX(times) FROM seen").fetchone()[0] == 1
    assert e1.positions() == {("log", 0): 120}


def test_incremental_equals_full_replay(tmp_path):
    log = make_log(tmp_path / "s", 4, 3)
    inc = engine(log, tmp_path / "inc.db")
    inc.run()
    Ingestor(log).ingest_lines(numbered([opened("late"), request("late", "r", [1], [2])]))
    inc.run()
    full = engine(log, tmp_path / "full.db")
    full.run()
    assert canonical_dump(inc.db) == canonical_dump(full.db)


def test_undecodable_event_goes_to_dead_letter_with_position(tmp_path):
    log = make_log(tmp_path / "s", 1, 1)
    junk = b"\xc3\x01" + b"\x00" * 8 + b"junk"
    import hashlib

    log.append([Submission("junk-1", "request", "e0", "junk-1", b"x", False, junk, hashlib.sha256(junk).digest())])
    eng = engine(log, tmp_path / "p.db")
    stats = eng.run()
    assert stats.dead_letters == 1
    row = eng.db.execute('SELECT "offset", event_id, error FROM _dead_letter').fetchone()
    assert row[0] == 2 and row[1] == "junk-1" and "unknown schema fingerprint" in row[2]


def test_rejections_are_recorded_not_dropped(tmp_path):
    log = make_log(tmp_path / "s", 1, 1)
    Ingestor(log).ingest_lines(numbered([request("e0", "refuse-me", [1], [2])]))
    eng = engine(log, tmp_path / "p.db")
    assert eng.run().rejected == 1
    assert eng.db.execute("SELECT event_id, projection, reason FROM _rejected").fetchall() == [
        ("request/e0/refuse-me", "counting", "test refusal")]


def test_unsigned_governance_on_the_log_is_ignored_and_reported(tmp_path):
    """A rogue producer bypassing ingest: projections ignore it, audit reports it."""
    from ledger.corpus.integrity import audit
    from ledger.events.codec import default_codec
    from ledger.events.validate import validate_line
    from ledger.producers.ingest import submission

    log = make_log(tmp_path / "s", 1, 1)
    rogue = validate_line({"type": "permission", "subject": "*", "use": "*", "action": "grant", "authority": "me"},
                          line=1, now_micros=0)
    log.append([submission(rogue, default_codec())])
    signer = Signer()
    eng = engine(log, tmp_path / "p.db", signer.trust)
    eng.run()
    assert eng.db.execute("SELECT event_type, projection, reason FROM _rejected").fetchall() == [
        ("permission", "engine", "unsigned governance event")]
    assert eng.db.execute("SELECT COUNT(*) FROM seen WHERE event_id LIKE 'permission/%'").fetchone()[0] == 0
    rep = audit(log, signer.trust)
    assert not rep.ok and "unsigned governance event" in rep.problems[0]


PROJECTOR = r"""
import sys
sys.path.insert(0, sys.argv[3])
from ledger.log import open_log
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.registry import all_projections
from tests.counting import CountingProjection
import ledger.projections.engine as eng
eng.BATCH = 7
log = open_log(sys.argv[1])
e = ReplayEngine(log, connect(sys.argv[2]), [*all_projections(), CountingProjection()])
e.run()
print("done", flush=True)
"""


@pytest.mark.parametrize("seed", range(5))
def test_sigkill_projector_applies_nothing_twice(tmp_path, seed):
    rng = random.Random(seed)
    log = make_log(tmp_path / "s", 150, 6)
    db = tmp_path / "p.db"
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", PROJECTOR, str(tmp_path / "s"), str(db), str(ROOT)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        time.sleep(0.5 + rng.random() * 0.8)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    final = engine(log, db)
    final.run()
    ref = engine(log, tmp_path / "ref.db")
    ref.run()
    assert final.db.execute("SELECT MAX(times), COUNT(*) FROM seen").fetchone() == (1, 1050)
    assert canonical_dump(final.db) == canonical_dump(ref.db)
