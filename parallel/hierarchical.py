"""Hierarchical (node-aware) all-to-all dispatch, DeepSeek-V3's: a token crosses between nodes once
per destination node, to the rank of that node with its own local index (its "relay"), carrying
the ids of that node's experts it goes to; the relay fans it out inside the node, once per rank
that owns some of them (the dedup dispatcher, parallel/dedup.py, whose rows never leave the node).
The combine comes back the same way: each expert rank weights and sums its experts' outputs, the
relay sums the node's partial sums, and one row per (token, node) crosses back.

Legend: T tokens, D model dim, N assignments, Q (token, node) pairs sent, A assignments sent,
P = ep ranks, L = ranks of the EP group per node, M = P / L nodes, rank p = node * L + local.
Talks on the `ep` group only; the inter-node steps have non-zero splits only between ranks of the
same local index (so their rows cross nodes), the fan-out only inside a node (all_to_all_single
over the one ep group with zero splits elsewhere: no extra process groups, nothing on the wire
for the zero splits).

| step                  | forward                                         | backward                 |
|-----------------------|-------------------------------------------------|--------------------------|
| node counts           | all_to_all_single of [P, 2] ints (pairs, ids)   | -                        |
| rows to relays        | all_to_all_single, Q rows of D (across nodes)   | all_to_all_single        |
| assignment ids        | all_to_all_single, A x 2 ints (row, expert)     | -                        |
| fan-out (dedup)       | dedup's dispatch over the relay rows (in node)  | dedup's                  |
| weights to relays     | all_to_all_single, A floats (across nodes)      | all_to_all_single        |
| node partial sums     | dedup's combine (in node): one row per relay row| dedup's                  |
| rows back             | all_to_all_single, Q rows of D (across nodes)   | all_to_all_single        |

Bytes of hidden state that leave a node: Q*D each way, where Q counts a token once per *other*
node it goes to (the alltoall dispatcher sends once per copy, dedup once per rank). Two host
syncs per layer (the relay learns what to forward only when its counts arrive); backward none.

Node-aligned expert groups: experts live contiguously by EP rank, so node n of an EP group holds
experts [n*E/M, (n+1)*E/M), and with `router.n_group` a multiple of M each group's experts are on
one node (`node_layout` checks it): `router.topk_group` then bounds the nodes a token reaches.
"""

from dataclasses import dataclass

import torch

from moepar.layers.dispatch import counts_to_host, gather_rows, segment_slots, sum_rows
from moepar.layers.router import Routing

from .comm import all_to_all, group_size, to_wire
from .dedup import DedupAllToAllDispatcher, DedupPlan, sort_pairs
from .splitcheck import split_check

__all__ = ["HierarchicalDispatcher", "HierarchicalPlan", "node_layout"]


def node_layout(ep: int, gpus_per_node: int, num_experts: int, n_group: int = 1) -> int:
    """Ranks of an EP group per node (L) for the hierarchical dispatcher; ValueError naming the
    keys when an EP group does not fill whole nodes (or sit inside one), or when router.n_group
    groups would straddle nodes. `gpus_per_node` 0: one node."""
    node = gpus_per_node or ep
    if (ep > node and ep % node) or (ep < node and node % ep):
        raise ValueError(f"parallel.dispatcher='hierarchical' needs each EP group on whole nodes: "
                         f"parallel.ep={ep} must be a multiple of parallel.gpus_per_node={node} "
                         "(or divide it)")
    ranks = min(ep, node)
    nodes = ep // ranks
    if num_experts % ep:
        raise ValueError(f"model.num_experts={num_experts} must be divisible by parallel.ep={ep}")
    if n_group > 1 and n_group % nodes:
        raise ValueError(f"router.n_group={n_group} must be a multiple of the {nodes} nodes that "
                         f"hold an EP group's experts (parallel.ep={ep} / parallel.gpus_per_node="
                         f"{node}) for node-aligned groups: {num_experts // n_group} experts per "
                         f"group against {num_experts // nodes} per node")
    return ranks


@dataclass(frozen=True)
class HierarchicalPlan:
    pair_token_Q: torch.Tensor     # source token of each (token, node) row sent
    pairs_of_token_TM: torch.Tensor  # each token's node rows (segment_slots): the final sum
    send_rows: list[int]           # node rows to each relay (zero off my local index)
    recv_rows: list[int]           # relay rows from each source
    assign: torch.Tensor           # the assignments this rank sends, in send order
    send_assign: list[int]
    recv_assign: list[int]
    inner: DedupPlan               # the relay's fan-out inside the node
    chunks: tuple                  # the inner plan's chunk: what the experts run

    @property
    def rows_per_expert(self) -> list[int]:
        return self.inner.rows_per_expert


