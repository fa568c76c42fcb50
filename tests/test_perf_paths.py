"""The fast paths of issue 19 give exactly what the slow paths gave (content hashes, keys, idempotency)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.identifiers import join_key, key_component
from ledger.events.codec import content_hash, default_codec, plain_request_content_hash
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.log.sealing import KeyStore, Sealer, SubjectResolver
from ledger.producers.ingest import Ingestor, submission
from workloads import synthetic as workload


def _requests(n: int = 3) -> list[dict]:
    lines = workload.with_prefix_references(workload.generate(n, seed=19, turns=14))
    return [ev for ev in (validate_line(line, line=i, now_micros=0) for i, line in enumerate(lines, 1))
            if ev["event_type"] == "request"]


def _odd_request() -> dict:
    return validate_line({"type": "request", "execution_id": "ex/é\u0001" + "x" * 70, "request_id": "r-ü" * 30,
                          "input_ids": list(range(300)), "output_ids": [7, 8], "agent_id": "a" * 200,
                          "consumed_tool_call_ids": ["c1", "c/2"], "emitted_tool_call_ids": ["é" * 64],
                          "parent_request_id": "p0", "model": None, "finish_reason": "stop", "generator": "harness"}, now_micros=1_700_000_000)


def test_plain_content_hash_of_sealed_requests_equals_the_encoded_plain_hash(tmp_path):
    codec = default_codec()
    schema = codec.schema_for("request")
    sealer = Sealer(KeyStore(tmp_path / "k.db"), SubjectResolver("execution"))
    reqs = _requests() + [_odd_request()]
    assert sum(ev["input_prefix"] is not None for ev in reqs) > 10  # prefix-referenced requests are covered
    for ev in reqs:
        sealed = sealer.seal(ev)
        value = codec.encode(sealed)
        assert plain_request_content_hash(ev, sealed, value, schema) == content_hash(ev, codec.encode(ev))
        assert submission(sealed, codec, plain=ev).content_hash == submission(ev, codec).content_hash


def test_plain_content_hash_refuses_what_it_cannot_splice(tmp_path):
    codec = default_codec()
    schema = codec.schema_for("request")
    ev = _odd_request()
    sealed = Sealer(KeyStore(tmp_path / "k.db"), SubjectResolver("execution")).seal(ev)
    value = codec.encode(sealed)
    assert plain_request_content_hash({**ev, "agent_id": "other"}, sealed, value, schema) is None  # records disagree
    assert plain_request_content_hash({**ev, "output_ids": bytearray(ev["output_ids"])}, sealed, value, schema) is None
    assert plain_request_content_hash(ev, sealed, value + b"\x00", schema) is None  # lengths do not add up
    assert plain_request_content_hash(ev, sealed, value, codec.schema_for("tool_payload")) is None  # other layout
    # the fallback in submission() still gives the plain content's hash
    assert submission(sealed, codec, plain={**ev, "output_ids": bytearray(ev["output_ids"])}).content_hash == \
        content_hash(ev, codec.encode(ev))


@pytest.mark.parametrize("parts", [("request", "e1", "r1"), ("request", "a/b", "r%1"), ("x", "\u0000", "é/"),
                                   ("cost_recorded", 17, "ab"), ("k", "\x9f", "\x7f"), ("p",)])
def test_join_key_fast_path_matches_per_component_escaping(parts):
    assert join_key(*parts) == "/".join(key_component(p) for p in parts)


def test_content_key_natural_keys_unchanged():
    """cost_recorded keys are a hash of the sorted content: the value the first release computed."""
    ev = validate_line({"type": "cost_recorded", "execution_id": "e", "amount": 0.5, "category": "generation"},
                       now_micros=0)
    from ledger.events.catalog import HEADER_FIELDS, natural_key

    content = sorted((k, v) for k, v in ev.items() if k not in HEADER_FIELDS and not isinstance(v, bytes))
    assert natural_key(ev) == f"cost_recorded/e/{hashlib.sha256(repr(content).encode()).hexdigest()[:16]}"


def test_one_query_idempotency_classifies_like_before(tmp_path):
    """Duplicates by event id, conflicts by event id and by natural key, across batches of > 500."""
    lines = [{"type": "execution_opened", "execution_id": "e", "task_id": "t", "deadline": "2030-01-01T00:00:00Z",
              "policy": "p"}]
    lines += [{"type": "cost_recorded", "execution_id": "e", "amount": float(i), "category": "generation",
               "event_id": f"c{i}"} for i in range(1200)]
    with open_log(str(tmp_path / "s"), create=True) as log:
        ing = Ingestor(log, seal=None)
        assert ing.ingest_lines(enumerate(lines, 1)).appended == 1201
        again = ing.ingest_lines(enumerate(lines[600:], 1))
        assert (again.appended, again.duplicates, again.conflicts) == (0, 601, [])
        changed = dict(lines[700], amount=12345.0)  # same event id, other content
        renamed = dict(lines[5], event_id="c-new")  # same content (natural key), other event id
        rep = ing.ingest_lines(enumerate([changed, renamed], 1))
        assert [(c["event_id"], c["reason"], c["existing_position"]) for c in rep.conflicts] == [
            ("c699", "same event_id with different content", "700"),
            ("c-new", f"{submission(validate_line(renamed, now_micros=0)).natural_key} already recorded as event c4", "5"),
        ]
        assert log.size() == 1201
        more = ing.ingest_lines(enumerate([dict(lines[1], event_id="c-more", amount=9999.0)], 1))
        assert more.appended == 1 and log.size() == 1202
        last = list(log.read(start=1201))[0]
        assert last.event_id == "c-more"


def test_scaling_benchmark_runs_with_given_sizes():
    from benchmarks.bench_scaling import run

    rows = run([300, 600], ["small"])
    assert [r["name"] for r in rows] == [
        "scaling small ingest: time/event at 600 vs 300 events", "scaling small ingest: peak RSS at 600 vs 300 events",
        "scaling small replay: time/event at 600 vs 300 events", "scaling small replay: peak RSS at 600 vs 300 events"]
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in rows)


# ---------------------------------------------------------------- second round (issue 19)
_TRICKY = ["", "e1", 'q"uote\\back', "ctl\u0001\n\t\x7f", "é/ü", "\u2028\u2029", "emoji \U0001F600", "x" * 300]


def test_aad_fast_path_equals_canonical_json():
    from ledger.algorithms.canonical import canonical_json
    from ledger.log.sealing import _aad

    for ex in _TRICKY:
        for rid in _TRICKY:
            for kid in ("k-1", 'k"2', "ķ"):
                ev = {"execution_id": ex, "request_id": rid}
                assert _aad(ev, kid) == canonical_json({"execution_id": ex, "request_id": rid, "key_id": kid, "v": 1})
    # not a str: the generic encoder (same bytes as before)
    assert _aad({"execution_id": 7, "request_id": "r"}, "k") == b'{"execution_id":7,"key_id":"k","request_id":"r","v":1}'


def test_unseal_through_a_key_cache_equals_unseal(tmp_path):
    from ledger.log.sealing import KeyCache, unseal

    ks = KeyStore(tmp_path / "k.db")
    sealer = Sealer(ks, SubjectResolver("execution"))
    reqs = _requests(2) + [_odd_request()]
    sealed = [sealer.seal(ev) for ev in reqs]
    cache = KeyCache(ks)
    for plain, s in zip(reqs, sealed):
        assert s["sealed"] is not None and s["output_ids"] == b""
        assert unseal(s, cache) == unseal(s, ks) == {**plain, "sealed": None}
    victim = sealed[0]
    ks.destroy(f"execution:{victim['execution_id']}")
    assert unseal(victim, ks) is None
    assert unseal(victim, cache) is not None  # the cache answers for the rest of its batch ...
    cache.clear()
    assert unseal(victim, cache) is None  # ... and the next batch sees the destroyed key


def test_released_tree_is_freed_by_reference_counting():
    import gc

    from ledger.algorithms.prefix_match import Tree

    def tree() -> Tree:
        t = Tree()
        for i, ev in enumerate(_requests(1)[:12]):
            t.insert(ev["request_id"], i, ev["input_ids"] or b"\x01\x00\x00\x00" * (i + 1), ev["output_ids"],
                     ev["output_logprobs"], 1)
        assert len(t.nodes) > 3
        return t

    gc.disable()
    try:
        gc.collect()
        t = tree()
        del t
        assert gc.collect() > 0  # the parent <-> children cycles wait for the cyclic collector
        t = tree()
        t.release()
        del t
        assert gc.collect() == 0  # freed at once
    finally:
        gc.enable()


def test_tree_projection_with_a_tiny_cache_equals_the_default(tmp_path):
    """Evicted (released) trees are reloaded, never reused: same tables with 1 cached tree as with 64."""
    from ledger.projections.engine import ReplayEngine, canonical_dump, connect
    from ledger.projections.tree import TreeProjection

    log = open_log(str(tmp_path / "s"), create=True)
    Ingestor(log).ingest_lines(enumerate(workload.with_prefix_references(workload.generate(4, seed=5, turns=13)), 1))
    dumps = []
    for name, proj in (("big", TreeProjection()), ("tiny", TreeProjection(cache_trees=1, cache_tokens=1))):
        db = connect(tmp_path / f"{name}.db")
        ReplayEngine(log, db, [proj]).run()
        assert db.execute("SELECT COUNT(*) FROM tree_requests").fetchone()[0] > 50
        dumps.append(canonical_dump(db))
        db.close()
    assert dumps[0] == dumps[1]
    log.close()


def _old_behavior(loaded, policy_nodes, nodes):  # the first release's implementation, kept as the reference
    import numpy as np

    from ledger.projections.tree import FLAG_OUTPUT

    parts = []
    for n in nodes:
        node = loaded.nodes[n]
        lp = node.logprobs.astype(np.float64)
        ok = ((node.flags & FLAG_OUTPUT) != 0) & ~np.isnan(lp) if policy_nodes[n] else np.zeros(lp.shape[0], dtype=bool)
        obj = lp.astype(object)
        obj[~ok] = None
        parts.append(obj)
    return np.concatenate(parts).tolist() if parts else []


def test_export_fast_paths_equal_the_slow_ones():
    import random
    from types import SimpleNamespace

    import numpy as np

    from ledger.algorithms.canonical import canonical_str
    from ledger.corpus.path_records import behavior_of as _behavior, mask_json as _mask_json, member_digest, spliced_digest as _spliced_digest
    from ledger.projections.tree import FLAG_OUTPUT

    rnd = random.Random(19)
    nodes = []
    for _ in range(60):
        k = rnd.choice([0, 1, 2, 7, 40])
        flags = np.array([rnd.choice([0, FLAG_OUTPUT, FLAG_OUTPUT | 2]) for _ in range(k)], dtype=np.uint8)
        if rnd.random() < 0.3:
            flags[: k // 2] = 0  # input then output, the usual shape
        lp = np.array([rnd.choice([np.nan, -0.5, -1e-30, -float("inf"), rnd.uniform(-20, 0)]) for _ in range(k)],
                      dtype=np.float32)
        nodes.append(SimpleNamespace(logprobs=lp, flags=flags))
    loaded = SimpleNamespace(nodes=nodes)
    policy = np.array([rnd.random() < 0.7 for _ in nodes])
    for _ in range(40):
        path = rnd.sample(range(len(nodes)), rnd.randint(0, 8))
        assert _behavior(loaded, policy, path) == _old_behavior(loaded, policy, path)
        beh = _behavior(loaded, policy, path)
        mask = np.array([rnd.randint(0, 1) for _ in beh], dtype=np.uint8)
        assert _mask_json(mask) == canonical_str(mask.tolist())[1:-1]
        chunks = [_behavior(loaded, policy, [n]) for n in path]
        toks = [[rnd.randint(0, 2**32 - 1) for _ in c] for c in chunks]
        rec = {"member_id": rnd.choice(_TRICKY), "execution_id": "é", "task_id": None, "group_id": 'g"', "split": "train",
               "route": "sft", "leaf_request_id": rnd.choice(_TRICKY), "role_class": "main/task",
               "input_ids": [t for c in toks for t in c], "target_mask": mask.tolist(), "behavior_logprobs": beh,
               "loss_weight": 1 / 3, "execution_target_tokens": 3, "reward": rnd.choice([None, 0.1, 1.0]), "dummy": False,
               "outcome_scope": "branch", "task_outcome": "unverified", "digest": "ignored"}
        bodies = {"input_ids": ",".join(canonical_str(c)[1:-1] for c in toks if c),
                  "behavior_logprobs": ",".join(canonical_str(c)[1:-1] for c in chunks if c),
                  "target_mask": _mask_json(mask)}
        assert _spliced_digest(rec, bodies) == member_digest(rec)


# ----------------------------------------------------------------------------- issue 19, third round (Kafka append)
def _kafka_sub(obj: dict) -> "Submission":
    return submission(validate_line(obj, line=1, now_micros=1_760_000_000_000_000))


def _kafka_opened(ex: str, policy: str = "qwen@1"):
    return _kafka_sub({"type": "execution_opened", "execution_id": ex, "task_id": f"task-{ex}",
                       "deadline": "2030-01-01T00:00:00Z", "policy": policy})


@pytest.mark.kafka
def test_kafka_merged_winner_lookup_equals_the_two_lookups(kafka_url):
    """``_winners`` (2 index queries) == ``(_winners_by_id, _winners_by_key)`` (3 queries) on an index
    holding: first-record-wins copies, natural keys differing from their event ids, a natural key
    equal to another record's event id, and ids absent from the index."""
    from ledger.log.kafka import EXECUTIONS, GOVERNANCE, _row

    with open_log(kafka_url, create=True) as log:
        rows = [_row(EXECUTIONS, 2, 9, "k", "e1", "e1", "t", b"h1", b"d" * 32, 10),
                _row(EXECUTIONS, 1, 4, "k", "e1", "e1", "t", b"h2", b"d" * 32, 10),   # earlier copy of e1: wins
                _row(GOVERNANCE, 0, 7, "k", "e2", "nk2", "t", b"h3", b"d" * 32, 10),  # natural key != event id
                _row(EXECUTIONS, 0, 1, "k", "e3", "nk2", "t", b"h4", b"d" * 32, 10),  # later copy of nk2
                _row(EXECUTIONS, 0, 2, "k", "nk2", "nk2", "t", b"h5", b"d" * 32, 10),  # event id == another's key
                _row(EXECUTIONS, 3, 0, "k", "e4", "e1", "t", b"h6", b"d" * 32, 10)]
        log._index(rows, {}, check=False)
        cases = [(["e1", "e2", "e3", "e4", "nk2", "absent"], ["e1", "nk2", "absent", "e2"]),
                 (["e1"], ["e1"]), ([], ["nk2"]), (["nk2", "e2"], []), (["absent"], ["absent"])]
        for ids, keys in cases:
            assert log._winners(ids, keys) == (log._winners_by_id(ids), log._winners_by_key(keys))
        by_id, by_key = log._winners(*cases[0])
        assert by_id["e1"] == ((EXECUTIONS, 1, 4), "e1", "e1", b"h2")
        assert by_key["e1"] == ((EXECUTIONS, 1, 4), "e1", "e1", b"h2")
        assert by_key["nk2"] == ((GOVERNANCE, 0, 7), "e2", "nk2", b"h3")
        assert by_id["nk2"] == ((EXECUTIONS, 0, 2), "nk2", "nk2", b"h5")
        assert "absent" not in by_id and "absent" not in by_key


