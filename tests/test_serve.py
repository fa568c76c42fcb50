"""`ledger serve` (issue 20): the read-only web view, driven in a real headless browser.

A store with routes, two published manifests around a withdrawal and a real Claude Code
session is built through the CLI; `ledger serve --listen 127.0.0.1:0` runs as a subprocess
and Debian's chromium (through chromium-driver and selenium) loads its pages.  Status codes
and JSON twins are read with urllib (a browser does not expose them).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ledger.cli import main

from .helpers import Signer
from .test_manifest import Store, _base_lines, _execution

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPTS = ROOT.parent / "shared" / "testdata" / "transcripts" / "claude-code"
SESSION = "4d5611e5-241a-462a-8d15-5122611a9569"  # a real Claude Code session (main agent, sub-agents, tools)

pytestmark = pytest.mark.timeout(300)


def _cli_json(capsys, *argv) -> tuple[int, object]:
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from workloads import claude_code

    root = tmp_path_factory.mktemp("serve")
    s = Store(root, Signer())
    s.ingest(_base_lines())
    session = next(p for p in claude_code.list_sessions(TRANSCRIPTS) if p.stem == SESSION)
    events = claude_code.session_events(session)
    s.ingest(events)
    url = s.paths.url
    assert main(["--store", url, "project"]) == 0
    assert main(["--store", url, "manifest", "publish", "sft", "--key", str(s.key), "--out", str(root / "m1.json")]) == 0
    s.ingest([{"type": "withdrawal", "subject": "execution:e2", "reason": "provider request", "authority": "legal"}])
    assert main(["--store", url, "project"]) == 0
    assert main(["--store", url, "manifest", "publish", "sft", "--key", str(s.key), "--out", str(root / "m2.json")]) == 0
    return {"store": s, "url": url, "root": root, "cc": events[0]["execution_id"],
            "archive": Path(url) / "manifests" / "sft"}


@pytest.fixture(scope="module")
def server(built):
    proc = subprocess.Popen([sys.executable, "-m", "ledger.cli", "--store", built["url"], "serve", "--listen",
                             "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.fail(f"ledger serve did not start: {proc.stderr.read()}")
    base = line.split(" on ", 1)[1].split()[0].rstrip("/")
    assert base.startswith("http://127.0.0.1:")
    yield base
    proc.terminate()
    proc.wait(10)


def _chromium() -> tuple[str, str] | None:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


@pytest.fixture(scope="module")
def browser():
    found = _chromium()
    if found is None:
        pytest.skip("chromium and chromium-driver are not installed and could not be (the Makefile's `browser` "
                    "target runs apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(a)
    opts.binary_location = found[0]
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(found[1]), options=opts)
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()


def _get(url: str, method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode()


def _wait_for(browser, element_id: str):
    """The element of the page a form submission navigates to (the old page has none)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, 60).until(EC.presence_of_element_located((By.ID, element_id)))


