"""The TRL bridge (SPEC 11.5, ledger.train.trl; TRL 1.16.0): two training steps of TRL's DPO and SFT
on a tiny random Qwen2 on CPU, checking that the batch TRL trains on holds the ledger's ids and
masks; ManifestDataset's checks; the execution batch sampler."""

from __future__ import annotations

import json

import pytest

import ledger
from ledger.corpus import manifest as M

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from ledger.corpus.export import DigestMismatch, member_digest, trainer_records  # noqa: E402
from ledger.train import ExecutionBatchSampler, ManifestDataset, MemberSetError, collate_paths, token_loss  # noqa: E402
from ledger.train.data import ManifestError  # noqa: E402
from tests.test_preference import EV, fail, passed, pref, project  # noqa: E402
from tests.helpers import closed, request  # noqa: E402
from tests.test_admission import opened, scored  # noqa: E402
from tests.train_models import id_tokenizer, tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.usefixtures("earlier_release")


def _capture(trainer) -> list:
    seen = []
    orig = trainer.compute_loss

    def compute_loss(model, inputs, *args, **kw):
        seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return orig(model, inputs, *args, **kw)

    trainer.compute_loss = compute_loss
    return seen


def _pairs(tmp_path):
    lines = [opened("e1", "t1"), request("e1", "r0", [1, 2], [3]),
             request("e1", "ra", [1, 2, 3, 50, 51], [7, 8]),
             request("e1", "rb", [1, 2, 3, 50, 51], [9]),
             request("e1", "ra2", [1, 2, 3, 50, 51, 7, 8, 60], [10, 11]),
             closed("e1"), scored("e1", 1.0, "a0"),
             scored("e1", 1.0, "a1", branch_request_id="ra", criteria=passed("tests")),
             scored("e1", 0.0, "a2", branch_request_id="rb", criteria=fail("tests")), pref(j_max=4)]
    return list(trainer_records(project(tmp_path, lines), "pref", evidence=EV))


def test_trl_dpo_trains_two_steps_on_the_ledgers_ids_and_policy_masks(tmp_path):
    from trl import DPOConfig

    from ledger.train.trl import DPOTrainer, dpo_dataset

    (rec,) = _pairs(tmp_path)
    model = tiny_qwen2(64, seed=2)
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_steps=2, per_device_train_batch_size=1, max_length=None,
                     report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, learning_rate=1e-2)
    ref = tiny_qwen2(64, seed=2)  # the same random weights (a model built in memory has no hub id to reload)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=dpo_dataset([rec]),
                         processing_class=id_tokenizer(64))
    seen = _capture(trainer)
    before = model.lm_head.weight.detach().clone()
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 2
    batch = seen[0]
    prompt = rec["prompt_ids"]
    assert batch["input_ids"][0].tolist() == prompt + rec["chosen_ids"]  # [1,2,3,50,51] + [7,8,60,10,11]
    assert batch["input_ids"][1].tolist() == prompt + rec["rejected_ids"] + [0] * 4  # padded with the pad id
    # only policy outputs are scored: the tool result 60 inside the chosen continuation is not
    assert batch["completion_mask"][0].tolist() == [0] * 5 + [1, 1, 0, 1, 1]
    assert batch["completion_mask"][1].tolist() == [0] * 5 + [1] + [0] * 4
    assert not torch.equal(before, model.lm_head.weight)


