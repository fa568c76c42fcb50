"""Capture gateway capacity (SPEC §11.8, issue 29): closed-loop sessions through the gateway vs
straight to the engine, and the gateway's CPU per turn.

* **Mock engine** (its own process, ``python -m benchmarks.bench_gateway_load engine PORT``): costs
  no CPU — it sleeps ``LATENCY`` s and answers a fixed reply, in vLLM's token-ID format
  (``POST /v1/completions``: ``token_ids`` + log-probs, what the gateway calls) and, for the direct
  arm, as a chat completion (``POST /v1/chat/completions``).
* **Sessions**: closed loop (a session sends its next turn when the previous answer arrives), each
  ``TURNS`` turns growing one conversation from a ~2k-token system prompt (the reply and a short
  user message appended per turn), 8 / 32 / 96 / 192 at once; one client process (asyncio).
* **Arms**: direct; through ``ledger gateway`` (its own process, sealed embedded store) with 1 and
  2 workers. Printed: turns/s, throughput kept (gateway / direct), added p50 / p90 / p99 latency,
  gateway CPU per turn (process CPU time, workers included, / turns).
* **Context table**: gateway CPU per turn at 8k / 40k / 80k tokens of context with 2k-token
  deltas (the first turn of each session, which renders the whole context, is not counted), beside the
  same for a pass-through aiohttp proxy that captures nothing (the HTTP stack's floor). CPU is read from
  the scheduler's nanosecond clocks of every thread (``/proc/PID/task/*/schedstat``); 4 sessions x 20
  counted turns per run, each figure the median of 3 interleaved runs (a shared machine's load moves
  single runs by +-30 %).

``python -m benchmarks bench_gateway_load`` (or ``python -m benchmarks.bench_gateway_load
[--quick]`` for the tables alone, ``... context [TOKENS ...]`` for the context table alone, ``... profile
TOKENS`` for a cProfile of the gateway's own work in one process, ``... handback`` for the CPU of a kept
connection changing worker, ``... compare ROUNDS CTX[,CTX] NAME=TREE[:VAR=VALUE] ...`` for the CPU per turn of
several builds interleaved, see :func:`compare_builds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import row

LATENCY = 0.3
TURNS = 10
LEVELS = (8, 32, 96, 192)
REPLY = "Sure. I looked at the file and the next step is to run the failing test again with more logging."
ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_WORD = 3.2  # _text's words are ~3.2 Qwen3.6 tokens each ("golf41 " -> 3-4 tokens)
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")


def _words(tokens: int) -> int:
    return int(tokens / TOKENS_PER_WORD)


def _text(n_words: int, salt: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] + str((i + salt) % 89) for i in range(n_words))


# ------------------------------------------------------------------ mock engine (its own process)
def serve_engine(port: int, latency: float) -> None:
    from aiohttp import web

    from ledger.producers import chatml

    ids = chatml.encode(REPLY) + [chatml.IM_END_ID]
    completion = json.dumps({"id": "cmpl-mock", "object": "text_completion", "created": 0, "model": "mock",
                             "choices": [{"index": 0, "text": REPLY, "token_ids": ids, "finish_reason": "stop",
                                          "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": [],
                                                       "top_logprobs": []}}]}).encode()
    chat = json.dumps({"id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": "mock",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 0, "completion_tokens": len(ids), "total_tokens": len(ids)}}).encode()

    def answer(doc: bytes):
        async def handle(request: web.Request) -> web.Response:
            await request.read()
            await asyncio.sleep(latency)
            return web.Response(body=doc, content_type="application/json")
        return handle

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/completions", answer(completion))
    app.router.add_post("/v1/chat/completions", answer(chat))
    web.run_app(app, host="127.0.0.1", port=port, print=lambda *_: None, access_log=None)


def serve_passthrough(port: int, upstream: str) -> None:
    """The floor of an aiohttp token proxy (no capture): parse the chat request's JSON, send a body of its size to
    the engine, parse the engine's JSON and answer a chat completion. What any capture proxy on this stack pays."""
    from aiohttp import ClientSession, web

    from ledger.algorithms.canonical import loads_unique

    box: dict = {}

    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        loads_unique(raw.decode("utf-8"))
        if "http" not in box:
            box["http"] = ClientSession()
        async with box["http"].post(upstream + "/v1/completions", data=raw,
                                    headers={"Content-Type": "application/json"}) as r:
            doc = json.loads(await r.text())
        text = doc["choices"][0]["text"]
        return web.json_response({"id": "chatcmpl-floor", "object": "chat.completion", "created": 0, "model": "mock",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}]})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=lambda *_: None, access_log=None)