def _console_errors(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


PAGES = ["/", "/executions", "/executions?route=sft&state=admitted", "/executions/e1", "/routes", "/routes/sft",
         "/splits", "/manifests", "/manifests/view?route=sft&version=1", "/manifests/diff?route=sft&a=1&b=2",
         "/withdrawals", "/withdrawals?subject=execution:e2", "/tree/e1"]


def test_pages_load_with_no_console_errors_and_write_nothing(built, server, browser):
    from selenium.webdriver.common.by import By

    db = Path(built["store"].paths.db)
    before = _sha(db)
    browser.get_log("browser")  # drop anything earlier
    for page in PAGES:
        browser.get(server + page)
        assert browser.find_element(By.TAG_NAME, "h1").text, page
        assert "Traceback" not in browser.page_source, page
        assert _console_errors(browser) == [], page
        assert browser.find_elements(By.TAG_NAME, "script") == [], page  # no JavaScript at all
    assert _sha(db) == before  # the projection database was opened read-only


def test_real_claude_code_tree_renders_with_ledger_tree_token_counts(built, server, browser, capsys):
    from selenium.webdriver.common.by import By

    ex = built["cc"]
    code, cli = _cli_json(capsys, "--store", built["url"], "tree", ex, "--json")
    assert code == 0 and len(cli["nodes"]) > 100
    browser.get(server + "/executions/" + ex)
    svg = browser.find_element(By.CSS_SELECTOR, "svg.tree")
    assert svg.is_displayed() and svg.size["width"] > 500 and svg.size["height"] > 40
    # one round trip for every node's attributes and hover text (the page itself runs no script)
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('svg.tree g.node')).map(g => [Number(g.dataset.nodeId), "
        "Number(g.dataset.tokens), Number(g.dataset.context), g.querySelector('title').textContent]);")
    drawn = {nid: (tokens, context, title) for nid, tokens, context, title in rows}
    want = {n["node_id"]: len(n["tokens"]) for n in cli["nodes"]}
    assert {k: v[0] for k, v in drawn.items()} == want
    assert sum(want.values()) == cli["stored_tokens"]
    stats = {b.get_attribute("data-k"): int(b.text.replace(",", ""))
             for b in browser.find_elements(By.CSS_SELECTOR, "#tree-stats b")}
    assert stats["stored_tokens"] == cli["stored_tokens"] and stats["expanded_tokens"] == cli["expanded_tokens"]
    assert stats["nodes"] == len(cli["nodes"]) and stats["requests"] == len(cli["requests"])
    # reconstructed transcripts carry no policy targets: every token is context
    assert all(v[1] == want[k] for k, v in drawn.items())
    # hovering shows the requests that end on a node and their tool calls
    by_node: dict[int, list[str]] = {}
    for rid, nid in cli["requests"].items():
        by_node.setdefault(nid, []).append(rid)
    for nid, rids in by_node.items():
        title = drawn[nid][2]
        assert title.startswith(f"node #{nid}: {want[nid]:,} tokens")
        assert all(f"request {r}:" in title for r in rids)
    assert sum("tool emitted" in v[2] for v in drawn.values()) > 10
    # the JSON twin of the tree page is the CLI's document
    assert json.loads(_get(server + "/tree/" + ex + "?format=json")[2]) == cli
    assert json.loads(_get(server + "/api/tree/" + ex)[2]) == cli


def test_execution_page_colours_targets_and_shows_the_predicate_trail(built, server, browser, capsys):
    from selenium.webdriver.common.by import By

    code, cli = _cli_json(capsys, "--store", built["url"], "tree", "e1", "--json")
    browser.get(server + "/executions/e1")
    groups = browser.find_elements(By.CSS_SELECTOR, "svg.tree g.node")
    candidates = sum(sum(n["target"]) for n in cli["nodes"])
    drawn_targets = sum(int(g.get_attribute("data-target")) for g in groups)
    not_selected = sum(int(g.get_attribute("data-not-selected")) for g in groups)
    db = sqlite3.connect(built["store"].paths.db)
    want = db.execute("SELECT SUM(target_tokens) FROM admitted_paths WHERE route = 'sft' AND execution_id = 'e1'").fetchone()[0]
    assert drawn_targets == want > 0 and drawn_targets + not_selected == candidates
    assert browser.find_elements(By.CSS_SELECTOR, "svg.tree rect.target")
    doc = json.loads(_get(server + "/executions/e2?format=json")[2])
    (adm,) = doc["admission"]
    assert adm["state"] == "rejected" and adm["predicate"] == "permitted_use"
    assert [(t["predicate"], t["verdict"]) for t in adm["trail"]] == [
        ("record_adequacy", "pass"), ("permitted_use", "fail"), ("target_suitability", "not evaluated")]
    assert doc["tree"] == _cli_json(capsys, "--store", built["url"], "tree", "e2", "--json")[1]
    assert [a["assessment_id"] for a in doc["assessments"]] == ["a1"] and doc["withdrawals"][0]["subject"] == "execution:e2"


def test_filters_match_the_projection(built, server):
    db = sqlite3.connect(built["store"].paths.db)

    def ids(query: str) -> list[str]:
        status, _, body = _get(server + "/executions?format=json&" + query)
        assert status == 200, body
        return [e["execution_id"] for e in json.loads(body)["executions"]]

    admitted = [r[0] for r in db.execute("SELECT execution_id FROM admission WHERE route = 'sft' AND state = 'admitted' "
                                         "ORDER BY 1")]
    assert ids("route=sft&state=admitted") == admitted == ["e1", "e3"]
    rejected = [r[0] for r in db.execute("SELECT execution_id FROM admission WHERE route = 'sft' AND state = 'rejected' "
                                         "ORDER BY 1")]
    assert ids("route=sft&state=rejected") == rejected and "e2" in rejected  # e2: withdrawn
    assert ids("state=unresolved") == [built["cc"]]  # its task has no split
    assert ids("task=t2") == ["e2"]
    subs = [r[0] for r in db.execute("SELECT DISTINCT execution_id FROM tree_requests WHERE agent_tier = 'sub' "
                                     "AND turn_kind = 'task' ORDER BY 1")]
    assert ids("role_class=sub/task") == subs and built["cc"] in subs and len(subs) == 5
    assert ids("split=train") == ["d1", "e1", "e2", "e3"]


def test_verify_button_reports_a_tampered_manifest_as_failed(built, server, browser):
    from selenium.webdriver.common.by import By

    archive = built["archive"] / "v1.json"
    original = archive.read_bytes()
    browser.get(server + "/manifests/view?route=sft&version=1")
    browser.find_element(By.ID, "verify").click()
    assert _wait_for(browser, "verdict").text == "manifest ok: sft v1"
    steps = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "table tr td:nth-child(2)")]
    assert "ManifestPublished on the log" in steps and "member digests against the rebuilt trainer records" in steps
    doc = json.loads(original)
    doc["members"][0]["digest"] = "0" * 64
    archive.write_text(json.dumps(doc))
    try:
        browser.get(server + "/manifests/view?route=sft&version=1")
        assert "does not match the manifest_sha256" in browser.page_source
        browser.find_element(By.ID, "verify").click()
        assert _wait_for(browser, "verdict").text == "manifest FAILED verification: sft v1"
        problems = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#problems li")]
        assert problems and any("root" in p for p in problems)
        assert _console_errors(browser) == []
        status, _, body = _get(server + "/manifests/verify?route=sft&version=1&format=json", "POST")
        assert status == 200 and json.loads(body) == json.loads(
            subprocess.run([sys.executable, "-m", "ledger.cli", "--store", built["url"], "manifest", "verify",
                            str(archive), "--deep", "--json"], cwd=ROOT, capture_output=True, text=True).stdout)
        assert json.loads(body)["ok"] is False
    finally:
        archive.write_bytes(original)