def test_trl_sft_trains_two_steps_with_the_target_mask_and_1_over_L(tmp_path):
    from trl import SFTConfig

    from ledger.train.trl import WeightedSFTTrainer, sft_dataset
    from tests.test_export import build

    recs = list(trainer_records(build(tmp_path), "sft", evidence=EV))
    real = [r for r in recs if not r["dummy"]]
    ds = sft_dataset(recs)
    assert ds.info.description == "ledger: 3 path records, 1 dummy records left out"
    with pytest.raises(ValueError, match=r"max_length=6 would cut 8 of 10 targets"):
        sft_dataset(recs, max_length=6)
    model = tiny_qwen2(32, seed=3)
    tok = id_tokenizer(32)
    with pytest.raises(ValueError, match="max_length=6 would cut 8 targets"):
        WeightedSFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "x"), max_length=6, report_to=[],
                                                       use_cpu=True), train_dataset=ds, processing_class=tok)
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=3, max_length=None,
                     report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, learning_rate=1e-2,
                     shuffle_dataset=False)
    trainer = WeightedSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    seen = _capture(trainer)
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 2
    batch = seen[0]
    for row, labels, w in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), batch["loss_weight"].tolist()):
        r = next(r for r in real if row[: len(r["input_ids"])] == r["input_ids"] and not any(row[len(r["input_ids"]):]))
        n = len(r["input_ids"])
        assert labels[:n] == [t if m else -100 for t, m in zip(r["input_ids"], r["target_mask"])]
        assert w == r["loss_weight"] == 0.1
    # TRL's loss on that batch is the path records' objective, Σ 1/L_i × CE (token_loss on collate_paths)
    model.eval()
    with torch.no_grad():
        got = trainer.compute_loss(model, {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}).item()
        pb = collate_paths(real)
        want = token_loss(model(input_ids=pb["input_ids"], attention_mask=pb["attention_mask"]).logits, pb).item()
    assert got == pytest.approx(want, rel=1e-12)


