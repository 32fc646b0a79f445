"""Expert placement: which logical expert each physical expert slot of an EP rank holds, and the
dispatcher wrapper that sends routed copies to slots instead of to contiguous blocks.

Legend: E logical experts, El = E / ep experts each rank owns, S = El + N slots per rank (N replica
slots), N assignments (token copies).
Talks on nothing itself; the wrapped dispatcher talks on `ep` (replicas' weights: replicas.py).

A map is one tuple per MoE layer, `slots[r * S + j]` = the logical expert in slot j of EP rank r.
The first El slots of a rank are the experts it owns (its parameter stack, checkpointed under
their logical ids); the last N are replicas of experts owned elsewhere (or here), whose weights
are fetched each step and whose gradients go back to the owner (replicas.py). The owned slots of
all ranks together hold every logical expert exactly once.

| placement    | owned slots                                  | replica slots                    |
|--------------|----------------------------------------------|----------------------------------|
| contiguous   | rank r: [r*El, (r+1)*El) (the default)       | none                             |
| balanced     | greedy packing of measured load (`balanced`) | the heaviest experts' copies     |
| a JSON file  | as written (`check_slots` validates it)      | as written                       |

The router's output stays in logical ids (statistics, capacity drops, balance losses and
checkpoints see no placement). `PlacedDispatcher.dispatch` maps each kept copy to a slot of its
expert, the k-th copy of an expert with c slots going to slot `token % c`, so the split is a
pure function of the routing; the inner dispatcher then treats slots as its experts. Each row
meets the same weights whichever slot it goes to, so the maths of any placement is the
contiguous layout's: per expert, the same rows in the same order (a stable sort).
"""

import dataclasses
from dataclasses import dataclass

import torch

from moepar.layers.router import Routing

__all__ = ["ExpertMap", "PlacedDispatcher", "contiguous", "balanced", "check_slots",
           "rank_rows", "imbalance"]


@dataclass(frozen=True)
class ExpertMap:
    """One MoE layer's placement: `slots[r * slots_per_rank + j]` is the logical expert in slot j
    of EP rank r (see the module docstring)."""
    slots: tuple[int, ...]
    num_experts: int
    ep: int

    def __post_init__(self):
        check_slots(self.slots, self.num_experts, self.ep, where="an expert map")

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.ep

    @property
    def num_owned(self) -> int:
        return self.num_experts // self.ep

    @property
    def replicas(self) -> int:
        return self.slots_per_rank - self.num_owned

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        return self.slots[rank * self.slots_per_rank:(rank + 1) * self.slots_per_rank]

    def owned(self, rank: int) -> tuple[int, ...]:
        """The logical experts whose parameters EP rank `rank` holds, in stack order."""
        return self.rank_slots(rank)[:self.num_owned]

    @property
    def is_contiguous(self) -> bool:
        return self.slots == tuple(range(self.num_experts))

    def owner(self) -> dict[int, tuple[int, int]]:
        """Logical expert -> (EP rank, index in that rank's parameter stack)."""
        return {e: (r, j) for r in range(self.ep) for j, e in enumerate(self.owned(r))}

    def per_rank(self) -> list[list[int]]:
        """The JSON form: one list of slots per EP rank."""
        return [list(self.rank_slots(r)) for r in range(self.ep)]


def check_slots(slots, num_experts: int, ep: int, where: str):
    """Raises ValueError naming `where` unless `slots` is a placement of `num_experts` experts
    over `ep` ranks: equal slots per rank, every id an expert, each expert owned exactly once."""
    if num_experts % ep:
        raise ValueError(f"{where}: num_experts={num_experts} is not divisible by ep={ep}")
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in slots):
        raise ValueError(f"{where}: slots must be integer expert ids, got {list(slots)[:16]}")
    if len(slots) % ep or len(slots) < num_experts:
        raise ValueError(f"{where}: {len(slots)} slots cannot be split equally over ep={ep} "
                         f"ranks with at least {num_experts // ep} each")
    bad = sorted({e for e in slots if not 0 <= e < num_experts})
    if bad:
        raise ValueError(f"{where}: expert ids {bad[:8]} are not in [0, {num_experts})")
    per_rank, owned = len(slots) // ep, num_experts // ep
    held = [e for r in range(ep) for e in slots[r * per_rank:r * per_rank + owned]]
    missing = sorted(set(range(num_experts)) - set(held))
    twice = sorted({e for e in held if held.count(e) > 1})
    if missing or twice:
        raise ValueError(f"{where}: the first {owned} slots of each rank (the experts it owns) "
                         f"must hold every expert once; missing {missing[:8]}, more than once "
                         f"{twice[:8]}")


def contiguous(num_experts: int, ep: int) -> ExpertMap:
    return ExpertMap(tuple(range(num_experts)), num_experts, ep)


