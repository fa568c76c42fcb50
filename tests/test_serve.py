"""`ledger serve` (issue 20): the read-only web view, driven in a real headless browser.

A store with routes, two published manifests around a withdrawal and a real Claude Code
session is built through the CLI; `ledger serve --listen 127.0.0.1:0` runs as a subprocess
and Debian's chromium (through chromium-driver and selenium) loads its pages.  Status codes
and JSON twins are read with urllib (a browser does not expose them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ledger.cli import main

from .helpers import Signer, signed_store
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


def _serving(url: str, *extra: str):
    """Run `ledger serve --listen 127.0.0.1:0` on the store at ``url``; yield its base URL, then stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "ledger.cli", "--store", url, "serve", "--listen",
                             "127.0.0.1:0", *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.fail(f"ledger serve did not start: {proc.stderr.read()}")
    base = line.split(" on ", 1)[1].split()[0].rstrip("/")
    assert base.startswith("http://127.0.0.1:")
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def server(built):
    yield from _serving(built["url"])


SHOTS = os.environ.get("LEDGER_SCREENSHOTS") == "1"  # `LEDGER_SCREENSHOTS=1 pytest ...` regenerates docs/serve-*.png


def _shot(browser, name: str) -> None:
    """Save the page shown as docs/serve-NAME.png (full height, capped) when LEDGER_SCREENSHOTS=1."""
    if SHOTS:
        h = browser.execute_script("return document.body.scrollHeight")
        browser.set_window_size(1400, min(max(h, 700), 2200))
        browser.save_screenshot(str(ROOT / "docs" / f"serve-{name}.png"))
        browser.set_window_size(1400, 1000)


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
         "/splits", "/splits?check=yes", "/manifests", "/manifests/view?route=sft&version=1",
         "/manifests/diff?route=sft&a=1&b=2", "/withdrawals", "/withdrawals?subject=execution:e2", "/tree/e1"]


SHOT_PAGES = {"/": "status", "/routes/sft": "route", "/splits?check=yes": "splits"}


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
        if page in SHOT_PAGES:
            _shot(browser, SHOT_PAGES[page])
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
    _shot(browser, "claude-code-tree")
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
    _shot(browser, "manifest-verify")
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
    # semantics 3 (SPEC 11.2): the member's lineage is on the proof page and summarised in the members table
    assert cli["lineage"]["semantics"] == 3 and _wait_for(browser, "lineage").text == "Lineage"
    page = browser.find_element(By.TAG_NAME, "body").text
    assert f"task_id {cli['lineage']['task_id']}" in page and "route_version" in page
    browser.get(server + "/manifests/view?route=sft&version=2")
    assert f"task {cli['lineage']['task_id']}@" in browser.find_element(By.TAG_NAME, "body").text


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
    splits = api("/api/splits?check=yes")
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


# ------------------------------------------------------------------ SPEC §6.10 evidence (issue 16)
EXAMPLES = ROOT / "examples"
LATE = "2030-01-03T00:00:00Z"  # after the campaign's first execution (2030-01-02)


def _example(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLES / name).read_text().splitlines() if line.strip()]


def _small_execution(ex: str, task: str) -> list[dict]:
    at = "2030-01-02T00:00:00Z"
    return [{"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": "2099-01-01T00:00:00Z",
             "policy": "qwen@1", "occurred_at": at},
            {"type": "request", "execution_id": ex, "request_id": "r1", "input_ids": [1, 2], "output_ids": [3],
             "output_logprobs": [-0.1], "occurred_at": at},
            {"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"],
             "occurred_at": at}]


def _assessed(ex: str, aid: str, reward: float, evaluator: str) -> dict:
    return {"type": "assessment", "assessment_id": aid, "execution_id": ex, "artifact_version": "v1", "outcome": "scored",
            "reward": reward, "evaluator": evaluator}


