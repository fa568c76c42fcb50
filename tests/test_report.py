"""`ledger report --out DIR` (SPEC §7.2): plots per projection, "no data" notes when empty."""

from __future__ import annotations

import re

import pytest

from ledger.corpus import publish as P
from ledger.reports.report import build_report, collect, write_report
from projections.engine import connect

from .test_manifest import Signer, Store, _base_lines, _factory

PNGS = ("admission_funnel.png", "token_shares.png", "split_sizes.png", "tree_shapes.png", "cost_per_artifact.png",
        "withdrawn_members.png")
ECONOMICS_PNGS = ("cohort_dispositions.png", "credit_usage.png", "loop_telemetry.png")  # ledger.reports.report_economics


def test_empty_database_gives_a_page_of_no_data_notes(tmp_path):
    db = connect(tmp_path / "empty.db")
    page = build_report(db, tmp_path / "out")
    text = page.read_text()
    assert text.count("No data:") == 11  # nine plotted sections + the evidence and canaries tables
    assert not any((tmp_path / "out" / p).exists() for p in PNGS + ECONOMICS_PNGS)
    # the same with every projection's tables created but no events
    db2 = connect(tmp_path / "tables.db")
    for p in _factory():
        p.create(db2)
    text = build_report(db2, tmp_path / "out2").read_text()
    assert text.count("No data:") == 11  # nine plotted sections + the evidence and canaries tables


@pytest.fixture()
def busy_store(tmp_path):
    s = Store(tmp_path, Signer())
    lines = _base_lines()
    lines += [{"type": "cost_recorded", "execution_id": ex, "amount": 0.6, "category": cat}
              for ex, cat in (("e1", "generation"), ("e2", "generation"), ("e3", "verification"), ("d1", "review"))]
    s.ingest(lines)
    s.publish(tmp_path / "m1.json")
    s.ingest([{"type": "withdrawal", "subject": "execution:e2", "reason": "provider request", "authority": "legal"}])
    s.publish(tmp_path / "m2.json")
    return s


def test_report_over_a_busy_store(busy_store, tmp_path):
    db = connect(busy_store.paths.db)

    def documents(row):
        return P.archived_manifest(busy_store.paths, db, row["route"], row["version"])

    data = collect(db, documents)
    assert data.funnels["sft"][0] == ("evaluated", 4)
    assert dict(data.funnels["sft"])["admitted"] == 2 and dict(data.funnels["sft"])["dummy"] == 1
    assert [(m["version"], m["members"], m["withdrawn"]) for m in data.manifests] == [(1, 7, 2), (2, 5, 0)]
    assert data.costs["sft"]["cohort"] == pytest.approx(2.4)
    assert data.costs["sft"]["per_emitted_artifact"] == pytest.approx(2.4 / 3)
    assert data.cost_categories == pytest.approx({"generation": 1.2, "review": 0.6, "verification": 0.6})
    assert {t["execution_id"] for t in data.trees} == {"e1", "e2", "e3", "d1"}
    assert all(t["depth"] >= 2 and t["stored_tokens"] <= t["expanded_tokens"] for t in data.trees)
    assert set(data.shares["sft"]) == {"main/summary", "sub/task", "dummy"}
    page = build_report(db, tmp_path / "rep", documents=documents)
    text = page.read_text()
    for png in PNGS:
        if png == "split_sizes.png" and "splits" in data.notes:
            assert "No data: " + data.notes["splits"] in text
            continue
        assert (tmp_path / "rep" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"src='{png}'" in text
    assert "withdrawn" in text and re.search(r"<td>sft</td><td>1</td><td>7</td><td>2</td>", text)


def test_cli_report(busy_store, tmp_path, monkeypatch, capsys):
    from ledger.cli import main

    monkeypatch.setattr(P, "projections", _factory)
    assert main(["--store", busy_store.paths.url, "report", "--out", str(tmp_path / "cli-report")]) == 0
    assert "report written to" in capsys.readouterr().out
    text = (tmp_path / "cli-report" / "index.html").read_text()
    assert "Admission funnel per route" in text and (tmp_path / "cli-report" / "admission_funnel.png").exists()


def test_write_report_on_a_fresh_store(tmp_path, monkeypatch):
    s = Store(tmp_path, Signer())
    page = write_report(s.paths, tmp_path / "r", projections_factory=_factory)
    assert page.read_text().count("No data:") == 11  # nine plotted sections + the evidence and canaries tables
