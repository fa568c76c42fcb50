"""Re-submitting an event accepted under an older schema version is a duplicate, not a conflict
(SPEC §4.3 idempotency across releases).  The idempotency hash covers the encoded body, and
ExecutionOpened / TaskRegistered gained optional fields in this release (v2), so a retried line
that an older release appended hashes differently; the log then compares it with the stored
event decoded and re-encoded under the new schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ledger import open_log
from ledger.events.codec import SCHEMA_DIR, Codec
from ledger.producers.ingest import Ingestor, read_json_lines

LINES = [
    {"type": "task_registered", "task_id": "fix-42", "source": "repair-pool"},
    {"type": "execution_opened", "execution_id": "s1", "task_id": "fix-42", "deadline": "2099-01-01T00:00:00Z",
     "policy": "qwen@1", "occurred_at": "2026-01-01T00:00:00Z"},
]


def _old_codec(tmp_path: Path) -> Codec:
    """The codec of a release before ExecutionOpened.v2 (and v3) / TaskRegistered.v2."""
    d = tmp_path / "old-schemas"
    d.mkdir()
    for p in SCHEMA_DIR.glob("*.avsc"):
        if p.name not in ("ExecutionOpened.v2.avsc", "ExecutionOpened.v3.avsc", "TaskRegistered.v2.avsc"):
            shutil.copy(p, d / p.name)
    return Codec(d)


def _lines(rows):
    return list(read_json_lines([json.dumps(r) + "\n" for r in rows]))


def _check(url: str, tmp_path: Path) -> None:
    old = _old_codec(tmp_path)
    assert old.schema_for("execution_opened").version == 1 and old.schema_for("task_registered").version == 1
    with open_log(url, create=True) as log:
        first = Ingestor(log, codec=old).ingest_lines(_lines(LINES))
        assert first.appended == 2
        again = Ingestor(log).ingest_lines(_lines(LINES))  # today's codec: ExecutionOpened.v3, TaskRegistered.v2
        assert (again.appended, again.duplicates, again.conflicts) == (0, 2, [])
        changed = [dict(LINES[1], deadline="2099-06-01T00:00:00Z")]
        rep = Ingestor(log).ingest_lines(_lines(changed))
        assert rep.appended == 0 and len(rep.conflicts) == 1  # different content is still a conflict
        new_field = [dict(LINES[1], collection_id="pool-repair")]
        rep = Ingestor(log).ingest_lines(_lines(new_field))
        assert rep.appended == 0 and len(rep.conflicts) == 1  # a value in the new field is different content
        rep = Ingestor(log).ingest_lines(_lines([dict(LINES[1], policy_version=3)]))
        assert rep.appended == 0 and len(rep.conflicts) == 1  # so is a policy version (ExecutionOpened.v3)


def test_embedded_log_recognises_a_resubmission_across_schema_versions(tmp_path):
    _check(str(tmp_path / "store"), tmp_path)


def test_kafka_log_recognises_a_resubmission_across_schema_versions(kafka_url, tmp_path):
    _check(kafka_url, tmp_path)
