"""Ingestion: JSON lines -> validated, reference-checked, signed events -> one atomic append.

``Ingestor.submit(events)`` is the one path every producer takes (CLI ``ingest``, the SDK,
ATIF import): nothing is appended unless every event of the batch is valid, references
only executions/requests that exist (in the log or earlier in the batch), and carries a
trusted signature where SPEC §4.3 demands one.

**Sealing is the default** (SPEC §6.4 ``erase``, §9 "Erase always means erased"): after the
reference checks, the seal step (:meth:`Ingestor._seal_step`) seals every request's token
payload under a data key kept outside the log (``seal="execution"``: one key per execution;
``"task"`` / ``"source"`` share one key per task / source; ``None``: no sealing, so erasure
of those records is refused).  The key store is the store's ``data-keys.db``
(:func:`ledger.log.sealing.store_keys_path`) unless ``keystore=`` names another.  Sealing is
deterministic, and the idempotency hash of a sealed request is the hash of its *plain*
content, so a retry stays a duplicate whether the original was stored sealed or not.
A prefix reference into a sealed request is verified by opening it with the key store.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Iterator, Sequence

from ledger.algorithms.canonical import DuplicateKeyError, loads_unique
from ledger.algorithms.errors import InputError
from ledger.algorithms.tokens import tokens_sha256
from ledger.events.catalog import EVENT_TYPES, EventType, natural_key
from ledger.events.codec import (Codec, CodecError, SchemaVersion, content_hash, default_codec, event_digest,
                                 plain_content_hash)
from ledger.events.signing import SignatureError, Trust, signing_body
from ledger.events.validate import ValidationError, validate_line
from ledger.log.base import AppendResult, Log, Recheck, Submission, new_submission
from ledger.log.sealing import (
    SEAL_LEVELS,
    KeyDestroyed,
    KeyStore,
    Sealer,
    SealError,
    SubjectResolver,
    is_sealed,
    store_keys_path,
    unseal,
)
from ledger.algorithms.tokens import pack_tokens
from ledger.producers.chatml import named_tokenizer

MAX_ERRORS = 50
_EXECUTION_SCOPED_NEEDS_OPEN = {"request", "tool_payload", "execution_closed", "assessment", "execution_finalized",
                                "target_selection", "predicate_evaluated", "cost_recorded"}
_EXECUTION_SCOPED_NEEDS_OPEN |= {"fault_injected", "production_feedback"}  # SPEC 6.10 evidence (ledger/projections/evidence.py)
_EXECUTION_SCOPED_NEEDS_OPEN |= {"artifact_diff", "grader_control"}  # SPEC 6.10 verifier integrity (ledger/projections/verifier.py)
_OPEN_IS_ALL = frozenset(_EXECUTION_SCOPED_NEEDS_OPEN - {"request", "execution_closed"})  # types checked for that alone


class IngestError(InputError):
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




def submission(ev: dict, codec: Codec | None = None, *, plain: dict | None = None) -> Submission:
    """Encode a validated event record into a :class:`Submission`.

    ``plain``: for a sealed request, the same request unsealed; the idempotency hash is
    taken over its encoding, so sealed and unsealed copies of one request compare equal."""
    codec = codec or default_codec()
    et = EVENT_TYPES[ev["event_type"]]
    return _submission(ev, plain, et, codec.schema_for(et.type), codec)


def _submission(ev: dict, plain: dict | None, et: EventType, schema: SchemaVersion, codec: Codec) -> Submission:
    value = codec.encode(ev, schema)
    if plain is None or plain is ev:
        chash = content_hash(ev, value)
    else:  # a sealed request: the plain content's hash, spliced from the sealed encoding (no second encode)
        chash = plain_content_hash(plain, ev, value, schema, codec)
    return new_submission(ev["event_id"], et.type, str(ev[et.key_field]), et.natural_key(ev), chash,
                          et.governance, value, event_digest(value))


def submissions(pairs: Iterable[tuple[dict, dict]],
                codec: Codec) -> tuple[list[Submission], list[tuple[int, CodecError]]]:
    """:func:`submission` of each ``(stored, plain)`` pair, and ``(index, CodecError)`` for each event its
    schema cannot hold (left out of the submissions).  The event type's catalog entry and schema are
    looked up once per type, not once per event (issue 33)."""
    out, failed = [], []
    types: dict[str, tuple[EventType, SchemaVersion]] = {}
    for i, (ev, plain) in enumerate(pairs):
        try:
            found = types.get(ev["event_type"])
            if found is None:
                et = EVENT_TYPES[ev["event_type"]]
                found = types[et.type] = (et, codec.schema_for(et.type))
            out.append(_submission(ev, plain, *found, codec))
        except CodecError as exc:
            failed.append((i, exc))
    return out, failed


MAX_NESTING = 64  # JSON arrays/objects nested deeper than this are refused (SPEC §9 "No tracebacks")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape (maybe half of a valid pair)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def read_json_lines(stream: IO[str] | IO[bytes]) -> Iterator[tuple[int, Any]]:
    """Yield (line number, decoded object); blank lines are skipped.

    Raises :class:`ValidationError` naming the line for: malformed JSON, bytes that are not
    UTF-8 (give a binary stream for the exact line; a text stream fails where its decoder
    does), arrays/objects nested deeper than :data:`MAX_NESTING`, and strings or keys holding
    a lone UTF-16 surrogate (``"\\ud800"``: no UTF-8 encoding can store it)."""
    it = iter(stream)
    n = 0
    while True:
        n += 1
        try:
            text = next(it)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise ValidationError(f"the input is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} cannot be "
                                  f"decoded ({exc.reason}; at or after this line)", line=n) from None
        if isinstance(text, (bytes, bytearray)):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValidationError(f"not UTF-8: byte 0x{text[exc.start]:02x} at byte {exc.start + 1} of the line "
                                      f"({exc.reason})", line=n) from None
        if not text.strip():
            continue
        yield n, parse_json_line(text, n)


def parse_json_line(text: str, line: int | None = None) -> Any:
    """One JSON line decoded, or :class:`ValidationError` (see :func:`read_json_lines`)."""
    try:
        obj = loads_unique(text, parse_constant=_refuse_constant)
    except DuplicateKeyError as exc:
        raise ValidationError(str(exc), line=line) from None
    except _NonFinite as exc:
        raise ValidationError(f"{exc.args[0]} is not a JSON number (NaN and Infinity are refused in JSON values)",
                              line=line, field=_constant_path(text)) from None
    except json.JSONDecodeError as exc:
        raise ValidationError(f"malformed JSON: {exc.msg} at column {exc.colno}", line=line) from None
    except RecursionError:
        raise ValidationError(f"JSON nested deeper than {MAX_NESTING} levels (the limit)", line=line) from None
    except ValueError as exc:  # an integer literal longer than Python converts (sys.get_int_max_str_digits)
        why = "an integer of more than {} digits".format(sys.get_int_max_str_digits()) if "digits" in str(exc) else exc
        raise ValidationError(f"malformed JSON: {why}", line=line) from None
    # the walk is only needed when the text could break a rule (both tests run at C speed)
    if text.count("[") + text.count("{") > MAX_NESTING or _SURROGATE_ESCAPE.search(text):
        _check_tree(obj, line)
    return obj


class _NonFinite(InputError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)


def _constant_path(text: str) -> str | None:
    """Where the first NaN / Infinity of a JSON text sits (``"metadata.x[1]"``), for the error."""
    marker = object()
    try:
        obj = json.loads(text, parse_constant=lambda _name: marker)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if value is marker:
            return path or None
        if isinstance(value, dict):
            stack += [(v, f"{path}.{k}" if path else k) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value)))]
    return None


def _check_tree(obj: Any, line: int | None) -> None:
    """Nesting depth and lone surrogates of a decoded JSON value (iterative: no recursion)."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise ValidationError("a lone UTF-16 surrogate (\\ud800-\\udfff escape without its pair) in a "
                                      "string; it cannot be stored as UTF-8", line=line, field=path or None)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_NESTING:
            raise ValidationError(f"JSON nested deeper than {MAX_NESTING} levels (the limit)", line=line,
                                  field=path or None)
        if isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else k
                if _LONE_SURROGATE.search(k):
                    raise ValidationError("a lone UTF-16 surrogate in an object key; it cannot be stored as UTF-8",
                                          line=line, field=path or None)
                stack.append((v, depth + 1, sub))
        else:
            for i, v in enumerate(value):
                if isinstance(v, (str, dict, list)):
                    stack.append((v, depth + 1, f"{path}[{i}]"))


