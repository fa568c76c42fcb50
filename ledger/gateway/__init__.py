"""The capture gateway (SPEC 7.6, 11.3, 12): an HTTP server between a harness and a token engine.

``app`` (the aiohttp application and the protocol-neutral call path: render, restore, record),
``apis`` (the request and answer shapes of the OpenAI Chat Completions / Responses and Anthropic
Messages protocols), ``body`` (canonical request-body digests), ``upstream`` (token engines:
vLLM, SGLang, llama.cpp, TGI), ``workers`` (``--workers N``: one front and N worker processes),
``run`` (``ledger run -- COMMAND``: an execution around a harness process).

May import: ``ledger.algorithms``, ``ledger.events``, ``ledger.log``, ``ledger.projections``,
``ledger.producers`` (the recorder, chat templates). Not ``ledger.corpus``, ``ledger.reports``,
``ledger.view`` or the CLI (the corpus layer imports this one: erasure scrubs the gateway's
stored responses).
"""
