"""Fault injection, in one process: divergence stops the run with exit 3 and saves nothing broken;
one run per run.dir; a resume never starts over, never touches folders it did not write, and
refuses config changes that alter the run; a fresh start never eats a previous run's files;
SIGTERM finishes the step, saves and stops; file work stays out of collective waits."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

from configs import tiny_config
from moepar import launch
from moepar.checkpoint import (CheckpointError, commit, complete_steps,
                               read_canonical, read_state, save_checkpoint)
from moepar.config import to_toml
from moepar.rundir import RunDirError
from moepar.train import NonFiniteError, Preempted, Trainer


def quiet(_msg):
    pass


def config_file(tmp_path, run_dir, *overrides, name="run.toml") -> str:
    """The tiny config (with overrides) written as a TOML file, for `moepar train FILE`."""
    path = tmp_path / name
    path.write_text(to_toml(tiny_config(run_dir, *overrides)))
    return str(path)


def poison_from(trainer, step: int):
    """A NaN loss (or NaN logits) and so a NaN grad norm from 1-based step `step` on: the
    model's output, the loss itself when the runner passes its `head_fn`, poisoned."""
    real = trainer.model.forward

    def forward(tokens, *args, **kwargs):
        out, outs = real(tokens, *args, **kwargs)
        return (out * float("nan") if trainer.step + 1 >= step else out), outs
    trainer.model.forward = forward


# ---- 1. divergence ------------------------------------------------------------------------------

def test_eps_zero_stops_with_exit_3_and_no_nan_checkpoint(tmp_path, capsys):
    """AdamW with eps=0 divides 0 by 0 for parameters whose gradient is zero (embedding rows of
    bytes not in the batch): the update itself makes NaN weights, with a finite loss before it."""
    run_dir = tmp_path / "run"
    cfg = config_file(tmp_path, run_dir, "--train.steps=4")
    assert launch.main([cfg, "--train.eps=0"]) == launch.EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "the update of step 1 made parameters non-finite" in err, err
    # Nothing after the damage was saved; whatever is there is finite.
    for step in complete_steps(str(run_dir / "checkpoints")):
        for name, t in read_canonical(str(run_dir / "checkpoints" / f"step_{step}")):
            assert torch.isfinite(t).all(), (step, name)
    assert complete_steps(str(run_dir / "checkpoints")) == []
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def test_consecutive_skips_past_the_limit_stop_every_time(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=10", "--run.checkpoint_every=1",
                                  "--run.keep_checkpoints=0", "--train.max_skipped_steps=2"),
                      log=quiet)
    poison_from(trainer, 3)
    with pytest.raises(NonFiniteError, match=r"step 5: .*3 skipped steps in a row, more than "
                                             r"train.max_skipped_steps=2"):
        trainer.run()
    # Steps 3 and 4 were skipped (parameters unchanged) and saved as such; none after.
    assert complete_steps(str(tmp_path / "checkpoints"))[-1] == 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True, True]
    a = dict(read_canonical(str(tmp_path / "checkpoints" / "step_2")))
    b = dict(read_canonical(str(tmp_path / "checkpoints" / "step_4")))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_skip_streak_shorter_than_the_limit_recovers(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=5", "--train.max_skipped_steps=2"),
                      log=quiet)
    real = trainer.model.forward
    poison_from(trainer, 2)
    trainer.train_step()
    assert trainer.train_step()["skipped"] and trainer.train_step()["skipped"]
    trainer.model.forward = real
    assert not trainer.train_step()["skipped"] and trainer.skipped_in_row == 0


def test_a_nonfinite_model_is_never_saved(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.steps=2"), log=quiet)
    trainer.train_step()
    with torch.no_grad():
        trainer.model.layers[1].attn_norm.weight[3] = float("inf")
    with pytest.raises(NonFiniteError, match="parameters are non-finite at step 1"):
        trainer.save()
    assert not (tmp_path / "checkpoints").exists() or os.listdir(tmp_path / "checkpoints") == []


def test_the_checkpoint_writer_refuses_nan_and_commits_nothing(tmp_path):
    """Below the trainer's check: a NaN anywhere (here a buffer, not a parameter) fails the save
    on every rank, and the folder it was writing is gone, not committed."""
    trainer = Trainer(tiny_config(tmp_path / "run", "--router.bias_update_rate=0.01"), log=quiet)
    bias = next(m.router.expert_bias_E for m in trainer.model.moe_layers())
    bias[1] = float("nan")
    root = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="expert_bias_E.*non-finite"):
        save_checkpoint(root, 7, trainer.engine, {"step": 7})
    for thread in threading.enumerate():
        if thread.name.startswith("discard-"):
            thread.join()
    assert os.listdir(root) == []


