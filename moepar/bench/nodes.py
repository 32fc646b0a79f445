"""Rows of hidden state that leave a node, per EP dispatcher, counted from a routing (no processes,
no clocks: the same numbers on any machine). `moepar bench dispatch --gpus-per-node L` prints them
for the routing its layer made; the planner's expectation (moepar/plan/dispatch.py) is their mean
over uniform routings.

EP rank p holds experts [p*El, (p+1)*El) and sits on node p // L. Per source rank, dispatch:
alltoall sends a row per kept copy whose expert is on another node; dedup one per (token, rank)
of another node; hierarchical one per (token, node) of another node. The combine sends the same
rows back.
"""

__all__ = ["off_node_rows", "node_bytes", "DISPATCH_KINDS"]

DISPATCH_KINDS = ("alltoall", "dedup", "hierarchical")


def off_node_rows(experts_TK: list[list[int]], rank: int, ep: int, ranks_per_node: int,
                  num_experts: int) -> dict:
    """{dispatcher: {other node: rows EP rank `rank` sends it in dispatch}} for its tokens' expert
    ids `experts_TK` (ids >= num_experts are dropped copies, which never travel)."""
    per_rank = num_experts // ep
    home = rank // ranks_per_node
    out = {kind: {} for kind in DISPATCH_KINDS}
    for experts in experts_TK:
        away = [r for r in (e // per_rank for e in experts if e < num_experts)
                if r // ranks_per_node != home]
        for kind, dests in (("alltoall", away), ("dedup", set(away)),
                            ("hierarchical", {r // ranks_per_node * ranks_per_node
                                              for r in away})):
            for r in dests:
                node = r // ranks_per_node
                out[kind][node] = out[kind].get(node, 0) + 1
    return out


def node_bytes(experts_PTK: list, ep: int, ranks_per_node: int, num_experts: int,
               row_bytes: int) -> dict:
    """{dispatcher: [bytes that leave node n, dispatch + combine]} for every EP rank's routing
    (`experts_PTK[p]` is rank p's `experts_TK`); `row_bytes` = dim * element size. A dispatch row
    leaves its source's node; its combine row leaves the destination node on the way back."""
    nodes = ep // ranks_per_node
    out = {kind: [0] * nodes for kind in DISPATCH_KINDS}
    for rank, experts_TK in enumerate(experts_PTK):
        rows = off_node_rows(experts_TK, rank, ep, ranks_per_node, num_experts)
        for kind in DISPATCH_KINDS:
            for node, n in rows[kind].items():
                out[kind][rank // ranks_per_node] += n * row_bytes
                out[kind][node] += n * row_bytes
    return out
