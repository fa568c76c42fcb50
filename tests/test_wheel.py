"""The built wheel (SPEC §2): schemas inside the package, only `ledger` (ledger.projections inside it)
installed, and a working `ledger` from a directory outside the checkout.

The wheel is built with ``pip wheel`` (PEP 517, build isolation: setuptools from the
package index, as a user's ``pip install`` would) from a copy of the checkout, so the
build's ``build/`` and ``*.egg-info`` never touch the working tree.  It is installed
with ``--no-deps`` into a fresh virtualenv whose dependencies come from the running
interpreter's site-packages through a plain path line in a ``.pth`` file (path lines add
the directory only; that directory's own ``.pth`` files, among them the editable install's
finder that maps ``ledger`` to the checkout, are not run).  Every command runs in a tmp
directory and the test asserts that ``ledger`` and ``ledger.projections`` are imported from the
new virtualenv, not from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPY = ("pyproject.toml", "README.md", "ledger", "schemas", "tests", "workloads", "benchmarks",
        "examples")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".venv", "demo-out",
                                ".hypothesis", ".pytest_cache")
ROUTE = "rl-main"


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in COPY:  # symlinks kept as links (ledger/events/schemas -> ../../schemas), as in a git clone
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, symlinks=True, ignore=IGNORE)
        else:
            shutil.copy2(p, src / name)
    assert (src / "ledger" / "events" / "schemas").is_symlink()
    dist = tmp_path_factory.mktemp("dist")
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
                 "-w", str(dist), str(src)], cwd=src)
    if proc.returncode != 0 and ("Could not find a version" in proc.stderr or "NewConnectionError" in proc.stderr):
        pytest.skip(f"no package index to fetch the build backend (setuptools>=68): {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr
    (whl,) = dist.glob("trajectory_ledger-*.whl")
    return whl


def test_wheel_ships_the_schemas_and_only_ledger(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tops = {n.split("/")[0] for n in names}
        assert tops == {"ledger", "trajectory_ledger-0.1.0.dist-info"}, tops  # one import name (SPEC 12.5)
        schemas = sorted(p.name for p in (ROOT / "schemas").glob("*.avsc"))
        shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("ledger/events/schemas/"))
        assert shipped == schemas and len(schemas) >= 25
        for name in schemas:  # real files with the schema's exact bytes, not links
            assert zf.read(f"ledger/events/schemas/{name}") == (ROOT / "schemas" / name).read_bytes()
        # every subpackage of the checkout is in the wheel (packages.find, not a hand list)
        pkgs = {str(p.parent.relative_to(ROOT)) for top in ("ledger",)
                for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts}
        assert pkgs <= {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
        assert {"ledger/cli/__init__.py", "ledger/gateway/app.py", "ledger/view/app.py", "ledger/events/codec.py", "ledger/projections/engine.py", "ledger/py.typed"} <= set(names)
        entry = zf.read("trajectory_ledger-0.1.0.dist-info/entry_points.txt").decode()
        assert "ledger = ledger.cli:main" in entry
        assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "workloads/", "examples/"))]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv") / "v"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=env_dir.parent)
    assert proc.returncode == 0, proc.stderr
    py = env_dir / "bin" / "python"
    proc = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                 "--disable-pip-version-check", "-q", str(wheel)], cwd=env_dir.parent)
    assert proc.returncode == 0, proc.stderr
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=env_dir.parent).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "zz_ledger_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return env_dir


def _clean_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LEDGER_STORE", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_installed_wheel_imports_from_the_venv_not_the_checkout(venv, tmp_path):
    proc = _run([str(venv / "bin" / "python"), "-c",
                 "import json, ledger, ledger.projections as projections, ledger.events.codec as c; "
                 "print(json.dumps([ledger.__file__, projections.__file__, str(c.SCHEMA_DIR), len(c.default_codec().by_fingerprint)]))"],
                cwd=tmp_path, env=_clean_env(venv))
    assert proc.returncode == 0, proc.stderr
    led, proj, schema_dir, n = json.loads(proc.stdout)
    for f in (led, proj, schema_dir):
        assert Path(f).resolve().is_relative_to(venv.resolve()), f
        assert not Path(f).resolve().is_relative_to(ROOT), f
    assert n == len(list((ROOT / "schemas").glob("*.avsc")))
    assert not Path(schema_dir).is_symlink()
    # nothing but the two packages: the test-data generators are not importable
    proc = _run([str(venv / "bin" / "python"), "-c", "import workloads"], cwd=tmp_path, env=_clean_env(venv))
    assert proc.returncode == 1 and "No module named 'workloads'" in proc.stderr


def _governance() -> list[dict]:
    sources = ["internal-bugbash", "curated-regressions"]
    lines = [{"type": "split_policy", "policy_id": "splits-v1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
              "salt": "wheel-salt"}]
    lines += [{"type": "permission", "subject": f"source:{s}", "use": "rl", "action": "grant",
               "authority": "data-governance"} for s in sources]
    lines.append({"type": "admission_policy", "route": ROUTE, "version": 1, "use": "rl", "split": "train", "j_max": 4,
                  "role_priority": ["main/task", "main/summary", "sub/task", "sub/summary"],
                  "predicates": [{"name": "record_adequacy"}, {"name": "permitted_use"},
                                 {"name": "target_suitability", "depends_on": ["record_adequacy"]}],
                  "seed": "wheel-route-seed", "consumer": "wheel-test", "evaluation_claim": "none"})
    return lines


def test_the_installed_ledger_runs_the_whole_flow_outside_the_checkout(venv, tmp_path):
    env = _clean_env(venv)
    ledger_bin = str(venv / "bin" / "ledger")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "demo.jsonl", work / "events.jsonl")
    (work / "gov.jsonl").write_text("".join(json.dumps(l) + "\n" for l in _governance()))

    def ledger(*args: str, rc: int = 0) -> str:
        proc = _run([ledger_bin, *args], cwd=work, env=env)
        assert proc.returncode == rc, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        return proc.stdout

    assert "initialised store" in ledger("init")
    assert (work / "ledger-data").is_dir()
    ledger("keys", "new", "--out", "gov.key")
    assert "appended 436, duplicate 0, conflicting 0" in ledger("ingest", "events.jsonl")
    assert "appended 0, duplicate 436, conflicting 0" in ledger("ingest", "events.jsonl")
    (work / "gov.signed.jsonl").write_text(ledger("sign", "--key", "gov.key", "gov.jsonl"))
    assert "appended 4, duplicate 0, conflicting 0" in ledger("ingest", "gov.signed.jsonl")
    assert "applied 440, rejected 0, dead letters 0" in ledger("project")
    ledger("export", ROUTE, "--out", "batch.jsonl", "--format", "jsonl")
    records = [json.loads(l) for l in (work / "batch.jsonl").read_text().splitlines()]
    assert records and all(r["route"] == ROUTE for r in records)
    ledger("manifest", "publish", ROUTE, "--key", "gov.key", "--out", "m1.json")
    doc = json.loads((work / "m1.json").read_text())
    assert doc["route"] == ROUTE and doc["version"] == 1
    assert sorted(m["digest"] for m in doc["members"]) == sorted(r["digest"] for r in records)
    ledger("manifest", "verify", "m1.json", "--deep")
    audit = json.loads(ledger("audit", "--json"))
    assert audit == {"events": 441, "first_bad_position": None, "ok": True, "problems": []}
    # the events the installed package wrote carry the Avro spec's fingerprint byte order
    proc = _run([str(venv / "bin" / "python"), "-c",
                 "from ledger import open_log; from ledger.events.codec import default_codec as d; c = d(); "
                 "log = open_log('ledger-data'); "
                 "print(sum(c.is_legacy_order(r.value) for w in log.partitions() for r in log.read(w)))"],
                cwd=work, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr
