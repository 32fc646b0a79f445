"""What a training step spends besides forward and backward: clipping multiplies the gradients
only when their norm is over train.grad_clip (with the same result as the old clamped multiply),
and the parameters are read for NaN/Inf at step 1, every run.log_every steps and before saves,
not after every update."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from configs import tiny_config
from moepar.parallel.grads import clip_coefficient, grad_norm_groups
from moepar.train import NonFiniteError, Trainer


def quiet(_msg):
    pass


def old_coefficient(norm: float, max_norm: float, dtype) -> float:
    """The clipping factor as the device used to compute it before every multiply."""
    total = torch.tensor(norm, dtype=torch.float64)
    return float((max_norm / (total.to(dtype) + 1e-6)).clamp(max=1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_coefficient_is_the_device_one(dtype):
    rng = random.Random(0)
    for _ in range(5000):
        norm = 10 ** rng.uniform(-3, 8)
        max_norm = rng.choice([1.0, 0.3, 10 ** rng.uniform(-2, 3)])
        coef = clip_coefficient(norm, max_norm, dtype)
        assert (1.0 if coef is None else coef) == old_coefficient(norm, max_norm, dtype)
    assert clip_coefficient(float("nan"), 1.0, dtype) is None
    assert clip_coefficient(5.0, float("inf"), dtype) is None


class GradMuls(TorchDispatchMode):
    """Records the mul / _foreach_mul_ calls that write into one of `storages`."""

    def __init__(self):
        super().__init__()
        self.storages, self.calls = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mul_, torch.ops.aten._foreach_mul_):
            first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            if any(t.untyped_storage().data_ptr() in self.storages for t in first):
                self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def spy_step(trainer):
    """Runs one step; returns (gradient multiplies, gradients before clipping, after)."""
    engine, muls, seen = trainer.engine, GradMuls(), {}
    real_clip = engine.clip_gradients

    def grads():
        groups = grad_norm_groups(engine.model, engine.sync, engine.layout.dims)
        return [g for group, _ in groups for g in group]

    def clip(norm, max_norm):
        seen["before"] = [g.clone() for g in grads()]
        seen["norm"] = norm
        muls.storages = {g.untyped_storage().data_ptr() for g in grads()}
        with muls:
            out = real_clip(norm, max_norm)
        seen["after"] = [g.clone() for g in grads()]
        return out
    engine.clip_gradients = clip
    trainer.train_step()
    return muls.calls, seen


def test_a_step_within_the_limit_multiplies_no_gradient(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.grad_clip=1e6"), log=quiet)
    calls, seen = spy_step(trainer)
    assert calls == [] and seen["norm"] < 1e6
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"], strict=True))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_step_over_the_limit_clips_as_before(tmp_path, dtype):
    max_norm = 0.05
    trainer = Trainer(tiny_config(tmp_path, f"--train.grad_clip={max_norm}",
                                  f"--train.dtype={dtype}"), log=quiet)
    calls, seen = spy_step(trainer)
    assert seen["norm"] > max_norm and calls == ["aten._foreach_mul_.Scalar"]
    grad_dtype = seen["before"][0].dtype
    coef = torch.tensor(old_coefficient(seen["norm"], max_norm, grad_dtype), dtype=grad_dtype)
    for before, after in zip(seen["before"], seen["after"], strict=True):
        assert torch.equal(after, before * coef)


def count_parameter_reads(trainer) -> list[int]:
    """The steps after whose update the parameters were read (engine.parameters_norm)."""
    engine, steps = trainer.engine, []
    real = engine.parameters_norm

    def norm():
        steps.append(trainer.step)
        return real()
    engine.parameters_norm = norm
    return steps


def test_parameters_are_read_at_step_1_and_every_log_every_steps(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--run.log_every=3", "--train.steps=7"), log=quiet)
    reads = count_parameter_reads(trainer)
    for _ in range(7):
        trainer.train_step()
    assert reads == [1, 3, 6]
    every_step = Trainer(tiny_config(tmp_path / "eps0", "--run.log_every=3", "--train.eps=0"),
                         log=quiet)
    reads = count_parameter_reads(every_step)
    every_step.train_step()
    with pytest.raises(NonFiniteError, match="the update of step 1 made parameters non-finite"):
        every_step.train_step()       # eps = 0 makes NaN out of 0/0: checked at every update


def test_damage_between_checks_is_caught_at_the_next_check(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--run.log_every=3", "--train.max_skipped_steps=5"),
                      log=quiet)
    for _ in range(2):
        trainer.train_step()                               # step 2: not checked
    with torch.no_grad():
        trainer.model.layers[0].attn_norm.weight[0] = float("nan")
    assert trainer.train_step()["skipped"]                 # step 3: NaN loss; due: checked
    with pytest.raises(NonFiniteError, match=r"an update of steps 2-3 \(parameters are "
                                             r"checked every run.log_every=3 steps\) made"):
        trainer.train_step()
