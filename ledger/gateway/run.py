"""`ledger run -- COMMAND ...` (SPEC §11.4): one recorded execution around a harness process.

Opens the execution on a gateway (``--gateway URL``, or one started in this process for the
command's duration), runs COMMAND with ``OPENAI_BASE_URL=URL/executions/E/v1`` and
``ANTHROPIC_BASE_URL=URL/executions/E`` (each SDK's own convention: the Anthropic client appends
``/v1/messages`` itself) — every process the harness spawns inherits them, so sub-agents land in
the same execution — and closes it ``completed`` when COMMAND exits 0, ``error`` otherwise (a
signal included). Returns COMMAND's exit code (128 + N for signal N, 127 when it cannot start).
The execution is opened and closed through the gateway's own control endpoints
(``POST /executions/{id}/ledger/open`` and ``.../close``), so ``--gateway`` needs no store access.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from typing import Any, Sequence
from urllib.parse import quote

from ledger.gateway.app import make_app
from ledger.gateway.serve import serve_in_background

__all__ = ["harness_command", "harness_env", "run_harness"]


#: the API-key variables of the harnesses ``ledger run`` serves; each is set to the execution's token
API_KEY_VARIABLES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "CODEX_API_KEY")


def harness_env(url: str, execution_id: str, base: dict[str, str] | None = None,
                token: str | None = None, context_length: int | None = None) -> dict[str, str]:
    """The environment COMMAND runs with (SPEC 12.1): the gateway's base URL of every protocol and, as
    every harness's API key, the execution's token (SPEC 12.3), replacing any key in the environment: a
    real provider key is never sent to the gateway, and the token lets the harness write into this
    execution only. ``context_length``: the model's window, for Claude Code, which refuses a model it
    does not know without one (``CLAUDE_CODE_MAX_CONTEXT_TOKENS``; a value already set is kept)."""
    env = dict(os.environ if base is None else base)
    env["OPENAI_BASE_URL"] = f"{url}/executions/{execution_id}/v1"
    env["ANTHROPIC_BASE_URL"] = f"{url}/executions/{execution_id}"
    env["LEDGER_EXECUTION_ID"] = execution_id
    for name in API_KEY_VARIABLES:
        env[name] = token or "ledger-run"  # the SDKs refuse to start without one; never recorded
    if context_length is not None:
        env.setdefault("CLAUDE_CODE_MAX_CONTEXT_TOKENS", str(context_length))
    return env


def harness_command(command: Sequence[str], url: str, execution_id: str) -> list[str]:
    """COMMAND with what a harness needs on its command line: Codex CLI reads no base URL from the
    environment (0.171 ignores ``OPENAI_BASE_URL``), so ``codex ...`` gets ``-c openai_base_url=URL``
    first (a global option; one the user gave is left alone)."""
    cmd = list(command)
    if cmd and os.path.basename(cmd[0]) == "codex" and not any("openai_base_url" in a for a in cmd[1:]):
        return [cmd[0], "-c", f"openai_base_url={url}/executions/{execution_id}/v1", *cmd[1:]]
    return cmd


def _control(url: str, execution_id: str, action: str, body: dict, admin: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if admin is not None:
        headers["Authorization"] = f"Bearer {admin}"
    req = urllib.request.Request(f"{url}/executions/{quote(execution_id, safe='')}/ledger/{action}",
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = f"HTTP {exc.code}"
        raise ValueError(f"the gateway refused to {action} execution {execution_id!r}: {msg}") from None
    except OSError as exc:
        raise ValueError(f"no gateway at {url}: {exc}") from None


def _wait(proc: subprocess.Popen) -> int:
    """Wait for COMMAND, forwarding SIGINT / SIGTERM to it; its exit code (128 + N for a signal)."""
    def forward(signum, _frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc


def run_harness(args: Any, command: Sequence[str], gateway: tuple | None, paths: Any, admin: str | None = None) -> int:
    """Open, run, close; ``gateway`` is ``(Gateway, recorder, log, host, port)`` to serve here, or None
    to use ``args.gateway``; ``admin``: the gateway's admin token (None: a gateway without credentials)."""
    stop = None
    if gateway is not None:
        gw, rec, log, host, port = gateway
        admin = gw.auth.admin
        url, stop = serve_in_background(make_app(gw), host, port)
    else:
        url = args.gateway.rstrip("/")
    ex = args.execution or f"run-{uuid.uuid4().hex[:16]}"
    deadline = args.deadline or (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=24)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    try:
        opened = _control(url, ex, "open", {"task_id": args.task, "deadline": deadline}, admin)
        print(f"ledger run: execution {ex} via {url}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.Popen(harness_command(command, url, ex),
                                    env=harness_env(url, ex, token=opened.get("token"),
                                                    context_length=opened.get("context_length")))
        except OSError as exc:
            print(f"ledger run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
            rc = 127
        else:
            rc = _wait(proc)
        status = "completed" if rc == 0 else "error"
        _control(url, ex, "close", {"status": status}, admin)
        print(f"ledger run: execution {ex} closed {status} (exit {rc})", file=sys.stderr, flush=True)
        return rc
    finally:
        if stop is not None:
            stop()
            gateway[1].close()
            gateway[2].close()
