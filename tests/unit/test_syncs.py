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
