"""Resuming under expert parallelism: bit exact in the same layout, equal to 1e-9 in another
layout (more ranks, other ep, one process), and a corrupt shard fails every rank without a hang."""

import math
import os
import shutil

import pytest
import torch.distributed as dist

from configs import tiny_config
from moepar.checkpoint import CheckpointError
from moepar.train import Trainer

# Capacity drops and the aux-loss-free bias make routing depend on restored state, not just weights.
ROUTER = ["--router.capacity_factor=1.0", "--router.bias_update_rate=0.01",
          "--run.checkpoint_every=0"]
# float64, 8 experts and 8 sequences a step, so worlds of 2 and 4 run the same global batch.
SAVED_STEP, STEPS = 2, 4    # the ep=2 float64 run saves step 2 and trains on to step 4
F64 = ["--train.dtype=float64", "--model.num_experts=8", "--train.global_batch_size=8",
       "--train.micro_batch_size=2", "--router.capacity_factor=1.0",
       "--router.bias_update_rate=0.01", f"--train.steps={STEPS}"]   # steps sets the lr schedule


def quiet(_msg):
    pass


def summary(records) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


# ---- cases (run on every rank) -----------------------------------------------------------------

def case_run(run_dir: str, overrides: list[str]):
    records = Trainer(tiny_config(run_dir, *overrides), log=quiet).run()
    dist.barrier()
    return summary(records)


def case_save_then_resume(run_dir: str, overrides: list[str], first: int):
    trainer = Trainer(tiny_config(run_dir, *overrides), log=quiet)
    for _ in range(first):
        trainer.train_step()
    trainer.save()
    del trainer
    resumed = Trainer(tiny_config(run_dir, *overrides, "--run.resume=true"), log=quiet)
    assert resumed.step == first, resumed.step
    records = resumed.run()
    dist.barrier()
    return summary(records)


def case_resume_from(run_dir: str, overrides: list[str], path: str, steps: int):
    trainer = Trainer(tiny_config(run_dir, *overrides, f"--run.resume_from={path}"), log=quiet)
    records = [trainer.train_step() for _ in range(steps)]
    dist.barrier()
    return summary(records)


def case_resume_error(run_dir: str, overrides: list[str]):
    try:
        Trainer(tiny_config(run_dir, *overrides, "--run.resume=true"), log=quiet)
    except CheckpointError as e:
        message = str(e)
    else:
        message = None
    dist.barrier()   # every rank got here: nobody is left inside a collective
    return message


# ---- tests (driver) ----------------------------------------------------------------------------

def test_resume_under_ep_is_bit_exact(worlds, tmp_path):
    overrides = ["--parallel.ep=2", *ROUTER]
    world = worlds(2)
    straight = world.run(case_run, str(tmp_path / "straight"), overrides, timeout=120)
    split = world.run(case_save_then_resume, str(tmp_path / "split"), overrides, 3, timeout=120)
    for rank in range(2):
        assert [s for s, _, _ in straight[rank]] == [1, 2, 3, 4, 5, 6]
        assert split[rank] == straight[rank][3:], (rank, split[rank], straight[rank][3:])
    assert straight[0] == straight[1]      # global numbers agree across ranks


@pytest.fixture(scope="module")
def ep2_run(worlds, tmp_path_factory):
    """A float64 ep=2 run in a world of 2 that saves step 2 and trains on: (step dir, records)."""
    run_dir = tmp_path_factory.mktemp("ep2") / "run"
    overrides = [*F64, "--parallel.ep=2", f"--run.checkpoint_every={SAVED_STEP}"]
    results = worlds(2).run(case_run, str(run_dir), overrides, timeout=120)
    assert results[0] == results[1]
    path = run_dir / "checkpoints" / f"step_{SAVED_STEP}"
    assert (path / "model-r00001.safetensors").is_file()   # rank 1 owns experts 4..7
    return str(path), results[0]


def assert_continues(got, ep2_records):
    """Resumed records equal the ep=2 run's own steps after the checkpoint, to rel 1e-9."""
    want = ep2_records[SAVED_STEP:]
    assert [s for s, _, _ in got] == [s for s, _, _ in want], (got, want)
    for (_, loss, gnorm), (_, w_loss, w_gnorm) in zip(got, want):
        assert math.isclose(loss, w_loss, rel_tol=1e-9), (got, want)
        assert math.isclose(gnorm, w_gnorm, rel_tol=1e-9), (got, want)


