"""Benchmark: the canary scan of a training manifest (SPEC 11.2), one pass vs one scan per canary.

Same run, same data: 1,000 canaries of 8-40 tokens (Qwen-sized vocabulary) over 10 M tokens
with 20 canaries planted.  The ledger's one-pass matcher
(:class:`ledger.algorithms.canaries.CanaryMatcher`: window hashes grown to 8 tokens, one bit-table
probe, exact verification) against the naive numpy scan, one sliding comparison per canary
(:func:`ledger.algorithms.canaries.naive_find`).  A check row says both found the same
occurrences.  The record path (:class:`ledger.corpus.canary_scan.RecordScanner` over 10,000
trainer-record-shaped dicts holding Python token lists, as ``manifest publish`` sees them) is
timed too, against the matcher alone on the same tokens: the price of gathering records.

``python -m benchmarks bench_canaries`` or ``python benchmarks/bench_canaries.py``.
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import print_table, row, timed
from ledger.algorithms.canaries import CanaryMatcher, naive_find
from ledger.corpus.canary_scan import RecordScanner

VOCAB = 248_000


def workload(tokens: int = 10_000_000, canaries: int = 1000, planted: int = 20, seed: int = 7, shortest: int = 8):
    rng = np.random.default_rng(seed)
    hay = rng.integers(0, VOCAB, tokens, dtype=np.uint32)
    patterns = [rng.integers(0, VOCAB, int(rng.integers(shortest, 41)), dtype=np.uint32) for _ in range(canaries)]
    for i, at in enumerate(rng.choice(tokens - 64, planted, replace=False)):
        p = patterns[i * (canaries // planted)]
        hay[at:at + p.size] = p
    return hay, patterns


def run(tokens: int = 10_000_000, canaries: int = 1000) -> list[dict]:
    hay, patterns = workload(tokens, canaries)
    matcher = CanaryMatcher(patterns)
    rows = _scan_rows(f"{canaries} canaries of 8-40 tokens", hay, patterns, matcher)
    short_hay, short = workload(tokens, canaries, shortest=1)  # 1-token canaries: every window length, many hits
    rows += _scan_rows(f"{canaries} canaries of 1-40 tokens", short_hay, short, CanaryMatcher(short))
    return rows + _record_rows(hay, patterns, matcher)


def _scan_rows(what: str, hay: np.ndarray, patterns: list[np.ndarray], matcher: CanaryMatcher) -> list[dict]:
    ours = matcher.find(hay)
    naive = naive_find(patterns, hay)
    t_ours = timed(lambda: matcher.find(hay))
    t_naive = timed(lambda: naive_find(patterns, hay), repeat=1)
    same = ours[0].tolist() == naive[0].tolist() and ours[1].tolist() == naive[1].tolist()
    return [row(f"canary scan, {what} over {hay.size / 1e6:g} M tokens: one pass vs one numpy scan per canary",
                hay.size / t_ours / 1e6, hay.size / t_naive / 1e6, "M tok/s"),
            row("  occurrences found: one pass / per canary (20 planted, the rest by chance)", float(ours[0].size),
                float(naive[0].size), "count"),
            row("  same occurrences", float(same), 1.0, "bool")]


def _record_rows(hay: np.ndarray, patterns: list[np.ndarray], matcher: CanaryMatcher) -> list[dict]:
    """RecordScanner over trainer-record dicts (Python lists, as publish streams them) vs the matcher alone."""
    n = 10_000
    cuts = np.linspace(0, hay.size, n + 1).astype(np.int64)
    records = [{"member_id": f"sft/e{i}/r1", "input_ids": hay[cuts[i]:cuts[i + 1]].tolist()} for i in range(n)]
    rows_canaries = [{"canary_id": f"c{i}", "token_ids": p.tobytes(), "scope": ["final_test"]}
                     for i, p in enumerate(patterns)]

    def scan_records() -> RecordScanner:
        scanner = RecordScanner(rows_canaries)
        for _ in scanner.watch(records):
            pass
        return scanner

    t_records = timed(scan_records)
    t_matcher = timed(lambda: matcher.find(hay))
    return [row(f"publish-side scan over {n} trainer records (list -> packed batches -> one pass) vs matcher alone",
                hay.size / t_records / 1e6, hay.size / t_matcher / 1e6, "M tok/s")]


def main() -> None:
    print_table(run())


if __name__ == "__main__":
    main()