@pytest.mark.kafka
def test_kafka_lookups_before_the_catch_up_are_redone_when_another_writer_appended(kafka_url):
    """``append`` queries the index while ListOffsets is on the way; when the catch-up then indexes
    another writer's records, the lookups are redone: a stale writer still sees duplicates and conflicts."""
    other = kafka_url.replace("idx.db", "other.db")
    with open_log(kafka_url, create=True) as a, open_log(other) as b:
        b.append([_kafka_opened("ex-b")])  # b's index is up to date and has our own records
        pos = dict(a.append([_kafka_opened("ex-1"), _kafka_opened("ex-2")]).appended)
        res = b.append([_kafka_opened("ex-1")])  # identical: a duplicate at a's position
        assert (res.appended, res.duplicates, res.conflicts) == ([], [("execution_opened/ex-1", pos["execution_opened/ex-1"])], [])
        res = b.append([_kafka_opened("ex-2", policy="other@2")])  # same id, different content
        assert res.appended == [] and [(c.event_id, c.reason, c.existing_position) for c in res.conflicts] == [
            ("execution_opened/ex-2", "same event_id with different content", pos["execution_opened/ex-2"])]
        consumed = b.counters["records_consumed"]
        assert consumed >= 2  # a's records were read by b's catch-up
        res = b.append([_kafka_opened("ex-b")])  # no other writer since: the early lookup stands
        assert [e for e, _ in res.duplicates] == ["execution_opened/ex-b"] and res.appended == []
        assert b.counters["records_consumed"] == consumed


