"""Expert placement maths (parallel/expert_map.py, moepar/expert_placement.py): the balanced
packing on a hand-worked load, the slot mapping of routed copies, and the errors a bad
placement file or config gives."""

import json

import pytest
import torch

from moepar.config import load_config
from moepar.expert_placement import measured_load, read_placement, write_placement
from moepar.layers import Routing
from moepar.parallel.expert_map import (ExpertMap, PlacedDispatcher, balanced, contiguous,
                                        imbalance, rank_rows)
from moepar.plan.source import placement_imbalance

# Expert 0 is hot (8 of 16 copies), the rest even, expert 7 a little warm.
LOAD = [8, 1, 1, 1, 1, 1, 1, 2]


def test_contiguous_imbalance_by_hand():
    # rank 0: experts 0-3 = 8+1+1+1 = 11 rows, rank 1: 1+1+1+2 = 5; mean 8.
    assert rank_rows(contiguous(8, 2), LOAD) == [11, 5]
    assert imbalance(contiguous(8, 2), LOAD) == 11 / 8


def test_balanced_without_replicas_by_hand():
    # Heaviest first to the least-loaded rank with a free slot: 0 -> r0 (8), 7 -> r1 (2),
    # 1, 2, 3 -> r1 (5, full), 4, 5, 6 -> r0 (11). The hot expert alone sets rank 0's load.
    m = balanced(LOAD, ep=2)
    assert m.per_rank() == [[0, 4, 5, 6], [7, 1, 2, 3]]
    assert rank_rows(m, LOAD) == [11, 5]


def test_balanced_replicates_the_hot_expert_by_hand():
    # Two replica slots: expert 0 gets a second copy (4 rows each), then expert 7 (1 each).
    # Owned: 0 -> r0 (4), 1..4 -> r1 (4, full), 5, 6, 7 -> r0 (7); replicas: 0 -> r1 (8),
    # 7 -> r0 (8): perfectly even, against 11/8 contiguous.
    m = balanced(LOAD, ep=2, replicas=1)
    assert m.per_rank() == [[0, 5, 6, 7, 7], [1, 2, 3, 4, 0]]
    assert rank_rows(m, LOAD) == [8, 8]
    assert m.replicas == 1 and m.owner()[0] == (0, 0) and m.owner()[4] == (1, 3)


def test_balanced_fills_nodes_before_ranks():
    # ep 4 in two nodes of two ranks: the two hot experts land on different nodes.
    m = balanced([10, 10, 1, 1, 1, 1, 1, 1], ep=4, ranks_per_node=2)
    node_of = {e: r // 2 for r in range(4) for e in m.owned(r)}
    assert node_of[0] != node_of[1]


def test_to_slots_by_hand():
    m = ExpertMap((1, 0, 0, 1), num_experts=2, ep=2)   # r0 owns 1, replica 0; r1 owns 0, rep 1
    d = PlacedDispatcher(None, m)
    routing = Routing(token_N=torch.tensor([0, 0, 1, 1, 2, 2]),
                      expert_N=torch.tensor([0, 1, 0, 2, 1, 0]),
                      weight_N=torch.ones(6), top_k=2)
    # expert 0 lives in slots (1, 2), expert 1 in (0, 3); the copy of token t takes slot t % 2.
    assert d.to_slots(routing).expert_N.tolist() == [1, 0, 2, 4, 0, 1]


def test_bad_maps_are_refused():
    with pytest.raises(ValueError, match="each rank.*must hold every expert once.*missing \\[0\\]"):
        ExpertMap((1, 0, 1, 0), num_experts=2, ep=2)     # both ranks own expert 1
    with pytest.raises(ValueError, match="not in \\[0, 4\\)"):
        ExpertMap((0, 1, 2, 4), num_experts=4, ep=2)
    with pytest.raises(ValueError, match="cannot be split equally"):
        ExpertMap((0, 1, 2, 3, 0), num_experts=4, ep=2)


def test_placement_file_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "p.json")
    m = balanced(LOAD, ep=2, replicas=1)
    write_placement(path, {0: m, 2: m})
    assert read_placement(path, [0, 2], 8, 2, 1) == {0: m, 2: m}
    with pytest.raises(ValueError, match="ep=2; this run has num_experts=8, ep=4"):
        read_placement(path, [0, 2], 8, 4, 1)
    with pytest.raises(ValueError, match="4 owned \\+ 0 replica slots"):
        read_placement(path, [0, 2], 8, 2, 0)
    with pytest.raises(ValueError, match="every MoE layer number \\[0, 1\\]"):
        read_placement(path, [0, 1], 8, 2, 1)
    data = json.load(open(path))
    data["layers"]["2"][1][3] = 5       # expert 4 owned nowhere, expert 5 twice
    json.dump(data, open(path, "w"))
    with pytest.raises(ValueError, match="layer 2.*missing \\[4\\], more than once \\[5\\]"):
        read_placement(path, [0, 2], 8, 2, 1)
    with pytest.raises(ValueError, match="no such file"):
        read_placement(str(tmp_path / "nope.json"), [0], 8, 2, 0)


@pytest.mark.parametrize("overrides, match", [
    (["--parallel.expert_placement=balanced"], "needs parallel.placement_from"),
    (["--parallel.expert_replicas=1"], "contiguous placement has no replica slots"),
    (["--parallel.placement_from=run"], "only read by parallel.expert_placement='balanced'"),
    (["--parallel.expert_replicas=-1", "--parallel.expert_placement=x.json"], "must be >= 0"),
    (["--parallel.replace_every=2", "--parallel.zero=1"], "replace_every=2 needs parallel.zero=0"),
    (["--parallel.dispatcher=hierarchical", "--parallel.expert_placement=x.json"],
     "hierarchical' needs parallel.expert_placement='contiguous'"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def write_load(run_dir, layers, steps):
    run_dir.mkdir()
    lines = [json.dumps({"format": "moepar.expert_load", "version": 1, "layers": layers,
                         "num_experts": 8})]
    lines += [json.dumps({"step": s + 1, "tokens": tokens}) for s, tokens in enumerate(steps)]
    (run_dir / "expert_load.jsonl").write_text("\n".join(lines) + "\n")


def test_plan_takes_the_placements_imbalance_per_ep(tmp_path):
    """`moepar plan --from-run RUN --placement`: per ep, the busiest rank over the mean of the
    later half of the run's load (the first step, uniform, is left out)."""
    cfg = load_config(None, ["--model.num_experts=8", "--model.num_layers=2"])
    write_load(tmp_path / "run", [0, 1], [[[2] * 8] * 2, [LOAD, LOAD], [LOAD, LOAD]])
    plain, _ = placement_imbalance(str(tmp_path / "run"), cfg.model, 8, "contiguous", 0)
    placed, why = placement_imbalance(str(tmp_path / "run"), cfg.model, 8, "balanced", 1)
    assert plain[1] == placed[1] == 1.0 and plain[2] == 11 / 8 and placed[2] == 1.0
    assert "balanced placement with 1 replica" in why
    with pytest.raises(ValueError, match="measured 8 experts on MoE layers \\[0, 1\\]; this "
                                         "model has 8 on \\[0\\]"):
        measured_load(str(tmp_path / "run"), 0, [0], 8)
