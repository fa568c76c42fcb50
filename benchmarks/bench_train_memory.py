"""Peak memory of the training loss on the README corpus's shapes: ``loss_at_targets`` vs full logits (SPEC 12.4).

The README's quickstart corpus (``examples/demo.jsonl`` under the README's route ``rl-main``) is built in a
temporary store and exported; its path records are ~5k tokens of the Qwen3.6 vocabulary (248,070 ids).
Each measurement runs in a fresh process (``python -m benchmarks.bench_train_memory child ...``): random
float32 hidden states ``[B, T, 64]`` and LM head ``[248,070, 64]`` (a tiny trunk: only the head and the
loss are compared), one forward and backward of the loss over the batch's real targets, then the peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``; ``VmHWM`` beside it, which excludes what the parent's
address space carried over the exec).

* ``loss_at_targets`` runs on the full shapes: the longest path record, and the largest execution as
  ``ExecutionBatchSampler`` batches it (all its paths, padded).
* The full-logits loss (``token_loss(hidden @ W.T, batch)``, what a Hugging Face model's ``.logits`` give)
  would need ``B × T × V × 4`` bytes for the logits alone (5.4 GB for the longest 5.8k path, 21.6 GB
  for the execution): it is **not** run there.  Its full-shape figure is computed: the inputs' RSS plus
  that logits tensor (a lower bound: the figure in the table and its ratio).  It *is* run on the
  ``NAIVE_TOKENS``-token prefix of the path with the most targets there (both losses measured); its peak
  above the pre-loss RSS divided by that prefix's logits bytes is the multiple ``k`` it needed, and
  ``k × B × T × V × 4`` is printed as an extrapolation (approximate: freshly zeroed gradient pages that
  are only read never become resident, so ``k`` depends on the target density).
"""

from __future__ import annotations

import importlib.util
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import print_table, row

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 248_070  # the Qwen3.6 tokenizer's vocabulary (the gateway's qwen3.6-27b; ids up to 248,069 in the corpus)
HIDDEN = 64
NAIVE_TOKENS = 1536
TARGET_MB = 2048  # SPEC 12.4 brief: loss_at_targets peak < 2 GB on these shapes


def _ledger(store: Path, cwd: Path, *args: str, stdout=None) -> None:
    subprocess.run([sys.executable, "-m", "ledger.cli", "--store", str(store), *args], cwd=cwd, check=True,
                   stdout=stdout or subprocess.DEVNULL, stderr=subprocess.PIPE)


def readme_corpus(d: Path) -> Path:
    """The README's quickstart 2 in ``d``: ingest examples/demo.jsonl, sign and ingest the README's route,
    project, export ``rl-main`` (path records, JSON lines); returns the export's path."""
    store = d / "ledger-data"
    route = re.search(r"cat > route.jsonl <<'JSON'\n(.*?)\nJSON\n", (ROOT / "README.md").read_text(), re.S).group(1)
    (d / "route.jsonl").write_text(route + "\n")
    _ledger(store, d, "init")
    _ledger(store, d, "keys", "new", "--out", "gov.key")
    _ledger(store, d, "ingest", str(ROOT / "examples" / "demo.jsonl"))
    with open(d / "route.signed.jsonl", "w") as fh:
        _ledger(store, d, "sign", "--key", "gov.key", "route.jsonl", stdout=fh)
    _ledger(store, d, "ingest", "route.signed.jsonl")
    _ledger(store, d, "project")
    _ledger(store, d, "export", "rl-main", "--out", "rl-main.jsonl")
    return d / "rl-main.jsonl"


def _rss_kb() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() // 1024


