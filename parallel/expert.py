"""Expert parallelism: shard each MoE layer's experts over the `ep` group and swap its dispatcher.

Talks on the `ep` group (through the dispatcher it installs).

| parameter                        | lives on                          | gradient reduced over          |
|----------------------------------|-----------------------------------|--------------------------------|
| experts.w_in_EDU, w_out_EFD      | E/ep experts per EP rank          | edp (sum), then / dp           |
| router, shared experts, the rest | every rank                        | dp (mean)                      |

EP rank r holds global experts [r*E/ep, (r+1)*E/ep), or the E/ep experts an expert map gives
it (parallel.expert_placement: expert_map.py; replica slots: replicas.py);
`GroupedExperts.expert_ids` records them (checkpoints name experts by global id). Expert
gradients are summed over edp and divided by dp rather than averaged over edp: each expert
already received, through the all-to-all backward, the gradients of the ep ranks that routed to
it, so the sum over edp covers every data-parallel token stream exactly once, and dp is the
number of those streams.
"""

import torch
from torch import nn

from moepar.layers.experts import GroupedExperts
from moepar.layers.moe import MoE

from .allgather import AllGatherDispatcher
from .alltoall import AllToAllDispatcher
from .dedup import DedupAllToAllDispatcher
from .expert_map import ExpertMap, contiguous
from .expert_move import apply_map
from .hierarchical import HierarchicalDispatcher, node_layout

__all__ = ["apply_ep", "DISPATCHERS", "moe_layers_by_id"]

DISPATCHERS = ("alltoall", "dedup", "allgather", "hierarchical")


def shard_experts(experts: GroupedExperts, ep: int, ep_rank: int,
                  expert_map: ExpertMap | None = None):
    """Keeps the experts this rank owns: its contiguous block, or those of `expert_map` (global
    ids recorded on the module)."""
    expert_map = expert_map or contiguous(experts.num_experts, ep)
    ids = expert_map.owned(ep_rank)
    with torch.no_grad():
        stacks = (experts.w_in_EDU, experts.w_out_EFD)
        if expert_map.is_contiguous:
            w_in, w_out = (w[ids[0]:ids[0] + len(ids)] for w in stacks)
        else:
            index = torch.tensor(ids, device=experts.w_in_EDU.device)
            w_in, w_out = (w.index_select(0, index) for w in stacks)
        experts.w_in_EDU = nn.Parameter(w_in.clone())
        experts.w_out_EFD = nn.Parameter(w_out.clone())
    experts.expert_offset, experts.num_global_experts = ids[0], experts.num_experts
    experts.expert_ids, experts.num_experts = ids, len(ids)


def moe_layers_by_id(model) -> list[tuple[int, MoE]]:
    """(the model's layer number, MoE) for a Transformer; (0, module) for a lone MoE layer."""
    if hasattr(model, "layers"):
        return [(block.layer_id, block.ffn) for block in model.blocks() if block.is_moe]
    return [(0, m) for m in model.modules() if isinstance(m, MoE)]


def apply_ep(model, dims, meshes, rank: int, dispatcher: str = "alltoall", debug: bool = False,
             a2a_chunks: int = 1, expert_maps: dict[int, ExpertMap] | None = None):
    """Shards every MoE layer of `model` over ep and installs the dispatcher of kind `dispatcher`
    (parallel.dispatcher: alltoall, dedup, allgather or hierarchical, whose nodes are
    `dims.gpus_per_node`; named by the model's layer number in its errors); returns model.
    `a2a_chunks` > 1 pipelines groups of local experts between the all-to-alls (alltoall).
    `expert_maps`: a placement per MoE layer number (expert_map.py); layers not in it are
    contiguous (the hierarchical dispatcher takes no other)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"parallel.dispatcher={dispatcher!r} is not one of {DISPATCHERS}")
    group = meshes.group("ep")
    ep_rank = dims.coords(rank).ep
    for layer_id, moe in moe_layers_by_id(model):
        expert_map = (expert_maps or {}).get(layer_id) or contiguous(moe.num_experts, dims.ep)
        if (expert_map.num_experts, expert_map.ep) != (moe.num_experts, dims.ep):
            raise ValueError(f"the expert map of layer {layer_id} places {expert_map.num_experts} "
                             f"experts over ep={expert_map.ep}; the model has {moe.num_experts} "
                             f"and ep={dims.ep}")
        if dispatcher == "hierarchical" and not expert_map.is_contiguous:
            raise ValueError("parallel.dispatcher='hierarchical' needs the contiguous expert "
                             "placement: its router groups are aligned to nodes by expert id")
        shard_experts(moe.experts, dims.ep, ep_rank, expert_map)
        num_experts = len(expert_map.slots)     # the dispatcher's "experts" are the slots
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
        apply_map(moe, expert_map, group, ep_rank)
    return model
