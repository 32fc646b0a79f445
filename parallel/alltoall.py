"""The all-to-all token dispatcher: token copies travel to the EP rank that owns their expert.

Legend: T tokens, D model dim, N assignments, S rows this rank sends, R rows it receives,
E global experts, El = E / ep local experts, P = ep ranks, C chunks.
Talks on the `ep` group only.

| step                     | forward                                   | backward                     |
|--------------------------|-------------------------------------------|------------------------------|
| count exchange           | all_to_all_single of [P, El] int counts   | -                            |
| rows out, per chunk      | all_to_all_single, uneven (S rows -> R)   | all_to_all_single (R -> S)   |
| rows back, per chunk     | all_to_all_single, uneven (R -> S)        | all_to_all_single (S -> R)   |

One host sync per layer: the local counts and the received counts go to the host together
(`counts_to_host`); the permutations and the grouped-GEMM offsets are built on the device from
the device copies of the same counts, and backward never syncs.
Only kept copies travel (capacity mode never pads on the wire): bytes out = kept rows * D.
Rows arrive source-major (all of rank 0's rows for my experts, then rank 1's, ...) and are
permuted to expert-major for the grouped GEMM; that permutation and its inverse are gathers.

Overlap is the plan's chunking (layers/dispatch.py): the row all-to-alls are asynchronous
(comm.py `all_to_all_start` / `all_to_all_wait`). The local experts are cut into C chunks of
El/C experts (`parallel.a2a_chunks`, clamped to a divisor of El); copies are sorted chunk-major
(chunk, destination rank, expert), so each chunk's rows leave in one all-to-all. `dispatch`
issues every chunk's rows and returns: the aux-loss injection and the shared experts run
meanwhile. The experts (layers/experts.py) take chunk i's rows (`arrive`: wait, permute), run its
GEMMs and send the results back (`depart`) while chunk i+1's rows and chunk i-1's results are in
flight; `combine` waits for the results. Autograd replays the same interleaving in reverse, with
one change: a chunk's experts give their input gradient, its all-to-all is issued, and then their
weight gradients are computed while it travels (layers/experts.py `defer_weight_grads`). Each
expert sees exactly the rows, in the order, of one chunk, and the per-expert GEMMs are the same
calls, so any chunking gives bit-identical results.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moepar.layers.dispatch import (ExpertChunk, Sorted, combine_sorted, counts_to_host,
                                    gather_sorted, group_offsets, inverse_permutation,
                                    permute_rows, sort_by_expert)
from moepar.layers.router import Routing

from .comm import (Flight, all_to_all, all_to_all_start, all_to_all_wait, flight, group_size,
                   to_wire)
from .splitcheck import split_check

__all__ = ["AllToAllDispatcher", "AllToAllPlan", "AllToAllChunk", "source_to_expert_major"]


@dataclass(frozen=True)
class AllToAllChunk(ExpertChunk):
    """One chunk of local experts: what travels, how arrivals become expert-major, and the two
    asynchronous all-to-alls (rows out, results back) that carry it."""
    send_splits: list[int]        # rows to each EP rank
    recv_splits: list[int]        # rows from each EP rank
    to_expert_major: torch.Tensor  # received rows -> expert-major order
    to_source_major: torch.Tensor  # its inverse
    out: Flight | None            # the rows' all-to-all (started by dispatch)
    back: Flight | None           # the results' all-to-all (started by depart, waited by combine)
    check: Callable               # the split check (parallel.debug_splits), or a no-op

    defers_weight_grads = True    # arrive's backward sends the input gradient back

    def arrive(self, rows):
        """Waits for the chunk's rows and puts them in expert order."""
        x_recv = all_to_all_wait(rows, self.out)
        return permute_rows(x_recv, self.to_expert_major, self.to_source_major)

    def depart(self, y_RD):
        """Back in arrival order, and on their way to the ranks that sent them."""
        y_recv = permute_rows(y_RD, self.to_source_major, self.to_expert_major)
        self.check(self.recv_splits, self.send_splits, "combine", y_RD.device)
        return all_to_all_start(y_recv, self.back)


