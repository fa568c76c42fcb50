"""``ledger events [--type T]... [--execution E] --json`` (SPEC 12.4): the decoded log as JSON lines with the
ingest field names, on the README's corpus; each line validates back to the stored event; bad selections
are one line on stderr and exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ledger.cli import main
from ledger.events.codec import default_codec
from ledger.events.lines import ingest_line
from ledger.events.validate import timestamp_micros, validate_line
from ledger.log import open_log
from ledger.log.sealing import KeyStore, unseal
from tests.helpers import readme_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The README's quickstart 2 store (examples/demo.jsonl under route rl-main)."""
    d = tmp_path_factory.mktemp("readme")
    readme_store(d)
    return d


def _events(capsys, store_dir, *args) -> tuple[int, list[dict], str]:
    capsys.readouterr()
    rc = main(["--store", str(store_dir / "ledger-data"), "events", *args, "--json"])
    out = capsys.readouterr()
    return rc, [json.loads(line) for line in out.out.splitlines()], out.err


def test_every_event_with_the_ingest_names_and_back(store, capsys):
    rc, lines, err = _events(capsys, store)
    assert rc == 0 and err == ""
    demo = [json.loads(line) for line in (ROOT / "examples" / "demo.jsonl").read_text().splitlines()]
    assert len(lines) == len(demo) + 3  # the README's three route lines
    assert [x["type"] for x in lines[:len(demo)]] == [x["type"] for x in demo]
    for mine, theirs in zip(lines, demo):  # what was ingested, as it was given (tokens opened from their seal)
        for k, v in theirs.items():
            if k in ("occurred_at", "deadline"):  # RFC 3339 of the same instant
                assert timestamp_micros(mine[k]) == timestamp_micros(v)
            elif k == "output_logprobs":
                assert mine[k] == pytest.approx(v, abs=1e-6)  # stored as float32
            else:
                assert mine[k] == v, (k, theirs["type"])
    assert lines[-1]["type"] == "admission_policy" and lines[-1]["signature"]["key_id"]
    # each line validates back to the event the log holds (the header ingest stamped comes back as given)
    codec, keys = default_codec(), KeyStore(store / "ledger-data" / "data-keys.db")
    with open_log(str(store / "ledger-data")) as log:
        stored = [unseal(codec.decode(r.value), keys) for w in log.partitions() for r in log.read(w)]
    keys.close()
    assert any(ev["event_type"] == "request" for ev in stored)
    for ev, line in zip(stored, lines):
        assert ingest_line(ev) == line
        back = validate_line(line, now_micros=0)
        skip = ("stamped", "signature", "signed_body", "sealed")
        assert {k: v for k, v in back.items() if k not in skip} == {k: v for k, v in ev.items() if k not in skip}


def test_selections(store, capsys):
    rc, lines, _ = _events(capsys, store, "--type", "execution_opened", "--type", "assessment")
    assert rc == 0 and [x["type"] for x in lines].count("execution_opened") == 6 and len(lines) == 12
    assert {x["type"] for x in lines} == {"execution_opened", "assessment"}
    rc, lines, _ = _events(capsys, store, "--execution", "exec-7-0003")
    assert rc == 0 and lines and all(x["execution_id"] == "exec-7-0003" for x in lines)
    assert lines[0]["type"] == "execution_opened" and lines[-1]["type"] in ("execution_closed", "assessment")
    rc, both, _ = _events(capsys, store, "--execution", "exec-7-0003", "--type", "request")
    assert rc == 0 and both == [x for x in lines if x["type"] == "request"] and both[0]["output_ids"]
    capsys.readouterr()
    assert main(["--store", str(store / "ledger-data"), "events", "--type", "permission"]) == 0  # without --json
    assert re.fullmatch(r"\d+\tpermission\tpermission/\S+\n", capsys.readouterr().out)


@pytest.mark.parametrize("args,message", [
    (["--type", "requests"], "ledger: error: unknown event type 'requests' (known: admission_policy, "),
    (["--execution", "exec-9"], "ledger: error: no execution 'exec-9' in the log (never opened nor derived)"),
])
def test_bad_selections_are_one_line_and_exit_2(store, capsys, args, message):
    rc, lines, err = _events(capsys, store, *args)
    assert rc == 2 and lines == []
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


def test_cli_process_exit_codes(store, tmp_path):
    """As a process: no traceback, exit 2; a store that does not exist is named."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "ledger.cli", *a], capture_output=True, text=True, cwd=store)
    p = run("events", "--type", "nope", "--json")
    assert p.returncode == 2 and p.stdout == "" and "unknown event type 'nope'" in p.stderr and "Traceback" not in p.stderr
    p = run("--store", str(tmp_path / "none"), "events", "--json")
    assert p.returncode == 2 and "no ledger store at" in p.stderr
    p = run("events", "--execution", "x" * 2000)
    assert p.returncode == 2 and "identifier" in p.stderr.lower() and "Traceback" not in p.stderr


def test_an_erased_request_keeps_its_metadata_not_its_tokens(store, tmp_path, capsys):
    """After `withdraw --erase` the data key is gone: the request's line says erased, without tokens."""
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(store, d)
    s = str(d / "ledger-data")
    assert main(["--store", s, "withdraw", "execution:exec-7-0002", "--reason", "consent withdrawn", "--erase",
                 "--key", str(d / "gov.key")]) == 0
    rc, lines, _ = _events(capsys, d, "--execution", "exec-7-0002", "--type", "request")
    assert rc == 0 and lines and all(x["erased"] is True for x in lines)
    assert not any(k in x for x in lines for k in ("input_ids", "output_ids", "output_logprobs", "input_suffix_ids"))
    assert lines[0]["request_id"] == "r001" and lines[0]["model"]
    rc, lines, _ = _events(capsys, d, "--execution", "exec-7-0001", "--type", "request")
    assert rc == 0 and "erased" not in lines[0] and lines[0]["output_ids"]
    rc, lines, _ = _events(capsys, d, "--type", "withdrawal")
    assert [x["subject"] for x in lines] == ["execution:exec-7-0002"] and lines[0]["erase"] is True