# ---------------------------------------------------------------- fourth round (issue 19): floors
def test_floor_storage_step_writes_exactly_what_the_embedded_log_writes(tmp_path):
    """bench_floors times the embedded log's storage work alone; it must be that work: the same
    segment bytes and the same index rows as EmbeddedLog.append for the same submissions."""
    import sqlite3

    from benchmarks.bench_floors import _index_append
    from benchmarks.bench_log import _small_events
    from ledger.log import open_log

    subs = [submission(ev) for _n, ev in _small_events(250)]
    _index_append(subs, 100, tmp_path / "floor")
    _index_append(subs, 100, tmp_path / "probed", probe=True)
    with open_log(str(tmp_path / "real"), create=True) as log:
        for i in range(0, len(subs), 100):
            assert log.append(subs[i:i + 100]).ok
    for name in ("floor", "probed", "real"):
        assert (tmp_path / name / "events.dat").read_bytes() == (tmp_path / "real" / "events.dat").read_bytes()
    rows = {}
    for name in ("floor", "probed", "real"):
        db = sqlite3.connect(tmp_path / name / "index.db")
        rows[name] = db.execute("SELECT * FROM events ORDER BY position").fetchall()
        db.close()
    assert len(rows["real"]) == 251 and rows["floor"] == rows["real"] == rows["probed"]


