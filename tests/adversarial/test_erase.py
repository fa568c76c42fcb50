"""Erase always means erased (SPEC §9; issue 13 item 1).

The review's case: records from plain ``ledger ingest`` (the README and demo path), then
``withdraw execution:X --erase``: it printed success while every token stayed readable.  Now
the default path seals, so erase destroys keys and no token remains; and whatever cannot be
made unreadable (``--no-seal`` records, a key shared with records outside the subject, clear
replacement tokens of a derived view) is refused with exit 2, naming the records, with
nothing appended and no key destroyed.
"""

from __future__ import annotations

import json
from pathlib import Path


from ledger.algorithms.tokens import pack_tokens
from ledger.cli import main as cli
from ledger.events.codec import default_codec
from ledger.log import open_log
from ledger.log.paths import store_paths
from ledger.log.sealing import KeyStore

from ..helpers import closed, opened, request, write_lines

ROOT = Path(__file__).resolve().parents[2]
MARKER = [3141592653, 2718281828, 1618033988, 1414213562]




def _state(store: Path) -> tuple[int, bytes, list]:
    """Log size, its bytes and the key store's rows: what a refused erase must leave unchanged."""
    data = (store / "events.dat").read_bytes()
    keys = []
    p = store_paths(str(store)).data_keys
    if Path(p).exists():
        import sqlite3

        con = sqlite3.connect(p)
        keys = con.execute("SELECT * FROM sqlite_master").fetchall()
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            keys += con.execute(f"SELECT * FROM {name}").fetchall()
        con.close()
    with open_log(str(store)) as log:
        return log.size(), data, keys


def _withdraw(tmp_path, subject, *extra):
    return cli(["withdraw", subject, "--reason", "data subject erasure", "--key", str(tmp_path / "gov.key"), "--erase",
                *extra])


def _all_store_bytes(store: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file())


def test_demo_path_erase_leaves_no_readable_token(store, tmp_path, capsys):
    """The review's exact case: `ledger ingest examples/demo.jsonl`, project, erase one execution."""
    assert cli(["ingest", str(ROOT / "examples" / "demo.jsonl")]) == 0
    assert cli(["project"]) == 0
    codec = default_codec()
    with open_log(str(store)) as log:
        reqs = [codec.decode(r.value) for w in log.partitions() for r in log.read(w) if r.event_type == "request"]
    assert reqs and all(ev["sealed"] is not None for ev in reqs)  # every request sealed on the plain path
    victim = reqs[0]["execution_id"]
    # the victim's tokens as the ledger itself shows them before erasure
    capsys.readouterr()
    assert cli(["tree", victim, "--json"]) == 0
    tree_doc = capsys.readouterr().out
    assert '"tokens"' in tree_doc or '"token' in tree_doc
    assert _withdraw(tmp_path, f"execution:{victim}", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["subject"] for d in out["erase"]["destroyed"]] == [f"execution:{victim}"]
    assert out["erase"]["not_destroyed"] == []
    # no request of the victim can be opened any more; the others still can
    from ledger.log.sealing import unseal

    with open_log(str(store)) as log, KeyStore(store_paths(str(store)).data_keys) as ks:
        for r in (r for w in log.partitions() for r in log.read(w) if r.event_type == "request"):
            ev = codec.decode(r.value)
            assert (unseal(ev, ks) is None) == (ev["execution_id"] == victim)
    assert cli(["audit"]) == 0


def test_unsealed_records_make_erase_refuse_and_name_them(store, tmp_path, capsys):
    lines = [{"type": "task_registered", "task_id": "t", "source": "acme"}, opened("x", "t"),
             request("x", "r1", [1, 2, 3], MARKER), request("x", "r2", [1, 2, 3] + MARKER, [7]), closed("x")]
    assert cli(["ingest", "--no-seal", write_lines(tmp_path / "d.jsonl", lines)]) == 0
    assert cli(["project"]) == 0
    before = _state(store)
    capsys.readouterr()
    assert _withdraw(tmp_path, "execution:x") == 2
    err = capsys.readouterr().err
    assert "cannot erase execution:x" in err and "2 requests are not sealed: x/r1, x/r2" in err
    assert "nothing was appended and no key was destroyed" in err and "Traceback" not in err
    assert _state(store) == before
    assert pack_tokens(MARKER) in (store / "events.dat").read_bytes()  # honest: the tokens are there, and we said so


