"""The folders carry the architecture (SPEC §3): imports point down only, pure algorithms do no I/O.

Every import of every module is read with ``ast`` (including imports inside functions), so a
lazy upward import cannot hide.  The layer of a module is the first rule of ``LAYERS`` that
its dotted name matches.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (prefix, rank).  A module may import modules of a strictly lower rank, or of its own prefix.
LAYERS = [
    ("ledger.algorithms", 0),
    ("ledger.events", 1),
    ("ledger.log", 2),
    ("ledger.projections", 3),
    ("ledger.producers", 4),
    ("ledger.runtime", 4),
    ("ledger.gateway", 5),  # SPEC 12.5: the capture gateway and `ledger run`
    ("ledger.corpus", 6),  # erasure scrubs the gateway's stored responses
    ("ledger.reports", 7),
    ("ledger.train", 7),  # SPEC 11.5, the [train] extra: reads corpora into torch/TRL; the core never imports it
    ("ledger.view", 8),  # SPEC 12.5: `ledger serve`, the read-only web view
    ("ledger.cli", 9),
    ("ledger", 9),  # the package face: open_log, Recorder, the trainer reader
    ("workloads", 10),  # test-data generators, never imported by production code
]
# What the replay engine and projections may see of the log layer: the interface and the
# sealed-payload key store, never a backend.
PROJECTION_LOG_ALLOWED = {"ledger.log.base", "ledger.log.sealing"}
# Pure algorithms import none of these (no files, databases, brokers, processes or sockets).
IO_MODULES = {"os", "io", "pathlib", "sqlite3", "sqlite_utils", "confluent_kafka", "shutil", "tempfile", "fcntl",
              "subprocess", "socket", "glob", "urllib", "http", "time", "datetime", "random"}
IO_CALLS = {"open", "input", "print"}
# The [train] extra's libraries: imported only inside ledger.train, so the core package stays torch-free.
TRAIN_ONLY = {"torch", "transformers", "trl", "datasets", "accelerate"}


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("ledger", "workloads"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer(name: str) -> tuple[str, int]:
    for prefix, rank in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return prefix, rank
    raise AssertionError(f"{name} belongs to no layer")


def imports(path: Path, name: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            # ``from ledger.algorithms import merkle`` names a module too
            for a in node.names:
                if f"{mod}.{a.name}" in MODULES:
                    found.append((node.lineno, f"{mod}.{a.name}"))
    return found


def _internal(mod: str) -> bool:
    return mod.split(".")[0] in ("ledger", "workloads", "examples", "benchmarks", "tests")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_only(name):
    path = MODULES[name]
    prefix, rank = layer(name)
    bad = []
    for lineno, mod in imports(path, name):
        if not _internal(mod):
            continue
        if mod.split(".")[0] in ("examples", "benchmarks", "tests"):
            bad.append(f"line {lineno}: {mod} (not a production package)")
            continue
        if mod in ("ledger",) and prefix != "ledger" and prefix != "workloads":
            bad.append(f"line {lineno}: the package face 'ledger' (import the subpackage instead)")
            continue
        if mod == "ledger":
            continue
        their_prefix, their_rank = layer(mod)
        if their_prefix == prefix:
            continue
        if their_rank >= rank:
            bad.append(f"line {lineno}: {mod} ({their_prefix}, layer {their_rank}) from layer {rank}")
        if prefix == "ledger.projections" and their_prefix == "ledger.log" and mod not in PROJECTION_LOG_ALLOWED:
            bad.append(f"line {lineno}: projections may not import the log backend {mod}")
    assert not bad, f"{name} imports upward:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n)[0] == "ledger.algorithms"))
def test_pure_algorithms_do_no_io(name):
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    bad = [f"line {lineno}: imports {mod}" for lineno, mod in imports(path, name) if mod.split(".")[0] in IO_MODULES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IO_CALLS:
            bad.append(f"line {node.lineno}: calls {node.func.id}()")
    assert not bad, f"{name} is in ledger.algorithms but does I/O:\n" + "\n".join(bad)


def test_every_subpackage_says_what_it_holds_and_may_import():
    for name, path in MODULES.items():
        if path.name != "__init__.py" or name in ("ledger",):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and "May import" in doc, f"{name}/__init__.py must open with a docstring saying what it may import"


def test_the_layering_test_can_fail(tmp_path):
    """A planted upward import and a planted open() are both found (the checks are not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sqlite3\nfrom ledger.corpus.export import read_records\n\ndef f():\n    return open('x')\n")
    mods = [m for _, m in imports(bad, "ledger.algorithms.bad")]
    assert "sqlite3" in mods and "ledger.corpus.export" in mods
    assert layer("ledger.corpus.export")[1] > layer("ledger.algorithms.bad")[1]


def test_root_holds_only_the_package_face():
    names = sorted(p.name for p in (ROOT / "ledger").glob("*.py"))
    assert names in (["__init__.py"], ["__init__.py", "__main__.py"]), names  # the CLI is the ledger.cli package


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_ledger_train_imports_it_and_torch(name):
    """SPEC 11.5: ``ledger.train`` sits on ledger.corpus and below; no other module imports it, nor
    torch / transformers / trl / datasets / accelerate (``pip install trajectory-ledger`` has none of them)."""
    if layer(name)[0] == "ledger.train":
        return
    bad = [f"line {lineno}: {mod}" for lineno, mod in imports(MODULES[name], name)
           if mod.split(".")[0] in TRAIN_ONLY or mod == "ledger.train" or mod.startswith("ledger.train.")]
    assert not bad, f"{name} imports the training stack:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------- no import cycles (SPEC 12.5)
def _runtime_imports(path: Path, name: str) -> list[str]:
    """The modules ``path`` imports at run time (module level and inside functions), without the
    imports under ``if TYPE_CHECKING:`` (they never run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    kept = {n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip}
    return [mod for lineno, mod in imports(path, name) if lineno in kept]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {m for m in _runtime_imports(path, name) if m in modules and m != name}
            for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module, each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is small (a few hundred modules)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(_one_cycle(graph, set(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``comp`` (breadth first inside the component)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def test_no_import_cycle_between_files():
    cycles = import_cycles(import_graph(MODULES))
    assert not cycles, "import cycles (a -> b -> ... -> a):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_test_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (tmp_path / "b.py").write_text("from pkg.c import h\n")
    (tmp_path / "c.py").write_text("import pkg.a\n")
    (tmp_path / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    mods = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abcd"}
    assert import_cycles(import_graph(mods)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


# ------------------------------------------------------- imports at module level, function splits (SPEC 12.5)
# The packages whose function-level imports and function lengths are checked: every one (SPEC 12.5).
CHECKED_PACKAGES = ["ledger.algorithms", "ledger.events", "ledger.log", "ledger.projections", "ledger.producers",
                    "ledger.runtime", "ledger.gateway", "ledger.corpus", "ledger.reports", "ledger.train", "ledger.view",
                    "ledger.cli", "ledger"]


def _checked(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in CHECKED_PACKAGES) and not any(
        name == p or name.startswith(p + ".") for p in ("ledger.cli", "ledger.gateway", "ledger.view")
        if p not in CHECKED_PACKAGES)


def uncommented_function_imports(path: Path) -> list[str]:
    """Imports inside a function whose first line carries no ``#`` comment saying why it is not at
    module level (an optional extra, a heavy import on a cold path, a cycle not broken yet)."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))
    bad = {}
    for fn in ast.walk(tree):  # breadth first: an inner function overwrites its outer one
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                    bad[node.lineno] = f"line {node.lineno} in {fn.name}(): {lines[node.lineno - 1].strip()}"
    return [bad[n] for n in sorted(bad)]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _checked(n)))
