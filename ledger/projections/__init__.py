"""Projections: state derived from the log by replay (SPEC §3, §6).

``engine`` (the replay engine: positions in the same transaction as state, dead letters),
``registry`` (which projections a store runs), ``shards`` (per-partition state and the
deterministic merge), and one module per projection: ``tree``, ``assessment``, ``splits``,
``governance`` (+ ``governance_check``, ``descendants``), ``admission``, ``credits``,
``manifests``.

May import: ``ledger.algorithms``, ``ledger.events``, the log *interface*
(``ledger.log.base``) and ``ledger.log.sealing``. Never a log backend, the producers, the
corpus services, the reports or the CLI.
"""
