"""Replica slots of hot experts (parallel.expert_replicas): each step a rank fetches the weights
of the experts its replica slots copy from their owners, and the replicas' gradients go back and
are summed into the owner's, so a logical expert keeps one parameter, one optimizer state and
one checkpoint entry, and its gradient is the sum over every slot that ran it.

Legend: El experts owned here, N replica slots here, W = D*U + F*D weights of one expert.
Talks on the `ep` group.

| step                      | forward                              | backward                       |
|---------------------------|--------------------------------------|--------------------------------|
| owned rows -> requesters  | gather (one row per requesting slot) | sum per owned expert, in order |
| weights to replica slots  | all_to_all_single of [*, W] rows     | all_to_all_single (adjoint)    |

No host sync: the split sizes come from the expert map, known at build time. The sum of an
owned expert's gradient contributions is layers/dispatch.py's `gather_rows`: an [El, M] table
summed slot by slot in a fixed order (no float `index_add`, whose atomics reorder on GPUs).
"""

import torch

from moepar.layers.dispatch import gather_rows, inverse_permutation, permute_rows, segment_slots

from .comm import all_to_all
from .expert_map import ExpertMap

__all__ = ["ReplicaWeights"]


class ReplicaWeights:
    """(w_in_EDU, w_out_EFD) of the El owned experts -> the stacks of all El + N slots of this
    rank: the owned ones, then the replicas fetched from their owners (`GroupedExperts.
    with_replicas`)."""

    def __init__(self, expert_map: ExpertMap, group, ep_rank: int, device=None):
        m, P = expert_map, expert_map.ep
        owner = m.owner()
        self.group = group
        # Requests: (destination rank, its replica slot index) -> (owner rank, owned index).
        wants = [[owner[e] for e in m.rank_slots(d)[m.num_owned:]] for d in range(P)]
        sends = [[i for o, i in wants[d] if o == ep_rank] for d in range(P)]
        self.in_splits = [len(s) for s in sends]
        self.out_splits = [sum(1 for o, _ in wants[ep_rank] if o == s) for s in range(P)]
        send_index = [i for s in sends for i in s]
        self.send_index = torch.tensor(send_index, dtype=torch.long, device=device)
        width = max([send_index.count(j) for j in range(m.num_owned)] + [1])
        self.table_EM = segment_slots(self.send_index, m.num_owned, width)
        # Arrivals are source-major (owner 0's rows first), each source's in my slot order.
        arrival = sorted(range(len(wants[ep_rank])), key=lambda j: (wants[ep_rank][j][0], j))
        self.to_slots = torch.tensor([arrival.index(j) for j in range(len(arrival))],
                                     dtype=torch.long, device=device)
        self.from_slots = inverse_permutation(self.to_slots)

    def __call__(self, w_in_EDU, w_out_EFD):
        if self.send_index.device != w_in_EDU.device:
            for name in ("send_index", "table_EM", "to_slots", "from_slots"):
                setattr(self, name, getattr(self, name).to(w_in_EDU.device))
        El = w_in_EDU.shape[0]
        flat_EW = torch.cat([w_in_EDU.reshape(El, -1), w_out_EFD.reshape(El, -1)], dim=1)
        out_NW = gather_rows(flat_EW, self.send_index, self.table_EM)
        got_NW = all_to_all(out_NW, self.out_splits, self.in_splits, self.group)
        got_NW = permute_rows(got_NW, self.to_slots, self.from_slots)
        w_in_N, w_out_N = got_NW.split([w_in_EDU[0].numel(), w_out_EFD[0].numel()], dim=1)
        return (torch.cat([w_in_EDU, w_in_N.view((-1,) + w_in_EDU.shape[1:])]),
                torch.cat([w_out_EFD, w_out_N.view((-1,) + w_out_EFD.shape[1:])]))
