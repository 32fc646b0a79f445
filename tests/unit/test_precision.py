"""bfloat16 training with float32 masters (parallel/precision.py), on one process: the weights the
model computes with are bf16 and follow the masters once per optimizer step, gradients
accumulate over micro-batches in float32, checkpoints hold the masters, and the residual stream
is bf16 unless train.fp32_residual keeps it float32."""

import pytest
import torch
from torch import nn

from configs import tiny_config
from moepar.checkpoint import load_checkpoint
from moepar.layers.router import TopKRouter
from moepar.metrics import StepStats
from moepar.parallel.precision import Masters
from moepar.train import Trainer


def quiet(_msg):
    pass


def bf16_trainer(tmp_path, *extra):
    return Trainer(tiny_config(tmp_path, "--train.dtype=bfloat16", "--train.micro_batch_size=2",
                               "--train.global_batch_size=4", *extra), log=quiet)


def test_compute_weights_are_bf16_copies_of_float32_masters(tmp_path):
    trainer = bf16_trainer(tmp_path)
    engine = trainer.engine
    routers = {id(p) for m in trainer.model.modules() if isinstance(m, TopKRouter)
               for p in m.parameters()}
    assert routers
    for p in trainer.model.parameters():
        master = engine.masters.master(p)
        if id(p) in routers:        # routing maths is float32: no copy
            assert master is p and p.dtype == torch.float32
        else:
            assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
            assert torch.equal(p, master.to(torch.bfloat16))
    for _ in range(2):
        trainer.train_step()
        for p, master in engine.masters.pairs:     # written from the updated masters
            assert torch.equal(p, master.detach().to(torch.bfloat16))


def test_gradients_accumulate_in_float32_over_micro_batches(tmp_path):
    """The main gradient of two micro-batches is the float32 sum of their bf16 gradients."""
    trainer = bf16_trainer(tmp_path)
    engine = trainer.engine
    x, y = trainer.sampler.batch(0)
    singles = []
    for _ in range(2):
        engine.zero_grad()
        engine.micro_batch(x, y, StepStats(len(engine.moe_layer_ids), 4))
        singles.append({id(m): m.grad.clone() for _, m in engine.masters.pairs})
    engine.zero_grad()
    engine.micro_batch(x, y, StepStats(len(engine.moe_layer_ids), 4), last=False)
    engine.micro_batch(x, y, StepStats(len(engine.moe_layer_ids), 4))
    for p, m in engine.masters.pairs:
        assert m.grad.dtype == torch.float32 and p.grad is None
        torch.testing.assert_close(m.grad, singles[0][id(m)] + singles[1][id(m)], rtol=0, atol=0)


@pytest.mark.parametrize("fp32_residual, want", [(False, torch.bfloat16), (True, torch.float32)])
def test_the_residual_stream_dtype(tmp_path, fp32_residual, want):
    trainer = bf16_trainer(tmp_path, f"--train.fp32_residual={str(fp32_residual).lower()}")
    seen = []
    trainer.model.layers[1].register_forward_hook(lambda m, args, out: seen.append(out[0].dtype))
    trainer.train_step()
    assert seen == [want, want]


def test_checkpoints_hold_the_masters_and_resume_bit_exactly(tmp_path):
    trainer = bf16_trainer(tmp_path / "a", "--train.steps=3", "--run.checkpoint_every=2")
    trainer.last_record = trainer.run()[-1]
    masters = {n: trainer.engine.masters.master(p).detach().clone()
               for n, p in trainer.model.named_parameters()}
    fresh = bf16_trainer(tmp_path / "b", "--train.steps=3")
    load_checkpoint(str(tmp_path / "a" / "checkpoints" / "step_3"), fresh.engine)
    for name, p in fresh.model.named_parameters():
        master = fresh.engine.masters.master(p)
        assert torch.equal(master, masters[name]), name                 # float32, exactly
        assert torch.equal(p, master.to(p.dtype)), name                 # compute weights follow
    step2 = str(tmp_path / "a" / "checkpoints" / "step_2")
    resumed = bf16_trainer(tmp_path / "d", "--train.steps=3", f"--run.resume_from={step2}")
    assert resumed.step == 2
    assert resumed.train_step()["loss"] == trainer.last_record["loss"]


def test_masters_without_a_compute_dtype_are_the_parameters():
    model = nn.Linear(3, 4)
    masters = Masters(model)
    assert masters.pairs == [] and masters.master(model.weight) is model.weight
