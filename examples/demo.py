"""`make demo`: a realistic end-to-end run on the embedded log.

Every step calls the `ledger` CLI exactly as a user would, in a fresh store under
./demo-out, and prints what it did.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "demo-out"
STORE = OUT / "store"


def ledger(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ledger.cli", "--store", str(STORE), *args]
    proc = subprocess.run(cmd, cwd=OUT, text=True, capture_output=True)
    if not quiet:
        print(f"$ ledger {' '.join(args)}")
        for line in (proc.stdout + proc.stderr).strip().splitlines()[:25]:
            print(f"    {line}")
    if check and proc.returncode != 0:
        raise SystemExit(f"demo step failed (exit {proc.returncode}): ledger {' '.join(args)}")
    return proc


def main() -> None:
    started = time.monotonic()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    example = ROOT / "examples" / "demo.jsonl"
    print("== 1. create a store and ingest realistic executions (Qwen3.6 tokenizer, ChatML) ==")
    ledger("init")
    ledger("ingest", str(example))
    print("== 2. an identical retry is a no-op ==")
    ledger("ingest", str(example))
    print("== 3. project and inspect ==")
    ledger("project")
    ledger("status")
    print("== 4. audit the log and take a signed head ==")
    ledger("audit")
    ledger("log", "head")
    print(f"demo finished in {time.monotonic() - started:.1f} s; store in {STORE}")


if __name__ == "__main__":
    main()
