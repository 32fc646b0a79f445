"""Fault injection across ranks: a SIGTERM that reaches one rank stops every rank after the same
step with one checkpoint; non-finite parameters on one rank stop every rank; parallel.timeout_s
reaches the groups created after the world (DeviceMesh's per-axis groups), so a rank that stops
answering fails its peers within that time."""

import os
import signal
import time

import torch
import torch.distributed as dist

from configs import tiny_config
from moepar.checkpoint import complete_steps, read_state
from moepar.train import NonFiniteError, Preempted, Trainer

DP2 = ["--parallel.dp=2", "--train.steps=6", "--run.checkpoint_every=0"]


def quiet(_msg):
    pass


# ---- cases (run on every rank) -----------------------------------------------------------------

def case_sigterm_on_one_rank(run_dir: str):
    def refuse(signum, frame):      # the default action would kill this world's process
        raise AssertionError("SIGTERM reached the default handler")
    previous = signal.signal(signal.SIGTERM, refuse)
    trainer = Trainer(tiny_config(run_dir, *DP2), log=quiet)
    real_step = trainer.train_step

    def step():
        if trainer.step == 2 and dist.get_rank() == 1:     # during step 3, on rank 1 only
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step()
    trainer.train_step = step
    try:
        trainer.run()
        outcome = ("finished", trainer.step)
    except Preempted as e:
        outcome = ("preempted", e.step)
    finally:
        signal.signal(signal.SIGTERM, previous)
    dist.barrier()
    return outcome


def case_nonfinite_on_one_rank(run_dir: str):
    trainer = Trainer(tiny_config(run_dir, *DP2), log=quiet)
    engine = trainer.engine
    real_update = engine.optimizer_step

    def update(lr, stats):          # one rank's copy goes bad in the update (say, a bit flip)
        real_update(lr, stats)
        if dist.get_rank() == 1:
            with torch.no_grad():
                trainer.model.layers[0].attn_norm.weight[0] = float("nan")
    engine.optimizer_step = update
    trainer.train_step()
    try:
        trainer.train_step()
        outcome = "trained on"
    except NonFiniteError as e:
        outcome = str(e).split(".")[0]
    trainer.release()
    dist.barrier()
    return outcome


def case_subgroup_timeout(seconds: float):
    import torch.distributed.distributed_c10d as c10d
    from moepar.config import ParallelConfig
    from moepar.process import init_process_group
    saved = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
    try:
        init_process_group(ParallelConfig(timeout_s=seconds), torch.device("cpu"), 2)
        group = dist.new_group([0, 1])           # what DeviceMesh does for a partial axis
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved
    waited = None
    if dist.get_rank() == 0:                     # rank 1 "stops answering" on this group
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError:
            waited = time.monotonic() - start
    dist.barrier()                               # the world itself is fine
    return waited


# ---- tests ---------------------------------------------------------------------------------------

def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(worlds, tmp_path):
    results = worlds(2).run(case_sigterm_on_one_rank, str(tmp_path), timeout=180)
    assert results == [("preempted", 3), ("preempted", 3)]
    root = str(tmp_path / "checkpoints")
    assert complete_steps(root) == [3]
    assert read_state(os.path.join(root, "step_3"))["stop_reason"] == "preempted"


def test_nonfinite_parameters_on_one_rank_stop_every_rank(worlds, tmp_path):
    results = worlds(2).run(case_nonfinite_on_one_rank, str(tmp_path), timeout=180)
    assert results == ["the run diverged: the update of step 1 made parameters non-finite "
                       "(NaN or Inf)"] * 2


def test_timeout_reaches_groups_made_after_the_world(worlds):
    """Without it, DeviceMesh's groups wait torch's default (30 min on gloo, 10 on NCCL)."""
    waited, _ = worlds(2).run(case_subgroup_timeout, 2.0, timeout=60)
    assert waited is not None and 1.0 <= waited < 20, waited