@dataclass(frozen=True)
class AllToAllPlan:
    sorted: Sorted                # how this rank's own copies were sorted and will be combined
    chunks: tuple[AllToAllChunk, ...]

    @property
    def rows_per_expert(self) -> list[int]:
        return [n for chunk in self.chunks for n in chunk.rows_per_expert]


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
    """Same methods as `LocalDispatcher`; experts [ep_rank*El, (ep_rank+1)*El) live here.

    `chunks`: expert chunks of the plan (the config's `parallel.a2a_chunks`); the largest divisor
    of El not above it is used. `timer` (an A2ATimer, benchmarks only) clocks the all-to-alls.
    """

    def __init__(self, num_experts: int, group, layer_id: int = 0, debug: bool = False,
                 chunks: int = 1):
        self.num_experts, self.group, self.layer_id, self.debug = num_experts, group, layer_id, debug
        # The split check is bound here (parallel.debug_splits), never asked for in forward.
        self._check = split_check(debug, group, layer_id)
        self.ep = group_size(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} must be divisible by ep={self.ep}")
        if chunks < 1:
            raise ValueError(f"parallel.a2a_chunks={chunks} must be >= 1")
        self.num_local = num_experts // self.ep
        self.chunks = max(c for c in range(1, min(chunks, self.num_local) + 1)
                          if self.num_local % c == 0)
        self.timer = None

    def exchange_counts(self, counts_E, chunks: int = 1):
        """(host counts sent, in the order of `counts_E`, host [source][local expert] counts
        received, the received counts as a [P, El] device tensor). `counts_E` is per global
        expert, or per sort key in chunk-major order (see `_chunk_major`) with `chunks` > 1; the
        exchange uses the natural [P, El] layout either way."""
        size = self.num_local // chunks
        send_PE = counts_E.view(chunks, self.ep, size).transpose(0, 1).reshape(
            self.ep, self.num_local).contiguous()
        if self.ep > 1:
            recv_PE = all_to_all(send_PE, [1] * self.ep, [1] * self.ep, self.group, self.timer)
        else:
            recv_PE = send_PE
        host = counts_to_host(torch.cat([counts_E, recv_PE.flatten()]))   # the one host sync
        sent = host[: self.num_experts]
        received = [host[self.num_experts + s * self.num_local: self.num_experts + (s + 1)
                         * self.num_local] for s in range(self.ep)]
        return sent, received, recv_PE

    def _chunk_major(self, expert_N, chunks: int):
        """Sort keys ordering copies by (chunk, destination rank, local expert); dropped stay E.
        One chunk: the expert id itself (destination-major, the synchronous order)."""
        if chunks == 1:
            return expert_N
        P, El, size = self.ep, self.num_local, self.num_local // chunks
        dest_N, local_N = torch.div(expert_N, El, rounding_mode="floor"), expert_N % El
        key_N = torch.div(local_N, size, rounding_mode="floor") * (P * size) + dest_N * size + \
            local_N % size
        return torch.where(expert_N == self.num_experts, expert_N, key_N)

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """Sorts the copies chunk-major, exchanges counts (the one sync), and starts every
        chunk's rows on their way: (x_RD, plan), x_RD one tensor per chunk, in flight."""
        P, size, chunks = self.ep, self.num_local // self.chunks, self.chunks
        order_N, counts_K = sort_by_expert(self._chunk_major(routing.expert_N, chunks),
                                           self.num_experts)
        sent, received, recv_PE = self.exchange_counts(counts_K, chunks)
        x_SD, sorted_ = gather_sorted(x_TD, routing, order_N, sum(sent), self.num_experts)
        plans = []
        for c in range(chunks):
            lo, hi = c * size, (c + 1) * size
            send_splits = [sum(sent[(c * P + p) * size:(c * P + p + 1) * size]) for p in range(P)]
            recv_splits = [sum(row[lo:hi]) for row in received]
            # (before anything is sized by the splits: a mismatch raises here, on every rank)
            self._check(send_splits, recv_splits, "dispatch", x_TD.device)
            to_expert = source_to_expert_major(recv_PE[:, lo:hi], sum(recv_splits))
            rows = [sum(received[s][e] for s in range(P)) for e in range(lo, hi)]
            plans.append(AllToAllChunk(
                lo, rows, group_offsets(recv_PE[:, lo:hi].sum(0)), send_splits, recv_splits,
                to_expert, inverse_permutation(to_expert),
                flight(recv_splits, send_splits, self.group, self.timer),
                flight(send_splits, recv_splits, self.group, self.timer), self._check))
        x_SD = to_wire(x_SD)
        pieces = x_SD.split([sum(c.send_splits) for c in plans]) if chunks > 1 else (x_SD,)
        x_RD = tuple(all_to_all_start(rows, chunk.out)
                     for chunk, rows in zip(plans, pieces, strict=True))
        return x_RD, AllToAllPlan(sorted_, tuple(plans))

    def combine(self, y_RD, plan: AllToAllPlan, weight_N: torch.Tensor) -> torch.Tensor:
        """Waits for every chunk's results and sums each token's copies with `weight_N`."""
        pieces = [all_to_all_wait(y, chunk.back) for chunk, y in zip(plan.chunks, y_RD,
                                                                      strict=True)]
        y_SD = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return combine_sorted(y_SD, plan.sorted, weight_N)
