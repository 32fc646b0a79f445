"""Under bfloat16 autocast a pipeline rank that keeps several micro-batches in flight casts each
weight once per step, shared by all of them (ParallelModel.step_scope), where each micro-batch
used to cast and keep its own copy; a rank with one in flight keeps casting per micro-batch
(its copies go as backward passes them). The numbers are the same bit for bit."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from configs import tiny_config
from moepar.train import Trainer


class WeightCasts(TorchDispatchMode):
    """Counts casts of the given parameters to bfloat16, by storage."""

    def __init__(self, params):
        super().__init__()
        self.ptrs, self.count = {p.data_ptr() for p in params}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16 \
                and args[0].dtype == torch.float32 and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **kwargs)


def case_step(run_dir: str, micro: int, per_micro: bool):
    """One bf16 1F1B step over pp 2 (rank 0 keeps 2 micro-batches in flight, rank 1 one):
    (weight casts on this rank, whether it shares them, its parameters after the step)."""
    trainer = Trainer(tiny_config(run_dir, "--train.dtype=bfloat16", "--parallel.pp=2",
                                  "--train.micro_batch_size=2",
                                  f"--train.global_batch_size={2 * micro}"), log=lambda _m: None)
    runner = trainer.engine.runner
    shared = runner.step_scope is not contextlib.nullcontext
    if per_micro:      # what every rank did before: casts live for one micro-batch's forward
        runner.step_scope = runner.backward_scope = contextlib.nullcontext
        for m in trainer.model.modules():
            if hasattr(m, "casts"):
                m.casts = None
    counter = WeightCasts([p for p in trainer.model.parameters() if p.dim() >= 2])
    with counter:
        trainer.train_step()
    assert len(trainer.engine.casts) == 0          # dropped when the step ends
    return counter.count, shared, [p.detach().clone() for p in trainer.model.parameters()]


def test_a_rank_with_micro_batches_in_flight_casts_each_weight_once_per_step(worlds, tmp_path):
    one = worlds(2).run(case_step, str(tmp_path / "one"), 1, False, timeout=120)
    four = worlds(2).run(case_step, str(tmp_path / "four"), 4, False, timeout=120)
    before = worlds(2).run(case_step, str(tmp_path / "before"), 4, True, timeout=120)
    (casts0, shared0, after0), (casts1, shared1, after1) = four
    assert shared0 and not shared1
    assert casts0 == one[0][0] > 0 and before[0][0] == 4 * casts0    # rank 0: once, was 4x
    assert casts1 == before[1][0] == 4 * one[1][0] > 0               # rank 1: per micro-batch
    for got, want in ((after0, before[0][2]), (after1, before[1][2])):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
