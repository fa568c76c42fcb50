"""One logical schema (SPEC 11.5): what int64 / float64 Parquet columns cost against the previous
release's uint32 ids, uint8 masks and float32 log-probs (lineage then a JSON string column).

The realistic workload (``bench_readers``' export) is written twice in the same run, with the
schema of this release (``ledger.corpus.formats``) and with the previous one (the baseline): file
size and write + ``read_records`` time.  ``python -m benchmarks bench_formats``; size with
``LEDGER_BENCH_READERS_EXECUTIONS`` (default 80), rounds with ``LEDGER_BENCH_READERS_ROUNDS``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .bench_readers import N_EXECUTIONS, ROUNDS
from .common import row


def _previous_schema(first=None):
    import pyarrow as pa

    return pa.schema([
        ("member_id", pa.string()), ("execution_id", pa.string()), ("task_id", pa.string()), ("group_id", pa.string()),
        ("split", pa.string()), ("route", pa.string()), ("leaf_request_id", pa.string()), ("role_class", pa.string()),
        ("input_ids", pa.list_(pa.uint32())), ("target_mask", pa.list_(pa.uint8())),
        ("behavior_logprobs", pa.list_(pa.float32())), ("loss_weight", pa.float64()),
        ("execution_target_tokens", pa.int64()), ("reward", pa.float64()), ("dummy", pa.bool_()), ("digest", pa.string()),
    ])


def _write_read(records, path: Path, schema) -> float:
    from ledger import read_records
    from ledger.corpus.export import write_parquet_rows

    t0 = time.perf_counter()
    write_parquet_rows(records, path, schema, lambda rec: None, row_group_tokens=1 << 20, row_group_rows=4096)
    n = sum(1 for _ in read_records(path))
    assert n == len(records)
    return time.perf_counter() - t0


def run(n_executions: int = N_EXECUTIONS, rounds: int = ROUNDS) -> list[dict]:
    from ledger.corpus.export import _arrow_schema, read_records

    from .bench_readers import _export

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _export(tmp, n_executions)
        records = list(read_records(tmp / "r.jsonl"))
        best_new = best_old = float("inf")
        for _ in range(rounds):  # interleaved: both see the same machine load
            best_old = min(best_old, _write_read(records, tmp / "old.parquet", _previous_schema))
            best_new = min(best_new, _write_read(records, tmp / "new.parquet", _arrow_schema))
        size_old, size_new = (tmp / "old.parquet").stat().st_size, (tmp / "new.parquet").stat().st_size
        tokens = sum(len(r["input_ids"]) for r in records)
    note = f"{len(records)} records, {tokens} tokens"
    return [row("path Parquet size: int64/float64 vs uint32/uint8/float32 (bytes)", size_new, size_old, "bytes", note=note),
            row("path Parquet write + validated read (s)", best_new, best_old, "s", note=note)]


if __name__ == "__main__":  # pragma: no cover
    from .common import print_table

    print_table(run())
