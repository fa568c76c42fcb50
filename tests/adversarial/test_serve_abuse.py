"""`ledger serve` cannot be abused (issue 27 items 5 and 6, SPEC 11.7).

DNS rebinding: a web page the user opens points a name it controls (``evil.example``) at
127.0.0.1 and reads the store through it; every request then carries ``Host: evil.example``.
The server answers only its own names (listen address, localhost, ``--allow-host``): anything
else gets 421 (400 for a missing or malformed ``Host``) and none of the store's data, and no
response carries a CORS header.  A huge integer in a URL, and a fuzzed URL of any route, is a
404 or a 400, never a 500.  The attacks go through a real ``ledger serve`` subprocess with raw
``http.client`` (which sends exactly the ``Host`` header it is given).
"""

from __future__ import annotations

import http.client
import json
import string
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.cli import main

from ..helpers import Signer
from ..test_manifest import Store, _base_lines

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A store with a route, a published manifest (sft v1) and an up-to-date projection database."""
    root = tmp_path_factory.mktemp("serve-abuse")
    s = Store(root, Signer())
    s.ingest(_base_lines())
    url = s.paths.url
    assert main(["--store", url, "project"]) == 0
    assert main(["--store", url, "manifest", "publish", "sft", "--key", str(s.key), "--out", str(root / "m1.json")]) == 0
    return url


def _serve(url: str, *extra: str):
    proc = subprocess.Popen([sys.executable, "-m", "ledger.cli", "--store", url, "serve", "--listen", "127.0.0.1:0",
                             *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.fail(f"ledger serve did not start: {proc.stderr.read()}")
    port = int(line.split(" on ", 1)[1].split()[0].rstrip("/").rsplit(":", 1)[1])
    return proc, port


@pytest.fixture(scope="module")
def server(published):
    proc, port = _serve(published, "--allow-host", "ledger.internal", "--allow-host", "Curators.Example:8443")
    yield port
    proc.terminate()
    proc.wait(10)


def _get(port: int, target: str, host: str | None, method: str = "GET", headers: dict | None = None):
    """One request with exactly the given Host header (None: no Host header at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


PAGES = ["/", "/api", "/executions", "/api/executions", "/executions/e1", "/api/executions/e1", "/tree/e1",
         "/routes", "/routes/sft", "/manifests", "/manifests/view?route=sft&version=1", "/splits", "/withdrawals",
         "/graders", "/campaigns", "/tasks", "/runs", "/runs/run-7", "/manifests/croissant?route=sft&version=1"]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}",
                                  "localhost.evil.example", "LOCALHOST.evil"])
def test_a_foreign_host_gets_421_and_no_data(server, published, host):
    for page in PAGES:
        status, headers, body = _get(server, page, host.format(port=server))
        assert status == 421, (page, status)
        text = body.decode()
        assert text.startswith("misdirected request: ") and "is not a name of this server" in text
        for secret in ("e1", "vendor-a", published, '"log"', "qwen", "policy-team"):  # nothing of the store leaks
            assert secret not in text
        assert not any(k.startswith("access-control-") for k in headers)


@pytest.mark.parametrize("host,status", [(None, 400), ("", 400), ("localhost:http", 400), ("[::1", 400),
                                         ("localhost:{port}:1", 400)])
def test_a_missing_or_malformed_host_is_400(server, host, status):
    got, headers, body = _get(server, "/api", None if host is None else host.format(port=server))
    assert got == status and b"executions" not in body
    assert not any(k.startswith("access-control-") for k in headers)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "localhost", "LocalHost.:{port}",
                                  "[::1]:{port}", "ledger.internal:{port}", "curators.example"])
def test_own_names_and_allowed_hosts_are_answered(server, host):
    status, headers, body = _get(server, "/api", host.format(port=server))
    assert status == 200, body[:200]
    assert json.loads(body)["log"]["events"] > 0
    assert not any(k.startswith("access-control-") for k in headers)


def test_no_cors_headers_even_for_a_preflight_from_a_page(server):
    for method, target in (("OPTIONS", "/api/executions"), ("GET", "/api/executions"), ("POST", "/manifests/verify")):
        status, headers, _ = _get(server, target, f"127.0.0.1:{server}", method,
                                  {"Origin": "http://evil.example", "Access-Control-Request-Method": "GET",
                                   "Content-Length": "0"})
        assert status in (200, 400, 405), (method, status)
        assert not any(k.startswith("access-control-") for k in headers), headers


