"""Layout maths without processes: ParallelDims coordinates and groups against hand-written tables,
its errors, the source-major -> expert-major permutation against a naive construction, and the
batch-size check in build_dims."""

import random
import re

import pytest
import torch

from configs import tiny_config
from moepar.parallel.alltoall import source_to_expert_major
from moepar.parallel.dims import Coords, Layout, ParallelDims
from moepar.build import build_dims

# ---- coordinates -----------------------------------------------------------------------------
# Hand-computed: dense rank = (pp * dp + dp_rank) * tp + tp_rank; inside a stage the dp*tp ranks
# are re-read as (edp, ep) with ep innermost. Rows are (pp, dp, tp, edp, ep) for ranks 0, 1, ...

LAYOUTS = {
    "pp2_dp2_tp2_ep2": (dict(world_size=8, pp=2, dp=2, tp=2, ep=2), [
        (0, 0, 0, 0, 0), (0, 0, 1, 0, 1), (0, 1, 0, 1, 0), (0, 1, 1, 1, 1),
        (1, 0, 0, 0, 0), (1, 0, 1, 0, 1), (1, 1, 0, 1, 0), (1, 1, 1, 1, 1)]),
    "pp2_dp2_tp2_ep4": (dict(world_size=8, pp=2, dp=2, tp=2, ep=4), [
        (0, 0, 0, 0, 0), (0, 0, 1, 0, 1), (0, 1, 0, 0, 2), (0, 1, 1, 0, 3),
        (1, 0, 0, 0, 0), (1, 0, 1, 0, 1), (1, 1, 0, 0, 2), (1, 1, 1, 0, 3)]),
    "dp4_ep2": (dict(world_size=4, dp=4, ep=2), [
        (0, 0, 0, 0, 0), (0, 1, 0, 0, 1), (0, 2, 0, 1, 0), (0, 3, 0, 1, 1)]),
    "dp2_tp4_ep2": (dict(world_size=8, dp=2, tp=4, ep=2), [   # ep < tp: EP inside the tp group
        (0, 0, 0, 0, 0), (0, 0, 1, 0, 1), (0, 0, 2, 1, 0), (0, 0, 3, 1, 1),
        (0, 1, 0, 2, 0), (0, 1, 1, 2, 1), (0, 1, 2, 3, 0), (0, 1, 3, 3, 1)]),
    "single": (dict(world_size=1), [(0, 0, 0, 0, 0)]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_coords_hand_table(layout):
    kwargs, table = LAYOUTS[layout]
    dims = ParallelDims(**kwargs)
    assert [dims.coords(r) for r in range(dims.world_size)] == [Coords(*row) for row in table]
    assert dims.edp == dims.dp * dims.tp // dims.ep


def test_coords_outside_world_raise():
    dims = ParallelDims(4, dp=4, ep=2)
    for rank in (-1, 4):
        with pytest.raises(ValueError, match=f"rank {rank} outside world size 4"):
            dims.coords(rank)


# ---- groups ----------------------------------------------------------------------------------

GROUPS = {
    "pp2_dp2_tp2_ep2": {
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],       # ep == tp: the tp groups
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
    "pp2_dp2_tp2_ep4": {
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],           # a whole stage
        "edp": [[r] for r in range(8)],
    },
    "dp4_ep2": {
        "pp": [[r] for r in range(4)],
        "dp": [[0, 1, 2, 3]],
        "tp": [[r] for r in range(4)],
        "ep": [[0, 1], [2, 3]],
        "edp": [[0, 2], [1, 3]],
    },
    "dp2_tp4_ep2": {
        "pp": [[r] for r in range(8)],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
}


@pytest.mark.parametrize("layout", GROUPS)
def test_group_ranks_hand_lists(layout):
    dims = ParallelDims(**LAYOUTS[layout][0])
    for axis, groups in GROUPS[layout].items():
        for group in groups:
            for rank in group:
                assert dims.group_ranks(axis, rank) == group, (axis, rank)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_partition_the_world(layout):
    dims = ParallelDims(**LAYOUTS[layout][0])
    for axis in ("pp", "dp", "tp", "edp", "ep"):
        groups = {tuple(dims.group_ranks(axis, r)) for r in range(dims.world_size)}
        covered = sorted(r for g in groups for r in g)
        assert covered == list(range(dims.world_size)), (axis, groups)   # each rank exactly once
        assert {len(g) for g in groups} == {getattr(dims, axis)}, (axis, groups)


# ---- errors ----------------------------------------------------------------------------------

def _names_all(message: str, *parts: str):
    for part in parts:
        assert part in message, (part, message)


def test_product_not_world_names_every_degree():
    with pytest.raises(ValueError) as err:
        ParallelDims(8, pp=2, dp=3, tp=2)
    _names_all(str(err.value), "world size 8", "parallel.pp=2", "parallel.dp=3", "parallel.tp=2",
               "12")


def test_ep_not_dividing_dp_tp_names_every_factor():
    for kwargs in (dict(world_size=8, pp=2, dp=2, tp=2, ep=3),
                   dict(world_size=8, pp=2, dp=2, tp=2, ep=8)):   # larger than a stage
        with pytest.raises(ValueError) as err:
            ParallelDims(**kwargs)
        _names_all(str(err.value), f"parallel.ep={kwargs['ep']}", "parallel.dp", "parallel.tp",
                   "2 * 2 = 4")


def test_num_experts_not_divisible_by_ep():
    with pytest.raises(ValueError) as err:
        ParallelDims(4, dp=4, ep=4, num_experts=6)
    _names_all(str(err.value), "model.num_experts=6", "parallel.ep=4")
    assert ParallelDims(4, dp=4, ep=4, num_experts=8).ep == 4


@pytest.mark.parametrize("name", ["pp", "dp", "tp", "ep"])
@pytest.mark.parametrize("value", [0, -1])
def test_degree_below_one(name, value):
    kwargs = dict(world_size=4, pp=1, dp=4, tp=1, ep=1, num_experts=4)
    kwargs[name] = value
    with pytest.raises(ValueError, match=re.escape(f"parallel.{name}={value} must be >= 1")):
        ParallelDims(**kwargs)


def test_world_size_below_one():
    with pytest.raises(ValueError, match="world size"):
        ParallelDims(0)


def test_resolve_derives_dp():
    assert ParallelDims.resolve(8, pp=2, tp=2).dp == 2
    assert ParallelDims.resolve(6, tp=2).dp == 3
    assert ParallelDims.resolve(4, ep=2, num_experts=4) == ParallelDims(4, 1, 4, 1, 2, 4)
    assert ParallelDims.resolve(8, pp=2, dp=4).dp == 4           # explicit dp is kept


def test_resolve_not_divisible_names_every_factor():
    with pytest.raises(ValueError) as err:
        ParallelDims.resolve(8, pp=3, tp=1)
    _names_all(str(err.value), "world size 8", "parallel.pp=3", "parallel.tp=1", "parallel.dp")
    with pytest.raises(ValueError) as err:
        ParallelDims.resolve(6, pp=2, tp=2)
    _names_all(str(err.value), "world size 6", "parallel.pp=2", "parallel.tp=2")


@pytest.mark.parametrize("name, value", [("pp", 0), ("tp", 0), ("tp", -2)])
def test_resolve_checks_degrees_before_deriving_dp(name, value):
    kwargs = dict(pp=1, tp=1)
    kwargs[name] = value
    with pytest.raises(ValueError, match=re.escape(f"parallel.{name}={value}")):
        ParallelDims.resolve(8, dp=0, **kwargs)


# ---- source-major -> expert-major ------------------------------------------------------------

def naive_expert_major(counts: list[list[int]]) -> list[int]:
    """Label arriving rows by position (source-major), then read them out expert by expert."""
    arrival, position = {}, 0
    for s, row in enumerate(counts):
        for e, n in enumerate(row):
            arrival[s, e] = list(range(position, position + n))
            position += n
    num_local = len(counts[0])
    return [i for e in range(num_local) for s in range(len(counts)) for i in arrival[s, e]]


def test_source_to_expert_major_hand_case():
    # source 0 sends 1 row to expert 0, 2 to expert 1; source 1 sends 3 to expert 0.
    # arrival: [s0e0 | s0e1 s0e1 | s1e0 s1e0 s1e0] -> expert-major: [s0e0 s1e0*3 | s0e1*2]
    assert source_to_expert_major([[1, 2], [3, 0]]).tolist() == [0, 3, 4, 5, 1, 2]


@pytest.mark.parametrize("seed", range(20))
def test_source_to_expert_major_random(seed):
    rng = random.Random(seed)
    sources, local = rng.randint(1, 5), rng.randint(1, 4)
    counts = [[rng.choice([0, 0, 1, 2, 3, 7]) for _ in range(local)] for _ in range(sources)]
    got = source_to_expert_major(counts)
    assert got.dtype == torch.long
    assert got.tolist() == naive_expert_major(counts), counts
    assert sorted(got.tolist()) == list(range(sum(map(sum, counts))))   # a permutation


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (4, 2)])
def test_source_to_expert_major_all_zero(shape):
    got = source_to_expert_major([[0] * shape[1] for _ in range(shape[0])])
    assert got.dtype == torch.long and got.numel() == 0


