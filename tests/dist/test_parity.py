"""Layout parity: a few float64 training steps in any layout equal the single-process steps
(losses, grad norms, updated parameters to rtol 1e-9). Grows with every parallelism."""

import math

import pytest
import torch
import torch.distributed as dist

from configs import tiny_config
from moepar.checkpoint import load_checkpoint
from moepar.layers import Transformer
from moepar.train import Trainer

STEPS = 3
COMMON = ["--train.dtype=float64", f"--train.steps={STEPS}", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--model.num_experts=8", "--router.capacity_factor=1.0",
          "--router.bias_update_rate=0.001", "--router.z_coeff=0.001",
          "--router.seq_balance_coeff=0.01", "--run.checkpoint_every=0"]


def case_train(run_dir: str, overrides: list[str]):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None)
    records = trainer.run()
    dist.barrier()
    return [(r["loss"], r["grad_norm"], r["aux_loss"], r["drop_fraction"]) for r in records]


def reference(tmp_path, *overrides):
    trainer = Trainer(tiny_config(tmp_path / "ref", *COMMON, *overrides), log=lambda _m: None)
    records = trainer.run()
    return trainer, [(r["loss"], r["grad_norm"], r["aux_loss"], r["drop_fraction"]) for r in records]


LAYOUTS = [
    (2, ["--parallel.ep=2"]),                        # dp=2, ep=2
    (4, ["--parallel.ep=4"]),                        # dp=4, ep=4
    (4, ["--parallel.dp=4", "--parallel.ep=2"]),     # two EP groups, edp=2
    (4, ["--parallel.ep=1"]),                        # pure data parallel
    (4, ["--parallel.ep=4", "--parallel.dispatcher=dedup"]),
    # 2 "nodes" of 2 ranks: a token crosses once per node, fans out inside it.
    (4, ["--parallel.ep=4", "--parallel.dispatcher=hierarchical", "--parallel.gpus_per_node=2"]),
    (4, ["--parallel.ep=4", "--parallel.dispatcher=hierarchical", "--parallel.gpus_per_node=2",
         "--parallel.zero=3", "--train.recompute=experts"]),
    (2, ["--parallel.ep=2", "--parallel.dispatcher=allgather"]),
    # ZeRO: dense state over dp, expert state over edp; small buckets so there are many shards.
    (2, ["--parallel.ep=2", "--parallel.zero=1", "--parallel.bucket_mb=0.002"]),
    (4, ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=1"]),
    (2, ["--parallel.ep=2", "--parallel.zero=2", "--parallel.bucket_mb=0.002"]),
    (4, ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=2", "--parallel.bucket_mb=0.002"]),
    (2, ["--parallel.ep=2", "--parallel.zero=3"]),
    (4, ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=3"]),
    (4, ["--parallel.ep=4", "--parallel.zero=3", "--train.activation_checkpointing=true"]),
    # Pipeline: one layer per stage, alone and with dp, ep and ZeRO inside the stages.
    (2, ["--parallel.pp=2"]),
    (2, ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"]),
    (4, ["--parallel.pp=2", "--parallel.ep=2"]),
    (4, ["--parallel.pp=2", "--parallel.dp=2", "--parallel.zero=1"]),
    (4, ["--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=2", "--parallel.bucket_mb=0.002"]),
    (4, ["--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=3"]),
    # Expert chunks pipelined between asynchronous all-to-alls: the blocking path's numbers.
    (4, ["--parallel.ep=4", "--parallel.a2a_chunks=2"]),
    (4, ["--parallel.pp=2", "--parallel.ep=2", "--parallel.a2a_chunks=4", "--parallel.zero=1"]),
    # ZeRO-3 resharding each layer's experts within backward, their weights split in chunks.
    (2, ["--parallel.ep=2", "--parallel.a2a_chunks=2", "--parallel.zero=3"]),
    # Recompute of the experts' maths alone: the pipeline's all-to-all waits are not run again.
    (2, ["--parallel.ep=2", "--parallel.a2a_chunks=2", "--train.recompute=experts"]),
    (2, ["--parallel.ep=2", "--parallel.dispatcher=dedup", "--parallel.zero=3",
         "--train.recompute=experts"]),
    # A power-of-two loss scale (float16's mechanism) leaves float64 results as they are.
    (4, ["--parallel.pp=2", "--parallel.ep=2", "--train.loss_scale=1024"]),
]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("single"))


LAYOUTS += [
    # Tensor + sequence parallelism: attention, embeddings, head and loss split; MoE layers route
    # sequence slices with capacity and balance losses of the whole micro-batch.
    (2, ["--parallel.tp=2"]),
    (4, ["--parallel.tp=4"]),                                          # kv heads 2 < tp: shared
    # Shared kv rows of the fused qkv_proj inside ZeRO's flat shards (split over buckets).
    (4, ["--parallel.tp=4", "--parallel.zero=1"]),
    (4, ["--parallel.tp=4", "--parallel.zero=2", "--parallel.bucket_mb=0.002"]),
    (2, ["--parallel.tp=2", "--parallel.ep=2"]),                       # EP group = the tp group
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=4"]),    # EP spans dp and tp
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1"]),
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=2",
         "--parallel.bucket_mb=0.002"]),
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=3"]),
    # All four axes: pipeline stages of tensor-parallel blocks, experts over the stage's ranks.
    (4, ["--parallel.pp=2", "--parallel.tp=2"]),
    (4, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1"]),
]

# Four layers, MoE on layers 1 and 3 only: stages without MoE layers, uneven splits, interleaving.
DEEP = ["--model.num_layers=4", "--model.moe_every=2", "--model.moe_offset=1"]
DEEP_LAYOUTS = [
    (2, ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b"]),
    (2, ["--parallel.pp=2", "--parallel.pp_layers=[3,1]", "--parallel.ep=1"]),
    (4, ["--parallel.pp=4"]),
    (4, ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b",
         "--parallel.ep=2", "--parallel.zero=1"]),
    (4, ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b",
         "--parallel.dp=2", "--parallel.zero=3"]),
    (4, ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b",
         "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=2"]),
]


