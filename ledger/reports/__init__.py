"""Reports: read-only views over projections for people.

``status`` (``ledger status``), ``report`` (the HTML report), ``splits_report``,
``cohort`` (cohort dispositions), ``telemetry`` (loop telemetry), ``plan`` (collection
plans), ``report_economics``, ``status_extras`` (the web view is ``ledger.view``).

May import: everything below it (``ledger.algorithms`` … ``ledger.corpus``). Not
``ledger.runtime`` or the CLI.
"""
