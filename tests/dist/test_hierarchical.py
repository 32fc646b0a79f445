"""The hierarchical dispatcher at 2 "nodes" of 2 ranks (ep 4, gpus_per_node 2) on localhost: the
combine is the hand-computed sum; a token crosses between nodes once per destination node (the
plan's splits equal the counted rows); the layer equals the one-process layer and the alltoall
dispatcher's, outputs and gradients, under node-aligned group-limited routing."""

import copy

import torch
import torch.distributed as dist

from idexperts import times_expert_id

from moepar.bench.nodes import off_node_rows
from moepar.layers import MoE, Routing
from moepar.parallel.dims import ParallelDims
from moepar.parallel.expert import apply_ep

DIM, FFN, E, K, T = 8, 12, 8, 3, 10


def setup():
    dims = ParallelDims.resolve(4, ep=4, num_experts=E, gpus_per_node=2)
    return dist.get_rank(), dims, dims.build_meshes("cpu")


def case_round_trip():
    """Experts multiply by (global id + 1): combine gives sum_k w * x * (e + 1); x's gradient
    sum_k w * (e + 1). Random routing with drops, and tokens with several experts per node."""
    rank, dims, meshes = setup()
    moe = apply_ep(MoE(DIM, FFN, E, K).double(), dims, meshes, rank, "hierarchical", debug=True)
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(T, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    expert = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    expert[0] = torch.tensor([E, E, E])             # all dropped
    expert[1] = torch.tensor([0, 1, E])             # both on rank 0 (node 0)
    expert[2] = torch.tensor([4, 6, 7])             # node 1 only, two of its ranks
    routing = Routing(torch.arange(T).repeat_interleave(K), expert.flatten(),
                      torch.rand(T * K, dtype=torch.float64, generator=gen), K)
    x_RD, plan = moe.dispatcher.dispatch(x, routing)
    # One row per (token, other node): the rows leaving this node are the counted ones.
    home = rank // 2
    off = sum(n for p, n in enumerate(plan.send_rows) if p // 2 != home)
    assert off == sum(off_node_rows(expert.tolist(), rank, 4, 2, E)["hierarchical"].values())
    y = moe.dispatcher.combine(times_expert_id(x_RD, plan, moe.experts.expert_offset), plan,
                               routing.weight_N)
    scale = torch.zeros(T, dtype=torch.float64)
    for n in range(T * K):
        e = int(routing.expert_N[n])
        if e < E:
            scale[n // K] += routing.weight_N[n] * (e + 1)
    torch.testing.assert_close(y, x.detach() * scale.unsqueeze(1), rtol=1e-12, atol=1e-12)
    y.sum().backward()
    torch.testing.assert_close(x.grad, scale.unsqueeze(1).expand(-1, DIM), rtol=1e-12, atol=1e-12)


def case_layer_parity():
    """Sigmoid router, 2 groups (= nodes) of 4 experts, topk_group 1: every token stays on one
    node. Hierarchical == one process == alltoall (outputs, router and expert gradients)."""
    rank, dims, meshes = setup()
    torch.manual_seed(0)
    reference = MoE(DIM, FFN, E, K, num_shared_experts=1, score_func="sigmoid", n_group=2,
                    topk_group=1, balance_coeff=0.01, z_coeff=0.001).double()
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, T, DIM, dtype=torch.float64, generator=gen) for _ in range(4)]
    gs = [torch.randn(2, T, DIM, dtype=torch.float64, generator=gen) for _ in range(4)]
    ref_y = []
    for x, g in zip(xs, gs, strict=True):
        out = reference(x)
        ref_y.append(out.y.detach())
        ((out.y * g).sum() + out.aux_loss.total).backward()
    results = {}
    for kind in ("hierarchical", "alltoall"):
        sharded = apply_ep(copy.deepcopy(reference), dims, meshes, rank, kind, debug=True)
        sharded.zero_grad()
        out = sharded(xs[rank])
        ((out.y * gs[rank]).sum() + out.aux_loss.total).backward()
        grads = {}
        for name, p in sharded.named_parameters():
            grad = p.grad.clone()
            if not name.startswith("experts."):
                dist.all_reduce(grad)       # dense parameters: summed over every rank's tokens
            grads[name] = grad
        results[kind] = (out.y.detach(), grads)
    y, grads = results["hierarchical"]
    torch.testing.assert_close(y, ref_y[rank], rtol=1e-10, atol=1e-12)
    first = rank * (E // 4)
    for name, q in reference.named_parameters():
        want = q.grad[first:first + E // 4] if name.startswith("experts.") else q.grad
        torch.testing.assert_close(grads[name], want, rtol=1e-10, atol=1e-12, msg=name)
    y2, grads2 = results["alltoall"]
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-13)
    for name in grads:
        torch.testing.assert_close(grads[name], grads2[name], rtol=1e-10, atol=1e-13, msg=name)


def test_round_trip(worlds):
    worlds(4).run(case_round_trip)


def test_layer_parity(worlds):
    worlds(4).run(case_layer_parity)
