"""Ingestion: JSON lines -> validated, reference-checked, signed events -> one atomic append.

``Ingestor.submit(events)`` is the one path every producer takes (CLI ``ingest``, the SDK,
ATIF import): nothing is appended unless every event of the batch is valid, references
only executions/requests that exist (in the log or earlier in the batch), and carries a
trusted signature where SPEC §4.3 demands one.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Iterator

from ledger.algorithms.tokens import tokens_sha256
from ledger.events.catalog import EVENT_TYPES, natural_key, partition_key
from ledger.events.codec import Codec, content_hash, default_codec, event_digest
from ledger.events.signing import SignatureError, Trust, signing_body
from ledger.events.validate import ValidationError, validate_line
from ledger.log.base import AppendResult, Log, Submission
from ledger.log.sealing import KeyStore, SealError, SubjectResolver, seal_request

MAX_ERRORS = 50
_EXECUTION_SCOPED_NEEDS_OPEN = {"request", "tool_payload", "execution_closed", "assessment", "execution_finalized",
                                "target_selection", "predicate_evaluated", "cost_recorded"}


class IngestError(ValueError):
    """A batch was refused; ``errors`` lists every problem found (line and field named)."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        super().__init__("; ".join(errors[:10]) + more)


@dataclass
class IngestReport:
    appended: int = 0
    duplicates: int = 0
    conflicts: list[dict] = field(default_factory=list)
    result: AppendResult | None = None

    def to_json(self) -> dict:
        return {"appended": self.appended, "duplicates": self.duplicates, "conflicting": len(self.conflicts),
                "conflicts": self.conflicts}




def submission(ev: dict, codec: Codec | None = None) -> Submission:
    """Encode a validated event record into a :class:`Submission`."""
    codec = codec or default_codec()
    value = codec.encode(ev)
    et = EVENT_TYPES[ev["event_type"]]
    return Submission(ev["event_id"], et.type, partition_key(ev), natural_key(ev), content_hash(ev, value),
                      et.governance, value, event_digest(value))


def read_json_lines(stream: IO[str]) -> Iterator[tuple[int, Any]]:
    """Yield (line number, decoded object); blank lines are skipped; bad JSON raises."""
    for n, text in enumerate(stream, 1):
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"malformed JSON: {exc.msg} at column {exc.colno}", line=n) from None


