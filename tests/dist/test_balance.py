"""Layout parity of the deferred balance losses (layers/balance.py): router.balance_loss =
'all_layers' (transformers' definition, counts of every MoE layer) and router.balance_scope =
'global' (counts over the dp ranks and the step's micro-batches so far) give, in float64, the
same losses, aux losses, grad norms and parameters at every layout as the reference run.

The reference is one process, except for the global scope with dp = 2: the scope's counts span
the dp ranks by definition, so layouts with dp = 2 are compared with the dp = 2 run (2 ranks,
nothing else split); tests/unit/test_balance.py checks that run's numbers by hand.
    python -m pytest tests/dist/test_balance.py -q
"""

import math

import pytest
import torch
import torch.distributed as dist

from configs import tiny_config
from moepar.checkpoint import load_checkpoint
from moepar.layers import Transformer
from moepar.train import Trainer
from test_parity import COMMON, DEEP, STEPS, case_train, check_parity, reference

ALL_LAYERS = ["--router.balance_loss=all_layers", "--router.balance_coeff=0.05"]
GLOBAL = ["--router.balance_scope=global", "--router.balance_coeff=0.05"]
QWEN3 = ["--router.balance_loss=all_layers", "--router.balance_scope=global",
         "--router.balance_coeff=0.05"]

ALL_LAYERS_LAYOUTS = [
    (2, ["--parallel.pp=2"]),
    (2, ["--parallel.tp=2"]),
    (2, ["--parallel.ep=2"]),
    (4, ["--parallel.pp=2", "--parallel.ep=2"]),
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1"]),
    (4, ["--parallel.pp=2", "--parallel.tp=2"]),
    (4, ["--parallel.ep=4", "--parallel.zero=3", "--train.activation_checkpointing=true"]),
]
ALL_LAYERS_DEEP = [   # MoE layers 1 and 3 of 4: stages without MoE layers, interleaving
    (2, ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b"]),
    (4, ["--parallel.pp=4"]),
    (4, ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b",
         "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=2"]),
]
# The global scope at dp = 1: one process is the reference.
GLOBAL_LAYOUTS = [
    (2, GLOBAL + ["--parallel.pp=2"]),
    (2, GLOBAL + ["--parallel.tp=2", "--parallel.ep=2"]),
    (2, QWEN3 + ["--parallel.pp=2", "--parallel.pp_virtual=2",
                 "--parallel.pp_schedule=interleaved_1f1b", *DEEP]),
    (4, QWEN3 + ["--parallel.pp=2", "--parallel.tp=2"]),
]
# The global scope at dp = 2: the plain dp = 2 run is the reference.
GLOBAL_DP2_LAYOUTS = [
    (4, ["--parallel.dp=2", "--parallel.pp=2", "--parallel.ep=2"]),
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=4"]),
    (4, ["--parallel.dp=2", "--parallel.pp=2", "--parallel.pp_virtual=2",
         "--parallel.pp_schedule=interleaved_1f1b", "--parallel.zero=1", *DEEP]),
]


@pytest.fixture(scope="module")
def single_all_layers(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("all_layers"), *ALL_LAYERS)


@pytest.fixture(scope="module")
def single_all_layers_deep(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("all_layers_deep"), *ALL_LAYERS, *DEEP)


@pytest.mark.parametrize("size, overrides", ALL_LAYERS_LAYOUTS, ids=lambda v: str(v))
def test_all_layers_parity(worlds, tmp_path, single_all_layers, size, overrides):
    check_parity(worlds, tmp_path, single_all_layers, size, [*ALL_LAYERS, *overrides])


@pytest.mark.parametrize("size, overrides", ALL_LAYERS_DEEP, ids=lambda v: str(v))
def test_all_layers_pipeline_parity(worlds, tmp_path, single_all_layers_deep, size, overrides):
    check_parity(worlds, tmp_path, single_all_layers_deep, size, [*ALL_LAYERS, *DEEP, *overrides])


def test_all_layers_is_not_per_layer(single_all_layers, tmp_path):
    """The option changes the trained loss (the parity above could pass with it ignored)."""
    _, per_layer = reference(tmp_path, "--router.balance_coeff=0.05")
    _, all_layers = single_all_layers
    assert not math.isclose(per_layer[0][2], all_layers[0][2], rel_tol=1e-3)
    assert per_layer[0][0] == all_layers[0][0]   # step 1's loss is before any update
    assert not math.isclose(per_layer[-1][0], all_layers[-1][0], rel_tol=1e-9)


@pytest.mark.parametrize("size, overrides", GLOBAL_LAYOUTS, ids=lambda v: str(v))
def test_global_scope_parity(worlds, tmp_path, size, overrides):
    deep = [o for o in overrides if o in DEEP]
    config = [o for o in overrides if o.startswith("--router.")] + deep
    single = reference(tmp_path / "ref", *config)
    check_parity(worlds, tmp_path, single, size, overrides)


def case_checkpoint_tensors(run_dir: str, overrides: list[str]):
    """Records of a run and, on rank 0, its last checkpoint loaded into one whole model."""
    records = case_train(run_dir, overrides)
    if dist.get_rank() != 0:
        return records, None
    cfg = tiny_config(run_dir, *COMMON, *overrides)
    model = Transformer(cfg.model, cfg.router).double()
    load_checkpoint(f"{run_dir}/checkpoints/step_{STEPS}", model)
    return records, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def dp2_reference(worlds, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("dp2") / "run")
    results = worlds(2).run(case_checkpoint_tensors, run_dir,
                            [*QWEN3, "--parallel.ep=1"], timeout=240)
    assert results[0][0] == results[1][0]
    return results[0]


@pytest.fixture(scope="module")
def dp2_deep_reference(worlds, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("dp2_deep") / "run")
    results = worlds(2).run(case_checkpoint_tensors, run_dir,
                            [*QWEN3, "--parallel.ep=1", *DEEP], timeout=240)
    return results[0]


@pytest.mark.parametrize("size, overrides", GLOBAL_DP2_LAYOUTS, ids=lambda v: str(v))
def test_global_scope_dp2_parity(worlds, tmp_path, dp2_reference, dp2_deep_reference, size,
                                 overrides):
    want_records, want_params = dp2_deep_reference if DEEP[0] in overrides else dp2_reference
    results = worlds(size).run(case_checkpoint_tensors, str(tmp_path / "run"),
                               [*QWEN3, *overrides], timeout=240)
    for records, _ in results:
        for step, (got, want) in enumerate(zip(records, want_records, strict=True), 1):
            for g, w in zip(got, want, strict=True):
                assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12), (step, got, want)
    params = results[0][1]
    for name, want in want_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-9, atol=1e-12, msg=name)