def balanced(load_E, ep: int, replicas: int = 0, ranks_per_node: int = 0) -> ExpertMap:
    """A placement from measured load (`load_E`: routed copies per logical expert).

    Replication first: `ep * replicas` extra copies go, one at a time, to the expert with the
    most load per copy (at most ep copies each). Then a greedy packing, heaviest share first:
    each expert's owned slot, then its replica slots, go to the least-loaded rank with a free slot
    of that kind, preferring a rank that holds no copy of it. With `ranks_per_node` (< ep) the
    same greedy first picks the least-loaded node with a free slot, then the rank within it, so
    the nodes are balanced before the ranks (an expert's copies then spread over nodes last).
    Ties break by the lower id, so the result is a pure function of the load."""
    load = [float(x) for x in load_E]
    E = len(load)
    if E % ep:
        raise ValueError(f"num_experts={E} is not divisible by ep={ep}")
    copies = [1] * E
    for _ in range(ep * replicas):
        e = max((e for e in range(E) if copies[e] < ep),
                key=lambda e: (load[e] / copies[e], -e), default=None)
        if e is None:
            break
        copies[e] += 1
    owned_n, per_rank = E // ep, E // ep + replicas
    node = ranks_per_node if 0 < ranks_per_node < ep and ep % ranks_per_node == 0 else ep
    rank_load, node_load = [0.0] * ep, [0.0] * (ep // node)
    slots = [[] for _ in range(ep)]

    def place(e: int, share: float, free):
        open_ranks = [r for r in range(ep) if free(r)]
        fresh = [r for r in open_ranks if e not in slots[r]] or open_ranks
        n = min({r // node for r in fresh}, key=lambda n: (node_load[n], n))
        r = min((r for r in fresh if r // node == n), key=lambda r: (rank_load[r], r))
        slots[r].append(e)
        rank_load[r] += share
        node_load[n] += share

    order = sorted(range(E), key=lambda e: (-load[e] / copies[e], e))
    for e in order:
        place(e, load[e] / copies[e], lambda r: len(slots[r]) < owned_n)
    extra = sorted((e for e in range(E) for _ in range(copies[e] - 1)),
                   key=lambda e: (-load[e] / copies[e], e))
    for e in extra:
        place(e, load[e] / copies[e], lambda r: len(slots[r]) < per_rank)
    for r in range(ep):                  # replica slots left empty (too few experts): copy one
        while len(slots[r]) < per_rank:
            slots[r].append(slots[r][len(slots[r]) - owned_n])
    return ExpertMap(tuple(e for rank in slots for e in rank), E, ep)


def rank_rows(expert_map: ExpertMap, load_E) -> list[float]:
    """The rows each EP rank's slots receive when each expert's load splits evenly over its
    slots (what `PlacedDispatcher`'s split does on average)."""
    counts = [0] * expert_map.num_experts
    for e in expert_map.slots:
        counts[e] += 1
    per = expert_map.slots_per_rank
    return [sum(float(load_E[e]) / counts[e] for e in expert_map.slots[r * per:(r + 1) * per])
            for r in range(expert_map.ep)]


def imbalance(expert_map: ExpertMap, load_E) -> float:
    """The busiest EP rank's rows over the mean under `expert_map` (1.0: perfectly even)."""
    rows = rank_rows(expert_map, load_E)
    mean = sum(rows) / len(rows)
    return max(rows) / mean if mean > 0 else 1.0


class PlacedDispatcher:
    """Same methods as the dispatcher it wraps (built over ep * slots_per_rank "experts"):
    dispatch maps each copy's logical expert to a slot (one gather on the device, no sync),
    combine is the inner one's."""

    def __init__(self, inner, expert_map: ExpertMap, device=None):
        self.inner, self.expert_map = inner, expert_map
        E, num_slots = expert_map.num_experts, len(expert_map.slots)
        by_expert = [[s for s, e in enumerate(expert_map.slots) if e == x] for x in range(E)]
        width = max(len(s) for s in by_expert)
        # Row E (a dropped copy) maps to slot num_slots, the inner dispatcher's "dropped".
        table = [s + [s[0]] * (width - len(s)) for s in by_expert] + [[num_slots] * width]
        self.slots_EC = torch.tensor(table, dtype=torch.long, device=device)
        self.copies_E = torch.tensor([len(s) for s in by_expert] + [1], dtype=torch.long,
                                     device=device)

    def to_slots(self, routing: Routing) -> Routing:
        """The routing with `expert_N` in slots: copy n of expert e goes to slot
        `token_n % copies(e)` of e's slots."""
        expert_N = routing.expert_N
        if self.slots_EC.device != expert_N.device:
            self.slots_EC = self.slots_EC.to(expert_N.device)
            self.copies_E = self.copies_E.to(expert_N.device)
        pick_N = routing.token_N % self.copies_E[expert_N]
        return dataclasses.replace(routing, expert_N=self.slots_EC[expert_N, pick_N])

    def dispatch(self, x_TD, routing: Routing):
        return self.inner.dispatch(x_TD, self.to_slots(routing))

    def combine(self, y_RD, plan, weight_N):
        return self.inner.combine(y_RD, plan, weight_N)