class Ingestor:
    """Validates and appends batches of events to one log."""

    def __init__(self, log: Log, trust: Trust | None = None, *, codec: Codec | None = None,
                 producer: str = "ledger-ingest", cache_requests: int = 256) -> None:
        self.log, self.trust, self.codec, self.producer = log, trust or Trust(), codec or default_codec(), producer
        self._paths: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # (execution, request) -> input+output
        self._cache_size = cache_requests

    # -------------------------------------------------------------- public API
    def ingest_lines(self, lines: Iterable[tuple[int, Any]]) -> IngestReport:
        """Validate numbered JSON objects and append them atomically."""
        now = time.time_ns() // 1000  # the one place the wall clock stamps occurred_at
        events, errors = [], []
        try:
            for n, obj in lines:
                try:
                    ev = validate_line(obj, line=n, now_micros=now, producer=self.producer)
                    self._check_signature(obj, ev, n)
                    events.append((n, ev))
                except (ValidationError, SignatureError) as exc:
                    errors.append(str(exc))
                    if len(errors) >= MAX_ERRORS:
                        break
        except ValidationError as exc:  # malformed JSON stops reading
            errors.append(str(exc))
        if errors:
            raise IngestError(errors)
        return self.submit(events)

    def submit(self, events: list[tuple[int | None, dict]]) -> IngestReport:
        """Reference-check validated event records and append them as one batch."""
        errors: list[str] = []
        batch_state = _BatchState()
        subs = []
        for n, ev in events:
            try:
                self._check_references(ev, batch_state)
            except ValidationError as exc:
                errors.append(str(ValidationError(exc.message, line=n, field=exc.field)))
                if len(errors) >= MAX_ERRORS:
                    break
                continue
            subs.append(submission(ev, self.codec))
        if errors:
            raise IngestError(errors)
        result = self.log.append(subs)
        report = IngestReport(result=result)
        if result.conflicts:
            report.conflicts = [{"event_id": c.event_id, "natural_key": c.natural_key, "reason": c.reason,
                                 "existing_position": c.existing_position} for c in result.conflicts]
            return report
        report.appended, report.duplicates = len(result.appended), len(result.duplicates)
        for key, packed in batch_state.paths.items():
            self._remember(key, packed)
        return report

    def request_path(self, execution_id: str, request_id: str) -> bytes | None:
        """Packed input+output tokens of an accepted request (resolving prefix references)."""
        key = (execution_id, request_id)
        if key in self._paths:
            self._paths.move_to_end(key)
            return self._paths[key]
        rec = self.log.lookup(f"request/{execution_id}/{request_id}")
        if rec is None:
            return None
        ev = self.codec.decode(rec.value)
        packed = self._full_input(ev, {}) + ev["output_ids"]
        self._remember(key, packed)
        return packed

    # -------------------------------------------------------------- checks
    def _check_signature(self, obj: dict, ev: dict, n: int) -> None:
        et = EVENT_TYPES[ev["event_type"]]
        sig = obj.get("signature")
        if sig is None:
            if et.signed:
                raise ValidationError(f"{et.type} events must be signed by a trusted key (see `ledger sign`)",
                                      line=n, field="signature")
            return
        if not et.governance:
            raise ValidationError("only governance events carry signatures", line=n, field="signature")
        body = signing_body(obj, ev["stamped"])
        try:
            self.trust.verify(et.type, body, sig)
        except SignatureError as exc:
            raise ValidationError(str(exc), line=n, field="signature") from None
        ev["signature"] = {"key_id": sig["key_id"], "value": sig["value"]}
        ev["signed_body"] = body.decode("utf-8")

    def _check_references(self, ev: dict, st: "_BatchState") -> None:
        et = ev["event_type"]
        if et in _EXECUTION_SCOPED_NEEDS_OPEN:
            ex = ev["execution_id"]
            if not st.opened(ex, self.log):
                raise ValidationError(f"execution {ex!r} was never opened (no execution_opened in the log or earlier in this batch)",
                                      field="execution_id")
        if et == "execution_opened":
            st.open.add(ev["execution_id"])
        elif et == "execution_closed":
            st.closed.add(ev["execution_id"])
        elif et == "request":
            self._check_request(ev, st)
        elif et == "record_derived":
            if not st.opened(ev["parent_execution_id"], self.log):
                raise ValidationError(f"parent execution {ev['parent_execution_id']!r} was never opened", field="parent_execution_id")
            st.open.add(ev["derived_execution_id"])
        elif et == "split_policy":
            self._check_split_policy(ev, st)
        elif et == "revalidated":
            if ev["derived_execution_id"] not in st.open and self.log.lookup(f"record_derived/{ev['derived_execution_id']}") is None:
                raise ValidationError(f"no record_derived for {ev['derived_execution_id']!r}", field="derived_execution_id")

    def _check_split_policy(self, ev: dict, st: "_BatchState") -> None:
        """One policy is in force; a later one must name the one it supersedes (SPEC §4.2)."""
        pid, sup = ev["policy_id"], ev["supersedes"]
        existing = self.log.lookup(f"split_policy/{pid}")
        if existing is not None and existing.event_id == ev["event_id"]:
            return  # a retry: the append decides duplicate vs conflict
        if sup is None:
            first = st.root_policy or self.log.first_of_type("split_policy")
            if first is not None:
                raise ValidationError(f"a split policy is already in force (event {first}); a new policy must name "
                                      "the one it supersedes", field="supersedes")
            st.root_policy = ev["event_id"]
        elif sup not in st.policies and self.log.lookup(f"split_policy/{sup}") is None:
            raise ValidationError(f"supersedes unknown split policy {sup!r}", field="supersedes")
        st.policies.add(pid)

    def _check_request(self, ev: dict, st: "_BatchState") -> None:
        ex, rid = ev["execution_id"], ev["request_id"]
        existing = self.log.lookup(f"request/{ex}/{rid}")
        if existing is not None and existing.event_id == ev["event_id"]:
            return  # a retry: the append decides duplicate vs conflict
        if ex in st.closed or self.log.lookup(f"execution_closed/{ex}") is not None:
            raise ValidationError(f"execution {ex!r} is closed; no further requests are accepted", field="request_id")
        packed = self._full_input(ev, st.paths) + ev["output_ids"]
        st.paths[(ex, rid)] = packed

    def _full_input(self, ev: dict, batch_paths: dict) -> bytes:
        ref = ev["input_prefix"]
        if ref is None:
            return ev["input_ids"]
        key = (ev["execution_id"], ref["request_id"])
        path = batch_paths[key] if key in batch_paths else self.request_path(*key)
        if path is None:
            raise ValidationError(f"prefix reference to unknown request {ref['request_id']!r} of execution {ev['execution_id']!r}",
                                  field="input_prefix")
        n = len(path) // 4
        if ref["length"] > n:
            raise ValidationError(f"prefix length {ref['length']} exceeds the {n} tokens of request {ref['request_id']!r}",
                                  field="input_prefix")
        prefix = path[: ref["length"] * 4]
        if tokens_sha256(prefix) != ref["sha256"]:
            raise ValidationError(f"sha256 of the first {ref['length']} tokens of request {ref['request_id']!r} does not match",
                                  field="input_prefix")
        return prefix + (ev["input_suffix_ids"] or b"")

    def _remember(self, key: tuple[str, str], packed: bytes) -> None:
        self._paths[key] = packed
        self._paths.move_to_end(key)
        while len(self._paths) > self._cache_size:
            self._paths.popitem(last=False)


