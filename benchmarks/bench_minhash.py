"""Benchmark: MinHash + banded LSH screening vs. datasketch (SPEC §8).

Same data, same hash family, same permutations (``seed``), same ``b`` and ``r``: the
ledger's batched numpy implementation (:mod:`ledger.algorithms.minhash`) against
``datasketch.MinHash.bulk`` + ``datasketch.MinHashLSH(params=(b, r))`` (insert every
signature, query every signature).  Besides speed, the run checks that the signatures are
bit-identical and the candidate-pair sets identical.

Run ``python -m benchmarks.bench_minhash`` for a table; :func:`run` returns the rows.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ledger.algorithms.minhash import MinHasher, lsh_candidate_indices, text_shingles

T = TypeVar("T")

_TOPICS = (
    "connection pool leaks sockets under load when the retry loop times out",
    "parser drops the last token of a multiline string literal",
    "cache invalidation races with the background refresh thread",
    "migration script fails on tables with composite primary keys",
    "date formatting uses the local timezone instead of utc",
    "cli exits zero although the config file could not be read",
    "pagination skips one record when the page size divides the total",
    "json encoder crashes on nested decimal values",
)


def synthetic_tasks(n: int = 5000, seed: int = 0, vocab: int = 3000) -> list[str]:
    """``n`` task descriptions: fresh random texts plus near-duplicate variants.

    About 40% of the tasks are edits (word substitutions, insertions, deletions) of an
    earlier task, so the corpus holds pairs across the whole similarity range.
    """
    rng = np.random.RandomState(seed)
    words = [f"w{i:04d}" for i in range(vocab)]
    texts: list[list[str]] = []
    for i in range(n):
        if texts and rng.random_sample() < 0.4:
            base = list(texts[rng.randint(len(texts))])
            rate = rng.uniform(0.02, 0.5)
            out: list[str] = []
            for w in base:
                x = rng.random_sample()
                if x < rate / 3:
                    continue  # delete
                if x < 2 * rate / 3:
                    out.append(words[rng.randint(vocab)])  # substitute
                    continue
                out.append(w)
                if x < rate:
                    out.append(words[rng.randint(vocab)])  # insert
            texts.append(out or base)
        else:
            topic = _TOPICS[rng.randint(len(_TOPICS))].split()
            body = [words[j] for j in rng.randint(0, vocab, rng.randint(20, 60))]
            texts.append(topic + body)
    return [" ".join(t) for t in texts]


def _best_of(repeats: int, fn: Callable[[], T]) -> tuple[float, T]:
    best = float("inf")
    result: Any = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run(n: int = 5000, num_perm: int = 128, b: int = 32, r: int = 4, seed: int = 1, repeats: int = 3) -> list[dict[str, Any]]:
    """Time ours vs. datasketch on ``n`` synthetic tasks; return table rows.

    Rows: ``{"name", "value", "baseline", "ratio", "unit"}``.  Throughput rows have
    ``ratio = value / baseline`` (> 1: ours is faster); check rows hold 1.0 for "identical".
    """
    from datasketch import MinHash, MinHashLSH

    tasks = synthetic_tasks(n)
    shingles = [sorted(text_shingles(t, k=3)) for t in tasks]
    keys = [f"task-{i:06d}" for i in range(n)]

    def ours_sign() -> np.ndarray:
        return MinHasher(num_perm, seed).signature_matrix(shingles)

    def theirs_sign() -> list[Any]:
        return MinHash.bulk(shingles, num_perm=num_perm, seed=seed)

    t_ours_sig, matrix = _best_of(repeats, ours_sign)
    t_ds_sig, minhashes = _best_of(repeats, theirs_sign)

    def ours_lsh() -> set[tuple[str, str]]:
        pairs = lsh_candidate_indices(matrix, b, r)
        return {(keys[i], keys[j]) for i, j in pairs.tolist()}

    def theirs_lsh() -> set[tuple[str, str]]:
        lsh = MinHashLSH(num_perm=num_perm, params=(b, r))
        for k, m in zip(keys, minhashes):
            lsh.insert(k, m)
        out: set[tuple[str, str]] = set()
        for k, m in zip(keys, minhashes):
            for other in lsh.query(m):
                if other != k:
                    out.add((min(k, other), max(k, other)))
        return out

    t_ours_lsh, ours_pairs = _best_of(repeats, ours_lsh)
    t_ds_lsh, ds_pairs = _best_of(repeats, theirs_lsh)

    same_sigs = bool(np.array_equal(matrix, np.stack([m.hashvalues for m in minhashes])))
    same_pairs = ours_pairs == ds_pairs

    def row(name: str, value: float, baseline: float, unit: str, ratio: float | None = None) -> dict[str, Any]:
        return {
            "name": name,
            "value": value,
            "baseline": baseline,
            "ratio": ratio if ratio is not None else (value / baseline if baseline else float("nan")),
            "unit": unit,
        }

    t_ours = t_ours_sig + t_ours_lsh
    t_ds = t_ds_sig + t_ds_lsh
    return [
        row(f"minhash signatures ({n} tasks, num_perm={num_perm}) vs datasketch", n / t_ours_sig, n / t_ds_sig, "tasks/s"),
        row(f"LSH candidates (b={b}, r={r}) vs datasketch MinHashLSH", n / t_ours_lsh, n / t_ds_lsh, "tasks/s"),
        row("MinHash+LSH screening total vs datasketch", n / t_ours, n / t_ds, "tasks/s"),
        row("signatures bit-identical to datasketch", float(same_sigs), 1.0, "bool"),
        row("candidate pairs (ours vs datasketch)", float(len(ours_pairs)), float(len(ds_pairs)), "pairs"),
        row("candidate sets identical", float(same_pairs), 1.0, "bool"),
    ]


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Render rows as a fixed-width text table."""
    name_w = max(len(r["name"]) for r in rows)
    lines = [f"{'benchmark':<{name_w}}  {'value':>12}  {'baseline':>12}  {'ratio':>7}  unit"]
    for r in rows:
        lines.append(f"{r['name']:<{name_w}}  {r['value']:>12,.1f}  {r['baseline']:>12,.1f}  {r['ratio']:>7.2f}  {r['unit']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("-b", type=int, default=32)
    parser.add_argument("-r", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = run(n=args.n, num_perm=args.num_perm, b=args.b, r=args.r, repeats=args.repeats)
    print(format_rows(rows))
    return 0 if all(r["ratio"] == 1.0 for r in rows if r["unit"] == "bool") else 1


if __name__ == "__main__":
    raise SystemExit(main())