def _diff(ex: str, paths: list[str], diff: str | None = None) -> dict:
    return {"type": "artifact_diff", "execution_id": ex, "artifact_version": "v1", "base_commit": "abc123",
            "changed_paths": paths, **({"diff": diff} if diff else {})}


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    """The README's SPEC §6.10 examples (campaign pool-repair, faults, feedback, probes) on one store, plus
    grader controls of two evaluator versions, protected paths with diffs, a late manifest and route
    version of the campaign, two published manifests and two checkpoints trained on them."""
    from ledger.events.catalog import SIGNED_TYPES
    from ledger.log import open_log
    from ledger.producers.ingest import Ingestor

    root = tmp_path_factory.mktemp("serve-evidence")
    signer, paths, key = signed_store(root, "gov.pem")

    def ingest(lines: list[dict]) -> None:
        lines = [signer.sign(l) if l["type"] in SIGNED_TYPES else l for l in lines]
        with open_log(paths.url) as log:
            rep = Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
        assert not rep.conflicts and rep.appended == len(lines), rep

    manifest = next(l for l in _example("collections-gov.jsonl") if l["type"] == "collection_manifest")
    lines = (_example("collections-events.jsonl") + _example("collections-gov.jsonl") + _example("evidence-events.jsonl")
             + [l for l in _example("evidence-gov.jsonl") if l["type"] != "split_policy"])  # one split policy only
    lines.append({"type": "task_registered", "task_id": "pool-repair", "source": "repo-pool",
                  "protected_paths": ["tests/**", "pyproject.toml"], "allowed_paths": ["tests/regression/test_*.py"]})
    for ex in ("ref", "wakeup", "tamper"):
        lines += _small_execution(ex, "pool-repair")
    lines += [_assessed("ref", "a1", 1.0, "repair_accept_v1@1"), _assessed("wakeup", "a1", 1.0, "repair_accept_v1@1"),
              _assessed("ref", "a2", 1.0, "strict@2"), _assessed("wakeup", "a2", 0.0, "strict@2"),
              _assessed("tamper", "a1", 1.0, "strict@2")]
    for ev in ("repair_accept_v1@1", "strict@2"):
        lines += [{"type": "grader_control", "execution_id": "ref", "evaluator": ev, "kind": "adequate",
                   "expected_verdict": "pass"},
                  {"type": "grader_control", "execution_id": "wakeup", "evaluator": ev, "kind": "inadequate",
                   "expected_verdict": "fail"}]
    lines += [_diff("tamper", ["src/pool.py", "tests/test_pool.py"], "--- a/tests/test_pool.py\n+++ b/tests/test_pool.py\n"
                                                                       "+assert True\n"),
              _diff("ref", ["src/pool.py", "tests/regression/test_pool_fix.py"]),
              {"type": "production_feedback", "execution_id": "tamper", "signal": "accepted", "consent_ref": "consent/x"},
              {**manifest, "version": 2, "required_capture": ["main/task", "tool_results"], "occurred_at": LATE},
              {"type": "admission_policy", "route": "repair_sft", "version": 2, "use": "sft", "split": "train", "j_max": 4,
               "collection_id": "pool-repair", "occurred_at": LATE}]
    ingest(lines)
    url = paths.url
    assert main(["--store", url, "project"]) == 0
    for r in ("repair_sft", "residual_rl"):
        assert main(["--store", url, "manifest", "publish", r, "--key", str(key), "--out", str(root / f"{r}.json")]) == 0
    ingest([{"type": "checkpoint_trained", "checkpoint_id": "ckpt-7", "manifests": [{"route": "repair_sft", "version": 1}],
             "evaluation_claims": ["pool pass@1"]},
            {"type": "checkpoint_trained", "checkpoint_id": "ckpt-8", "evaluation_claims": ["pool pass@1", "ops resolve rate"],
             "manifests": [{"route": "repair_sft", "version": 1}, {"route": "residual_rl", "version": 1}]}])
    assert main(["--store", url, "project"]) == 0
    return {"url": url, "root": root, "db": Path(paths.db)}


@pytest.fixture(scope="module")
def evidence_server(evidence):
    yield from _serving(evidence["url"])


def _cells(browser, table_id: str) -> list[list[str]]:
    from selenium.webdriver.common.by import By

    rows = browser.find_elements(By.CSS_SELECTOR, f"table[id='{table_id}'] tr")
    return [[td.text for td in r.find_elements(By.TAG_NAME, "td")] for r in rows[1:]]


def _api_json(base: str, path: str):
    status, ctype, body = _get(base + path)
    assert status == 200 and ctype.startswith("application/json"), (path, status, body)
    return json.loads(body)


EVIDENCE_PAGES = ["/graders", "/graders/strict@2", "/campaigns", "/campaigns/pool-repair",
                  "/campaigns/pool-repair?route=repair_sft", "/routes/residual_rl", "/routes/repair_sft", "/executions/g1",
                  "/executions/tamper", "/executions/wakeup", "/executions/s1"]


