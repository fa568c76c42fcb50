"""``ledger serve`` list pages on a large store (issue 32 item 4): every page < 1 s at 100,000 executions.

Workload: :mod:`workloads.serve_store` (small executions over 25 collection runs, a quarter as many
tasks, one source withdrawn with erase), ingested and projected.  Each page is requested through
the ASGI application in-process (no sockets), best of ``REPEAT``; the baseline is the same page
on a store of ``SMALL`` executions, so the ratio shows how a page's cost grows with the store
(SQL paging: it should stay far below the 100x growth of the store).  ``LEDGER_BENCH_SERVE_EXECUTIONS``
overrides the large size (default 100,000), ``LEDGER_BENCH_SERVE_PAGES`` (comma-separated) the pages; ``LEDGER_BENCH_SERVE_STORES=SMALL_DIR,LARGE_DIR`` measures
stores built before (``build``: the 100,000-execution store takes ~10 minutes to ingest and project
on a loaded 2-core machine).  The execution page's first request loads the tokenizer once (~0.9 s),
the status page's first request hashes the whole log once (its Merkle frontiers are then kept);
the best of ``REPEAT`` is reported, and the first request beside it.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from .common import print_table, row, signed_store

N = int(os.environ.get("LEDGER_BENCH_SERVE_EXECUTIONS", "100000"))
SMALL = 1000
REPEAT = 3
PAGES = ["/executions", "/executions?sort=stored&order=desc", "/executions?page=400&limit=100",
         "/executions?split=train&route=rl&state=admitted&sort=reward&order=desc", "/executions?erased=yes",
         "/executions?role_class=main/task&page=50", "/tasks?sort=executions&order=desc", "/tasks?page=100",
         "/withdrawals", "/runs", "/runs/run-03", "/executions/ex-000001",
         # issue 32, second round: the status and route pages (accounting), every other page kind
         "/", "/routes", "/routes/rl", "/runs/run-03?sort=reward&order=desc&page=5", "/runs/run-03?state=rejected",
         "/tree/ex-000001", "/manifests", "/manifests/view?route=rl&version=1",
         "/manifests/view?route=rl&version=1&page=300&withdrawn=yes",
         "/manifests/prove?route=rl&version=1&member=rl/ex-000001/r1", "/manifests/croissant?route=rl&version=1",
         "/withdrawals?subject=source:src-3", "/splits", "/graders", "/campaigns"]
if os.environ.get("LEDGER_BENCH_SERVE_PAGES"):  # a comma-separated subset, in that order (say one cold page)
    PAGES = os.environ["LEDGER_BENCH_SERVE_PAGES"].split(",")


def build(n: int, root: Path):
    """A projected store of ``n`` executions under ``root`` (its StorePaths)."""
    from ledger.cli import main
    from ledger.producers.ingest import Ingestor
    from workloads import serve_store

    key, trust, paths, log = signed_store(root)
    lines = list(serve_store.lines(n, key))
    for i in range(0, len(lines), 20_000):
        Ingestor(log, trust).ingest_lines(enumerate(lines[i:i + 20_000], i + 1))
    log.close()
    assert main(["--store", paths.url, "project"]) == 0
    return paths


def ensure_manifest(paths, route: str = "rl") -> None:
    """Publish manifest v1 of ``route`` (a fresh key, added to the store's trust file) unless one is
    published already, so the manifest pages have something to show; the manifest is written beside
    the store."""
    from ledger.corpus.publish import archive_path, publish
    from ledger.events.catalog import SIGNED_TYPES
    from ledger.events.signing import Trust, new_private_key, public_bytes, write_private_key

    if archive_path(paths, route, 1).exists():
        return
    key, path = new_private_key(), Path(paths.url).parent / "publisher.pem"
    write_private_key(key, path)
    trust = Trust.load(paths.trust)
    trust.add(public_bytes(key), list(SIGNED_TYPES))
    trust.save(paths.trust)
    publish(paths, route, key=path, out=Path(paths.url).parent / f"{route}-v1.json")


def get(app, path: str) -> tuple[int, bytes]:
    """One GET through the ASGI application (Host: 127.0.0.1)."""
    target, _, query = path.partition("?")
    scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": target, "raw_path": target.encode(),
             "query_string": query.encode(), "headers": [(b"host", b"127.0.0.1")], "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def page_times(paths) -> dict[str, tuple[float, float]]:
    """Per page ``(first request, best of REPEAT)`` through one application (a server's caches: the
    tokenizer, decoded spans, the log heads' Merkle frontiers)."""
    from ledger.view.app import make_app

    ensure_manifest(paths)
    app = make_app(paths)
    out = {}
    for page in PAGES:
        times = []
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            status, _body = get(app, page)
            times.append(time.perf_counter() - t0)
            assert status == 200, (page, status, _body[:300])
        out[page] = (times[0], min(times))
    return out


def run() -> list[dict]:
    from ledger.log.paths import store_paths

    rows = []
    given = os.environ.get("LEDGER_BENCH_SERVE_STORES")
    with tempfile.TemporaryDirectory() as tmp:
        if given:
            small_dir, large_dir = given.split(",")
            small, built = page_times(store_paths(small_dir)), float("nan")
            large = page_times(store_paths(large_dir))
        else:
            small = page_times(build(SMALL, Path(tmp) / "small"))
            t0 = time.perf_counter()
            large_paths = build(N, Path(tmp) / "large")
            built = time.perf_counter() - t0
            large = page_times(large_paths)
    for page in PAGES:
        (first, best), base = large[page], small[page][1]
        rows.append(row(f"serve page {page} ({N:,} vs {SMALL:,} executions)", best, base, "s", None,
                        f"{'OK' if best < 1.0 else 'OVER'} < 1 s; first request {first:.3f} s"))
    if not given:
        rows.append(row(f"build + project the {N:,}-execution store", built, built, "s", None, "(setup, informational)"))
    return rows


if __name__ == "__main__":
    print_table(run())