# ---- build_dims ------------------------------------------------------------------------------

def test_build_dims_batch_not_divisible_names_all_three(tmp_path):
    cfg = tiny_config(tmp_path, "--train.global_batch_size=6", "--train.micro_batch_size=2")
    with pytest.raises(ValueError) as err:
        build_dims(cfg, 2)           # 6 % (2 * 2)
    _names_all(str(err.value), "train.global_batch_size=6", "train.micro_batch_size=2", "dp=2")
    cfg = tiny_config(tmp_path, "--train.global_batch_size=4", "--train.micro_batch_size=2")
    with pytest.raises(ValueError) as err:
        build_dims(cfg, 4)           # 4 % (2 * 4)
    _names_all(str(err.value), "train.global_batch_size=4", "train.micro_batch_size=2", "dp=4")


def test_build_dims_resolves_layout(tmp_path):
    cfg = tiny_config(tmp_path, "--train.global_batch_size=8", "--parallel.ep=2")
    assert build_dims(cfg, 4) == ParallelDims(4, 1, 4, 1, 2, 4)
    assert build_dims(cfg, 2) == ParallelDims(2, 1, 2, 1, 2, 4)


def test_build_dims_interleaved_needs_micro_batches_in_multiples_of_pp(tmp_path):
    cfg = tiny_config(tmp_path, "--parallel.pp=2", "--parallel.pp_virtual=2", "--model.num_layers=4",
                      "--parallel.pp_schedule=interleaved_1f1b", "--train.global_batch_size=6")
    with pytest.raises(ValueError, match=r"micro-batches per step \(3\) to be a multiple of pp=2"):
        build_dims(cfg, 2)           # 6 / 2 = 3 micro-batches on one pipeline
    cfg = tiny_config(tmp_path, "--parallel.pp=2", "--parallel.pp_virtual=2", "--model.num_layers=4",
                      "--parallel.pp_schedule=interleaved_1f1b", "--train.global_batch_size=8")
    assert build_dims(cfg, 4) == ParallelDims(4, 2, 2, 1, 1, 4)   # dp 2: 2 micro-batches each


