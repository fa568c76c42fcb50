"""References are checked under the writer lock (SPEC §9; issue 13 item 4).

``Ingestor.submit`` checks a batch's references long before it appends (validation, the
checks, sealing and encoding of 15k lines take seconds), and a concurrent writer can put a
closure or a root split policy on the log meanwhile.  The log therefore calls the ingestor's
``recheck`` under its writer lock, just before it writes.  Real processes, the real CLI:

* one process ingests ~15k lines holding a request for execution X near the end, the other
  X's closure, started at once, inside the first one's check-to-append window (three times;
  the window is seen from outside as the seal step creating data-keys.db) and after it: the
  log never holds a request of X after X's closure, and every start inside the window ends
  in the refusal under the lock (naming the concurrent closure);
* two big files, each with a signed root split policy at its head, ingested at the same
  time: exactly one is appended, the other refused (exit 2), the log holds one policy.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from ledger.events.signing import load_private_key, sign_line

ROOT = Path(__file__).resolve().parents[2]
N_EXEC = 3000  # x 5 lines = 15k lines per big file


def _cmd(store: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "ledger.cli", "--store", str(store), *args]


def _run(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(store, *args), cwd=ROOT, capture_output=True, text=True, timeout=300)


def _big(tag: str) -> list[dict]:
    out = []
    for e in range(N_EXEC):
        ex = f"{tag}{e}"
        out.append({"type": "execution_opened", "execution_id": ex, "task_id": "t1", "deadline": "2030-01-01T00:00:00Z",
                    "policy": "qwen@1"})
        out += [{"type": "request", "execution_id": ex, "request_id": f"r{r}", "input_ids": [1, 2, 3, r],
                 "output_ids": [4, 5], "output_logprobs": [-0.5, -0.5]} for r in range(3)]
        out.append({"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"]})
    return out


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _events(store: Path) -> list[tuple[int, str, str]]:
    db = sqlite3.connect(store / "index.db")
    try:
        return db.execute("SELECT position, event_type, event_id FROM events ORDER BY position").fetchall()
    finally:
        db.close()


def test_a_request_never_lands_after_its_closure(tmp_path):
    base = tmp_path / "base"
    assert _run(base, "init").returncode == 0
    opened = {"type": "execution_opened", "execution_id": "X", "task_id": "t1", "deadline": "2030-01-01T00:00:00Z",
              "policy": "qwen@1"}
    assert _run(base, "ingest", str(_write(tmp_path / "x.jsonl", [opened]))).returncode == 0
    lines = _big("a")
    lines.insert(len(lines) - 20, {"type": "request", "execution_id": "X", "request_id": "late", "input_ids": [1, 2, 3],
                                   "output_ids": [4], "output_logprobs": [-0.5]})
    big = _write(tmp_path / "big.jsonl", lines)
    close = _write(tmp_path / "close.jsonl", [{"type": "execution_closed", "execution_id": "X", "status": "completed",
                                                "artifact_versions": ["v1"]}])
    line_no = next(i for i, x in enumerate(lines, 1) if x.get("request_id") == "late")

    # When to start the closure.  The data-key store (data-keys.db) is created by the seal step,
    # which runs after the reference checks and before the append: its appearance means the big
    # ingest is inside the check-to-append window.  "at once": the closure races the whole run;
    # "window": started when the key store appears (3 times); "after": once the big ingest ended.
    outcomes = []
    for i, when in enumerate(("at once", "window", "window", "window", "after")):
        store = tmp_path / f"s{i}"
        shutil.copytree(base, store)
        assert not (store / "data-keys.db").exists()
        a = subprocess.Popen(_cmd(store, "ingest", str(big)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        if when == "window":
            deadline = time.monotonic() + 240
            while not (store / "data-keys.db").exists() and a.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
        elif when == "after":
            a.wait(timeout=300)
        b = _run(store, "ingest", str(close))
        a_out, a_err = a.communicate(timeout=300)
        assert b.returncode == 0, b.stderr  # the closure is always accepted
        assert "Traceback" not in a_err
        events = _events(store)
        where = {eid: pos for pos, _t, eid in events}
        assert "execution_closed/X" in where
        if a.returncode == 0:
            assert where["request/X/late"] < where["execution_closed/X"]
            assert len(events) == 1 + len(lines) + 1
            outcomes.append("request first")
        else:
            assert a.returncode == 2, a_err
            assert a_err.count("\n") == 1 and a_err.startswith(f"ledger: refused (nothing appended): line {line_no}: ")
            assert [e[2] for e in events] == ["execution_opened/X", "execution_closed/X"]  # nothing of the batch
            if "was closed by a concurrent writer (event execution_closed/X)" in a_err:
                outcomes.append("refused under the lock")
            else:
                assert "execution 'X' is closed; no further requests are accepted" in a_err, a_err
                outcomes.append("refused before")
        # the invariant: no request of X after X's closure, whoever won
        closed_at = where["execution_closed/X"]
        assert not [e for e in events if e[1] == "request" and e[2].startswith("request/X/") and e[0] > closed_at]
    assert outcomes[0] in ("refused before", "refused under the lock"), outcomes
    assert outcomes[1:] == ["refused under the lock"] * 3 + ["request first"], outcomes


def test_two_concurrent_root_split_policies_one_wins(tmp_path):
    base = tmp_path / "base"
    assert _run(base, "init").returncode == 0
    assert _run(base, "keys", "new", "--out", str(tmp_path / "gov.key")).returncode == 0
    key = load_private_key(tmp_path / "gov.key")
    files = []
    for name in ("pa", "pb"):
        policy = sign_line({"type": "split_policy", "policy_id": name, "salt": name,
                            "fractions": {"train": 0.98, "dev": 0.01, "final_test": 0.01}}, key)
        files.append(_write(tmp_path / f"{name}.jsonl", [policy, *_big(name)]))
    for rep in range(3):
        store = tmp_path / f"s{rep}"
        shutil.copytree(base, store)
        procs = [subprocess.Popen(_cmd(store, "ingest", str(f)), cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for f in files]
        results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
        codes = sorted(r[0] for r in results)
        assert codes == [0, 2], results
        winner, loser = (0, 1) if results[0][0] == 0 else (1, 0)
        err = results[loser][2]
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert err.startswith("ledger: refused (nothing appended): line 1: ")
        assert "a split policy is already in force (event split_policy/" + ("pa" if winner == 0 else "pb") in err, err
        events = _events(store)
        assert [e[2] for e in events if e[1] == "split_policy"] == [f"split_policy/{'pa' if winner == 0 else 'pb'}"]
        assert len(events) == 1 + 5 * N_EXEC  # the winner's file, nothing of the loser's
