"""Capture gateway overhead (SPEC §7.6): latency the gateway adds per call (p50 / p99) and its
calls/s, against calling the same engine directly with the same token IDs in the same run.

Engine: ONNX Runtime running the tiny random Qwen-vocabulary model of workloads/tiny_engine.py
behind vLLM's ``/v1/completions`` wire format. Each sample: one gateway call through the
official ``openai`` client (render + restore + upstream + record + flush to a sealed embedded
store), then the engine called directly (urllib) with the prompt the gateway sent.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from .common import row

CALLS_PER_EXECUTION = 8
EXECUTIONS = 8
SHORT = ["Done ", {"word": [1, 3]}]
TOOL = ['<tool_call>\n{"name": "read", "arguments": {"path": "', {"word": [1, 3]}, '"}}\n</tool_call>']


def _start_gateway(store: Path, upstream: str):
    from ledger import open_log
    from ledger.cli import main as cli_main
    from ledger.gateway.app import make_app
    from ledger.gateway.calls import Gateway
    from ledger.gateway.serve import serve_in_background
    from ledger.gateway.store import gateway_db_path
    from ledger.producers.recorder import Recorder

    assert cli_main(["--store", str(store), "init"]) == 0
    log = open_log(str(store))
    rec = Recorder(log, producer="bench-gateway")
    gw = Gateway(rec, upstream=upstream, api="vllm", tokenizer_name="qwen3.6-27b", state_db=gateway_db_path(store),
                 model="tiny")
    url, stop_server = serve_in_background(make_app(gw))

    def stop() -> None:
        stop_server()
        rec.close()
        log.close()

    return url, stop


def _direct(url: str, prompt: list[int], seed: int, constraint) -> None:
    body = {"prompt": prompt, "max_tokens": 40, "logprobs": 1, "return_token_ids": True, "seed": seed,
            "constraint": constraint}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _loop(client, ex: int, samples: list | None, engine, engine_url: str) -> None:
    msgs = [{"role": "system", "content": "bench"}, {"role": "user", "content": f"task {ex}"}]
    for step in range(CALLS_PER_EXECUTION):
        cons = TOOL if step < CALLS_PER_EXECUTION - 1 else SHORT
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, seed=ex * 100 + step,
                                           extra_body={"constraint": cons})
        t_gw = time.perf_counter() - t0
        if samples is not None:
            prompt = engine.history[-1]["prompt"]
            t0 = time.perf_counter()
            _direct(engine_url, prompt, ex * 100 + step, cons)
            samples.append((t_gw, time.perf_counter() - t0, prompt, ex * 100 + step, cons))
        m = r.choices[0].message
        msgs.append({"role": "assistant", "content": m.content,
                     "tool_calls": [tc.model_dump() for tc in m.tool_calls] if m.tool_calls else None})
        for tc in m.tool_calls or ():
            msgs.append({"role": "tool", "tool_call_id": tc.id, "content": f"result {step}"})


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run() -> list[dict]:
    import openai

    from workloads.tiny_engine import OrtEngine, serve

    engine = serve(OrtEngine(seed=0))
    tmp = tempfile.TemporaryDirectory()
    url, stop = _start_gateway(Path(tmp.name) / "store", engine.url)
    try:
        def client(ex: str):
            return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, default_headers={
                "X-Ledger-Execution-Id": ex, "X-Ledger-Task-Id": "t", "X-Ledger-Deadline": "2030-01-01T00:00:00Z"})

        _loop(client("warm"), 99, None, engine, engine.url)
        samples: list[tuple] = []
        for ex in range(EXECUTIONS):  # sequential: latency
            _loop(client(f"lat-{ex}"), ex, samples, engine, engine.url)
        gw_t = [s[0] for s in samples]
        di_t = [s[1] for s in samples]
        added = [s[0] - s[1] for s in samples]

        def throughput(fn) -> float:
            threads = [threading.Thread(target=fn, args=(k,)) for k in range(4)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return len(samples) / (time.perf_counter() - t0)

        # the same work both ways: 4 harnesses x 2 executions through the gateway, and the 64
        # prompts (with their seeds and constraints) of the latency phase sent directly
        gw_rate = throughput(lambda k: [_loop(client(f"tp-{k}-{j}"), 50 + 2 * k + j, None, engine, engine.url)
                                        for j in range(EXECUTIONS // 4)])
        di_rate = throughput(lambda k: [_direct(engine.url, s[2], s[3], s[4]) for s in samples[k::4]])
    finally:
        stop()
        engine.close()
        tmp.cleanup()
    n = len(samples)
    return [
        row(f"gateway call latency p50 ({n} calls, ms)", 1000 * _pct(gw_t, 0.5), 1000 * _pct(di_t, 0.5), "ms",
            note="baseline: the engine called directly"),
        row("gateway call latency p99 (ms)", 1000 * _pct(gw_t, 0.99), 1000 * _pct(di_t, 0.99), "ms"),
        row("added latency per call p50 (ms)", 1000 * _pct(added, 0.5), 1000 * _pct(di_t, 0.5), "ms",
            note="baseline: direct call p50"),
        row("added latency per call p99 (ms)", 1000 * _pct(added, 0.99), 1000 * _pct(di_t, 0.99), "ms"),
        row("calls/s, 4 concurrent harnesses", gw_rate, di_rate, "calls/s", note="baseline: direct calls/s"),
    ]


if __name__ == "__main__":
    from .common import print_table

    print_table(run())