class _BatchState:
    def __init__(self) -> None:
        self.open: set[str] = set()
        self.closed: set[str] = set()
        self.paths: dict[tuple[str, str], bytes] = {}
        self.policies: set[str] = set()
        self.root_policy: str | None = None
        self._known: dict[str, bool] = {}

    def opened(self, execution_id: str, log: Log) -> bool:
        if execution_id in self.open:
            return True
        if execution_id not in self._known:
            self._known[execution_id] = (log.lookup(f"execution_opened/{execution_id}") is not None
                                         or log.lookup(f"record_derived/{execution_id}") is not None)
        return self._known[execution_id]


def ingest_sealed(ingestor, lines, keystore: KeyStore, *, level: str = "execution"):
    """Validate numbered JSON lines, seal their requests, and submit them as one atomic batch.

    The same path as ``Ingestor.ingest_lines`` except that request tokens are sealed before
    submission.  Signed governance lines are refused here (ingest them with `ledger ingest`):
    their signature check is the ingestor's own business."""
    now = time.time_ns() // 1000
    events, errors = [], []
    resolver = SubjectResolver(level, getattr(ingestor, "log", None), getattr(ingestor, "codec", None))
    for n, obj in lines:
        try:
            ev = validate_line(obj, line=n, now_micros=now, producer=ingestor.producer)
            if EVENT_TYPES[ev["event_type"]].signed or (isinstance(obj, dict) and "signature" in obj):
                raise ValidationError("signed governance lines are not accepted with sealing; use `ledger ingest`",
                                      line=n, field="type")
            resolver.observe(ev)
            if ev["event_type"] == "request":
                ev = seal_request(ev, keystore, resolver(ev))
            events.append((n, ev))
        except (ValidationError, SealError) as exc:
            errors.append(str(exc) if isinstance(exc, ValidationError) else f"line {n}: {exc}")
    if errors:
        raise IngestError(errors)
    return ingestor.submit(events)
