"""No tracebacks (SPEC §9; issue 13 items 7 and 9b/9c).

Each bad input of the review ends in one line on stderr naming the problem, exit 2 (bad
input) or 1 (a verification finding), with nothing appended and nothing half-written:
deep JSON nesting, a raw 0xFF byte, a lone surrogate, an unwritable ``--out`` (/dev/full, a
directory, a missing folder, ``''``), ``manifest verify --deep`` on a truncated log, ``export``
on a store never projected, ``manifest verify`` of a non-JSON file.  ``--out -`` means stdout.
Anything else unexpected is caught by ``main()``'s safety net: one ``internal error`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ledger.cli.store as cli_mod  # the module of `ledger status`, whose handler the safety-net tests replace
from ledger.cli import main as cli
from ledger.events.signing import Trust, key_id, load_private_key, public_bytes, sign_line
from ledger.log import open_log
from ledger.producers.ingest import MAX_NESTING, parse_json_line
from ledger.events.validate import ValidationError

from ..helpers import closed, opened, request

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "rl-main"


# ------------------------------------------------------------------ helpers
def _write(path: Path, lines) -> str:
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    return str(path)


def _log_state(store: Path) -> tuple[int, bytes]:
    with open_log(str(store)) as log:
        return log.size(), (store / "events.dat").read_bytes()


def _one_line(err: str) -> str:
    """The whole of stderr, which must be exactly one line and no traceback."""
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def _world(key) -> list[dict]:
    """Two executions of a task from a permitted source, scored; split policy, permission, route."""
    lines = [{"type": "task_registered", "task_id": "t1", "fixture": "fx@1", "family": "f", "source": "src"}]
    for ex in ("e1", "e2"):
        lines += [opened(ex, "t1"), request(ex, "r1", [1, 2, 3], [4, 5]), request(ex, "r2", [1, 2, 3, 4, 5, 6], [7, 8]),
                  closed(ex),
                  {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
                   "outcome": "scored", "reward": 1.0, "evaluator": "grader@1"}]
    gov = [{"type": "split_policy", "policy_id": "sp1", "fractions": {"train": 0.98, "dev": 0.01, "final_test": 0.01},
            "salt": "s"},
           {"type": "permission", "subject": "source:src", "use": "rl", "action": "grant", "authority": "gov"},
           {"type": "admission_policy", "route": ROUTE, "version": 1, "use": "rl", "split": "train", "j_max": 4}]
    return lines + [sign_line(l, key) for l in gov]




@pytest.fixture
def projected(store, tmp_path, capsys):
    """``store`` holding the world, projected: route rl-main exports 2 records (one leaf per execution)."""
    key = load_private_key(tmp_path / "gov.key")
    assert cli(["ingest", _write(tmp_path / "world.jsonl", _world(key))]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    assert cli(["export", ROUTE, "--out", str(tmp_path / "ref.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 2
    return store


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    """The real `ledger` process (what a shell sees: exit status, stdout bytes, stderr)."""
    return subprocess.run([sys.executable, "-m", "ledger.cli", *args], capture_output=True, cwd=ROOT, **kw)


# ------------------------------------------------------------------ 7: JSON lines that used to raise
@pytest.mark.parametrize("text", ["[" * 3000 + "]" * 3000,
                                  '{"type": "execution_opened", "x": ' + '{"a": ' * 2500 + "1" + "}" * 2500 + "}"],
                         ids=["array-3000", "object-2500"])
def test_deep_nesting_is_refused_with_the_limit_and_line(store, tmp_path, capsys, text):
    ok = json.dumps(opened("e1"))
    (tmp_path / "deep.jsonl").write_text(ok + "\n" + text + "\n")
    before = _log_state(store)
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "deep.jsonl")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"ledger: refused (nothing appended): line 2: JSON nested deeper than {MAX_NESTING} levels (the limit)")
    assert _log_state(store) == before


def test_nesting_limit_boundary():
    """Depth counts containers, the line's own object being 1: 64 passes, 65 is refused."""
    def nested(depth: int) -> str:  # an object holding depth-1 nested arrays
        return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

    assert parse_json_line(nested(MAX_NESTING), 1) == {"a": json.loads("[" * 63 + "]" * 63)}
    with pytest.raises(ValidationError, match=r"^line 7: field 'a\[0\]\[0\]") as exc:
        parse_json_line(nested(MAX_NESTING + 1), 7)
    assert str(exc.value).endswith(f"JSON nested deeper than {MAX_NESTING} levels (the limit)")


