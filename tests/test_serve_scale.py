"""``ledger serve`` on large stores (issue 32, second round): what keeps the route, status, splits and
manifest pages bounded, checked for what they show (the times are benchmarks/bench_serve.py's).

The ``ledger serve`` benchmark workload (400 executions: split-rejected and erased ones over 25
collection runs, manifest v1 published) is served in-process through the ASGI application."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.bench_serve import build, ensure_manifest, get
from ledger.corpus.integrity import partition_head, tree_for
from ledger.log import open_log

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    paths = build(400, tmp_path_factory.mktemp("serve-scale"))
    ensure_manifest(paths)
    return paths


@pytest.fixture(scope="module")
def app(store):
    from ledger.view.app import make_app

    return make_app(store)


def _json(app, path: str):
    status, body = get(app, path)
    assert status == 200, (path, body[:300])
    return json.loads(body)


def test_log_heads_from_kept_frontiers_are_the_merkle_roots(store):
    with open_log(store.url) as log:
        (where,) = log.partitions()
        end = log.end_offsets()[where]
        frontiers: dict = {}
        for cut in (0, 1, 2, 7, 64, end // 3, end - 1, end, end // 2):  # growing, then a smaller size (recomputed)
            assert partition_head(log, where, cut, frontiers) == (cut, tree_for(log, where, cut).root())
        kept = frontiers[where]
        partition_head(log, where, end, frontiers)
        assert kept.size == end // 2  # a kept frontier is replaced, never extended in place


def test_status_page_head_follows_appends(store, app):
    from ledger.events.signing import Trust
    from ledger.producers.ingest import Ingestor

    first = _json(app, "/api")["log"]["head"]
    with open_log(store.url) as log:
        Ingestor(log, Trust.load(store.trust)).ingest_lines([(1, {"type": "task_registered", "task_id": "late-task", "source": "src-9"})])
        (where,) = log.partitions()
        want = tree_for(log, where).root().hex()
    (head,) = _json(app, "/api")["log"]["head"].values()
    assert head == {"size": next(iter(first.values()))["size"] + 1, "root": want}
    assert get(app, "/")[0] == 200


def test_route_page_lists_its_first_rows_and_counts_every_row(store, app):
    from ledger.view.app import ROUTE_ROWS

    doc = _json(app, "/api/routes/rl")
    assert doc["admission_count"] == 400 and len(doc["admission"]) == ROUTE_ROWS == 100
    assert [r["execution_id"] for r in doc["admission"]] == [f"ex-{i:06d}" for i in range(100)]
    assert doc["unresolved_count"] == 0 and doc["unresolved"] == []
    listed = {r["execution_id"] for r in doc["admission"]}
    assert doc["erased_executions"] and set(doc["erased_executions"]) <= listed
    assert doc["accounting"]["attempts"] == 400 and "/api/executions?route=rl" in doc["listed"]
    _, body = get(app, "/routes/rl")
    text = body.decode()
    assert "Every execution (400)" in text and "… 300 more" in text and text.count('class="tag erased"') == \
        len(doc["erased_executions"])


def test_splits_page_runs_the_check_on_request(store, app):
    assert _json(app, "/api/splits")["check"] is None
    _, body = get(app, "/splits")
    assert re.search(r'href="/splits\?check=yes"', body.decode())
    checked = _json(app, "/api/splits?check=yes")["check"]
    assert checked is not None and checked["ok"] is True
    status, body = get(app, "/splits?check=maybe")
    assert status == 400 and b"check must be yes" in body


def test_manifest_pages_read_an_archive_once_per_file_version(store, app):
    from ledger.corpus.publish import archive_path
    from ledger.corpus import archive_cache as serve_archives

    serve_archives.clear()  # earlier tests in this process may have cached other stores' archives
    pages = [_json(app, "/api/manifests/view?route=rl&version=1") for _ in range(2)]
    assert pages[0] == pages[1] and pages[0]["authenticated"] is True
    assert len(pages[0]["manifest"]["members"]) == pages[0]["publication"]["size"]
    path = archive_path(store, "rl", 1)
    text = open(path, encoding="utf-8").read()
    with open(path, "w", encoding="utf-8") as fh:  # a changed archive is read again: now it does not authenticate
        fh.write(text.replace('"policy-team"', '"someone-else"', 1))
    try:
        doc = _json(app, "/api/manifests/view?route=rl&version=1")
        assert doc["authenticated"] is False and "does not match" in doc["problem"]
    finally:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    assert _json(app, "/api/manifests")["manifests"][0]["withdrawn_since"] == pages[0]["withdrawn_since"]["count"]
