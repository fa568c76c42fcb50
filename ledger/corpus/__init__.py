"""Corpus services: what trainers and auditors consume, and how it changes.

``export`` (trainer records), ``manifest`` (manifest documents: Merkle root, signature,
verification), ``publish`` (publish / verify --deep / prove / diff), ``withdraw``
(withdrawal, impact, erase), ``integrity`` (log audit, signed heads, proofs), ``log_lines`` (the decoded log as ingest
lines, ``ledger events``), ``projection_check``
(a projection database against a replay of the log: audit and publish), ``atif_export``
(an execution's tree as ATIF trajectories).

May import: everything below it: ``ledger.algorithms``, ``ledger.events``, ``ledger.log``,
``projections``, ``ledger.producers``. Not ``ledger.reports``, ``ledger.runtime`` or the CLI.
"""
