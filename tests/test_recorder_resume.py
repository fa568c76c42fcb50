"""Recorder.resume (SPEC §7.4/§7.6): a new process continues the prefix references of an
execution an earlier process recorded, through the public API (the gateway's restart path)."""

from __future__ import annotations

import pytest

from ledger.log import open_log
from ledger.producers.recorder import Recorder
from tests.test_recorder import DEADLINE, replay

BASE = list(range(100, 140))


def _first_run(log) -> list[tuple[str, str, list[int], list[int]]]:
    """Three calls of execution "e" recorded by a first recorder (which then goes away)."""
    calls = [("r1", "main", BASE, [1, 2, 3]), ("s1", "helper", BASE[:20] + [7], [8]),
             ("r2", "main", BASE + [1, 2, 3, 50], [4, 5])]
    with Recorder(log, min_prefix=1) as rec:
        rec.open_execution("e", "t", DEADLINE, "p")
        for rid, agent, inp, out in calls:
            rec.record_request("e", rid, inp, out, [-0.1] * len(out), agent)
    return calls


def test_resume_continues_prefix_references_from_the_recorded_calls(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    calls = _first_run(log)
    with Recorder(log, min_prefix=1) as rec:
        assert rec.resume("e", calls) == 3
        r3 = rec.record_request("e", "r3", BASE + [1, 2, 3, 50, 4, 5, 60], [6], [-0.2])  # the agent's last: r2
        assert (r3["input_prefix"]["request_id"], r3["input_prefix"]["length"]) == ("r2", 46)
        assert r3["input_suffix_ids"] == [60] and "input_ids" not in r3
        # a helper call under r1: its own previous call (s1) shares 20 tokens, the parent r1 shares 30
        s2 = rec.record_request("e", "s2", BASE[:30] + [9], [10], [-0.3], "helper", parent_request_id="r1")
        assert (s2["input_prefix"]["request_id"], s2["input_prefix"]["length"]) == ("r1", 30)
    db = replay(log, tmp_path)
    from ledger.projections.tree import request_path

    assert request_path(db, "e", "r3").tolist() == BASE + [1, 2, 3, 50, 4, 5, 60, 6]
    assert request_path(db, "e", "s2").tolist() == BASE[:30] + [9, 10]


def test_without_resume_a_new_recorder_writes_the_full_input(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    _first_run(log)
    with Recorder(log, min_prefix=1) as rec:
        line = rec.record_request("e", "r3", BASE + [1, 2, 3, 50, 4, 5, 60], [6], [-0.2])
    assert "input_prefix" not in line and len(line["input_ids"]) == 47


def test_state_the_recorder_holds_wins_and_recent_paths_is_a_bound(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    calls = _first_run(log)
    with Recorder(log, min_prefix=1, recent_paths=2) as rec:
        rec.record_request("e", "r9", [500] * 10, [501], [-0.1])  # this recorder's own latest call of "main"
        assert rec.resume("e", calls) == 3
        nxt = rec.record_request("e", "r10", [500] * 10 + [501, 502], [503], [-0.1])
        assert (nxt["input_prefix"]["request_id"], nxt["input_prefix"]["length"]) == ("r9", 11)
        # only the last 2 resumed calls are kept for parent references: r1 is gone, r2 is there
        kept = rec.record_request("e", "x2", BASE[:30], [2], [-0.1], "other2", parent_request_id="r2")
        gone = rec.record_request("e", "x1", BASE[:30], [1], [-0.1], "other", parent_request_id="r1")
        assert "input_prefix" not in gone
        assert (kept["input_prefix"]["request_id"], kept["input_prefix"]["length"]) == ("r2", 30)


def test_bad_tokens_raise_and_change_nothing(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    calls = _first_run(log)
    with Recorder(log, min_prefix=1) as rec:
        with pytest.raises(ValueError, match=r"^bad: input_ids: token IDs must be in 0\.\.4294967295$"):
            rec.resume("e", calls + [("bad", "main", [-1], [1])])
        line = rec.record_request("e", "r3", BASE + [1, 2, 3, 50, 4, 5, 60], [6], [-0.2])
        assert "input_prefix" not in line  # the valid calls before the bad one were not taken either
