"""Node-aligned expert groups for parallel.dispatcher = "hierarchical": where experts land (the EP
sharding) puts each router group on one node, and layouts where it cannot are refused by the
config or the launcher's node size, naming the keys, before any process group exists."""

import pytest

from moepar.build import build_dims
from moepar.config import load_config
from moepar.layers.experts import GroupedExperts
from moepar.parallel.expert import shard_experts
from moepar.parallel.hierarchical import node_layout


@pytest.mark.parametrize("experts, ep, node, n_group", [
    (8, 4, 2, 2), (16, 8, 2, 4), (16, 8, 2, 8), (8, 4, 4, 1), (8, 2, 4, 4)])
def test_each_group_lives_on_one_node(experts, ep, node, n_group):
    ranks = node_layout(ep, node, experts, n_group)
    holder = {}
    for ep_rank in range(ep):        # the sharding apply_ep does, rank by rank
        module = GroupedExperts(experts, 2, 2)
        shard_experts(module, ep, ep_rank)
        for e in range(module.expert_offset, module.expert_offset + module.num_experts):
            holder[e] = ep_rank
    per_group = experts // n_group
    for g in range(n_group):
        nodes = {holder[e] // ranks for e in range(g * per_group, (g + 1) * per_group)}
        assert len(nodes) == 1, (g, nodes)
    assert ranks == min(ep, node)


def test_uneven_nodes_are_refused_by_the_config():
    with pytest.raises(ValueError, match=r"parallel\.ep=4 must be a multiple of "
                                         r"parallel\.gpus_per_node=3"):
        load_config(None, ["--parallel.ep=4", "--parallel.dispatcher=hierarchical",
                           "--parallel.gpus_per_node=3"])


def test_groups_across_nodes_are_refused_by_the_config():
    # 8 experts, ep 4 on 2 nodes of 2 ranks: 2 groups of 4 experts are the 2 nodes. ep 8 on 4
    # nodes holds 2 experts per node: a group of 4 would straddle two.
    load_config(None, ["--parallel.ep=4", "--parallel.dispatcher=hierarchical",
                       "--parallel.gpus_per_node=2", "--router.n_group=2", "--router.topk_group=1"])
    with pytest.raises(ValueError, match=r"router\.n_group=2 must be a multiple of the 4 nodes.*"
                                         r"4 experts per group against 2 per node"):
        load_config(None, ["--model.num_experts=8", "--parallel.ep=8", "--parallel.gpus_per_node=2",
                           "--parallel.dispatcher=hierarchical", "--router.n_group=2",
                           "--router.topk_group=1"])


def test_launcher_node_size_is_checked_before_any_collective(monkeypatch):
    """gpus_per_node 0 takes LOCAL_WORLD_SIZE: 3 ranks per node cannot hold ep 4 evenly."""
    cfg = load_config(None, ["--parallel.ep=4", "--parallel.dispatcher=hierarchical",
                             "--parallel.dp=12", "--train.global_batch_size=24",
                             "--train.micro_batch_size=2"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"parallel\.ep=4 must be a multiple of "
                                         r"parallel\.gpus_per_node=3"):
        build_dims(cfg, 12)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert build_dims(cfg, 12).gpus_per_node == 2
