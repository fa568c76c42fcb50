"""`python -m benchmarks`: every benchmark, each figure beside its same-run baseline (SPEC §8)."""

from __future__ import annotations

import importlib
import os
import sys

from .common import CLOCK_ENV, print_table

MODULES = ["bench_log", "bench_merkle", "bench_tree", "bench_admission", "bench_minhash", "bench_kafka", "bench_memory",
           "bench_scaling",
           "bench_scaleout",
           "bench_sealing",
           "bench_gateway",
           "bench_gateway_load",
           "bench_floors",
           "bench_replay",
           "bench_canaries",
           "bench_json_keys",
           "bench_publish_check",
           "bench_feed",
           "bench_erase",
           "bench_readers",
           "bench_formats",
           "bench_serve",
           "bench_verify_deep",
           "bench_follow",
           "bench_train_memory"]


def main(argv: list[str]) -> None:
    """``[--cpu] [module ...]``: ``--cpu`` is ``LEDGER_BENCH_CLOCK=cpu`` (CPU-time ratios)."""
    if "--cpu" in argv:
        os.environ[CLOCK_ENV] = "cpu"
    wanted = [a for a in argv if a != "--cpu"] or MODULES
    rows = []
    for name in wanted:
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError:
            print(f"(skipping {name}: not present)", file=sys.stderr)
            continue
        print(f"running {name} ...", file=sys.stderr)
        rows.extend(mod.run())
    print_table(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
