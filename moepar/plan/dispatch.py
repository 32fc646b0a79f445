"""Rows of hidden state per token that leave a node in one dispatch, per EP dispatcher, expected
over uniform routing: what steptime.py charges at network speed. The mean of the rows
`moepar bench dispatch` counts (moepar/bench/nodes.py) over every routing equals it.

M nodes of L ranks hold an EP group of P = M*L ranks, E experts, El = E/P per rank, EN = E/M per
node; a token has k experts. Group-limited routing (router.n_group G groups of s = E/G experts,
router.topk_group g) draws g groups, then k experts among their g*s; without groups, k of E.

| dispatcher   | rows per token that leave the node          |
|--------------|---------------------------------------------|
| alltoall     | k * (M-1)/M (every copy on another node)    |
| dedup        | (P-L) * P(a given rank is hit)              |
| hierarchical | (M-1) * P(a given node is hit)              |

P(a unit of m experts is hit): without groups 1 - C(E-m, k)/C(E, k); inside one group (m | s)
g/G * (1 - C(gs-m, k)/C(gs, k)); made of c = m/s groups, summed over how many of them were drawn
(hypergeometric). A unit that neither divides nor is divided by a group gets the ungrouped value.
"""

from fractions import Fraction
from math import comb

__all__ = ["off_node_rows_per_token", "unit_hit"]


def unit_hit(m: int, num_experts: int, k: int, n_group: int = 1, topk_group: int = 1) -> Fraction:
    """Probability that a token has at least one expert among a given block of m experts."""
    if n_group <= 1 or topk_group >= n_group or (m % (num_experts // n_group)
                                                  and (num_experts // n_group) % m):
        return 1 - Fraction(comb(num_experts - m, k), comb(num_experts, k))
    s, G, g = num_experts // n_group, n_group, topk_group
    pool = g * s
    if m <= s:
        return Fraction(g, G) * (1 - Fraction(comb(pool - m, k), comb(pool, k)))
    c = m // s
    return sum(Fraction(comb(c, j) * comb(G - c, g - j), comb(G, g))
               * (1 - Fraction(comb(pool - j * s, k), comb(pool, k)))
               for j in range(1, min(c, g) + 1))


def off_node_rows_per_token(dispatcher: str, num_experts: int, k: int, ep: int,
                            ranks_per_node: int, n_group: int = 1,
                            topk_group: int = 1) -> Fraction:
    """Expected rows one token sends off its node in dispatch (the combine returns as many)."""
    L = min(ranks_per_node, ep)
    nodes = ep // L
    if dispatcher == "hierarchical":
        return (nodes - 1) * unit_hit(num_experts // nodes, num_experts, k, n_group, topk_group)
    if dispatcher == "dedup":
        return (ep - L) * unit_hit(num_experts // ep, num_experts, k, n_group, topk_group)
    return Fraction(k * (nodes - 1), nodes)