def test_mixed_sealed_and_unsealed_refuses_only_when_covered(store, tmp_path, capsys):
    sealed = [{"type": "task_registered", "task_id": "t", "source": "acme"}, opened("s", "t"),
              request("s", "r1", [1, 2], [3]), closed("s")]
    plain = [opened("p", "t"), request("p", "r1", [1, 2], [4]), closed("p")]
    assert cli(["ingest", write_lines(tmp_path / "a.jsonl", sealed)]) == 0
    assert cli(["ingest", "--no-seal", write_lines(tmp_path / "b.jsonl", plain)]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    assert _withdraw(tmp_path, "task:t") == 2  # covers p, which is in the clear
    assert "p/r1" in capsys.readouterr().err
    assert _withdraw(tmp_path, "execution:s", "--json") == 0  # covers only sealed records
    assert [d["subject"] for d in json.loads(capsys.readouterr().out)["erase"]["destroyed"]] == ["execution:s"]


def test_task_and_source_erasure_destroy_every_covered_execution_key(store, tmp_path, capsys):
    lines = [{"type": "task_registered", "task_id": "t1", "source": "acme"},
             {"type": "task_registered", "task_id": "t2", "source": "acme"},
             {"type": "task_registered", "task_id": "t3", "source": "beta"}]
    for ex, t in (("a", "t1"), ("b", "t1"), ("c", "t2"), ("d", "t3")):
        lines += [opened(ex, t), request(ex, "r1", [1], [ord(ex)]), closed(ex)]
    assert cli(["ingest", write_lines(tmp_path / "d.jsonl", lines)]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    assert _withdraw(tmp_path, "task:t1", "--json") == 0
    assert sorted(d["subject"] for d in json.loads(capsys.readouterr().out)["erase"]["destroyed"]) == [
        "execution:a", "execution:b"]
    assert _withdraw(tmp_path, "source:acme", "--json") == 0
    assert sorted(d["subject"] for d in json.loads(capsys.readouterr().out)["erase"]["destroyed"]) == ["execution:c"]
    with KeyStore(store_paths(str(store)).data_keys) as ks:
        assert [ks.destroyed(f"execution:{e}") for e in "abcd"] == [True, True, True, False]


def test_a_key_shared_beyond_the_subject_is_refused(store, tmp_path, capsys):
    lines = [{"type": "task_registered", "task_id": "t", "source": "acme"}, opened("e1", "t"),
             request("e1", "r1", [1], [2]), opened("e2", "t"), request("e2", "r1", [1], [3])]
    assert cli(["ingest", "--per", "source", write_lines(tmp_path / "d.jsonl", lines)]) == 0
    assert cli(["project"]) == 0
    before = _state(store)
    capsys.readouterr()
    assert _withdraw(tmp_path, "execution:e1") == 2
    err = capsys.readouterr().err
    assert "sealed under the key of source:acme" in err and "erase source:acme instead" in err
    assert _state(store) == before
    assert _withdraw(tmp_path, "source:acme") == 0


def test_derived_view_with_clear_replacement_tokens_is_refused(store, tmp_path, capsys):
    lines = [{"type": "task_registered", "task_id": "t", "source": "acme"}, opened("e", "t"),
             request("e", "r1", [1, 2], [3, 4]), closed("e"),
             {"type": "record_derived", "derived_execution_id": "ev", "parent_execution_id": "e",
              "transformation": "redact@1", "replacements": {"r1": {"output_ids": [9, 9]}}}]
    assert cli(["ingest", write_lines(tmp_path / "d.jsonl", lines)]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    assert _withdraw(tmp_path, "execution:e") == 2
    assert "ev (r1)" in capsys.readouterr().err


def test_prefix_reference_into_an_erased_request_is_refused(store, tmp_path, capsys):
    from ledger.algorithms.tokens import tokens_sha256

    lines = [{"type": "task_registered", "task_id": "t", "source": "acme"}, opened("e", "t"),
             request("e", "r1", [1, 2, 3], [4])]
    assert cli(["ingest", write_lines(tmp_path / "d.jsonl", lines)]) == 0
    assert cli(["project"]) == 0
    assert _withdraw(tmp_path, "execution:e") == 0
    before = _state(store)
    capsys.readouterr()
    ref = {"type": "request", "execution_id": "e", "request_id": "r2", "output_ids": [5], "output_logprobs": [-1.0],
           "input_prefix": {"request_id": "r1", "length": 4, "sha256": tokens_sha256(pack_tokens([1, 2, 3, 4]))}}
    assert cli(["ingest", write_lines(tmp_path / "r.jsonl", [ref])]) == 2
    assert "erased" in capsys.readouterr().err
    assert _state(store)[0] == before[0]