def test_floors_benchmark_runs_at_small_sizes():
    from benchmarks.bench_floors import large_rows, replay_rows, small_glue_rows, small_rows, tree_rows

    glue = small_glue_rows(300, 100)
    assert len(glue) == 9 and all(r["value"] > 0 for r in glue) and glue[0]["ratio"] == 1.0

    rows = small_rows(300, 100) + large_rows(4, 1024, 2) + tree_rows(2, 13) + replay_rows(2)
    assert len(rows) == 11 + 10 + 7 + 3
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in rows)
    assert [r["name"].split(":")[0] for r in rows[:11]] == [
        "ledger / zero-glue floor, 300 small events, batch 100, wall",
        "ledger / zero-glue floor, 300 small events, batch 100, CPU",
        "ledger / zero-glue floor, 300 small events, batch 100, idempotency probe counted, wall",
        "ledger / zero-glue floor, 300 small events, batch 100, idempotency probe counted, CPU"] + [
        "floor, 300 small events, batch 100"] * 6 + ["ledger, 300 small events, batch 100"]
    assert [r["target"] for r in rows[:4]] == [0.9] * 4 and [r["target"] for r in rows[11:13]] == [0.8, 0.8]


def test_sqlite_floor_writes_exactly_the_replayed_tables_and_the_replay_floor_runs(tmp_path):
    """The replay floors' SQLite step writes the state a replay derived, row for row (so it times the
    real tables, written once); every step of ``bench_replay``'s floor runs on a small store."""
    import sqlite3

    from benchmarks.bench_floors import sqlite_floor
    from benchmarks.bench_replay import build_store, floor_steps, replay
    from ledger.projections.engine import canonical_dump

    store, n = build_store(tmp_path, 2)
    replay(store, tmp_path / "r.db")
    steps = floor_steps(store, tmp_path / "r.db", tmp_path)
    assert len(steps) == 4 and all(t > 0 for t in steps.values())
    assert sqlite_floor(tmp_path / "r.db", tmp_path, 1, with_close=False) > 0
    dumps = []
    for name in ("r.db", "floor-0.db"):
        db = sqlite3.connect(tmp_path / name)
        dumps.append(canonical_dump(db))
        db.close()
    assert n > 100 and "tree_nodes" in dumps[0] and dumps[0] == dumps[1]


