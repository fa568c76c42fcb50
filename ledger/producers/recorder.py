"""The producer SDK: record an agent harness's model calls on the ledger (SPEC §7.4).

::

    from ledger import open_log
    from ledger.producers.recorder import Recorder

    with Recorder(open_log("./ledger-data")) as rec:
        rec.open_execution("ex-1", task_id="t-1", deadline="2030-01-01T00:00:00Z", policy="qwen@1200")
        rec.record_request("ex-1", "r1", input_ids, output_ids, output_logprobs)
        rec.record_request("ex-1", "r2", input_ids_2, output_ids_2, output_logprobs_2)  # prefix reference to r1
        rec.cache_tool_payload("ex-1", "call-1", "result", {"stdout": "..."})
        rec.close_execution("ex-1", "completed", artifact_versions=["v1"])

* **Automatic prefix references.**  A request's input is written as a reference to the
  longest common prefix it shares with the same agent's previous request (its
  input+output) — or with the ``parent_request_id`` request when that is longer — plus
  the new suffix.  The ledger verifies the SHA-256 and rebuilds the exact input, so the log
  grows with O(turns) instead of O(turns²).  A process that continues an execution an
  earlier one recorded calls :meth:`Recorder.resume` with the recorded calls so its prefix
  references continue from them.
* **Same events as ``ledger ingest``.**  Every event is built as a SPEC §7.1 JSON line
  (with ``producer`` set) and validated with :func:`ledger.events.validate.validate_line`, then
  appended through :meth:`ledger.producers.ingest.Ingestor.submit`; ingesting the same JSON lines
  (``tee=`` writes them) stores the same events.  ``occurred_at`` is stamped at the call
  unless given.
* **Safe retries.**  Event ids derive from natural keys, so recording the same request
  (same ids, same content) again is a duplicate, never a new event — within one recorder
  (the same prefix reference is reused) and across restarts (a request already on the log
  with the same tokens and fields is skipped).  Different content under the same id is a
  conflict: reported, never overwritten.
* **Sealed by default.**  Request tokens are sealed per execution (AES-GCM, keys in the
  store's ``data-keys.db``), as with ``ledger ingest``; ``seal=None`` opts out.
* **Bounded in-flight buffer.**  A background writer drains a ``queue.Queue(maxsize=
  max_in_flight)`` in batches (one durable append per batch); when it is full, callers
  block (back-pressure).  Validation errors raise at the call; errors from the log
  (references, conflicts) surface on the next call, :meth:`flush` or :meth:`close`.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections import OrderedDict
from datetime import datetime
from typing import IO, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ledger.algorithms.errors import InputError, StateError
from ledger.algorithms.prefix_match import as_tokens, common_prefix, tokens_sha256
from ledger.algorithms.tokens import TokenList
from ledger.events.catalog import key_of
from ledger.events.signing import Trust
from ledger.events.validate import ValidationError, format_micros, validate_line
from ledger.log.base import Log
from ledger.producers.ingest import IngestError, Ingestor

__all__ = ["Recorder", "RecorderError"]

_STOP = object()
_HEADER = ("event_id", "event_type", "occurred_at", "producer", "stamped", "signature", "signed_body")
_INPUT_FIELDS = ("input_ids", "input_prefix", "input_suffix_ids")
_U32 = np.dtype(np.uint32)


class RecorderError(StateError):
    """Events the ledger refused after they were queued (reference errors, conflicts)."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        super().__init__("; ".join(errors[:5]) + more)


def _timestamp(value: Any, name: str) -> str:
    """datetime (aware) | RFC 3339 str | int microseconds since the epoch -> RFC 3339 str."""
    if isinstance(value, str):
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InputError(f"{name} must be timezone-aware")
        return value.isoformat()
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return format_micros(int(value))
    raise TypeError(f"{name} must be a datetime, an RFC 3339 string or int microseconds, got {type(value).__name__}")


def _token_array(ids: Any, name: str) -> np.ndarray:
    """Validate token IDs (list or numpy array) and return them as uint32.  A 1-D native uint32 array
    (the gateway's prompts) is taken as it is: every value it can hold is a valid token ID."""
    if isinstance(ids, np.ndarray) and ids.dtype == _U32 and ids.ndim == 1:
        return ids
    if isinstance(ids, (bytes, bytearray, memoryview)):
        return as_tokens(ids)
    arr = np.asarray(ids)
    if arr.ndim != 1:
        if arr.size == 0:
            return np.zeros(0, dtype=np.uint32)
        raise InputError(f"{name} must be a 1-D sequence of token IDs")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise InputError(f"{name}: token IDs must be integers (got dtype {arr.dtype})")
    if int(arr.min()) < 0 or int(arr.max()) > 2**32 - 1:
        raise InputError(f"{name}: token IDs must be in 0..{2**32 - 1}")
    return arr.astype(np.uint32, copy=False)


