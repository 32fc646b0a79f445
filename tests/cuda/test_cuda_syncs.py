"""On a GPU: one MoE layer's forward syncs the host at most once (the split sizes,
`counts_to_host`) and its backward never, checked by `torch.cuda.set_sync_debug_mode("error")`,
which raises on any synchronizing CUDA call. The allowed call runs with the check lifted and is
counted: 0 times for a routing that drops nothing (dropless top-k, expert choice) on the local
dispatcher in bf16 (the native grouped GEMM takes the device offsets), once otherwise (EP
splits, capacity drops, or the host list float32's fallback GEMM needs).

Covers the local dispatcher and, in a one-rank process group (one GPU), the all-to-all, dedup
and all-gather dispatchers; the CPU count of the same budget at ep 2 is in tests/dist/test_ep.py.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from moepar.layers import MoE, dispatch
from moepar.parallel import allgather, alltoall, dedup

pytestmark = pytest.mark.cuda

DIM, FFN, E, K, T = 64, 32, 8, 2, 96


@contextlib.contextmanager
def syncs_are_errors(monkeypatch):
    """Every synchronizing CUDA call raises, except `counts_to_host`; yields its call count."""
    calls = []
    real = dispatch.counts_to_host

    def allowed(counts):
        calls.append(tuple(counts.shape))
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(counts)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    for module in (dispatch, alltoall, dedup, allgather):
        monkeypatch.setattr(module, "counts_to_host", allowed)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield calls
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank NCCL world (the EP dispatchers at ep 1 still build their plans on the device)."""
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(),
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def dispatchers(group):
    return {"local": None,
            "alltoall": lambda: alltoall.AllToAllDispatcher(E, group),
            "alltoall_dedup": lambda: dedup.DedupAllToAllDispatcher(E, group),
            "allgather": lambda: allgather.AllGatherDispatcher(E, group, 0)}


ROUTERS = {"dropless": {}, "capacity": dict(capacity_factor=1.0),
           "expert_choice": dict(type="expert_choice", capacity_factor=1.0)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
@pytest.mark.parametrize("kind", ["local", "alltoall", "alltoall_dedup", "allgather"])
def test_moe_syncs_at_most_once_forward_never_backward(kind, router, dtype, monkeypatch, one_rank_group):
    torch.manual_seed(0)
    moe = MoE(DIM, FFN, E, K, num_shared_experts=1, aux_loss_scale=1.0, **router).cuda().to(dtype)
    make = dispatchers(one_rank_group)[kind]
    if make is not None:
        moe.dispatcher = make()
    x = torch.randn(2, T // 2, DIM, device="cuda", dtype=dtype, requires_grad=True)
    moe(x).y.float().square().sum().backward()       # warm-up: the grouped-GEMM probe syncs once
    want = 0 if kind == "local" and router is not ROUTERS["capacity"] and \
        dtype == torch.bfloat16 else 1
    with syncs_are_errors(monkeypatch) as calls:
        y = moe(x).y
        assert len(calls) == want, calls
        y.float().square().sum().backward()
        assert len(calls) == want, calls
    torch.cuda.synchronize()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_counts_to_host_reads_the_device_counts():
    counts = torch.arange(5, device="cuda") * 7
    assert dispatch.counts_to_host(counts) == [0, 7, 14, 21, 28]
