"""Layout parity of the deferred balance losses (layers/balance.py): router.balance_loss =
'all_layers' (transformers' definition, counts of every MoE layer) and router.balance_scope =
'global' (counts over the dp ranks and the step's micro-batches so far) give, in float64, the
same losses, aux losses, grad norms and parameters at every layout as the reference run.

The reference is one process, except for the global scope with dp = 2: the scope's counts span
the dp ranks by definition, so layouts with dp = 2 are compared with the dp = 2 run (2 ranks,
nothing else split), whose gradients are checked against a hand computation below.
    python -m pytest tests/dist/test_balance_parity.py -q
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


# ---- the global scope's semantics, by hand -------------------------------------------------

def hand_reference(run_dir: str, overrides: list[str], dp: int):
    """One step's gradients and aux loss with the global-scope balance loss built in plain
    autograd from a model that trains no balance loss itself (balance_coeff 0, same initial
    values): micro-batch j of dp rank d takes f from the counts of micro-batches 0..j of every
    dp rank (rank d holds the step's global micro-batches d*m .. d*m+m-1), P from its own."""
    cfg = tiny_config(run_dir, *COMMON, *overrides)
    coeff, all_layers = cfg.router.balance_coeff, cfg.router.balance_loss == "all_layers"
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides, "--router.balance_coeff=0"),
                      log=lambda _m: None)
    model, E, K = trainer.model, cfg.model.num_experts, cfg.model.top_k
    num_micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    m = num_micro // dp
    model.set_aux_loss_scale(1.0 / num_micro)   # the z and sequence losses, as the trainer
    probs = []
    for moe in model.moe_layers():      # record each router's probabilities, with their graph
        moe.router.balance_probs = (lambda f: lambda s: probs.append(f(s)) or probs[-1])(
            moe.router.balance_probs)
    runs = []
    for g in range(num_micro):
        probs.clear()
        logits, outs = model(trainer.sampler.batch(g)[0])
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                               trainer.sampler.batch(g)[1].flatten())
        counts = [o.stats.tokens_per_expert_E.double() for o in outs]
        runs.append((ce, list(probs), counts))
    total, aux = 0.0, 0.0
    for g, (ce, probs_L, counts_L) in enumerate(runs):
        j = g % m
        seen = [g2 for g2 in range(num_micro) if g2 % m <= j]     # every rank's 0..j
        tokens = probs_L[0].shape[0]
        if all_layers:
            f = sum(c for g2 in seen for c in runs[g2][2]) / (len(seen) * len(counts_L) * tokens)
            p = sum(pr.sum(0) for pr in probs_L) / (len(counts_L) * tokens)
            balance = E * torch.sum(f * p)
        else:
            balance = sum(E * torch.sum(sum(runs[g2][2][l] for g2 in seen)
                                        / (len(seen) * tokens * K) * probs_L[l].mean(0))
                          for l in range(len(counts_L)))
        total = total + (ce + coeff * balance) / num_micro
        aux += float(coeff * balance.detach()) / num_micro
    total.backward()
    return {n: p.grad for n, p in model.named_parameters()}, aux


# Dropless, and no sequence-wise loss in the logged aux loss (the z-loss stays, trained alike).
HAND = ["--router.capacity_factor=none", "--router.seq_balance_coeff=0"]


def case_first_step_grads(run_dir: str, overrides: list[str]):
    """Gradients (synced) and logged aux loss of the first step, on rank 0 (others: None)."""
    from moepar.metrics import StepStats
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None)
    engine = trainer.engine
    stats = StepStats(len(engine.moe_layer_ids), trainer.cfg.model.num_experts, trainer.device)
    loss_sum = trainer.forward_backward(stats)
    engine.finish_step(stats, loss_sum)
    grads = {n: engine.sync.grad_view(p).clone() for n, p in trainer.model.named_parameters()}
    return (grads, stats.summary()["aux_loss"]) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("router", [GLOBAL, QWEN3], ids=["per_layer", "all_layers"])
def test_global_scope_spans_dp_ranks_and_earlier_micro_batches(worlds, tmp_path, router):
    overrides = [*router, *HAND, "--parallel.ep=1"]
    want, want_aux = hand_reference(str(tmp_path / "ref"), overrides, dp=2)
    got, got_aux = worlds(2).run(case_first_step_grads, str(tmp_path / "run"), overrides,
                                 timeout=240)[0]
    assert math.isclose(got_aux, want_aux, rel_tol=1e-10)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-13, msg=name)


@pytest.mark.parametrize("router", [GLOBAL, QWEN3], ids=["per_layer", "all_layers"])
def test_global_scope_running_sum_on_one_process(tmp_path, router):
    """dp = 1: micro-batch j's counts are those of micro-batches 0..j of the step."""
    overrides = [*router, *HAND]
    want, want_aux = hand_reference(str(tmp_path / "ref"), overrides, dp=1)
    from moepar.metrics import StepStats
    trainer = Trainer(tiny_config(str(tmp_path / "run"), *COMMON, *overrides), log=lambda _m: None)
    stats = StepStats(len(trainer.engine.moe_layer_ids), 8, trainer.device)
    trainer.engine.finish_step(stats, trainer.forward_backward(stats))
    assert math.isclose(stats.summary()["aux_loss"], want_aux, rel_tol=1e-10)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-13, msg=name)
