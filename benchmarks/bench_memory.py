"""Peak memory of replay and export vs log size (SPEC §8, last row).

Two logs of the same realistic executions, 10× apart in count; `ledger project --rebuild`
and `ledger export` each run in a fresh process and report their peak RSS (``wait4``). The
ratio big/small should stay ≤ 1.5: memory grows with the largest execution, not the log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ledger.events.signing import (
    Trust,
    new_private_key,
    public_bytes,
    sign_line,
    write_private_key,
)
from workloads import synthetic as workload

from .common import print_table, row

ROOT = Path(__file__).resolve().parent.parent


# VmHWM is the peak RSS of the process's own address space (ru_maxrss would carry the
# parent's peak across fork+exec on Linux).
_LAUNCH = ("import sys\nfrom ledger.cli import main\nrc = main(sys.argv[1:])\n"
           "hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
           "print(f'VmHWM {hwm}', file=sys.stderr)\nsys.exit(rc)\n")


def _peak_rss_mb(args: list[str], cwd: Path) -> float:
    proc = subprocess.run([sys.executable, "-c", _LAUNCH, *args], cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ledger {' '.join(args)} failed: {proc.stderr[-500:]}")
    return int(proc.stderr.rsplit("VmHWM ", 1)[1].split()[0]) / 1024  # kB -> MB


def _store(d: Path, n: int) -> Path:
    store = d / f"store-{n}"
    key = new_private_key()
    subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), "init"], check=True, capture_output=True)
    trust = Trust.load(store / "trust.json")
    trust.add(public_bytes(key), ["split_policy", "permission", "admission_policy"])
    trust.save(store / "trust.json")
    lines = list(workload.with_prefix_references(workload.generate(n, seed=5, turns=14)))
    gov = [{"type": "split_policy", "policy_id": "p", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}, "salt": "m"},
           {"type": "permission", "subject": "*", "use": "*", "action": "grant", "authority": "bench"},
           {"type": "admission_policy", "route": "r", "version": 1, "use": "rl", "split": "train", "j_max": 4}]
    lines += [sign_line(g, key) for g in gov]
    path = d / f"events-{n}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), "ingest", str(path)], check=True,
                   capture_output=True)
    return store


def run(small: int = 20, factor: int = 10) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        stores = {n: _store(d, n) for n in (small, small * factor)}
        peaks = {}
        for n, store in stores.items():
            peaks[("project", n)] = _peak_rss_mb(["--store", str(store), "project", "--rebuild"], d)
            peaks[("export", n)] = _peak_rss_mb(["--store", str(store), "export", "r", "--out", str(d / f"x{n}.jsonl")], d)
        big = small * factor
        for what in ("project", "export"):
            rows.append(row(f"peak RSS of `ledger {what}`: {big} vs {small} executions (10x log)",
                            peaks[(what, big)], peaks[(what, small)], "MB (ratio target <= 1.5)"))
    return rows


if __name__ == "__main__":
    print_table(run())
