"""Muon in every sharding of its matrices: float64 steps at dp2 zero1 (flat shards), tp2 (rows
and columns of matrices over tp) and dp2 ep2 zero3 (FSDP2 DTensors, experts over ep) equal the
single-process steps, and resuming a Muon run is exact. MuonClip is on throughout, with a tau
(0.05) some heads of this model pass in every step (their logits are 0.04-0.07), so its
per-head maxima, reduced over dp, and its row scaling of tp shards and FSDP2 rows are checked
too."""

import pytest
import torch.distributed as dist

from configs import tiny_config
from moepar.train import Trainer
from parity_checks import assert_checkpoint_equals, assert_same_steps

STEPS = 3
COMMON = ["--train.dtype=float64", f"--train.steps={STEPS}", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--model.num_experts=8", "--router.capacity_factor=1.0",
          "--train.optimizer=muon", "--train.qk_clip=0.05", "--run.checkpoint_every=0"]


def summary(records):
    return [(r["loss"], r["grad_norm"]) for r in records]


def case_train(run_dir: str, overrides: list[str]):
    records = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None).run()
    dist.barrier()
    return summary(records)


def case_save_then_resume(run_dir: str, overrides: list[str], first: int):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None)
    for _ in range(first):
        trainer.train_step()
    trainer.save()
    del trainer
    resumed = Trainer(tiny_config(run_dir, *COMMON, *overrides, "--run.resume=true"),
                      log=lambda _m: None)
    records = resumed.run()
    dist.barrier()
    return resumed.step, summary(records)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    trainer = Trainer(tiny_config(tmp_path_factory.mktemp("muon_single"), *COMMON),
                      log=lambda _m: None)
    return trainer, summary(trainer.run())


LAYOUTS = [
    (2, ["--parallel.ep=1", "--parallel.zero=1", "--parallel.bucket_mb=0.002"]),   # dp2 zero1
    (2, ["--parallel.tp=2", "--parallel.ep=1"]),                                    # tp2
    (2, ["--parallel.ep=2", "--parallel.zero=3"]),                                  # dp2 ep2 zero3
    (2, ["--parallel.pp=2", "--parallel.ep=1"]),     # a stage's matrices alone; one layer each
]


@pytest.mark.parametrize("size, overrides", LAYOUTS, ids=lambda v: str(v))
def test_muon_layout_parity(worlds, tmp_path, single, size, overrides):
    ref_trainer, ref_records = single
    run_dir = str(tmp_path / "run")
    results = worlds(size).run(case_train, run_dir, overrides + ["--run.checkpoint_every=3"],
                               timeout=240)
    assert len(ref_records) == STEPS
    assert_same_steps(results, ref_records)
    assert_checkpoint_equals(f"{run_dir}/checkpoints/step_{STEPS}", ref_trainer)


def test_muon_resume_is_exact(worlds, tmp_path):
    """Momentum buffers (ZeRO-1 flat shards of them here) go through the checkpoint: saving at
    step 2 and resuming gives bit for bit the steps of the run that never stopped."""
    layout = ["--parallel.ep=2", "--parallel.zero=1", "--train.steps=4"]
    straight = worlds(2).run(case_train, str(tmp_path / "straight"), layout, timeout=240)
    resumed = worlds(2).run(case_save_then_resume, str(tmp_path / "resumed"), layout, 2,
                            timeout=240)
    for (step, records), whole in zip(resumed, straight, strict=True):
        assert step == 4 and records == whole[2:], (records, whole)