# ------------------------------------------------------------------ processes
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError as exc:
            if getattr(exc, "code", None) is not None:  # any HTTP answer: it listens
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _env(root: Path | str = ROOT, env: dict | None = None) -> dict:
    """The environment of a process running the tree ``root`` (``env``'s PYTHONPATH is appended to it)."""
    extra = dict(env or {})
    path = os.pathsep.join([str(root), *filter(None, [extra.pop("PYTHONPATH", None)])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _spawn(args: list[str], env: dict | None = None, root: Path | str = ROOT) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=root, env=_env(root, env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _init_store(store: Path, root: Path | str = ROOT, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), "init"], cwd=root, env=_env(root, env),
                   check=True, capture_output=True)


def _start_engine(latency: float) -> tuple[str, subprocess.Popen]:
    port = _port()
    proc = _spawn(["-m", "benchmarks.bench_gateway_load", "engine", str(port), str(latency)])
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", proc)
    return url, proc


def _start_gateway(store: Path, upstream: str, workers: int, root: Path | str = ROOT,
                   env: dict | None = None) -> tuple[str, subprocess.Popen]:
    port = _port()
    proc = _spawn(["-m", "ledger.cli", "--store", str(store), "gateway", "--upstream", upstream, "--api", "vllm",
                   "--tokenizer", "qwen3.6-27b", "--model", "mock", "--listen", f"127.0.0.1:{port}",
                   "--workers", str(workers), "--max-tokens", "64"], env, root)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/v1/models", proc)
    return url, proc


def _start_passthrough(upstream: str) -> tuple[str, subprocess.Popen]:
    port = _port()
    proc = _spawn(["-m", "benchmarks.bench_gateway_load", "passthrough", str(port), upstream])
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/v1/models", proc)
    return url, proc


def _cpu(pid: int) -> float:
    """CPU seconds of a process and all its descendants (nanosecond scheduler clocks of every thread where
    Linux has them; psutil's 10 ms ticks otherwise)."""
    import psutil

    p = psutil.Process(pid)
    total = 0.0
    for proc in [p, *p.children(recursive=True)]:
        try:
            total += _threads_cpu(proc.pid) if Path(f"/proc/{proc.pid}/task").is_dir() else sum(proc.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _threads_cpu(pid: int) -> float:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            pass
    return total / 1e9


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ closed-loop client
async def _session(http, url: str, ex: str, system: str, turns: int, delta_words: int, lat: list, gateway: bool,
                   on_turn=None) -> None:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"task {ex}"}]
    headers = {"X-Ledger-Execution-Id": ex, "X-Ledger-Task-Id": "bench", "X-Ledger-Deadline": "2030-01-01T00:00:00Z"} \
        if gateway else {}
    for turn in range(turns):
        t0 = time.perf_counter()
        async with http.post(url + "/v1/chat/completions", json={"model": "mock", "messages": msgs, "max_tokens": 64},
                             headers=headers) as r:
            doc = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {doc}")
        lat.append(time.perf_counter() - t0)
        msgs += [{"role": "assistant", "content": doc["choices"][0]["message"]["content"]},
                 {"role": "user", "content": _text(delta_words, turn) if delta_words else f"next {turn}"}]
        if on_turn is not None:
            await on_turn(turn)


