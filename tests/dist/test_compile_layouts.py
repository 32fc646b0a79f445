"""Regional compile under expert, tensor, pipeline and ZeRO-3 parallelism: in each layout the
compiled steps equal the eager steps of the same layout (float64: losses, grad norms, updated
parameter shards), with no graph break and no recompile after the first step.

The regions are traced with the aot_eager backend (Dynamo and AOTAutograd decide breaks,
guards and the backward; Inductor's kernels are layout-free and tests/unit/test_compile.py
checks them), so a case costs seconds, not minutes of C++ builds per rank."""

import math

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

from configs import tiny_config
from moepar.parallel.placement import local_tensor
from moepar.train import Trainer

STEPS = 3
COMMON = ["--train.dtype=float64", f"--train.steps={STEPS}", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--model.num_experts=8", "--router.capacity_factor=1.0",
          "--router.z_coeff=0.001", "--run.checkpoint_every=0"]


def _steps(run_dir: str, overrides: list[str]):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None)
    records, graphs = [], []
    for _ in range(STEPS):
        record = trainer.train_step()
        aux = trainer.last_stats.summary()["aux_loss"]   # read once per log window in run()
        records.append((record["loss"], record["grad_norm"], aux))
        graphs.append(counters["stats"]["unique_graphs"])
    params = [local_tensor(p.detach()).clone() for p in trainer.model.parameters()]
    trainer.release()
    return records, params, graphs


def case_compile_equals_eager(run_dir: str, overrides: list[str]):
    eager = _steps(f"{run_dir}/eager", overrides)
    torch._dynamo.reset()    # this case's compiles only (the worlds serve the whole session)
    counters.clear()
    clear_compilation_metrics()
    compiled = _steps(f"{run_dir}/compiled", [*overrides, "--train.compile=true",
                                              "--train.compile_backend=aot_eager"])
    for want, have in zip(eager[0], compiled[0], strict=True):
        for w, h in zip(want, have, strict=True):
            assert math.isclose(h, w, rel_tol=1e-10, abs_tol=1e-14), (want, have)
    for want, have in zip(eager[1], compiled[1], strict=True):
        torch.testing.assert_close(have, want, rtol=1e-10, atol=1e-14)
    frames = sorted(m.co_name for m in get_compilation_metrics() if m.is_forward)
    return dict(counters["graph_break"]), compiled[2], frames


# The frames Dynamo compiles (sorted names), each once: a second compile of one would be a
# recompile. RMSNorm, attention and the router all compile a `forward`.
LAYOUTS = [
    # FSDP2 hooks around compiled regions; experts' activation per all-to-all chunk, inside the
    # deferred-weight-gradient Function.
    (["--parallel.ep=2", "--parallel.zero=3", "--parallel.a2a_chunks=2"],
     ["activate", "forward", "forward", "forward"]),
    # Attention's maths between the sequence all-gather and reduce-scatter (its local_forward is
    # Attention.forward); the router talks on tp and stays eager.
    (["--parallel.tp=2"], ["activate", "forward", "forward"]),
    # Each stage compiles the block it keeps.
    (["--parallel.pp=2", "--parallel.zero=1"], ["activate", "forward", "forward", "forward"]),
]


@pytest.mark.parametrize("overrides, frames", LAYOUTS, ids=lambda v: str(v))
def test_compile_equals_eager(worlds, tmp_path, overrides, frames):
    results = worlds(2).run(case_compile_equals_eager, str(tmp_path), overrides, timeout=600)
    for breaks, unique_graphs, compiled in results:
        assert breaks == {}
        assert compiled == frames
        assert unique_graphs[1:] == unique_graphs[:-1], unique_graphs   # none after step 1
