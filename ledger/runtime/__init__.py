"""Long-running processes: the projector (``project --follow``, consumer groups) and the
local scale-out cluster.

May import: ``ledger.algorithms``, ``ledger.events``, ``ledger.log``, ``projections``. Not
``ledger.producers``, ``ledger.corpus``, ``ledger.reports`` or the CLI.
"""