@pytest.mark.parametrize("overrides", [
    ["--parallel.ep=4"], ["--parallel.dp=4", "--parallel.ep=2"],
    ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=1"],
    ["--parallel.ep=4", "--parallel.zero=2", "--parallel.bucket_mb=0.002"],
    ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=3"],
    ["--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=2"],
    ["--parallel.pp=2", "--parallel.ep=2", "--parallel.pp_schedule=gpipe"],
    ["--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1"],
    ["--parallel.tp=4", "--parallel.ep=2", "--parallel.zero=3"],
], ids=["ep4", "dp4_ep2", "dp4_ep2_zero1", "ep4_zero2", "dp4_ep2_zero3", "pp2_ep2_zero2",
        "pp2_ep2_gpipe", "dp2_tp2_ep2_zero1", "tp4_ep2_zero3"])
def test_ep2_checkpoint_resumes_in_world_of_4(worlds, tmp_path, ep2_run, overrides):
    path, ep2_records = ep2_run
    results = worlds(4).run(case_resume_from, str(tmp_path / "run"), [*F64, *overrides], path,
                            STEPS - SAVED_STEP, timeout=120)
    for rank_records in results:
        assert_continues(rank_records, ep2_records)


def test_ep2_checkpoint_resumes_in_one_process(tmp_path, ep2_run):
    assert "WORLD_SIZE" not in os.environ and not dist.is_initialized()
    path, ep2_records = ep2_run
    trainer = Trainer(tiny_config(tmp_path / "run", *F64, f"--run.resume_from={path}"), log=quiet)
    assert trainer.dims.world_size == 1 and trainer.step == SAVED_STEP
    got = summary([trainer.train_step() for _ in range(STEPS - SAVED_STEP)])
    assert_continues(got, ep2_records)


@pytest.mark.parametrize("layout", [
    ["--parallel.ep=2", "--parallel.zero=1"], ["--parallel.ep=2", "--parallel.zero=2"],
    ["--parallel.ep=2", "--parallel.zero=3"], ["--parallel.pp=2", "--parallel.ep=1"],
    ["--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=2"]],
    ids=["zero1", "zero2", "zero3", "pp2", "tp2_zero2"])
def test_sharded_checkpoint_resumes_in_one_process(worlds, tmp_path, ep2_run, layout):
    """ZeRO and tensor-parallel runs save whole tensors (sharded state gathered), pipeline stages
    each their layers; one process resumes any of them."""
    _, ep2_records = ep2_run
    run_dir = tmp_path / "sharded"
    overrides = [*F64, *layout, "--parallel.bucket_mb=0.002", f"--run.checkpoint_every={SAVED_STEP}"]
    results = worlds(2).run(case_run, str(run_dir), overrides, timeout=120)
    assert_continues(results[0][SAVED_STEP:], ep2_records)    # the ZeRO run is the ep=2 run
    path = run_dir / "checkpoints" / f"step_{SAVED_STEP}"
    trainer = Trainer(tiny_config(tmp_path / "one", *F64, f"--run.resume_from={path}"), log=quiet)
    got = summary([trainer.train_step() for _ in range(STEPS - SAVED_STEP)])
    assert_continues(got, ep2_records)


def test_corrupt_shard_fails_every_rank(worlds, tmp_path, ep2_run):
    path, _ = ep2_run
    run_dir = tmp_path / "run"
    copy = run_dir / "checkpoints" / f"step_{SAVED_STEP}"
    shutil.copytree(path, copy)
    shard = copy / "model-r00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01                       # in the tensor bytes: the header still parses
    shard.write_bytes(bytes(data))
    overrides = [*F64, "--parallel.ep=2"]
    messages = worlds(2).run(case_resume_error, str(run_dir), overrides, timeout=60)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} resumed from a corrupt checkpoint"
        assert "model-r00001.safetensors" in message, (rank, message)
    # The same checkpoint in one process fails the same way.
    with pytest.raises(CheckpointError, match="model-r00001.safetensors"):
        Trainer(tiny_config(tmp_path / "single", *F64, f"--run.resume_from={copy}"), log=quiet)