class Ingestor:
    """Validates and appends batches of events to one log."""

    def __init__(self, log: Log, trust: Trust | None = None, *, codec: Codec | None = None,
                 producer: str = "ledger-ingest", cache_requests: int = 256, seal: str | None = "execution",
                 keystore: KeyStore | None = None) -> None:
        """``seal``: ``"execution"`` (default), ``"task"``, ``"source"`` or ``None`` (store
        request tokens in the clear; ``withdraw --erase`` then refuses those records).
        ``keystore``: where the data keys live (default: the store's ``data-keys.db``,
        opened on first use; a log without a ``url`` has none, so nothing is sealed)."""
        if seal is not None and seal not in SEAL_LEVELS:
            raise InputError(f"seal must be one of {', '.join(SEAL_LEVELS)} or None, got {seal!r}")
        self.log, self.trust, self.codec, self.producer = log, trust or Trust(), codec or default_codec(), producer
        self.seal = seal
        self._keystore, self._own_keystore = keystore, False
        self._paths: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (execution, request) -> input+output
        # (bytes, or its parts until a reference reads it: see _joined)
        # SHA-256 states of cached paths: a prefix reference to a whole path is checked, and the referring
        # request's own state derived, in O(new tokens) (a missing one is computed from the path once)
        self._shas: dict[tuple[str, str], Any] = {}
        self._cache_size = cache_requests
        self._append_takes_recheck: bool | None = None

    @property
    def keystore(self) -> KeyStore | None:
        """The key store sealing uses (the store's ``data-keys.db`` unless given; created on first use)."""
        if self._keystore is None:
            url = getattr(self.log, "url", None)
            if isinstance(url, str):
                self._keystore, self._own_keystore = KeyStore(store_keys_path(url)), True
        return self._keystore

    def _existing_keystore(self) -> KeyStore | None:
        """The key store if it exists already (reading never creates the store's key file)."""
        if self._keystore is None:
            url = getattr(self.log, "url", None)
            if not isinstance(url, str) or not store_keys_path(url).exists():
                return None
        return self.keystore

    def close(self) -> None:
        """Close the key store this ingestor opened itself (not one it was given)."""
        if self._own_keystore and self._keystore is not None:
            self._keystore.close()
            self._keystore, self._own_keystore = None, False

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
        types = {ev["event_type"] for _n, ev in events}
        batch_state = _BatchState(self.log, self._referenced_keys(ev for _n, ev in events))
        self._check_batch(events, batch_state)
        subs, failed = submissions(self._seal_step(events, types), self.codec)
        if failed:  # a value the schema cannot hold: name the line, append nothing
            lines = [events[i][0] for i, _exc in failed[:MAX_ERRORS]]
            raise IngestError([f"line {n}: {exc}" if n is not None else str(exc)
                               for n, (_i, exc) in zip(lines, failed)])
        result = self._append(subs, self._lock_time_checks(events, types))
        report = IngestReport(result=result)
        if result.conflicts:
            report.conflicts = [{"event_id": c.event_id, "natural_key": c.natural_key, "reason": c.reason,
                                 "existing_position": c.existing_position} for c in result.conflicts]
            return report
        report.appended, report.duplicates = len(result.appended), len(result.duplicates)
        for key, packed in batch_state.paths.items():
            self._remember(key, packed, batch_state.shas.get(key))
        return report

    def _check_batch(self, events: list[tuple[int | None, dict]], batch_state: "_BatchState") -> None:
        """The reference checks of every event, in order; :class:`IngestError` naming each line that fails
        (at most :data:`MAX_ERRORS`).  When it returns, every event of ``events`` passed."""
        errors: list[str] = []
        opened = batch_state.opened_here
        for n, ev in events:
            if ev["event_type"] in _OPEN_IS_ALL and ev["execution_id"] in opened:  # checked for an earlier event
                continue
            try:
                self._check_references(ev, batch_state)
            except ValidationError as exc:
                errors.append(str(ValidationError(exc.message, line=n, field=exc.field)))
                if len(errors) >= MAX_ERRORS:
                    break
        if errors:
            raise IngestError(errors)

    # -------------------------------------------------------------- checks under the writer lock
    def _lock_time_checks(self, checked: list[tuple[int | None, dict]], types: set[str]) -> Recheck | None:
        """The reference checks a concurrent writer can invalidate between :meth:`submit`'s
        checks and the append, as a ``recheck`` the log runs under its writer lock (SPEC §9
        "References are checked under the writer lock"): a request whose execution another
        writer closed meanwhile, a root split policy when another writer put one on the log.
        Everything else the checks found only grows (an opened execution, a known request or
        policy stays so), so it is not asked again.  Cost: one batched ``event_ids`` query over
        the closure keys of the batch's executions, one ``first_of_type`` if it has a root policy.
        ``types``: the event types of the batch (none of the two: no re-check, no pass over it)."""
        if "split_policy" not in types and "request" not in types:
            return None
        lines = {ev["event_id"]: n for n, ev in checked}
        roots = {ev["event_id"] for _n, ev in checked if ev["event_type"] == "split_policy" and ev["supersedes"] is None}
        if not roots and not any(ev["event_type"] == "request" for _n, ev in checked):
            return None

        def at(event_id: str) -> str:
            n = lines.get(event_id)
            return f"line {n}: " if n is not None else ""

        def recheck(new: Sequence[Submission]) -> None:
            errors = []
            requests = [s for s in new if s.event_type == "request"]
            if requests:
                closed = self.log.event_ids({_nk("execution_closed", execution_id=s.key) for s in requests})
                for s in requests:
                    close = closed.get(_nk("execution_closed", execution_id=s.key))
                    if close is not None:
                        errors.append(f"{at(s.event_id)}execution {s.key!r} was closed by a concurrent writer (event "
                                      f"{close}); no further requests are accepted (field request_id)")
            if roots and any(s.event_id in roots for s in new):
                first = self.log.first_of_type("split_policy")
                if first is not None and first not in roots:
                    errors += [f"{at(s.event_id)}a split policy is already in force (event {first}, appended by a "
                               "concurrent writer); a new policy must name the one it supersedes (field supersedes)"
                               for s in new if s.event_id in roots]
            if errors:
                raise IngestError(errors[:MAX_ERRORS])

        return recheck

    def _append(self, subs: list[Submission], recheck: Recheck | None) -> AppendResult:
        """``log.append`` with ``recheck`` under its writer lock; a log object whose ``append``
        takes no ``recheck`` (a caller's wrapper) gets the re-check just before the append."""
        if recheck is None:
            return self.log.append(subs)
        takes = self._append_takes_recheck
        if takes is None:
            try:
                takes = "recheck" in inspect.signature(self.log.append).parameters
            except (TypeError, ValueError):
                takes = False
            self._append_takes_recheck = takes
        if takes:
            return self.log.append(subs, recheck=recheck)
        known = self.log.event_ids(s.natural_key for s in subs)
        recheck([s for s in subs if known.get(s.natural_key) != s.event_id])  # retries are the log's to settle
        return self.log.append(subs)

    # -------------------------------------------------------------- the seal step
    def _seal_step(self, events: list[tuple[int | None, dict]], types: set[str]) -> list[tuple[dict, dict]]:
        """(record to store, plain record) per reference-checked event: requests sealed under
        their subject's key (``self.seal``), everything else unchanged.  Raises
        :class:`IngestError` naming the line when a key cannot be had (erased subject).
        ``types``: the event types of the batch (only requests are ever sealed)."""
        if "request" not in types:
            return [(ev, ev) for _n, ev in events]
        opener = self._existing_keystore() if any(is_sealed(ev) for _n, ev in events) else None
        plain_of = []
        for _n, ev in events:
            plain = ev
            if opener is not None and is_sealed(ev):
                try:
                    plain = unseal(ev, opener) or ev
                except SealError:
                    plain = ev
            plain_of.append((ev, plain))
        if self.seal is None or not any(ev["event_type"] == "request" and not is_sealed(ev) for _n, ev in events):
            return plain_of
        keystore = self.keystore
        if keystore is None:
            return plain_of
        sealer = Sealer(keystore, SubjectResolver(self.seal, self.log, self.codec))
        sealer.prepare(ev for _n, ev in events)  # the batch's new data keys: one transaction
        out, errors = [], []
        for (n, _ev), (ev, plain) in zip(events, plain_of):
            sealer.observe(ev)
            if ev["event_type"] != "request" or is_sealed(ev):
                out.append((ev, plain))
                continue
            try:
                out.append((sealer.seal(ev), plain))
            except KeyDestroyed as exc:
                if self.log.lookup(natural_key(ev)) is not None:
                    out.append((ev, plain))  # a retry of a stored request: the log settles duplicate/conflict
                    continue  # (either way this plain copy is never appended)
                errors.append(f"line {n}: {exc}" if n is not None else str(exc))
            except SealError as exc:
                errors.append(f"line {n}: {exc}" if n is not None else str(exc))
        if errors:
            raise IngestError(errors)
        return out

    def request_path(self, execution_id: str, request_id: str) -> bytes | None:
        """Packed input+output tokens of an accepted request (resolving prefix references).

        A sealed request is opened with the key store; raises :class:`ValidationError` when
        it cannot be (its key was destroyed, or there is no key store)."""
        key = (execution_id, request_id)
        try:  # (a gateway asks from several threads: another may evict the key between two steps)
            self._paths.move_to_end(key)
            return _joined(self._paths, key)
        except KeyError:
            pass
        rec = self.log.lookup(_nk("request", execution_id=execution_id, request_id=request_id))
        if rec is None:
            return None
        ev = self.opened_request(self.codec.decode(rec.value))
        packed = b"".join(self._full_path(ev, {}, {})[0])
        self._remember(key, packed)
        return packed

    def opened_request(self, ev: dict) -> dict:
        """A stored request with its tokens readable (unsealed with the key store)."""
        if not is_sealed(ev):
            return ev
        where = f"request {ev['request_id']!r} of execution {ev['execution_id']!r}"
        keystore = self._existing_keystore()
        if keystore is None:
            raise ValidationError(f"prefix reference to {where}, which is sealed, and no key store (data-keys.db) is "
                                  "available to open it", field="input_prefix")
        try:
            plain = unseal(ev, keystore)
        except SealError as exc:
            raise ValidationError(f"prefix reference to {where}: {exc}", field="input_prefix") from None
        if plain is None:
            raise ValidationError(f"prefix reference to {where}, whose tokens were erased (its data key was destroyed); "
                                  "send the full input_ids instead", field="input_prefix")
        return plain

    # -------------------------------------------------------------- checks
    @staticmethod
    def _referenced_keys(events: Iterable[dict]) -> set[str]:
        """Every natural key the reference checks of these events may ask the log about."""
        keys: set[str] = set()
        opened: set[str] = set()  # executions whose keys are in already (one batch holds few executions)
        closed: set[str] = set()
        for ev in events:
            et = ev["event_type"]
            if et in _EXECUTION_SCOPED_NEEDS_OPEN and ev["execution_id"] not in opened:
                opened.add(ev["execution_id"])
                keys.update(_opened_keys(ev["execution_id"]))
            if et == "request":
                keys.add(_nk("request", execution_id=ev["execution_id"], request_id=ev["request_id"]))
                if ev["execution_id"] not in closed:
                    closed.add(ev["execution_id"])
                    keys.add(_nk("execution_closed", execution_id=ev["execution_id"]))
            elif et == "record_derived":
                keys.update(_opened_keys(ev["parent_execution_id"]))
            elif et == "revalidated":
                keys.add(_nk("record_derived", derived_execution_id=ev["derived_execution_id"]))
            elif et == "split_policy":
                keys.add(_nk("split_policy", policy_id=ev["policy_id"]))
                if ev.get("supersedes") is not None:
                    keys.add(_nk("split_policy", policy_id=ev["supersedes"]))
        return keys

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
            if not st.opened(ex):
                raise ValidationError(f"execution {ex!r} was never opened (no execution_opened in the log or earlier in this batch)",
                                      field="execution_id")
        if et == "execution_opened":
            st.open.add(ev["execution_id"])
        elif et == "execution_closed":
            st.closed.add(ev["execution_id"])
        elif et == "request":
            self._check_request(ev, st)
        elif et == "record_derived":
            if not st.opened(ev["parent_execution_id"]):
                raise ValidationError(f"parent execution {ev['parent_execution_id']!r} was never opened", field="parent_execution_id")
            st.open.add(ev["derived_execution_id"])
        elif et == "split_policy":
            self._check_split_policy(ev, st)
        elif et == "canary" and ev["token_ids"] is None:
            _tokenize_canary(ev)
        elif et == "revalidated":
            if ev["derived_execution_id"] not in st.open and st.known(_nk("record_derived", derived_execution_id=ev["derived_execution_id"])) is None:
                raise ValidationError(f"no record_derived for {ev['derived_execution_id']!r}", field="derived_execution_id")

    def _check_split_policy(self, ev: dict, st: "_BatchState") -> None:
        """One policy is in force; a later one must name the one it supersedes (SPEC §4.2)."""
        pid, sup = ev["policy_id"], ev["supersedes"]
        existing = st.known(_nk("split_policy", policy_id=pid))
        if existing is not None and existing == ev["event_id"]:
            return  # a retry: the append decides duplicate vs conflict
        if sup is None:
            first = st.root_policy or self.log.first_of_type("split_policy")
            if first is not None:
                raise ValidationError(f"a split policy is already in force (event {first}); a new policy must name "
                                      "the one it supersedes", field="supersedes")
            st.root_policy = ev["event_id"]
        elif sup not in st.policies and st.known(_nk("split_policy", policy_id=sup)) is None:
            raise ValidationError(f"supersedes unknown split policy {sup!r}", field="supersedes")
        st.policies.add(pid)

    def _check_request(self, ev: dict, st: "_BatchState") -> None:
        ex, rid = ev["execution_id"], ev["request_id"]
        existing = st.known(_nk("request", execution_id=ex, request_id=rid))
        if existing is not None and existing == ev["event_id"]:
            return  # a retry: the append decides duplicate vs conflict
        if ex in st.closed or st.known(_nk("execution_closed", execution_id=ex)) is not None:
            raise ValidationError(f"execution {ex!r} is closed; no further requests are accepted", field="request_id")
        if is_sealed(ev):  # sealed by the producer: check (and remember) its plain tokens
            try:
                ev = self.opened_request(ev)
            except ValidationError:
                raise ValidationError(f"request {rid!r} is sealed under a key this ingest cannot open",
                                      field="sealed") from None
        st.paths[(ex, rid)], sha = self._full_path(ev, st.paths, st.shas)
        if sha is not None:  # this path's state, continued from the whole path it references
            sha = sha.copy()
            sha.update(ev["input_suffix_ids"] or b"")
            sha.update(ev["output_ids"])
            st.shas[(ex, rid)] = sha

    def _full_path(self, ev: dict, batch_paths: dict, batch_shas: dict) -> tuple[tuple[bytes, ...], Any]:
        """The request's packed path, input + output (its prefix reference resolved and checked), as its parts:
        :func:`_joined` joins a path when a reference first reads it, so one that no request references is never
        copied (issue 33); and, when the reference covers a whole path, that path's SHA-256 state (else None)."""
        ref = ev["input_prefix"]
        if ref is None:
            return (ev["input_ids"], ev["output_ids"]), None
        key = (ev["execution_id"], ref["request_id"])
        path = _joined(batch_paths, key) if key in batch_paths else self.request_path(*key)
        if path is None:
            raise ValidationError(f"prefix reference to unknown request {ref['request_id']!r} of execution {ev['execution_id']!r}",
                                  field="input_prefix")
        n = len(path) // 4
        if ref["length"] > n:
            raise ValidationError(f"prefix length {ref['length']} exceeds the {n} tokens of request {ref['request_id']!r}",
                                  field="input_prefix")
        whole = ref["length"] == n
        sha = self._path_sha(key, path, batch_shas if key in batch_paths else self._shas) if whole else None
        prefix = path if whole else path[: ref["length"] * 4]
        if (sha.hexdigest() if sha is not None else tokens_sha256(prefix)) != ref["sha256"]:
            raise ValidationError(f"sha256 of the first {ref['length']} tokens of request {ref['request_id']!r} does not match",
                                  field="input_prefix")
        return (prefix, ev["input_suffix_ids"] or b"", ev["output_ids"]), sha

    @staticmethod
    def _path_sha(key: tuple[str, str], path: bytes, shas: dict) -> Any:
        """The SHA-256 state of ``path`` (the packed path of ``key``): kept in ``shas``, computed once if absent."""
        sha = shas.get(key)
        if sha is None:
            sha = shas[key] = hashlib.sha256(path)
        return sha

    def _remember(self, key: tuple[str, str], packed: bytes, sha: Any = None) -> None:
        self._paths[key] = packed
        self._paths.move_to_end(key)
        if sha is not None:
            self._shas[key] = sha
        while len(self._paths) > self._cache_size:
            try:
                evicted = self._paths.popitem(last=False)[0]
            except KeyError:  # emptied by another thread meanwhile
                break
            self._shas.pop(evicted, None)


