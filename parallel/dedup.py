"""All-to-all dispatch with token de-duplication: a token whose top-k experts share an EP rank
travels there once; that rank runs each of its experts on it, weights and sums the results, and
sends one row back.

Legend: T tokens, D model dim, N assignments, Q (token, rank) pairs sent, A assignments sent,
P = ep ranks, El local experts. Talks on the `ep` group only.

| step              | forward                                             | backward                    |
|-------------------|-----------------------------------------------------|-----------------------------|
| count exchange    | all_to_all_single of [P, 1+El] ints                 | -                           |
| rows out          | all_to_all_single, Q rows of D                      | all_to_all_single           |
| assignment ids    | all_to_all_single, A x 2 ints (row, local expert)   | -                           |
| weights           | all_to_all_single, A floats                         | all_to_all_single           |
| rows back         | all_to_all_single, Q rows of D (partial sums)       | all_to_all_single           |

Bytes of hidden state on the wire: Q*D each way instead of the plain dispatcher's A*D; the ids
and weights add 3 numbers per assignment. One host sync per layer (all counts together); pair
keys, counts and offsets are built on the device without boolean masks or `bincount` (which
sync on CUDA), and backward never syncs. The rows out travel asynchronously (dispatch starts
them, the plan's one chunk waits for them in `arrive`); in backward their gradient's all-to-all
is issued before the experts' weight gradients are computed, which then run while it travels
(layers/experts.py `defer_weight_grads`). The weights travel in `combine`, once the aux-loss
injection has set them.
"""

from dataclasses import dataclass

import torch

from moepar.layers.dispatch import (ExpertChunk, counts_to_host, gather_rows, group_offsets,
                                    segment_slots, sort_by_expert, sum_rows)
from moepar.layers.router import Routing, expert_counts

from .comm import (Flight, all_to_all, all_to_all_start, all_to_all_wait, flight, group_size,
                   to_wire)
from .splitcheck import split_check

__all__ = ["DedupAllToAllDispatcher", "DedupPlan", "DedupChunk", "sort_pairs"]


@dataclass(frozen=True)
class DedupChunk(ExpertChunk):
    """Every local expert: the pair rows arrive in one all-to-all, and each assignment reads its
    pair's row (`rows_per_expert` counts assignments, grouped by local expert)."""
    rows_in: Flight | None         # the pair rows' all-to-all (started by dispatch)
    row_A: torch.Tensor            # received row each assignment reads, assignments expert-major
    assigns_of_row_QM: torch.Tensor  # each received row's assignments (segment_slots)

    defers_weight_grads = True     # arrive's backward sends the rows' gradient back

    def arrive(self, rows):
        """The pair rows, once here, expanded to one row per assignment, expert-major."""
        x_recv = all_to_all_wait(rows, self.rows_in)
        return gather_rows(x_recv, self.row_A, self.assigns_of_row_QM)


@dataclass(frozen=True)
class DedupPlan:
    pair_token_Q: torch.Tensor     # source token of each pair row sent
    pairs_of_token_TM: torch.Tensor  # each token's pair rows (segment_slots): the final sum
    num_tokens: int
    send_rows: list[int]           # pair rows to each rank
    recv_rows: list[int]           # pair rows from each rank
    assign: torch.Tensor           # the assignments this rank sends, in send order
    send_assign: list[int]
    recv_assign: list[int]
    order_A: torch.Tensor          # received assignments -> expert-major
    chunks: tuple[DedupChunk]

    @property
    def rows_per_expert(self) -> list[int]:
        return self.chunks[0].rows_per_expert


def sort_pairs(dest_N, token_N, num_tokens: int, num_dest: int):
    """Copies sorted by (destination, token), stably, and grouped into (destination, token)
    pairs: (order_N, pair of each sorted copy, each pair's key dest * num_tokens + token in its
    first slots, pairs per destination). Destination `num_dest` (dropped copies) sorts last and
    is not counted. On the device, no host sync."""
    key_sorted, order_N = torch.sort(dest_N * num_tokens + token_N, stable=True)
    first = torch.ones_like(key_sorted, dtype=torch.bool)
    first[1:] = key_sorted[1:] != key_sorted[:-1]
    pair_of_sorted = torch.cumsum(first, 0) - 1
    # Each pair's key, without a boolean mask (whose size the host would need): every copy
    # writes its pair's slot, and the copies of one pair carry the same key.
    pair_key = key_sorted.new_empty(key_sorted.shape).scatter_(0, pair_of_sorted, key_sorted)
    dest_sorted = torch.div(key_sorted, num_tokens, rounding_mode="floor")
    pairs_per_dest = torch.zeros(num_dest + 1, dtype=torch.long, device=dest_N.device).scatter_add_(
        0, dest_sorted, first.long())[:num_dest]
    return order_N, pair_of_sorted, pair_key, pairs_per_dest