def test_write_all_survives_short_writes_and_more_buffers_than_iov_max(tmp_path, monkeypatch):
    """The segment append writes the batch with writev (no joined copy); short writes (a signal, a
    full pipe, a file system that splits) and batches over IOV_MAX buffers must give the same bytes."""
    import os
    import random

    import ledger.log.embedded as emb

    rng = random.Random(5)
    values = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))) for _ in range(2500)]
    real_writev, real_write = os.writev, os.write
    calls = {"writev": 0, "write": 0}

    def short_writev(fd, bufs):
        calls["writev"] += 1
        assert len(bufs) <= emb._IOV_MAX
        data = b"".join(bytes(b) for b in bufs)
        return real_write(fd, data[:rng.randrange(0, len(data) + 1)]) if data else 0

    def short_write(fd, view):
        calls["write"] += 1
        return real_write(fd, bytes(view)[:max(1, rng.randrange(0, len(view) + 1))])

    fd = os.open(tmp_path / "seg", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with monkeypatch.context() as m:  # patched only around the call (os is the process-wide module)
            m.setattr(emb.os, "writev", short_writev)
            m.setattr(emb.os, "write", short_write)
            emb.write_all(fd, values)
    finally:
        os.close(fd)
    assert (tmp_path / "seg").read_bytes() == b"".join(values)
    assert calls["writev"] > 3 and calls["write"] > 0  # short writes happened and were finished


class _Untouchable(dict):
    """An event or database that fails the test when read: a projection acting on an event type it
    does not declare in ``event_types`` touches one of them."""

    def __getattr__(self, name):
        raise AssertionError(f"touched {name}")

    def __getitem__(self, key):
        raise AssertionError(f"read field {key!r}")

    def get(self, key, default=None):
        raise AssertionError(f"read field {key!r}")


@pytest.mark.parametrize("index", range(13))
def test_a_projection_declaring_event_types_acts_on_no_other_type(index):
    """The engine calls ``apply`` only for a projection's declared ``event_types``: for every other
    catalog type, ``apply`` reads no field, runs no SQL and changes no state of its own."""
    import copy

    from ledger.events.catalog import EVENT_TYPES
    from ledger.projections.engine import Applied
    from ledger.projections.registry import all_projections

    projs = all_projections()
    assert len(projs) == 13
    p = projs[index]
    declared = getattr(p, "event_types", None)
    if declared is None:
        pytest.skip(f"{p.name}: called for every event")
    assert declared <= set(EVENT_TYPES)
    for et in sorted(set(EVENT_TYPES) - declared):
        item = Applied.__new__(Applied)
        item.event, item.record, item.type = _Untouchable(), None, et
        before = copy.deepcopy({k: v for k, v in vars(p).items() if k != "keystore"})
        p.apply(_Untouchable(), item)
        assert {k: v for k, v in vars(p).items() if k != "keystore"} == before, (p.name, et)


def test_replay_dispatching_by_event_type_equals_calling_every_projection(tmp_path):
    """Same tables, byte for byte, with the engine's dispatch by event type as without it."""
    from ledger.projections.engine import ReplayEngine, canonical_dump, connect
    from ledger.projections.registry import all_projections

    log = open_log(str(tmp_path / "s"), create=True)
    Ingestor(log).ingest_lines(enumerate(workload.with_prefix_references(workload.generate(5, seed=3, turns=13)), 1))
    dumps = []
    for dispatch in (True, False):
        db = connect(tmp_path / f"{dispatch}.db")
        stats = ReplayEngine(log, db, all_projections(), dispatch=dispatch).run()
        assert stats.applied > 100 and not stats.dead_letters
        dumps.append(canonical_dump(db))
        db.close()
    assert dumps[0] == dumps[1]
    log.close()


def test_replay_batches_capped_by_bytes_give_the_same_tables(tmp_path, monkeypatch):
    """A run's transactions end at ``BATCH`` events or ``BATCH_BYTES`` of values: one event per
    transaction (a 1-byte cap) gives the same tables as the default batches."""
    import ledger.projections.engine as engine_mod
    from ledger.projections.engine import ReplayEngine, canonical_dump, connect
    from ledger.projections.registry import all_projections

    log = open_log(str(tmp_path / "s"), create=True)
    Ingestor(log).ingest_lines(enumerate(workload.with_prefix_references(workload.generate(3, seed=8, turns=13)), 1))
    dumps, commits = [], []
    for cap in (engine_mod.BATCH_BYTES, 1):
        monkeypatch.setattr(engine_mod, "BATCH_BYTES", cap)
        db = connect(tmp_path / f"{cap}.db")
        eng = ReplayEngine(log, db, all_projections())
        calls = []
        eng._apply_batch = lambda where, batch, stats, _real=eng._apply_batch, **kw: (calls.append(len(batch)),
                                                                                       _real(where, batch, stats, **kw))
        eng.run()
        dumps.append(canonical_dump(db))
        commits.append(calls)
        db.close()
    assert dumps[0] == dumps[1]
    assert len(commits[0]) == 1 and set(commits[1]) == {1} and len(commits[1]) == commits[0][0]
    log.close()


def test_the_cyclic_collector_waits_for_the_end_of_a_batch_and_resumes_after_it(tmp_path):
    """Inside a batch's transaction the engine pauses Python's cyclic collector; it is back on after the
    batch, after a batch that failed, and stays off for a caller that had turned it off."""
    import gc

    from ledger.projections.engine import ReplayEngine, connect

    class Probe:
        name = "probe"

        def __init__(self, fail_at=None):
            self.seen, self.fail_at = [], fail_at

        def create(self, db):
            pass

        def apply(self, db, item):
            self.seen.append(gc.isenabled())
            if len(self.seen) == self.fail_at:
                raise RuntimeError("boom")

        def finish(self, db):
            pass

        def reset(self):
            pass

    log = open_log(str(tmp_path / "s"), create=True)
    Ingestor(log).ingest_lines(enumerate(workload.generate(1, seed=3, turns=13), 1))
    assert gc.isenabled()
    probe = Probe()
    ReplayEngine(log, connect(tmp_path / "a.db"), [probe]).run()
    assert probe.seen and not any(probe.seen) and gc.isenabled()
    failing = Probe(fail_at=2)
    with pytest.raises(RuntimeError):
        ReplayEngine(log, connect(tmp_path / "b.db"), [failing]).run()
    assert gc.isenabled()
    gc.disable()
    try:
        ReplayEngine(log, connect(tmp_path / "c.db"), [Probe()]).run()
        assert not gc.isenabled()
    finally:
        gc.enable()
    log.close()


# ---------------------------------------------------------------- fifth round (issue 33): ingest glue
def _reference_submissions(pairs, codec):
    """What ``Ingestor.submit`` did per event before the batch encoder (the reference path)."""
    from ledger.events.codec import CodecError

    out, failed = [], []
    for i, (ev, plain) in enumerate(pairs):
        try:
            out.append(submission(ev, codec, plain=plain))
        except CodecError as exc:
            failed.append((i, exc))
    return out, failed


def _mixed_events() -> list[dict]:
    """Every event type of a realistic execution (prefix-referenced requests), small events and an odd request."""
    lines = list(workload.with_prefix_references(workload.generate(2, seed=33, turns=13)))
    lines += [{"type": "cost_recorded", "execution_id": lines[1]["execution_id"], "amount": 0.5 * i,
               "category": "generation"} for i in range(40)]
    return [validate_line(line, line=i, now_micros=1_700_000_000_000_000) for i, line in enumerate(lines, 1)]


@pytest.mark.parametrize("legacy", [False, True])
def test_batch_submissions_equal_one_submission_per_event(tmp_path, legacy):
    """``submissions`` (the batch encoder) gives the submissions ``submission`` gives, field for field and
    byte for byte: plain events, requests sealed with their plain copies, both fingerprint orders."""
    from ledger.events.codec import Codec
    from ledger.producers.ingest import submissions

    codec = Codec(legacy_fingerprint_order=True) if legacy else default_codec()
    sealer = Sealer(KeyStore(tmp_path / "k.db"), SubjectResolver("execution"))
    events = _mixed_events() + [_odd_request()]
    pairs = [(ev, ev) for ev in events]
    pairs += [(sealer.seal(ev), ev) for ev in events if ev["event_type"] == "request"]
    assert len({ev["event_type"] for ev, _p in pairs}) >= 5 and any(s is not p for s, p in pairs)
    fast, failed = submissions(pairs, codec)
    assert failed == [] and fast == _reference_submissions(pairs, codec)[0]
    assert [s.value for s in fast] == [codec.encode(s) for s, _p in pairs]


def test_batch_submissions_name_what_the_schema_cannot_hold_like_the_reference():
    from ledger.producers.ingest import submissions

    good = _mixed_events()[:3]
    bad = dict(good[1], execution_id=12345)  # not a string: fastavro refuses it
    pairs = [(ev, ev) for ev in (good[0], bad, good[2], bad)]
    fast, failed = submissions(pairs, default_codec())
    ref, ref_failed = _reference_submissions(pairs, default_codec())
    assert fast == ref and len(fast) == 2
    assert [(i, str(e)) for i, e in failed] == [(i, str(e)) for i, e in ref_failed] and [i for i, _e in failed] == [1, 3]


def test_ingest_fast_path_writes_the_bytes_the_reference_path_wrote(tmp_path, monkeypatch):
    """Same input, one key store: the log written through the batch encoder, the per-batch shortcuts
    (no seal step or lock-time re-check without requests, the opened-execution memo) and the embedded
    log's one-query ``event_ids`` is byte for byte the log the per-event reference path writes."""
    import sqlite3

    import ledger.producers.ingest as ingest_mod
    from ledger.log.base import Log
    from ledger.log.embedded import EmbeddedLog

    events = _mixed_events()
    keys = KeyStore(tmp_path / "keys.db")

    def ingest(name: str) -> tuple[bytes, list]:
        with open_log(str(tmp_path / name), create=True) as log:
            ing = Ingestor(log, keystore=keys)
            for i in range(0, len(events), 37):  # batches mixing types; some with no request
                rep = ing.submit([(n, dict(ev)) for n, ev in enumerate(events[i:i + 37], i + 1)])
                assert rep.appended == len(events[i:i + 37])
            again = ing.submit([(1, dict(events[5])), (2, dict(events[-1]))])  # retries: duplicates
            assert (again.appended, again.duplicates) == (0, 2)
        db = sqlite3.connect(tmp_path / name / "index.db")
        rows = db.execute("SELECT * FROM events ORDER BY position").fetchall()
        db.close()
        return (tmp_path / name / "events.dat").read_bytes(), rows

    fast = ingest("fast")
    monkeypatch.setattr(ingest_mod, "submissions", _reference_submissions)
    monkeypatch.setattr(ingest_mod, "_OPEN_IS_ALL", frozenset())
    monkeypatch.setattr(EmbeddedLog, "event_ids", Log.event_ids)
    reference = ingest("reference")
    keys.close()
    assert fast == reference and len(fast[1]) == len(events)


def test_embedded_event_ids_equal_one_lookup_per_key(tmp_path):
    from ledger.log.base import Log

    with open_log(str(tmp_path / "s"), create=True) as log:
        Ingestor(log, seal=None).submit([(n, ev) for n, ev in enumerate(_mixed_events(), 1)])
        keys = [s.natural_key for s in (submission(ev) for ev in _mixed_events()[::3])] + ["request/none/none", "x/%2F"]
        keys += [f"k{i}" for i in range(600)]  # more than one query's 500
        assert log.event_ids(keys) == Log.event_ids(log, keys) and len(log.event_ids(keys)) == len(_mixed_events()[::3])


def test_verify_deep_benchmark_runs_at_a_small_size(tmp_path):
    """``bench_verify_deep`` builds, projects and publishes a store, then times verify --deep against a replay."""
    from benchmarks.bench_verify_deep import build, measure

    store, manifest = build(2, tmp_path / "v")
    rows = measure(store, manifest, tmp_path, repeat=1)
    assert len(rows) == 2 and all(r["value"] > 0 and r["baseline"] > 0 for r in rows)
    assert rows[0]["name"].startswith("manifest verify --deep, ")


def test_follow_benchmark_sees_every_batch_applied(kafka_broker, tmp_path):
    """``bench_follow``: a producer process, ``ledger project --follow``, every batch's positions seen applied."""
    from benchmarks.bench_follow import measure

    rows = measure(kafka_broker, tmp_path, seconds=1.0, rate=4)
    assert [r["name"].split(", p")[0] for r in rows] == ["project --follow (Kafka): append returned -> applied"] * 2
    assert all(r["value"] >= 0 and r["baseline"] > 0 for r in rows) and rows[0]["value"] <= rows[1]["value"]
    assert "applied" in rows[0]["note"] and "rejected 0, dead letters 0" in rows[0]["note"]


_ids = st.sampled_from(["a", "b", "c", "d", "e"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_ids, _ids, st.sampled_from([b"1", b"2"])), max_size=8),
       st.lists(_ids, max_size=2), st.lists(_ids, max_size=2))
