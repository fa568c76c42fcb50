"""A local group of projector processes (``ledger project --follow --group``) for fault tests,
the soak test, benchmarks and demos: start, kill, stop, watch positions and statistics.

Every process is ``python -m ledger.cli --store URL --trust TRUST project --follow --group G
--state-dir DIR --stats <workdir>/<name>.stats.json`` with its output in ``<workdir>/<name>.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping
from ledger.projections.shards import shard_positions

ROOT = Path(__file__).resolve().parents[2]


class LocalCluster:
    def __init__(self, url: str, trust: str | Path, state_dir: str | Path, group: str, *, workdir: str | Path,
                 extra_args: Iterable[str] = (), python: str = sys.executable) -> None:
        self.url, self.trust, self.group = url, str(trust), group
        self.state_dir = Path(state_dir)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.extra_args = list(extra_args)
        self.python = python
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}

    # ------------------------------------------------------------------ processes
    def command(self, name: str, *extra: str) -> list[str]:
        return [self.python, "-m", "ledger.cli", "--store", self.url, "--trust", self.trust, "project", "--follow",
                "--group", self.group, "--state-dir", str(self.state_dir), "--stats", str(self.stats_path(name)),
                *self.extra_args, *extra]

    def spawn(self, name: str, *extra: str) -> subprocess.Popen:
        """Start projector ``name`` (a previous process of that name must have exited)."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"projector {name} is still running")
        self.stats_path(name).unlink(missing_ok=True)
        log = open(self.workdir / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        proc = subprocess.Popen(self.command(name, *extra), cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        self._logs[name] = log
        return proc

    def start(self, n: int, *extra: str, prefix: str = "p") -> list[str]:
        names = [f"{prefix}{i}" for i in range(n)]
        for name in names:
            self.spawn(name, *extra)
        return names

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def kill(self, name: str) -> int:
        """SIGKILL ``name`` and reap it."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        return proc.wait(10)

    def stop(self, name: str, timeout: float = 30.0, *, signalled: bool = False) -> int | None:
        """SIGTERM ``name`` (once: a second one during shutdown would kill it) and wait for its exit code."""
        proc = self.procs[name]
        if proc.poll() is None and not signalled:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            return None

    def stop_all(self, timeout: float = 30.0) -> dict[str, int | None]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        out = {name: self.stop(name, timeout, signalled=True) for name in list(self.procs)}
        for log in self._logs.values():
            log.close()  # type: ignore[attr-defined]
        return out

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    # ------------------------------------------------------------------ observation
    def stats_path(self, name: str) -> Path:
        return self.workdir / f"{name}.stats.json"

    def stats(self, name: str) -> dict | None:
        try:
            return json.loads(self.stats_path(name).read_text())
        except (OSError, ValueError):
            return None

    def log_text(self, name: str) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def positions(self) -> dict[tuple[str, int], int]:

        return shard_positions(self.state_dir)

    def owners(self) -> dict[int, str]:
        """Execution partition -> the projector whose last statistics say it owns it."""
        out = {}
        for name in self.alive():
            st = self.stats(name) or {}
            for p in st.get("owned", []):
                out[p] = name
        return out

    def wait_caught_up(self, want: Mapping[tuple[str, int], int], timeout: float) -> bool:
        """Until every shard has applied up to ``want`` (e.g. a single replay's positions)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            have = self.positions()
            if all(have.get(k, 0) >= v for k, v in want.items() if v > 0):
                return True
            time.sleep(0.2)
        return False

    def wait_owned(self, partitions: Iterable[int], names: Iterable[str] | None = None, timeout: float = 60.0) -> bool:
        """Until the live projectors (or ``names``) between them own exactly ``partitions``, each
        partition once and (when there are enough partitions) every projector at least one."""
        want = sorted(partitions)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            members = list(names) if names is not None else self.alive()
            owned: list[int] = []
            everyone = True
            for name in members:
                mine = (self.stats(name) or {}).get("owned", [])
                everyone = everyone and bool(mine)
                owned += mine
            if sorted(owned) == want and (everyone or len(members) > len(want)):
                return True
            time.sleep(0.2)
        return False
