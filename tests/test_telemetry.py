"""Self-improvement loop telemetry (seed 002 §15.7): distinct normalised action sequences,
pass@1 vs pass@k, informative-task fraction, retention caps, external anchors, and the
coverage-narrowing warning, per fixture and round, through the ledger."""

from __future__ import annotations

import json
import math

import pytest

from ledger.algorithms.economics import informative_task_fraction
from ledger.algorithms.split_hash import assign_split
from ledger.cli import main
from ledger.log import open_log
from ledger.log.paths import store_paths
from ledger.producers.ingest import Ingestor
from ledger.reports.telemetry import format_telemetry, loop_telemetry
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.registry import all_projections

from .helpers import Signer

STAMP = "2098-06-01T00:00:00Z"
DEADLINE = "2099-01-01T00:00:00Z"
FRACTIONS = {"train": 0.5, "dev": 0.5, "final_test": 0.0}
SALT = "loop"
SEQ = {"A": ["bash", "edit_file"], "B": ["bash", "run_tests"], "C": ["grep", "edit_file", "run_tests"],
       "D": ["bash", "bash", "edit_file"]}
# round -> fixture -> [(sequence, passed)]
ROUNDS = {
    "r1": {"f-easy": [("A", 1), ("B", 1), ("C", 1), ("A", 0)], "f-hard": [("A", 0), ("B", 0), ("C", 0), ("D", 0)]},
    "r2": {"f-easy": [("A", 1), ("B", 1), ("A", 1), ("B", 1)], "f-hard": [("A", 1), ("B", 0), ("C", 1), ("A", 0)]},
    "r3": {"f-easy": [("A", 1), ("A", 1), ("A", 1), ("A", 1)], "f-hard": [("A", 1), ("A", 1), ("B", 1), ("A", 0)]},
}
HELD_OUT = {"r1": [1, 1, 0, 0], "r2": [1, 1, 1, 0], "r3": [1, 1, 1, 0]}


def task_in(split: str, prefix: str) -> str:
    i = 0
    while assign_split(f"{prefix}-{i}", FRACTIONS, SALT) != split:
        i += 1
    return f"{prefix}-{i}"


def clock(n: int) -> str:
    return f"2098-06-01T{n // 3600:02d}:{n // 60 % 60:02d}:{n % 60:02d}Z"


def execution(ex: str, task: str, t: int, actions: list[str], passed: int, *, run: str, origin: str = "synthetic",
              metadata: dict | None = None) -> list[dict]:
    calls = [f"{ex}-c{i}" for i in range(len(actions))]
    # the first request emits the *second* half of the calls: order comes from requests, not call ids
    half = len(calls) // 2
    first, second = calls[half:], calls[:half]
    lines = [{"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": DEADLINE, "policy": "p@1",
              "origin": origin, "collection_run_id": run, "occurred_at": clock(t)},
             {"type": "request", "execution_id": ex, "request_id": "r1", "input_ids": [1, 2], "output_ids": [3],
              "output_logprobs": [-0.1], "emitted_tool_call_ids": first, "occurred_at": clock(t)},
             {"type": "request", "execution_id": ex, "request_id": "r2", "input_ids": [1, 2, 3, 4], "output_ids": [5],
              "output_logprobs": [-0.1], "emitted_tool_call_ids": second, "occurred_at": clock(t)}]
    if metadata is not None:
        lines[0]["metadata"] = metadata
    ordered = first + second
    for call, name in zip(ordered, actions):
        lines.append({"type": "tool_payload", "execution_id": ex, "call_id": call, "kind": "call",
                      "payload": {"name": name, "arguments": {"path": f"/src/{ex}.py"}}, "occurred_at": clock(t)})
    lines += [{"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"],
               "occurred_at": clock(t)},
              {"type": "assessment", "assessment_id": "a", "execution_id": ex, "artifact_version": "v1",
               "outcome": "scored", "reward": float(passed), "evaluator": "g@1", "occurred_at": clock(t)},
              {"type": "predicate_evaluated", "execution_id": ex, "route": "sft", "predicate": "tests_pass",
               "verdict": "pass" if passed else "fail", "verifier": "pytest@1", "occurred_at": clock(t)}]
    return lines


