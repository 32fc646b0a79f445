"""Two GPUs on NCCL (skipped otherwise): every expert-parallel dispatcher's round trip, with a
rank that sends nothing and a rank that receives nothing, against the combine computed by hand
(as tests/dist/test_ep.py checks on gloo); a ZeRO-3 save holds one box at a time in GPU memory."""

import os

import pytest
import torch

from idexperts import times_expert_id
from net import free_port

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")]

DIM, FFN, E, K, T = 8, 12, 8, 2, 10
KINDS = ["alltoall", "dedup", "allgather", "hierarchical"]   # hierarchical: 2 nodes of 1 GPU
# ep 2: experts 0-3 live on rank 0, 4-7 on rank 1
SCENARIOS = ["random", "rank0_sends_nothing", "rank1_receives_nothing"]


def _routing(scenario: str, rank: int, gen):
    from moepar.layers import Routing
    token = torch.arange(T).repeat_interleave(K)
    weight = torch.rand(T * K, dtype=torch.float64, generator=gen)
    if scenario == "random":
        expert = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).flatten()
    elif scenario == "rank0_sends_nothing":        # expert E: dropped
        expert = torch.full((T * K,), E) if rank == 0 else torch.tensor([0, 5] * T)
    else:                                          # every copy to rank 0's experts
        expert = torch.tensor([0, 3] * T)
    return Routing(token.cuda(), expert.cuda(), weight.cuda(), K)


def _round_trip(rank: int, port: int, dispatcher: str, scenario: str):
    import torch.distributed as dist

    from moepar.layers import MoE
    from moepar.parallel.dims import ParallelDims
    from moepar.parallel.expert import apply_ep
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        dims = ParallelDims.resolve(2, ep=2, num_experts=E,
                                    gpus_per_node=1 if dispatcher == "hierarchical" else 0)
        meshes = dims.build_meshes("cuda")
        moe = apply_ep(MoE(DIM, FFN, E, K).double().cuda(), dims, meshes, rank, dispatcher,
                       debug=True)
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(T, DIM, dtype=torch.float64, generator=gen).cuda().requires_grad_()
        routing = _routing(scenario, rank, gen)
        x_RD, plan = moe.dispatcher.dispatch(x, routing)
        if scenario == "rank1_receives_nothing" and rank == 1:
            assert sum(plan.rows_per_expert) == 0
        y_RD = times_expert_id(x_RD, plan, moe.experts.expert_offset)
        y = moe.dispatcher.combine(y_RD, plan, routing.weight_N)
        expert_N, token_N, weight_N = (t.cpu() for t in (routing.expert_N, routing.token_N,
                                                         routing.weight_N))
        x_host = x.detach().cpu()
        expected = torch.zeros(T, DIM, dtype=torch.float64)
        scale = torch.zeros(T, dtype=torch.float64)
        for n in range(T * K):
            e, t = int(expert_N[n]), int(token_N[n])
            if e < E:
                expected[t] += weight_N[n] * x_host[t] * (e + 1)
                scale[t] += weight_N[n] * (e + 1)
        torch.testing.assert_close(y.cpu(), expected, rtol=1e-12, atol=1e-12)
        y.sum().backward()
        torch.testing.assert_close(x.grad.cpu(), scale.unsqueeze(1).expand(-1, DIM), rtol=1e-12,
                                   atol=1e-12)
        torch.cuda.synchronize()
        dist.barrier()      # no rank tears its communicators down while its peer still talks
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("dispatcher", KINDS)
def test_dispatcher_round_trip_on_nccl(dispatcher, scenario):
    import torch.multiprocessing as mp
    mp.spawn(_round_trip, args=(free_port(), dispatcher, scenario), nprocs=2, join=True)


def _zero3_checkpoint_memory(rank: int, port: int, run_dir: str):
    """ZeRO-3 on NCCL: a save holds at most one box over the rank's memory at a time (the
    FSDP shards are written as they are, never gathered)."""
    import torch.distributed as dist

    from configs import tiny_config
    from moepar.train import Trainer
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    trainer = Trainer(tiny_config(run_dir, "--train.device=cuda", "--parallel.zero=3",
                                  "--train.global_batch_size=8", "--model.dim=256",
                                  "--model.moe_ffn_dim=1024", "--model.num_experts=16",
                                  "--train.steps=1"), log=lambda _m: None)
    try:
        trainer.train_step()
        largest = max(seg.canon.numel * lt.tensor.element_size()
                      for lt in trainer.engine.model_shards() for seg in lt.segments)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.save()
        grown = torch.cuda.max_memory_allocated() - before
        assert grown <= largest + (1 << 20), (rank, grown, largest)
        dist.barrier()
    finally:
        trainer.release()
        dist.destroy_process_group()


def test_zero3_checkpoint_holds_one_box_at_a_time_in_gpu_memory(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_zero3_checkpoint_memory, args=(free_port(), str(tmp_path / "run")), nprocs=2,
             join=True)
