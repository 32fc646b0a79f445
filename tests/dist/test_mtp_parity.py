"""Multi-token prediction at dp2 ep2, pp2 and ZeRO-3 equals one process in float64: the main
loss, the MTP loss, the grad norm and aux loss of every step, and the updated parameters (MTP
depth's MoE router bias included). Under pp the MTP depth lives on the last stage and its
embedding input comes from the first (parallel/pipeline_runner.py)."""

import pytest
import torch.distributed as dist

from configs import tiny_config
from moepar.train import Trainer
from parity_checks import assert_checkpoint_equals, assert_same_steps

STEPS = 2
COMMON = ["--train.dtype=float64", f"--train.steps={STEPS}", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--model.mtp_layers=1", "--train.mtp_coeff=0.3",
          "--router.bias_update_rate=0.001", "--router.seq_balance_coeff=0.01",
          "--run.checkpoint_every=0"]


def _numbers(records):
    return [(r["loss"], r["mtp_loss"], r["grad_norm"], r["aux_loss"]) for r in records]


def case_train(run_dir: str, overrides: list[str]):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None)
    records = trainer.run()
    dist.barrier()
    return _numbers(records)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    trainer = Trainer(tiny_config(tmp_path_factory.mktemp("single") / "ref", *COMMON),
                      log=lambda _m: None)
    return trainer, _numbers(trainer.run())


@pytest.mark.parametrize("overrides", [["--parallel.ep=2"], ["--parallel.pp=2"],
                                       ["--parallel.ep=2", "--parallel.zero=3"]],
                         ids=lambda v: " ".join(v))
def test_mtp_layout_parity(worlds, tmp_path, single, overrides):
    ref_trainer, ref_records = single
    assert ref_records[0][1] > 0            # the MTP loss is there and trained
    run_dir = str(tmp_path / "run")
    assert_same_steps(worlds(2).run(case_train, run_dir, overrides, timeout=120), ref_records)
    ref = assert_checkpoint_equals(f"{run_dir}/checkpoints/step_{STEPS}", ref_trainer)
    assert any(name.startswith("mtp.0.block.ffn.router") for name in ref)