# ---- 2. one run per run.dir ---------------------------------------------------------------------

def test_a_live_runs_folder_is_left_alone(tmp_path):
    """A second start while the first holds the lock is refused, and its recovery never runs:
    the first run's in-progress save stays exactly as it is."""
    Trainer(tiny_config(tmp_path, "--train.steps=1"), log=quiet).run()
    in_progress = tmp_path / "checkpoints" / ".step_2.tmp"
    in_progress.mkdir()
    (in_progress / "model-r00000.safetensors").write_bytes(b"being written")
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(RunDirError, match=rf"in use by another run: pid {holder.pid} on host "
                                              rf"{socket.gethostname()} "):
            Trainer(tiny_config(tmp_path, "--train.steps=2", "--run.resume=true"), log=quiet)
        assert (in_progress / "model-r00000.safetensors").read_bytes() == b"being written"
    finally:
        holder.kill()
        holder.wait()
    # Once the holder is gone, the lock is free again (the kernel dropped it with the process).
    Trainer(tiny_config(tmp_path, "--train.steps=2", "--run.resume=true"), log=quiet).release()


def hold_lock(run_dir):
    """Another process holding run_dir's lock (moepar.rundir alone: no torch, starts fast)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from moepar.rundir import "
                               "RunLock; RunLock(sys.argv[1]); print('held', flush=True); "
                               "sys.stdin.read()", str(run_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


# ---- 3. resume never starts over ----------------------------------------------------------------

def test_resume_without_a_complete_checkpoint_refuses_and_keeps_everything(tmp_path):
    Trainer(tiny_config(tmp_path, "--train.steps=2", "--run.checkpoint_every=1",
                        "--run.keep_checkpoints=0"), log=quiet).run()
    for step in (1, 2):          # both lose their manifests (damage, or an older format)
        os.remove(tmp_path / "checkpoints" / f"step_{step}" / "manifest.json")
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    # Refused (exit 2) with nothing changed: the folders are still where they were ...
    with pytest.raises(RunDirError, match=r"run.resume=true but there is no complete checkpoint"
                                          r".*holds step_1, step_2. Nothing was changed"):
        Trainer(tiny_config(tmp_path, "--train.steps=4", "--run.resume=true"), log=quiet)
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1", "step_2"]
    # ... and a start that goes ahead sets them aside, whole.
    Trainer(tiny_config(tmp_path, "--train.steps=4", "--run.overwrite=true"), log=quiet).release()
    aside = sorted(os.listdir(tmp_path / "checkpoints"))
    assert [a.split(".")[0] for a in aside] == ["step_1", "step_2"]
    assert all(".incomplete-" in a for a in aside)
    for a in aside:    # set aside whole, never deleted
        assert "model-r00000.safetensors" in os.listdir(tmp_path / "checkpoints" / a)


def test_a_checkpoint_is_never_replaced(tmp_path):
    trainer = Trainer(tiny_config(tmp_path / "run"), log=quiet)
    path = save_checkpoint(str(tmp_path / "ckpt"), 3, trainer.engine, {"step": 3})
    before = {f: os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)}
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        commit(str(other), path, 3)
    assert {f: os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)} == before


def test_resume_refuses_changes_that_alter_the_run_unless_allowed(tmp_path):
    Trainer(tiny_config(tmp_path, "--train.steps=2"), log=quiet).run()
    for change, key in (("--train.seed=1", "train.seed"), ("--model.top_k=1", "model.top_k"),
                        ("--train.micro_batch_size=1", "train.micro_batch_size"),
                        ("--train.dtype=float64", "train.dtype")):
        with pytest.raises(RunDirError, match=rf"{key} .* -> .*--run.allow_changes={key}"):
            Trainer(tiny_config(tmp_path, "--train.steps=3", "--run.resume=true", change),
                    log=quiet)
    logged = []
    resumed = Trainer(tiny_config(tmp_path, "--train.steps=3", "--run.resume=true",
                                  "--train.seed=1", "--run.allow_changes=seed"), log=logged.append)
    assert resumed.step == 2
    assert any("train.steps 2 -> 3 (the run is extended" in line for line in logged), logged
    assert any("train.seed 0 -> 1 (allowed by run.allow_changes)" in line for line in logged)


def test_allow_changes_names_real_keys():
    from moepar.config import load_config
    cfg = load_config(None, ["--run.allow_changes=top_k,train.lr"])
    assert cfg.run.allow_changes == ["model.top_k", "train.lr"]
    with pytest.raises(ValueError, match="run.allow_changes: 'train.learning_rate' is not a "
                                         "config key"):
        load_config(None, ["--run.allow_changes=train.learning_rate"])


# ---- 4. the user's files are theirs -------------------------------------------------------------

def test_fresh_start_refuses_a_previous_runs_files(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(RunDirError, match=r"previous run's files \(metrics.jsonl\).*"
                                          r"--run.overwrite=true"):
        Trainer(tiny_config(tmp_path, "--train.steps=1"), log=quiet)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
    Trainer(tiny_config(tmp_path, "--train.steps=1", "--run.overwrite=true"), log=quiet).run()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] != 2.0


def test_the_input_config_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    text = "# my notes, kept\n" + to_toml(tiny_config(run_dir, "--train.steps=1"))
    (run_dir / "config.toml").write_text(text)
    config = str(run_dir / "config.toml")
    assert launch.main([config]) == 0     # the input config is not a previous run's file
    assert launch.main([config, "--run.resume=true", "--train.steps=2"]) == 0
    assert (run_dir / "config.toml").read_text() == text
    assert complete_steps(str(run_dir / "checkpoints")) == [1, 2]


# ---- 6. preemption and file work out of collective waits ---------------------------------------

def _no_default_sigterm():
    """A SIGTERM nobody handles fails the test instead of killing pytest."""
    def refuse(signum, frame):
        raise AssertionError("SIGTERM reached the default handler: the trainer did not catch it")
    return signal.signal(signal.SIGTERM, refuse)


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path):
    args = ["--train.steps=5", "--run.checkpoint_every=0"]
    full = Trainer(tiny_config(tmp_path / "full", *args), log=quiet).run()
    previous = _no_default_sigterm()
    try:
        trainer = Trainer(tiny_config(tmp_path / "cut", *args), log=quiet)
        real_step = trainer.train_step

        def step_then_signal():
            if trainer.step == 1:       # during step 2: the signal lands mid-step
                os.kill(os.getpid(), signal.SIGTERM)
            return real_step()
        trainer.train_step = step_then_signal
        with pytest.raises(Preempted) as caught:
            trainer.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert caught.value.step == 2 and signal.getsignal(signal.SIGTERM) is previous
    ckpt = tmp_path / "cut" / "checkpoints" / "step_2"
    assert read_state(str(ckpt))["stop_reason"] == "preempted"
    tail = Trainer(tiny_config(tmp_path / "cut", *args, "--run.resume=true"), log=quiet).run()
    assert [r["loss"] for r in tail] == [r["loss"] for r in full[2:]]


def test_pruning_deletes_outside_the_step(tmp_path, monkeypatch):
    """Pruning old checkpoints happens on rank 0 only: the folder is renamed away at once and
    deleted by a background thread, so no other rank waits in a collective for the deletion."""
    import shutil
    deleted_by, real = [], shutil.rmtree

    def watched(path, *args, **kwargs):
        deleted_by.append((os.path.basename(path), threading.current_thread().name))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", watched)
    Trainer(tiny_config(tmp_path, "--train.steps=3", "--run.checkpoint_every=1",
                        "--run.keep_checkpoints=1"), log=quiet).run()
    assert complete_steps(str(tmp_path / "checkpoints")) == [3]
    assert os.listdir(tmp_path / "checkpoints") == ["step_3"]    # deletions done when run ends
    assert sorted(name.split("-")[1] for name, _ in deleted_by) == ["step_1", "step_2"]
    assert all(thread != "MainThread" for _, thread in deleted_by), deleted_by


def test_a_fresh_start_keeps_a_previous_runs_expert_load(tmp_path):
    """expert_load.jsonl is a previous run's file too: a plain start over it is refused and
    leaves it byte for byte (a start would truncate it)."""
    (tmp_path / "expert_load.jsonl").write_text('{"header": 1}\n{"step": 1}\n')
    with pytest.raises(RunDirError, match=r"already holds a previous run's files "
                                          r"\(expert_load.jsonl\)"):
        Trainer(tiny_config(tmp_path, "--train.steps=1"), log=quiet)
    assert (tmp_path / "expert_load.jsonl").read_text() == '{"header": 1}\n{"step": 1}\n'
