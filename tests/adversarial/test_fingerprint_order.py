"""Hostile and legacy fingerprint bytes on the log (SPEC §4.1, issue 12).

Old logs carry the 8 fingerprint bytes reversed and must keep working from the CLI; bytes in
neither order (a rogue producer, a half-swapped header) are dead letters and audit findings
with a one-line reason, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ledger import open_log
from ledger.events.codec import Codec, default_codec, event_digest
from ledger.log.base import Submission
from ledger.producers.ingest import Ingestor, read_json_lines

ROOT = Path(__file__).resolve().parents[2]


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), *args],
                          capture_output=True, text=True, cwd=store.parent, timeout=120)


def _old_store(tmp_path: Path, n: int = 40) -> Path:
    store = tmp_path / "store"
    assert _cli(store, "init").returncode == 0
    with open(ROOT / "examples" / "demo.jsonl") as f:
        lines = list(read_json_lines(f))[:n]
    with open_log(str(store)) as log:
        rep = Ingestor(log, codec=Codec(legacy_fingerprint_order=True)).ingest_lines(lines)
        assert rep.appended == n
    return store


def test_cli_on_an_old_order_log_audits_projects_and_dedups(tmp_path):
    store = _old_store(tmp_path)
    audit = _cli(store, "audit", "--json")
    assert audit.returncode == 0, audit.stderr
    assert json.loads(audit.stdout) == {"events": 40, "first_bad_position": None, "ok": True, "problems": []}
    proj = _cli(store, "project")
    assert proj.returncode == 0 and "applied 40, rejected 0, dead letters 0" in proj.stdout
    head = (ROOT / "examples" / "demo.jsonl").read_text().splitlines()[:40]
    (tmp_path / "again.jsonl").write_text("\n".join(head) + "\n")
    again = _cli(store, "ingest", str(tmp_path / "again.jsonl"))
    assert again.returncode == 0 and "appended 0, duplicate 40, conflicting 0" in again.stdout


def test_fingerprint_in_neither_order_is_a_dead_letter_and_an_audit_finding(tmp_path):
    store = _old_store(tmp_path, 10)
    codec = default_codec()
    with open_log(str(store)) as log:
        good = next(log.read(log.partitions()[0])).value
        std = codec.writer_schema(good).fingerprint
        # half of the bytes in each order: a fingerprint of no schema in either order
        bad = good[:2] + std[:4] + std[4:][::-1] + good[10:]
        log.append([Submission("rogue-1", "task_registered", "rogue", "rogue-1", b"x", False, bad, event_digest(bad))])
    audit = _cli(store, "audit")
    assert audit.returncode == 1 and "Traceback" not in audit.stderr + audit.stdout
    assert "position 10: undecodable event rogue-1: unknown schema fingerprint" in audit.stdout + audit.stderr
    proj = _cli(store, "project")
    assert "Traceback" not in proj.stderr and "applied 10" in proj.stdout and "dead letters 1" in proj.stdout
