"""`ledger plan` (seed 002 equation 4, napkin math 15.6): the binding stage and the planned
admitted rate of a collector, with the active-resource charge per admitted record."""

from __future__ import annotations

import json

import pytest

from ledger.algorithms.cascade_plan import plan_cascade
from ledger.cli import main
from ledger.reports.plan import collector_plan, parse_size

from .test_cohort import cohort_store  # noqa: F401  (module fixture: a store with a measured route)
from .test_economics import ROUTE_15_2

NAPKIN_15_6 = ["plan", "--accelerators", "64", "--gen-seconds", "60", "--verifier-slots", "4",
               "--check-seconds", "6.24", "--yield", "0.2052", "--record-ceiling", "8MB", "--write-bandwidth", "200MB/s",
               "--accelerator-price", "2.50", "--slot-price", "0.04"]


def test_napkin_15_6_text(capsys):
    assert main(NAPKIN_15_6) == 0
    out = capsys.readouterr().out
    assert "generation  64 accelerators / 60 s     = 1.067" in out
    assert "assessment  4 verifier slots / 6.24 s  = 0.641  <- binds" in out
    assert "storage     200 MB/s / 8 MB            = 25" in out
    assert "binding stage: assessment" in out
    assert "admitted rate at yield 20.52%: 0.1315/s" in out
    assert "unused generation capacity: 39.9%" in out
    assert "verifier slots to match generation: 7" in out
    assert "per admitted record $0.20 (checking 0.2%)" in out
    assert "generation $0.0417" in out  # $0.042 per attempt


def test_napkin_15_6_json_and_what_if(capsys):
    assert main(NAPKIN_15_6 + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["binding"] == "assessment"
    assert round(p["stage_rates"]["generation"], 2) == 1.07 and round(p["stage_rates"]["assessment"], 2) == 0.64
    assert p["stage_rates"]["storage"] == pytest.approx(25.0)
    assert p["admitted_rate"] == pytest.approx(4 / 6.24 * 0.2052)
    assert round(p["cost"]["generation_per_attempt"], 3) == 0.042 and round(p["cost"]["per_admitted"], 2) == 0.20
    # seven slots: generation binds; halving the yield doubles the charge ($0.41)
    seven = [a if a != "4" else "7" for a in NAPKIN_15_6]
    assert main(seven + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["binding"] == "generation"
    half = [a if a != "0.2052" else "0.1026" for a in NAPKIN_15_6]
    assert main(half + ["--json"]) == 0
    assert round(json.loads(capsys.readouterr().out)["cost"]["per_admitted"], 2) == 0.41


def test_check_seconds_from_the_cascade_of_napkin_15_2():
    cheaper = plan_cascade(ROUTE_15_2).chosen
    p = collector_plan(accelerators=64, gen_seconds=60, verifier_slots=4, check_seconds=cheaper.seconds_per_attempted,
                       route_yield=cheaper.route_yield, record_ceiling="8MB", write_bandwidth="200 MB/s")
    assert p["binding"] == "assessment" and round(100 * p["unused_generation_fraction"], 1) == 39.9
    assert "cost" not in p


def test_storage_binds_exercise_6(capsys):
    assert main(["plan", "--accelerators", "32", "--gen-seconds", "40", "--verifier-slots", "16", "--check-seconds",
                 "6.6", "--yield", "0.37044", "--record-ceiling", "1GB", "--write-bandwidth", "500MB", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["binding"] == "storage" and round(p["admitted_per_hour"], 1) == 666.8


def test_sizes_and_bad_input(capsys):
    assert parse_size("8MB") == 8e6 and parse_size("2MiB") == 2 * 1024 * 1024 and parse_size("200 MB/s") == 2e8
    assert parse_size("1.5GB") == 1.5e9 and parse_size("123") == 123 and parse_size(5) == 5
    with pytest.raises(ValueError):
        parse_size("8 parsecs")
    base = ["plan", "--accelerators", "1", "--gen-seconds", "1", "--verifier-slots", "1", "--record-ceiling", "1MB",
            "--write-bandwidth", "1MB"]
    assert main(base) == 2  # neither --check-seconds/--yield nor --route
    assert main(base + ["--check-seconds", "1", "--yield", "1.5"]) == 2
    assert main(base + ["--check-seconds", "1", "--yield", "0.5", "--write-bandwidth", "lots"]) == 2
    capsys.readouterr()


def test_route_takes_measured_check_seconds_and_yield(cohort_store, capsys):  # noqa: F811
    from ledger.projections.admission import cascade_plan
    from ledger.projections.engine import connect

    capsys.readouterr()
    assert main(["--store", cohort_store.url, "plan", "--route", "repair_demos", "--accelerators", "64", "--gen-seconds",
                 "60", "--verifier-slots", "4", "--record-ceiling", "8MB", "--write-bandwidth", "200MB", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    chosen = cascade_plan(connect(cohort_store.db), "repair_demos").chosen
    assert p["inputs"]["check_seconds"] == pytest.approx(chosen.seconds_per_attempted)
    assert p["inputs"]["route_yield"] == pytest.approx(chosen.route_yield)
    assert main(["--store", cohort_store.url, "plan", "--route", "nope", "--accelerators", "1", "--gen-seconds", "1",
                 "--verifier-slots", "1", "--record-ceiling", "1MB", "--write-bandwidth", "1MB"]) == 2