class HierarchicalDispatcher:
    """Same methods as `LocalDispatcher` (one chunk); `ranks_per_node` from `node_layout`."""

    def __init__(self, num_experts: int, group, ep_rank: int, ranks_per_node: int,
                 layer_id: int = 0, debug: bool = False):
        self.num_experts, self.group, self.layer_id = num_experts, group, layer_id
        self._check = split_check(debug, group, layer_id)
        self.ep = group_size(group)
        if self.ep % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must divide ep={self.ep}")
        self.ranks_per_node, self.nodes = ranks_per_node, self.ep // ranks_per_node
        self.per_node = num_experts // self.nodes           # experts on one node
        self.local_index = ep_rank % ranks_per_node     # my relay in every node has it too
        self.inner = DedupAllToAllDispatcher(num_experts, group, layer_id, debug,
                                             max_ranks=ranks_per_node)
        self.timer = None

    @property
    def timer(self):
        """An A2ATimer (benchmarks) clocking every all-to-all, the fan-out's included."""
        return self.inner.timer

    @timer.setter
    def timer(self, timer):
        self.inner.timer = timer

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """Node counts (sync 1), rows to the relays and the ids (blocking), then the relay's
        fan-out inside the node (dedup: sync 2, its rows in flight: (x_QD,))."""
        num_tokens, P, M, L = x_TD.shape[0], self.ep, self.nodes, self.ranks_per_node
        device = x_TD.device
        node_N = torch.div(routing.expert_N, self.per_node, rounding_mode="floor")  # dropped -> M
        order_N, pair_of_sorted, pair_key, pairs_per_node = sort_pairs(node_N, routing.token_N,
                                                                       num_tokens, M)
        assigns_per_node = torch.zeros(M + 1, dtype=torch.long, device=device).scatter_add_(
            0, node_N, torch.ones_like(node_N))[:M]
        relay_of_node = torch.arange(M, device=device) * L + self.local_index
        send = torch.zeros(P, 2, dtype=torch.long, device=device).index_copy_(
            0, relay_of_node, torch.stack([pairs_per_node, assigns_per_node], 1))
        recv = all_to_all(send, [1] * P, [1] * P, self.group, self.timer)
        host = counts_to_host(torch.cat([send.flatten(), recv.flatten()]))   # host sync 1
        send_rows, send_assign = host[0:2 * P:2], host[1:2 * P:2]
        recv_rows, recv_assign = host[2 * P::2], host[2 * P + 1::2]
        self._check(send_rows, recv_rows, "dispatch (node rows)", device)
        num_pairs, num_assign = sum(send_rows), sum(send_assign)

        # Source side: one row per (token, node) pair, to that node's relay.
        pair_token_Q = torch.remainder(pair_key[:num_pairs], num_tokens)
        k = routing.top_k or self.num_experts
        pairs_of_token_TM = segment_slots(pair_token_Q, num_tokens, min(k, M))
        x_relay = all_to_all(to_wire(gather_rows(x_TD, pair_token_Q, pairs_of_token_TM)),
                             recv_rows, send_rows, self.group, self.timer)
        assign = order_N[:num_assign]
        assign_node = node_N[assign]
        pair_start = torch.cumsum(pairs_per_node, 0) - pairs_per_node
        meta_A2 = torch.stack([pair_of_sorted[:num_assign] - pair_start[assign_node],
                               routing.expert_N[assign]], 1)
        meta_recv = all_to_all(meta_A2, recv_assign, send_assign, self.group, self.timer)

        # Relay side: the received rows are the inner dispatcher's tokens, each with the global
        # ids of this node's experts it goes to (so dedup's destinations stay in this node).
        recv_rows_t = recv[:, 0]
        src_of_assign = torch.repeat_interleave(torch.arange(P, device=device), recv[:, 1],
                                                output_size=sum(recv_assign))
        row_of_assign = meta_recv[:, 0] + (torch.cumsum(recv_rows_t, 0) - recv_rows_t)[src_of_assign]
        relay_routing = Routing(row_of_assign, meta_recv[:, 1], None, None)
        x_RD, inner = self.inner.dispatch(x_relay, relay_routing)
        plan = HierarchicalPlan(pair_token_Q, pairs_of_token_TM, send_rows, recv_rows, assign,
                                send_assign, recv_assign, inner, inner.chunks)
        return x_RD, plan

    def combine(self, y_RD, plan: HierarchicalPlan, weight_N: torch.Tensor) -> torch.Tensor:
        """The weights to the relays, the node's partial sums at the relay (dedup's combine),
        one row per (token, node) back, and each token's node rows summed."""
        (y_AD,) = y_RD
        weight_relay = all_to_all(weight_N[plan.assign].unsqueeze(1), plan.recv_assign,
                                  plan.send_assign, self.group, self.timer).squeeze(1)
        y_relay = self.inner.combine(y_RD, plan.inner, weight_relay)
        self._check(plan.recv_rows, plan.send_rows, "combine (node rows)", y_AD.device)
        # Node sums travel in the experts' dtype (bf16 under autocast), summed in fp32 after.
        y_pairs = all_to_all(y_relay.to(y_AD.dtype), plan.send_rows, plan.recv_rows, self.group,
                             self.timer)
        dtype = torch.promote_types(y_AD.dtype, weight_N.dtype)
        return sum_rows(y_pairs.to(dtype), plan.pair_token_Q, plan.pairs_of_token_TM)
