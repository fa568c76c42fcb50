"""Small builders shared by the tests (JSON lines in the SPEC §7.1 shape)."""

from __future__ import annotations

from ledger.events.catalog import SIGNED_TYPES
from ledger.events.signing import Trust, new_private_key, public_bytes, sign_line

DEADLINE = "2030-01-01T00:00:00Z"


def opened(ex: str, task: str = "t1", **kw) -> dict:
    return {"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": DEADLINE, "policy": "qwen@1", **kw}


def request(ex: str, rid: str, inp: list[int], out: list[int], **kw) -> dict:
    line = {"type": "request", "execution_id": ex, "request_id": rid, "input_ids": inp, "output_ids": out,
            "output_logprobs": [-0.5] * len(out)}
    line.update(kw)
    return line


def closed(ex: str, status: str = "completed", versions: tuple[str, ...] = ("v1",)) -> dict:
    return {"type": "execution_closed", "execution_id": ex, "status": status, "artifact_versions": list(versions)}


def numbered(lines: list[dict]) -> list[tuple[int, dict]]:
    return list(enumerate(lines, 1))


class Signer:
    """A trusted governance key and its trust file, for tests."""

    def __init__(self, may_sign: tuple[str, ...] = SIGNED_TYPES) -> None:
        self.key = new_private_key()
        self.trust = Trust()
        self.trust.add(public_bytes(self.key), list(may_sign))

    def sign(self, line: dict) -> dict:
        return sign_line(line, self.key)


def _execution_or_gov(line: dict) -> str:
    return line.get("execution_id", "gov")


def interleave(lines: list[dict], rnd, stream=_execution_or_gov) -> list[dict]:
    """A random interleaving of ``lines`` that keeps each stream's lines in their order: by default
    each execution's events, and the remaining (governance, task) lines as one stream -- what
    partitioned delivery may produce.  ``stream(line)`` names another grouping."""
    streams: dict[str, list[dict]] = {}
    for line in lines:
        streams.setdefault(stream(line), []).append(line)
    mixed = []
    while streams:
        key = rnd.choice(sorted(streams))
        mixed.append(streams[key].pop(0))
        if not streams[key]:
            del streams[key]
    return mixed


def write_lines(path, lines) -> str:
    """Write ``lines`` as a JSON-lines file at ``path``; returns its path as a string (for the CLI)."""
    import json

    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def table_dump(db, tables: tuple[str, ...], order_by: str = "1, 2") -> str:
    """Every row of ``tables`` (in this order), each table sorted by ``order_by``: equal dumps = equal state."""
    return "\n".join(repr(r) for t in tables for r in db.execute(f"SELECT * FROM {t} ORDER BY {order_by}"))


def signed_store(root, key_name: str = "publisher.pem"):
    """A new embedded store under ``root/store`` whose trust file trusts a fresh governance key,
    that key written to ``root/key_name``: ``(signer, paths, key_path)``."""
    from ledger.events.signing import write_private_key
    from ledger.log import open_log
    from ledger.log.paths import store_paths

    signer = Signer()
    paths = store_paths(str(root / "store"))
    open_log(paths.url, create=True).close()
    signer.trust.save(paths.trust)
    key = root / key_name
    write_private_key(signer.key, key)
    return signer, paths, key


def readme_store(d) -> str:
    """The README's quickstart 2 store in ``d``: ``ledger-data`` with examples/demo.jsonl (six executions: two
    attempts of each of three tasks, every attempt in its own collection run) and the README's signed route
    ``rl-main`` ingested (not projected); ``gov.key`` beside it.  Returns the store's path."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from ledger.cli import main

    root = Path(__file__).resolve().parents[1]
    s = str(Path(d) / "ledger-data")
    route = re.search(r"cat > route.jsonl <<'JSON'\n(.*?)\nJSON\n", (root / "README.md").read_text(), re.S).group(1)
    (Path(d) / "route.jsonl").write_text(route + "\n")
    assert main(["--store", s, "init"]) == 0
    assert main(["--store", s, "keys", "new", "--out", str(Path(d) / "gov.key")]) == 0
    assert main(["--store", s, "ingest", str(root / "examples" / "demo.jsonl")]) == 0
    signed = subprocess.run([sys.executable, "-m", "ledger.cli", "--store", s, "sign", "--key", str(Path(d) / "gov.key"),
                             str(Path(d) / "route.jsonl")], capture_output=True, text=True, check=True).stdout
    (Path(d) / "route.signed.jsonl").write_text(signed)
    assert main(["--store", s, "ingest", str(Path(d) / "route.signed.jsonl")]) == 0
    return s
