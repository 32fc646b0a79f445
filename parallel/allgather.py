"""The all-gather token dispatcher: every EP rank sees the whole EP group's tokens and runs its
own experts on the copies routed to them; partial outputs are summed back by reduce-scatter.

Legend: T tokens per rank, D model dim, N assignments per rank, P = ep ranks, R local rows.
Talks on the `ep` group only.

| step            | forward                                     | backward                       |
|-----------------|---------------------------------------------|--------------------------------|
| tokens          | all_gather_into_tensor [P*T, D]             | reduce_scatter_tensor (sum)    |
| weights, ids    | all_gather_into_tensor [P*N] (+ ids, no grad)| reduce_scatter_tensor (sum)   |
| outputs         | reduce_scatter_tensor [P*T, D] -> [T, D]    | all_gather_into_tensor         |

Moves (P-1)*T*D per rank each way whatever the routing, so it suits small EP; every rank must
hold the same T. One host sync per layer (rows per local expert).
"""

from dataclasses import dataclass

import torch

from moepar.layers.dispatch import (ExpertChunk, Sorted, combine_sorted, counts_to_host,
                                    gather_sorted, group_offsets, sort_by_expert)
from moepar.layers.router import Routing

from .comm import all_gather_rows, group_size, reduce_scatter_rows, to_wire

__all__ = ["AllGatherDispatcher", "AllGatherPlan"]


@dataclass(frozen=True)
class AllGatherPlan:
    sorted: Sorted                # the EP group's copies of my experts, sorted by local expert
    chunks: tuple[ExpertChunk]    # one: the gathered rows are all here

    @property
    def rows_per_expert(self) -> list[int]:
        return self.chunks[0].rows_per_expert


class AllGatherDispatcher:
    """Same methods as `LocalDispatcher` (its collectives are blocking: nothing to overlap)."""

    def __init__(self, num_experts: int, group, ep_rank: int, layer_id: int = 0):
        self.num_experts, self.group, self.layer_id = num_experts, group, layer_id
        self.ep = group_size(group)
        self.num_local = num_experts // self.ep
        self.first = ep_rank * self.num_local

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """Gathers the tokens and their expert ids (not the weights: see `combine`)."""
        num_tokens = x_TD.shape[0]
        x_all = all_gather_rows(to_wire(x_TD), self.group)
        expert_all = all_gather_rows(routing.expert_N, self.group)
        token_all = all_gather_rows(routing.token_N, self.group)
        rank_of_N = torch.arange(self.ep, device=x_TD.device).repeat_interleave(routing.expert_N.numel())
        token_all = token_all + rank_of_N * num_tokens
        # Local experts keep their index (shifted to 0..El-1); every other copy is "dropped" here.
        local_e = expert_all - self.first
        mine = (local_e >= 0) & (local_e < self.num_local)
        local_e = torch.where(mine, local_e, self.num_local)
        local_routing = Routing(token_all, local_e, None, routing.top_k)
        order_N, counts = sort_by_expert(local_e, self.num_local)
        rows = counts_to_host(counts)   # the one host sync
        x_RD, sorted_ = gather_sorted(x_all, local_routing, order_N, sum(rows), self.num_local)
        return (x_RD,), AllGatherPlan(sorted_, (ExpertChunk(0, rows, group_offsets(counts)),))

    def combine(self, y_RD, plan: AllGatherPlan, weight_N: torch.Tensor) -> torch.Tensor:
        """The combine weights of every rank's copies (gathered now that the caller has them),
        my experts' share of every token, summed over the group by a reduce-scatter."""
        (y,) = y_RD
        weight_all = all_gather_rows(weight_N, self.group)
        partial_all = combine_sorted(y, plan.sorted, weight_all)
        # The reduce-scatter adds the partial sums on the wire: in the weights' dtype (float32
        # under bf16, whose combine returns bf16 rows' sums), so the sum over ranks is not bf16.
        return reduce_scatter_rows(partial_all.to(torch.promote_types(partial_all.dtype,
                                                                      weight_all.dtype)),
                                   self.group)