def _published(tmp_path):
    from ledger.corpus import publish as Pub
    from ledger.log import open_log
    from ledger.producers.ingest import Ingestor
    from tests.helpers import signed_store
    from tests.test_admission import STAMP
    from tests.test_preference import rollout

    signer, paths, key = signed_store(tmp_path)
    gov = [{"type": "split_policy", "policy_id": "p1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
            "salt": "s"},
           {"type": "permission", "subject": "*", "use": "sft", "action": "grant", "authority": "legal"},
           {"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 2}]
    lines = [signer.sign({**g, "occurred_at": STAMP}) for g in gov]
    lines += [{"type": "task_registered", "task_id": t, "source": "pool"} for t in ("t1", "t2")]
    lines += rollout("e1", "t1", [4, 5], 1.0) + rollout("e2", "t2", [4, 6, 6], 1.0)
    with open_log(paths.url) as log:
        Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
    Pub.publish(paths, "sft", key=key, out=tmp_path / "m.json")
    from ledger.cli import main

    assert main(["--store", paths.url, "export", "sft", "--out", str(tmp_path / "x.jsonl")]) == 0
    return paths, tmp_path / "m.json", tmp_path / "x.jsonl"


def test_manifest_dataset_checks_signature_member_set_and_digests(tmp_path, capsys):
    from ledger.events.signing import Trust

    paths, manifest, export = _published(tmp_path)
    capsys.readouterr()
    ds = ManifestDataset(manifest, export, trust=paths.trust)
    assert ds.to_json() == {"route": "sft", "version": 1, "kind": "path", "records": len(ds), "dummies": 0,
                            "signature_verified": True, "member_digests_checked": True}
    recs = [json.loads(line) for line in export.read_text().splitlines()]
    assert len(recs) == 2
    with pytest.raises(MemberSetError, match="1 duplicated"):
        ManifestDataset(manifest, recs + recs[:1], trust=paths.trust)
    with pytest.raises(MemberSetError, match=r"1 missing \(first 'sft/e2/r1'\)") as missing:
        ManifestDataset(manifest, recs[:1], trust=paths.trust)
    # one hierarchy (SPEC 11.5): a member-set error is a ledger.MemberSetMismatch naming the first problem
    assert isinstance(missing.value, ledger.MemberSetMismatch) and isinstance(missing.value, ledger.ReadError)
    assert (missing.value.kind, missing.value.member_id, missing.value.missing) == ("missing", "sft/e2/r1", ["sft/e2/r1"])
    other = dict(recs[0], member_id="sft/e9/r1")
    other["digest"] = member_digest(other)
    with pytest.raises(MemberSetError, match=r"1 extra \(first 'sft/e9/r1'\)"):
        ManifestDataset(manifest, recs + [other], trust=paths.trust)
    changed = dict(recs[0], reward=0.5)
    changed["digest"] = member_digest(changed)  # self-consistent, but not what the manifest publishes
    with pytest.raises(MemberSetError, match="1 with another digest"):
        ManifestDataset(manifest, [changed, recs[1]], trust=paths.trust)
    with pytest.raises(DigestMismatch):
        ManifestDataset(manifest, [dict(recs[0], reward=0.5), recs[1]], trust=paths.trust)
    with pytest.raises(ManifestError, match="signature") as bad:
        ManifestDataset(manifest, recs, trust=Trust())
    assert isinstance(bad.value, ledger.ReadError) and isinstance(bad.value, M.ManifestError)
    assert not isinstance(bad.value, ledger.DigestMismatch)
    with pytest.warns(UserWarning, match="signature is not checked"):
        assert not ManifestDataset(manifest, recs).signature_verified


def test_manifest_dataset_checks_packed_records_against_the_manifests_member_digests(tmp_path):
    """SPEC 11.5: a semantics-3 packed export carries its members' digests, rewards and behaviour
    log-probs; ManifestDataset rebuilds each member's path record and checks it against the signed
    manifest, so a packed record changed and re-digested is refused."""
    from ledger.cli import main
    from ledger.corpus.packed import PackedDigestMismatch
    from ledger.train import collate_packed

    paths, manifest, _ = _published(tmp_path)
    packed = tmp_path / "packed.jsonl"
    assert main(["--store", paths.url, "export", "sft", "--out", str(packed), "--format", "packed"]) == 0
    assert main(["--store", paths.url, "export", "sft", "--out", str(tmp_path / "packed.parquet"),
                 "--format", "packed-parquet"]) == 0
    for f in (packed, tmp_path / "packed.parquet"):
        ds = ManifestDataset(manifest, f, trust=paths.trust)
        assert ds.to_json() == {"route": "sft", "version": 1, "kind": "packed", "records": 2, "dummies": 0,
                                "signature_verified": True, "member_digests_checked": True}
    batch = collate_packed(list(ds), mask="bool")
    assert batch["loss_rewards"].tolist() == [1.0] * batch["loss_targets"].shape[0]
    assert not batch["loss_behavior_logprobs"].isnan().any()  # every target is a recorded policy output
    recs = [json.loads(line) for line in packed.read_text().splitlines()]
    bad = json.loads(json.dumps(recs[1]))
    bad["input_ids"][-1] += 1
    bad["digest"] = member_digest(bad)  # the packed digest recomputed: only the member digests still hold
    with pytest.raises(PackedDigestMismatch, match="member sft/e2/r1's path record"):
        ManifestDataset(manifest, [recs[0], bad], trust=paths.trust)
    from ledger.corpus.packed import member_records

    (r,) = member_records(bad)
    bad["members"][0]["digest"] = member_digest(r)  # and the member's digest too: the manifest publishes another
    bad["digest"] = member_digest(bad)
    with pytest.raises(MemberSetError, match="1 with another digest .first 'sft/e2/r1'"):
        ManifestDataset(manifest, [recs[0], bad], trust=paths.trust)


def test_execution_batch_sampler_keeps_executions_whole(tmp_path):
    from tests.test_tree_pack import _synthetic_db

    recs = [r for r in trainer_records(_synthetic_db(tmp_path), "sft", evidence=EV) if not r["dummy"]]
    sizes = {}
    for r in recs:
        sizes[r["execution_id"]] = sizes.get(r["execution_id"], 0) + len(r["input_ids"])
    budget = max(sizes.values()) + 1
    batches = list(ExecutionBatchSampler(recs, budget))
    assert len(batches) == 2 and sorted(i for b in batches for i in b) == list(range(len(recs)))
    for b in batches:
        assert len({recs[i]["execution_id"] for i in b}) == 1
        # whole executions: the batch's 1/L_i weights over its targets sum to 1 per execution
        batch = collate_paths([recs[i] for i in b])
        assert batch["loss_weights"].sum().item() == pytest.approx(1.0, abs=1e-12)
    both = list(ExecutionBatchSampler(recs, 10**9))
    assert len(both) == 1
    s = ExecutionBatchSampler(recs, 1, shuffle=True, seed=0)
    first = list(s)
    s.set_epoch(1)
    assert sorted(map(tuple, first)) == sorted(map(tuple, s)) and len(first) == 2