def _names(value: Any, field: str) -> list:
    """A sequence argument as the JSON array the line carries; a bare string is refused (SPEC 11.7:
    ``list("call_1")`` would record its characters as seven ids)."""
    if isinstance(value, (str, bytes)):
        raise ValidationError(f"expected a list, got the string {value!r:.40}", field=field)
    return list(value)


def _packed(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a, dtype="<u4")).cast("B")


def _path_sha(inp: np.ndarray, out: np.ndarray, base: Any = None, skip: int = 0) -> Any:
    """SHA-256 state of the packed path ``inp + out``; from ``base`` (the state of ``inp[:skip]``) in
    O(new tokens) when given."""
    h = base.copy() if base is not None else hashlib.sha256()
    h.update(_packed(inp[skip:] if base is not None else inp))
    h.update(_packed(out))
    return h


def _content(inp: np.ndarray, out: np.ndarray, path_sha: Any) -> tuple:
    """What a retried request id is compared by: the input and output lengths and the path's SHA-256."""
    return (len(inp), len(out), path_sha.digest())


def _shared_prefix(path: np.ndarray, inp: np.ndarray) -> int:
    """The number of leading tokens ``inp`` shares with ``path``: one comparison when it extends the whole path
    (the usual case), the scan otherwise."""
    n = len(path)
    if len(inp) >= n and path.dtype == inp.dtype and np.array_equal(inp[:n], path):
        return n
    return common_prefix(path, inp)


