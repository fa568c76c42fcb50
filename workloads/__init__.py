"""Test-data generators used by the demo, the tests and the benchmarks (not shipped in the wheel).

``synthetic`` (realistic agent executions rendered with the real Qwen3.6 tokenizer),
``claude_code`` (real Claude Code sessions rendered to token-level executions),
``scenario`` (mixed governance/execution scenarios for the scale-out tests).

May import anything in ``ledger`` and ``projections``; nothing in ``ledger`` or
``projections`` imports this package.
"""