def _joined(paths: dict, key: tuple[str, str]) -> bytes:
    """``paths[key]`` as one bytes object: a path kept as its parts (:meth:`Ingestor._full_path`) is joined once
    and stored back joined."""
    path = paths[key]
    if type(path) is not bytes:
        path = paths[key] = b"".join(path)
    return path


def _tokenize_canary(ev: dict) -> None:
    """A text canary's tokens, stamped at ingest (SPEC 11.2): the log keeps the exact sequence every
    later scan looks for, so no replay or deep verification depends on the tokenizer library.  The
    signature covers text and tokenizer; ``token_ids`` is a stamped field, like ``semantics``."""

    try:
        ids = named_tokenizer(ev["tokenizer"]).encode(ev["text"])
    except Exception as exc:  # noqa: BLE001 - a vocabulary that will not load names the field
        raise ValidationError(f"cannot tokenize with {ev['tokenizer']!r}: {exc}", field="tokenizer") from None
    ev["token_ids"] = pack_tokens(ids)
    ev["stamped"].append("token_ids")


def _nk(event_type: str, **fields: str) -> str:
    """The natural key an event of ``event_type`` with ``fields`` has (SPEC §4.3, the catalog's rule)."""
    return natural_key({"event_type": event_type, **fields})


def _opened_keys(ex: str) -> list[str]:
    return [_nk("execution_opened", execution_id=ex), _nk("record_derived", derived_execution_id=ex)]