def test_inclusion_proof_lookup_is_the_cli_proof(built, server, browser, capsys):
    from selenium.webdriver.common.by import By

    member = json.loads((built["archive"] / "v2.json").read_text())["members"][1]["member_id"]
    browser.get(server + "/manifests/view?route=sft&version=2")
    browser.find_element(By.ID, "member").send_keys(member)
    browser.find_element(By.ID, "prove").click()
    code, cli = _cli_json(capsys, "manifest", "prove", str(built["archive"] / "v2.json"), member)
    assert code == 0
    assert _wait_for(browser, "proved").text.startswith(f"{member} is leaf {cli['leaf_index']} of {cli['tree_size']}")
    assert json.loads(_get(server + "/api/manifests/prove?route=sft&version=2&member=" + member)[2]) == cli


def test_json_twins_are_the_cli_documents(built, server, capsys):
    url = built["url"]

    def api(path: str):
        status, ctype, body = _get(server + path)
        assert status == 200 and ctype.startswith("application/json"), (path, body)
        return json.loads(body)

    assert api("/api") == api("/?format=json") == _cli_json(capsys, "--store", url, "status", "--json")[1]
    page = api("/withdrawals?subject=execution:e2&format=json")
    assert page["impact"] == _cli_json(capsys, "--store", url, "impact", "execution:e2", "--json")[1]
    assert [(p["version"], p["subject_members"], p["published"]) for p in page["publications"]] == [
        (1, 2, "before"), (2, 0, "after")]
    splits = api("/api/splits")
    assert splits["show"] == _cli_json(capsys, "--store", url, "splits", "show", "--json")[1]
    assert splits["check"] == _cli_json(capsys, "--store", url, "splits", "check", "--json")[1]
    assert splits["candidates"] == _cli_json(capsys, "--store", url, "similarity", "candidates", "--json")[1]
    a, b = str(built["archive"] / "v1.json"), str(built["archive"] / "v2.json")
    assert api("/api/manifests/diff?route=sft&a=1&b=2") == _cli_json(capsys, "--store", url, "manifest", "diff", a, b,
                                                                      "--json")[1]
    route = api("/api/routes/sft")
    status = _cli_json(capsys, "--store", url, "status", "--json")[1]
    assert route["accounting"] == status["accounting"]["sft"]
    assert dict(route["funnel"]) == {k: status["routes"]["sft"][k] for k in
                                     ("evaluated", "admitted", "dummy", "rejected", "unresolved")}


