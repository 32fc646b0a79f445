"""The overlapped reducer: buckets launch during the last backward, never on earlier micro-batches,
in the same order on every rank, and give the same gradients as one step-end all-reduce."""

import torch
import torch.distributed as dist

from configs import tiny_config
from moepar.metrics import StepStats
from moepar.parallel.grads import reduce_gradients
from moepar.train import Trainer


def case_overlap_and_accumulation(run_dir: str):
    cfg = tiny_config(run_dir, "--train.dtype=float64", "--parallel.ep=2", "--parallel.bucket_mb=0.0005",
                      "--train.global_batch_size=8", "--train.micro_batch_size=2")
    trainer = Trainer(cfg, log=lambda _m: None)
    reducer = trainer.sync
    assert trainer.num_local_micro == 2 and len(reducer.buckets) > 4
    calls = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    stats = StepStats(len(trainer.model.moe_layers()), 4)
    dist.all_reduce = spy
    try:
        trainer._micro_batch(*trainer.sampler.batch(trainer.first_micro), stats, last=False)
        assert calls == [], "an accumulation micro-batch must not reduce"
        reducer.after_backward = lambda last, final=None: None   # look before finish() writes back
        trainer._micro_batch(*trainer.sampler.batch(trainer.first_micro + 1), stats, last=True)
        launched_in_backward = reducer.next_launch
    finally:
        dist.all_reduce = real
    assert 0 < launched_in_backward <= len(reducer.buckets)
    reducer.finish()
    overlapped = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    # Reference: the same two micro-batches with no reduction at all, then the plain step-end
    # all-reduce (the gradient buffers are reduced in place, so the local sums are taken anew).
    ref = Trainer(cfg, log=lambda _m: None)
    for i in range(2):
        ref._micro_batch(*ref.sampler.batch(ref.first_micro + i), stats, last=False)
    reduce_gradients(ref.model, ref.meshes, ref.dims)
    for n, p in ref.model.named_parameters():
        torch.testing.assert_close(overlapped[n], p.grad, rtol=1e-12, atol=1e-15, msg=n)
    return launched_in_backward, len(reducer.buckets)


def test_overlap_and_accumulation(worlds, tmp_path):
    results = worlds(2).run(case_overlap_and_accumulation, str(tmp_path / "run"), timeout=120)
    assert results[0] == results[1]          # same launch count: same order on every rank
