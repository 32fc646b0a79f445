"""Re-placing experts during a run (parallel.replace_every): every owned expert's rows (its
weights, their float32 masters under bf16 training, and its AdamW moments) travel to their new
owner in one all-to-all, and each MoE layer's slot mapping and replica fetch are rebuilt.

Legend: El experts owned per rank, B bytes of one expert's rows over all its tensors.
Talks on the `ep` group.

| step                   | collective                                               |
|------------------------|----------------------------------------------------------|
| rows to the new owner  | all_to_all_single of [El, B] uint8 rows (every tensor at once) |

The values are moved as bytes, so the move is exact in any dtype; the parameters stay the same
tensor objects (the optimizer, the gradient buckets and the masters keep their references).
ZeRO 1-3 shard these rows by position inside flat or FSDP shards: not supported (the config
refuses it). No autograd: between steps only.
"""

import torch

from moepar.layers.moe import MoE

from .comm import all_to_all
from .expert_map import ExpertMap, PlacedDispatcher
from .replicas import ReplicaWeights

__all__ = ["move_experts", "apply_map"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t's rows as bytes: an [El, B_t] uint8 view (t is contiguous)."""
    return t.view(t.shape[0], -1).view(torch.uint8)


@torch.no_grad()
def move_experts(tensors: list[torch.Tensor], old: ExpertMap, new: ExpertMap, group,
                 ep_rank: int):
    """Moves row j of every tensor in `tensors` (this rank's owned experts under `old`, each
    [El, ...]) so that afterwards row j holds expert `new.owned(ep_rank)[j]`; in place."""
    owner = old.owner()
    send, in_splits = [], []
    for d in range(new.ep):
        rows = [owner[e][1] for e in new.owned(d) if owner[e][0] == ep_rank]
        send += rows
        in_splits.append(len(rows))
    mine = new.owned(ep_rank)
    out_splits = [sum(1 for e in mine if owner[e][0] == s) for s in range(new.ep)]
    # Arrivals come source-major, each source's rows in my new order.
    arrival = sorted(range(len(mine)), key=lambda j: (owner[mine[j]][0], j))
    rows_EB = torch.cat([_rows(t) for t in tensors], dim=1)
    index = torch.tensor(send, dtype=torch.long, device=rows_EB.device)
    got = all_to_all(rows_EB.index_select(0, index), out_splits, in_splits, group)
    placed = torch.empty_like(rows_EB)
    placed[torch.tensor(arrival, dtype=torch.long, device=rows_EB.device)] = got
    at = 0
    for t in tensors:
        width = _rows(t).shape[1]
        _rows(t).copy_(placed[:, at:at + width])
        at += width


def apply_map(moe: MoE, expert_map: ExpertMap, group, ep_rank: int):
    """Points `moe`'s slot mapping, replica fetch and expert names at `expert_map` (its rows
    must already hold the experts it owns there: `move_experts`)."""
    inner = moe.dispatcher.inner if isinstance(moe.dispatcher, PlacedDispatcher) else \
        moe.dispatcher
    moe.dispatcher = inner if expert_map.is_contiguous else PlacedDispatcher(inner, expert_map)
    moe.experts.with_replicas = (ReplicaWeights(expert_map, group, ep_rank)
                                 if expert_map.replicas else None)
    ids = expert_map.owned(ep_rank)
    moe.experts.expert_ids, moe.experts.expert_offset = ids, ids[0]