def test_raw_ff_byte_names_the_line(store, tmp_path, capsys):
    good = json.dumps(opened("e1"))
    (tmp_path / "ff.jsonl").write_bytes(good.encode() + b"\n" + b'{"type": "execution_opened", "execution_id": "e\xff"}\n')
    before = _log_state(store)
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "ff.jsonl")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "ledger: refused (nothing appended): line 2: not UTF-8: byte 0xff at byte 48 of the line (invalid start byte)")
    assert _log_state(store) == before  # line 1 was valid: still nothing appended


def test_raw_ff_byte_on_stdin_real_process(store, tmp_path):
    proc = _run("--store", str(store), "ingest", "-", input=b'\xff{"type": "x"}\n')
    assert proc.returncode == 2 and proc.stdout == b""
    assert _one_line(proc.stderr.decode()) == (
        "ledger: refused (nothing appended): line 1: not UTF-8: byte 0xff at byte 1 of the line (invalid start byte)")


def test_lone_surrogate_in_an_id_is_refused(store, tmp_path, capsys):
    (tmp_path / "s.jsonl").write_text(json.dumps(opened("e1")) + "\n"
                                      + json.dumps(opened("e2")).replace('"e2"', '"e\\ud800x"') + "\n")
    before = _log_state(store)
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "s.jsonl")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "ledger: refused (nothing appended): line 2: field 'execution_id': a lone UTF-16 surrogate "
        "(\\ud800-\\udfff escape without its pair) in a string; it cannot be stored as UTF-8")
    assert _log_state(store) == before


def test_a_surrogate_pair_is_an_ordinary_character(store, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text(json.dumps(opened("e1")).replace('"e1"', '"e\\ud83d\\ude00"') + "\n")
    assert cli(["ingest", str(tmp_path / "p.jsonl")]) == 0
    with open_log(str(store)) as log:
        assert log.lookup("execution_opened/e\U0001F600") is not None


def test_integer_too_long_to_convert(store, tmp_path, capsys):
    (tmp_path / "big.jsonl").write_text('{"type": "execution_opened", "n": ' + "9" * 5000 + "}\n")
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "big.jsonl")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"ledger: refused (nothing appended): line 1: malformed JSON: an integer of more than "
        f"{sys.get_int_max_str_digits()} digits")


# ------------------------------------------------------------------ 7: export --out that cannot be written
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "tree"])
@pytest.mark.parametrize("out,message", [
    ("/dev/full", "cannot write /dev/full: No space left on device"),
    ("{tmp}", "--out {tmp} is a directory; name a file"),
    ("{tmp}/missing/x.out", "--out {tmp}/missing/x.out: folder {tmp}/missing does not exist"),
    ("", "--out is empty: name a file (or - for stdout)"),
], ids=["dev-full", "directory", "missing-folder", "empty"])
def test_export_to_an_unwritable_out(projected, tmp_path, capsys, fmt, out, message):
    if out == "/dev/full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    out, message = out.format(tmp=tmp_path), message.format(tmp=tmp_path)
    listing = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert cli(["export", ROUTE, "--format", fmt, "--out", out]) == 2
    assert _one_line(capsys.readouterr().err) == f"ledger: error: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # nothing half-written, no temporary left


