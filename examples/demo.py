"""`make demo`: a realistic end-to-end run on the embedded log (SPEC §1, issue 6).

Every step runs the `ledger` CLI exactly as a user would, in a fresh store under
./demo-out, and prints a short account of what happened:

realistic executions (real Qwen3.6 tokenizer, plus real Claude Code sessions rendered the
same way) -> assessments -> signed governance (split policy, permissions, a route) ->
projections -> splits check -> cascade plan -> publish signed manifest v1 -> verify (deep)
-> withdraw one source -> replay -> v2 without its members -> impact shows v1 affected ->
diff v1 v2 -> a trainer loop reads v2 with digest checks -> report -> audit + signed head.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "demo-out"
STORE = OUT / "store"
SESSIONS = ROOT.parent / "shared" / "testdata" / "transcripts" / "claude-code"
ROUTE = "rl-main"


def ledger(*args: str, check: bool = True, show: int = 12) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ledger.cli", "--store", str(STORE), *args]
    proc = subprocess.run(cmd, cwd=OUT, text=True, capture_output=True)
    print(f"$ ledger {' '.join(args)}")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    for line in lines[:show]:
        print(f"    {line}")
    if len(lines) > show:
        print(f"    ... ({len(lines) - show} more lines)")
    if check and proc.returncode != 0:
        raise SystemExit(f"demo step failed (exit {proc.returncode}): ledger {' '.join(args)}")
    return proc


def step(title: str) -> None:
    print(f"\n== {title} ==")


def write_jsonl(path: Path, lines) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
    return n


def executions_file() -> Path:
    """24 generated executions (12 tasks, several sources) + two real Claude Code sessions."""
    from workloads import synthetic as workload
    from workloads.claude_code import session_events

    events = list(workload.with_prefix_references(workload.generate(24, seed=11, turns=14)))
    for name in ("subagent.jsonl", "tool_heavy.jsonl"):
        session = SESSIONS / name
        if session.exists():
            task = f"cc-{session.stem}"
            events.append({"type": "task_registered", "task_id": task, "source": "claude-code-sessions",
                           "family": "real-session"})
            events += list(workload.with_prefix_references(session_events(session, task_id=task)))
    path = OUT / "executions.jsonl"
    write_jsonl(path, events)
    return path


def governance_file() -> Path:
    sources = ["swe-synth", "internal-bugbash", "oss-issues", "curated-regressions", "claude-code-sessions"]
    lines = [{"type": "split_policy", "policy_id": "splits-v1", "fractions": {"train": 0.7, "dev": 0.15, "final_test": 0.15},
              "salt": "demo-salt-2026"}]
    lines += [{"type": "permission", "subject": f"source:{s}", "use": "rl", "action": "grant", "authority": "data-governance"}
              for s in sources]
    lines.append({"type": "admission_policy", "route": ROUTE, "version": 1, "use": "rl", "split": "train", "j_max": 4,
                  "role_priority": ["main/task", "main/summary", "sub/task", "sub/summary"],
                  "predicates": [{"name": "record_adequacy"}, {"name": "permitted_use"},
                                 {"name": "target_suitability", "depends_on": ["record_adequacy"]}],
                  "seed": "demo-route-seed", "consumer": "demo-trainer",
                  "evaluation_claim": "none: training corpus only"})
    path = OUT / "governance.jsonl"
    write_jsonl(path, lines)
    return path


def trainer_loop(manifest: Path, records: Path) -> None:
    """What a trainer does: read records, check each digest against the signed manifest."""
    from ledger.corpus.export import read_records

    doc = json.loads(manifest.read_text())
    expected = {m["member_id"]: m["digest"] for m in doc["members"]}
    n = targets = 0
    weight_by_execution: dict[str, float] = {}
    for rec in read_records(records):  # raises on any digest mismatch
        if expected.get(rec["member_id"]) != rec["digest"]:
            raise SystemExit(f"member {rec['member_id']} is not in the manifest with this digest")
        n += 1
        targets += sum(rec["target_mask"])
        weight_by_execution[rec["execution_id"]] = weight_by_execution.get(rec["execution_id"], 0.0) + \
            rec["loss_weight"] * sum(rec["target_mask"])
    print(f"    trainer read {n} records ({targets} target tokens), every digest matches manifest v{doc['version']}")
    print(f"    per-execution total loss weight (1/L_i x L_i): "
          f"{sorted(set(round(w, 6) for w in weight_by_execution.values()))} for {len(weight_by_execution)} executions")


def main() -> None:
    started = time.monotonic()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()

    step("1. a store, a governance key, realistic executions")
    ledger("init")
    ledger("keys", "new", "--out", "gov.key")
    path = executions_file()
    print(f"    wrote {path.name}: {sum(1 for _ in open(path))} events (Qwen3.6 tokens, prefix references)")
    ledger("ingest", str(path))
    ledger("ingest", str(path), show=2)  # identical retry: all duplicates

    step("2. signed governance: split policy, source permissions, an admission route")
    signed = OUT / "governance.signed.jsonl"
    proc = ledger("sign", "--key", "gov.key", str(governance_file()), show=0)
    signed.write_text(proc.stdout)
    ledger("ingest", str(signed))

    step("3. project everything and look around")
    ledger("project")
    ledger("status")
    ledger("tree", "exec-11-0000", show=16)
    ledger("splits", "show")
    ledger("splits", "check")
    ledger("cascade", "plan", ROUTE)

    step("4. publish signed manifest v1 and verify it (deep: replay the log and rebuild)")
    ledger("manifest", "publish", ROUTE, "--key", "gov.key", "--out", "manifest-v1.json")
    ledger("manifest", "verify", "manifest-v1.json", "--deep")

    step("5. withdraw and erase one source (its data keys are destroyed); replay; v2 leaves its members out")
    ledger("withdraw", "source:internal-bugbash", "--reason", "provider revoked consent", "--key", "gov.key", "--erase")
    ledger("project")
    ledger("manifest", "publish", ROUTE, "--key", "gov.key", "--out", "manifest-v2.json")
    ledger("impact", "source:internal-bugbash")
    ledger("manifest", "diff", "manifest-v1.json", "manifest-v2.json")
    ledger("manifest", "verify", "manifest-v2.json")

    step("6. a trainer reads v2 with digest checks")
    ledger("export", ROUTE, "--out", "train-v2.jsonl", "--format", "jsonl", show=4)
    trainer_loop(OUT / "manifest-v2.json", OUT / "train-v2.jsonl")
    doc = json.loads((OUT / "manifest-v2.json").read_text())
    member = doc["members"][0]["member_id"] if doc["members"] else None
    if member:
        ledger("manifest", "prove", "manifest-v2.json", member, show=6)

    step("7. report, audit and a signed log head")
    ledger("report", "--out", "report")
    ledger("audit")
    ledger("log", "head")
    print(f"\ndemo finished in {time.monotonic() - started:.1f} s; everything is in {OUT}")


if __name__ == "__main__":
    main()
