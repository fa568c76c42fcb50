"""The CLI package (SPEC 12.5): one module per command group, each command's parser beside its handler,
no function over 80 lines, and errors translated once, at the edge (``ledger.cli.main``)."""

from __future__ import annotations

import argparse
import ast
import importlib
from pathlib import Path

import pytest

import ledger.cli as cli
import ledger.cli.store
from ledger.algorithms.errors import InputError, IntegrityError, LedgerError, StateError

from .test_layering import long_functions, uncommented_function_imports

ROOT = Path(__file__).resolve().parents[1]

# command -> the module of its group (ledger.cli.<group>)
GROUP_OF = {
    "init": "store", "status": "store", "audit": "store", "log": "store", "conflicts": "store",
    "ingest": "ingest", "ingest-sealed": "ingest", "import-atif": "ingest", "finalize": "ingest",
    "keys": "keys", "sign": "keys",
    "project": "project", "tree": "project",
    "cascade": "admission", "admission": "admission",
    "export": "export", "export-atif": "export",
    "withdraw": "governance", "impact": "governance",
    "feed": "feed",
    "manifest": "manifest",
    "gateway": "gateway", "run": "gateway",
    "report": "serve", "serve": "serve",
    "splits": "splits", "similarity": "splits",
    "credits": "economics", "graders": "economics", "cohort": "economics", "telemetry": "economics",
    "plan": "economics",
    "events": "events",
}


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)


def _leaves(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    sub = _subparsers(p)
    if sub is None:
        yield path, p
        return
    for name, child in sub.choices.items():
        yield from _leaves(child, path + (name,))


LEAVES = list(_leaves(cli.build_parser()))


def test_every_command_has_a_group():
    assert sorted(_subparsers(cli.build_parser()).choices) == sorted(GROUP_OF)
    assert len(LEAVES) == 40  # 33 commands: 24 plain ones and 9 groups of 16 subcommands


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_command_maps_to_a_handler_in_its_group_module(path, parser):
    fn = parser.get_default("fn")
    assert callable(fn), f"ledger {' '.join(path)} has no handler"
    assert fn.__module__ == f"ledger.cli.{GROUP_OF[path[0]]}", (path, fn.__module__)
    assert fn.__name__.startswith("cmd_"), fn.__name__


@pytest.mark.parametrize("group", sorted(set(GROUP_OF.values())))
def test_a_group_registers_exactly_its_commands(group):
    mod = importlib.import_module(f"ledger.cli.{group}")
    sub = argparse.ArgumentParser().add_subparsers()
    mod.register(sub)
    assert sorted(sub.choices) == sorted(c for c, g in GROUP_OF.items() if g == group)
    assert mod in cli.GROUPS


CLI_MODULES = sorted((ROOT / "ledger" / "cli").glob("*.py"))


def test_no_cli_function_exceeds_80_lines():
    """tests/test_layering.py's check (nested functions too), over every module of the package."""
    assert len(CLI_MODULES) >= 15
    found = {q: n for path in CLI_MODULES for q, n in long_functions(path, f"ledger.cli.{path.stem}").items()}
    assert found == {}
    assert long_functions(CLI_MODULES[0], "x", limit=5)  # the same walk finds the longer ones


@pytest.mark.parametrize("path", CLI_MODULES, ids=[p.name for p in CLI_MODULES])
def test_cli_function_level_imports_say_why(path):
    """Imports at module level; a lazy one says why on its line (``# lazy: startup time``)."""
    assert uncommented_function_imports(path) == []


@pytest.mark.parametrize("exc,code,line", [
    (IntegrityError("the root differs"), 1, "ledger: error: the root differs"),
    (InputError("no such thing"), 2, "ledger: error: no such thing"),
    (StateError("the store is held"), 2, "ledger: error: the store is held"),
    (LedgerError("something of the ledger"), 2, "ledger: error: something of the ledger"),
    (cli.UsageError("bad --flag"), 2, "ledger: error: bad --flag"),
    (KeyError("not a ledger error"), 2, "ledger: internal error: KeyError: 'not a ledger error'"),
])
def test_the_edge_translates_once(monkeypatch, capsys, exc, code, line):
    def raises(args):
        raise exc

    monkeypatch.setattr(ledger.cli.store, "cmd_status", raises)
    assert cli.main(["status"]) == code
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""


def test_per_command_translation_is_gone():
    """No command module catches an error of the LedgerError tree to re-say it: ``main`` does."""
    named = {"PublishError", "FeedError", "AtifExportError", "ManifestError", "MergeError", "LedgerError",
             "InputError", "StateError", "IntegrityError"}
    caught = []
    for path in sorted((ROOT / "ledger" / "cli").glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                caught += [f"{path.name}:{node.lineno}: {n}" for n in names & named]
    assert caught == []


def test_private_names_tests_use_stay_importable():
    from ledger.cli import _gateway_of, build_parser, main  # noqa: F401

    assert cli.main is main