async def _load(url: str, n: int, turns: int, gateway: bool, tag: str, system_words: int = _words(2000),
                delta_words: int = 0, barrier_cpu=None, own_pools: bool = False) -> tuple[float, list[float]]:
    """``n`` closed-loop sessions; one aiohttp connection pool shared by all (the reported arms), or
    (``own_pools``) one per session, as under ``ledger run`` where each harness has its own SDK client."""
    import aiohttp

    lat: list[float] = []
    system = _text(system_words)
    hooks = None
    if barrier_cpu is not None:  # every session's first turn done -> CPU snapshot (the context table)
        first = asyncio.Barrier(n)

        async def hooks(turn: int) -> None:
            if turn == 0:
                if await first.wait() == 0:
                    barrier_cpu()

    def pool():
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600))

    async def one(i: int, shared) -> None:
        async with pool() if own_pools else contextlib.nullcontext(shared) as http:
            await _session(http, url, f"{tag}-{i}", system + f" session {i}", turns, delta_words, lat, gateway, hooks)

    async with pool() as shared:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, shared) for i in range(n)))
        wall = time.perf_counter() - t0
    return n * turns / wall, lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def capacity(levels=LEVELS, turns: int = TURNS, workers=(1, 2), latency: float = LATENCY,
             own_pools: bool = False) -> list[dict]:
    """One row per (arm, sessions): turns/s, kept, added p50/p90/p99 (ms), CPU ms per turn (all the gateway's
    processes; ``front_ms``: the first process's alone -- with workers, the front). ``own_pools``: every session
    its own connection pool (arms named "... own pools"), the direct arm too."""
    out = []
    tail = " own pools" if own_pools else ""
    engine, eproc = _start_engine(latency)
    try:
        direct = {n: asyncio.run(_load(engine, n, turns, False, f"d{n}", own_pools=own_pools)) for n in levels}
        for n in levels:
            tps, lat = direct[n]
            out.append({"arm": "direct" + tail, "sessions": n, "tps": tps, "kept": 1.0, "p50": _pct(lat, .5) * 1e3,
                        "p90": _pct(lat, .9) * 1e3, "p99": _pct(lat, .99) * 1e3, "cpu_ms": None})
        for w in workers:
            with tempfile.TemporaryDirectory() as tmp:
                store = Path(tmp) / "store"
                _init_store(store)
                url, gproc = _start_gateway(store, engine, w)
                try:
                    for n in levels:
                        c0, f0 = _cpu(gproc.pid), _threads_cpu(gproc.pid)
                        tps, lat = asyncio.run(_load(url, n, turns, True, f"w{w}n{n}", own_pools=own_pools))
                        cpu, front = _cpu(gproc.pid) - c0, _threads_cpu(gproc.pid) - f0
                        d = direct[n][1]
                        out.append({"arm": f"gateway {w}w{tail}", "sessions": n, "front_ms": front / (n * turns) * 1e3, "tps": tps, "kept": tps / direct[n][0],
                                    "p50": (_pct(lat, .5) - _pct(d, .5)) * 1e3, "p90": (_pct(lat, .9) - _pct(d, .9)) * 1e3,
                                    "p99": (_pct(lat, .99) - _pct(d, .99)) * 1e3, "cpu_ms": cpu / (n * turns) * 1e3})
                finally:
                    _stop(gproc)
    finally:
        _stop(eproc)
    return out


def context_cpu(contexts=(8000, 40000, 80000), sessions: int = 4, turns: int = 21, delta_words: int = _words(2000),
                latency: float = 0.05, repeats: int = 3) -> list[dict]:
    """Gateway CPU per turn (ms) at each context size, 2k-token deltas, first turns not counted; beside it the
    same for the pass-through proxy (:func:`serve_passthrough`, the HTTP floor), in the same run.  Each figure is the
    median of ``repeats`` runs, interleaved (every context and both servers once per repeat, the servers' order
    alternating), so that a burst of load from the rest of the machine moves one run of a point, not the point;
    ``runs``: every run's figure."""
    engine, eproc = _start_engine(latency)

    def gateway(ctx: int, rep: int) -> float:
        return _build_cpu(ROOT, None, engine, ctx, sessions, turns, delta_words, f"ctx{rep}-{ctx}")

    def floor(ctx: int, rep: int) -> float:
        url, pproc = _start_passthrough(engine)
        try:
            return _turn_cpu(url, pproc, ctx, sessions, turns, delta_words, f"floor{rep}-{ctx}")
        finally:
            _stop(pproc)

    runs: dict[int, dict[str, list[float]]] = {ctx: {"cpu_ms": [], "floor_ms": []} for ctx in contexts}
    try:
        for rep in range(repeats):
            for ctx in contexts:
                arms = (("cpu_ms", gateway), ("floor_ms", floor))
                for name, fn in (arms if rep % 2 == 0 else arms[::-1]):
                    runs[ctx][name].append(fn(ctx, rep))
    finally:
        _stop(eproc)
    return [{"context": ctx, "cpu_ms": statistics.median(r["cpu_ms"]), "floor_ms": statistics.median(r["floor_ms"]),
             "runs": r} for ctx, r in runs.items()]


