"""Numbers are what they claim (SPEC §9; issue 13 item 6).

NaN / Infinity / -Infinity are refused anywhere in a JSON value (Python's json accepts them by
default) by the JSON reader, and a literal that overflows float64 to infinity (``1e400``) or a
float NaN/inf handed in by a Python caller is refused by validation; log-probabilities must be
finite *as float32* and <= 0 (``-1e300`` is float32 ``-inf``); rewards finite; token IDs
< 2^32 (the message names the value and the limit); integer fields fit an Avro long.  Each is
exit 2 from ``ledger ingest`` with one line naming the line and field, and nothing appended.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ledger.cli import main as cli
from ledger.events.validate import ValidationError, validate_line
from ledger.log import open_log

from ..helpers import opened, request

OPEN = json.dumps(opened("e1"))
BIG = "1" + "0" * 400  # an integer literal beyond the float64 range
REFUSED = "ledger: refused (nothing appended): "
LOGPROB_RULE = "(log-probabilities must be finite float32 values <= 0)"
NOT_A_NUMBER = "is not a JSON number (NaN and Infinity are refused in JSON values)"
RULE = "(NaN, Infinity and literals beyond the float64 range, such as 1e400, are refused)"


def _req(**kw) -> str:
    return json.dumps(request("e1", "r1", [1, 2], [3, 4], **kw))


def _assessment(reward: str) -> str:
    return ('{"type": "assessment", "assessment_id": "a1", "execution_id": "e1", "artifact_version": "v1", '
            '"outcome": "scored", "evaluator": "g@1", "reward": ' + reward + "}")


# (class, second line of the file, the error after "line 2: ")
CASES = [
    ("nan-in-metadata", OPEN[:-1] + ', "metadata": {"a": [1, NaN]}}',
     f"field 'metadata.a[1]': NaN {NOT_A_NUMBER}"),
    ("infinity-in-metadata", OPEN[:-1] + ', "metadata": {"x": Infinity}}',
     f"field 'metadata.x': Infinity {NOT_A_NUMBER}"),
    ("minus-infinity-in-unknown-field", OPEN[:-1] + ', "extra": -Infinity}',
     f"field 'extra': -Infinity {NOT_A_NUMBER}"),
    ("nan-logprob", _req().replace("[-0.5, -0.5]", "[-0.5, NaN]"),
     f"field 'output_logprobs[1]': NaN {NOT_A_NUMBER}"),
    ("overflow-literal-in-metadata", OPEN[:-1] + ', "metadata": {"x": [1, 1e400]}}',
     f"field 'metadata': inf at x[1] is not a finite number {RULE}"),
    ("overflow-literal-reward", _assessment("-2e308"), f"field 'reward': expected a finite number, got -inf {RULE}"),
    ("overflow-literal-logprob", _req(output_logprobs=[-0.5, -0.5]).replace("[-0.5, -0.5]", "[-0.5, -1e999]"),
     f"field 'output_logprobs': log-probability -inf at index 1 is not finite as float32 {LOGPROB_RULE}"),
    ("logprob-float32-infinite", _req(output_logprobs=[-0.5, -1e300]),
     f"field 'output_logprobs': log-probability -1e+300 at index 1 is not finite as float32 {LOGPROB_RULE}"),
    ("logprob-just-past-float32", _req(output_logprobs=[-3.5e38, -0.1]),
     f"field 'output_logprobs': log-probability -3.5e+38 at index 0 is not finite as float32 {LOGPROB_RULE}"),
    ("logprob-positive", _req(output_logprobs=[1e-30, -0.1]),
     f"field 'output_logprobs': log-probability 1e-30 at index 0 is positive {LOGPROB_RULE}"),
    ("logprob-huge-integer", _req().replace("[-0.5, -0.5]", f"[-0.5, -{BIG}]"),
     f"field 'output_logprobs': log-probability -1000000000000000000... (401 digits) at index 1 is not finite as "
     f"float32 {LOGPROB_RULE}"),
    ("reward-huge-integer", _assessment(BIG),
     "field 'reward': expected a finite number, got 10000000000000000000... (401 digits), beyond the float64 range"),
    ("token-id-2^32", json.dumps(request("e1", "r1", [1, 2**32], [3], output_logprobs=[-0.1])),
     "field 'input_ids': token ID 4294967296 at index 1 is out of range (not below 2^32): token IDs are uint32, "
     "0..4294967295"),
    ("token-id-beyond-int64", json.dumps(request("e1", "r1", [1], [3, 10**25], output_logprobs=[-0.1, -0.1])),
     "field 'output_ids': token ID 10000000000000000000000000 at index 1 is out of range (not below 2^32): "
     "token IDs are uint32, 0..4294967295"),
    ("token-id-negative-beyond-int64", json.dumps(request("e1", "r1", [-(10**25)], [3], output_logprobs=[-0.1])),
     "field 'input_ids': token ID -10000000000000000000000000 at index 0 is out of range (negative): "
     "token IDs are uint32, 0..4294967295"),
    ("integer-beyond-long", '{"type": "credit_pool_declared", "pool": "p", "capacity_bytes": ' + "9" * 20
     + ', "record_ceiling_bytes": 1, "hard_limit": 1}',
     "field 'capacity_bytes': 99999999999999999999 is too large: must be <= 9223372036854775807 (2^63-1)"),
]
CLASSES = sorted({c[0] for c in CASES})


def test_the_classes_counted():
    assert len(CLASSES) == len(CASES) == 16




def _state(store: Path) -> tuple[int, bytes]:
    with open_log(str(store)) as log:
        return log.size(), (store / "events.dat").read_bytes()


@pytest.mark.parametrize("name,line,message", CASES, ids=[c[0] for c in CASES])
def test_bad_number_is_refused_exit_2_nothing_appended(store, tmp_path, capsys, name, line, message):
    # the store already holds an event, so "unchanged" is about a non-empty log
    (tmp_path / "seed.jsonl").write_text(json.dumps(opened("e0")) + "\n")
    assert cli(["ingest", str(tmp_path / "seed.jsonl")]) == 0
    before = _state(store)
    (tmp_path / "bad.jsonl").write_text(OPEN + "\n" + line + "\n")
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "bad.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.strip() == REFUSED + "line 2: " + message
    assert _state(store) == before


def test_the_same_file_without_the_bad_number_is_accepted(store, tmp_path, capsys):
    """The fixtures are otherwise valid: the refusals above are about the numbers only."""
    lines = [OPEN, _req(output_logprobs=[-0.0, -3.4e38]), _assessment("1e300"),
             json.dumps(request("e1", "r2", [0, 2**32 - 1], [3], output_logprobs=[-87.5]))]
    (tmp_path / "ok.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "ok.jsonl")]) == 0
    assert capsys.readouterr().out.startswith("appended 4, duplicate 0, conflicting 0")


@pytest.mark.parametrize("field,value,message", [
    ("metadata", {"x": [1.0, math.nan]}, f"field 'metadata': nan at x[1] is not a finite number {RULE}"),
    ("metadata", {"y": -math.inf}, f"field 'metadata': -inf at y is not a finite number {RULE}"),
    ("output_logprobs", [-0.1, math.nan], "field 'output_logprobs': log-probability nan at index 1 is not finite"),
], ids=["nan", "minus-inf", "logprob-nan"])
def test_python_callers_cannot_slip_non_finite_floats_in(field, value, message):
    """The SDK path hands dicts, not JSON text: validation refuses the floats itself."""
    line = opened("e1") if field == "metadata" else request("e1", "r1", [1], [2, 3])
    line[field] = value
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=4, now_micros=0)
    assert str(exc.value).startswith("line 4: " + message)
