"""Retries are cheap on Kafka (SPEC §9; issue 13 item 8).

A producer that lost the answer to an ingest re-sends the batch.  The whole duplicate check
of that retry -- ingest's reference checks (``Log.event_ids``) and the backend's own
idempotency check in ``KafkaLog.append`` -- must cost O(batch), not O(topic): no record of
the topic is consumed or fetched, and the work is the same on a topic of 300 events as on one
of 3000.  ``KafkaLog.counters`` counts what a log object asked of the broker and its index.
"""

from __future__ import annotations

import uuid

import pytest

from ledger.log.kafka import KafkaLog
from ledger.log.sealing import KeyStore
from ledger.producers.ingest import Ingestor

from ..helpers import closed, opened, request

pytestmark = pytest.mark.kafka

PER_EXECUTION = 8  # requests per execution: an execution is 1 + 8 + 1 = 10 events
BATCH = 100


def _lines(n: int) -> list[dict]:
    """``n`` events: executions of an open, 8 requests (each extending the previous path), a close."""
    out: list[dict] = []
    e = 0
    while len(out) < n:
        ex = f"ex{e:05d}"
        out.append(opened(ex, task=f"task{e % 7}"))
        for r in range(PER_EXECUTION):
            out.append(request(ex, f"r{r}", [e, r, 1, 2, 3], [7, 8, r]))
        out.append(closed(ex))
        e += 1
    assert len(out) == n
    return out


def _fill(url: str, lines: list[dict], keys: KeyStore) -> None:
    with KafkaLog(url, create=True) as log:
        ing = Ingestor(log, keystore=keys)
        for i in range(0, len(lines), 1000):
            rep = ing.ingest_lines(list(enumerate(lines[i:i + 1000], i + 1)))
            assert rep.appended == len(lines[i:i + 1000]) and rep.duplicates == 0


def _retry(url: str, lines: list[dict], start: int, keys: KeyStore) -> dict:
    """Re-ingest ``lines[start:start + BATCH]`` with a fresh KafkaLog on the stored index (a new
    ``ledger ingest`` process); the log's counters for the whole retry."""
    with KafkaLog(url) as log:
        before = log.end_offsets()
        log.counters.clear()
        rep = Ingestor(log, keystore=keys).ingest_lines(list(enumerate(lines[start:start + BATCH], start + 1)))
        assert (rep.appended, rep.duplicates, rep.conflicts) == (0, BATCH, [])
        counters = dict(log.counters)
        assert log.end_offsets() == before  # nothing appended
    return counters


@pytest.fixture
def topics(kafka_broker, tmp_path):
    """url(n): a fresh topic prefix holding ``n`` ingested events (index in tmp_path)."""
    keys = KeyStore(tmp_path / "data-keys.db")

    def make(n: int) -> tuple[str, list[dict]]:
        url = f"kafka://{kafka_broker}/r{uuid.uuid4().hex[:10]}?index={tmp_path}/idx-{n}.db"
        lines = _lines(n)
        _fill(url, lines, keys)
        return url, lines

    yield make, keys
    keys.close()


def test_retry_of_a_batch_costs_the_same_on_a_small_and_a_large_topic(topics):
    make, keys = topics
    small_url, small = make(300)
    large_url, large = make(3000)
    # a slice from the middle of each log: requests and closes of executions opened before it,
    # so the reference checks must consult the log, not the batch
    c_small = _retry(small_url, small, 105, keys)
    c_large = _retry(large_url, large, 1505, keys)
    assert c_small == c_large  # independent of the topic's size
    assert c_large.get("records_consumed", 0) == 0  # the catch-up read nothing: the index was current
    assert c_large.get("values_fetched", 0) == 0  # no event's bytes fetched from the broker
    assert c_large["catch_ups"] <= 3  # event_ids, append (and a marker-only re-check at most)
    # every key the reference checks may ask about, one hashed index query per 500: O(batch)
    assert 0 < c_large["keys_looked_up"] <= 3 * BATCH


def test_retry_on_the_writing_log_object_reads_nothing(kafka_url, tmp_path):
    """The same process retrying (a lost acknowledgement): the second ingest of a batch is all
    duplicates, consumes no record and fetches no value."""
    lines = _lines(1000)
    with KeyStore(tmp_path / "keys.db") as keys, KafkaLog(kafka_url, create=True) as log:
        ing = Ingestor(log, keystore=keys)
        ing.ingest_lines(list(enumerate(lines, 1)))
        log.counters.clear()
        rep = ing.ingest_lines(list(enumerate(lines[400:400 + BATCH], 401)))
        assert (rep.appended, rep.duplicates) == (0, BATCH)
        assert log.counters.get("records_consumed", 0) == 0
        assert log.counters.get("values_fetched", 0) == 0
        assert log.counters["keys_looked_up"] <= 3 * BATCH
