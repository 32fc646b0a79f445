"""Expert parallelism: shard each MoE layer's experts over the `ep` group and swap its dispatcher.

Talks on the `ep` group (through the dispatcher it installs).

| parameter                        | lives on                          | gradient reduced over          |
|----------------------------------|-----------------------------------|--------------------------------|
| experts.w_in_EDU, w_out_EFD      | E/ep experts per EP rank          | edp (sum), then / dp           |
| router, shared experts, the rest | every rank                        | dp (mean)                      |

EP rank r holds global experts [r*E/ep, (r+1)*E/ep); `GroupedExperts.expert_offset` records the
first one (checkpoints name experts by global id). Expert gradients are summed over edp and
divided by dp rather than averaged over edp: each expert already received, through the
all-to-all backward, the gradients of the ep ranks that routed to it, so the sum over edp covers
every data-parallel token stream exactly once, and dp is the number of those streams.
"""

import torch
from torch import nn

from moepar.layers.experts import GroupedExperts
from moepar.layers.moe import MoE

from .allgather import AllGatherDispatcher
from .alltoall import AllToAllDispatcher
from .dedup import DedupAllToAllDispatcher
from .hierarchical import HierarchicalDispatcher, node_layout

__all__ = ["apply_ep", "DISPATCHERS"]

DISPATCHERS = ("alltoall", "dedup", "allgather", "hierarchical")


def shard_experts(experts: GroupedExperts, ep: int, ep_rank: int):
    """Keeps this rank's contiguous block of experts (global ids recorded on the module)."""
    num_local = experts.num_experts // ep
    first = ep_rank * num_local
    with torch.no_grad():
        experts.w_in_EDU = nn.Parameter(experts.w_in_EDU[first:first + num_local].clone())
        experts.w_out_EFD = nn.Parameter(experts.w_out_EFD[first:first + num_local].clone())
    experts.expert_offset, experts.num_global_experts = first, experts.num_experts
    experts.num_experts = num_local


def _moe_layers(model) -> list[tuple[int, MoE]]:
    """(the model's layer number, MoE) for a Transformer; (0, module) for a lone MoE layer."""
    if hasattr(model, "layers"):
        return [(block.layer_id, block.ffn) for block in model.layers if block.is_moe]
    return [(0, m) for m in model.modules() if isinstance(m, MoE)]


def apply_ep(model, dims, meshes, rank: int, dispatcher: str = "alltoall", debug: bool = False,
             a2a_chunks: int = 1):
    """Shards every MoE layer of `model` over ep and installs the dispatcher of kind `dispatcher`
    (parallel.dispatcher: alltoall, dedup, allgather or hierarchical, whose nodes are
    `dims.gpus_per_node`; named by the model's layer number in its errors); returns model.
    `a2a_chunks` > 1 pipelines groups of local experts between the all-to-alls (alltoall)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"parallel.dispatcher={dispatcher!r} is not one of {DISPATCHERS}")
    group = meshes.group("ep")
    ep_rank = dims.coords(rank).ep
    for layer_id, moe in _moe_layers(model):
        num_experts = moe.num_experts
        shard_experts(moe.experts, dims.ep, ep_rank)
        if dispatcher == "allgather":
            moe.dispatcher = AllGatherDispatcher(num_experts, group, ep_rank, layer_id)
        elif dispatcher == "hierarchical":
            ranks = node_layout(dims.ep, dims.gpus_per_node, num_experts, moe.router.cfg.n_group)
            moe.dispatcher = HierarchicalDispatcher(num_experts, group, ep_rank, ranks, layer_id,
                                                    debug)
        elif dispatcher == "dedup":
            moe.dispatcher = DedupAllToAllDispatcher(num_experts, group, layer_id, debug)
        else:
            moe.dispatcher = AllToAllDispatcher(num_experts, group, layer_id, debug,
                                                chunks=a2a_chunks)
    return model