def scenario(signer: Signer) -> list[dict]:
    easy, hard, held = task_in("train", "easy"), task_in("train", "hard"), task_in("dev", "held")
    lines = [{"type": "task_registered", "task_id": easy, "fixture": "f-easy", "source": "s", "occurred_at": STAMP},
             {"type": "task_registered", "task_id": hard, "fixture": "f-hard", "source": "s", "occurred_at": STAMP},
             {"type": "task_registered", "task_id": held, "fixture": "f-held", "source": "s", "occurred_at": STAMP},
             signer.sign({"type": "split_policy", "policy_id": "p", "fractions": FRACTIONS, "salt": SALT,
                          "occurred_at": STAMP}),
             signer.sign({"type": "permission", "subject": "*", "use": "*", "action": "grant", "authority": "a",
                          "occurred_at": STAMP}),
             signer.sign({"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train",
                          "j_max": 1, "predicates": [{"name": "tests_pass", "family": "outcome"}], "occurred_at": STAMP})]
    t = 0
    for rnd, fixtures in ROUNDS.items():
        for fixture, runs in fixtures.items():
            task = easy if fixture == "f-easy" else hard
            for i, (seq, passed) in enumerate(runs):
                t += 1
                origin = "human" if (rnd, fixture, i) == ("r1", "f-easy", 0) else "synthetic"
                lines += execution(f"{rnd}-{fixture}-{i}", task, t, SEQ[seq], passed, run=rnd, origin=origin)
        for i, passed in enumerate(HELD_OUT[rnd]):  # the round's candidate on held-out tasks (its own eval run)
            t += 1
            lines += execution(f"{rnd}-eval-{i}", held, t, SEQ["A"], passed, run=f"eval-{rnd}",
                               metadata={"round": rnd})
    return lines


@pytest.fixture(scope="module")
def loop_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    signer = Signer()
    paths = store_paths(str(root / "store"))
    assert main(["--store", paths.url, "init"]) == 0
    signer.trust.save(paths.trust)
    with open_log(paths.url) as log:
        Ingestor(log, signer.trust).ingest_lines(enumerate(scenario(signer), 1))
    db = connect(root / "p.db")
    with open_log(paths.url) as log:
        ReplayEngine(log, db, all_projections(), trust=signer.trust).run()
    return paths, db


def test_rounds_fixtures_and_narrowing_warning(loop_store):
    _, db = loop_store
    rep = loop_telemetry(db, retention_cap=3)
    rounds = {r["round"]: r for r in rep["rounds"]}
    assert [r["round"] for r in rep["rounds"]] == ["r1", "r2", "r3"]  # held-out runs joined their round via metadata
    assert {r: rounds[r]["distinct_sequences"] for r in rounds} == {"r1": 3.5, "r2": 2.5, "r3": 1.5}
    assert {r: rounds[r]["pass_at_1"] for r in rounds} == pytest.approx({"r1": 0.375, "r2": 0.75, "r3": 0.875})
    assert {r: rounds[r]["pass_at_k"] for r in rounds} == pytest.approx({"r1": 0.5, "r2": 1.0, "r3": 1.0})
    assert {r: rounds[r]["held_out_score"] for r in rounds} == {"r1": 0.5, "r2": 0.75, "r3": 0.75}
    assert {r: rounds[r]["train_acceptance"] for r in rounds} == {"r1": 3 / 8, "r2": 6 / 8, "r3": 7 / 8}
    # retention caps per fixture and external anchors (one curated human run in round 1)
    assert rounds["r2"]["fixtures_over_cap"] == ["f-easy"] and rounds["r1"]["fixtures_over_cap"] == []
    assert rounds["r1"]["anchors"]["retained"]["external"] == pytest.approx(1 / 3)
    assert rounds["r1"]["anchors"]["retained"]["self_generated"] == pytest.approx(2 / 3)
    assert rounds["r2"]["anchors"]["retained"]["external"] == 0.0
    assert rounds["r1"]["anchors"]["attempted"]["count"] == 8
    # per fixture: equation 3 with the cell's pass rate and k = its scored attempts
    cell = next(f for f in rep["fixtures"] if (f["fixture"], f["round"]) == ("f-hard", "r2"))
    assert (cell["scored"], cell["passed"], cell["k"], cell["distinct_sequences"]) == (4, 2, 4, 3)
    assert cell["informative_expected"] == pytest.approx(informative_task_fraction(0.5, 4)) == pytest.approx(0.875)
    assert cell["mixed_outcomes"] is True
    easy1 = next(f for f in rep["fixtures"] if (f["fixture"], f["round"]) == ("f-easy", "r1"))
    assert easy1["distinct_sequences"] == 3 and easy1["pass_at_1"] == 0.75 and easy1["retained"] == 3
    assert not any(f["fixture"] == "f-held" for f in rep["fixtures"])  # held-out tasks never count as training
    # diversity fell 40 % from r2 to r3 while held-out stayed at 0.75: over-specialising
    by_rule = {(w["rule"], w["round"], w["since_round"]) for w in rep["warnings"]}
    assert ("diversity_falls_held_out_flat", "r3", "r2") in by_rule
    assert not any(w["round"] == "r2" for w in rep["warnings"])  # r1 -> r2: diversity fell, held-out rose
    assert by_rule == {("diversity_falls_held_out_flat", "r3", "r2"), ("pass1_up_passk_flat", "r3", "r2"),
                       ("train_up_held_out_flat", "r3", "r2")}


