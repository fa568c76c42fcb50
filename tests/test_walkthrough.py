"""docs/admission.md section 10 runs as written: one log, an SFT, an RL and a preference route
(SPEC §6.8, §6.9), and the outputs the page shows are the outputs the commands print."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "admission.md"


def _section_blocks(title_prefix: str) -> list[tuple[str, str]]:
    text = DOC.read_text()
    start = text.index("\n## " + title_prefix)
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_three_routes_walkthrough_prints_what_the_page_shows(tmp_path: Path) -> None:
    blocks = _section_blocks("10. One log, three consumers")
    kinds = [k for k, _ in blocks]
    assert kinds == ["sh", "text", "sh", "text"], kinds
    (tmp_path / "examples").mkdir()
    for name in ("walkthrough-events.jsonl", "walkthrough-gov.jsonl"):
        shutil.copy(ROOT / "examples" / name, tmp_path / "examples" / name)
    marker = "=== next block ==="
    script = "set -euo pipefail\n" + blocks[0][1] + f"\necho '{marker}'\n" + blocks[2][1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = proc.stdout.split(marker + "\n")
    assert first.endswith(blocks[1][1]), first[-3000:]
    assert second == blocks[3][1], second
    # the three corpora really are on disk, one record per member
    assert sum(1 for _ in open(tmp_path / "repair-sft.jsonl")) == 2
    assert sum(1 for _ in open(tmp_path / "repair-rl.jsonl")) == 5
    assert sum(1 for _ in open(tmp_path / "repair-dpo.jsonl")) == 2
