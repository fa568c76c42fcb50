"""Producer front doors: the ways events reach the log.

``ingest`` (validated, atomic JSON-lines batches), ``recorder`` (the harness SDK with
automatic prefix references), ``atif_import`` (ATIF trajectories), ``chatml`` (the chat
template rendering importers use), ``credit_client`` (collection credits), ``finalize``
(the one place the wall clock enters).

May import: ``ledger.algorithms``, ``ledger.events``, ``ledger.log``, ``ledger.projections``.
The capture gateway and ``ledger run`` are ``ledger.gateway`` (one layer up).
Not ``ledger.corpus``, ``ledger.reports``, ``ledger.runtime`` or the CLI.
"""