def test_classify_and_settle_shortcuts_equal_the_full_loop(items, on_log_ids, on_log_keys):
    """Invariant (issue 33): the shortcut taken when nothing is on the log and nothing repeats in the batch,
    and ``settle`` without duplicates, give exactly what the per-submission loop gives, for any batch."""
    import ledger.log.base as base
    from ledger.log.base import Existing, Submission, classify, settle

    batch = [Submission(e, "cost_recorded", "x", f"k/{k}", h, False, h, h) for e, k, h in items]
    by_id = {e: Existing(str(i), e, b"1") for i, e in enumerate(on_log_ids)}
    by_key = {f"k/{k}": Existing(str(i), "z", b"1") for i, k in enumerate(on_log_keys)}
    fast_new, fast = classify(batch, by_id, by_key)
    real = base._all_distinct
    base._all_distinct = lambda _batch: False  # the full loop
    try:
        slow_new, slow = classify(batch, by_id, by_key)
    finally:
        base._all_distinct = real
    assert fast_new == slow_new and fast == slow
    if not fast.conflicts:
        positions = [str(100 + i) for i in range(len(fast_new))]
        settled = settle(fast, fast_new, positions)
        first = dict(zip((s.event_id for s in fast_new), positions))
        assert settled.appended == list(zip((s.event_id for s in fast_new), positions))
        assert settled.duplicates == [(e, first.get(e, p) if p == "batch" else p) for e, p in slow.duplicates]


