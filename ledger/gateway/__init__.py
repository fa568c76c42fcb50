"""The capture gateway (SPEC 7.6, 11.3, 12): an HTTP server between a harness and a token engine.

``app`` (``make_app``: the aiohttp application, each protocol's routes registered, middlewares in one place),
``calls`` (the shared state and the protocol-neutral call path: render, restore, record), one module per
protocol -- ``chat`` (OpenAI Chat Completions), ``responses`` (OpenAI Responses, its stored responses),
``messages`` (Anthropic Messages) -- over ``endpoint`` (the shared HTTP handler, errors, server-sent events)
and ``shapes`` (request-mapping helpers); ``ledger_routes`` (open / close an execution), ``store``
(``gateway.db``: drift counts, restoration state, stored responses), ``body`` (canonical request-body
digests), ``upstream`` (token engines: vLLM, SGLang, llama.cpp, TGI), ``serve`` (event loop, serving on a
thread), ``workers`` (``--workers N``: one front and N worker processes), ``run`` (``ledger run -- COMMAND``:
an execution around a harness process).

May import: ``ledger.algorithms``, ``ledger.events``, ``ledger.log``, ``ledger.projections``,
``ledger.producers`` (the recorder, chat templates). Not ``ledger.corpus``, ``ledger.reports``,
``ledger.view`` or the CLI (the corpus layer imports this one: erasure scrubs the gateway's
stored responses).
"""
