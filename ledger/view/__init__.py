"""``ledger serve``: the read-only web view of a store (SPEC 9.x, docs/serve.md).

``app`` (the Starlette application: routes and pages), ``lists`` (filtered, sorted, paged lists),
``text`` (decoded token text), ``tree`` (an execution's tree), ``evidence`` (SPEC 6.10 evidence pages).

May import every layer below it (``ledger.reports`` for the status and reports it shows); nothing
but the CLI imports it.
"""
