"""Bytes that leave a node per EP dispatcher: `bench dispatch`'s count against a hand-counted
routing, and the planner's expectation against the mean of that count over every routing."""

import dataclasses
import itertools
import pathlib
from fractions import Fraction

import pytest

from moepar.bench.nodes import node_bytes, off_node_rows
from moepar.config import load_config
from moepar.plan.activations import ActSpec
from moepar.plan.dispatch import off_node_rows_per_token
from moepar.plan.hardware import PRESETS
from moepar.plan.steptime import stage_seconds

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_node_bytes_of_a_hand_counted_routing():
    """ep 6 on 3 nodes of 2 ranks, 12 experts (2 per rank: node 0 holds 0-3, node 1 4-7, node 2
    8-11), rows of 10 bytes. Rank 0 (node 0): [4, 5, 8] is 2 copies to node 1 (both on rank 2)
    and 1 to node 2; [6, 9, 11] is 1 to node 1 and 2 to node 2 (ranks 4 and 5); [0, 12, 12]
    stays (12: dropped). Rank 2 (node 1): [0, 1, 2] is 3 copies to node 0 on 2 ranks."""
    routing = [[[4, 5, 8], [6, 9, 11], [0, 12, 12]], [], [[0, 1, 2]], [], [], []]
    got = node_bytes(routing, 6, 2, 12, 10)
    # A node sends its dispatch rows, and the combine rows of what it received.
    # alltoall:      node 0: 6 out + 3 back; node 1: 3 out + 3 back; node 2: 3 back
    # dedup:         rank 0 sends node 1 2 rows (ranks 2, 3), node 2 3 rows; rank 2 2 rows
    # hierarchical:  rank 0 sends node 1 2 rows, node 2 2 rows (a token once per node); rank 2 1
    assert got == {"alltoall": [90, 60, 30], "dedup": [70, 40, 30], "hierarchical": [50, 30, 20]}
    assert off_node_rows(routing[0], 0, 6, 2, 12)["hierarchical"] == {1: 2, 2: 2}


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (2, 1), (4, 2)])
def test_planner_rows_are_the_mean_count_over_every_routing(n_group, topk_group):
    """E 8, k 2, ep 4 on 2 nodes of 2 ranks: every routing the router can make (topk_group of
    the n_group groups, then k experts among theirs), each rank's count averaged."""
    E, k, ep, L = 8, 2, 4, 2
    size = E // n_group
    routings = [list(experts) for groups in itertools.combinations(range(n_group), topk_group)
                for experts in itertools.combinations(
                    [e for g in groups for e in range(g * size, (g + 1) * size)], k)]
    for kind in ("alltoall", "dedup", "hierarchical"):
        want = off_node_rows_per_token(kind, E, k, ep, L, n_group, topk_group)
        for rank in range(ep):
            rows = off_node_rows(routings, rank, ep, L, E)[kind]
            assert Fraction(sum(rows.values()), len(routings)) == want, (kind, rank)
    # by hand: hierarchical without groups, 1 - C(4,2)/C(8,2) = 11/14; groups = nodes, 1 of 2: 1/2
    assert off_node_rows_per_token("hierarchical", 8, 2, 4, 2) == Fraction(11, 14)
    assert off_node_rows_per_token("hierarchical", 8, 2, 4, 2, 2, 1) == Fraction(1, 2)


def test_planner_charges_the_hierarchical_rows_at_network_speed():
    """16 experts, k 2, ep 16 on 2 nodes of 8: a token leaves its node for 1 - C(8,2)/C(16,2)
    = 23/30 rows, and reaches 16 * (1 - C(15,2)/C(16,2)) = 2 ranks, 7/8 of them not its relay."""
    cfg = load_config(str(EXAMPLES / "mixtral_8x7b.toml"))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_experts=16),
                              parallel=dataclasses.replace(cfg.parallel,
                                                           dispatcher="hierarchical"))
    spec = ActSpec(1, 4096, 1, 16, "bfloat16", row_factor=1.0)
    stage = {"dense": 0, "moe": 1, "first": False, "last": False, "virtual": 1}
    links = {"tp": False, "dp": False, "edp": False, "pp": False, "pp_size": 1, "dp_size": 16,
             "edp_size": 1, "ep": True, "ep_inside": 0.5}
    gpu = PRESETS["h100-80g"]
    row = 4096 * 4096 * 2                                   # t * D * bytes per row per token
    net, nvlink = gpu.inter_gbps * 0.7e9, gpu.intra_gbps * 0.7e9
    got = stage_seconds(cfg, spec, gpu, stage, links)["a2a"]
    assert got == pytest.approx(4 * (23 / 30 * row / net + 7 / 4 * row / nvlink), rel=1e-12)
