"""`ledger run -- COMMAND` (SPEC §11.4): a harness process gets its execution opened, the SDKs'
base URLs pointed at the gateway, and the execution closed `completed` (exit 0) or `error` (any
other exit, a signal included); `ledger run` exits with COMMAND's code. The OpenAI Agents SDK
with its default (Responses) model runs a tool loop through it, recorded as one exact chain."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ledger.cli import main as cli_main
from ledger.gateway.run import harness_env
from tests.gateway_helpers import ANSWER, TOOL_CALL, init_store, log_requests

pytestmark = pytest.mark.timeout(180)
SCRIPTS = Path(__file__).resolve().parent / "harness_scripts"


def _closed(store: Path, ex: str) -> list[str]:
    from ledger import open_log
    from ledger.events.codec import default_codec

    codec = default_codec()
    with open_log(str(store)) as log:
        return [codec.decode(r.value)["status"] for p in log.partitions() for r in log.read(p)
                if r.event_type == "execution_closed" and codec.decode(r.value)["execution_id"] == ex]


def _run(store: Path, engine, ex: str, *command: str, gateway: str | None = None) -> int:
    where = ["--gateway", gateway] if gateway else ["--upstream", engine.url, "--api", "vllm",
                                                    "--tokenizer", "qwen3.6-27b", "--model", "tiny"]
    return cli_main(["--store", str(store), "run", "--execution", ex, "--task", "t-run", *where, "--", *command])


def test_agents_sdk_tool_loop_through_ledger_run(tmp_path, engine, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    store = init_store(tmp_path / "store")
    n0 = len(engine.history)
    rc = _run(store, engine, "ex-agents", sys.executable, str(SCRIPTS / "agents_tool_loop.py"),
              json.dumps(TOOL_CALL), json.dumps(ANSWER))
    assert rc == 0
    reqs = log_requests(store, "ex-agents")
    calls = engine.history[n0:]
    assert [(r["input"], r["output"]) for r in reqs] == [(c["prompt"], c["tokens"]) for c in calls]
    assert len(reqs) == 2 and reqs[1]["input_prefix"]["request_id"] == reqs[0]["request_id"]
    assert reqs[1]["input"][:len(reqs[0]["input"]) + len(reqs[0]["output"])] == reqs[0]["input"] + reqs[0]["output"]
    assert reqs[1]["consumed_tool_call_ids"] == reqs[0]["emitted_tool_call_ids"] != []
    assert _closed(store, "ex-agents") == ["completed"]


@pytest.mark.parametrize("how,code,status", [("0", 0, "completed"), ("3", 3, "error"), ("TERM", 128 + 15, "error")])
def test_cli_harness_exit_code_and_status(tmp_path, engine, how, code, status):
    store = init_store(tmp_path / "store")
    ex = f"ex-cli-{how}"
    assert _run(store, engine, ex, sys.executable, str(SCRIPTS / "clients_then_exit.py"), json.dumps(ANSWER),
                how) == code
    assert {r["agent_id"] for r in log_requests(store, ex)} == {"claude", "codex"}
    assert _closed(store, ex) == [status]


def test_run_against_a_running_gateway(gateway, engine):
    ex = "ex-external"
    assert _run(gateway.store, engine, ex, sys.executable, "-c", "import sys; sys.exit(0)", gateway=gateway.url) == 0
    assert _run(gateway.store, engine, "ex-missing", "/no/such/harness", gateway=gateway.url) == 127
    gateway.recorder.flush()
    assert _closed(gateway.store, ex) == ["completed"] and _closed(gateway.store, "ex-missing") == ["error"]


def test_env_and_usage_errors(tmp_path, capsys):
    env = harness_env("http://h:1", "e1", {"OPENAI_API_KEY": "mine"})
    assert env["OPENAI_BASE_URL"] == "http://h:1/executions/e1/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://h:1/executions/e1"
    # SPEC 12.3: every harness API key is the execution's token (here none: a gateway without credentials),
    # replacing a key in the environment, so a real provider key never reaches the gateway
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == env["GEMINI_API_KEY"] == "ledger-run"
    env = harness_env("http://h:1", "e1", {"OPENAI_API_KEY": "mine"}, token="tok")
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == env["GEMINI_API_KEY"] == "tok"
    store = init_store(tmp_path / "s")
    capsys.readouterr()
    assert cli_main(["--store", str(store), "run", "--gateway", "http://127.0.0.1:9"]) == 2
    assert "give the harness command after --" in capsys.readouterr().err
    assert cli_main(["--store", str(store), "run", "--", "true"]) == 2
    assert "--upstream, --api and --tokenizer are needed" in capsys.readouterr().err
    assert cli_main(["--store", str(store), "run", "--gateway", "http://127.0.0.1:9", "--", "true"]) == 2
    assert "no gateway at http://127.0.0.1:9" in capsys.readouterr().err
