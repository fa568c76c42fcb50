"""Planning a leakage screen within a review budget (seed 002 §15.4.3, exercise 8; SPEC §11.2):
`ledger similarity curve --records N --budget PAIRS` and ledger.algorithms.lsh_plan."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.lsh_plan import band_designs, plan_screen, standard_error
from ledger.cli import main

N = 100_000
PAIRS = N * (N - 1) // 2  # 4,999,950,000


def exercise_8(**kw):
    return plan_screen(N, 20_000, relatives=2000, similarity_of_relatives=0.8, similarity_of_unrelated=0.1, **kw)


def test_exercise_8_figures_from_the_pure_function():
    plan = exercise_8()
    d = {(x.bands, x.rows): x for x in plan.designs}
    assert list(d) == [(128, 1), (64, 2), (32, 4), (16, 8), (8, 16), (4, 32), (2, 64), (1, 128)]
    assert plan.pairs == PAIRS and plan.unrelated_pairs == PAIRS - 2000
    # 32 x 4: ~1.6e7 false candidates, over the 20,000 budget; recall ~1
    assert f"{d[32, 4].false_candidates:.2g}" == "1.6e+07" and d[32, 4].fits_budget is False
    assert d[32, 4].recall > 0.9999999
    # 16 x 8: ~800 false candidates, recall 0.947, fits
    assert round(d[16, 8].false_candidates) == 800 and round(d[16, 8].recall, 3) == 0.947
    assert d[16, 8].fits_budget is True and round(d[16, 8].expected_candidates) == 2694
    # 8 x 16: 4.0e-6 (exactly (pairs - 2000) * (1 - (1 - 0.1^16)^8) = 3.9999584e-6), recall 0.204
    exact = (PAIRS - 2000) * (1 - (1 - Fraction(1, 10) ** 16) ** 8)
    assert d[8, 16].false_candidates == pytest.approx(float(exact), rel=1e-9)
    assert f"{d[8, 16].false_candidates:.2g}" == "4e-06" and round(d[8, 16].recall, 3) == 0.204
    # (the naive float form loses it: 1 - 1e-16 rounds to 1 - 1.11e-16, giving 4.4e-6)
    assert f"{(PAIRS - 2000) * (1 - (1 - 0.1 ** 16) ** 8):.2g}" == "4.4e-06"
    # the signature: 512 B, 51.2 MB per corpus, standard error at most 0.0442
    assert (plan.bytes_per_signature, plan.bytes_per_corpus) == (512, 51_200_000)
    assert round(plan.standard_error_max, 4) == 0.0442 and round(d[32, 4].threshold, 3) == 0.420


def test_exercise_8_through_the_cli(capsys):
    base = ["similarity", "curve", "--records", str(N), "--budget", "20000", "--relatives", "2000",
            "--similarity-of-unrelated", "0.1"]
    assert main(base) == 0
    text = capsys.readouterr().out
    assert "100000 records, 4999950000 pairs (2000 true relatives at s=0.8, 4999948000 unrelated at s=0.1); " \
           "review budget 20000 pairs" in text
    assert "512 B per signature, 51.20 MB per corpus; standard error sqrt(s(1-s)/128) at most 0.0442" in text
    rows = {tuple(line.split()[:3]): line.split() for line in text.splitlines() if " x " in line and "rows" not in line}
    assert rows["32", "x", "4"][4:] == ["1.6e+07", "1.0000", "2000.0", "1.6e+07", "no"]
    assert rows["16", "x", "8"][4:] == ["800", "0.9470", "1894.1", "2.69e+03", "yes"]
    assert rows["8", "x", "16"][4:] == ["4e-06", "0.2042", "408.4", "408", "yes"]
    assert main(base + ["--bands", "16", "--rows", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(x["bands"], x["rows"], round(x["false_candidates"]), x["fits_budget"]) for x in doc["designs"]] == [
        (16, 8, 800, True)]
    assert doc["bytes_per_signature"] == 512 and doc["num_perm"] == 128


def test_the_curve_keeps_its_output_and_gains_json(capsys):
    assert main(["similarity", "curve", "--bands", "16", "--rows", "8"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("similarity screening: MinHash num_perm=128") and "1 - (1 - s^8)^16" in text
    assert main(["similarity", "curve", "--json", "--points", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["bands"], doc["rows"], doc["num_perm"]) == (32, 4, 128)
    assert [round(p["candidate_probability"], 3) for p in doc["curve"]] == [0.0, 0.873, 1.0]  # 87.3 % at s = 0.5


@pytest.mark.parametrize("args, message", [
    (["--budget", "5"], "--budget needs --records N"),
    (["--records", "10", "--budget", "-1"], "budget must be >= 0"),
    (["--records", "10", "--similarity-of-unrelated", "1.5"], "similarity must lie in [0, 1]"),
    (["--records", "10", "--relatives", "46"], "relatives must be between 0 and the 45 pairs"),
    (["--records", "10", "--bands", "64", "--rows", "4", "--num-perm", "128"], "bands*rows <= num_perm"),
    (["--records", "10", "--bytes-per-value", "0"], "bytes per value must be >= 1"),
])
def test_bad_planning_inputs_exit_2(args, message, capsys):
    assert main(["similarity", "curve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 512), records=st.integers(2, 10**6), s0=st.floats(0, 1), s1=st.floats(0, 1))
def test_more_rows_per_band_never_add_false_candidates(n, records, s0, s1):
    """With the signature length fixed, moving components from bands into rows (fewer bands, more
    rows) never adds false candidates and never adds recall (seed §15.4.3)."""
    plan = plan_screen(records, None, similarity_of_unrelated=s0, similarity_of_relatives=s1, num_perm=n)
    assert [d.bands * d.rows for d in plan.designs] == [n] * len(band_designs(n))
    for a, b in zip(plan.designs, plan.designs[1:]):  # most bands first
        assert b.false_candidates <= a.false_candidates * (1 + 1e-9) + 1e-300
        assert b.recall <= a.recall + 1e-12
    assert plan.standard_error_max == pytest.approx(0.5 / math.sqrt(n))
    assert standard_error(s0, n) <= plan.standard_error_max + 1e-15