def _members(dims, axis):
    """Every group of `axis` as a set of ranks, from the rank maths (naive)."""
    return {tuple(dims.group_ranks(axis, r)) for r in range(dims.world_size)}


@pytest.mark.parametrize("kwargs, node, inside, across", [
    (dict(world_size=32, pp=2, dp=8, tp=2, ep=4), 8, {"tp", "ep"}, {"dp", "edp", "pp"}),
    (dict(world_size=64, pp=4, dp=16, tp=1, ep=8), 8, {"ep"}, {"dp", "edp", "pp"}),
    (dict(world_size=16, pp=1, dp=2, tp=8, ep=16), 8, {"tp"}, {"dp", "ep", "edp"}),
    (dict(world_size=24, pp=4, dp=3, tp=2, ep=6), 8, {"tp"}, {"dp", "ep", "pp"}),
    (dict(world_size=16, pp=2, dp=8, tp=1, ep=2), 16, {"dp", "ep", "edp", "pp"}, set()),
])
def test_which_groups_span_nodes(kwargs, node, inside, across):
    """tp first, then ep, stay inside a node when the node size allows; checked against the
    naive group membership (node = rank // ranks per node)."""
    dims = ParallelDims(**kwargs, gpus_per_node=node)
    for axis in ("tp", "dp", "pp", "ep", "edp"):
        groups = _members(dims, axis)
        naive = any(len({r // node for r in g}) > 1 for g in groups)
        assert dims.spans_nodes(axis) == naive, axis
        if len(next(iter(groups))) > 1:
            assert (axis in across) == naive, (axis, dims.describe_nodes())
            assert (axis in inside) == (not naive), axis


def test_gpus_per_node_must_divide_the_world():
    with pytest.raises(ValueError, match="gpus_per_node=3 must divide the world size 8"):
        ParallelDims(8, dp=8, gpus_per_node=3)
    assert ParallelDims(8, dp=8, gpus_per_node=4).describe_nodes().startswith("2 nodes of 4")


def test_world_collectives_are_no_ops_alone():
    """Alone (or standing in for one rank of a larger layout, without meshes) the layout's world
    collectives return their input and call nothing: no process group exists here, so any
    torch.distributed call would raise."""
    for dims in (ParallelDims(1), ParallelDims(4, dp=4)):
        cpu = torch.device("cpu")
        layout = dims.bind(0, cpu) if dims.world_size == 1 else Layout(dims, 2, cpu, None)
        assert layout.world == 1
        flags = torch.tensor([0.0, 1.0])
        assert layout.all_reduce(flags, "max") is flags and flags.tolist() == [0.0, 1.0]
        assert layout.from_rank0({"a": 1}) == {"a": 1}
        assert layout.everyone("x") == ["x"] and layout.gather_to_first("x") == ["x"]
        layout.barrier()
