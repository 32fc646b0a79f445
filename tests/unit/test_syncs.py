"""Host-sync budget of one MoE layer, counted on CPU by what each op would cost on CUDA
(tests/synccount.py): 0 in backward always; in forward 0 when no copy can be dropped (dropless
top-k, expert choice) and the native grouped GEMM runs (the offsets stay on the device), else 1
(the split sizes: rows kept under capacity, or the host list the padded float64 GEMM needs).

The expert-parallel dispatchers have the same budget in tests/dist/test_ep.py; the GPU check of
it is tests/cuda/test_cuda_syncs.py.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moepar.layers import MoE
from moepar.layers.router import expert_counts
from synccount import SyncCounter

DIM, FFN, E, K, T = 16, 8, 4, 2, 24


def test_counter_counts_each_kind_of_sync():
    """The counter itself: every kind it claims to see is seen, with its cost."""
    ids = torch.tensor([0, 2, 2, 1])
    cases = [(lambda: ids.tolist(), 1), (lambda: ids[0].item(), 1), (lambda: bool(ids[1]), 1),
             (lambda: torch.bincount(ids), 2), (lambda: ids[ids > 0], 1),
             (lambda: torch.tensor([1, 2]), 1), (lambda: ids.nonzero(), 1),
             (lambda: torch.repeat_interleave(ids, ids), 1),
             (lambda: torch.repeat_interleave(ids, ids, output_size=5), 0),
             (lambda: expert_counts(ids, 3), 0), (lambda: torch.sort(ids, stable=True), 0)]
    got = []
    for fn, _ in cases:
        with SyncCounter() as counter:
            fn()
        got.append(counter.count)
    assert got == [n for _, n in cases]


def count_forward_backward(moe, x):
    """(forward syncs, backward syncs, reports) of one call after a warm-up call (which fills
    the grouped-GEMM probe cache, a one-time cost)."""
    moe(x).y.sum().backward()
    with SyncCounter() as fwd:
        out = moe(x)
        loss = (out.y * out.y).sum() + out.aux_loss.total
    with SyncCounter() as bwd:
        loss.backward()
    return fwd, bwd


ROUTERS = {
    "dropless": dict(),
    "capacity_probs": dict(capacity_factor=1.0, drop_policy="probs"),
    "capacity_position": dict(capacity_factor=0.5, drop_policy="position"),
    "expert_choice": dict(type="expert_choice", capacity_factor=1.0),
    "sigmoid_groups_seq_balance": dict(score_func="sigmoid", n_group=2, topk_group=1,
                                       seq_balance_coeff=0.1, z_coeff=0.01, norm_topk_prob=True),
}


# Routings that never drop a copy: the kept rows are all N, known on the host without a read.
DROPLESS = {"dropless", "expert_choice", "sigmoid_groups_seq_balance"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", ROUTERS)
def test_moe_layer_forward_syncs_at_most_once_and_backward_never(name, dtype):
    torch.manual_seed(0)
    moe = MoE(DIM, FFN, E, K, num_shared_experts=1, aux_loss_scale=1.0, **ROUTERS[name]).to(dtype)
    x = torch.randn(2, T // 2, DIM, dtype=dtype, requires_grad=True)
    fwd, bwd = count_forward_backward(moe, x)
    # float32 runs torch's native CPU grouped GEMM (device offsets); float64 the padded one.
    want = 0 if name in DROPLESS and dtype == torch.float32 else 1
    assert fwd.count == want, f"forward syncs:\n{fwd.report()}"
    assert bwd.count == 0, f"backward syncs:\n{bwd.report()}"


def test_padded_gemm_reads_the_host_list_once_also_under_recompute():
    """Dropless float64 (the padded GEMM needs the rows per expert on the host): the first GEMM
    reads them, the second and the experts' recompute in backward reuse them."""
    torch.manual_seed(0)
    moe = MoE(DIM, FFN, E, K).to(torch.float64)
    moe.experts.recompute = lambda fn, *args: checkpoint(fn, *args, use_reentrant=False)
    x = torch.randn(2, T // 2, DIM, dtype=torch.float64, requires_grad=True)
    fwd, bwd = count_forward_backward(moe, x)
    assert (fwd.count, bwd.count) == (1, 0), f"{fwd.report()}\n{bwd.report()}"
    assert "dispatch.py" in fwd.report()


# ---- the training step ------------------------------------------------------------------------

def counted_run(tmp_path, *overrides):
    """Syncs of `Trainer.run()` over 6 steps, leaving out host work that is no device sync on
    CUDA: the sampler builds batches on the host, AdamW on CPU keeps its step counts on the host
    (the fused CUDA kernel keeps them on the device), and the final save (its own check)."""
    from configs import tiny_config
    from moepar.train import Trainer
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=6", "--router.bias_update_rate=0.01",
                                  *overrides), log=lambda _m: None)
    batches = {i: trainer.sampler.batch(i) for i in range(6 * 2)}
    trainer.sampler.batch = batches.__getitem__
    counter = SyncCounter()
    real_step = trainer.engine.optimizer_step

    def step_outside(lr, stats):
        counter.__exit__(None, None, None)
        try:
            real_step(lr, stats)
        finally:
            counter.__enter__()
    trainer.engine.optimizer_step = step_outside
    trainer.save = lambda **kwargs: None
    trainer.model(batches[0][0])          # the grouped-GEMM probe's one-time cost, outside
    with counter:
        records = trainer.run()
    assert len(records) == 6 and all("aux_loss" in r for r in records)
    return counter


@pytest.mark.parametrize("log_every, flushes", [(0, 6), (3, 3)])
def test_a_training_step_syncs_once_plus_one_read_of_metrics_per_log_every(tmp_path, log_every,
                                                                          flushes):
    """Per step: the step's one sync (loss, grad norm, flags), and no split-size sync (the
    tiny model routes dropless on one rank: layers/dispatch.py keeps the grouped GEMM's offsets
    on the device); the router statistics are read once per flush (steps 1, 3 and 6 with
    run.log_every=3; every step with 0). Before, the statistics cost 8 more per step (4 for the
    record's summary, 4 for the expert-load line with a bias), and the MoE layers 2 x 2."""
    counter = counted_run(tmp_path, f"--run.log_every={log_every}")
    moe_splits = 0
    assert counter.count == moe_splits + 6 + flushes, counter.report()
