"""Shared fixtures of the adversarial suite."""

from __future__ import annotations

import pytest

from ledger.cli import main as cli


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An initialised store with a governance key (``tmp_path/gov.key``); LEDGER_STORE points at
    it and the working directory is ``tmp_path``."""
    s = tmp_path / "store"
    monkeypatch.setenv("LEDGER_STORE", str(s))
    monkeypatch.chdir(tmp_path)
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", str(tmp_path / "gov.key")]) == 0
    return s