def child(mode: str, records_file: str, members: str, limit: str) -> None:
    """One measurement (run in a fresh process): prints a JSON line."""
    import torch

    from ledger.train import collate_paths, loss_at_targets, token_loss

    wanted = members.split(",")
    recs = [json.loads(line) for line in open(records_file)]
    recs = [r for r in recs if r["member_id"] in wanted]
    if int(limit):
        recs = [dict(r, input_ids=r["input_ids"][:int(limit)], target_mask=r["target_mask"][:int(limit)],
                     behavior_logprobs=r["behavior_logprobs"][:int(limit)]) for r in recs]
    batch = collate_paths(recs, dtype=torch.float32)
    b, t = batch["input_ids"].shape
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, HIDDEN, generator=gen).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN ** 0.5).requires_grad_()
    before = _rss_kb()
    t0 = time.perf_counter()
    if mode == "naive":
        loss = token_loss(hidden @ weight.T, batch)
    else:
        loss = loss_at_targets(hidden, weight, batch)
    loss.backward()
    seconds = time.perf_counter() - t0
    hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
    print(json.dumps({"mode": mode, "member": wanted[0], "B": b, "T": t, "targets": int(batch["loss_targets"].shape[0]), "loss": loss.item(),
                      "rss_before_kb": before, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "vmhwm_kb": hwm, "seconds": seconds}))


def _measure(mode: str, records: Path, members: list[str], limit: int = 0) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_train_memory", "child", mode, str(records),
                           ",".join(members), str(limit)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} measurement failed: {proc.stderr[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shapes(records: Path) -> dict[str, list[str]]:
    recs = [json.loads(line) for line in open(records)]
    longest = max(recs, key=lambda r: len(r["input_ids"]))
    by_ex: dict[str, list[dict]] = {}
    for r in recs:
        by_ex.setdefault(r["execution_id"], []).append(r)
    biggest = max(by_ex.values(), key=lambda rs: len(rs) * max(len(r["input_ids"]) for r in rs))
    dense = max(recs, key=lambda r: sum(r["target_mask"][:NAIVE_TOKENS]))
    return {"prefix": [dense["member_id"]], "longest path": [longest["member_id"]],
            "largest execution": [r["member_id"] for r in biggest]}


def _mb(kb: float) -> float:
    return kb / 1024


def run() -> list[dict]:
    if importlib.util.find_spec("torch") is None:
        print("(skipping bench_train_memory: torch is not installed; it is in the [train] extra)", file=sys.stderr)
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        records = readme_corpus(Path(tmp))
        shapes = _shapes(records)
        small = _measure("naive", records, shapes.pop("prefix"), NAIVE_TOKENS)
        ours_small = _measure("ours", records, [small["member"]], NAIVE_TOKENS)
        k = (small["maxrss_kb"] - small["rss_before_kb"]) * 1024 / (small["B"] * small["T"] * VOCAB * 4)
        print(f"both run on a {small['T']}-token prefix ({small['targets']} targets): full logits peak "
              f"{_mb(small['maxrss_kb']):.0f} MB ({k:.2f} x its logits tensor above the inputs), loss_at_targets "
              f"{_mb(ours_small['maxrss_kb']):.0f} MB", file=sys.stderr)
        rows.append(row(f"train loss peak RSS, {small['T']}-token prefix: full logits vs loss_at_targets",
                        _mb(small["maxrss_kb"]), _mb(ours_small["maxrss_kb"]), "MB (both measured)"))
        for name, members in shapes.items():
            ours = _measure("ours", records, members)
            logits = ours["B"] * ours["T"] * VOCAB * 4
            naive_mb = _mb(ours["rss_before_kb"]) + logits / 2**20  # computed, never allocated
            peak = _mb(ours["maxrss_kb"])
            print(f"{name}: B={ours['B']} T={ours['T']} targets={ours['targets']}: loss_at_targets peak {peak:.0f} MB "
                  f"(VmHWM {_mb(ours['vmhwm_kb']):.0f} MB, {_mb(ours['maxrss_kb'] - ours['rss_before_kb']):.0f} MB above "
                  f"the inputs, {ours['seconds']:.1f} s); full logits NOT run: the logits alone are {logits / 2**30:.1f} GB "
                  f"(>= {naive_mb / 1024:.1f} GB with the inputs, {naive_mb / peak:.0f}x; ~{(naive_mb + (k - 1) * logits / 2**20) / 1024:.1f} GB "
                  f"extrapolated with k); target < {TARGET_MB} MB: " + ("met" if peak < TARGET_MB else "MISSED"), file=sys.stderr)
            rows.append(row(f"train loss peak RSS, {name} (B={ours['B']}, T={ours['T']}): full logits (computed) "
                            "vs loss_at_targets", naive_mb, peak, f"MB (loss_at_targets < {TARGET_MB} MB)"))
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(*sys.argv[2:])
    else:
        print_table(run())
