"""Under bfloat16 training the model computes with bf16 weights written from the float32 masters
once per optimizer step (parallel/precision.py): no micro-batch casts a parameter, forward or
backward, whatever the layout; the optimizer step writes each mastered weight exactly once."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from configs import tiny_config
from moepar.train import Trainer


class ParameterCasts(TorchDispatchMode):
    """Counts dtype conversions whose source shares storage with one of `params`: `_to_copy` to
    another dtype, and `copy_` between dtypes (a refresh writing a compute weight)."""

    def __init__(self, params):
        super().__init__()
        self.ptrs, self.count = {p.data_ptr() for p in params}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs \
                and kwargs.get("dtype", args[0].dtype) != args[0].dtype:
            self.count += 1
        elif func is torch.ops.aten.copy_.default and args[1].data_ptr() in self.ptrs \
                and args[0].dtype != args[1].dtype:
            self.count += 1
        return func(*args, **kwargs)


def case_step(run_dir: str, *overrides: str):
    """(parameter casts in the step's micro-batches, casts in its optimizer step, the number of
    weights with a master, whether every one is bf16 with a float32 master)."""
    trainer = Trainer(tiny_config(run_dir, "--train.dtype=bfloat16", "--train.micro_batch_size=2",
                                  "--train.global_batch_size=8", *overrides), log=lambda _m: None)
    engine = trainer.engine
    pairs = engine.masters.pairs
    ok = bool(pairs) and all(p.dtype == torch.bfloat16 and m.dtype == torch.float32
                             for p, m in pairs)
    tracked = [p for p, _ in pairs] + [m for _, m in pairs]
    micro, real = ParameterCasts(tracked), engine.forward_backward

    def counted(*args):
        with micro:
            return real(*args)

    engine.forward_backward = counted
    step = ParameterCasts(tracked)
    real_step = engine.optimizer_step

    def counted_step(*args):
        with step:
            return real_step(*args)

    engine.optimizer_step = counted_step
    trainer.train_step()
    return micro.count, step.count, len(pairs), ok


def test_no_micro_batch_casts_a_parameter(worlds, tmp_path):
    for name, world, overrides in (("pp2", 2, ["--parallel.pp=2"]),
                                   ("dp2-ep2-zero1", 2, ["--parallel.ep=2", "--parallel.zero=1"])):
        results = worlds(world).run(case_step, str(tmp_path / name), *overrides, timeout=120)
        for micro, step, mastered, ok in results:
            assert ok, name
            assert micro == 0, (name, micro)
            assert step == mastered > 0, (name, step, mastered)