def test_benchmark_clock_cpu_mode_counts_work_not_waiting(monkeypatch, capsys):
    import subprocess
    import sys
    import time

    from benchmarks import __main__ as bench_main
    from benchmarks.common import CLOCK_ENV, clock_name, now, print_table, row, timed

    monkeypatch.delenv(CLOCK_ENV, raising=False)
    assert clock_name() == "wall"
    assert timed(lambda: time.sleep(0.05), 1) >= 0.05  # wall by default: waiting counts
    monkeypatch.setenv(CLOCK_ENV, "cpu")
    assert timed(lambda: time.sleep(0.05), 1) < 0.03  # CPU: waiting does not
    assert timed(lambda: sum(range(2_000_000)), 1) > 0.005  # work does
    t0 = now()  # a waited-for child's CPU counts
    subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)
    assert now() - t0 > 0.02
    print_table([row("x", 2.0, 1.0, "u")])
    assert capsys.readouterr().out.startswith("clock: cpu")
    monkeypatch.setenv(CLOCK_ENV, "bogus")
    with pytest.raises(ValueError, match=CLOCK_ENV):
        now()
    monkeypatch.delenv(CLOCK_ENV)
    monkeypatch.setattr(bench_main, "print_table", lambda rows: None)
    bench_main.main(["--cpu", "bench_no_such_module"])  # the flag sets the clock for the run
    assert clock_name() == "cpu"


def test_embedded_read_builds_the_records_the_dataclass_constructor_builds(tmp_path):
    import dataclasses
    import os

    from ledger.log.base import LogRecord

    small = [submission(validate_line({"type": "cost_recorded", "execution_id": f"ex-{i % 7}", "amount": 0.5 * i,
                                       "category": "generation", "occurred_at": "2025-06-01T00:00:00Z"},
                                      line=i + 1, now_micros=0)) for i in range(2_100)]
    reqs = [submission(ev) for ev in _requests(2)]
    with open_log(str(tmp_path / "s"), create=True) as log:
        assert log.append(small[:1_000] + reqs + small[1_000:]).ok
        rows = log._db.execute("SELECT position, file_offset, length, key, event_id, event_type, digest FROM events "
                               "ORDER BY position").fetchall()
        fd = os.open(tmp_path / "s" / "events.dat", os.O_RDONLY)
        try:  # the reference: one constructor call and one pread per event
            ref = [LogRecord("log", 0, p, k, e, t, os.pread(fd, n, off), d) for p, off, n, k, e, t, d in rows]
        finally:
            os.close(fd)
        assert len(ref) > 2_000 + len(reqs) - 1  # more than one 2,000-row chunk
        for start, end in ((0, None), (3, 2_050), (1_999, 2_001), (len(ref) - 1, None), (5, 5)):
            got = list(log.read(("log", 0), start, end))
            want = ref[start:end]
            assert got == want and [hash(r) for r in got] == [hash(r) for r in want]
            assert [repr(r) for r in got] == [repr(r) for r in want]
            assert [list(vars(r).items()) for r in got] == [list(vars(r).items()) for r in want]
            assert all(type(r) is LogRecord and type(r.value) is bytes and r.where == ("log", 0) for r in got)
        rec = next(iter(log.read()))
        assert dataclasses.asdict(rec) == dataclasses.asdict(ref[0]) and dataclasses.replace(rec) == rec
        with pytest.raises(dataclasses.FrozenInstanceError):
            rec.value = b""


