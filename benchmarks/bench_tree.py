"""Prefix-tree build vs reading the log; log bytes with vs without prefix references (SPEC §8).

Workload: :func:`workloads.synthetic.generate` (realistic Qwen3.6-tokenized coding-agent runs:
tool loops, a sub-agent, two samples from one prefix, a user follow-up that drops earlier
think blocks, a compaction).  ``LEDGER_BENCH_TREE_EXECUTIONS`` / ``LEDGER_BENCH_TREE_TURNS``
override the size (default 200 executions x 30 main-agent turns).

Rows:

* **tree build** — ``ReplayEngine`` with :class:`projections.tree.TreeProjection` over the
  log written *without* prefix references (every request carries its full ``input_ids``):
  raw tokens matched per second (expanded tokens / build time, the build includes reading
  and decoding the log and committing the tables), against **log-read throughput** on the
  same log (read + decode every event; expanded tokens / read time).  Target ratio >= 0.5.
* the same two figures on the log the :class:`ledger.producers.recorder.Recorder` wrote (prefix
  references: the log is much smaller, so reading it is cheap; informational);
* prefix matching alone (in-memory :class:`ledger.algorithms.prefix_match.Tree`, no SQLite) vs
  log read (informational: shows matching is not the bottleneck);
* **log bytes per execution** with prefix references (Recorder) vs full ``input_ids``;
* **stored / expanded tokens** over all trees.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path

from ledger.algorithms.prefix_match import Tree, output_flag
from ledger.events.codec import default_codec
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.producers.recorder import Recorder
from ledger.projections.engine import ReplayEngine, connect
from workloads import synthetic as workload

from .common import print_table, row, now

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_TREE_EXECUTIONS", "200"))
TURNS = int(os.environ.get("LEDGER_BENCH_TREE_TURNS", "30"))
REPEAT = int(os.environ.get("LEDGER_BENCH_TREE_REPEAT", "3"))


def _by_execution(events: list[dict]) -> list[list[dict]]:
    groups: list[list[dict]] = []
    current: list[dict] = []
    for e in events:
        if e["type"] == "execution_opened" and current:
            groups.append(current)
            current = []
        current.append(e)
    if current:
        groups.append(current)
    return groups


def _record(rec: Recorder, e: dict) -> None:
    t = e["type"]
    if t == "execution_opened":
        rec.open_execution(e["execution_id"], e["task_id"], e["deadline"], e["policy"], tokenizer=e.get("tokenizer"),
                           origin=e.get("origin"), collection_run_id=e.get("collection_run_id"),
                           metadata=e.get("metadata"), occurred_at=e.get("occurred_at"))
    elif t == "request":
        opts = {k: e[k] for k in ("agent_tier", "turn_kind", "generator", "parent_request_id", "consumed_tool_call_ids",
                                  "emitted_tool_call_ids", "model", "finish_reason", "occurred_at", "reconstructed") if k in e}
        rec.record_request(e["execution_id"], e["request_id"], e["input_ids"], e["output_ids"],
                           e.get("output_logprobs"), e.get("agent_id", "main"), **opts)
    else:
        rec.emit(e)


def _read_all(log) -> float:
    codec = default_codec()
    t0 = now()
    n = 0
    for where in log.partitions():
        for rec in log.read(where):
            codec.decode(rec.value)
            n += 1
    return now() - t0


class _Null:
    """A projection that does nothing: replaying with it costs the engine's own work."""

    name = "null"

    def create(self, db) -> None:
        pass

    def apply(self, db, item) -> None:
        pass

    def finish(self, db) -> None:
        pass

    def reset(self) -> None:
        pass


def _null_replay(log, db_path: Path) -> float:
    db = connect(db_path)
    t0 = now()
    ReplayEngine(log, db, [_Null()]).run()
    elapsed = now() - t0
    db.close()
    return elapsed


def _with_page_size(db_path: Path, page_size: int) -> Path:
    """Create an empty database with ``page_size`` (must happen before WAL mode / any table)."""
    raw = sqlite3.connect(str(db_path))
    raw.execute(f"PRAGMA page_size={page_size}")
    raw.execute("VACUUM")
    raw.close()
    return db_path


def _build(log, db_path: Path):
    from ledger.projections.tree import TreeProjection

    db = connect(db_path)
    t0 = now()
    ReplayEngine(log, db, [TreeProjection()]).run()
    elapsed = now() - t0
    stored, expanded = db.execute("SELECT SUM(stored_tokens), SUM(expanded_tokens) FROM tree_stats").fetchone()
    db.close()
    return elapsed, stored, expanded


def _match_only(log) -> float:
    """In-memory trees only (decode + match + insert), no SQLite."""
    codec = default_codec()
    events = [codec.decode(r.value) for w in log.partitions() for r in log.read(w)]
    t0 = now()
    trees: dict[str, Tree] = {}
    for ev in events:
        if ev["event_type"] != "request":
            continue
        tree = trees.setdefault(ev["execution_id"], Tree())
        lp = ev["output_logprobs"]
        tree.insert(ev["request_id"], len(tree.requests), ev["input_ids"], ev["output_ids"], lp,
                    output_flag(ev["generator"], ev["reconstructed"]), hint=ev["parent_request_id"])
    return now() - t0


