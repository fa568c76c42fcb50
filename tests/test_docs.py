"""The README's examples and the docs' quickstarts run, and every relative link in README.md and docs/ resolves.

As sqlite-utils and Datasette test their documentation: the fenced ``sh`` and ``python`` blocks of
README.md are extracted and executed in order, in one temporary directory (the quickstarts share
one store), with the virtualenv's ``ledger`` on PATH and the checkout's ``examples/`` beside them.
So are the blocks of every quickstart section of a page in docs/ (a heading naming a quickstart,
quick tour, walkthrough or "try it", down to the next heading of its level), one directory per page;
an ``export NAME=VALUE`` of a shell block holds for the page's later blocks, as in one terminal.
A block preceded by ``<!-- docs-test: skip REASON -->`` is not run (the reason is required).
A shell block that starts servers in the background (``&``) is followed by a wait until the
ports it names accept connections; the fixed ports of the text (8000, 8090) are replaced by free
ones so that parallel runs do not collide, and every process a block started is stopped at the end.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- docs-test: skip (\S.*?) -->")
PORTS = ("8000", "8090")


def blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, skip reason or None) of every fenced sh/python block, in order."""
    out, last = [], 0
    for m in FENCE.finditer(text):
        lang = {"bash": "sh", "py": "python"}.get(m.group(1), m.group(1))
        reason = SKIP.search(text[last:m.start()])
        last = m.end()
        if lang in ("sh", "python"):
            out.append((lang, m.group(2), reason.group(1) if reason else None))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port} after {timeout:.0f} s")


class Session:
    """Runs blocks one after another in ``cwd``; remembers the process groups it started."""

    def __init__(self, cwd: Path, timeout: float = 120) -> None:
        self.cwd, self.groups, self.n, self.timeout = cwd, [], 0, timeout
        self.ports = {p: str(_free_port()) for p in PORTS}
        bin_dir = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items() if k != "LEDGER_STORE"}
        self.env.update(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=str(ROOT),
                        PYTHONUNBUFFERED="1", NO_COLOR="1")

    def run(self, lang: str, code: str) -> str:
        for name, value in re.findall(r"^export (\w+)=(\S+)$", code, re.M):  # what the reader's shell keeps
            self.env[name] = value.replace("$PWD", str(self.cwd))
        for fixed, free in self.ports.items():
            code = code.replace(f":{fixed}", f":{free}").replace(f"port={fixed}", f"port={free}")
        self.n += 1
        out = self.cwd / f"block-{self.n}.out"
        argv = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
        with open(out, "w") as fh:
            proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.groups.append(proc.pid)
            rc = proc.wait(timeout=self.timeout)
        text = out.read_text()
        assert rc == 0, f"block {self.n} exited {rc}:\n{code}\n--- output ---\n{text}"
        if lang == "sh" and re.search(r"&\s*$", code, re.M):
            for port in re.findall(r"127\.0\.0\.1:(\d+)", code):
                _wait_for(int(port))
        return text

    def close(self) -> None:
        for pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def run_blocks(todo: list[tuple[str, str, str | None]], cwd: Path) -> dict[str, str]:
    """Run the blocks not skipped, in order, in ``cwd`` (``examples/`` beside them): code -> output."""
    assert all(reason is None or reason.strip() for _, _, reason in todo)
    (cwd / "examples").symlink_to(ROOT / "examples")
    session = Session(cwd)
    outputs = {}
    try:
        for lang, code, reason in todo:
            if reason is None:
                outputs[code] = session.run(lang, code)
    finally:
        session.close()
    return outputs


def test_readme_blocks_run(tmp_path):
    outputs = run_blocks(blocks((ROOT / "README.md").read_text()), tmp_path)
    ran = [c for c in outputs]
    assert len(ran) >= 7, "the quickstarts' blocks"
    by_text = {next(c for c in ran if needle in c): expect for needle, expect in (
        ("X-Ledger-Execution-Id", "extends"),                    # the gateway restored the first call's tokens
        ("ledger tree exec-1", "exec-1"),
        ("read_records", "records;"),
        ("ledger.Feed", "'trained'"),
        ("ledger impact", "internal-bugbash"),
    )}
    for code, expect in by_text.items():
        assert expect in outputs[code], f"{expect!r} not in the output of:\n{code}\n---\n{outputs[code]}"


QUICKSTART = re.compile(r"quick ?start|quick tour|walkthrough|try it", re.I)


def quickstarts(text: str) -> str:
    """The text of a page's quickstart sections (headings inside fenced blocks are code, not headings)."""
    sections: list[tuple[int, str, list[str]]] = [(0, "", [])]
    fenced = False
    for line in text.splitlines(keepends=True):
        fenced = fenced != line.startswith("```")
        m = None if fenced else re.match(r"(#+) (.+)", line)
        if m:
            sections.append((len(m.group(1)), m.group(2), [line]))
        else:
            sections[-1][2].append(line)
    out, level = [], None
    for depth, heading, lines in sections:
        if level is not None and depth <= level:
            level = None
        if level is None and depth and QUICKSTART.search(heading):
            level = depth
        if level is not None:
            out += lines
    return "".join(out)


def _quickstart_pages() -> list[Path]:
    return [p for p in sorted((ROOT / "docs").glob("*.md")) if blocks(quickstarts(p.read_text()))]


def test_the_docs_quickstarts_are_found():
    assert {p.name for p in _quickstart_pages()} >= {"ingest.md", "governance.md", "economics.md", "serve.md"}


