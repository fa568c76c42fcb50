"""Caches `ledger serve` and `ledger status` keep beside a store so that a new process's first
request is fast (issue 32): each partition's Merkle frontier at its last signed checkpoint
(``frontiers.json``, written by ``ledger log head``), and what reading a manifest archive found
(``archive-cache.db``, keyed by the SHA-256 of the archive's bytes).  A frontier is used only at a
checkpoint the store's key signed, a cached archive answer only for the very bytes read; a changed
file, a truncated log or a foreign signature makes them ignored, never believed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ledger.algorithms import merkle
from ledger.cli import main
from ledger.corpus import integrity
from ledger.log import open_log
from ledger.log.paths import store_paths
from tests.test_checkpoint_origin import _events as checkpoint_origin_events


def _run(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().out


def _events(tmp_path: Path, first: int, n: int) -> str:
    return checkpoint_origin_events(tmp_path, n, first)


def _store(tmp_path: Path, capsys, n: int = 5) -> str:
    s = str(tmp_path / "store")
    assert _run(capsys, "--store", s, "init")[0] == 0
    assert _run(capsys, "--store", s, "ingest", _events(tmp_path, 0, n))[0] == 0
    return s


def _saved(s: str) -> dict:
    with open_log(s) as log:
        return {w: (r.size, r.root()) for w, r in integrity.store_frontiers(log, store_paths(s)).items()}


def _true_head(s: str) -> dict:
    with open_log(s) as log:
        (where,) = log.partitions()
        levels = integrity.tree_for(log, where)
        return {"size": levels.size, "root": levels.root().hex()}


def _status_head(capsys, s: str) -> dict:
    code, out = _run(capsys, "--store", s, "status", "--json")
    assert code == 0
    return json.loads(out)["log"]["head"]["log:0"]


def test_log_head_saves_the_frontier_and_status_extends_it(tmp_path, capsys, monkeypatch):
    s = _store(tmp_path, capsys)
    assert _saved(s) == {}  # no checkpoint yet: nothing saved
    assert _run(capsys, "--store", s, "log", "head")[0] == 0
    assert _saved(s) == {("log", 0): (10, bytes.fromhex(_true_head(s)["root"]))}
    assert _run(capsys, "--store", s, "ingest", _events(tmp_path, 5, 2))[0] == 0
    want, starts = _true_head(s), []
    real = integrity.partition_digests
    monkeypatch.setattr(integrity, "partition_digests",
                        lambda log, where, end=None, start=0: starts.append(start) or real(log, where, end, start))
    assert _status_head(capsys, s) == want and want["size"] == 14
    assert starts == [10]  # only the 4 events after the signed checkpoint were hashed


def test_a_changed_frontier_file_is_ignored(tmp_path, capsys):
    s = _store(tmp_path, capsys)
    assert _run(capsys, "--store", s, "log", "head")[0] == 0
    path = store_paths(s).frontiers
    saved = json.loads(path.read_text())
    forged = {"log:0": {"size": 10, "frontier": ("ab" * 32) + saved["log:0"]["frontier"][64:]}}
    path.write_text(json.dumps(forged))
    assert _saved(s) == {}
    assert _status_head(capsys, s) == _true_head(s)
    # a genuine frontier, but at a size no signed checkpoint names
    with open_log(s) as log:
        nine = integrity.tree_for(log, ("log", 0)).frontier(9)
    integrity.save_frontiers(path, {("log", 0): nine})
    assert _saved(s) == {}
    for junk in ("", "[]", "{\"log:0\": {\"size\": \"10\"}}", "{\"log:0\": {\"size\": 10, \"frontier\": \"zz\"}}"):
        path.write_text(junk)
        assert _saved(s) == {} and _status_head(capsys, s) == _true_head(s)


def test_a_checkpoint_not_signed_by_the_store_key_is_not_trusted(tmp_path, capsys):
    from ledger.events.signing import new_private_key

    s = _store(tmp_path, capsys)
    p = store_paths(s)
    with open_log(s) as log:  # a checkpoint recorded by someone else's key, with the frontier saved
        integrity.log_heads(log, new_private_key(), p.checkpoint_origin.read_text().strip(),
                            record=p.checkpoints, frontiers=p.frontiers)
    assert p.frontiers.exists() and _saved(s) == {}


def test_a_truncated_log_ignores_a_frontier_beyond_its_end(tmp_path, capsys):
    s = _store(tmp_path, capsys, n=2)
    shorter = tmp_path / "shorter"
    shutil.copytree(s, shorter)  # the log as it was at 4 events
    assert _run(capsys, "--store", s, "ingest", _events(tmp_path, 2, 3))[0] == 0
    assert _run(capsys, "--store", s, "log", "head")[0] == 0
    for name in ("frontiers.json", "checkpoints.jsonl"):  # the longer log's checkpoint and frontier
        shutil.copy(Path(s) / name, shorter / name)
    assert _saved(str(shorter)) == {}
    assert _status_head(capsys, str(shorter)) == _true_head(str(shorter)) and _true_head(str(shorter))["size"] == 4
    assert merkle.CompactRange.from_bytes(10, bytes.fromhex(json.loads(
        (shorter / "frontiers.json").read_text())["log:0"]["frontier"])).size == 10


# ------------------------------------------------------------------ manifest archives (archive-cache.db)
@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from benchmarks.bench_serve import build, ensure_manifest

    paths = build(40, tmp_path_factory.mktemp("archives"))
    ensure_manifest(paths)
    return paths


def _api(paths, page: str):
    from benchmarks.bench_serve import get
    from ledger.corpus import archive_cache as serve_archives
    from ledger.view.app import make_app

    serve_archives.clear()  # a new server process: nothing read yet
    status, body = get(make_app(paths), page)
    assert status == 200, body[:300]
    return json.loads(body)


VIEW, LIST, CROISSANT = "/api/manifests/view?route=rl&version=1", "/api/manifests", "/manifests/croissant?route=rl&version=1"


def test_publish_records_its_archive_so_a_first_server_does_not_rehash_it(published, monkeypatch):
    from ledger.corpus import manifest as M

    assert published.archive_cache.exists()  # written by `ledger manifest publish` (bench_serve.ensure_manifest)
    monkeypatch.setattr(M, "document_sha256", lambda doc: pytest.fail("re-hashed an archive publish recorded"))
    doc = _api(published, VIEW)
    assert doc["authenticated"] is True and doc["problem"] is None
    assert _api(published, LIST)["manifests"][0]["withdrawn_since"] == doc["withdrawn_since"]["count"]


def test_a_new_server_uses_the_cache_for_these_bytes_only(published, monkeypatch):
    from ledger.corpus import manifest as M

    if published.archive_cache.exists():
        published.archive_cache.unlink()
    first = {page: _api(published, page) for page in (VIEW, LIST, CROISSANT)}
    assert first[VIEW]["authenticated"] is True and published.archive_cache.exists()
    assert first[LIST]["manifests"][0]["withdrawn_since"] == first[VIEW]["withdrawn_since"]["count"]
    monkeypatch.setattr(M, "document_sha256", lambda doc: pytest.fail("re-hashed an archive the cache knows"))
    assert {page: _api(published, page) for page in (VIEW, LIST, CROISSANT)} == first


def test_a_changed_archive_is_hashed_again_and_not_authenticated(published):
    from ledger.corpus.publish import archive_path

    assert _api(published, VIEW)["authenticated"] is True  # cached
    path = archive_path(published, "rl", 1)
    before, st = path.read_bytes(), path.stat()
    at = before.index(b'"policy-team"')
    with open(path, "r+b") as fh:  # same size, same inode, same mtime: only the bytes differ
        fh.seek(at + 1)
        fh.write(b"P")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        assert (path.stat().st_size, path.stat().st_ino, path.stat().st_mtime_ns) == (st.st_size, st.st_ino, st.st_mtime_ns)
        doc = _api(published, VIEW)
        assert doc["authenticated"] is False and "does not match" in doc["problem"]
    finally:
        path.write_bytes(before)
    assert _api(published, VIEW)["authenticated"] is True


def test_an_unreadable_cache_is_no_cache(published):
    from ledger.corpus.publish import archive_path

    published.archive_cache.write_bytes(b"not a database")
    doc = _api(published, VIEW)
    assert doc["authenticated"] is True and _api(published, LIST)["manifests"][0]["withdrawn_since"] is not None
    archive_path(published, "rl", 1).rename(archive_path(published, "rl", 1).with_suffix(".gone"))
    try:
        assert _api(published, LIST)["manifests"][0]["withdrawn_since"] is None
    finally:
        archive_path(published, "rl", 1).with_suffix(".gone").rename(archive_path(published, "rl", 1))
        published.archive_cache.unlink()