def test_evidence_pages_load_with_no_console_errors_and_write_nothing(evidence, evidence_server, browser):
    from selenium.webdriver.common.by import By

    before = _sha(evidence["db"])
    browser.get_log("browser")
    for page in EVIDENCE_PAGES:
        browser.get(evidence_server + page)
        assert browser.find_element(By.TAG_NAME, "h1").text, page
        assert "Traceback" not in browser.page_source and "internal error" not in browser.page_source, page
        assert _console_errors(browser) == [], page
        assert browser.find_elements(By.TAG_NAME, "script") == [], page
        nav = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "header a")]
        assert nav[-2:] == ["Graders", "Campaigns"], page
    assert _sha(evidence["db"]) == before


def test_graders_page_is_ledger_graders(evidence, evidence_server, browser, capsys):
    code, cli = _cli_json(capsys, "--store", evidence["url"], "graders", "--json")
    assert code == 0
    assert _api_json(evidence_server, "/api/graders") == _api_json(evidence_server, "/graders?format=json") == cli
    by = {g["evaluator"]: g for g in cli}
    assert sorted(by) == ["grader@1", "repair_accept_v1", "repair_accept_v1@1", "strict@2"]
    assert _api_json(evidence_server, "/api/graders/repair_accept_v1@1") == by["repair_accept_v1@1"]
    browser.get(evidence_server + "/graders")
    rows = {r[0]: r for r in _cells(browser, "graders")}
    assert rows["repair_accept_v1@1"] == ["repair_accept_v1@1", "no", "misclassified controls wakeup", "2",
                                          "1.000 (1/1)", "0.000 (0/1)", "wakeup", ""]
    assert rows["strict@2"] == ["strict@2", "yes", "", "2", "0.000 (0/1)", "0.000 (0/1)", "", ""]
    assert rows["grader@1"][1:6] == ["no", "no adequate and no inadequate control", "0", "n/a (0 assessed)",
                                     "n/a (0 assessed)"]
    for name, g in by.items():  # every figure on the page is the CLI document's
        fa, fr = g["false_acceptance"], g["false_rejection"]
        assert rows[name][1] == ("yes" if g["calibrated"] else "no") and rows[name][2] == g["why_not"]
        assert rows[name][4] == ("n/a (0 assessed)" if fa["rate"] is None else
                                 f"{fa['rate']:.3f} ({fa['inadequate_passed']}/{fa['inadequate_assessed']})")
        assert rows[name][5] == ("n/a (0 assessed)" if fr["rate"] is None else
                                 f"{fr['rate']:.3f} ({fr['adequate_failed']}/{fr['adequate_assessed']})")
    assert _cells(browser, "controls-repair_accept_v1@1") == [["ref", "adequate", "pass", "pass", "as expected"],
                                                              ["wakeup", "inadequate", "fail", "pass", "MISCLASSIFIED"]]
    assert [[c["execution_id"], c["kind"], c["expected"], c["observed"]] for c in by["repair_accept_v1@1"]["controls"]] \
        == [r[:4] for r in _cells(browser, "controls-repair_accept_v1@1")]
    _shot(browser, "graders")
    browser.get(evidence_server + "/graders/strict@2")
    assert _cells(browser, "controls-strict@2") == [["ref", "adequate", "pass", "pass", "as expected"],
                                                    ["wakeup", "inadequate", "fail", "fail", "as expected"]]