@pytest.fixture(scope="module")
def single_deep(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("single_deep"), *DEEP)


@pytest.mark.parametrize("size, overrides", LAYOUTS, ids=lambda v: str(v))
def test_layout_parity(worlds, tmp_path, single, size, overrides):
    check_parity(worlds, tmp_path, single, size, overrides)


@pytest.mark.parametrize("size, overrides", DEEP_LAYOUTS, ids=lambda v: str(v))
def test_pipeline_layout_parity(worlds, tmp_path, single_deep, size, overrides):
    check_parity(worlds, tmp_path, single_deep, size, [*DEEP, *overrides])


def check_parity(worlds, tmp_path, single, size, overrides):
    ref_trainer, ref_records = single
    run_dir = str(tmp_path / "run")
    results = worlds(size).run(case_train, run_dir, overrides, timeout=240)
    for rank_records in results:          # every rank reports the same global numbers
        for step, (got, want) in enumerate(zip(rank_records, ref_records), 1):
            for g, w in zip(got, want):
                assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12), (step, got, want)
    # The sharded checkpoint loads into one process and equals the reference parameters.
    model = Transformer(ref_trainer.cfg.model, ref_trainer.cfg.router).double()
    load_checkpoint(f"{run_dir}/checkpoints/step_{STEPS}", model)
    for (name, p), q in zip(model.state_dict().items(), ref_trainer.model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)


def test_world_of_one_equals_no_process_group(worlds, tmp_path, single):
    """A one-rank world (process group up, every axis of size 1) is the single-process run."""
    _, ref_records = single
    (records,) = worlds(1).run(case_train, str(tmp_path / "run"), [], timeout=120)
    assert records == ref_records


def case_float16(run_dir: str):
    trainer = Trainer(tiny_config(run_dir, "--parallel.ep=2", "--parallel.zero=1",
                                  "--train.dtype=float16", "--train.loss_scale=16777216",
                                  "--train.steps=8"), log=lambda _m: None)
    records = trainer.run()
    dist.barrier()
    return [(r["skipped"], r["loss"]) for r in records], trainer.scaler.scale


def test_float16_ranks_skip_the_same_steps(worlds, tmp_path):
    """Overflow decisions come from the all-reduced norm: every rank skips the same steps and
    ends with the same scale (a rank deciding alone would desynchronise and hang)."""
    (records, scale), other = worlds(2).run(case_float16, str(tmp_path / "run"), timeout=120)
    assert (records, scale) == other
    skips = sum(skipped for skipped, _ in records)
    assert records[0][0] and 0 < skips < len(records) and scale == 2.0 ** 24 / 2 ** skips
