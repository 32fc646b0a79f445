"""The all-to-all token dispatcher: token copies travel to the EP rank that owns their expert.

Legend: T tokens, D model dim, N assignments, S rows this rank sends, R rows it receives,
E global experts, El = E / ep local experts, P = ep ranks.
Talks on the `ep` group only.

| step                     | forward                                   | backward                     |
|--------------------------|-------------------------------------------|------------------------------|
| count exchange           | all_to_all_single of [P, El] int counts   | -                            |
| rows out                 | all_to_all_single, uneven (S rows -> R)   | all_to_all_single (R -> S)   |
| rows back (combine)      | all_to_all_single, uneven (R -> S)        | all_to_all_single (S -> R)   |

One host sync per layer: the local counts and the received counts go to the host together
(`counts_to_host`); the permutations and the grouped-GEMM offsets are built on the device from
the device copies of the same counts, and backward never syncs.
Only kept copies travel (capacity mode never pads on the wire): bytes out = kept rows * D.
Rows arrive source-major (all of rank 0's rows for my experts, then rank 1's, ...) and are
permuted to expert-major for the grouped GEMM; that permutation and its inverse are gathers.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moepar.layers.dispatch import (LocalPlan, combine_sorted, counts_to_host, gather_sorted,
                                    group_offsets, inverse_permutation, permute_rows,
                                    sort_by_expert)
from moepar.layers.router import Routing

from .comm import all_to_all, group_size, to_wire
from .splitcheck import check_splits

__all__ = ["AllToAllDispatcher", "AllToAllPlan", "source_to_expert_major"]


@dataclass(frozen=True)
class AllToAllPlan:
    local: LocalPlan              # how this rank's own copies were sorted and will be combined
    send_splits: list[int]        # rows to each EP rank
    recv_splits: list[int]        # rows from each EP rank
    to_expert_major: torch.Tensor  # received rows -> expert-major order
    to_source_major: torch.Tensor  # its inverse
    rows_per_expert: list[int]    # rows per local expert (what the grouped GEMM needs)
    offs_E: torch.Tensor          # their int32 cumulative sum, on the device


def source_to_expert_major(recv_counts, total: int | None = None, device=None) -> torch.Tensor:
    """Index that reorders rows laid out [source][expert] into [expert][source].

    recv_counts[s][e] rows came from source s for local expert e, source-major on arrival: a
    [P, El] device tensor (then `total`, the host sum, keeps this free of host syncs) or lists.
    """
    if isinstance(recv_counts, torch.Tensor):
        counts_SE, device = recv_counts.long(), recv_counts.device
    else:
        counts_SE = torch.tensor(recv_counts, dtype=torch.long, device=device)
        total = int(sum(map(sum, recv_counts)))
    num_sources, num_local = counts_SE.shape
    flat_src = counts_SE.flatten()                       # blocks in arrival order (s, e)
    start_src = torch.cumsum(flat_src, 0) - flat_src
    flat_dst = counts_SE.t().flatten()                   # blocks in target order (e, s)
    start_dst = torch.cumsum(flat_dst, 0) - flat_dst
    # block b (in target order) is (e, s) = divmod(b, num_sources); its source-order id is s*El+e
    block_dst = torch.arange(num_local * num_sources, device=device)
    e, s = block_dst // num_sources, block_dst % num_sources
    src_block = s * num_local + e
    owner = torch.repeat_interleave(block_dst, flat_dst, output_size=total)
    offset = torch.arange(total, device=device) - start_dst[owner]
    return start_src[src_block][owner] + offset


class AllToAllDispatcher:
    """Same two methods as `LocalDispatcher`; experts [ep_rank*El, (ep_rank+1)*El) live here."""

    def __init__(self, num_experts: int, group, layer_id: int = 0, debug: bool = False):
        self.num_experts, self.group, self.layer_id, self.debug = num_experts, group, layer_id, debug
        self.ep = group_size(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} must be divisible by ep={self.ep}")
        self.num_local = num_experts // self.ep

    def exchange_counts(self, counts_E):
        """(host counts per global expert sent, host [source][local expert] counts received,
        the received counts as a [P, El] device tensor)."""
        send_PE = counts_E.view(self.ep, self.num_local)
        recv_PE = torch.empty_like(send_PE)
        if self.ep > 1:
            dist.all_to_all_single(recv_PE, send_PE.contiguous(), group=self.group)
        else:
            recv_PE = send_PE
        host = counts_to_host(torch.cat([counts_E, recv_PE.flatten()]))   # the one host sync
        sent = host[: self.num_experts]
        received = [host[self.num_experts + s * self.num_local: self.num_experts + (s + 1)
                         * self.num_local] for s in range(self.ep)]
        return sent, received, recv_PE

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        order_N, counts_E = sort_by_expert(routing.expert_N, self.num_experts)
        sent, received, recv_PE = self.exchange_counts(counts_E)
        x_SD, local = gather_sorted(x_TD, routing, order_N, sent, counts_E)
        send_splits = [sum(sent[p * self.num_local:(p + 1) * self.num_local]) for p in range(self.ep)]
        recv_splits = [sum(row) for row in received]
        if self.debug:
            check_splits(send_splits, recv_splits, self.group, f"MoE layer {self.layer_id} dispatch",
                         x_TD.device)
        x_recv = all_to_all(to_wire(x_SD), recv_splits, send_splits, self.group)
        to_expert = source_to_expert_major(recv_PE, sum(recv_splits))
        to_source = inverse_permutation(to_expert)
        x_RD = permute_rows(x_recv, to_expert, to_source)
        rows = [sum(received[s][e] for s in range(self.ep)) for e in range(self.num_local)]
        return x_RD, AllToAllPlan(local, send_splits, recv_splits, to_expert, to_source, rows,
                                  group_offsets(recv_PE.sum(0)))

    def combine(self, y_RD: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        y_recv = permute_rows(y_RD, plan.to_source_major, plan.to_expert_major)
        if self.debug:
            check_splits(plan.recv_splits, plan.send_splits, self.group,
                         f"MoE layer {self.layer_id} combine", y_RD.device)
        y_SD = all_to_all(y_recv, plan.send_splits, plan.recv_splits, self.group)
        return combine_sorted(y_SD, plan.local)