class DedupAllToAllDispatcher:
    """Same methods as `LocalDispatcher` (one chunk). `timer`: see AllToAllDispatcher."""

    def __init__(self, num_experts: int, group, layer_id: int = 0, debug: bool = False,
                 max_ranks: int = 0):
        self.num_experts, self.group, self.layer_id, self.debug = num_experts, group, layer_id, debug
        # The split check is bound here (parallel.debug_splits), never asked for in forward.
        self._check = split_check(debug, group, layer_id)
        self.ep = group_size(group)
        self.num_local = num_experts // self.ep
        # A bound on the ranks one token reaches (0: ep); the hierarchical relay's is its node's
        # ranks. It sizes the slot table of the final sum: one gather and add per slot.
        self.max_ranks = max_ranks or self.ep
        self.timer = None

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """Counts (the one sync), the pair rows out (asynchronous: (x_RD,) is in flight), the
        assignment ids (blocking, small); the weights wait for `combine` (the aux-loss injection
        may still change them)."""
        num_tokens, P, El = x_TD.shape[0], self.ep, self.num_local
        dest_N = torch.div(routing.expert_N, El, rounding_mode="floor")   # dropped -> P
        order_N, pair_of_sorted, pair_key, pairs_per_dest = sort_pairs(dest_N, routing.token_N,
                                                                       num_tokens, P)
        assigns_PE = expert_counts(routing.expert_N, self.num_experts + 1)[:-1].view(P, El)
        send = torch.cat([pairs_per_dest.unsqueeze(1), assigns_PE], 1)         # [P, 1+El]
        recv = all_to_all(send, [1] * P, [1] * P, self.group, self.timer)
        host = counts_to_host(torch.cat([send.flatten(), recv.flatten()]))   # the one host sync
        send_h = [host[p * (1 + El):(p + 1) * (1 + El)] for p in range(P)]
        recv_h = [host[(P + p) * (1 + El):(P + p + 1) * (1 + El)] for p in range(P)]
        send_rows, recv_rows = [r[0] for r in send_h], [r[0] for r in recv_h]
        send_assign, recv_assign = [sum(r[1:]) for r in send_h], [sum(r[1:]) for r in recv_h]
        self._check(send_rows, recv_rows, "dispatch (dedup rows)", x_TD.device)
        num_pairs, num_assign = sum(send_rows), sum(send_assign)

        # Source side: one row per (rank, token) pair; per assignment its row and local expert.
        pair_token_Q = torch.remainder(pair_key[:num_pairs], num_tokens)
        # Sums over a token's copies run slot by slot (deterministic, see segment_slots): a token
        # has at most one pair per rank and one assignment per expert, and at most K of each.
        k = routing.top_k or self.num_experts
        pairs_of_token_TM = segment_slots(pair_token_Q, num_tokens, min(k, self.max_ranks))
        rows_in = flight(recv_rows, send_rows, self.group, self.timer)
        x_QD = all_to_all_start(to_wire(gather_rows(x_TD, pair_token_Q, pairs_of_token_TM)),
                                rows_in)
        assign = order_N[:num_assign]
        assign_dest = dest_N[assign]
        pair_start = torch.cumsum(pairs_per_dest, 0) - pairs_per_dest
        meta_A2 = torch.stack([pair_of_sorted[:num_assign] - pair_start[assign_dest],
                               routing.expert_N[assign] - assign_dest * El], 1)
        meta_recv = all_to_all(meta_A2, recv_assign, send_assign, self.group, self.timer)

        # Destination side: expand rows to assignments, grouped by local expert.
        # (from the device copy of the received counts: no host-to-device copy of the lists)
        recv_rows_t = recv[:, 0]
        src_of_assign = torch.repeat_interleave(
            torch.arange(P, device=x_TD.device), recv[:, 1:].sum(1), output_size=sum(recv_assign))
        row_of_assign = meta_recv[:, 0] + (torch.cumsum(recv_rows_t, 0) - recv_rows_t)[src_of_assign]
        order_A, counts_El = sort_by_expert(meta_recv[:, 1], El)
        rows_per_expert = [sum(recv_h[s][1 + e] for s in range(P)) for e in range(El)]
        row_A = row_of_assign.index_select(0, order_A)
        chunk = DedupChunk(0, rows_per_expert, group_offsets(counts_El), rows_in, row_A,
                           segment_slots(row_A, sum(recv_rows), min(k, El)))
        plan = DedupPlan(pair_token_Q, pairs_of_token_TM, num_tokens, send_rows, recv_rows, assign,
                         send_assign, recv_assign, order_A, (chunk,))
        return (x_QD,), plan

    def combine(self, y_RD, plan: DedupPlan, weight_N: torch.Tensor) -> torch.Tensor:
        """The weights out (blocking, A numbers); each received row's assignments weighted and
        summed here; one partial sum per pair back (blocking); each token's pairs summed."""
        (y_AD,), (chunk,) = y_RD, plan.chunks
        weight_recv = all_to_all(weight_N[plan.assign].unsqueeze(1), plan.recv_assign,
                                 plan.send_assign, self.group, self.timer).squeeze(1)
        weight_A = weight_recv.index_select(0, plan.order_A)
        dtype = torch.promote_types(y_AD.dtype, weight_A.dtype)
        weighted = y_AD.to(dtype) * weight_A.to(dtype).unsqueeze(1)
        y_rows = sum_rows(weighted, chunk.row_A, chunk.assigns_of_row_QM)
        self._check(plan.recv_rows, plan.send_rows, "combine (dedup rows)", y_AD.device)
        # Partial sums travel in the experts' dtype (bf16 under autocast), summed in fp32 after.
        y_pairs = all_to_all(y_rows.to(y_AD.dtype), plan.send_rows, plan.recv_rows, self.group,
                             self.timer)
        return sum_rows(y_pairs.to(dtype), plan.pair_token_Q, plan.pairs_of_token_TM)