def test_allow_host_refuses_a_bad_name(published, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--store", published, "serve", "--allow-host", "evil.example/x"])
    assert exc.value.code == 2 and "not a host name" in capsys.readouterr().err


# ------------------------------------------------------------------ huge integers and fuzzed URLs (item 6)
HUGE = "99999999999999999999"


@pytest.mark.parametrize("target,status", [
    (f"/manifest/rl-main/{HUGE}", 404),
    (f"/manifests/view?route=sft&version={HUGE}", 400),
    (f"/api/manifests/view?route=sft&version={HUGE}", 400),
    (f"/manifests/view?route=sft&version=-{HUGE}", 400),
    (f"/manifests/view?route=sft&version={'9' * 5000}", 400),
    (f"/manifests/prove?route=sft&version={HUGE}&member=m", 400),
    (f"/manifests/diff?route=sft&a=1&b={HUGE}", 400),
    (f"/executions?limit={HUGE}", 400),
    (f"/executions?page={HUGE}", 400),
    ("/executions?page=1000000000&limit=5000", 200),  # far past the end: an empty page, not an error
    (f"/tasks?page={HUGE}", 400),
    (f"/manifests/view?route=sft&version=1&page={HUGE}", 400),
    (f"/manifests/croissant?route=sft&version={HUGE}", 400),
    (f"/runs/{HUGE}", 404),
    ("/executions/e1?leaf=%FF", 400),
    (f"/manifests/view?route=sft&version=9223372036854775807", 404),
    (f"/manifests/view?route=sft&version=9223372036854775808", 400),
    (f"/executions/{HUGE}", 404),
    (f"/routes/{HUGE}", 404),
    ("/executions/%FF%FE", 404),  # bytes that are not UTF-8, a lone surrogate, NUL, an overlong '/'
    ("/tree/%ED%A0%80", 404),
    ("/routes/%00", 404),
    ("/graders/%C0%AF", 404),
    ("/executions?task=%ED%A0%80&limit=%FF", 400),
])
def test_a_huge_integer_in_a_url_is_404_or_400(server, target, status):
    got, _headers, body = _get(server, target, f"127.0.0.1:{server}")
    assert got == status, body[:300]
    assert b"internal error" not in body


_PATHS = ["/", "/executions", "/executions/{}", "/tree/{}", "/routes", "/routes/{}", "/splits", "/manifests",
          "/manifests/view", "/manifests/prove", "/manifests/diff", "/withdrawals", "/graders", "/graders/{}",
          "/campaigns", "/campaigns/{}", "/nowhere/{}", "/tasks", "/runs", "/runs/{}", "/manifests/croissant"]
_PARAMS = ["route", "version", "member", "a", "b", "limit", "task", "split", "state", "role_class", "status",
           "subject", "format", "x", "page", "sort", "order", "erased", "leaf", "source"]
_segment = st.one_of(st.integers(min_value=-10**30, max_value=10**30).map(str), st.sampled_from(["e1", "sft", "t1"]),
                     st.text(min_size=1, max_size=40), st.text(string.digits, min_size=19, max_size=60))
_value = st.one_of(_segment, st.sampled_from(["", "1", "2", "json", "html", "main/task", "admitted", "train",
                                              "execution:e1", "source:vendor-a", "*", "%00", "0", "-1"]))


@st.composite
def _urls(draw) -> tuple[str, str]:
    path = draw(st.sampled_from(_PATHS)).replace("{}", quote(draw(_segment), safe=""))
    if draw(st.booleans()):
        path = "/api" + (path if path != "/" else "")
    params = draw(st.lists(st.tuples(st.sampled_from(_PARAMS), _value), max_size=5))
    method = "POST" if draw(st.integers(0, 9)) == 0 else "GET"
    if method == "POST":
        path = draw(st.sampled_from(["/manifests/verify", "/api/manifests/verify"]))
        params = [p for p in params if p[0] != "version"] + [("route", "sft"), ("version", draw(_segment))]
    return method, path + ("?" + urlencode(params) if params else "")


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(url=_urls())
def test_no_url_of_any_route_is_a_500(server, url):
    method, target = url
    status, headers, body = _get(server, target, f"localhost:{server}", method, {"Content-Length": "0"})
    assert status in (200, 400, 404, 405), (method, target, status, body[:300])
    assert b"internal error" not in body
    assert not any(k.startswith("access-control-") for k in headers)