def test_export_failing_midway_leaves_the_old_file(projected, tmp_path):
    """A write that fails after some records were written (the process may write only half the
    file: RLIMIT_FSIZE, EFBIG): one line, exit 2, the previous export intact, no temporary left."""
    import resource
    import signal

    target = tmp_path / "ref.jsonl"
    old = target.read_bytes()
    target.write_bytes(b"previous export\n")
    import sqlite3

    # The limit binds every file of the process: SQLite creating the 32 KiB -shm index of the WAL-mode projection
    # database would fail too.  A reader held open here keeps -shm (and the WAL) in place, so the export's only
    # write past the limit is its output file, and its connection is not the last one (no checkpoint on close).
    holder = sqlite3.connect(projected / "projections.db")
    holder.execute("SELECT count(*) FROM sqlite_master").fetchone()

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(old) // 2, resource.RLIM_INFINITY))

    try:
        proc = _run("--store", str(projected), "export", ROUTE, "--out", str(target), preexec_fn=small_files)
    finally:
        holder.close()
    assert proc.returncode == 2
    assert _one_line(proc.stderr.decode()) == f"ledger: error: cannot write {target}: File too large (nothing written)"
    assert target.read_bytes() == b"previous export\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_export_on_a_store_never_projected(store, tmp_path, capsys):
    capsys.readouterr()
    assert cli(["export", ROUTE, "--out", str(tmp_path / "x.jsonl")]) == 2
    db = store / "projections.db"
    assert _one_line(capsys.readouterr().err) == (
        f"ledger: error: the projection database {db} has not been built (no routes table): run `ledger project` first")
    assert not (tmp_path / "x.jsonl").exists()


# ------------------------------------------------------------------ 9c: --out - is stdout
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "tree"])
def test_export_out_dash_writes_stdout(projected, tmp_path, fmt):
    assert cli(["export", ROUTE, "--format", fmt, "--out", str(tmp_path / f"file.{fmt}")]) == 0
    proc = _run("--store", str(projected), "export", ROUTE, "--format", fmt, "--out", "-")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (tmp_path / f"file.{fmt}").read_bytes()  # the records, and nothing else
    summary = json.loads(proc.stderr)  # the summary goes to stderr
    assert summary["records"] == 2 and summary["format"] == fmt
    assert not (ROOT / "-").exists() and not (tmp_path / "-").exists()


def test_keys_new_out_dash_prints_the_key(store, tmp_path):
    proc = _run("--store", str(store), "keys", "new", "--out", "-", "--may-sign", "permission")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(b"-----BEGIN PRIVATE KEY-----\n") and proc.stdout.endswith(b"-----END PRIVATE KEY-----\n")
    (tmp_path / "k.pem").write_bytes(proc.stdout)
    kid = key_id(public_bytes(load_private_key(tmp_path / "k.pem")))
    assert proc.stderr.decode().startswith(f"key {kid} written to stdout; trusted in ")
    assert Trust.load(store / "trust.json").keys[kid].may_sign == ["permission"]
    assert not (ROOT / "-").exists() and not (tmp_path / "-").exists()


def test_manifest_publish_out_dash_prints_the_manifest(projected, tmp_path):
    proc = _run("--store", str(projected), "manifest", "publish", ROUTE, "--key", str(tmp_path / "gov.key"), "--out", "-")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["route"] == ROUTE and doc["version"] == 1 and len(doc["members"]) == 2
    assert "manifest stdout (no Croissant file)" in proc.stderr.decode()
    archived = next((projected / "manifests").rglob("*.json"))
    assert json.loads(archived.read_text()) == doc
    assert not (ROOT / "-").exists() and not (tmp_path / "-").exists()
    (tmp_path / "m.json").write_bytes(proc.stdout)
    assert cli(["manifest", "verify", str(tmp_path / "m.json")]) == 0