# ----------------------------------------------------------------------------- issue 33, second round (Kafka append)
@pytest.mark.kafka
def test_kafka_failed_commit_leaves_no_index_rows(kafka_url, monkeypatch):
    """No index row claims an event of a batch whose Kafka commit failed (our own records are indexed
    only after the commit; writing them while the commit is in flight was tried and reverted)."""
    from confluent_kafka import KafkaError, KafkaException

    from ledger.log import LogError

    def state(log) -> tuple:
        return ([r for r in log._db.execute("SELECT * FROM records ORDER BY stream, partition, offset")],
                [r for r in log._db.execute("SELECT * FROM cursors ORDER BY stream, partition")],
                dict(log._own_tail), list(log._values.items()))

    with open_log(kafka_url, create=True) as log:
        assert log.append([_kafka_opened("ex-0")]).ok
        assert log.lookup("execution_opened/none") is None  # the catch-up an append starts with
        before = state(log)

        def failed_commit(producer):
            raise KafkaException(KafkaError(KafkaError._FAIL, "EndTxn lost"))

        monkeypatch.setattr(log, "_commit", failed_commit)
        with pytest.raises(LogError, match="nothing committed.*EndTxn lost"):
            log.append([_kafka_opened("ex-1"), _kafka_opened("ex-2")])
        assert state(log) == before


def _existing_deduplicated(db, batch):
    """The embedded log's idempotency probe before issue 33's fifth round: the IN lists de-duplicated first."""
    from ledger.log.base import Existing

    by_id, by_key = {}, {}
    for i in range(0, len(batch), 500):
        chunk = batch[i:i + 500]
        ids = list(dict.fromkeys(s.event_id for s in chunk))
        keys = list(dict.fromkeys(s.natural_key for s in chunk))
        q = (f"SELECT event_id, natural_key, position, content_hash FROM events WHERE event_id IN "
             f"({','.join('?' * len(ids))}) OR natural_key IN ({','.join('?' * len(keys))})")
        for eid, nk, pos, chash in db.execute(q, ids + keys):
            old = Existing(str(pos), eid, chash)
            if eid in set(ids):
                by_id[eid] = old
            if nk in set(keys):
                by_key[nk] = old
    return by_id, by_key


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_ids, _ids), max_size=5, unique_by=lambda t: t[0]),
       st.lists(st.tuples(_ids, _ids), max_size=700), st.sampled_from([b"1", b"2"]))
def test_idempotency_probe_without_deduplicated_lists_finds_what_it_found(on_log, batch, h):
    """Invariant (issue 33): ``embedded.existing`` (IN lists with repeats, as many as the batch, more than one
    query's 500) returns exactly what the probe with de-duplicated lists returned, for any index holding repeated
    natural keys (a store written before a key's definition changed) and any batch with repeats."""
    import sqlite3

    from ledger.log.base import Submission
    from ledger.log.embedded import _SCHEMA, existing

    db = sqlite3.connect(":memory:")
    db.executescript(_SCHEMA)
    db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?,?)",
                   [(p, 0, 0, "x", e, f"k/{k}", "cost_recorded", 0, h, h)
                    for p, (e, k) in enumerate(on_log)])
    subs = [Submission(e, "cost_recorded", "x", f"k/{k}", h, False, h, h) for e, k in batch]
    assert existing(db, subs) == _existing_deduplicated(db, subs)


@pytest.mark.parametrize("batch", [1, 7])
def test_request_paths_kept_as_parts_read_back_as_the_full_path(tmp_path, batch):
    """Issue 33: a request's path is kept as its parts until a reference reads it.  Every path ``request_path``
    returns (across batches, through prefix references to whole and partial paths, sealed) is the request's
    full input + output; one no request referenced is still its parts, joined when first read."""
    from ledger.algorithms.tokens import pack_tokens

    full = list(workload.generate(2, seed=5, turns=13))
    expected = {(ev["execution_id"], ev["request_id"]): pack_tokens(ev["input_ids"]) + pack_tokens(ev["output_ids"])
                for ev in full if ev["type"] == "request"}
    lines = list(workload.with_prefix_references(full))
    assert any(ev.get("input_prefix") for ev in lines if ev["type"] == "request")
    with open_log(str(tmp_path / "s"), create=True) as log:
        ing = Ingestor(log, cache_requests=1000)
        for i in range(0, len(lines), batch):
            assert ing.ingest_lines(list(enumerate(lines[i:i + batch], i + 1))).appended > 0
        last = list(expected)[-1]  # the last request: referenced by none
        assert type(ing._paths[last]) is tuple
        assert {key: ing.request_path(*key) for key in expected} == expected
        assert type(ing._paths[last]) is bytes
        fresh = Ingestor(log)  # nothing cached: read from the log, opened with the key store
        assert {key: fresh.request_path(*key) for key in expected} == expected
        ing.close()
        fresh.close()
