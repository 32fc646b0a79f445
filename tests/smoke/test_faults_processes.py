"""Fault injection on real processes: a second start on a run.dir in use is refused naming the
holder; a killed launcher leaves no worker behind; SIGTERM to the launcher saves and exits 75; a
kill -9 in the middle of a save is recovered by the next start; a rank that stops answering
fails its peer within parallel.timeout_s."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from configs import tiny_config
from moepar.checkpoint import complete_steps, latest_checkpoint, read_state
from moepar.config import to_toml
from moepar.train import Trainer

ENV = dict(os.environ, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60", OMP_NUM_THREADS="1")


def quiet(_msg):
    pass


def config_file(tmp_path, run_dir, *overrides) -> str:
    path = tmp_path / "run.toml"
    path.write_text(to_toml(tiny_config(run_dir, *overrides)))
    return str(path)


@contextlib.contextmanager
def training(tmp_path, steps: int, *overrides, env=ENV):
    """A long two-worker run under `moepar train --nproc 2`, once rank 0 logged `steps` steps:
    yields (launcher, its two workers, run.dir); whatever is left running is killed after."""
    run_dir = tmp_path / "run"
    cfg = config_file(tmp_path, run_dir, "--train.steps=100000", "--run.checkpoint_every=0",
                      *overrides)
    launcher = subprocess.Popen([sys.executable, "-m", "moepar", "train", cfg, "--nproc", "2",
                                 "--parallel.dp=2"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        wait_for_steps(run_dir, steps, launcher)
        workers = workers_of(launcher, 2)
        yield launcher, workers, run_dir
    finally:
        for pid in workers:            # ends what the test started, by pid
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_steps(run_dir, n: int, proc, timeout: float = 240):
    """Blocks until rank 0 logged n steps (the workers are training), or fails."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {n} steps in {timeout} s")


def workers_of(launcher: subprocess.Popen, n: int) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p for p in children(launcher.pid) if alive(p)]
        if len(found) >= n:
            return found
        time.sleep(0.2)
    pytest.fail(f"the launcher has {children(launcher.pid)} as children, not {n} workers")


def test_second_start_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from moepar.rundir import "
                               "RunLock; RunLock(sys.argv[1]); print('held', flush=True); "
                               "sys.stdin.read()", str(run_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = config_file(tmp_path, run_dir, "--train.steps=1")
        for extra in ([], ["--nproc", "2", "--parallel.dp=2"]):
            result = subprocess.run([sys.executable, "-m", "moepar", "train", cfg, *extra],
                                    capture_output=True, text=True, timeout=240, env=ENV)
            assert result.returncode == 2, (extra, result.stderr[-3000:])
            assert (f"in use by another run: pid {holder.pid} on host {socket.gethostname()}"
                    in result.stderr), result.stderr[-3000:]
        assert sorted(os.listdir(run_dir)) == ["run.lock"]      # nothing written, nothing deleted
    finally:
        holder.kill()
        holder.wait()


def test_killed_launcher_leaves_no_worker_behind(tmp_path):
    with training(tmp_path, 1) as (launcher, workers, _):
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if alive(p)], "workers outlived their launcher"


def test_sigterm_to_the_launcher_saves_every_rank_and_exits_75(tmp_path):
    with training(tmp_path, 2) as (launcher, _, run_dir):
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=240)
        assert launcher.returncode == 75, err[-3000:]
    state = read_state(latest_checkpoint(str(run_dir / "checkpoints")))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert state["stop_reason"] == "preempted"
    assert state["step"] == json.loads(lines[-1])["step"] >= 2    # the step it was in, saved
    assert state["data_position"] == state["step"] * 2    # 2 micro-batches a step, all ranks
    assert "SIGTERM: the workers saved a checkpoint" in err


KILL_DURING_SAVE = """
import os, signal, sys
import moepar.checkpoint.save as save     # the module that calls write_tensors
real = save.write_tensors
def write_then_die(path, entries, *args, **kwargs):
    if "step_2" in path and "optimizer" in os.path.basename(path):
        os.kill(os.getpid(), signal.SIGKILL)        # the model file is written, this one is not
    return real(path, entries, *args, **kwargs)
save.write_tensors = write_then_die
from moepar.launch import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_during_a_save_is_recovered_by_the_next_start(tmp_path):
    args = ["--train.steps=3", "--run.checkpoint_every=1", "--run.keep_checkpoints=0"]
    full = Trainer(tiny_config(tmp_path / "full", *args), log=quiet).run()
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE,
                             config_file(tmp_path, run_dir, *args)],
                            capture_output=True, text=True, timeout=240, env=ENV)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert complete_steps(str(run_dir / "checkpoints")) == [1]
    logged = []
    tail = Trainer(tiny_config(run_dir, *args, "--run.resume=true"), log=logged.append).run()
    assert any("set aside incomplete .step_2.tmp as step_2.incomplete-" in m for m in logged)
    assert [r["loss"] for r in tail] == [r["loss"] for r in full[1:]]
    names = sorted(os.listdir(run_dir / "checkpoints"))
    assert len(names) == 4 and names[2].startswith("step_2.incomplete-"), names
    assert [names[i] for i in (0, 1, 3)] == ["step_1", "step_2", "step_3"]
    assert "model-r00000.safetensors" in os.listdir(run_dir / "checkpoints" / names[2])


def test_a_rank_that_stops_answering_fails_its_peer_within_the_timeout(tmp_path):
    """SIGSTOP one worker: the other fails its collective after parallel.timeout_s (2 s here)
    and exits; torch's launcher then ends the job, killing the stopped worker after its fixed
    30 s shutdown grace (not waited for here; the teardown kills the launcher, and the stopped
    worker dies with it)."""
    with training(tmp_path, 1, "--parallel.timeout_s=2") as (launcher, workers, _):
        os.kill(workers[0], signal.SIGSTOP)       # either rank: the other waits on it
        deadline = time.monotonic() + 2 + 60      # the timeout + slack for a loaded machine
        while alive(workers[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(workers[1]), "the peer of a stopped rank is still waiting"
        os.kill(launcher.pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        # gloo words it by where the wait was: a recv timed out, or the pair it used was closed
        # by the timeout (both are the 2 s of parallel.timeout_s)
        assert ("Timed out waiting 2000ms" in err
                or "Application timeout caused pair closure" in err), err[-3000:]


def test_an_elastic_job_does_not_replay_its_divergence(tmp_path):
    """--max-restarts 2 on a run that diverges in step 1 (AdamW eps=0): torch's agent restarts
    the workers twice; each restart is refused at once (nothing trains again) and the job ends
    with exit 3, not the launcher's 1 for a worker stopped by the agent."""
    run_dir = tmp_path / "run"
    cfg = config_file(tmp_path, run_dir, "--train.steps=4", "--train.eps=0", "--run.log_every=1")
    result = subprocess.run([sys.executable, "-m", "moepar", "train", cfg, "--nproc", "2",
                             "--parallel.ep=2", "--max-restarts", "2", "--run.resume=auto"],
                            env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 3, result.stderr[-3000:]
    assert result.stdout.count("step     1/4") == 1, result.stdout[-3000:]
    # two ranks per attempt, two restarts
    assert result.stderr.count("not retrying a divergence: starting over") == 4, result.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