class _BatchState:
    """What the reference checks of one batch know.  ``known(key)`` answers from one batched
    ``log.event_ids`` query made before the checks (O(batch) index lookups, no event read:
    SPEC §9 "Retries are cheap on Kafka"); a key nobody predicted falls back to ``log.lookup``."""

    def __init__(self, log: Log | None = None, keys: Iterable[str] = ()) -> None:
        self.log = log
        self._ids: dict[str, str | None] = {}
        if log is not None:
            keys = set(keys)
            found = log.event_ids(keys) if keys else {}
            self._ids = {k: found.get(k) for k in keys}
        self.open: set[str] = set()
        self.closed: set[str] = set()
        self.paths: dict[tuple[str, str], bytes] = {}
        self.shas: dict[tuple[str, str], Any] = {}  # SHA-256 states of paths (see Ingestor._full_path)
        self.policies: set[str] = set()
        self.root_policy: str | None = None
        self._known: dict[str, bool] = {}
        self.opened_here: set[str] = set()  # executions :meth:`opened` answered True for

    def known(self, key: str) -> str | None:
        """The event id on the log with natural key ``key``, or None."""
        if key not in self._ids:
            rec = self.log.lookup(key) if self.log is not None else None
            self._ids[key] = rec.event_id if rec is not None else None
        return self._ids[key]

    def opened(self, execution_id: str) -> bool:
        if execution_id in self.open:
            self.opened_here.add(execution_id)
            return True
        if execution_id not in self._known:
            self._known[execution_id] = any(self.known(k) is not None for k in _opened_keys(execution_id))
        if self._known[execution_id]:
            self.opened_here.add(execution_id)
        return self._known[execution_id]


def ingest_sealed(ingestor, lines, keystore: KeyStore, *, level: str = "execution"):
    """Validate numbered JSON lines and ingest them with request tokens sealed per ``level``
    under ``keystore`` (compatibility wrapper: sealing is the ingestor's default now, see
    :class:`Ingestor` ``seal=`` / ``keystore=``)."""
    if level not in SEAL_LEVELS:
        raise InputError(f"seal level must be one of {', '.join(SEAL_LEVELS)}, got {level!r}")
    saved = ingestor.seal, ingestor._keystore, ingestor._own_keystore
    ingestor.seal, ingestor._keystore, ingestor._own_keystore = level, keystore, False
    try:
        return ingestor.ingest_lines(lines)
    finally:
        ingestor.seal, ingestor._keystore, ingestor._own_keystore = saved