def test_function_level_imports_say_why(name):
    bad = uncommented_function_imports(MODULES[name])
    assert not bad, (f"{name} imports inside functions without a comment saying why (move them to module "
                     f"level, or say: optional extra / cold path / cycle):\n" + "\n".join(bad))


def test_the_function_import_test_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import json\n\ndef f():\n    import os\n    import torch  # optional extra [train]\n"
                   "    def g():\n        from ledger.log import open_log\n")
    assert uncommented_function_imports(bad) == ["line 4 in f(): import os",
                                                 "line 7 in g(): from ledger.log import open_log"]
    assert _checked("ledger.cli") and _checked("ledger.gateway.app") and _checked("ledger.view.app") \
        and _checked("ledger.corpus.export") and not _checked("workloads.synthetic")


def long_functions(path: Path, name: str, limit: int = 80) -> dict[str, int]:
    """``{dotted.qualname: lines}`` of every function (nested ones too) longer than ``limit`` lines."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > limit:
                    out[qual] = child.end_lineno - child.lineno + 1
                visit(child, qual)
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), name)
    return out


def design_long_functions() -> list[str]:
    """The names listed under "## Functions over 80 lines" in docs/DESIGN.md."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("\n## Functions over 80 lines\n", 1)[1].split("\n## ", 1)[0]
    return [line.split("`")[1] for line in section.splitlines() if line.startswith("- `")]


def test_no_function_over_80_lines_unless_design_says_why():
    found = {q: n for name, path in MODULES.items() if _checked(name) for q, n in long_functions(path, name).items()}
    listed = design_long_functions()
    assert len(listed) <= 5, f"at most five functions over 80 lines may stay, DESIGN.md lists {len(listed)}"
    unlisted = sorted(f"{q} ({n} lines)" for q, n in found.items() if q not in listed)
    assert not unlisted, "functions over 80 lines (split them, or list them in docs/DESIGN.md):\n" + "\n".join(unlisted)
    stale = [q for q in listed if q not in found and any(q.startswith(p + ".") for p in CHECKED_PACKAGES)
             and not any(q.startswith(p + ".") for p in ("ledger.cli", "ledger.gateway", "ledger.view")
                         if p not in CHECKED_PACKAGES)]
    assert not stale, f"docs/DESIGN.md lists functions no longer over 80 lines (or gone): {stale}"


def test_the_long_function_test_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    body = "".join(f"        x{i} = {i}\n" for i in range(80))  # 80 lines at two indents
    bad.write_text(f"class C:\n    def m(self):\n{body}\ndef f():\n    def g():\n{body}"
                   f"    return g\n\ndef short():\n    pass\n")
    assert long_functions(bad, "pkg.bad") == {"pkg.bad.C.m": 81, "pkg.bad.f": 83, "pkg.bad.f.g": 81}
    assert "ledger.algorithms.tree_pack.pack" in design_long_functions()
