"""What an operator sees of a running gateway (SPEC 12.3): Prometheus metrics and the access log.

The metric families are ``prometheus-client``'s (the exposition format, histogram buckets and
``_total`` / ``_seconds`` naming are the library's, not hand-written). With ``--workers N`` the
front sets ``PROMETHEUS_MULTIPROC_DIR`` for its workers, each worker writes its values there and
``GET /metrics`` (answered by whichever worker gets it) sums every worker's.

One access-log line per call is one JSON object: time, execution, request id, api, status,
gateway ms (without the upstream), upstream ms, tokens in/out. Never a credential, never message
text.
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

__all__ = ["AccessLog", "CallStats", "GatewayMetrics", "current_call", "CONTENT_TYPE_LATEST"]

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_UPSTREAM = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class CallStats:
    """What one HTTP request did, filled in as it goes (see :func:`current_call`)."""

    started: float = field(default_factory=time.perf_counter)
    upstream_s: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    execution: str | None = None
    request_id: str | None = None
    refusal: str | None = None


_CALL: contextvars.ContextVar[CallStats | None] = contextvars.ContextVar("ledger_gateway_call", default=None)


def current_call() -> CallStats | None:
    """The stats of the request this coroutine serves (None outside one)."""
    return _CALL.get()


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class GatewayMetrics:
    """The gateway's metric families in one registry of its own (tests build several gateways per process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ledger_gateway_requests", "HTTP requests answered, by API and status",
                                ["api", "status"], registry=r)
        self.request_seconds = Histogram("ledger_gateway_request_seconds",
                                         "Gateway time per call, without the upstream", buckets=_LATENCY, registry=r)
        self.upstream_seconds = Histogram("ledger_gateway_upstream_seconds", "Upstream engine time per call",
                                          buckets=_UPSTREAM, registry=r)
        self.tokens = Counter("ledger_gateway_tokens", "Tokens read (in) and written (out) by the engine",
                              ["direction"], registry=r)
        self.open_executions = Gauge("ledger_gateway_open_executions", "Executions opened here and not closed",
                                     registry=r, multiprocess_mode="livesum")
        self.commit_batch = Histogram("ledger_gateway_commit_batch_size", "Events per durable log append (group commit)",
                                      buckets=_BATCH, registry=r)
        self.refusals = Counter("ledger_gateway_refusals", "Requests refused, by reason", ["reason"], registry=r)

    def begin(self) -> tuple[CallStats, contextvars.Token]:
        stats = CallStats()
        return stats, _CALL.set(stats)

    def end(self, token: contextvars.Token, stats: CallStats, api: str, status: int) -> None:
        _CALL.reset(token)
        total = time.perf_counter() - stats.started
        self.requests.labels(api, str(status)).inc()
        self.request_seconds.observe(max(0.0, total - stats.upstream_s))
        if stats.upstream_s:
            self.upstream_seconds.observe(stats.upstream_s)
        if stats.tokens_in:
            self.tokens.labels("in").inc(stats.tokens_in)
        if stats.tokens_out:
            self.tokens.labels("out").inc(stats.tokens_out)
        if stats.refusal:
            self.refusals.labels(stats.refusal).inc()

    def exposition(self) -> bytes:
        """The Prometheus text exposition (every worker's values under ``--workers N``)."""
        if _multiprocess():
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


def refusal_reason(status: int, type_: str | None) -> str:
    """A short label for a refused request (bounded: Prometheus labels must not carry ids or text)."""
    if status == 401:
        return "unauthenticated"
    if status == 403:
        return "forbidden"
    if status == 413:
        return "body_too_large"
    if status == 429:
        return "too_many_concurrent"
    if status == 409:
        return "conflict"
    if status >= 500:
        return "upstream" if type_ and type_.startswith("upstream") else "server"
    return "invalid_request"


class AccessLog:
    """One JSON line per call to ``path`` (``-``: standard error), or nothing when ``path`` is None."""

    def __init__(self, path: str | None) -> None:
        self._out: IO[str] | None = None
        self._lock = threading.Lock()
        if path == "-":
            self._out = sys.stderr
        elif path:
            self._out = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - kept open for the process

    def write(self, stats: CallStats, api: str, status: int, method: str, path: str) -> None:
        if self._out is None:
            return
        total = time.perf_counter() - stats.started
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "method": method, "path": _safe_path(path),
            "api": api, "status": status, "execution": stats.execution, "request_id": stats.request_id,
            "gateway_ms": round(max(0.0, total - stats.upstream_s) * 1000, 3),
            "upstream_ms": round(stats.upstream_s * 1000, 3), "tokens_in": stats.tokens_in,
            "tokens_out": stats.tokens_out}
        if stats.refusal:
            line["refusal"] = stats.refusal
        with self._lock:
            self._out.write(json.dumps(line, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._out is not None and self._out is not sys.stderr:
            self._out.close()
        self._out = None


def _safe_path(path: str) -> str:
    """The request path without its query string (a query may carry a key)."""
    return path.split("?", 1)[0][:512]
