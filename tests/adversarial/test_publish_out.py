"""`manifest publish --out` never replaces what is not a regular file (issue 27 item 4, SPEC §11.7).

The review gave it a device node: it replaced the node with a regular file, exited 0 and wrote
``X.croissant.json`` beside it.  Now a character device or a pipe is written through (as
``export`` does; no Croissant file beside it, the archive keeps the document), anything else
that is not a regular file (a socket, a directory) is refused with exit 2 before anything is
signed, and a symbolic link is followed, never replaced.  The device is a /dev/null made with
``mknod`` inside the test folder (so a regression cannot touch the machine's own).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from ledger.cli import main as cli
from ledger.log import open_log

from .test_tracebacks import ROUTE, projected  # noqa: F401 - the fixture: a projected store, route rl-main


def _devnull(where: Path) -> Path:
    """A character device equal to /dev/null (major 1, minor 3) in ``where``; the machine's own
    /dev/null where mknod is not permitted (then, not being root, nothing could replace it)."""
    p = where / "devnull"
    try:
        os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        assert os.geteuid() != 0, "mknod refused to root: run where device nodes may be made"
        return Path("/dev/null")
    return p


def _publish(tmp_path: Path, out: Path) -> int:
    return cli(["manifest", "publish", ROUTE, "--key", str(tmp_path / "gov.key"), "--out", str(out), "--json"])


def _log_size(store: Path) -> int:
    with open_log(str(store)) as log:
        return log.size()


def _archived(store: Path) -> list[Path]:
    return sorted((store / "manifests").rglob("v*.json")) if (store / "manifests").exists() else []


def test_a_character_device_is_written_through_never_replaced(projected, tmp_path, capsys):
    dev = _devnull(tmp_path)
    before = os.stat(dev)
    assert _publish(tmp_path, dev) == 0
    after = os.stat(dev)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino
    got = json.loads(capsys.readouterr().out)
    assert got["croissant"] is None and got["version"] == 1
    assert not list(tmp_path.glob("*.croissant.json")) and not list(tmp_path.glob(".devnull*"))
    assert len(_archived(projected)) == 1  # the publication is on the log and in the archive


def test_a_pipe_is_written_through_and_its_reader_gets_the_manifest(projected, tmp_path, capsys):
    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        assert _publish(tmp_path, fifo) == 0
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    finally:
        reader.join(timeout=60)
        if reader.is_alive() and stat.S_ISFIFO(os.stat(fifo).st_mode):  # nothing wrote the pipe: let the reader go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    doc = json.loads(got[0])
    (archived,) = _archived(projected)
    assert json.loads(archived.read_text()) == doc and doc["route"] == ROUTE and len(doc["members"]) == 2
    assert not (tmp_path / "m.croissant.json").exists()
    assert json.loads(capsys.readouterr().out)["path"] == str(fifo)


def test_a_link_to_a_device_writes_through_it(projected, tmp_path):
    dev = _devnull(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(dev)
    assert _publish(tmp_path, link) == 0
    assert link.is_symlink() and stat.S_ISCHR(os.stat(dev).st_mode)
    assert not (tmp_path / "link.croissant.json").exists()


def test_a_croissant_path_that_is_a_device_is_written_through(projected, tmp_path):
    dev = _devnull(tmp_path)
    (tmp_path / "m.croissant.json").symlink_to(dev)
    assert _publish(tmp_path, tmp_path / "m.json") == 0
    assert (tmp_path / "m.json").is_file() and (tmp_path / "m.croissant.json").is_symlink()
    assert stat.S_ISCHR(os.stat(dev).st_mode)


@pytest.mark.parametrize("where", ["out", "croissant"])
def test_a_socket_is_refused_before_anything_is_signed(projected, tmp_path, capsys, where):
    path = tmp_path / ("m.json" if where == "out" else "m.croissant.json")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    try:
        size = _log_size(projected)
        capsys.readouterr()
        assert _publish(tmp_path, tmp_path / "m.json") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "is not a regular file" in err, err
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert _log_size(projected) == size and not _archived(projected)
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    finally:
        sock.close()


def test_a_link_to_a_regular_file_replaces_the_file_not_the_link(projected, tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "m.json").symlink_to(target)
    assert _publish(tmp_path, tmp_path / "m.json") == 0
    assert (tmp_path / "m.json").is_symlink() and json.loads(target.read_text())["route"] == ROUTE
    assert (tmp_path / "m.croissant.json").is_file()


def test_a_regular_file_is_still_replaced_with_its_croissant_beside_it(projected, tmp_path):
    (tmp_path / "m.json").write_text("old")
    assert _publish(tmp_path, tmp_path / "m.json") == 0
    assert json.loads((tmp_path / "m.json").read_text())["route"] == ROUTE
    assert json.loads((tmp_path / "m.croissant.json").read_text())["name"] == f"{ROUTE}-v1"
