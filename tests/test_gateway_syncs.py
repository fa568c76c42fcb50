"""The synced writes on a gateway call's critical path (issue 29, SPEC §11.8): counted per file.

Every ``os.fsync`` / ``os.fdatasync`` is counted by the file it syncs, every SQLite ``COMMIT``
by its database; a commit syncs when its connection runs ``synchronous=FULL`` (the log's index
and the data-key store), never on ``gateway.db`` (WAL, ``synchronous=NORMAL``: a process crash
loses nothing); its WAL is fsynced once per log batch, before the batch's events are appended, so a
power loss never leaves a request on the log without its restoration state."""

from __future__ import annotations

import collections
import io
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ledger import open_log
from ledger.gateway.app import make_app
from ledger.gateway.calls import Gateway
from ledger.gateway.serve import serve_in_background
from ledger.gateway.store import gateway_db_path
from ledger.producers.recorder import Recorder
from tests.gateway_helpers import init_store, log_requests
from tests.test_gateway_workers import MockEngine, _client, _turn

pytestmark = pytest.mark.timeout(240)


class SyncCounter:
    """Counts syncs (by file name) and commits (by database file name) while ``on``."""

    def __init__(self, monkeypatch) -> None:
        self.on = False
        self.syncs: collections.Counter = collections.Counter()
        self.commits: collections.Counter = collections.Counter()
        self.order: list[str] = []  # synced file names, in order
        real_connect = sqlite3.connect
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._sync(real))

        counter = self

        class Counting(sqlite3.Connection):  # Python-level overrides: no SQLite callback (a trace callback
            def execute(self, sql, *args):   # on a connection shared by threads can deadlock on the GIL)
                counter._commit(self.base, sql)
                return super().execute(sql, *args)

            def commit(self):
                counter._commit(self.base, "COMMIT")
                return super().commit()

        def connect(database, *args, **kw):
            db = real_connect(database, *args, factory=Counting, **kw)
            db.base = Path(str(database).split("?")[0].removeprefix("file:")).name
            return db

        monkeypatch.setattr(sqlite3, "connect", connect)

    def _sync(self, real):
        def sync(fd: int) -> None:
            if self.on:
                name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
                self.syncs[name] += 1
                self.order.append(name)
            real(fd)
        return sync

    def _commit(self, base: str, sql: str) -> None:
        if self.on and sql.strip().upper().startswith(("COMMIT", "END")):
            self.commits[base] += 1


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    counter = SyncCounter(monkeypatch)  # before anything connects
    eng = MockEngine()
    store = init_store(tmp_path / "store")
    log = open_log(str(store))
    rec = Recorder(log, producer="ledger-gateway", tee=io.StringIO())
    gw = Gateway(rec, upstream=eng.url, api="vllm", tokenizer_name="qwen3.6-27b", state_db=gateway_db_path(store),
                 model="tiny")
    url, stop = serve_in_background(make_app(gw))
    yield url, counter, store, gw
    stop()
    rec.close()
    log.close()
    eng.close()


def _calls(url: str, n: int, prefix: str, rid: str) -> None:
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda i: _turn(_client(url, f"{prefix}{i}"), [
            {"role": "user", "content": f"go {i}"}], f"{rid}-{i}"), range(n)))
    assert all(a.choices[0].message.content == "All done here." for a in answers)


def test_one_log_sync_per_batch_and_nothing_else_synced_per_call(gateway):
    url, counter, store, gw = gateway
    _calls(url, 32, "ex-s", "warm")  # the executions (and their data keys) exist before the measured calls
    counter.on = True
    _calls(url, 32, "ex-s", "r")
    counter.on = False
    batches = counter.syncs["events.dat"]
    assert 1 <= batches < 32  # group commit: one fdatasync of the segment per batch
    assert counter.commits["index.db"] == batches  # one index transaction per batch, in the same batch
    assert counter.commits["data-keys.db"] == 0  # keys exist: looked up, never written
    assert set(counter.syncs) == {"events.dat", "gateway.db-wal"}  # no other file synced from Python
    # the state rows of a batch's calls are synced before the batch's events: one WAL fsync per batch, first
    assert counter.syncs["gateway.db-wal"] == batches
    assert counter.order == ["gateway.db-wal", "events.dat"] * batches
    with gw._db_lock:
        assert gw.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # gateway.db commits never sync (NORMAL)
    for i in range(32):
        assert [r["request_id"] for r in log_requests(store, f"ex-s{i}")] == [f"warm-{i}", f"r-{i}"]


def test_data_keys_of_executions_starting_together_are_one_transaction(gateway):
    """Each data-key commit (journal DELETE, synchronous FULL) costs ~4 syncs: the first calls of
    executions that start together create their keys in one transaction per log batch."""
    url, counter, store, gw = gateway
    counter.on = True
    _calls(url, 32, "ex-k", "first")
    counter.on = False
    requests = 32
    batches = counter.syncs["events.dat"]
    assert 0 < counter.commits["data-keys.db"] < requests
    assert counter.commits["data-keys.db"] <= batches
    for i in range(32):
        assert [r["request_id"] for r in log_requests(store, f"ex-k{i}")] == [f"first-{i}"]
