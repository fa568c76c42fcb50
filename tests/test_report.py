"""`ledger report --out DIR` (SPEC §7.2): plots per projection, "no data" notes when empty."""

from __future__ import annotations

import re

import pytest

from ledger.corpus import publish as P
from ledger.reports.report import build_report, collect, write_report
from ledger.projections.engine import connect

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


# ------------------------------------------------------------------ plots a curator can read (issue 32 item 6)
def _figure(monkeypatch, plot, data, tmp_path):
    """Run a report plot and keep its figure (``_save`` stubbed)."""
    from ledger.reports import report

    figs = []
    monkeypatch.setattr(report, "_save", lambda fig, out, name: figs.append(fig) or name)
    plt = report._plt()
    assert plot(plt, data, tmp_path)
    return plt, figs[0]


def test_depth_histogram_leaves_out_erased_executions(monkeypatch, tmp_path):
    from ledger.reports import report

    tree = {"requests": 3, "stored_tokens": 10, "expanded_tokens": 20, "max_branching": 1}
    data = report.ReportData(trees=[{**tree, "depth": 4, "nodes": 5}, {**tree, "depth": 4, "nodes": 5},
                                    {**tree, "depth": 0, "nodes": 0, "stored_tokens": 0, "expanded_tokens": 0}])
    plt, fig = _figure(monkeypatch, report._plot_trees, data, tmp_path)
    ax = fig.axes[0]
    heights = {round(p.get_x() + p.get_width() / 2): p.get_height() for p in ax.patches if p.get_height()}
    assert heights == {4: 2}  # no bar at depth 0 for the erased execution
    assert "1 execution(s) with no tokens (erased) left out" in ax.get_title()
    plt.close(fig)


def test_token_shares_plot_draws_absolute_target_and_other_tokens(monkeypatch, tmp_path):
    from ledger.reports import report

    data = report.ReportData(shares={"rl": {"main/task": {"records": 32, "stored_tokens": 50_073, "target_tokens": 8_600}}})
    plt, fig = _figure(monkeypatch, report._plot_shares, data, tmp_path)
    ax = fig.axes[0]
    assert sorted(p.get_width() for p in ax.patches) == [8_600, 50_073 - 8_600]  # not a 100 % bar
    assert [t.get_text() for t in ax.texts] == ["32 records · 50,073 tokens · 17 % target"]
    plt.close(fig)


def test_loop_plot_does_not_join_unrelated_collection_runs(tmp_path):
    from ledger.reports import report, report_economics

    rounds = [{"round": f"run-{i}", "distinct_sequences": 1.0, "pass_at_1": float(i % 2), "pass_at_k": float(i % 2),
               "held_out_score": None} for i in range(5)]
    fixtures = [{"fixture": f"task-{i}", "round": f"run-{i}"} for i in range(5)]  # no fixture in two runs
    figs = []
    plt = report._plt()
    econ = {"loop": {"rounds": rounds, "fixtures": fixtures, "warnings": []}}
    assert report_economics._plot_loop(plt, econ, tmp_path, lambda fig, out, name: figs.append(fig) or name)
    assert {ln.get_linestyle() for ax in figs[0].axes for ln in ax.get_lines()} == {"None"}
    assert "unordered" in figs[0].axes[0].get_xlabel()
    plt.close(figs[0])