def test_bad_input_gets_a_404_or_400_page_never_a_traceback(built, server, browser):
    from selenium.webdriver.common.by import By

    cases = {"/executions/no-such-execution": 404, "/tree/no-such-execution": 404, "/routes/nope": 404,
             "/manifests/view?route=sft&version=99": 404, "/manifests/prove?route=sft&version=1&member=nope": 404,
             "/no/such/page": 404, "/executions?split=bogus": 400, "/executions?limit=ten": 400,
             "/executions?state=maybe": 400, "/executions?route=nope": 400, "/executions?bogus=1": 400,
             "/executions?task=a&task=b": 400, "/manifests/view?route=sft": 400,
             "/manifests/view?route=sft&version=-1": 400, "/withdrawals?subject=bad": 400,
             "/executions/e1?route=nope": 400, "/?format=xml": 400, "/executions?task=%00": 400}
    for path, want in cases.items():
        status, ctype, body = _get(server + path)
        assert status == want, (path, status, body)
        assert "Traceback" not in body and 'id="error"' in body, path
        j_status, j_type, j_body = _get(server + path + ("&" if "?" in path else "?") + "format=json")
        if path != "/?format=xml":
            assert j_status == want and json.loads(j_body)["status"] == want, path
    for method in ("POST", "PUT", "DELETE"):  # no write endpoint
        assert _get(server + "/executions", method)[0] == 405
    assert _get(server + "/manifests/verify?route=sft&version=1")[0] == 405  # verify only by POST
    browser.get(server + "/executions/no-such-execution")
    assert browser.find_element(By.TAG_NAME, "h1").text == "404 Not found"
    assert "no execution 'no-such-execution'" in browser.find_element(By.ID, "error").text
    browser.get(server + "/executions?split=bogus")
    assert browser.find_element(By.TAG_NAME, "h1").text == "400 Bad request"


def test_pages_are_live_as_the_projector_applies_events(built, server):
    s = built["store"]
    assert "e9" not in _get(server + "/executions")[2]
    s.ingest([{"type": "task_registered", "task_id": "t9", "source": "vendor-a"}, *_execution("e9", "t9")])
    assert _get(server + "/executions/e9")[0] == 404  # on the log, not yet projected
    assert main(["--store", built["url"], "project"]) == 0
    status, _, body = _get(server + "/executions/e9?format=json")
    assert status == 200 and json.loads(body)["admission"][0]["state"] == "admitted"


def test_serve_refuses_bad_listen_addresses(built, capsys):
    assert main(["--store", built["url"], "serve", "--listen", "localhost"]) == 2
    assert "--listen must be HOST:PORT" in capsys.readouterr().err
    assert main(["--store", built["url"], "serve", "--listen", "127.0.0.1:99999"]) == 2
    assert main(["--store", str(built["root"] / "nowhere"), "serve", "--listen", "127.0.0.1:0"]) == 2
    assert "no ledger store" in capsys.readouterr().err
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--store", built["url"], "serve", "--listen", f"127.0.0.1:{port}"]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
