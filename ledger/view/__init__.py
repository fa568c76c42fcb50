"""``ledger serve``: the read-only web view of a store (SPEC 9.x, docs/serve.md).

``app`` (the factory: the Starlette application from every page module's ``ROUTES``, and ``serve``).
One module per page family, each with its documents (the JSON twins), its HTML and its ``ROUTES``:
``status``, ``executions`` (executions, tasks, one execution, trees), ``runs``, ``routes``, ``splits``,
``manifests``, ``withdrawals``, ``evidence`` (SPEC 6.10: graders, campaigns, evidence sections).
Shared: ``page`` (the chrome: escaping, tables, layout, pager, the read-only database), ``request``
(query parameters, JSON answers, error pages, headers), ``hosts`` (the ``Host`` check), ``lists``
(filtered, sorted, paged lists), ``text`` (decoded token text), ``tree`` (an execution's tree).

May import every layer below it (``ledger.reports`` for the status and reports it shows); nothing
but the CLI imports it.
"""
