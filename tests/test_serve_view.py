"""`ledger serve` as a curator reads it (issue 32): decoded conversations with the loss mask, labelled
trees with a legend, erased executions marked, paged lists, the collection-run grid, manifest
datasheets with "k of n withdrawn since", and the capability_gap blocker on the execution page.

Driven in Debian's chromium (selenium), as tests/test_serve.py; screenshots of the pages are
written to ``docs/serve-*.png`` when ``LEDGER_SCREENSHOTS=1``.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.cli import main
from ledger.producers import chatml
from ledger.view.lists import EXECUTION_SORTS

from .helpers import Signer, closed, request
from .test_manifest import Store, _opened
from .test_serve import _cells, _get, _serving, _shot, browser, evidence, evidence_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(300)
DEADLINE = "2099-01-01T00:00:00Z"
SYSTEM = "<|im_start|>system\nYou are Juniper, a careful coding agent.<|im_end|>\n"
USER = "<|im_start|>user\nThe pool leaks connections; fix release() in pool.py.<|im_end|>\n<|im_start|>assistant\n"
ANSWER1 = ("<think>\nRead the pool first.\n</think>\n\nI will read pool.py.\n<tool_call>\n"
           '{"name": "read_file", "arguments": {"path": "pool.py"}}\n</tool_call><|im_end|>')
TOOL = "\n<|im_start|>user\n<tool_response>\ndef release(c): pass\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
ANSWER2 = "release() never returns the connection; I return it to the free list now.<|im_end|>"


def _qwen_execution(ex: str, task: str, tokenizer: str = chatml.TOKENIZER_NAME) -> list[dict]:
    enc = chatml.encode
    inp1 = enc(SYSTEM + USER)
    out1 = enc(ANSWER1)
    inp2 = inp1 + out1 + enc(TOOL)
    out2 = enc(ANSWER2)
    return [{**_opened(ex, task, deadline=DEADLINE, collection_run_id="run-9", origin="synthetic"), "tokenizer": tokenizer},
            request(ex, "r1", inp1, out1), request(ex, "r2", inp2, out2), closed(ex),
            {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
             "outcome": "scored", "reward": 1.0, "evaluator": "grader@1"}]


@pytest.fixture(scope="module")
def view(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-view")
    s = Store(root, Signer())
    lines = [{"type": "task_registered", "task_id": f"t{i}", "source": "vendor-a" if i % 2 else "vendor-b"}
             for i in range(8)]
    lines += [{"type": "split_policy", "policy_id": "p1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
               "salt": "s"},
              {"type": "permission", "subject": "*", "use": "rl", "action": "grant", "authority": "legal"},
              {"type": "admission_policy", "route": "sft", "version": 1, "use": "rl", "split": "train", "j_max": 2,
               "consumer": "policy-team"}]
    lines += _qwen_execution("q1", "t0") + _qwen_execution("mystery", "t1", tokenizer="mystery-tok")
    for i in range(30):  # attempts of four tasks in one collection run, for paging and the grid
        lines += _qwen_execution(f"p{i:02d}", f"t{2 + i % 4}")
    s.ingest(lines)
    url = s.paths.url
    assert main(["--store", url, "project"]) == 0
    assert main(["--store", url, "manifest", "publish", "sft", "--key", str(s.key), "--out", str(root / "m1.json")]) == 0
    s.ingest([{"type": "withdrawal", "subject": "task:t2", "reason": "provider request", "authority": "legal",
               "erase": True}])
    assert main(["--store", url, "project"]) == 0
    return {"url": url, "root": root, "store": s}


@pytest.fixture(scope="module")
def view_server(view):
    yield from _serving(view["url"])


@pytest.fixture(scope="module")
def mapped_server(view):
    yield from _serving(view["url"], "--tokenizer", f"mystery-tok={chatml.TOKENIZER_NAME}")


def test_conversation_is_decoded_with_targets_highlighted_over_the_text(view, view_server, browser):
    from selenium.webdriver.common.by import By

    browser.get(view_server + "/executions/q1")
    conv = browser.find_element(By.CSS_SELECTOR, ".conversation")
    text = conv.text
    assert "You are Juniper, a careful coding agent." in text and "fix release() in pool.py" in text
    assert "I will read pool.py." in text and "def release(c): pass" in text
    roles = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".conversation .msg .role")]
    assert roles[:3] == ["SYSTEM", "USER", "ASSISTANT"] and "TOOL" not in roles
    # the loss mask is drawn over the decoded text: targets are exactly the drawn outputs
    targets = "".join(e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, ".conversation .tok.target"))
    contexts = "".join(e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, ".conversation .tok.context"))
    assert "release() never returns the connection" in targets and "I will read pool.py." in targets
    assert "You are Juniper" in contexts and "def release(c): pass" in contexts and "Juniper" not in targets
    reasoning = browser.find_elements(By.CSS_SELECTOR, ".conversation .tok.k-reasoning")
    assert any("Read the pool first." in e.text for e in reasoning)
    span = browser.find_element(By.CSS_SELECTOR, ".conversation .tok.target")
    assert span.get_attribute("title").startswith("loss target on route sft: fixed by draw")
    note = browser.find_element(By.ID, "side-note").text
    assert "route sft: admitted" in note and "paths drawn on this leaf: draw" in note
    assert "Qwen3.6" in browser.find_element(By.ID, "tokenizer").text
    legend = browser.find_element(By.ID, "legend").text
    assert "loss target" in legend and "context" in legend and "not selected" in legend
    # every token of the path is in exactly one span: the spans, in order, are the whole decoded path
    # (each "<|im_start|>role" header is drawn as the message's role label instead)
    spans = browser.execute_script("return Array.from(document.querySelectorAll('.conversation .tok'))"
                                   ".map(e => e.textContent).join('');")
    assert spans == re.sub(r"<\|im_start\|>[a-z]+\n", "", SYSTEM + USER + ANSWER1 + TOOL + ANSWER2)
    _shot(browser, "execution")
    doc = json.loads(_get(view_server + "/api/executions/q1")[2])
    conv_doc = doc["conversation"]
    assert conv_doc["decoded"] and conv_doc["leaf"] == "r2" and conv_doc["skipped_tokens"] == 0
    assert conv_doc["token_classes"]["target"] == len(chatml.encode(ANSWER1)) + len(chatml.encode(ANSWER2))


def test_tree_nodes_are_labelled_and_link_to_their_decoded_text(view, view_server, browser):
    from selenium.webdriver.common.by import By

    browser.get(view_server + "/tree/q1")
    assert "policy output (no route selected)" in browser.find_element(By.ID, "legend").text
    labels = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "svg.tree text.label")]
    assert any(label.startswith("r2 · main") for label in labels), labels
    outputs = sum(int(g.get_attribute("data-output")) for g in browser.find_elements(By.CSS_SELECTOR, "svg.tree g.node"))
    assert outputs == len(chatml.encode(ANSWER1)) + len(chatml.encode(ANSWER2))  # distinguished without a route
    href = browser.execute_script("return document.querySelector('svg.tree g.node a').getAttribute('href')")
    assert href.startswith("/executions/q1?leaf=") and "#text-" in href
    browser.get(view_server + href)
    anchor = href.rsplit("#", 1)[1]
    assert browser.find_element(By.ID, anchor).is_displayed()


def test_unknown_tokenizer_says_so_and_a_mapping_decodes_it(view, view_server, mapped_server, browser):
    from selenium.webdriver.common.by import By

    browser.get(view_server + "/executions/mystery")
    msg = browser.find_element(By.ID, "no-tokenizer").text
    assert "not decoded" in msg and "mystery-tok" in msg and "--tokenizer mystery-tok=PATH" in msg
    counts = _cells(browser, "path-counts")
    assert counts and sum(int(r[1].replace(",", "")) for r in counts) > 0
    assert not browser.find_elements(By.CSS_SELECTOR, ".conversation")
    browser.get(mapped_server + "/executions/mystery")
    assert "I will read pool.py." in browser.find_element(By.CSS_SELECTOR, ".conversation").text
    assert "mystery-tok → Qwen3.6 (ledger serve --tokenizer)" in browser.find_element(By.ID, "tokenizer").text
    assert _get(view_server + "/executions/q1?leaf=nope")[0] == 400


def test_erased_executions_are_marked_everywhere(view, view_server, browser):
    from selenium.webdriver.common.by import By

    erased = sorted(f"p{i:02d}" for i in range(30) if i % 4 == 0)
    browser.get(view_server + "/executions?erased=yes&limit=100")
    rows = _cells(browser, "executions")
    assert [r[0].split()[0] for r in rows] == erased and all(r[0].endswith("erased") for r in rows)
    browser.get(view_server + f"/executions/{erased[0]}")
    assert browser.find_element(By.ID, "erased-mark").text.startswith("ERASED")
    assert _cells(browser, "execution-withdrawals")[0][:4] == ["task:t2", "provider request", "legal", "yes: tokens shredded"]
    browser.get(view_server + "/withdrawals")
    (w,) = _cells(browser, "withdrawals")
    assert w[1] == "task:t2" and w[4] == str(len(erased)) and w[5] == "erased" and re.match(r"\d{4}-\d\d-\d\dT", w[0])
    _shot(browser, "withdrawals")
    browser.get(view_server + "/manifests/view?route=sft&version=1")
    doc = json.loads((view["root"] / "m1.json").read_text())
    hit = [m for m in doc["members"] if m["execution_id"] in erased]
    assert browser.find_element(By.ID, "withdrawn-since").text.startswith(
        f"{len(hit)} of {len(doc['members'])} members withdrawn since")
    assert browser.find_elements(By.CSS_SELECTOR, "#members .tag.erased")


def test_lists_page_sort_and_filter_server_side(view, view_server, browser):
    from selenium.webdriver.common.by import By

    every = json.loads(_get(view_server + "/api/executions?limit=1000")[2])
    assert every["matching"] == 32 and every["pages"] == 1
    pages = [json.loads(_get(view_server + f"/api/executions?limit=10&page={k}")[2]) for k in (1, 2, 3, 4)]
    assert [p["shown"] for p in pages] == [10, 10, 10, 2] and all(p["pages"] == 4 for p in pages)
    assert [e["execution_id"] for p in pages for e in p["executions"]] == \
        [e["execution_id"] for e in every["executions"]] == sorted(e["execution_id"] for e in every["executions"])
    desc = json.loads(_get(view_server + "/api/executions?sort=execution&order=desc&limit=3")[2])
    assert [e["execution_id"] for e in desc["executions"]] == ["q1", "p29", "p28"]
    assert json.loads(_get(view_server + "/api/executions?task=t3")[2])["matching"] == 8
    browser.get(view_server + "/executions?limit=10")
    assert browser.find_element(By.ID, "matching").text == "32" and browser.find_element(By.ID, "page").text == "1"
    browser.find_element(By.LINK_TEXT, "next ›").click()
    assert browser.find_element(By.ID, "page").text == "2"
    assert [r[0] for r in _cells(browser, "executions")][0] == every["executions"][10]["execution_id"]
    browser.find_element(By.PARTIAL_LINK_TEXT, "stored").click()  # sort by a column header
    assert "sort=stored" in browser.current_url and "limit=10" in browser.current_url  # the page size is kept
    assert browser.find_element(By.ID, "page").text == "1"
    _shot(browser, "executions")
    tasks = json.loads(_get(view_server + "/api/tasks?sort=executions&order=desc&limit=2")[2])
    assert [(t["task_id"], t["executions"]) for t in tasks["tasks"]] == [("t2", 8), ("t3", 8)]
    assert json.loads(_get(view_server + "/api/tasks?task=t2")[2])["tasks"][0]["erased"] == 8
    for bad in ("/executions?sort=nope", "/executions?order=up", "/executions?page=0", "/executions?erased=maybe",
                "/tasks?limit=0", "/withdrawals?sort=x", "/runs/nope", "/manifests/view?route=sft&version=1&page=x"):
        status, _, body = _get(view_server + bad)
        assert status in (400, 404) and 'id="error"' in body and "Traceback" not in body, bad


def test_collection_run_grid_shows_tasks_by_attempts(view, view_server, browser):
    from selenium.webdriver.common.by import By

    doc = json.loads(_get(view_server + "/api/runs/run-9")[2])
    assert doc["attempts"] == 8 and doc["route"] == "sft" and sorted(doc["tasks"]) == ["t0", "t1", "t2", "t3", "t4", "t5"]
    browser.get(view_server + "/runs/run-9")
    grid = _cells(browser, "grid")
    by_task = {r[0]: r[1:] for r in grid}
    assert by_task["t2"][:8] == ["✕"] * 8 and by_task["t3"][0] == "1"
    cell = browser.find_element(By.CSS_SELECTOR, "#grid td.cell a")
    assert "/executions/" in cell.get_attribute("href") and ": admitted" in cell.get_attribute("title")
    assert "erased" in browser.find_element(By.ID, "legend").text
    _shot(browser, "run-grid")
    # the tasks (rows) are sorted, filtered and paged server-side, like the other lists
    page = json.loads(_get(view_server + "/api/runs/run-9?sort=erased&order=desc&limit=2")[2])
    assert (page["task_count"], page["matching"], page["pages"], page["task_ids"]) == (6, 6, 3, ["t2", "t0"])
    assert page["executions"] == 32 and page["attempts"] == 8  # of the whole run, not the page
    assert json.loads(_get(view_server + "/api/runs/run-9?state=rejected")[2])["task_ids"] == ["t2"]
    assert json.loads(_get(view_server + "/api/runs/run-9?erased=no&sort=attempts&order=desc")[2])["task_ids"] == \
        ["t3", "t4", "t5", "t0", "t1"]
    assert json.loads(_get(view_server + "/api/runs/run-9?task=5")[2])["task_ids"] == ["t5"]
    browser.get(view_server + "/runs/run-9?limit=2")
    assert [r[0] for r in _cells(browser, "grid")] == ["t0", "t1"]
    browser.find_element(By.LINK_TEXT, "next ›").click()
    assert browser.find_element(By.ID, "page").text == "2" and [r[0] for r in _cells(browser, "grid")] == ["t2", "t3"]
    browser.find_element(By.PARTIAL_LINK_TEXT, "best reward").click()
    assert "sort=reward" in browser.current_url and "limit=2" in browser.current_url and "route=sft" in browser.current_url
    for bad in ("/runs/run-9?state=maybe", "/runs/run-9?erased=x", "/runs/run-9?sort=nope", "/runs/run-9?page=0"):
        status, _, body = _get(view_server + bad)
        assert status == 400 and 'id="error"' in body and "Traceback" not in body, bad
    browser.get(view_server + "/runs")
    assert _cells(browser, "runs")[0][0] == "run-9"


def test_manifest_page_shows_datasheet_croissant_and_date(view, view_server, browser):
    from selenium.webdriver.common.by import By

    browser.get(view_server + "/manifests/view?route=sft&version=1")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Datasheet" in body and "declared use" in body and "policy-team" in body
    published = [r for r in _cells(browser, "members")]
    assert published and "task t" in published[0][5]  # per-member lineage (semantics 3)
    croissant = browser.find_element(By.LINK_TEXT, "Croissant 1.0 (JSON-LD)").get_attribute("href")
    status, ctype, text = _get(croissant)
    cr = json.loads(text)
    assert status == 200 and ctype.startswith("application/json") and cr["@type"] == "sc:Dataset"
    written = json.loads((view["root"] / "m1.croissant.json").read_text())
    # the document `ledger manifest publish` wrote beside m1.json, naming the archive's file (v1.json) instead
    assert cr["distribution"][0]["sha256"] == written["distribution"][0]["sha256"]
    assert cr["url"] == cr["distribution"][0]["name"] == "v1.json" and written["url"] == "m1.json"
    assert {k: v for k, v in cr.items() if k not in ("url", "distribution")} == \
        {k: v for k, v in written.items() if k not in ("url", "distribution")}
    assert cr["datePublished"] in body
    _shot(browser, "manifest")


def test_capability_gap_blocker_is_named_on_the_execution_page(evidence, evidence_server, browser):
    from selenium.webdriver.common.by import By

    import sqlite3

    db = sqlite3.connect(evidence["db"])
    ex, route, reason = db.execute("SELECT execution_id, route, reason FROM admission WHERE predicate = 'capability_gap' "
                                   "ORDER BY execution_id").fetchone()
    doc = json.loads(_get(evidence_server + f"/api/executions/{ex}")[2])
    trail = next(a for a in doc["admission"] if a["route"] == route)["trail"]
    assert trail[0]["predicate"] == "capability_gap" and trail[0]["reason"] == reason
    assert all(t["verdict"] == "not evaluated" for t in trail[1:]) and not any(t["verdict"] == "unknown" for t in trail)
    browser.get(evidence_server + f"/executions/{ex}?route={route}")
    assert "capability_gap" in browser.find_element(By.ID, f"route-{route}").find_element(By.XPATH, "following-sibling::table").text


def test_no_raw_json_or_cli_text_on_html_pages(view, view_server, browser):
    from selenium.webdriver.common.by import By

    for page in ("/", "/executions", "/tasks", "/routes/sft", "/splits", "/manifests", "/manifests/view?route=sft&version=1",
                 "/withdrawals?subject=task:t2", "/runs/run-9", "/executions/q1", "/executions/p00"):
        browser.get(view_server + page)
        text = browser.execute_script(  # what the page itself says: decoded content and tool payloads are data
            "const m = document.querySelector('main').cloneNode(true); "
            "m.querySelectorAll('.conversation, pre.payload').forEach(e => e.remove()); "
            "document.body.appendChild(m); const t = m.innerText; m.remove(); return t;")
        assert not re.search(r'[\[{]"[a-z_]+":', text), (page, re.search(r'[\[{]"[a-z_]+":.{0,80}', text))
        assert not browser.find_elements(By.CSS_SELECTOR, "main pre:not(.payload)"), page


def test_serve_refuses_a_bad_tokenizer_mapping(view, capsys):
    capsys.readouterr()
    assert main(["--store", view["url"], "serve", "--listen", "127.0.0.1:0", "--tokenizer", "no-equals-sign"]) == 2
    assert "--tokenizer must be NAME=PATH" in capsys.readouterr().err


def test_the_serve_benchmark_store_pages_every_list(tmp_path):
    """benchmarks/bench_serve.py on a small store: every page it times answers 200, and paging of the
    generated executions is exact (the benchmark itself records times, never asserts them)."""
    from benchmarks.bench_serve import PAGES, build, ensure_manifest, get
    from ledger.view.app import make_app

    paths = build(100, tmp_path)
    ensure_manifest(paths)  # what page_times does before timing: the manifest pages have a v1
    app = make_app(paths)
    for page in PAGES:
        assert get(app, page)[0] == 200, page
    status, body = get(app, "/api/executions?erased=yes&limit=5&page=2")
    doc = json.loads(body)
    erased = [f"ex-{i:06d}" for i in range(100) if (i % 25) % 8 == 3]  # the tasks of source src-3
    assert status == 200 and doc["matching"] == len(erased) and [e["execution_id"] for e in doc["executions"]] == \
        erased[5:10]


def test_manifest_members_filter_by_withdrawn_since(view, view_server):
    doc = json.loads((view["root"] / "m1.json").read_text())
    erased = {f"p{i:02d}" for i in range(30) if i % 4 == 0}
    gone = sum(m["execution_id"] in erased for m in doc["members"])
    for flag, want in (("yes", gone), ("no", len(doc["members"]) - gone)):
        body = _get(view_server + f"/manifests/view?route=sft&version=1&withdrawn={flag}&limit=1000")[2]
        assert re.search(rf'rows 1–{want} of <b id="matching">{want}</b>', body), flag
    assert _get(view_server + "/manifests/view?route=sft&version=1&withdrawn=maybe")[0] == 400


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sort=st.sampled_from(sorted(EXECUTION_SORTS)), order=st.sampled_from(["asc", "desc"]),
       limit=st.integers(1, 40), erased=st.sampled_from([None, "yes", "no"]))
def test_pages_partition_the_sorted_list(view, sort, order, limit, erased):
    """Invariant: the pages of any sort, order, page size and filter, concatenated, are the one-page
    list (every execution exactly once, in the same order) and agree on the count."""
    import sqlite3

    from ledger.view.app import _int_param
    from ledger.view.lists import executions_page, page_args

    db = sqlite3.connect(view["store"].paths.db)
    filters = {"task": None, "split": None, "route": None, "state": None, "role_class": None, "erased": erased}

    def page(k: int, n: int) -> dict:
        return executions_page(db, filters, page_args({"sort": sort, "order": order, "limit": str(n), "page": str(k)},
                                                      EXECUTION_SORTS, "execution", _int_param))

    whole = page(1, 1000)
    first = page(1, limit)
    got = [e["execution_id"] for k in range(1, first["pages"] + 1) for e in page(k, limit)["executions"]]
    assert got == [e["execution_id"] for e in whole["executions"]] and len(set(got)) == whole["matching"] == len(got)
    assert first["pages"] == max(1, -(-whole["matching"] // limit))


def test_manifests_list_says_how_many_members_were_withdrawn_since(view, view_server, browser):
    doc = json.loads((view["root"] / "m1.json").read_text())
    erased = {f"p{i:02d}" for i in range(30) if i % 4 == 0}
    gone = sum(m["execution_id"] in erased for m in doc["members"])
    browser.get(view_server + "/manifests")
    (row,) = _cells(browser, "manifests")
    assert row[0] == "sft v1" and row[4] == f"{gone} of {len(doc['members'])}" and re.match(r"\d{4}-\d\d-\d\dT", row[1])


def test_token_ids_outside_the_vocabulary_are_shown_not_a_500(tmp_path):
    """A record whose IDs the named tokenizer cannot decode (the wrong tokenizer, a corrupt producer)
    still renders: the bad IDs are marked in the text."""
    import numpy as np

    from ledger.producers.models import load_format
    from ledger.view.text import DecodeCache

    fmt = load_format(chatml.TOKENIZER_NAME)
    ids = np.array(chatml.encode("hello") + [999_999, 4_294_967_295] + chatml.encode(" world"), dtype=np.uint32)
    cache = DecodeCache()
    assert cache.decode(fmt, ("x", 0, 0, len(ids)), ids) == "hello⟨id 999999?⟩⟨id 4294967295?⟩ world"
    assert cache.decode(fmt, ("x", 0, 0, len(ids)), ids) == "hello⟨id 999999?⟩⟨id 4294967295?⟩ world"
    assert (cache.hits, cache.misses) == (1, 1)
    small = DecodeCache(max_chars=12)  # bounded: the least recently used span goes first
    a, b = np.array(chatml.encode("abcdefg"), dtype=np.uint32), np.array(chatml.encode("hijklmn"), dtype=np.uint32)
    small.decode(fmt, ("x", 0, 0, 1), a)
    small.decode(fmt, ("x", 0, 1, 2), b)
    assert small.chars == 7 and small.misses == 2
    small.decode(fmt, ("x", 0, 0, 1), a)
    assert small.misses == 3  # evicted, decoded again


def test_pager_numbers_rows_and_keeps_the_page_size(view, view_server, browser):
    from selenium.webdriver.common.by import By

    browser.get(view_server + "/tasks?limit=3&page=3")
    assert browser.find_element(By.ID, "pager").text.startswith("rows 7–8 of 8 · page 3 of 3")
    browser.find_element(By.LINK_TEXT, "‹ previous").click()
    assert browser.find_element(By.ID, "pager").text.startswith("rows 4–6 of 8 · page 2 of 3")
    assert [r[0] for r in _cells(browser, "tasks")] == ["t3", "t4", "t5"]