def test_action_order_follows_requests_and_options(loop_store):
    _, db = loop_store
    from ledger.reports.telemetry import _action_sequences

    seqs = _action_sequences(db, {"r1-f-hard-3"})
    assert [a["name"] for a in seqs["r1-f-hard-3"]] == ["bash", "bash", "edit_file"]  # D, in request order
    with_args = loop_telemetry(db, include_args=True)  # each execution edits its own path: all distinct
    assert {r["round"]: r["distinct_sequences"] for r in with_args["rounds"]} == {"r1": 4.0, "r2": 4.0, "r3": 4.0}
    collapsed = loop_telemetry(db, collapse_repeats=True)  # D collapses to [bash, edit_file] == A
    assert {r["round"]: r["distinct_sequences"] for r in collapsed["rounds"]}["r1"] == 3.0
    k2 = loop_telemetry(db, k=2, threshold=0.5)
    cell = next(f for f in k2["fixtures"] if (f["fixture"], f["round"]) == ("f-hard", "r2"))
    assert cell["k"] == 2 and cell["pass_at_k"] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)


def test_cli_telemetry(loop_store, capsys):
    paths, _ = loop_store
    capsys.readouterr()
    assert main(["--store", paths.url, "telemetry", "--retention-cap", "3"]) == 0
    text = capsys.readouterr().out
    assert "WARNING diversity_falls_held_out_flat (round r3 vs r2)" in text and "OVER CAP" in text
    assert main(["--store", paths.url, "telemetry", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["round"] for r in rep["rounds"]] == ["r1", "r2", "r3"] and rep["warnings"]
    assert main(["--store", paths.url, "telemetry", "--k", "0"]) == 2


def test_no_data(tmp_path):
    db = connect(tmp_path / "empty.db")
    rep = loop_telemetry(db)
    assert rep["rounds"] == [] and rep["warnings"] == [] and rep["notes"]
    assert "no data" in format_telemetry(rep)
    for p in all_projections():
        p.create(db)
    rep = loop_telemetry(db)
    assert rep["rounds"] == [] and "no data" in format_telemetry(rep)


def test_report_section_loop_telemetry(loop_store, tmp_path):
    from ledger.reports.report import build_report

    _, db = loop_store
    text = build_report(db, tmp_path / "rep").read_text()
    assert (tmp_path / "rep" / "loop_telemetry.png").read_bytes()[:4] == b"\x89PNG"
    assert "Self-improvement loop telemetry" in text and "diversity_falls_held_out_flat" in text
    assert "No data: no scored training executions" not in text


def _loop_figure(econ: dict, out):
    from ledger.reports import report_economics
    from ledger.reports.report import _plt

    figs = []

    def keep(fig, out, name):
        figs.append(fig)
        return name

    plt = _plt()
    assert report_economics._plot_loop(plt, econ, out, keep) == "loop_telemetry.png"
    return plt, figs[0]


@pytest.mark.parametrize("n_rounds", [3, 40])
def test_loop_plot_labels_are_thinned_and_pass_at_1_is_on_top(loop_store, tmp_path, n_rounds):
    """The x axes keep at most 12 round labels, rotated, none overlapping; pass@1 is drawn above
    pass@k (higher zorder, dashed with diamonds) so it is visible where they coincide."""
    from ledger.reports import report_economics

    _, db = loop_store
    econ = report_economics.collect(db, {})
    real = econ["loop"]["rounds"]
    assert [r["round"] for r in real] == ["r1", "r2", "r3"]
    rounds = [dict(real[i % 3], round=f"round-{i:03d}") for i in range(n_rounds)] if n_rounds > 3 else real
    plt, fig = _loop_figure({**econ, "loop": {**econ["loop"], "rounds": rounds, "warnings": []}}, tmp_path)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        want = [r["round"] for r in rounds][:: -(-n_rounds // 12)]
        assert len(want) == (3 if n_rounds == 3 else 10)
        for ax in fig.axes:
            labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
            assert [t.get_text() for t in labels] == want and len(labels) <= 12
            assert {t.get_rotation() for t in labels} == {30.0}
            # parallel labels rotated by 30 degrees do not overlap when their baselines are at least
            # one text height apart: tick spacing * sin(30) >= text height (display pixels)
            xs = [ax.transData.transform((x, 0))[0] for x in ax.get_xticks()]
            height = max(t.get_window_extent(renderer).height for t in
                         [ax.text(0, 0, lab.get_text(), fontsize=lab.get_fontsize()) for lab in labels[:1]])
            if len(xs) > 1:
                assert min(b - a for a, b in zip(xs, xs[1:])) * math.sin(math.radians(30)) >= height
        lines = {ln.get_label(): ln for ln in fig.axes[1].get_lines()}
        assert set(lines) == {"pass@1", "pass@k", "held-out"}
        one, k = lines["pass@1"], lines["pass@k"]
        assert one.get_zorder() > k.get_zorder() and one.get_zorder() > lines["held-out"].get_zorder()
        assert (one.get_linestyle(), one.get_marker()) == ("--", "D") and k.get_marker() == "o"
        assert list(one.get_ydata()) == [r["pass_at_1"] for r in rounds]
    finally:
        plt.close(fig)