def compare_builds(arms: list[tuple[str, str, dict]], contexts=(8000,), rounds: int = 3, sessions: int = 4,
                   turns: int = 21, delta_words: int = _words(2000), latency: float = 0.05) -> dict:
    """Gateway CPU per turn (ms) of several builds, interleaved: ``arms`` are ``(name, source tree, extra
    environment)``, say this tree and ``git archive``'s extract of a base commit (``ledger schemas projections
    workloads``), or one tree with ``LEDGER_GATEWAY_LOOP=uvloop``; per round every context and every arm once, the
    arms' order alternating.  Returns ``{(name, context): [ms per round]}``; prints each round and the medians."""
    out: dict = {(name, ctx): [] for name, _, _ in arms for ctx in contexts}
    engine, eproc = _start_engine(latency)
    try:
        for rnd in range(rounds):
            for ctx in contexts:
                for name, root, env in (arms if rnd % 2 == 0 else arms[::-1]):
                    out[(name, ctx)].append(_build_cpu(root, env, engine, ctx, sessions, turns, delta_words,
                                                       f"{name}{rnd}-"))
            print(f"round {rnd}: " + "  ".join(f"{n}@{c}={out[(n, c)][-1]:.2f}" for c in contexts for n, _, _ in arms),
                  flush=True)
    finally:
        _stop(eproc)
    print("median: " + "  ".join(f"{n}@{c}={statistics.median(out[(n, c)]):.2f}" for c in contexts for n, _, _ in arms))
    return out


