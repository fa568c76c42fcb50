"""SPEC §6.10's evidence on Kafka: the README examples of collection manifests (signed, governance topic) and of
faults, feedback and probes (execution topic, task-scoped probes) give the same admission on a Kafka store as on
the embedded log, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledger.cli import main as cli

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROUTES = {"collections": ("repair_sft", "open_sft", "ghost_sft"), "evidence": ("residual_rl", "feedback_rl")}


def _admissions(store: str, work: Path, name: str, monkeypatch, capsys) -> dict:
    work.mkdir()
    monkeypatch.chdir(work)  # a Kafka store keeps its trust file and projection database in the working directory
    monkeypatch.setenv("LEDGER_STORE", store)
    assert cli(["init"]) == 0 and cli(["keys", "new", "--out", "gov.key"]) == 0
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", str(EXAMPLES / f"{name}-gov.jsonl")]) == 0
    Path("gov.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", str(EXAMPLES / f"{name}-events.jsonl")]) == 0 and cli(["ingest", "gov.signed.jsonl"]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    out = {}
    for route in ROUTES[name]:
        assert cli(["admission", "show", route, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        out[route] = sorted((r["execution_id"], r["state"], r["predicate"], r["reason"], r["target_tokens"])
                            for r in doc["executions"])
    return out


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_kafka_and_embedded_admit_the_same(name, kafka_url, tmp_path, monkeypatch, capsys):
    embedded = _admissions(str(tmp_path / "store"), tmp_path / "embedded", name, monkeypatch, capsys)
    kafka = _admissions(kafka_url, tmp_path / "kafka", name, monkeypatch, capsys)
    assert kafka == embedded
    states = {s for rows in embedded.values() for _, s, *_ in rows}
    assert "admitted" in states and states - {"admitted"}  # the examples exercise both outcomes