@pytest.mark.parametrize("page", _quickstart_pages(), ids=lambda p: p.name)
def test_docs_quickstart_blocks_run(page, tmp_path):
    todo = blocks(quickstarts(page.read_text()))
    outputs = run_blocks(todo, tmp_path)
    assert outputs and len(outputs) == sum(reason is None for _, _, reason in todo)
    expect = {"ingest.md": "appended 0, duplicate", "governance.md": "ERASED", "economics.md": "pool staging: 12 of 12 credits held",
              "serve.md": '"stored_tokens": '}.get(page.name, "")
    assert expect in "".join(outputs.values()), f"{expect!r} not in the output of {page.name}'s quickstart"


def test_readme_is_a_doorway():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert text.split("```")[1].strip().splitlines()[1:] == [
        "make demo    # builds .venv, installs, runs a realistic end-to-end flow on the embedded log",
        "make test    # builds .venv with test extras and runs the whole suite (real Kafka-protocol broker included)"]
    assert "(docs/dependencies.md)" in text  # "Dependencies and why" stays one click away


# ------------------------------------------------------------------ links
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# ------------------------------------------------------------------ docs/train.md
TRAIN_PRELUDE = """\
from transformers import AutoModelForCausalLM, AutoTokenizer
model, tokenizer = AutoModelForCausalLM.from_pretrained("tiny-model"), AutoTokenizer.from_pretrained("tiny-model")
"""


TRAIN_VOCAB = {"small": 64, "readme": 248_070}  # the README corpus: the Qwen3.6 tokenizer's ids


def _train_store(cwd: Path, corpus: str) -> str:
    """What docs/train.md starts from: a tiny random Qwen2 + an id tokenizer saved in ``tiny-model`` (the reader's
    ``model`` and ``tokenizer``) and the events of the README's route ``rl-main``; returns the file to ingest.
    ``small``: a small store over ids < 64 (three path records).  ``readme``: the README's own corpus
    (``examples/demo.jsonl``: six executions, 24 paths of 1.5k-5.8k tokens of the 248,070-id vocabulary); the
    loops' ``loss_at_targets`` never makes their [B, T, V] logits (21.6 GB in float32 for one execution)."""
    import json

    from tests.helpers import closed, request
    from tests.test_admission import STAMP, opened, scored
    from tests.train_models import id_tokenizer, tiny_qwen2

    readme = (ROOT / "README.md").read_text()
    route = re.search(r"cat > route.jsonl <<'JSON'\n(.*?)\nJSON\n", readme, re.S).group(1)
    (cwd / "route.jsonl").write_text(route + "\n")
    vocab = TRAIN_VOCAB[corpus]
    tiny_qwen2(vocab, seed=0, max_positions=8192).to(dtype=__import__("torch").float32).save_pretrained(cwd / "tiny-model")
    id_tokenizer(vocab).save_pretrained(cwd / "tiny-model")
    if corpus == "readme":
        return "examples/demo.jsonl"
    events = [{"type": "task_registered", "task_id": t, "source": "internal-bugbash"} for t in ("t1", "t2")]
    events += [opened("e1", "t1"), request("e1", "r0", [1, 2], [3]), request("e1", "ra", [1, 2, 3, 50, 51], [7, 8]),
               request("e1", "rb", [1, 2, 3, 50, 51], [9]), closed("e1"), scored("e1", 1.0),
               opened("e2", "t2"), request("e2", "r0", [1, 4], [5, 6]), closed("e2"), scored("e2", 0.5)]
    (cwd / "events.jsonl").write_text("".join(json.dumps({**e, "occurred_at": STAMP}) + "\n" for e in events))
    return "events.jsonl"


@pytest.mark.parametrize("corpus", ["small", pytest.param("readme", marks=pytest.mark.slow)])
def test_train_doc_blocks_run(tmp_path, corpus):
    """docs/train.md's shell and Python blocks (and so its "Train on a corpus" examples: a bare PyTorch loop,
    packed records, TRL DPO and SFT) run as written, in order, after the README's route is published: on a
    64-id corpus (~50 s), and with ``--run-slow`` on the README's corpus itself and a model over its whole
    248,070-id vocabulary (190-280 s on 2 cores: the loss at ~8,700 targets × 248,070 ids, several passes)."""
    pytest.importorskip("trl")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    events = _train_store(tmp_path, corpus)
    admission = (ROOT / "docs" / "admission.md").read_text()
    pref = next(code for lang, code, _ in blocks(admission) if "ledger export repair_dpo" in code)
    setup = (f"ledger init && ledger keys new --out gov.key && ledger ingest {events}\n"
             "ledger sign --key gov.key route.jsonl > route.signed.jsonl && ledger ingest route.signed.jsonl\n"
             "ledger project && ledger manifest publish rl-main --key gov.key --out rl-main.v1.json\n")
    todo = blocks((ROOT / "docs" / "train.md").read_text())
    assert all(reason is None or reason.strip() for _, _, reason in todo)
    session = Session(tmp_path, timeout=120 if corpus == "small" else 900)
    outputs = []
    try:
        session.run("sh", setup)
        session.run("sh", pref)
        session.run("sh", "ledger export rl-main --out rl-main.jsonl")  # as the README's quickstart
        # small: e1's two branches and e2 (not vacuous); readme: six executions, four paths each
        assert len((tmp_path / "rl-main.jsonl").read_text().splitlines()) == {"small": 3, "readme": 24}[corpus]
        for lang, code, reason in todo:
            if reason is None:
                outputs.append(session.run(lang, TRAIN_PRELUDE + code if "model" in code and lang == "python" else code))
    finally:
        session.close()
    assert len(outputs) == 7, "the export, packed, Features, PyTorch, packed-attention, DPO and SFT blocks"
    first = {"small": "e1 ", "readme": "exec-7-0000 "}[corpus]
    assert first in next(o for o in outputs if "tokens" in o and "targets" in o)  # the packed reader's lines