def _build_cpu(root: str, env: dict, engine: str, ctx: int, sessions: int, turns: int, delta_words: int,
               tag: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        _init_store(store, root, env)
        url, proc = _start_gateway(store, engine, 1, root, env)
        try:
            return _turn_cpu(url, proc, ctx, sessions, turns, delta_words, tag)
        finally:
            _stop(proc)


def _turn_cpu(url: str, proc: subprocess.Popen, ctx: int, sessions: int, turns: int, delta_words: int,
              tag: str) -> float:
    """CPU ms per turn of the server ``proc`` under ``sessions`` closed-loop sessions of ``turns`` turns from a
    ``ctx``-token prompt, every session's first turn not counted."""
    box: dict = {}
    asyncio.run(_load(url, sessions, turns, True, tag, system_words=_words(ctx), delta_words=delta_words,
                      barrier_cpu=lambda: box.setdefault("c0", _cpu(proc.pid))))
    return (_cpu(proc.pid) - box["c0"]) / (sessions * (turns - 1)) * 1e3


def print_tables(cap: list[dict], ctx: list[dict]) -> None:
    print(f"{'arm':22} {'sessions':>8} {'turns/s':>8} {'kept':>6} {'+p50 ms':>8} {'+p90 ms':>8} {'+p99 ms':>8} "
          f"{'CPU ms/turn':>11} {'of it front':>11}")
    for r in cap:
        cpu = f"{r['cpu_ms']:.2f}" if r["cpu_ms"] is not None else ""
        front = f"{r['front_ms']:.2f}" if r.get("front_ms") is not None and "1w" not in r["arm"] else ""
        extra = "" if r["arm"].startswith("direct") else f"{r['p50']:8.1f} {r['p90']:8.1f} {r['p99']:8.1f}"
        print(f"{r['arm']:22} {r['sessions']:8d} {r['tps']:8.1f} {r['kept']:6.2f} {extra:>26} {cpu:>11} {front:>11}")
    print(f"\n{'context (tokens)':>16} {'CPU ms/turn (2k-token delta)':>30} {'pass-through proxy floor':>25}")
    for r in ctx:
        print(f"{r['context']:16d} {r['cpu_ms']:30.2f} {r.get('floor_ms', float('nan')):25.2f}")
    if ctx and len(ctx[0].get("runs", {}).get("cpu_ms", ())) > 1:
        print(f"(medians of {len(ctx[0]['runs']['cpu_ms'])} interleaved runs; gateway runs: " + ", ".join(
            f"{r['context']}: " + " / ".join(f"{x:.2f}" for x in r["runs"]["cpu_ms"]) for r in ctx) + ")")


def run() -> list[dict]:
    cap = capacity()
    ctx = context_cpu()
    print_tables(cap, ctx)
    rows = []
    for r in cap:
        if r["arm"] != "direct":
            target = 0.95 if (r["arm"], r["sessions"]) == ("gateway 1w", 32) else (
                0.9 if (r["arm"], r["sessions"]) == ("gateway 2w", 96) else None)
            rows.append(row(f"gateway load {r['arm']} {r['sessions']} sessions turns/s", r["tps"], r["tps"] / r["kept"],
                            "turns/s", target, f"CPU {r['cpu_ms']:.2f} ms/turn"))
    base = ctx[0]["cpu_ms"]
    for r in ctx:
        rows.append(row(f"gateway CPU per turn at {r['context']} tokens (2k delta)", r["cpu_ms"], base, "ms",
                        note="target <= 2 ms, flat within 30 %"))
    return rows


def _raw_turn(sock_file, sock: socket.socket, ex: str, msgs: list) -> None:
    """One chat turn of ``ex`` on a raw kept-alive connection; appends the answer and a next user message."""
    body = json.dumps({"model": "mock", "messages": msgs, "max_tokens": 16}).encode()
    sock.sendall((f"POST /executions/{ex}/v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Ledger-Task-Id: t\r\n"
                  f"X-Ledger-Deadline: 2030-01-01T00:00:00Z\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    sock_file.readline()
    length = 0
    while (line := sock_file.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    doc = json.loads(sock_file.read(length))
    msgs += [{"role": "assistant", "content": doc["choices"][0]["message"]["content"]}, {"role": "user", "content": "go on"}]


def handback(turns: int = 120, rounds: int = 4) -> None:
    """With 2 workers, one client connection, sequential turns (engine latency 0): the gateway's CPU per turn when
    two executions of one worker alternate on it (kept, never handed on), when executions of the two workers
    alternate (every turn hands the connection to the other worker), and the same with a new connection per turn
    (routed by the front, as before keep-alive). Arms in a rotating order each round."""
    from ledger.gateway.workers import worker_of

    arms = [("same worker, kept", (1, 1), False), ("alternating, handed on", (0, 1), False),
            ("alternating, new conns", (0, 1), True)]
    engine, eproc = _start_engine(0.0)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store"
            subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), "init"], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True)
            url, gproc = _start_gateway(store, engine, 2)
            host, port = url.removeprefix("http://").split(":")
            try:
                for rnd in range(rounds):
                    for name, workers, fresh in arms[rnd % 3:] + arms[:rnd % 3]:
                        names = iter(f"{name[:3]}{rnd}-{i}" for i in range(10**4))
                        exs = [next(n for n in names if worker_of(n, 2) == w) for w in workers]
                        convs = {ex: [{"role": "user", "content": f"task {ex}"}] for ex in exs}
                        sock = socket.create_connection((host, int(port)))
                        for ex in exs:  # the executions' first turns (they render the whole prompt): not counted
                            _raw_turn(sock.makefile("rb"), sock, ex, convs[ex])
                        c0, t0 = _cpu(gproc.pid), time.perf_counter()
                        for t in range(turns):
                            if fresh:
                                sock.close()
                                sock = socket.create_connection((host, int(port)))
                            _raw_turn(sock.makefile("rb"), sock, exs[t % 2], convs[exs[t % 2]])
                        cpu, wall = (_cpu(gproc.pid) - c0) / turns * 1e3, (time.perf_counter() - t0) / turns * 1e3
                        sock.close()
                        print(f"round {rnd} {name:24} gateway CPU {cpu:.2f} ms/turn, wall {wall:.2f} ms/turn", flush=True)
            finally:
                _stop(gproc)
    finally:
        _stop(eproc)


def profile(context_words: int = _words(8000), delta_words: int = _words(2000), sessions: int = 4, turns: int = 6, top: int = 25,
            cprofile: bool = True, wire: bool = False):
    """cProfile of the gateway's own per-turn work in one process (the upstream answered in-process, no
    HTTP): the top frames by cumulative and own time, first turns excluded.  ``cprofile=False``: the process CPU
    per turn alone (every thread, first turns excluded), without the profiler's overhead.  ``wire``: each request
    body reaches the gateway as the HTTP handler gets it, parsed from its JSON bytes (every string a new object,
    as over HTTP; the client's serialisation not counted, the parse counted)."""
    import cProfile
    import pstats

    from ledger import open_log
    from ledger.algorithms.canonical import loads_unique
    from ledger.producers import chatml
    from ledger.gateway.calls import Gateway, _Headers
    from ledger.gateway.store import gateway_db_path
    from ledger.gateway.upstream import Completion
    from ledger.producers.recorder import Recorder

    ids = chatml.encode(REPLY) + [chatml.IM_END_ID]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        _init_store(store)
        log = open_log(str(store))
        rec = Recorder(log, producer="bench")
        gw = Gateway(rec, upstream="http://unused", api="vllm", tokenizer_name="qwen3.6-27b",
                     state_db=gateway_db_path(store), model="mock")

        async def upstream(prompt, body, *_):
            return Completion(list(ids), [-0.5] * len(ids), "stop")

        gw._upstream = upstream
        prof = cProfile.Profile()
        clock = {"client": 0.0}
        import ledger.gateway.calls as gmod

        async def inline(fn, *a, **k):  # the profiler sees one thread: run the gateway's thread work inline
            return fn(*a, **k)

        real, gmod.asyncio.to_thread = gmod.asyncio.to_thread, inline

        async def main() -> None:
            convs = [[{"role": "system", "content": _text(context_words, s)}, {"role": "user", "content": "go"}]
                     for s in range(sessions)]
            deltas = [_text(delta_words, t) for t in range(turns)]
            for turn in range(turns):
                if turn == 1:
                    clock["t1"] = time.process_time()
                    if cprofile:
                        prof.enable()
                for s, msgs in enumerate(convs):
                    h = _Headers(f"p{s}", "main", "main", "task", f"r{turn}", False, "bench", "2030-01-01T00:00:00Z")
                    body = {"model": "mock", "messages": msgs, "max_tokens": 64}
                    if wire:
                        t = time.process_time()
                        raw = json.dumps(body).encode()
                        clock["client"] += time.process_time() - t if turn else 0.0
                        body = loads_unique(raw.decode("utf-8"))
                    resp = await gw.chat(h, gw.parse_body(body))
                    msgs += [{"role": "assistant", "content": resp["choices"][0]["message"]["content"]},
                             {"role": "user", "content": deltas[turn]}]
            prof.disable()
            await asyncio.to_thread(rec.flush)
            clock["t2"] = time.process_time()
            await gw.close()

        t0 = time.process_time()
        try:
            asyncio.run(main())
        finally:
            gmod.asyncio.to_thread = real
        rec.close()
        log.close()
    n = sessions * (turns - 1)
    print(f"profile: {n} turns at ~{context_words * TOKENS_PER_WORD:.0f} tokens of context, ~{delta_words * TOKENS_PER_WORD:.0f}-token deltas; "
          f"{(time.process_time() - t0) / (sessions * turns) * 1e3:.2f} ms CPU per turn overall, "
          f"{(clock['t2'] - clock['t1'] - clock['client']) / n * 1e3:.2f} ms per turn after the first"
          + (" (bodies parsed from JSON)" if wire else "") + (" (cProfile on)" if cprofile else ""))
    if not cprofile:
        return
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        serve_engine(int(sys.argv[2]), float(sys.argv[3]))
    elif sys.argv[1:2] == ["passthrough"]:
        serve_passthrough(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["profile"]:  # profile [TOKENS] [cpu] [wire]: cProfile, or ("cpu") the CPU per turn alone
        profile(_words(int(sys.argv[2]) if len(sys.argv) > 2 else 8000), cprofile="cpu" not in sys.argv[3:],
                turns=11 if "cpu" in sys.argv[3:] else 6, wire="wire" in sys.argv[3:])
    elif sys.argv[1:2] == ["handback"]:  # the cost of a connection changing worker (keep-alive routing)
        handback()
    elif sys.argv[1:2] == ["context"]:  # the CPU-per-context table alone: context [TOKENS ...]
        print_tables([], context_cpu(contexts=tuple(int(a) for a in sys.argv[2:]) or (8000, 40000, 80000)))
    elif sys.argv[1:2] == ["compare"]:  # compare ROUNDS CTX[,CTX...] NAME=TREE[:VAR=VALUE...] ...
        compare_builds([(a.split("=", 1)[0], a.split("=", 1)[1].split(":")[0],
                         dict(kv.split("=", 1) for kv in a.split("=", 1)[1].split(":")[1:])) for a in sys.argv[4:]],
                       contexts=tuple(int(c) for c in sys.argv[3].split(",")), rounds=int(sys.argv[2]),
                       sessions=int(os.environ.get("SESSIONS", 4)), turns=int(os.environ.get("TURNS", 21)))
    elif sys.argv[1:2] == ["--quick"]:
        cap = capacity(levels=(8, 32), turns=5, workers=(1,))
        print_tables(cap, context_cpu(contexts=(8000, 40000), sessions=2, turns=3, repeats=1))
    else:
        print_tables(capacity(), context_cpu())
