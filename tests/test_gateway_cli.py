"""`ledger gateway` arguments: bad input is one line and exit 2; `ledger status --json` without
a gateway has no gateway section."""

from __future__ import annotations

import json

import pytest

from ledger.cli import main
from tests.gateway_helpers import init_store


@pytest.mark.parametrize("argv,message", [
    (["--api", "openai", "--tokenizer", "qwen3.6-27b"], "--api must be one of vllm, sglang, llamacpp"),
    (["--api", "vllm", "--tokenizer", "qwen3.6-27b", "--listen", "nowhere"], "--listen must be HOST:PORT"),
    (["--api", "vllm", "--tokenizer", "no-such-tokenizer"], "cannot load tokenizer 'no-such-tokenizer'"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    store = init_store(tmp_path / "s")
    capsys.readouterr()
    assert main(["--store", str(store), "gateway", "--upstream", "http://127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_bad_upstream_and_missing_store(tmp_path, capsys):
    assert main(["--store", str(tmp_path / "none"), "gateway", "--upstream", "http://127.0.0.1:1", "--api", "vllm",
                 "--tokenizer", "qwen3.6-27b"]) == 2
    assert "no store at" in capsys.readouterr().err
    assert main(["--store", str(tmp_path), "gateway", "--upstream", "ftp://x", "--api", "vllm",
                 "--tokenizer", "qwen3.6-27b"]) == 2
    assert "--upstream must be an http://" in capsys.readouterr().err


def test_status_without_gateway(tmp_path, capsys):
    store = init_store(tmp_path / "s")
    capsys.readouterr()
    assert main(["--store", str(store), "status", "--json"]) == 0
    assert "gateway" not in json.loads(capsys.readouterr().out)
