"""Regional compile (train.compile, parallel/compile.py): a compiled training step equals the
eager step, no region has a graph break, and routing that changes every step recompiles nothing.

Inductor generates and builds C++ on a CPU, minutes for a few graphs on two cores: one test uses
it, on a one-block model; the others trace the same regions with the aot_eager backend (Dynamo
and AOTAutograd, which is where graph breaks and recompiles are decided, without code
generation)."""

import math

import pytest
import torch
from torch._dynamo.utils import counters

from configs import tiny_config
from moepar.layers import ModelConfig, RouterConfig, Transformer
from moepar.parallel.compile import apply_compile
from moepar.parallel.checkpointing import apply_recompute
from moepar.parallel.placement import local_tensor
from moepar.train import Trainer

STEPS = 3


def quiet(_msg):
    pass


def _run(tmp_path, name, *overrides):
    """(trainer, records, parameters after the steps, compiled graphs after each step)."""
    trainer = Trainer(tiny_config(tmp_path / name, f"--train.steps={STEPS}",
                                  "--run.checkpoint_every=0", *overrides), log=quiet)
    records, graphs = [], []
    for _ in range(STEPS):
        records.append({**trainer.train_step(), **trainer.last_stats.summary()})
        graphs.append(counters["stats"]["unique_graphs"])
    params = [local_tensor(p.detach()).clone() for p in trainer.model.parameters()]
    trainer.release()
    return trainer, records, params, graphs


def _compare(eager, compiled, rel: float):
    (trainer, ref, ref_params, _), (_, got, got_params, _) = eager, compiled
    for want, have in zip(ref, got, strict=True):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert math.isclose(have[key], want[key], rel_tol=rel), (key, have[key], want[key])
    # AdamW's step is lr * m / (sqrt(v) + eps): for an element whose gradient sits near eps (an
    # expert that got almost no rows) a rounding-level change of the gradient moves the step by
    # a fraction of lr (measured: 1.3e-6 at lr 3e-3, one element of 2048, once the loss formed its
    # gradients in forward): the bound is rel of the tensor's largest value, or 1e-3 of the peak
    # learning rate per step, whichever is larger.
    lr_bound = 1e-3 * trainer.cfg.train.lr * len(ref)
    for want, have in zip(ref_params, got_params, strict=True):
        torch.testing.assert_close(have, want, rtol=rel,
                                   atol=max(rel * want.abs().max().item(), lr_bound))


def _fresh():
    torch._dynamo.reset()      # this test's graphs only, counted from zero
    counters.clear()


@pytest.mark.timeout(900)
def test_inductor_step_equals_eager_float32(tmp_path):
    """One MoE block, float32, Inductor: 3 steps equal the eager ones to 1e-5 (loss, grad norm,
    aux loss, updated parameters). Four graphs: the two norms share one (same code, same
    shapes), attention, router, experts' activation; the routing changes every step (other
    rows per expert, other R), and no step after the first compiles anything."""
    one_block = ["--model.num_layers=1", "--router.capacity_factor=1.0", "--router.z_coeff=0.001"]
    eager = _run(tmp_path, "eager", *one_block)
    _fresh()
    compiled = _run(tmp_path, "compiled", *one_block, "--train.compile=true")
    _compare(eager, compiled, 1e-5)
    assert dict(counters["graph_break"]) == {}
    assert compiled[3] == [4] * STEPS            # unique graphs after each step: no recompile
    assert compiled[0].engine.compiled.count == 5   # 2 norms, attention, router, activation
    assert eager[1][0]["drop_fraction"] > 0     # capacity at work in the compiled router


def test_regions_trace_whole_float64(tmp_path):
    """A dense block and an MoE block with a shared expert, float64, traced by aot_eager: the
    step equals the eager step to 1e-10, and six graphs (norm, attention, dense FFN, router,
    shared experts, activation) hold every region without a break."""
    model = ["--train.dtype=float64", "--model.first_k_dense=1", "--model.num_shared_experts=1",
             "--router.capacity_factor=1.0", "--router.seq_balance_coeff=0.01"]
    eager = _run(tmp_path, "eager", *model)
    _fresh()
    compiled = _run(tmp_path, "compiled", *model, "--train.compile=true",
                    "--train.compile_backend=aot_eager")
    _compare(eager, compiled, 1e-10)
    assert dict(counters["graph_break"]) == {}
    assert compiled[3] == [6] * STEPS
    assert compiled[0].engine.compiled.per_layer == {0: 4, 1: 6}


def test_recompute_regions_compile_with_their_checkpoint():
    """train.recompute='attention' wraps attention in a checkpoint before compile: the compiled
    region holds the checkpoint (Dynamo traces it), and gradients equal eager ones."""
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      moe_ffn_dim=32, num_experts=4, top_k=2, max_seq_len=16)
    torch.manual_seed(0)
    eager = Transformer(cfg, RouterConfig(), seed=0).double()
    compiled = Transformer(cfg, RouterConfig(), seed=0).double()
    for model in (eager, compiled):
        apply_recompute(model, "attention")
    _fresh()
    apply_compile(compiled, "aot_eager")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        logits, outs = model(tokens)
        (logits.logsumexp(-1).mean() + sum(o.aux_loss.total for o in outs)).backward()
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-14)
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 4


def test_bad_backend_is_refused(tmp_path):
    with pytest.raises(ValueError, match="train.compile_backend='tvm' is not one of"):
        tiny_config(tmp_path, "--train.compile_backend=tvm")
