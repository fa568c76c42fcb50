"""Shared pieces of the gateway tests: a store, a gateway on a loopback port, the recorded lines."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from ledger import open_log
from ledger.cli import main as cli_main
from ledger.gateway.app import make_app
from ledger.gateway.calls import Gateway
from ledger.gateway.serve import serve_in_background
from ledger.gateway.store import gateway_db_path
from ledger.producers.recorder import Recorder

READ_TOOL = {"type": "function", "function": {"name": "read", "description": "read a file",
                                              "parameters": {"type": "object", "properties": {
                                                  "path": {"type": "string"}, "n": {"type": "integer"}}}}}
TOOL_CALL = ["<think>\n", {"word": [1, 6]}, " ", {"word": [1, 6]}, "\n</think>\n\n<tool_call>\n"
             '{"name": "read", "arguments": {"path": "', {"word": [1, 8]}, '", "n": 3}}\n</tool_call>']
ANSWER = ["<think>\n", {"word": [1, 6]}, "\n</think>\n\nDone ", {"word": [1, 6]}]
SUMMARY = ["<summary>\n", {"word": [1, 6]}, " ", {"word": [1, 6]}, "\n</summary>"]


#: base URL of a gateway process started by a test -> its admin token (clients built from a URL use it)
ADMIN_TOKENS: dict[str, str] = {}


class RunningGateway:
    def __init__(self, store: Path, upstream: str, api: str, timeout: float = 30.0, fmt=None) -> None:
        """``fmt``: the model format (a :class:`ChatFormat`; the Qwen3.6 one when None)."""
        self.store = store
        self.tee = io.StringIO()
        self.log = open_log(str(store))
        self.recorder = Recorder(self.log, producer="ledger-gateway", tee=self.tee)
        self.gw = Gateway(self.recorder, upstream=upstream, api=api,
                          tokenizer_name=fmt.name if fmt is not None else "qwen3.6-27b",
                          state_db=gateway_db_path(store), model="tiny", timeout=timeout, fmt=fmt)
        self.url, self._stop = serve_in_background(make_app(self.gw))

    def client(self, execution: str, *, agent: str = "main", tier: str = "main", kind: str = "task", **headers):
        import openai

        h = {"X-Ledger-Execution-Id": execution, "X-Ledger-Agent-Id": agent, "X-Ledger-Agent-Tier": tier,
             "X-Ledger-Turn-Kind": kind, "X-Ledger-Task-Id": f"task-{execution}",
             "X-Ledger-Deadline": "2030-01-01T00:00:00Z", **headers}
        return openai.OpenAI(base_url=self.url + "/v1", api_key=getattr(self, "token", "unused"), default_headers=h,
                             max_retries=0,
                             timeout=60)

    def lines(self, type_: str = "request", execution: str | None = None) -> list[dict]:
        self.recorder.flush()
        out = [json.loads(x) for x in self.tee.getvalue().splitlines()]
        return [x for x in out if x["type"] == type_ and (execution is None or x["execution_id"] == execution)]

    def path(self, execution: str, request_id: str) -> list[int]:
        """The request's input+output as the log holds it (sealed tokens opened with the store's keys)."""
        import numpy as np

        raw = self.recorder.ingestor.request_path(execution, request_id)
        return np.frombuffer(raw, dtype="<u4").tolist()

    def close(self) -> None:
        self._stop()
        self.recorder.close()
        self.log.close()


def init_store(path: Path) -> Path:
    assert cli_main(["--store", str(path), "init"]) == 0
    return path


def inputs_of(lines: list[dict]) -> dict[str, list[int]]:
    """request id -> full input IDs, rebuilt from prefix references (in recording order)."""
    paths: dict[str, list[int]] = {}
    inputs: dict[str, list[int]] = {}
    for ln in lines:
        if "input_ids" in ln:
            inp = ln["input_ids"]
        else:
            ref = ln["input_prefix"]
            inp = paths[ref["request_id"]][:ref["length"]] + ln["input_suffix_ids"]
        inputs[ln["request_id"]] = inp
        paths[ln["request_id"]] = inp + ln["output_ids"]
    return inputs


class GatewayProcess:
    """`ledger gateway` as its own process (the CLI, on a free loopback port), for restart tests."""

    def __init__(self, store: Path, upstream: str, api: str = "vllm", *, workers: int = 1,
                 env: dict | None = None, no_auth: bool = False, extra: list[str] | None = None) -> None:
        import socket
        import subprocess
        import sys
        import time
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.store = store
        self.url = f"http://127.0.0.1:{port}"
        root = Path(__file__).resolve().parent.parent
        self.proc = subprocess.Popen([sys.executable, "-m", "ledger.cli", "--store", str(store), "gateway",
                                      "--upstream", upstream, "--api", api, "--tokenizer", "qwen3.6-27b",
                                      "--model", "tiny", "--listen", f"127.0.0.1:{port}", "--timeout", "30",
                                      "--workers", str(workers), *(["--no-auth"] if no_auth else []), *(extra or [])],
                                     cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"ledger gateway did not start: {self.proc.communicate()[1]}")
            time.sleep(0.05)

        # authentication is on (SPEC 12.3): the clients use the admin token `ledger gateway` wrote to the store
        self.token = "unused" if no_auth else (store / "gateway.token").read_text().strip()
        ADMIN_TOKENS[self.url] = self.token

    client = RunningGateway.client

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (what was acknowledged must already be durable)."""
        self.proc.kill()
        self.proc.communicate(timeout=10)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.communicate(timeout=10)


def log_requests(store: Path, execution: str) -> list[dict]:
    """The execution's request events as the log holds them, in log order, tokens opened with the
    store's keys: each with ``input`` / ``output`` (full token lists) and ``input_prefix``."""
    import numpy as np

    from ledger.events.codec import default_codec
    from ledger.producers.ingest import Ingestor

    log = open_log(str(store))
    try:
        ing = Ingestor(log)
        codec = default_codec()
        out = []
        for part in log.partitions():
            for rec in log.read(part):
                if rec.event_type != "request":
                    continue
                ev = ing.opened_request(codec.decode(rec.value))
                if ev["execution_id"] != execution:
                    continue
                path = np.frombuffer(ing.request_path(execution, ev["request_id"]), dtype="<u4").tolist()
                n = len(ev["output_ids"]) // 4
                out.append({**{k: v for k, v in ev.items() if not isinstance(v, bytes)},
                            "input": path[:len(path) - n], "output": path[len(path) - n:]})
        return out
    finally:
        log.close()