def test_report_out_dash_is_refused(store, capsys):
    capsys.readouterr()
    assert cli(["report", "--out", "-"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "ledger: error: report --out names a folder (index.html and its plots); - (stdout) cannot hold it")


# ------------------------------------------------------------------ 7 and 9b: manifest verify
def test_manifest_verify_of_a_non_json_file(store, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("this is not json\n")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    capsys.readouterr()
    assert cli(["manifest", "verify", str(tmp_path / "bad.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "None" not in captured.err
    assert _one_line(captured.err) == f"ledger: error: {tmp_path / 'bad.json'} is not JSON: Expecting value at line 1"
    assert cli(["manifest", "verify", str(tmp_path / "bin.json")]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"ledger: error: {tmp_path / 'bin.json'} is not a manifest: not UTF-8 text (byte 0)")


def test_manifest_verify_deep_on_a_truncated_log(projected, tmp_path, capsys):
    assert cli(["manifest", "publish", ROUTE, "--key", str(tmp_path / "gov.key"), "--out", str(tmp_path / "m.json")]) == 0
    assert cli(["manifest", "verify", str(tmp_path / "m.json"), "--deep"]) == 0
    data = projected / "events.dat"
    os.truncate(data, data.stat().st_size // 2)
    capsys.readouterr()
    assert cli(["manifest", "verify", str(tmp_path / "m.json"), "--deep"]) == 1  # a verification finding
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err == ""
    with open_log(str(projected)) as log:
        last = log.size() - 1  # the ManifestPublished event, the last one, lies in the lost half
    assert captured.out == (f"manifest FAILED verification: {ROUTE} v1\n"
                            f"  the log is damaged: the ManifestPublished event at position {last} cannot be read back "
                            "(bytes missing or changed: the event file was truncated or altered); run `ledger audit`\n")


def test_manifest_verify_deep_on_a_log_damaged_before_the_manifest(projected, tmp_path, capsys):
    """The replay itself meets bytes that fail their digest: named with its position, exit 1."""
    assert cli(["manifest", "publish", ROUTE, "--key", str(tmp_path / "gov.key"), "--out", str(tmp_path / "m.json")]) == 0
    with open_log(str(projected)) as log:
        rec = next(r for r in log.read() if r.event_type == "request")
    with open(projected / "events.dat", "r+b") as fh:  # zero the bytes of that one request
        import sqlite3

        off, length = sqlite3.connect(projected / "index.db").execute(
            "SELECT file_offset, length FROM events WHERE position = ?", (rec.offset,)).fetchone()
        fh.seek(off)
        fh.write(b"\0" * length)
    capsys.readouterr()
    assert cli(["manifest", "verify", str(tmp_path / "m.json"), "--deep"]) == 1
    out = capsys.readouterr().out
    assert out == (f"manifest FAILED verification: {ROUTE} v1\n"
                   f"  the log is damaged: 1 undecodable event(s) in the replay, the first at position {rec.offset} "
                   "cannot be read back (bytes missing or changed: the event file was truncated or altered); "
                   "run `ledger audit`\n")


# ------------------------------------------------------------------ the safety net
def test_unexpected_exception_is_one_internal_error_line(store, capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("something broke\nacross two lines")

    monkeypatch.setattr(cli_mod, "cmd_status", boom)
    capsys.readouterr()
    assert cli(["status"]) == 2
    assert _one_line(capsys.readouterr().err) == "ledger: internal error: RuntimeError: something broke across two lines"


def test_keyboard_interrupt_exits_130(store, capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_mod, "cmd_status", interrupted)
    capsys.readouterr()
    assert cli(["status"]) == 130
    assert _one_line(capsys.readouterr().err) == "ledger: interrupted"


def test_stdout_that_cannot_be_written_real_process(store):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), "status"], stdout=full,
                              stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.returncode == 2
    assert _one_line(proc.stderr.decode()) == "ledger: error: cannot write output: No space left on device"


@pytest.mark.parametrize("out", ["gov.key", "-"])
def test_keys_new_without_a_store_writes_nothing(tmp_path, out):
    """Found by the i30 helper: `ledger keys new --out gov.key` in a folder with no store ended in
    "internal error: FileNotFoundError … trust.json.tmp" after writing gov.key, so a retry said the key
    already existed although no trust file named it."""
    proc = subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(tmp_path / "nostore"), "keys", "new",
                           "--out", out], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"ledger: error: cannot trust the new key in {tmp_path / 'nostore' / 'trust.json'}: ")
    assert "run `ledger init` first" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