def test_campaigns_page_is_the_status_and_admission_documents(evidence, evidence_server, browser, capsys):
    url = evidence["url"]
    status = _cli_json(capsys, "--store", url, "status", "--json")[1]
    page = _api_json(evidence_server, "/api/campaigns")
    assert page == _api_json(evidence_server, "/campaigns?format=json")
    assert page["collections"] == status["collections"]
    assert sorted(page["collections"]) == ["ghost", "other-campaign", "pool-repair"]
    show = _cli_json(capsys, "--store", url, "admission", "show", "repair_sft", "--json")[1]
    one = _api_json(evidence_server, "/api/campaigns/pool-repair?route=repair_sft")
    assert one["summary"] == show["collection"]
    assert [(p["route"], p["version"], [c["checkpoint_id"] for c in p["checkpoints"]]) for p in page["checkpoints"]] == [
        ("repair_sft", 1, ["ckpt-7", "ckpt-8"]), ("residual_rl", 1, ["ckpt-8"])]
    impact = _cli_json(capsys, "--store", url, "impact", "source:repo-pool", "--json")[1]
    named = {(m["route"], m["version"]): m.get("checkpoints") for m in impact["manifests"]}
    assert named[("repair_sft", 1)] == page["checkpoints"][0]["checkpoints"]  # = ledger impact's checkpoints

    browser.get(evidence_server + "/campaigns")
    rows = {r[0]: r for r in _cells(browser, "campaigns")}
    assert rows["pool-repair"] == ["pool-repair", "1, 2", "2", "2030-01-02T00:00:00Z", "yes",
                                   f"admission_policy repair_sft v2 at {LATE}; collection_manifest pool-repair v2 at {LATE}"]
    assert rows["ghost"] == ["ghost", "none", "0", "", "no", ""]
    for cid, s in page["collections"].items():
        assert rows[cid][2] == str(s["executions"]) and rows[cid][4] == ("yes" if s["declared_after_sampling"] else "no")
    assert _cells(browser, "checkpoints") == [
        ["repair_sft v1", "2", "3", "pool-repair", "ckpt-7", "pool pass@1"],
        ["repair_sft v1", "2", "3", "pool-repair", "ckpt-8", "pool pass@1, ops resolve rate"],
        ["residual_rl v1", "1", "1", "-", "ckpt-8", "pool pass@1, ops resolve rate"]]

    browser.get(evidence_server + "/campaigns/pool-repair")
    doc = _api_json(evidence_server, "/api/campaigns/pool-repair")
    assert _cells(browser, "manifest-versions") == [
        ["1", "2030-01-01T00:00:00Z", "sft", "sft-trainer@3", "main/task, sub/task, tool_results", "repair_sft", "no"],
        ["2", LATE, "sft", "sft-trainer@3", "main/task, tool_results", "repair_sft", "yes"]]
    assert _cells(browser, "late") == [["admission_policy", "repair_sft", "2", LATE], ["collection_manifest", "pool-repair", "2",
                                                                                       LATE]]
    assert [[d["declaration"], d.get("route") or d.get("collection_id"), str(d["version"]), d["occurred_at"]]
            for d in doc["summary"]["late_declarations"]] == _cells(browser, "late")
    assert _cells(browser, "routes") == [["repair_sft", "1", "2030-01-01T00:00:00Z", "no"], ["repair_sft", "2", LATE, "yes"]]
    assert [r[0] for r in _cells(browser, "executions")] == [e["execution_id"] for e in doc["executions"]] == ["run-1", "run-2"]
    assert [r[4] for r in _cells(browser, "checkpoints")] == ["ckpt-7", "ckpt-8"]
    from selenium.webdriver.common.by import By

    assert browser.find_element(By.ID, "declared-after-sampling").text == "declared after sampling"


def test_route_page_shows_fault_coverage_and_probe_evidence_of_the_datasheet(evidence, evidence_server, browser, built,
                                                                             server):
    archive = json.loads((Path(evidence["url"]) / "manifests" / "residual_rl" / "v1.json").read_text())
    doc = _api_json(evidence_server, "/api/routes/residual_rl")
    assert doc["fault_coverage"] == archive["fault_injection"]["coverage"]
    assert doc["probe_evidence"] == archive["capability_gap"]["probes_by_task"]
    assert doc["capability_gap"] is True
    browser.get(evidence_server + "/routes/residual_rl")
    cov = {r[0]: r for r in _cells(browser, "fault-coverage")}
    assert list(cov) == ["malformed_rejected", "partial_result", "lost_ack", "capability_unavailable"]
    assert cov["lost_ack"][2:5] == ["1", "1", "3"] and cov["partial_result"][2:5] == ["0", "0", "0"]
    for cond, c in doc["fault_coverage"].items():
        assert cov[cond][2:5] == [str(c["attempts"]), str(c["admitted_executions"]), str(c["admitted_target_tokens"])]
        assert cov[cond][5] == "; ".join(c["expected_responses"])
    assert _cells(browser, "route-faults") == [["g1", "i1", "faults@1", "lost_ack", "c1", "admitted"]]
    assert _cells(browser, "probes") == [["gap-1", "context", "p1", "failure_persists", "added API version fact"],
                                         ["gap-1", "interface", "p2", "failure_persists", ""],
                                         ["gap-1", "runtime", "p3", "failure_persists", ""]]
    # a route of a store with no SPEC 6.10 evidence shows none of it
    plain = _api_json(server, "/api/routes/sft")
    assert plain["fault_coverage"] is None and plain["probe_evidence"] is None and plain["faults"] == []
    assert "Fault-injection coverage" not in _get(server + "/routes/sft")[2]


def test_execution_page_shows_diffs_feedback_faults_and_controls(evidence, evidence_server, browser, capsys):
    from selenium.webdriver.common.by import By

    show = _cli_json(capsys, "--store", evidence["url"], "admission", "show", "feedback_rl", "--json")[1]
    row = next(e for e in show["executions"] if e["execution_id"] == "tamper")
    assert (row["state"], row["predicate"], row["verdict"]) == ("rejected", "protected_paths", "fail")
    ev = _api_json(evidence_server, "/api/executions/tamper")["evidence"]
    assert ev["protected_paths"] == {"verdict": "fail", "reason": row["reason"], "missing_evidence": None}
    assert row["reason"] == "artifact v1 changes protected path tests/test_pool.py (protected by tests/**), not allowed by the task"
    browser.get(evidence_server + "/executions/tamper")
    assert browser.find_element(By.ID, "protected-paths").text == "fail"
    assert browser.find_element(By.ID, "protected-paths-reason").text == row["reason"]
    assert _cells(browser, "artifact-diffs") == [["v1", "abc123", "src/pool.py", "allowed", "recorded"],
                                                 ["v1", "abc123", "tests/test_pool.py", "protected by tests/**", "recorded"]]
    assert browser.find_element(By.ID, "feedback-verdict").text == "pass"  # feedback passes; the diff still rejects
    browser.get(evidence_server + "/executions/ref")
    assert browser.find_element(By.ID, "protected-paths").text == "pass"
    assert [r[2:4] for r in _cells(browser, "artifact-diffs")] == [["src/pool.py", "allowed"],
                                                                  ["tests/regression/test_pool_fix.py", "allowed"]]
    assert _cells(browser, "grader-controls") == [["repair_accept_v1@1", "adequate", "pass"], ["strict@2", "adequate", "pass"]]
    assert "calibration control: adequate control for repair_accept_v1@1; controls are never admitted" in browser.page_source

    g1 = _api_json(evidence_server, "/api/executions/g1")["evidence"]
    assert [(f["injection_id"], f["condition"], f["target_call_id"], f["simulated_state"]) for f in g1["faults"]] == [
        ("i1", "lost_ack", "c1", {"write_committed": True})]
    browser.get(evidence_server + "/executions/g1")
    assert _cells(browser, "faults") == [["i1", "faults@1", "lost_ack", "c1", "write_committed yes",
                                          "reconcile the identified operation before a dependent retry (reconcile before "
                                          "retry) (Table 9 default)"]]
    assert [r[1:4] for r in _cells(browser, "feedback")] == [["accepted", "-", "consent/2031-07"]]
    assert [r[0] for r in _cells(browser, "feedback")] == [f["occurred_at"] for f in g1["feedback"]]
    assert browser.find_element(By.ID, "feedback-verdict").text == "pass"
    s1 = _api_json(evidence_server, "/api/executions/s1")["evidence"]
    fb = next(e for e in show["executions"] if e["execution_id"] == "s1")
    assert s1["feedback_verdict"]["verdict"] == "fail" and (fb["predicate"], fb["verdict"]) == ("feedback", "fail")
    assert s1["feedback_verdict"]["reason"] == fb["reason"]
    assert g1["artifact_diffs"] == [] and g1["protected_paths"] is None  # task gap-1 protects nothing, no diff


def test_evidence_pages_bad_input_gets_404_or_400(evidence, evidence_server, browser):
    from selenium.webdriver.common.by import By

    cases = {"/graders/nope@1": 404, "/campaigns/nope": 404, "/campaigns/pool-repair?route=open_sft": 400,
             "/campaigns/pool-repair?route=a&route=b": 400, "/graders?bogus=1": 400, "/campaigns?route=x": 400,
             "/graders/strict@2?route=x": 400}
    for path, want in cases.items():
        status, _, body = _get(evidence_server + path)
        assert status == want and "Traceback" not in body and 'id="error"' in body, (path, status, body)
        j_status, _, j_body = _get(evidence_server + path + ("&" if "?" in path else "?") + "format=json")
        assert j_status == want and json.loads(j_body)["status"] == want, path
        api_status = _get(evidence_server + "/api" + path)[0]
        assert api_status == want, path
    assert _get(evidence_server + "/graders", "POST")[0] == 405
    browser.get(evidence_server + "/campaigns/nope")
    assert browser.find_element(By.TAG_NAME, "h1").text == "404 Not found"
    assert browser.find_element(By.ID, "error").text == ("no collection campaign 'nope' (known: ghost, other-campaign, "
                                                         "pool-repair)")
    browser.get(evidence_server + "/campaigns/pool-repair?route=open_sft")
    assert browser.find_element(By.ID, "error").text == ("route 'open_sft' names no version of collection 'pool-repair' "
                                                         "(routes naming it: repair_sft)")