class Recorder:
    """Records executions on a log through :class:`~ledger.producers.ingest.Ingestor`."""

    def __init__(self, log: Log, trust: Trust | None = None, producer: str = "recorder", max_in_flight: int = 64, *,
                 min_prefix: int = 16, batch_size: int = 256, recent_paths: int = 64,
                 tee: IO[str] | None = None, credits: Any = None, seal: str | None = "execution",
                 keystore: Any = None) -> None:
        """``seal`` / ``keystore``: as :class:`~ledger.producers.ingest.Ingestor` (request tokens are
        sealed per execution under the store's ``data-keys.db`` by default, so ``withdraw --erase``
        works for every recorded request; ``seal=None`` stores them in the clear)."""
        if max_in_flight < 1:
            raise InputError("max_in_flight must be >= 1")
        self.log = log
        self.producer = producer
        self.min_prefix = min_prefix
        self.batch_size = batch_size
        self.ingestor = Ingestor(log, trust, producer=producer, seal=seal, keystore=keystore)
        self.tee = tee
        self.appended = 0
        self.duplicates = 0
        self._q: queue.Queue = queue.Queue(maxsize=max_in_flight)
        self._errors: list[str] = []
        self._err_lock = threading.Lock()
        self._state = threading.RLock()
        self._agents: dict[tuple[str, str], tuple[str, np.ndarray]] = {}  # (ex, agent) -> (request, path)
        self._refs: dict[tuple[str, str], tuple[bytes, dict | None]] = {}  # (ex, rid) -> (content digest, ref)
        self._recent: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._recent_size = recent_paths
        # SHA-256 states of recorded paths (packed input+output), so that a reference to a whole path and the
        # next path's state cost O(new tokens); a missing one is computed again (bounded like _recent)
        self._shas: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._fresh: set[str] = set()  # writer thread: executions this recorder opened new on the log
        # Optional collection credits (ledger.producers.credit_client.CreditClient, with its own log handle): a credit is
        # acquired before an execution opens and released once it is closed + decisively assessed on the log.
        self.credits = credits
        self.credit_grants: dict[str, Any] = {}  # execution id -> Grant (kind "grant" or "slow")
        self._credit_progress: dict[str, set[str]] = {}
        self._closed = False
        # group commit: events are numbered as they are queued; the writer appends whatever is queued as one
        # batch (one fdatasync) and advances _written, so a caller waits for its own events only (wait_durable)
        self._enqueued = 0
        self._written = 0
        self._durable = threading.Condition()  # guards _written (the writer never takes _put_lock)
        self._put_lock = threading.Lock()  # guards _enqueued
        # called by the writer before each batch is appended (the gateway syncs its state rows there: one fsync per
        # batch makes the rows of every call in the batch durable before any of its events is)
        self.before_append: Callable[[], None] | None = None
        # called by the writer after each batch was taken (appended and synced, or refused), with the number of
        # events taken so far: an event loop waits for :meth:`mark` without a thread blocked in wait_durable
        self.on_written: Callable[[int], None] | None = None
        self._thread = threading.Thread(target=self._writer, name="ledger-recorder", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ events
    def open_execution(self, execution_id: str, task_id: str, deadline: Any, policy: str, *,
                       tokenizer: str | None = None, origin: str | None = None, collection_run_id: str | None = None,
                       metadata: Any = None, event_id: str | None = None, occurred_at: Any = None) -> dict:
        line = {"type": "execution_opened", "execution_id": execution_id, "task_id": task_id,
                "deadline": _timestamp(deadline, "deadline"), "policy": policy, "tokenizer": tokenizer,
                "origin": origin, "collection_run_id": collection_run_id, "metadata": metadata}
        if self.credits is None:
            return self._emit(line, event_id, occurred_at)
        ev, line = self._prepare(line, event_id, occurred_at)
        # blocks until a credit is held (CreditTimeout / CreditRefused: nothing is recorded)
        self.credit_grants[execution_id] = self.credits.acquire(execution_id, run_id=collection_run_id)
        self._enqueue(ev, line, None)
        return line

    def record_request(self, execution_id: str, request_id: str, input_ids: Any, output_ids: Any,
                       output_logprobs: Any = None, agent_id: str = "main", *, agent_tier: str = "main",
                       turn_kind: str = "task", generator: str = "policy", parent_request_id: str | None = None,
                       consumed_tool_call_ids: Sequence[str] = (), emitted_tool_call_ids: Sequence[str] = (),
                       reconstructed: bool = False, model: str | None = None, finish_reason: str | None = None,
                       metadata: Mapping[str, Any] | None = None, event_id: str | None = None,
                       occurred_at: Any = None) -> dict:
        """Record one model call exactly as it happened; returns the JSON line written.

        ``input_ids`` / ``output_ids``: lists or numpy arrays of token IDs; ``output_logprobs``
        the behaviour log-probs (required for ``generator="policy"`` unless reconstructed).
        """
        self._raise_pending()
        inp = _token_array(input_ids, "input_ids")
        out = _token_array(output_ids, "output_ids")
        key = (execution_id, request_id)
        with self._state:
            known = self._refs.get(key)
            if known is None:
                ref, base = self._choose_reference(execution_id, agent_id, parent_request_id, inp)
            else:  # a retry: the same line again, or (different content) a full line that will conflict
                ref = known[1] if known[0] == _content(inp, out, _path_sha(inp, out)) else None
        line: dict[str, Any] = {"type": "request", "execution_id": execution_id, "request_id": request_id}
        if ref is None:  # lists that keep their packed bytes: validation does not re-pack them
            line["input_ids"] = TokenList(inp)
        else:
            line["input_prefix"] = ref
            line["input_suffix_ids"] = TokenList(inp[ref["length"]:])
        line["output_ids"] = TokenList(out)
        if output_logprobs is not None:
            line["output_logprobs"] = (np.asarray(output_logprobs, dtype=np.float64).tolist()
                                       if isinstance(output_logprobs, np.ndarray) else list(output_logprobs))
        line.update({"agent_id": agent_id, "agent_tier": agent_tier, "turn_kind": turn_kind, "generator": generator,
                     "parent_request_id": parent_request_id,
                     "consumed_tool_call_ids": _names(consumed_tool_call_ids, "consumed_tool_call_ids"),
                     "emitted_tool_call_ids": _names(emitted_tool_call_ids, "emitted_tool_call_ids"),
                     "reconstructed": reconstructed, "model": model, "finish_reason": finish_reason,
                     "metadata": metadata})
        ev, line = self._prepare(line, event_id, occurred_at)  # raises ValidationError before any state changes
        if known is None:
            sha = _path_sha(inp, out, base, ref["length"] if ref is not None else 0)
            with self._state:
                self._refs[key] = (_content(inp, out, sha), ref)
                path = np.concatenate((inp, out))
                self._agents[(execution_id, agent_id)] = (request_id, path)
                self._recent[key] = path
                while len(self._recent) > self._recent_size:
                    self._recent.popitem(last=False)
                self._keep_sha(key, sha)
        self._enqueue(ev, line, (inp, out))
        return line

    def resume(self, execution_id: str, requests: Iterable[tuple[str, str, Any, Any]]) -> int:
        """Continue prefix references from requests already on the log (recorded by an earlier
        process): ``requests`` are ``(request_id, agent_id, input_ids, output_ids)`` in recording
        order, oldest first.  Each agent's last one becomes its previous request and the last
        ``recent_paths`` are kept for ``parent_request_id``; nothing is written to the log.  State
        this recorder already holds for the execution (it recorded those calls itself) wins.
        Returns the number of requests taken; bad token IDs raise ``ValueError`` with nothing
        changed."""
        paths = [(rid, agent, np.concatenate((_token_array(inp, f"{rid}: input_ids"),
                                              _token_array(out, f"{rid}: output_ids"))))
                 for rid, agent, inp, out in requests]
        with self._state:
            last: dict[str, tuple[str, np.ndarray]] = {}
            for rid, agent, path in paths:
                last[agent] = (rid, path)
            for agent, prev in last.items():
                self._agents.setdefault((execution_id, agent), prev)
            for rid, _, path in (paths[-self._recent_size:] if self._recent_size > 0 else ()):
                self._recent.setdefault((execution_id, rid), path)
            while len(self._recent) > self._recent_size:
                self._recent.popitem(last=False)
        return len(paths)

    def cache_tool_payload(self, execution_id: str, call_id: str, kind: str, payload: Any, *,
                           event_id: str | None = None, occurred_at: Any = None) -> dict:
        """Cache an exact tool call (``kind="call"``) or tool result (``kind="result"``)."""
        line = {"type": "tool_payload", "execution_id": execution_id, "call_id": call_id, "kind": kind,
                "payload": payload}
        return self._emit(line, event_id, occurred_at)

    def record_assessment(self, execution_id: str, assessment_id: str, artifact_version: str, outcome: str,
                          evaluator: str, reward: float | None = None, *, branch_request_id: str | None = None,
                          criteria: Iterable[dict] | None = None, event_id: str | None = None,
                          occurred_at: Any = None) -> dict:
        """Publish an assessment (outcome ``scored`` needs ``reward``; zero is a valid reward)."""
        line = {"type": "assessment", "assessment_id": assessment_id, "execution_id": execution_id,
                "artifact_version": artifact_version, "outcome": outcome, "reward": reward,
                "branch_request_id": branch_request_id, "evaluator": evaluator,
                "criteria": _names(criteria, "criteria") if criteria is not None else None}
        out = self._emit(line, event_id, occurred_at)
        if outcome in ("scored", "not_assessable"):
            self._credit_step(execution_id, "assessed")
        return out

    def close_execution(self, execution_id: str, status: str = "completed", artifact_versions: Sequence[str] = (), *,
                        event_id: str | None = None, occurred_at: Any = None) -> dict:
        line = {"type": "execution_closed", "execution_id": execution_id, "status": status,
                "artifact_versions": _names(artifact_versions, "artifact_versions")}
        out = self._emit(line, event_id, occurred_at)
        with self._state:  # forget the execution's reference state
            for k in [k for k in self._agents if k[0] == execution_id]:
                del self._agents[k]
            for k in [k for k in self._refs if k[0] == execution_id]:
                del self._refs[k]
            for k in [k for k in self._recent if k[0] == execution_id]:
                del self._recent[k]
            for k in [k for k in self._shas if k[0] == execution_id]:
                del self._shas[k]
        self._credit_step(execution_id, "closed")
        return out

    def emit(self, line: dict) -> dict:
        """Any other SPEC §7.1 JSON line (e.g. ``cost_recorded``, ``target_selection``)."""
        line = dict(line)
        out = self._emit(line, line.pop("event_id", None), line.pop("occurred_at", None))
        if line.get("type") == "execution_finalized":
            self._credit_step(line["execution_id"], "finalized")
        return out

    def hand_off(self, execution_id: str, acknowledged_by: str) -> bool:
        """Release ``execution_id``'s credit on an acknowledged hand-off to another bounded owner."""
        if self.credits is None:
            raise RuntimeError("this recorder has no credit client")
        self.flush()
        self._credit_progress.pop(execution_id, None)
        return self.credits.hand_off(execution_id, acknowledged_by)

    def _credit_step(self, execution_id: str, step: str) -> None:
        """Release the credit once the disposition is durable: closed + assessed, or finalized."""
        if self.credits is None or execution_id not in self.credit_grants:
            return
        with self._state:
            done = self._credit_progress.setdefault(execution_id, set())
            done.add(step)
            ready = {"closed", "assessed"} <= done or "finalized" in done
            if ready:
                del self._credit_progress[execution_id]
        if ready:
            self.flush()  # durable on the log first
            self.credits.release(execution_id, "disposition")

    # ------------------------------------------------------------------ control
    def flush(self) -> None:
        """Wait until every queued event is on the log; raise the errors seen so far."""
        if self._thread.is_alive():
            self._q.join()
        self._raise_pending()

    def mark(self) -> int:
        """The number of events queued so far: :meth:`wait_durable` of it waits for them alone."""
        with self._put_lock:
            return self._enqueued

    def wait_durable(self, mark: int) -> None:
        """Wait until the first ``mark`` queued events are on the log (appended and synced, possibly in one
        batch with other callers' events: group commit); raise the errors seen so far."""
        self.wait_written(mark)
        self._raise_pending()

    def written(self, mark: int) -> bool:
        """Whether the writer has taken the first ``mark`` queued events (or stopped): :meth:`wait_durable` of
        ``mark`` would not wait."""
        return self._written >= mark or not self._thread.is_alive()

    def wait_written(self, mark: int) -> None:
        """Wait until the writer has taken the first ``mark`` queued events (appended, or refused: the
        errors stay pending for :meth:`flush` / :meth:`wait_durable`)."""
        with self._durable:
            while self._written < mark and self._thread.is_alive():
                self._durable.wait(1.0)

    def close(self) -> None:
        """Flush and stop the writer (idempotent)."""
        if not self._closed:
            self._closed = True
            if self._thread.is_alive():
                self._q.join()
                self._q.put(_STOP)
                self._thread.join()
            self.ingestor.close()  # the data-key store it opened (if any)
        self._raise_pending()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # don't mask the body's exception
            try:
                self.close()
            except RecorderError:
                pass

    @property
    def in_flight(self) -> int:
        return self._q.qsize()

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more events can be queued now without blocking (back-pressure), other producers aside."""
        return self._q.maxsize - self._q.qsize() >= n

    # ------------------------------------------------------------------ internals
    def _choose_reference(self, execution_id: str, agent_id: str, parent: str | None,
                          inp: np.ndarray) -> tuple[dict | None, Any]:
        """The prefix reference for ``inp`` (None if none pays off) and, when it covers a whole recorded path, that
        path's SHA-256 state (the new path's state continues from it)."""
        cands: list[tuple[str, np.ndarray]] = []
        prev = self._agents.get((execution_id, agent_id))
        if prev is not None:
            cands.append(prev)
        if parent is not None:
            p = self._recent.get((execution_id, parent))
            if p is not None and (prev is None or prev[0] != parent):
                cands.append((parent, p))
        best_len, best = 0, None
        for rid, path in cands:
            n = _shared_prefix(path, inp)
            if n > best_len:
                best_len, best = n, (rid, path)
        if best is None or best_len < max(1, self.min_prefix):
            return None, None
        rid, path = best
        if best_len < len(path):
            return {"request_id": rid, "length": best_len, "sha256": tokens_sha256(path[:best_len])}, None
        sha = self._shas.get((execution_id, rid))
        if sha is None:  # a path this recorder did not hash yet (resumed, or evicted): once, in full
            sha = _path_sha(path, path[:0])
            self._keep_sha((execution_id, rid), sha)
        return {"request_id": rid, "length": best_len, "sha256": sha.hexdigest()}, sha

    def _keep_sha(self, key: tuple[str, str], sha: Any) -> None:
        self._shas[key] = sha
        self._shas.move_to_end(key)
        while len(self._shas) > max(self._recent_size, 1) + 64:
            self._shas.popitem(last=False)

    def _emit(self, line: dict, event_id: str | None, occurred_at: Any) -> dict:
        ev, line = self._prepare(line, event_id, occurred_at)
        self._enqueue(ev, line, None)
        return line

    def _prepare(self, line: dict, event_id: str | None, occurred_at: Any) -> tuple[dict, dict]:
        """The JSON line (``None`` fields dropped, producer set) and its validated event record."""
        if self._closed:
            raise RuntimeError("the recorder is closed")
        self._raise_pending()
        line = {k: v for k, v in line.items() if v is not None}
        line["producer"] = self.producer
        if event_id is not None:
            line["event_id"] = event_id
        if occurred_at is not None:
            line["occurred_at"] = _timestamp(occurred_at, "occurred_at")
        return validate_line(line, now_micros=time.time_ns() // 1000, producer=self.producer), line

    def _enqueue(self, ev: dict, line: dict, check: tuple | None) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the recorder's writer thread stopped")
        with self._put_lock:  # numbered in queue order (the writer takes them in that order)
            self._q.put((ev, line, check))  # blocks while max_in_flight events are queued (back-pressure)
            self._enqueued += 1

    def _raise_pending(self) -> None:
        with self._err_lock:
            if not self._errors:
                return
            errors, self._errors = self._errors, []
        raise RecorderError(errors)

    def errors_pending(self) -> bool:
        """Whether the writer failed appends it has not reported yet (the gateway's readiness: the log
        does not take appends)."""
        with self._err_lock:
            return bool(self._errors)

    def _fail(self, msg: str) -> None:
        with self._err_lock:
            self._errors.append(msg)

    # ------------------------------------------------------------------ writer thread
    def _writer(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                self._q.task_done()
                return
            items = [item]
            stop = False
            while len(items) < self.batch_size:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                items.append(nxt)
            try:
                self._write(items)
            except BaseException as exc:  # never let the writer die silently
                self._fail(f"writer error: {type(exc).__name__}: {exc}")
            finally:
                with self._durable:
                    self._written += len(items)
                    written = self._written
                    self._durable.notify_all()
                self._report_written(written)
                for _ in items:
                    self._q.task_done()
            if stop:
                self._q.task_done()
                return

    def _report_written(self, written: int) -> None:
        if self.on_written is not None:
            try:
                self.on_written(written)
            except Exception as exc:  # never let the writer die silently
                self._fail(f"on_written: {type(exc).__name__}: {exc}")

    def _write(self, items: list[tuple[dict, dict, tuple | None]]) -> None:
        batch = []
        for ev, line, check in items:
            if ev["event_type"] == "execution_opened":
                if self.log.lookup(key_of("execution_opened", execution_id=ev["execution_id"])) is None:
                    self._fresh.add(ev["execution_id"])
            elif ev["event_type"] == "execution_closed":  # its reference state is gone: check retries
                self._fresh.discard(ev["execution_id"])
            elif (ev["event_type"] == "request" and ev["execution_id"] not in self._fresh
                  and self._already_recorded(ev, check)):
                self.duplicates += 1
                self._tee(line)
                continue
            batch.append((ev, line))
        if not batch:
            return
        if self.before_append is not None:
            self.before_append()
        try:
            self._submit(batch)
        except IngestError:
            for one in batch:  # isolate the bad event(s); the good ones still go in
                try:
                    self._submit([one])
                except IngestError as exc:
                    self._fail(f"{one[0]['event_type']} {one[0]['event_id']}: {exc}")

    def _submit(self, batch: list[tuple[dict, dict]]) -> None:
        report = self.ingestor.submit([(None, ev) for ev, _ in batch])
        if report.conflicts:
            conflicting = {c["event_id"] for c in report.conflicts}
            for c in report.conflicts:
                self._fail(f"conflict: {c['event_id']}: {c['reason']}")
            rest = [b for b in batch if b[0]["event_id"] not in conflicting]
            if rest and len(rest) < len(batch):
                self._submit(rest)
            return
        self.appended += report.appended
        self.duplicates += report.duplicates
        for _, line in batch:
            self._tee(line)

    def _tee(self, line: dict) -> None:
        if self.tee is not None:
            self.tee.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")

    def _already_recorded(self, ev: dict, check: tuple | None) -> bool:
        """A request of an execution this recorder did not open: is the same one on the log?"""
        rec = self.log.lookup(key_of("request", execution_id=ev["execution_id"], request_id=ev["request_id"]))
        if rec is None or check is None:
            return False
        try:  # a sealed request is compared by its plain content (opened with the store's data keys)
            stored = self.ingestor.opened_request(self.ingestor.codec.decode(rec.value))
        except ValidationError:
            return False  # erased or not openable here: let the log decide duplicate vs conflict
        same_fields = all(stored.get(k) == ev.get(k) for k in set(stored) | set(ev)
                          if k not in _HEADER and k not in _INPUT_FIELDS)
        if not same_fields or (ev.get("event_id") != stored["event_id"]):
            return False
        path = self.ingestor.request_path(ev["execution_id"], ev["request_id"])
        inp, out = check
        return path is not None and path == np.concatenate((inp, out)).astype("<u4").tobytes()
