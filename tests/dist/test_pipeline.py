"""Pipeline parallelism: every schedule, in float64, equals plain gradient accumulation on one
process (loss, every parameter's gradient, MoE statistics per micro-batch), with MoE layers on
every stage or only some, aux-loss gradients reaching the routers of every stage, and EP inside
the stages; and each schedule holds the micro-batches alive that it promises."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from configs import tiny_config, tiny_model, token_batches
from moepar.layers.experts import GroupedExperts
from moepar.parallel.dims import ParallelDims
from moepar.parallel.expert import apply_ep
from moepar.parallel.pipeline import apply_pp
from moepar.parallel.pipeline_runner import PipelineRunner
from moepar.parallel.loss import cross_entropy
from moepar.parallel.schedules import measured_bubble, peak_in_flight, rank_order


def aux_only(h_BSD, w_VD, targets_BS, grad_scale=None):
    """No language-model gradient at all: whatever reaches a router comes from its aux losses."""
    return 0.0 * F.linear(h_BSD, w_VD).sum()


LOSSES = {"ce": cross_entropy, "aux_only": aux_only}


def reference_step(model, inputs, targets, loss_fn):
    """Plain gradient accumulation on one process, as the trainer does without pipelining."""
    m = len(inputs)
    model.set_aux_loss_scale(1.0 / m)
    total, moe = 0.0, []
    for x, y in zip(inputs, targets):
        logits, outs = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) if loss_fn is cross_entropy \
            else 0.0 * logits.sum()
        (loss / m).backward()
        total += loss.item()
        moe.append(outs)
    return total, moe


def case_parity(schedule: str, pp: int, virtual: int, m: int, model_kw: dict, loss: str = "ce",
                ep: int = 1):
    """Each dp rank pipelines its block of m micro-batches; the reference runs all of them."""
    rank, size = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(size, pp=pp, dp=size // pp, ep=ep, num_experts=4)
    meshes = dims.build_meshes("cpu")
    coords = dims.coords(rank)
    reference = tiny_model(**model_kw)
    full = copy.deepcopy(reference)
    if ep > 1:
        apply_ep(full, dims, meshes, rank)
    stage = apply_pp(full, coords.pp, pp, virtual)
    inputs, targets = token_batches(m * dims.dp)
    mine = slice(coords.dp * m, (coords.dp + 1) * m)
    runner = PipelineRunner(stage, m, LOSSES[loss], pp_group=meshes.group("pp"), schedule=schedule)
    loss_sum, moe_outputs = runner.run(inputs[mine], targets[mine])
    dist.all_reduce(loss_sum, group=meshes.group("pp"))   # zero off the last stage, as the trainer
    want_sum, want_moe = reference_step(reference, inputs, targets, LOSSES[loss])

    # The loss, on every rank (summed over dp, as the trainer's step-end all-reduce does).
    dist.all_reduce(loss_sum, group=meshes.group("dp"))
    assert float(loss_sum) == pytest.approx(want_sum, rel=1e-10, abs=1e-12)
    # Gradients: dense ones averaged over dp; expert ones summed over edp (size 1 here), / dp.
    expert_ids = {id(p) for mod in stage.modules() if isinstance(mod, GroupedExperts)
                  for p in mod.parameters()}
    want = dict(reference.named_parameters())
    for name, p in stage.named_parameters():
        grad = p.grad.clone()
        if id(p) not in expert_ids:
            dist.all_reduce(grad, group=meshes.group("dp"))
        grad /= dims.dp
        ref = want[name].grad
        if id(p) in expert_ids:     # this EP rank's block of experts
            first = coords.ep * p.shape[0]
            ref = ref[first:first + p.shape[0]]
        torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-13, msg=name)
        if name.endswith("router.weight"):
            assert ref.abs().max() > 1e-8, f"{name}: no gradient reached the router"
    # MoE statistics come back per micro-batch, for this stage's layers, in layer order.
    assert len(moe_outputs) == m
    indices = stage.moe_indices()
    for n, outs in zip(range(mine.start, mine.stop), moe_outputs):
        assert len(outs) == len(stage.moe_layers()) == len(indices)
        for out, i in zip(outs, indices):
            torch.testing.assert_close(out.stats.tokens_per_expert_E,
                                       want_moe[n][i].stats.tokens_per_expert_E)
            assert float(out.stats.num_dropped) == float(want_moe[n][i].stats.num_dropped)
    order = rank_order(schedule, coords.pp, pp, virtual, m)
    assert [e.action for e in runner.events] == order
    bubble = measured_bubble(runner.events, runner.step_start, runner.step_end)
    assert 0.0 <= bubble < 1.0
    return coords.pp, runner.peak_in_flight, peak_in_flight(order), len(indices)


CASES = [
    # schedule, world, pp, virtual, m, model, loss, ep
    pytest.param("gpipe", 2, 2, 1, 4, {}, "ce", 1, id="gpipe-pp2-moe_everywhere"),
    pytest.param("1f1b", 2, 2, 1, 4, {"first_k_dense": 2}, "ce", 1, id="1f1b-pp2-stage0_dense"),
    pytest.param("1f1b", 2, 2, 1, 3, {"num_layers": 3}, "aux_only", 1,
                 id="1f1b-pp2-3_layers-aux_only"),
    pytest.param("interleaved_1f1b", 2, 2, 2, 4, {"moe_every": 2}, "ce", 1,
                 id="interleaved-pp2-v2-moe_on_rank0"),
    pytest.param("1f1b", 4, 4, 1, 6, {"moe_every": 2}, "ce", 1, id="1f1b-pp4-moe_on_stages_0_2"),
    pytest.param("1f1b", 4, 2, 1, 3, {}, "ce", 2, id="1f1b-pp2-dp2-ep2"),
]


@pytest.mark.parametrize("schedule, world, pp, virtual, m, model_kw, loss, ep", CASES)
def test_pipeline_equals_accumulation(worlds, schedule, world, pp, virtual, m, model_kw, loss, ep):
    results = worlds(world).run(case_parity, schedule, pp, virtual, m, model_kw, loss, ep,
                                timeout=120)
    for pp_rank, peak, planned, _ in results:
        assert peak == planned
        if schedule == "gpipe":
            assert peak == m
        elif schedule == "1f1b":
            assert peak == min(pp - pp_rank, m) <= pp
        else:
            assert peak < m * virtual or m == pp
    num_moe = {r[0]: r[3] for r in results}
    if model_kw.get("first_k_dense") == 2:
        assert num_moe[0] == 0 and num_moe[1] == 2     # the stage without MoE took part too


def case_trainer_bf16_backward_outside_autocast(run_dir: str):
    from moepar.train import Trainer
    trainer = Trainer(tiny_config(run_dir, "--parallel.pp=2", "--train.dtype=bfloat16",
                                  "--train.global_batch_size=8"), log=lambda _m: None)
    during_backward = []
    for p in trainer.model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda _p: during_backward.append(torch.is_autocast_enabled("cpu")))
    kept = []
    real_run = trainer.runner.run

    def run(*args, **kwargs):
        loss_sum, outputs = real_run(*args, **kwargs)
        kept.extend(o for per_micro in outputs for o in per_micro)
        return loss_sum, outputs

    trainer.runner.run = run
    trainer.train_step()
    dist.barrier()
    return (len(during_backward), any(during_backward), len(kept),
            all(o.y is None and not o.aux_loss.total.requires_grad for o in kept))


def test_trainer_pipeline_bf16_backward_runs_outside_autocast(worlds, tmp_path):
    """Autocast covers each stage's forward and loss only: backward (the router's float32 maths
    included) never runs under it, and the kept MoE outputs hold no activation or graph."""
    for grads, under_autocast, kept, detached in worlds(2).run(
            case_trainer_bf16_backward_outside_autocast, str(tmp_path), timeout=120):
        assert grads > 0 and not under_autocast
        assert kept == 4 and detached        # 4 micro-batches x 1 MoE layer on each stage