def _measure(events: list[dict], label: str, *, repeat: int = REPEAT, extras: bool = True) -> tuple[list[dict], dict]:
    """Rows for one workload (events as JSON lines with full input_ids)."""
    groups = _by_execution([e for e in events if e["type"] != "task_registered"])
    n_exec = len(groups)
    n_req = sum(1 for e in events if e["type"] == "request")
    expanded = sum(len(e["input_ids"]) + len(e["output_ids"]) for e in events if e["type"] == "request")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        full = open_log(str(d / "full"), create=True)
        ing = Ingestor(full, producer="bench")
        for g in groups:
            ing.ingest_lines(list(enumerate(g, 1)))
        refs = open_log(str(d / "refs"), create=True)
        with Recorder(refs, producer="bench") as rec:
            for e in events:
                if e["type"] != "task_registered":
                    _record(rec, e)
        full_bytes = (d / "full" / "events.dat").stat().st_size
        ref_bytes = (d / "refs" / "events.dat").stat().st_size

        # best of `repeat`, interleaved (the machine may be shared)
        t_read = t_null = t_build = t_read_r = t_build_r = t_match = t_build_16k = float("inf")
        stored = stored_r = exp_db = 0
        for i in range(repeat):
            t_read = min(t_read, _read_all(full))
            t_null = min(t_null, _null_replay(full, d / f"null{i}.db"))
            tb, stored, exp_db = _build(full, d / f"full{i}.db")
            t_build = min(t_build, tb)
            if extras:
                t_read_r = min(t_read_r, _read_all(refs))
                tb, stored_r, _ = _build(refs, d / f"refs{i}.db")
                t_build_r = min(t_build_r, tb)
                t_match = min(t_match, _match_only(full))
                t_build_16k = min(t_build_16k, _build(full, _with_page_size(d / f"p16k{i}.db", 16384))[0])
        assert exp_db == expanded, (exp_db, expanded)
        assert not extras or stored_r == stored
        full.close()
        refs.close()
    size = f"{n_exec} executions, {n_req} requests, {expanded / 1e6:.1f}M expanded tokens"
    mtok = 1e6
    rows.append(row(f"tree build, {label} ({size}), full-input log", expanded / t_build / mtok,
                    expanded / t_read / mtok, "M raw tokens matched/s (vs log read+decode, same log)", 0.5))
    rows.append(row(f"tree build, {label}: projection's own work (replay minus no-op replay)",
                    expanded / max(t_build - t_null, 1e-9) / mtok, expanded / t_read / mtok,
                    "M raw tokens/s (vs log read+decode)", 0.5))
    if extras:
        rows.append(row(f"tree build, {label}: 16 KiB SQLite pages (proposed engine setting)",
                        expanded / t_build_16k / mtok, expanded / t_read / mtok,
                        "M raw tokens/s (vs log read+decode; informational)"))
        rows.append(row(f"tree build, {label}: prefix-reference log (Recorder)", expanded / t_build_r / mtok,
                        expanded / t_read_r / mtok, "M raw tokens/s (vs read+decode of that log; informational)"))
        rows.append(row(f"prefix matching only, {label} (in-memory trees, no SQLite)", expanded / t_match / mtok,
                        expanded / t_read / mtok, "M raw tokens/s (vs log read+decode; informational)"))
    rows.append(row(f"log bytes per execution, {label}: prefix references (Recorder) vs full input_ids",
                    ref_bytes / n_exec, full_bytes / n_exec, "bytes/execution (lower is better)"))
    rows.append(row(f"stored / expanded tokens, {label}", stored, expanded, "tokens (lower is better)"))
    return rows, {"executions": n_exec, "requests": n_req, "expanded": expanded, "stored": stored}


def claude_code_events() -> list[dict]:
    """The real Claude Code sessions of ../shared/testdata (empty if absent)."""
    from workloads import claude_code

    root = Path(__file__).resolve().parents[1].parent / "shared" / "testdata" / "transcripts" / "claude-code"
    out: list[dict] = []
    for session in claude_code.list_sessions(root):
        out.extend(claude_code.session_events(session))
    return out


def run(n_executions: int = N_EXECUTIONS, turns: int = TURNS) -> list[dict]:
    t0 = now()
    events = list(workload.generate(n_executions, seed=2024, turns=turns))
    gen_s = now() - t0
    rows, _ = _measure(events, f"workload {turns} turns")
    try:
        cc = claude_code_events()
    except (ImportError, OSError):  # pragma: no cover - test data not present
        cc = []
    if cc:
        more, _ = _measure(cc, "real Claude Code sessions", extras=False)
        rows.extend(more)
    rows.append(row(f"workload generation ({n_executions} executions, for reference)", gen_s, gen_s, "s"))
    return rows


if __name__ == "__main__":
    print_table(run())
