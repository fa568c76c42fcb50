"""Seeded generator of realistic token-level coding-agent executions (JSON-lines events).

Every execution is a small but complete agent run on a synthetic Python repository, rendered
through the real Qwen3.6 tokenizer (:mod:`ledger.producers.chatml`) exactly as a Qwen-based harness
would capture it. Each one contains:

* a system prompt with tool schemas and a user task (a bug report against a generated repo);
* multi-turn tool use against a virtual repository (greps, file reads, test runs, edits,
  diffs, lint), every output with a ``<think>`` block;
* a sub-agent (own system prompt and tools, ``agent_tier`` ``sub``) started by a
  ``delegate`` tool call, whose report comes back as that call's result;
* a user follow-up after the first hand-back, so re-rendering drops the earlier ``<think>``
  blocks (Qwen3 template) and the next input diverges from the previous output;
* two independent samples drawn from one prefix (identical ``input_ids``; sometimes even
  identical output tokens), the run continuing from the second one (``parent_request_id``);
* a compaction call (``turn_kind`` ``summary``) whose summary replaces the history.

All randomness comes from ``random.Random(seed)`` (the task itself from the task id), so
the same arguments always give the same events. Events are dicts shaped like SPEC §7.1
JSON lines (token lists are ``list[int]``, timestamps RFC 3339 strings).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ledger.producers import chatml

MODEL = "Qwen/Qwen3.6-35B-A3B"
POLICY = "qwen3.6-35b-a3b-coder@rl-step-1200"
EVALUATOR = "tests@1"
MIN_TURNS = 13
"""Main-agent calls needed for the fixed script (explore … compaction … final answer)."""

_EPOCH = datetime(2025, 3, 3, 8, 0, tzinfo=timezone.utc)

# --------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------

_PROJECTS = (
    "tidewater", "ledgerline", "quillmark", "parcelpost", "brightcal", "stackhash",
    "ferrywheel", "mintpress", "orbitkv", "cinderlog", "pebbledb", "harborq", "lumenroute",
    "tallyho", "wavelet", "driftwood", "saltbox", "kitepost", "emberly", "gridiron",
)
_DOMAINS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "billing": (("invoices", "pricing", "currency", "discounts", "payouts"),
                ("invoice", "price", "discount", "payout")),
    "scheduling": (("calendar", "recurrence", "slots", "reminders", "timezones"),
                   ("event", "slot", "reminder", "booking")),
    "networking": (("headers", "retry", "routing", "client", "proxy"),
                   ("header", "route", "request", "upstream")),
    "storage": (("cache", "segments", "compaction", "index", "snapshots"),
                ("segment", "entry", "snapshot", "shard")),
    "text": (("tokenize", "slugify", "templates", "markdown", "wrap"),
             ("slug", "token", "template", "paragraph")),
    "config": (("settings", "loader", "env", "schema", "profiles"),
               ("setting", "profile", "option", "override")),
    "packaging": (("versions", "manifest", "deps", "release", "wheels"),
                  ("version", "package", "release", "artifact")),
}
_SOURCES = ("swe-synth", "internal-bugbash", "oss-issues", "curated-regressions")
_FAMILIES = {"off_by_one": "boundary", "none_check": "null-handling", "rounding": "arithmetic",
             "timezone": "datetime", "missing_key": "config", "wrong_sort": "ordering",
             "wrong_exception": "error-handling", "strip_prefix": "string-handling"}

# --------------------------------------------------------------------------------------
# Bug kinds: code template (placeholders @FN@, @NOUN@, ...), the fix, the tests
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BugKind:
    fn: str
    imports: tuple[str, ...]
    preamble: tuple[str, ...]
    code: str
    old: str
    new: str
    test_imports: tuple[str, ...]
    failing_test: str
    failure: tuple[str, ...]
    """``E`` lines of the pytest failure; the first is the short summary."""
    raise_line: str | None
    """Code line that raises (exception bugs); None for assertion failures."""
    passing_tests: tuple[str, ...]
    regression_test: str
    case: str
    cause: str
    callexpr: str
    tasks: tuple[str, ...]


_BUGS: dict[str, _BugKind] = {
    "off_by_one": _BugKind(
        fn="chunk_@NOUNS@",
        imports=("from typing import Sequence, TypeVar",),
        preamble=('T = TypeVar("T")',),
        code='''def @FN@(items: Sequence[T], size: int) -> list[list[T]]:
    """Split @NOUN@ items into consecutive batches of at most ``size`` elements."""
    if size <= 0:
        raise ValueError("size must be positive")
    batches = []
    for start in range(0, len(items) - 1, size):
        batches.append(list(items[start : start + size]))
    return batches''',
        old="range(0, len(items) - 1, size)",
        new="range(0, len(items), size)",
        test_imports=(),
        failing_test='''def test_@FN@_keeps_last_partial_batch():
    assert @FN@([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]''',
        failure=("assert [[1, 2], [3, 4]] == [[1, 2], [3, 4], [5]]",
                 "  Right contains one more item: [5]"),
        raise_line=None,
        passing_tests=('''def test_@FN@_rejects_zero_size():
    with pytest.raises(ValueError):
        @FN@([1, 2], 0)''', '''def test_@FN@_even_split():
    assert @FN@([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]'''),
        regression_test='''def test_@FN@_single_item():
    assert @FN@(["only"], 3) == [["only"]]''',
        case="a single item or an odd number of items",
        cause=("the loop stops at `len(items) - 1`, so a trailing batch with one element is never "
               "emitted"),
        callexpr="@FN@(records, size=limit)",
        tasks=("`@FN@` in `@PATH@` drops the last @NOUN@ when the number of items is odd: "
               "`@FN@([1, 2, 3, 4, 5], 2)` returns only two batches. Please fix it.",
               "Our nightly @MODULE@ export is missing records. I traced it to `@FN@` "
               "(`@PATH@`), which loses the final partial batch. Fix the bug and make sure "
               "the test suite passes.",
               "Bug: batching in @PROJECT@ skips the last element when len(items) is odd. "
               "See `@FN@`. Please fix and keep the existing behaviour for even splits."),
    ),
    "none_check": _BugKind(
        fn="normalize_@NOUN@_name",
        imports=(),
        preamble=(),
        code='''def @FN@(value: str | None, default: str = "@DEFAULT@") -> str:
    """Return the canonical form of a @NOUN@ name (trimmed, lower-case)."""
    cleaned = value.strip().lower()
    return cleaned or default''',
        old="cleaned = value.strip().lower()",
        new='cleaned = (value or "").strip().lower()',
        test_imports=(),
        failing_test='''def test_@FN@_missing_value_uses_default():
    assert @FN@(None) == "@DEFAULT@"''',
        failure=("AttributeError: 'NoneType' object has no attribute 'strip'",),
        raise_line="cleaned = value.strip().lower()",
        passing_tests=('''def test_@FN@_trims_and_lowercases():
    assert @FN@("  Foo ") == "foo"''', '''def test_@FN@_empty_uses_default():
    assert @FN@("") == "@DEFAULT@"'''),
        regression_test='''def test_@FN@_none_with_explicit_default():
    assert @FN@(None, default="fallback") == "fallback"''',
        case="a missing (None) name",
        cause=("`value` can be None (the API passes it through from optional form fields) and the "
               "function calls `.strip()` on it unconditionally"),
        callexpr="[@FN@(getattr(record, 'name', None)) for record in records[:limit]]",
        tasks=("Calling `@FN@(None)` crashes with AttributeError instead of returning the "
               "default. It lives in `@PATH@`. Please fix.",
               "Production error: `AttributeError: 'NoneType' object has no attribute 'strip'` "
               "from `@FN@` when a @NOUN@ has no name. Make it fall back to the default.",
               "@PROJECT@: `@FN@` should treat a missing name like an empty one. Fix it and "
               "run the tests."),
    ),
    "rounding": _BugKind(
        fn="split_@NOUN@_amount",
        imports=(),
        preamble=(),
        code='''def @FN@(total_cents: int, parts: int) -> list[int]:
    """Split a @NOUN@ amount into ``parts`` integer shares that add up to the total."""
    if parts <= 0:
        raise ValueError("parts must be positive")
    share = round(total_cents / parts)
    shares = [share] * parts
    shares[-1] += total_cents - share * parts
    return shares''',
        old="share = round(total_cents / parts)",
        new="share = total_cents // parts",
        test_imports=(),
        failing_test='''def test_@FN@_remainder_goes_to_last_share():
    assert @FN@(200, 3) == [66, 66, 68]''',
        failure=("assert [67, 67, 66] == [66, 66, 68]", "  At index 0 diff: 67 != 66"),
        raise_line=None,
        passing_tests=('''def test_@FN@_even():
    assert @FN@(300, 3) == [100, 100, 100]''', '''def test_@FN@_sums_to_total():
    assert sum(@FN@(1001, 4)) == 1001'''),
        regression_test='''def test_@FN@_small_amount():
    assert @FN@(5, 3) == [1, 1, 3]''',
        case="amounts that do not divide evenly",
        cause=("`round(total / parts)` can round up, so the earlier shares are too large and the "
               "last one absorbs a negative remainder"),
        callexpr="[@FN@(getattr(record, 'amount', 0), limit) for record in records]",
        tasks=("`@FN@` (in `@PATH@`) gives the first shares too much when the amount does not "
               "divide evenly, e.g. 200 into 3 gives [67, 67, 66]. The remainder should go to "
               "the last share. Please fix.",
               "Finance reported that split @NOUN@s are off by a cent. `@FN@` rounds each share "
               "instead of flooring it. Fix it so `@FN@(200, 3) == [66, 66, 68]`."),
    ),
    "timezone": _BugKind(
        fn="is_@NOUN@_expired",
        imports=("from datetime import datetime, timezone",),
        preamble=(),
        code='''def @FN@(expires_at: datetime) -> bool:
    """Return True when the @NOUN@ has expired (``expires_at`` is timezone-aware)."""
    now = datetime.now()
    return expires_at <= now''',
        old="now = datetime.now()",
        new="now = datetime.now(timezone.utc)",
        test_imports=("from datetime import datetime, timedelta, timezone",),
        failing_test='''def test_@FN@_accepts_aware_datetimes():
    past = datetime(2020, 1, 1, tzinfo=timezone.utc)
    assert @FN@(past) is True''',
        failure=("TypeError: can't compare offset-naive and offset-aware datetimes",),
        raise_line="return expires_at <= now",
        passing_tests=(),
        regression_test='''def test_@FN@_future_is_not_expired():
    assert @FN@(datetime.now(timezone.utc) + timedelta(hours=1)) is False''',
        case="timestamps in the future",
        cause=("`datetime.now()` is naive while stored expiry times are UTC-aware, so the "
               "comparison raises TypeError"),
        callexpr="[record for record in records if not @FN@(record.expires_at)][:limit]",
        tasks=("`@FN@` raises `TypeError: can't compare offset-naive and offset-aware "
               "datetimes` for every @NOUN@ we load from the database. See `@PATH@`. Fix it.",
               "Since we switched to timezone-aware timestamps, `@FN@` blows up. Please make it "
               "compare in UTC and run the tests."),
    ),
    "missing_key": _BugKind(
        fn="@NOUN@_timeout",
        imports=("from typing import Any, Mapping",),
        preamble=("DEFAULT_TIMEOUT = @CONST@.0",),
        code='''def @FN@(config: Mapping[str, Any]) -> float:
    """Return the @NOUN@ timeout in seconds, falling back to ``DEFAULT_TIMEOUT``."""
    raw = config["timeout"]
    return float(raw)''',
        old='raw = config["timeout"]',
        new='raw = config.get("timeout", DEFAULT_TIMEOUT)',
        test_imports=(),
        failing_test='''def test_@FN@_defaults_when_missing():
    assert @FN@({}) == DEFAULT_TIMEOUT''',
        failure=("KeyError: 'timeout'",),
        raise_line='raw = config["timeout"]',
        passing_tests=('''def test_@FN@_parses_strings():
    assert @FN@({"timeout": "2.5"}) == 2.5''',),
        regression_test='''def test_@FN@_ignores_unrelated_keys():
    assert @FN@({"retries": 3}) == DEFAULT_TIMEOUT''',
        case="configs without a `timeout` key",
        cause=("the function indexes `config[\"timeout\"]` directly although the docstring "
               "promises a fallback to `DEFAULT_TIMEOUT`"),
        callexpr="[@FN@(getattr(record, 'config', {})) for record in records[:limit]]",
        tasks=("`@FN@` in `@PATH@` raises KeyError when the config has no timeout; it should "
               "fall back to `DEFAULT_TIMEOUT` as documented. Please fix.",
               "Loading a @NOUN@ profile without `timeout` crashes with `KeyError: 'timeout'`. "
               "Make `@FN@` use the default and keep the tests green."),
    ),
    "wrong_sort": _BugKind(
        fn="recent_@NOUNS@",
        imports=("from typing import Any, Iterable",),
        preamble=(),
        code='''def @FN@(records: Iterable[Any], limit: int = 10) -> list[Any]:
    """Return the ``limit`` most recently updated @NOUN@ records, newest first."""
    ordered = sorted(records, key=lambda record: record.updated_at)
    return ordered[:limit]''',
        old="key=lambda record: record.updated_at)",
        new="key=lambda record: record.updated_at, reverse=True)",
        test_imports=("from datetime import datetime", "from types import SimpleNamespace"),
        failing_test='''def _rec(name, day):
    return SimpleNamespace(name=name, updated_at=datetime(2024, 1, day))


def test_@FN@_newest_first():
    records = [_rec("a", 1), _rec("b", 3), _rec("c", 2)]
    assert [r.name for r in @FN@(records)] == ["b", "c", "a"]''',
        failure=("assert ['a', 'c', 'b'] == ['b', 'c', 'a']", "  At index 0 diff: 'a' != 'b'"),
        raise_line=None,
        passing_tests=('''def test_@FN@_empty():
    assert @FN@([]) == []''',),
        regression_test='''def test_@FN@_respects_limit():
    records = [_rec("a", 1), _rec("b", 3), _rec("c", 2)]
    assert [r.name for r in @FN@(records, limit=1)] == ["b"]''',
        case="the `limit` argument",
        cause=("`sorted` is called without `reverse=True`, so the oldest records come first and "
               "`limit` keeps the wrong ones"),
        callexpr="@FN@(records, limit=limit)",
        tasks=("The dashboard shows the *oldest* @NOUN@s under \"Recent\". `@FN@` in `@PATH@` "
               "should return newest first. Please fix.",
               "`@FN@` returns records in ascending order of `updated_at`; the docstring says "
               "newest first. Fix it and make sure `limit` keeps the newest ones."),
    ),
    "wrong_exception": _BugKind(
        fn="parse_@NOUN@_size",
        imports=("import re",),
        preamble=('_SIZE_RE = re.compile(r"(\\d+)([kmg]?)", re.IGNORECASE)',
                  '_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}'),
        code='''def @FN@(text: str) -> int:
    """Parse a @NOUN@ size such as ``'10k'`` or ``'2M'`` into bytes."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise RuntimeError(f"invalid @NOUN@ size: {text!r}")
    number, unit = match.groups()
    return int(number) * _UNITS[unit.lower()]''',
        old="raise RuntimeError(",
        new="raise ValueError(",
        test_imports=(),
        failing_test='''def test_@FN@_rejects_garbage():
    with pytest.raises(ValueError):
        @FN@("lots")''',
        failure=("RuntimeError: invalid @NOUN@ size: 'lots'",),
        raise_line='raise RuntimeError(f"invalid @NOUN@ size: {text!r}")',
        passing_tests=('''def test_@FN@_units():
    assert @FN@("10k") == 10240''', '''def test_@FN@_plain_number():
    assert @FN@("3") == 3'''),
        regression_test='''def test_@FN@_rejects_empty():
    with pytest.raises(ValueError):
        @FN@("")''',
        case="empty strings",
        cause="invalid input raises RuntimeError, but callers (and the CLI) catch ValueError",
        callexpr="[@FN@(str(getattr(record, 'size', '0'))) for record in records[:limit]]",
        tasks=("`@FN@(\"lots\")` raises RuntimeError; callers expect ValueError for bad input. "
               "It is in `@PATH@`. Please fix.",
               "The CLI crashes with a traceback on a bad size flag instead of printing a usage "
               "error, because `@FN@` raises the wrong exception type. Fix it."),
    ),
    "strip_prefix": _BugKind(
        fn="clean_@NOUN@_tag",
        imports=(),
        preamble=(),
        code='''def @FN@(tag: str) -> str:
    """Strip the leading ``v`` from a @NOUN@ tag (``v1.2.0`` -> ``1.2.0``)."""
    return tag.strip().lstrip("v")''',
        old='lstrip("v")',
        new='removeprefix("v")',
        test_imports=(),
        failing_test='''def test_@FN@_keeps_words_starting_with_v():
    assert @FN@("vvendor-1.0") == "vendor-1.0"''',
        failure=("AssertionError: assert 'endor-1.0' == 'vendor-1.0'", "  - vendor-1.0",
                 "  + endor-1.0"),
        raise_line=None,
        passing_tests=('''def test_@FN@_plain():
    assert @FN@("v1.2.0") == "1.2.0"''', '''def test_@FN@_whitespace():
    assert @FN@(" 2.0 ") == "2.0"'''),
        regression_test='''def test_@FN@_double_v():
    assert @FN@("vv1") == "v1"''',
        case="tags that start with more than one `v`",
        cause="`str.lstrip(\"v\")` strips every leading `v` character, not the prefix `v`",
        callexpr="[@FN@(str(getattr(record, 'tag', ''))) for record in records[:limit]]",
        tasks=("`@FN@(\"vvendor-1.0\")` returns `endor-1.0`. It should only remove a single "
               "leading `v`. See `@PATH@`.",
               "Release tags like `vendored-2.1` get mangled by `@FN@`. Please fix it without "
               "changing the result for normal `v1.2.3` tags."),
    ),
}

# Helper functions that fill the modules: (name, imports, code, test or ""), placeholders
# @NAME@, @NOUN@, @NOUNS@, @CLASS@, @MODULE@, @CONST@, @UPPER@.
_FILLERS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("count_@NOUNS@", ("from typing import Iterable",),
     """\
def @NAME@(values: Iterable[str]) -> dict[str, int]:
    \"\"\"Count how often each @NOUN@ appears in ``values``.\"\"\"
    counts: dict[str, int] = {}
    for value in values:
        key = value.strip().lower()
        if not key:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts""", """def test_@NAME@_ignores_blanks():
    assert @NAME@(["a", " A", "", "b"]) == {"a": 2, "b": 1}"""),
    ("load_@NOUNS@", ("import json", "from pathlib import Path", "from typing import Any"),
     """\
def @NAME@(path: Path) -> list[dict[str, Any]]:
    \"\"\"Load @NOUN@ records from a JSON-lines file.\"\"\"
    records = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid @NOUN@ record") from exc
    return records""", """def test_@NAME@_reads_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"id": 1}\\n\\n{"id": 2}\\n')
    assert [r["id"] for r in @NAME@(path)] == [1, 2]"""),
    ("smooth_@NOUN@_values", ("from typing import Sequence",),
     """\
def @NAME@(items: Sequence[float], window: int = @CONST@) -> list[float]:
    \"\"\"Moving average of @NOUN@ values over ``window`` samples.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, item in enumerate(items):
        total += item
        if i >= window:
            total -= items[i - window]
        out.append(total / min(i + 1, window))
    return out""", ""),
    ("flatten_@NOUN@_settings", ("from typing import Any, Mapping",),
     """\
def @NAME@(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    \"\"\"Flatten nested @NOUN@ settings into dotted keys.\"\"\"
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        full = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(@NAME@(value, full))
        else:
            flat[full] = value
    return flat""", """def test_@NAME@_nested():
    assert @NAME@({"a": {"b": 1}, "c": 2}) == {"a.b": 1, "c": 2}"""),
    ("quote_@NOUN@", (),
     """\
def @NAME@(raw: str) -> str:
    \"\"\"Quote a @NOUN@ value for the @MODULE@ log format.\"\"\"
    escaped = raw.replace("\\\\", "\\\\\\\\").replace('"', '\\\\"')
    return f'"{escaped}"'""", ""),
    ("@NOUN@_backoff", (),
     """\
def @NAME@(attempt: int, base: float = 0.5, cap: float = @CONST@.0) -> float:
    \"\"\"Delay before retry ``attempt`` of a @NOUN@ request (exponential, capped).\"\"\"
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    return min(cap, base * 2**attempt)""", """def test_@NAME@_is_capped():
    assert @NAME@(50) == @CONST@.0"""),
    ("@CLASS@", ("from dataclasses import dataclass", "from datetime import datetime"),
     """\
@dataclass(frozen=True)
class @NAME@:
    \"\"\"A @NOUN@ as stored in the @MODULE@ table.\"\"\"

    id: str
    name: str
    updated_at: datetime
    tags: tuple[str, ...] = ()

    def label(self) -> str:
        return f"{self.name} ({self.id})\"""", ""),
    ("dedupe_@NOUNS@", ("from typing import Hashable, Iterable, TypeVar",),
     """\
def @NAME@(items: Iterable[Hashable]) -> list[Hashable]:
    \"\"\"Drop repeated @NOUN@ keys, keeping the first occurrence.\"\"\"
    seen: set[Hashable] = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out""", """def test_@NAME@_keeps_order():
    assert @NAME@(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]"""),
    ("parse_@NOUN@_pairs", (),
     """\
def @NAME@(text: str, sep: str = ",") -> dict[str, str]:
    \"\"\"Parse ``key=value`` @NOUN@ pairs separated by ``sep``.\"\"\"
    pairs: dict[str, str] = {}
    for chunk in text.split(sep):
        chunk = chunk.strip()
        if not chunk:
            continue
        key, _, value = chunk.partition("=")
        if not key:
            raise ValueError(f"missing key in {chunk!r}")
        pairs[key.strip()] = value.strip()
    return pairs""", """def test_@NAME@_basic():
    assert @NAME@("a=1, b = 2,") == {"a": "1", "b": "2"}


def test_@NAME@_missing_key():
    with pytest.raises(ValueError):
        @NAME@("=3")"""),
    ("@CLASS@Registry", ("import threading", "from typing import Any"),
     """\
class @NAME@:
    \"\"\"Thread-safe in-memory registry of @NOUNS@ keyed by id.\"\"\"

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._lock = threading.Lock()

    def add(self, key: str, item: Any) -> None:
        with self._lock:
            if key in self._items:
                raise KeyError(f"duplicate @NOUN@ {key!r}")
            self._items[key] = item

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            return self._items.get(key, default)

    def remove(self, key: str) -> bool:
        with self._lock:
            return self._items.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._items)""", """def test_@NAME@_rejects_duplicates():
    registry = @NAME@()
    registry.add("x", 1)
    with pytest.raises(KeyError):
        registry.add("x", 2)
    assert len(registry) == 1"""),
    ("group_@NOUNS@_by",
     ("from collections import defaultdict", "from typing import Any, Iterable"),
     """\
def @NAME@(items: Iterable[Any], attribute: str) -> dict[Any, list[Any]]:
    \"\"\"Group @NOUN@ records by the value of ``attribute``.\"\"\"
    groups: dict[Any, list[Any]] = defaultdict(list)
    for item in items:
        groups[getattr(item, attribute)].append(item)
    return dict(groups)""", ""),
    ("write_@NOUNS@_atomic",
     ("import json", "import os", "from pathlib import Path",
      "from typing import Any, Iterable, Mapping"),
     """\
def @NAME@(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    \"\"\"Write @NOUN@ rows as JSON lines atomically; returns the number of rows.\"\"\"
    tmp = path.with_suffix(path.suffix + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\\n")
            count += 1
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return count""", """def test_@NAME@_roundtrip(tmp_path):
    path = tmp_path / "out.jsonl"
    assert @NAME@(path, [{"a": 1}, {"a": 2}]) == 2
    assert path.read_text().count("\\n") == 2"""),
    ("@NOUN@_percentile", ("from typing import Sequence",),
     """\
def @NAME@(values: Sequence[float], q: float) -> float:
    \"\"\"Linear-interpolated percentile ``q`` (0..100) of @NOUN@ values.\"\"\"
    if not values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)""",
     """\
def test_@NAME@_median():
    assert @NAME@([3.0, 1.0, 2.0], 50) == 2.0


def test_@NAME@_rejects_empty():
    with pytest.raises(ValueError):
        @NAME@([], 90)"""),
    ("@NOUN@_overrides_from_env", ("import os",),
     """\
def @NAME@(prefix: str = "@UPPER@_") -> dict[str, str]:
    \"\"\"Collect @NOUN@ overrides from environment variables starting with ``prefix``.\"\"\"
    return {
        key[len(prefix) :].lower(): value
        for key, value in sorted(os.environ.items())
        if key.startswith(prefix)
    }""", """def test_@NAME@(monkeypatch):
    monkeypatch.setenv("@UPPER@_LEVEL", "3")
    assert @NAME@()["level"] == "3\""""),
    ("paginate_@NOUNS@", ("from typing import Any, Sequence",),
     """\
def @NAME@(items: Sequence[Any], page: int, per_page: int = @CONST@) -> dict[str, Any]:
    \"\"\"Return one page of @NOUN@ items with paging metadata.\"\"\"
    if page < 1 or per_page < 1:
        raise ValueError("page and per_page must be >= 1")
    total = len(items)
    start = (page - 1) * per_page
    return {
        "items": list(items[start : start + per_page]),
        "page": page,
        "pages": max(1, -(-total // per_page)),
        "total": total,
    }""", """def test_@NAME@_last_page():
    result = @NAME@(list(range(7)), page=2, per_page=5)
    assert result["items"] == [5, 6]
    assert result["pages"] == 2"""),
    ("@NOUN@_fingerprint", ("import hashlib", "import json", "from typing import Any, Mapping"),
     """\
def @NAME@(payload: Mapping[str, Any]) -> str:
    \"\"\"Stable SHA-256 fingerprint of a @NOUN@ payload (sorted keys, compact JSON).\"\"\"
    data = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(data).hexdigest()""", """def test_@NAME@_ignores_key_order():
    assert @NAME@({"a": 1, "b": 2}) == @NAME@({"b": 2, "a": 1})"""),
)

# --------------------------------------------------------------------------------------
# Task: a generated repository with one bug
# --------------------------------------------------------------------------------------


def _fill(template: str, slots: dict[str, str]) -> str:
    for key, value in slots.items():
        template = template.replace(f"@{key}@", value)
    return template


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _noun_slots(noun: str) -> dict[str, str]:
    return {"NOUN": noun, "NOUNS": _plural(noun), "UPPER": noun.upper(),
            "CLASS": noun.title().replace("_", "")}


_CALLER = '''def @CALLER@(records: list[Any], limit: int = @CONST@) -> list[Any]:
    """Prepare @NOUN@ data for the @MODULE@ job."""
    log.debug("preparing %d @NOUN@ records", len(records))
    result = @CALLEXPR@
    return list(result)'''


@dataclass
class _Task:
    """A generated repository with one bug, and the bug report the user files."""

    task_id: str
    project: str
    domain: str
    kind: str
    bug: _BugKind
    slots: dict[str, str]
    target_path: str
    caller_path: str
    caller_fn: str
    test_path: str
    files: dict[str, list[str]]
    description: str
    source: str

    @property
    def fn(self) -> str:
        return self.slots["FN"]

    def render(self, template: str) -> str:
        return _fill(template, self.slots)


def _python_module(docstring: str, imports: Iterable[str], preamble: Sequence[str],
                   blocks: Sequence[str]) -> list[str]:
    """Source lines of a module; ``from X import a`` lines for one X are merged."""
    plain: set[str] = set()
    from_imports: dict[str, set[str]] = {}
    for line in imports:
        if line.startswith("from "):
            module, _, names = line[5:].partition(" import ")
            from_imports.setdefault(module, set()).update(n.strip() for n in names.split(","))
        else:
            plain.add(line)
    lines = [f'"""{docstring}"""', "", "from __future__ import annotations", ""]
    lines += sorted(plain)
    lines += [f"from {module} import {', '.join(sorted(names, key=str.lower))}"
              for module, names in sorted(from_imports.items())]
    text = "\n".join(lines + [""] + list(preamble)) + "\n\n\n" + "\n\n\n".join(blocks) + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text).split("\n")[:-1]


def _make_task(task_id: str) -> _Task:
    """The task (repository, bug, description) for ``task_id``; depends only on the id."""
    rng = random.Random(f"task/{task_id}")
    project = rng.choice(_PROJECTS)
    domain = rng.choice(sorted(_DOMAINS))
    modules, nouns = _DOMAINS[domain]
    kind = rng.choice(sorted(_BUGS))
    bug = _BUGS[kind]
    mods = rng.sample(modules, k=rng.randint(3, len(modules)))
    target_mod, caller_mod = mods[0], mods[1]
    slots = _noun_slots(rng.choice(nouns))
    slots.update(PROJECT=project, MODULE=target_mod,
                 DEFAULT=rng.choice(("unknown", "default", "unnamed", "general")),
                 CONST=str(rng.choice((3, 5, 8, 10, 30, 60))))
    slots["FN"] = _fill(bug.fn, slots)
    target_path = f"src/{project}/{target_mod}.py"
    slots["PATH"] = target_path
    deck: list[tuple[str, tuple[str, ...], str, str]] = []
    used = {slots["FN"]}

    def helpers(count: int, module: str) -> tuple[list[str], list[str], list[str], list[str]]:
        """(names, code blocks, imports, tests) of ``count`` helpers for ``module``."""
        names: list[str] = []
        blocks: list[str] = []
        imports: list[str] = []
        tests: list[str] = []
        while len(blocks) < count:
            if not deck:
                deck.extend(_FILLERS)
                rng.shuffle(deck)
            name_t, imps, code, test = deck.pop()
            local = dict(slots, MODULE=module, **_noun_slots(rng.choice(nouns)))
            local["NAME"] = _fill(name_t, local)
            if local["NAME"] in used:
                continue
            used.add(local["NAME"])
            names.append(local["NAME"])
            blocks.append(_fill(code, local))
            imports += imps
            if test:
                tests.append(_fill(test, local))
        return names, blocks, imports, tests

    files: dict[str, list[str]] = {}
    helper_names, blocks, imports, target_extra_tests = helpers(rng.randint(2, 4), target_mod)
    blocks.insert(rng.randint(0, len(blocks)), _fill(bug.code, slots))
    files[target_path] = _python_module(
        f"{target_mod.title()} helpers for {project}.", imports + list(bug.imports),
        [_fill(p, slots) for p in bug.preamble], blocks)
    caller_fn = f"prepare_{target_mod}_batch"
    for module in mods[1:]:
        names, blocks, imports, tests = helpers(rng.randint(3, 5), module)
        preamble: list[str] = []
        if module == caller_mod:
            callexpr = _fill(bug.callexpr, slots)
            blocks.insert(rng.randint(0, len(blocks)),
                          _fill(_CALLER, dict(slots, CALLER=caller_fn, CALLEXPR=callexpr)))
            imports += ["import logging", "from typing import Any",
                        f"from {project}.{target_mod} import {slots['FN']}"]
            preamble = ["log = logging.getLogger(__name__)"]
        files[f"src/{project}/{module}.py"] = _python_module(
            f"{module.title()} for {project}.", imports, preamble, blocks)
        if tests:
            tested = [name for name in names if any(name in test for test in tests)]
            files[f"tests/test_{module}.py"] = _python_module(
                f"Tests for {project}.{module}.",
                ["import pytest", f"from {project}.{module} import {', '.join(tested)}"],
                [], tests)
    files[f"src/{project}/__init__.py"] = [
        f'"""{project}: {domain} toolkit."""', "",
        f'__version__ = "0.{rng.randint(1, 9)}.{rng.randint(0, 20)}"']
    test_path = f"tests/test_{target_mod}.py"
    target_tests = [bug.failing_test, *bug.passing_tests]
    rng.shuffle(target_tests)
    imported = [slots["FN"]] + (["DEFAULT_TIMEOUT"] if kind == "missing_key" else []) + [
        name for name in helper_names if any(name in test for test in target_extra_tests)]
    files[test_path] = _python_module(
        f"Tests for {project}.{target_mod}.",
        ["import pytest", *bug.test_imports,
         f"from {project}.{target_mod} import {', '.join(imported)}"], [],
        [_fill(test, slots) for test in target_tests] + target_extra_tests)
    files["pyproject.toml"] = [
        "[project]", f'name = "{project}"', 'requires-python = ">=3.11"', "dependencies = []",
        "", "[tool.pytest.ini_options]", 'testpaths = ["tests"]', "", "[tool.ruff]",
        "line-length = 100"]
    files["CHANGELOG.md"] = ["# Changelog", "", "## Unreleased", "",
                             f"- Faster {slots['NOUN']} loading.", ""]
    return _Task(task_id=task_id, project=project, domain=domain, kind=kind, bug=bug,
                 slots=slots, target_path=target_path,
                 caller_path=f"src/{project}/{caller_mod}.py", caller_fn=caller_fn,
                 test_path=test_path, files=dict(sorted(files.items())),
                 description=_fill(rng.choice(bug.tasks), slots), source=rng.choice(_SOURCES))


def task_registered(task_id: str) -> dict[str, Any]:
    """The ``task_registered`` event for a generated task (fixture, family, features)."""
    task = _make_task(task_id)
    return {
        "type": "task_registered", "task_id": task_id,
        "fixture": f"{task.project}@{hashlib.sha256(task_id.encode()).hexdigest()[:12]}",
        "family": _FAMILIES[task.kind], "source": task.source,
        "features": {"repo": task.project, "domain": task.domain, "bug_kind": task.kind,
                     "path": task.target_path, "symbol": task.fn,
                     "text": task.description},
    }


# --------------------------------------------------------------------------------------
# The simulated harness
# --------------------------------------------------------------------------------------


def _rfc3339(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _logprobs(rng: random.Random, n: int) -> list[float]:
    """Plausible behaviour log-probs: mostly near 0, a tail of uncertain tokens."""
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.72:
            x = rng.random() * 0.02
        elif u < 0.95:
            x = rng.expovariate(2.5)
        else:
            x = min(rng.expovariate(0.35), 18.0)
        out.append(-round(1e-5 + x, 5))
    return out


@dataclass
class _Agent:
    agent_id: str
    tier: str
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    last_request: str | None = None
    unconsumed: list[str] = field(default_factory=list)


def _tool(name: str, description: str, required: dict[str, tuple[str, str]],
          optional: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A function-tool schema; parameters map name -> (JSON type, description)."""
    params = {**required, **(optional or {})}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {k: {"type": t, "description": d}
                                      for k, (t, d) in params.items()},
                       "required": list(required)}}}


_READ = _tool("read_file", "Read a text file from the repository. Lines are numbered.",
              {"path": ("string", "Path relative to the repository root.")},
              {"offset": ("integer", "First line to read (1-based)."),
               "limit": ("integer", "Maximum number of lines.")})
_GREP = _tool("grep", "Search file contents with a regular expression.",
              {"pattern": ("string", "Regular expression.")},
              {"path": ("string", "Directory or file to search (default: repository root).")})
_LIST = _tool("list_files", "List files under a directory.",
              {"path": ("string", "Directory relative to the repository root.")})
_BASH = _tool("bash", "Run a shell command in the repository and return its output.",
              {"command": ("string", "The command line.")},
              {"timeout": ("integer", "Timeout in seconds (default 120).")})
_EDIT = _tool("edit_file", "Replace an exact string in a file.",
              {"path": ("string", "File to edit."), "old_string": ("string", "Text to replace."),
               "new_string": ("string", "Replacement text.")})
_DELEGATE = _tool("delegate", "Start a read-only research sub-agent and return its report.",
                  {"description": ("string", "Short label for the sub-task."),
                   "prompt": ("string", "Complete instructions for the sub-agent.")})
MAIN_TOOLS = [_BASH, _READ, _EDIT, _GREP, _LIST, _DELEGATE]
SUB_TOOLS = [_READ, _GREP, _LIST]

_IDENTITIES = (
    "You are {name}, an autonomous software engineering agent. You work inside a sandboxed "
    "checkout of the user's repository and solve the task end to end.",
    "You are {name}, a coding agent. You fix bugs and implement changes in the user's "
    "repository using the tools provided, then report back concisely.",
    "You are {name}, an AI pair programmer operating in a terminal. Investigate before you "
    "edit, keep changes minimal, and verify them with the project's tests.",
)
_RULES = (
    "Read the relevant code before editing it; never guess file contents.",
    "Prefer small, targeted edits over rewrites.",
    "Run the tests that cover your change before you say you are done.",
    "Do not modify tests to make them pass unless the test itself is wrong.",
    "Keep the public API backwards compatible unless the user asks otherwise.",
    "Use `delegate` for broad read-only searches so your own context stays small.",
    "When a command fails, read the error carefully before trying again.",
    "Follow the existing code style (type hints, docstrings, ruff line length).",
    "Never commit or push unless the user asks you to.",
    "Answer in the language of the user; keep the final report short.",
)
_SUB_IDENTITIES = (
    "You are a read-only research sub-agent. Another agent delegated a question to you. "
    "Search and read the code, then answer with a precise report (paths and line numbers). "
    "You cannot edit files or run commands.",
    "You are an exploration sub-agent working for a coding agent. Find the facts it asked "
    "for using only read_file, grep and list_files, and finish with a concise report.",
)
_COMPACTION_PROMPTS = (
    "Your context window is almost full. Write a summary of the conversation so far that "
    "lets you continue without the earlier messages: the user's requests, what you found, "
    "files you changed, test results and the next step. Put it inside <summary></summary> "
    "and do not call any tools.",
    "Context limit reached. Summarize the work so far (task, root cause, edits, commands and "
    "their results, open items) inside <summary></summary>. No tool calls.",
)


def _system_prompt(rng: random.Random, task: _Task, start: datetime, python: str) -> str:
    name = rng.choice(("Ferris", "Atlas", "Kestrel", "Juniper", "Orca"))
    rules = rng.sample(_RULES, k=rng.randint(4, 7))
    return (rng.choice(_IDENTITIES).format(name=name) + "\n\n# Rules\n"
            + "".join(f"- {rule}\n" for rule in rules)
            + f"\n# Environment\n- Repository: /workspace/{task.project}\n"
            + f"- Python {python}, pytest, ruff\n"
            + f"- OS: Linux\n- Date: {start.date().isoformat()}")


class _Run:
    """One simulated execution: harness state, virtual repository and the event list."""

    def __init__(self, execution_id: str, task: _Task, seed: int) -> None:
        self.rng = random.Random(seed)
        self.execution_id = execution_id
        self.task = task
        self.files = {path: list(lines) for path, lines in task.files.items()}
        self.events: list[dict[str, Any]] = []
        self.clock = _EPOCH + timedelta(days=self.rng.randint(0, 180),
                                        seconds=self.rng.randint(0, 86_400))
        self.start = self.clock
        self.python = self.rng.choice(("3.11.9", "3.12.4", "3.12.7", "3.13.1"))
        self.requests = 0
        self.fixed = False
        self.decks: dict[str, list[str]] = {}
        self.read_paths = {task.target_path, task.test_path}
        self.artifacts: list[str] = []
        self.edited: list[str] = []

    # -- clock and events ------------------------------------------------------------

    def tick(self, seconds: float) -> str:
        self.clock += timedelta(seconds=seconds)
        return _rfc3339(self.clock)

    def emit(self, event: dict[str, Any], seconds: float = 0.05) -> None:
        event.setdefault("occurred_at", self.tick(seconds))
        self.events.append(event)

    def call_id(self) -> str:
        return f"call_{self.rng.getrandbits(64):016x}"

    # -- model calls -------------------------------------------------------------------

    def model_call(self, agent: _Agent, message: dict[str, Any], *, turn_kind: str = "task",
                   alternative: dict[str, Any] | None = None, identical: bool = False) -> None:
        """Record a model call producing ``message`` and append it to the agent's history.

        With ``alternative`` the harness draws two samples from the same input: first the
        alternative (``identical``: the very same tokens, hence the same log-probs), then
        ``message``, which the run continues from.
        """
        input_ids = chatml.render_prompt(agent.messages, agent.tools)
        consumed, agent.unconsumed = agent.unconsumed, []
        parent = agent.last_request
        samples = [alternative, message] if alternative is not None else [message]
        request_id = ""
        logprobs: list[float] = []
        for sample in samples:
            output_ids = chatml.render_output(sample)
            if not (identical and logprobs):
                logprobs = _logprobs(self.rng, len(output_ids))
            self.requests += 1
            request_id = f"r{self.requests:03d}"
            calls = sample.get("tool_calls") or []
            event = {
                "type": "request", "execution_id": self.execution_id,
                "request_id": request_id, "input_ids": input_ids, "output_ids": output_ids,
                "output_logprobs": logprobs, "agent_id": agent.agent_id,
                "agent_tier": agent.tier, "turn_kind": turn_kind, "generator": "policy",
                "consumed_tool_call_ids": list(consumed),
                "emitted_tool_call_ids": [call["id"] for call in calls],
                "model": MODEL, "finish_reason": "tool_calls" if calls else "stop",
            }
            if parent is not None:
                event["parent_request_id"] = parent
            self.emit(event, 0.4 + len(input_ids) / 40_000 + len(output_ids) / 70)
            for call in calls:
                self.emit({"type": "tool_payload", "execution_id": self.execution_id,
                           "call_id": call["id"], "kind": "call",
                           "payload": {"name": call["name"], "arguments": call["arguments"]}})
        agent.messages.append(message)
        agent.last_request = request_id

    def results(self, agent: _Agent, message: dict[str, Any]) -> None:
        """Execute the message's tool calls and append their results to the history."""
        for call in message.get("tool_calls") or []:
            content = self.execute(call)
            agent.messages.append({"role": "tool", "content": content})
            agent.unconsumed.append(call["id"])
            self.emit({"type": "tool_payload", "execution_id": self.execution_id,
                       "call_id": call["id"], "kind": "result",
                       "payload": {"content": content, "is_error": False}},
                      self.rng.uniform(0.2, 2.5))

    def step(self, agent: _Agent, reasoning: str, content: str,
             calls: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """One model call with tool calls, followed by their results."""
        message = self.assistant(reasoning, content, calls)
        self.model_call(agent, message)
        self.results(agent, message)

    def assistant(self, reasoning: str, content: str,
                  calls: Sequence[tuple[str, dict[str, Any]]] = ()) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "reasoning_content": reasoning,
                                   "content": content}
        if calls:
            message["tool_calls"] = [{"id": self.call_id(), "name": name, "arguments": args}
                                     for name, args in calls]
        return message

    # -- the virtual repository ---------------------------------------------------------

    def execute(self, call: dict[str, Any]) -> str:
        args = call["arguments"]
        name = call["name"]
        if name == "read_file":
            return self.read(args["path"], args.get("offset", 1), args.get("limit"))
        if name == "grep":
            return self.grep(args["pattern"], args.get("path", "."))
        if name == "list_files":
            return self.list_files(args["path"])
        if name == "edit_file":
            return self.edit(args["path"], args["old_string"], args["new_string"])
        if name == "bash":
            return self.bash(args["command"])
        if name == "delegate":
            return self.run_subagent(args["prompt"])
        raise ValueError(f"unknown tool {name}")

    def read(self, path: str, offset: int = 1, limit: int | None = None) -> str:
        lines = self.files.get(path)
        if lines is None:
            return f"Error: file not found: {path}"
        end = len(lines) if limit is None else min(len(lines), offset - 1 + limit)
        return "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(offset, end + 1))

    def grep(self, pattern: str, path: str) -> str:
        regex = re.compile(pattern)
        hits = [f"{name}:{n}:{line}" for name in sorted(self.files)
                if name.startswith(path.rstrip("/")) or path in (".", "")
                for n, line in enumerate(self.files[name], start=1) if regex.search(line)]
        return "\n".join(hits[:40]) if hits else "No matches found."

    def list_files(self, path: str) -> str:
        prefix = "" if path in (".", "") else path.rstrip("/") + "/"
        names = sorted(name for name in self.files if name.startswith(prefix))
        return "\n".join(names) if names else f"Error: no such directory: {path}"

    def edit(self, path: str, old: str, new: str) -> str:
        text = "\n".join(self.files[path])
        if text.count(old) != 1:
            return f"Error: old_string must match exactly once in {path}"
        self.files[path] = text.replace(old, new).split("\n")
        self.edited.append(path)
        self.artifacts.append(f"{self.rng.getrandbits(28):07x}")
        return f"The file {path} has been updated (1 replacement)."

    def n_tests(self, path: str = "tests/") -> int:
        """Number of test functions in the test files under ``path``."""
        return sum(line.startswith("def test_") for name, lines in self.files.items()
                   if name.startswith(path) for line in lines)

    def bash(self, command: str) -> str:
        if command.startswith(("python -m pytest", "pytest")):
            return self.pytest(command)
        if command.startswith("git diff"):
            return self.diff()
        if command.startswith("git status"):
            changed = sorted(set(self.edited))
            return ("On branch main\nChanges not staged for commit:\n"
                    + "".join(f"\tmodified:   {p}\n" for p in changed)
                    + "\nno changes added to commit (use \"git add\" and/or \"git commit -a\")")
        if command.startswith("ruff"):
            return "All checks passed!"
        if command.startswith("mypy"):
            n = sum(1 for p in self.files if p.endswith(".py"))
            return f"Success: no issues found in {n} source files"
        return f"bash: {command.split()[0]}: command not found"

    def diff(self) -> str:
        chunks = []
        for path in sorted(set(self.edited)):
            original = self.task.files[path]
            chunks += difflib.unified_diff(original, self.files[path], f"a/{path}", f"b/{path}",
                                           lineterm="", n=2)
        return "\n".join(chunks)

    def pytest(self, command: str) -> str:
        """Pytest output for the current state of the virtual repository."""
        task = self.task
        failing = "" if self.fixed else re.search(
            r"def (test_\w+)", task.render(task.bug.failing_test)).group(1)
        scope = task.test_path if task.test_path in command else "tests/"
        outcomes = {name: "".join("F" if line.startswith(f"def {failing}(") and failing else "."
                                  for line in lines if line.startswith("def test_"))
                    for name, lines in self.files.items() if name.startswith(scope)}
        total = sum(len(marks) for marks in outcomes.values())
        failed = sum(marks.count("F") for marks in outcomes.values())
        seconds = self.rng.uniform(0.15, 0.6) if scope != "tests/" else self.rng.uniform(0.8, 4.5)
        quiet = " -q" in command
        lines = [] if quiet else [
            " test session starts ".center(80, "="),
            f"platform linux -- Python {self.python}, pytest-8.3.3, pluggy-1.5.0",
            f"rootdir: /workspace/{task.project}", "configfile: pyproject.toml",
            f"collected {total} items", ""]
        done = 0
        for name, marks in outcomes.items():
            done += len(marks)
            progress = f"[{round(100 * done / total):3d}%]"
            text = marks if quiet else f"{name} {marks}"
            lines.append(text.ljust(80 - len(progress)) + progress)
        if failed:
            lines += self.failure_report()
            summary = f"{failed} failed, {total - failed} passed in {seconds:.2f}s"
        else:
            summary = f"{total} passed in {seconds:.2f}s"
        lines.append(summary if quiet else f" {summary} ".center(80, "="))
        return "\n".join(lines)

    def failure_report(self) -> list[str]:
        """The FAILURES section pytest prints for the bug's failing test."""
        task, bug = self.task, self.task.bug
        test_lines = self.files[task.test_path]
        name = re.search(r"def (test_\w+)", task.render(bug.failing_test)).group(1)
        start = next(i for i, line in enumerate(test_lines) if line.startswith(f"def {name}("))
        body = [test_lines[start]]
        for line in test_lines[start + 1:]:
            if not line.startswith(" "):
                break
            body.append(line)
        errors = [task.render(line) for line in bug.failure]
        head = errors[0].split(":")[0]
        exc = head if head.endswith("Error") and " " not in head else "AssertionError"
        out = [" FAILURES ".center(80, "="), f" {name} ".center(80, "_"), ""]
        out += ["    " + line for line in body[:-1]] + [">   " + body[-1]]
        if bug.raise_line is not None:
            target = self.files[task.target_path]
            raise_line = task.render(bug.raise_line)
            end = next(i for i, line in enumerate(target) if raise_line in line)
            begin = max(i for i in range(end + 1) if target[i].startswith("def "))
            out += ["", f"{task.test_path}:{start + len(body)}: ", "_ " * 36, ""]
            out += ["    " + line for line in target[begin:end]] + [">   " + target[end]]
            out += [f"E       {errors[0]}", "", f"{task.target_path}:{end + 1}: {exc}"]
        else:
            out += [f"E       {line}" for line in errors]
            out += ["", f"{task.test_path}:{start + len(body)}: {exc}"]
        out += [" short test summary info ".center(80, "="),
                f"FAILED {task.test_path}::{name} - {errors[0]}"]
        return out

    # -- sub-agent ---------------------------------------------------------------------

    def run_subagent(self, prompt: str) -> str:
        """A read-only sub-agent answering ``prompt``; returns its final report."""
        rng, task = self.rng, self.task
        agent = _Agent(f"explore-{rng.getrandbits(24):06x}", "sub", list(SUB_TOOLS), [
            {"role": "system", "content": rng.choice(_SUB_IDENTITIES)
             + f"\n\nRepository: /workspace/{task.project}"},
            {"role": "user", "content": prompt}])
        fn = task.fn
        self.step(agent, _pick(rng, (
            f"I need every use of `{fn}`. A grep over the whole repository is the quickest start.",
            f"The question is about callers of `{fn}`. Let me search for the name first, then "
            "read the callers.")), "", [("grep", {"pattern": rf"\b{fn}\b"})])
        self.step(agent, _pick(rng, (
            f"`{task.caller_path}` calls it inside `{task.caller_fn}`. Let me read that file to "
            "see how the result is used.",
            f"Besides the definition and the tests there is one production caller in "
            f"`{task.caller_path}`. Reading it.")), "", [("read_file", {"path": task.caller_path})])
        if rng.random() < 0.6:
            self.step(agent, "Let me check which tests exercise it, so the report can say what "
                      "is covered.", "", [("grep", {"pattern": rf"{fn}\(", "path": "tests"})])
        caller_line = next(n for n, line in enumerate(self.files[task.caller_path], 1)
                           if fn + "(" in line and "import" not in line)
        definition = next(n for n, line in enumerate(self.files[task.target_path], 1)
                          if line.startswith(f"def {fn}("))
        report = (f"## Uses of `{fn}`\n\n"
                  f"- Definition: `{task.target_path}:{definition}`.\n"
                  f"- Production caller: `{task.caller_path}:{caller_line}` in "
                  f"`{task.caller_fn}()`, which passes the records of the `{task.slots['MODULE']}` "
                  "job straight through and returns the result as a list.\n"
                  f"- Tests: `{task.test_path}` covers it directly; nothing else imports it.\n\n"
                  "No other callers, so a fix inside the function will not break other code.")
        message = self.assistant(_pick(rng, (
            "I have what I need: one definition, one caller, one test module. Writing the report.",
            "That covers all references. Time to summarize with paths and line numbers.")), report)
        self.model_call(agent, message)
        return report


def _pick(rng: random.Random, options: Sequence[str]) -> str:
    return options[rng.randrange(len(options))]


# --------------------------------------------------------------------------------------
# The main agent's script
# --------------------------------------------------------------------------------------


_FILLER_KINDS = {
    "early": ("read_other", "read_other", "list", "grep_defs", "read_test"),
    "middle": ("read_other", "list", "grep_defs", "diff", "lint", "single_test", "typecheck",
               "status"),
    "late": ("diff", "lint", "single_test", "typecheck", "status"),
}


def _filler_step(run: _Run, agent: _Agent, phase: str) -> None:
    """One investigation or housekeeping call that fits ``phase`` (early | middle | late).

    Kinds are dealt from a shuffled deck per phase, so consecutive calls rarely repeat.
    """
    rng, task = run.rng, run.task
    deck = run.decks.setdefault(phase, [])
    if not deck:
        deck.extend(_FILLER_KINDS[phase])
        rng.shuffle(deck)
    kind = deck.pop()
    unread = [p for p in run.files if p.endswith(".py") and p not in run.read_paths
              and not p.endswith("__init__.py")]
    if kind in ("read_other", "read_test") and unread:
        tests = [p for p in unread if p.startswith("tests/")]
        path = rng.choice(tests if kind == "read_test" and tests else unread)
        run.read_paths.add(path)
        run.step(agent, _pick(rng, (
            f"`{path}` might have related helpers; I want to see its conventions before editing.",
            f"Let me skim `{path}` to make sure nothing there depends on the current behaviour.",
            f"I haven't looked at `{path}` yet. A quick read shows how the package is organised.",
            f"Reading `{path}` as well; the test and helper style there tells me what a fix and "
            "a new test should look like.")), "", [("read_file", {"path": path})])
    elif kind in ("list", "read_other", "read_test"):
        path = rng.choice((f"src/{task.project}", "tests", "."))
        run.step(agent, _pick(rng, (f"Let me get an overview of `{path}`.",
                                    f"What else lives in `{path}`?")), "",
                 [("list_files", {"path": path})])
    elif kind == "grep_defs":
        run.step(agent, _pick(rng, (
            "Let me list the public functions in the package to see what else touches this area.",
            "A quick grep for function definitions gives me a map of the package.")), "",
            [("grep", {"pattern": r"^(def|class) \w+", "path": "src"})])
    elif kind == "diff":
        run.step(agent, _pick(rng, ("Let me review the diff so far.",
                                    "Quick look at the diff to make sure only intended lines "
                                    "changed.")), "", [("bash", {"command": "git diff"})])
    elif kind == "lint":
        run.step(agent, _pick(rng, ("Run the linter on the touched code.",
                                    "Style check before moving on: ruff.")), "",
                 [("bash", {"command": "ruff check src tests"})])
    elif kind == "single_test":
        run.step(agent, _pick(rng, ("Let me rerun just the module's tests to be sure.",
                                    f"Rerun `{task.test_path}` on its own.")), "",
                 [("bash", {"command": f"python -m pytest {task.test_path} -q"})])
    elif kind == "typecheck":
        run.step(agent, "The project uses type hints; let me make sure mypy is still happy.", "",
                 [("bash", {"command": "mypy src"})])
    else:
        run.step(agent, "Let me check which files are modified.", "",
                 [("bash", {"command": "git status"})])


def _spread(extra: int, rng: random.Random) -> tuple[int, int, int]:
    """Split the filler budget into (before the fix, after the follow-up, after compaction)."""
    early = round(extra * rng.uniform(0.3, 0.45))
    late = round(extra * rng.uniform(0.2, 0.3))
    return early, extra - early - late, late


def generate_execution(execution_id: str, task_id: str, *, seed: int,
                       turns: int = 30) -> list[dict[str, Any]]:
    """All events of one execution: opened, requests, tool payloads, closed, assessment.

    ``turns`` is the number of main-agent model calls (both samples and the compaction call
    included; the sub-agent's calls come on top). It must be at least ``MIN_TURNS``.
    """
    if turns < MIN_TURNS:
        raise ValueError(f"turns must be >= {MIN_TURNS}")
    task = _make_task(task_id)
    run = _Run(execution_id, task, seed)
    rng, bug, fn = run.rng, task.bug, task.fn
    system = _system_prompt(rng, task, run.start, run.python)
    main = _Agent("main", "main", list(MAIN_TOOLS),
                  [{"role": "system", "content": system},
                   {"role": "user", "content": task.description}])
    run.emit({"type": "execution_opened", "execution_id": execution_id, "task_id": task_id,
              "deadline": _rfc3339(run.start + timedelta(hours=4)), "policy": POLICY,
              "tokenizer": chatml.TOKENIZER_NAME, "origin": "synthetic",
              "collection_run_id": f"run-{task.source}-{seed % 97:02d}",
              "metadata": {"repo": task.project, "harness": "ledger.workload", "seed": seed}},
             0)
    early, middle, late = _spread(turns - MIN_TURNS, rng)

    # 1. explore
    run.step(main, _pick(rng, (
        f"The user reports a problem in `{fn}`. Before touching anything I want to find the "
        "definition and every place that uses it.",
        f"Let me start by locating `{fn}` and its callers; the report mentions "
        f"`{task.target_path}` but I should confirm there are no other definitions.",
        f"First step: grep for `{fn}` so I know where it is defined, used and tested.")),
        _pick(rng, ("I'll start by locating the function.", "", "Let me look at the code first.")),
        [("grep", {"pattern": fn})])
    # 2. read implementation and tests (parallel calls)
    run.step(main, _pick(rng, (
        f"It is defined in `{task.target_path}` and tested in `{task.test_path}`. Reading both "
        "together so I can compare the implementation with what the tests expect.",
        "Two files matter: the implementation and its tests. Let me read them side by side.")),
        "", [("read_file", {"path": task.target_path}), ("read_file", {"path": task.test_path})])
    for _ in range(early):
        _filler_step(run, main, "early")
    # 3. delegate a search to a sub-agent
    run.step(main, _pick(rng, (
        f"Before changing `{fn}` I want to know every caller and how it uses the result, so the "
        "fix does not break anything. A sub-agent can do that search without filling my context.",
        f"I should check the blast radius of changing `{fn}`. Delegating the caller analysis.")),
        "Let me check who depends on this function before changing it.",
        [("delegate", {"description": f"Find callers of {fn}",
                       "prompt": f"In /workspace/{task.project}, find every caller of `{fn}` "
                                 f"(defined in `{task.target_path}`). For each, give the file, "
                                 "line number and how the return value is used. Also list the "
                                 "tests that exercise it. Do not edit anything."})])
    # 4. reproduce
    run.step(main, _pick(rng, (
        "Only one production caller and it passes data straight through. Let me reproduce the "
        "failure with the tests before editing.",
        "The sub-agent confirms a fix inside the function is safe. Now reproduce the bug.")),
        "", [("bash", {"command": f"python -m pytest {task.test_path}"})])
    # 5. fix
    run.step(main, f"The failure confirms it: {bug.cause}. "
             + _pick(rng, ("The minimal fix is a one-line change.",
                           "I'll make the smallest change that fixes it.",
                           "Fixing it in place keeps the signature unchanged.")),
             _pick(rng, ("Found the cause. Fixing it now.", "", "The fix is straightforward.")),
             [("edit_file", {"path": task.target_path, "old_string": task.render(bug.old),
                             "new_string": task.render(bug.new)})])
    run.fixed = True
    # 6. verify
    run.step(main, "Let me run the whole suite to verify the fix and catch regressions.", "",
             [("bash", {"command": "python -m pytest -q"})])
    # 7. hand back to the user
    run.model_call(main, run.assistant(
        "All tests pass. Time to report back to the user.",
        f"Fixed `{fn}` in `{task.target_path}`: {bug.cause}, so I changed "
        f"`{task.render(bug.old)}` to `{task.render(bug.new)}`. The full suite passes "
        f"({run.n_tests()} tests)."))
    # the user follows up: a new query, so earlier <think> blocks are dropped on re-render
    main.messages.append({"role": "user", "content": _pick(rng, (
        f"Thanks! Please also add a regression test for {bug.case}.",
        f"Looks good. Can you add a test that covers {bug.case}? Keep the signature of `{fn}` "
        "unchanged.",
        f"Before we merge: add a regression test for {bug.case} and make sure ruff is clean."))})
    run.clock += timedelta(seconds=rng.uniform(20, 400))
    regression = task.render(bug.regression_test)
    test_lines = run.files[task.test_path]
    last_test = max(i for i, line in enumerate(test_lines) if line.startswith("def test_"))
    anchor = "\n".join(test_lines[last_test:])
    pair_slot = rng.randint(0, middle)  # which post-follow-up call is sampled twice
    # 8. add the regression test
    run.step(main, f"I'll append a test for {bug.case} at the end of `{task.test_path}`, "
             "next to the existing ones.", "",
             [("edit_file", {"path": task.test_path, "old_string": anchor,
                             "new_string": anchor + "\n\n\n" + regression})])
    # 9. run tests, possibly as the two-sample branch point
    for index in range(middle + 1):
        if index == pair_slot:
            _sampled_pair(run, main)
        else:
            _filler_step(run, main, "middle")
    # 10. compaction: the summary replaces the history
    summary_prompt = {"role": "user", "content": rng.choice(_COMPACTION_PROMPTS)}
    summary = (f"<summary>\n1. Task: {task.description}\n"
               f"2. Root cause: {bug.cause}.\n"
               f"3. Fix: in `{task.target_path}` replaced `{task.render(bug.old)}` with "
               f"`{task.render(bug.new)}`.\n"
               f"4. A sub-agent confirmed the only production caller is `{task.caller_fn}` in "
               f"`{task.caller_path}`.\n"
               f"5. The user asked for a regression test for {bug.case}; added to "
               f"`{task.test_path}`. Full suite: {run.n_tests()} passed.\n"
               "6. Next: review the final diff and report back.\n</summary>")
    main.messages.append(summary_prompt)
    run.model_call(main, run.assistant(
        "I need to capture the task, the root cause, the exact edit, test status and what is "
        "left, so I can continue without the old messages.", summary), turn_kind="summary")
    main.messages = [main.messages[0], {"role": "user", "content": (
        "This task continues from an earlier conversation that was compacted. Summary of the "
        f"work so far:\n\n{summary}\n\nContinue from where you left off.")}]
    main.last_request = None
    for _ in range(late):
        _filler_step(run, main, "late")
    # 11. final verification and 12. final answer (or a timeout mid-command)
    run.step(main, "Picking up after the summary: the fix and the regression test are in. "
             "Let me look at the final diff once more.", "", [("bash", {"command": "git diff"})])
    timed_out = rng.random() < 0.12
    if timed_out:
        run.model_call(main, run.assistant(
            "One last full run with verbose output before I report.", "",
            [("bash", {"command": "python -m pytest -vv"})]))
    else:
        run.model_call(main, run.assistant(
            "The diff contains exactly the fix and the new test. Reporting back.",
            f"Done.\n\n- `{task.target_path}`: `{task.render(bug.old)}` → "
            f"`{task.render(bug.new)}` ({bug.cause}).\n- `{task.test_path}`: new regression "
            f"test for {bug.case}.\n- Full suite: {run.n_tests()} passed; only caller "
            f"`{task.caller_fn}` is unaffected."))
    run.emit({"type": "execution_closed", "execution_id": execution_id,
              "status": "timeout" if timed_out else "completed",
              "artifact_versions": list(run.artifacts)}, 1.0)
    reward = 1.0 if rng.random() < 0.75 else 0.0
    run.emit({"type": "assessment", "assessment_id": f"{execution_id}/tests@1",
              "execution_id": execution_id, "artifact_version": run.artifacts[-1],
              "outcome": "scored", "reward": reward, "evaluator": EVALUATOR,
              "criteria": [
                  {"name": "hidden_tests", "verdict": "pass" if reward else "fail",
                   "evidence": f"pytest tests/hidden/test_{task.slots['MODULE']}_hidden.py"},
                  {"name": "regression_test_added", "verdict": "pass",
                   "evidence": task.test_path},
                  {"name": "style", "verdict": "unknown", "evidence": "ruff not run by evaluator"},
              ]}, rng.uniform(30, 300))
    return run.events


def _sampled_pair(run: _Run, agent: _Agent) -> None:
    """Two independent samples from one prefix; the run continues from the second."""
    rng, task = run.rng, run.task
    identical = rng.random() < 0.4
    reasoning = "The regression test is in. Let me run the whole suite again."
    message = run.assistant(reasoning, "", [("bash", {"command": "python -m pytest -q"})])
    if identical:
        alternative = dict(message, tool_calls=[dict(message["tool_calls"][0],
                                                     id=run.call_id())])
    else:
        alternative = run.assistant(_pick(rng, (
            "New test added; I'll run only the module's tests, that is faster.",
            f"Let me check the new test for {task.bug.case} passes before anything else.")),
            "", [("bash", {"command": f"python -m pytest {task.test_path} -q"})])
    run.model_call(agent, message, alternative=alternative, identical=identical)
    run.results(agent, message)


def generate(n_executions: int, *, seed: int, turns: int = 30) -> Iterator[dict[str, Any]]:
    """Events of ``n_executions`` executions (two per task), each task registered first."""
    for index in range(n_executions):
        task_id = f"task-{seed}-{index // 2:04d}"
        if index % 2 == 0:
            yield task_registered(task_id)
        yield from generate_execution(f"exec-{seed}-{index:04d}", task_id,
                                      seed=seed * 1_000_003 + index, turns=turns)


# --------------------------------------------------------------------------------------
# Prefix references and continuity analysis
# --------------------------------------------------------------------------------------


def _array(tokens: Sequence[int]) -> np.ndarray:
    return np.fromiter(tokens, dtype=np.uint32, count=len(tokens))


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _continued(prev_in: np.ndarray, prev_out: np.ndarray, new: np.ndarray) -> int:
    """Length of the common prefix of ``prev_in + prev_out`` and ``new``."""
    common = _common_prefix(prev_in, new)
    if common < len(prev_in):
        return common
    return common + _common_prefix(prev_out, new[common:])


def tokens_sha256(tokens: Sequence[int]) -> str:
    """SHA-256 (hex) of tokens packed as little-endian uint32 (the prefix-reference hash)."""
    return hashlib.sha256(_array(tokens).astype("<u4", copy=False).tobytes()).hexdigest()


def with_prefix_references(events: Iterable[dict[str, Any]], *, window: int = 8,
                           min_length: int = 64) -> Iterator[dict[str, Any]]:
    """Rewrite requests to reference the longest matching prefix of a recent request.

    For each request, the ``window`` preceding requests of its execution are candidates;
    the one whose ``input_ids + output_ids`` shares the longest prefix with the new input
    (at least ``min_length`` tokens) becomes ``input_prefix`` and only the rest is written
    as ``input_suffix_ids`` (SPEC §4.2). Other events pass through unchanged.
    """
    recent: dict[str, list[tuple[dict[str, Any], np.ndarray, np.ndarray]]] = {}
    for event in events:
        if event.get("type") != "request" or "input_ids" not in event:
            yield event
            continue
        input_ids = event["input_ids"]
        new = _array(input_ids)
        history = recent.setdefault(event["execution_id"], [])
        best, best_len = None, 0
        for candidate, cand_in, cand_out in history:
            length = _continued(cand_in, cand_out, new)
            if length > best_len:
                best, best_len = candidate, length
        history.append((event, new, _array(event["output_ids"])))
        del history[:-window]
        if best is None or best_len < min_length:
            yield event
            continue
        referenced = (best["input_ids"] + best["output_ids"])[:best_len]
        out = {k: v for k, v in event.items() if k != "input_ids"}
        out["input_prefix"] = {"request_id": best["request_id"], "length": best_len,
                               "sha256": tokens_sha256(referenced)}
        out["input_suffix_ids"] = input_ids[best_len:]
        yield out


def prefix_continuity(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """How each request's input continues the previous request of the same agent.

    One row per consecutive pair (per execution and agent; requests must carry full
    ``input_ids``): ``common`` tokens shared by ``prev.input + prev.output`` and
    ``next.input``, ``offset`` = common − len(prev.input) (negative: diverged inside the
    previous input, e.g. a dropped think block or a compaction; 0..len(output)−1: inside the
    previous output); ``where`` says which (``"input"``, ``"output"``), or ``"extends"``
    when the whole previous call is a prefix of the next input.
    """
    last: dict[tuple[str, str], tuple[dict[str, Any], np.ndarray, np.ndarray]] = {}
    rows = []
    for event in events:
        if event.get("type") != "request":
            continue
        key = (event["execution_id"], event.get("agent_id", "main"))
        new = _array(event["input_ids"])
        previous = last.get(key)
        last[key] = (event, new, _array(event["output_ids"]))
        if previous is None:
            continue
        prev, prev_in, prev_out = previous
        common = _continued(prev_in, prev_out, new)
        offset = common - len(prev_in)
        total = len(prev_in) + len(prev_out)
        where = "extends" if common == total else "output" if offset >= 0 else "input"
        rows.append({"execution_id": key[0], "agent_id": key[1],
                     "prev": prev["request_id"], "next": event["request_id"],
                     "common": common, "prev_input": len(prev_in), "prev_total": total,
                     "offset": offset, "where": where,
                     "turn_kind": event.get("turn_kind", "task")})
    return rows


def write_example(path: str | Path, n: int = 6, seed: int = 7, *, turns: int = 22,
                  prefix_references: bool = True) -> dict[str, int]:
    """Write a small deterministic example JSON-lines file; returns line and byte counts.

    With ``prefix_references`` (the default, as the SDK recorder writes them) requests
    reference the previous context instead of repeating it, keeping the file small.
    """
    events: Iterable[dict[str, Any]] = generate(n, seed=seed, turns=turns)
    if prefix_references:
        events = with_prefix_references(events)
    lines = 0
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as handle:
        for event in events:
            handle.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n")
            lines += 1
    return {"lines": lines, "bytes": target.stat().st_size}
