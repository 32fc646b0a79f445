"""Running on a cluster, in one process: the multi-node flags become torch's launcher arguments
(read back by torch's own parser), the layout is checked at every node count before anything
starts, run.resume="auto" resumes or starts fresh without eating another run, and the SLURM and
Kubernetes recipes produce the launch they document."""

import os
import pathlib
import re
import shlex
import stat
import subprocess
import sys

import pytest

from configs import tiny_config
from test_faults_run import config_file
from moepar import launch
from moepar.checkpoint import complete_steps
from moepar.cluster import launcher_argv, node_counts, pop_multinode
from moepar.config import load_config, to_toml
from moepar.rundir import RunDirError
from moepar.train import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "cluster"


def quiet(_msg):
    pass


def torch_reads(command: str):
    """The printed `torchrun ...` command, parsed by torch's own launcher parser."""
    from torch.distributed.run import get_args_parser
    words = shlex.split(command)
    if words[0] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1":    # a job that can restart
        words = words[1:]
    assert words[0] == "torchrun", words
    return get_args_parser().parse_args(words[1:])


def test_restarting_jobs_get_a_fresh_rendezvous_store(tmp_path, capsys):
    config = config_file(tmp_path, tmp_path / "run")
    common = [str(config), "--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint", "h:1",
              "--print-launch"]
    for extra, fresh in (([], False), (["--max-restarts", "0"], False),
                         (["--max-restarts", "2"], True)):
        assert launch.main([*common, *extra]) == 0
        out = capsys.readouterr().out
        assert out.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun") == fresh, out
        torch_reads(out)


def test_abbreviated_launcher_flags_are_refused(tmp_path, capsys):
    """argparse would take --max-restart for --max-restarts' unused twin and start a plain run."""
    config = config_file(tmp_path, tmp_path / "run")
    for flag in ("--max-restart", "--print-launc", "--nnode"):
        assert launch.main([str(config), flag, "2"]) == launch.EXIT_REFUSED
        assert flag in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---- the launcher's arguments ------------------------------------------------------------------

def test_pop_multinode_takes_both_spellings_and_leaves_the_rest():
    flags, printed, rest = pop_multinode(["cfg.toml", "--nnodes", "2", "--node-rank=1",
                                          "--train.steps=3", "--rdzv-endpoint", "h:1",
                                          "--print-launch", "--nproc", "4"])
    assert flags == {"--nnodes": "2", "--node-rank": "1", "--rdzv-endpoint": "h:1"}
    assert printed and rest == ["cfg.toml", "--train.steps=3", "--nproc", "4"]
    with pytest.raises(ValueError, match="--max-restarts needs a value"):
        pop_multinode(["cfg.toml", "--max-restarts"])


def test_launcher_argv_static_elastic_and_one_node():
    assert launcher_argv(2, {}) == ["--standalone", "--nproc_per_node=2"]
    assert launcher_argv(2, {"--max-restarts": "3"}) == [
        "--standalone", "--nproc_per_node=2", "--max-restarts=3"]
    static = launcher_argv(8, {"--nnodes": "4", "--node-rank": "3", "--rdzv-endpoint": "h:29500",
                               "--rdzv-id": "job7"})
    assert static == ["--nnodes=4", "--nproc_per_node=8", "--rdzv-backend=c10d",
                      "--rdzv-endpoint=h:29500", "--rdzv-id=job7"]
    elastic = launcher_argv(8, {"--nnodes": "2:4", "--rdzv-endpoint": "h:29500",
                                "--max-restarts": "2", "--rdzv-conf": "last_call_timeout=5"})
    assert "--nnodes=2:4" in elastic and "--max-restarts=2" in elastic
    assert "--rdzv-conf=last_call_timeout=5" in elastic
    assert list(node_counts({"--nnodes": "2:4"})) == [2, 3, 4]


@pytest.mark.parametrize("flags, message", [
    ({"--nnodes": "2"}, "needs --rdzv-endpoint"),
    ({"--nnodes": "2", "--rdzv-endpoint": "nohost"}, "must be HOST:PORT"),
    ({"--nnodes": "4:2", "--rdzv-endpoint": "h:1"}, "1 <= MIN <= MAX"),
    ({"--nnodes": "two", "--rdzv-endpoint": "h:1"}, "must be N or MIN:MAX"),
    ({"--nnodes": "2", "--node-rank": "2", "--rdzv-endpoint": "h:1"}, "must be 0 .. 1"),
    ({"--nnodes": "1:2", "--node-rank": "0", "--rdzv-endpoint": "h:1"}, "elastic MIN:MAX"),
    ({"--max-restarts": "-1"}, "non-negative integer"),
    ({"--rdzv-conf": "a=1"}, "for several nodes"),
], ids=["no-endpoint", "bad-endpoint", "min-over-max", "not-a-number", "node-rank-too-big",
        "node-rank-elastic", "negative-restarts", "conf-alone"])
def test_bad_launcher_flags_are_named(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        launcher_argv(2, flags)


def test_print_launch_is_a_command_torch_reads(tmp_path, capsys):
    config = config_file(tmp_path, tmp_path / "run", "--train.global_batch_size=8")
    code = launch.main([str(config), "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
                        "--rdzv-endpoint", "10.0.0.1:29400", "--train.steps=3", "--print-launch"])
    assert code == 0
    args = torch_reads(capsys.readouterr().out.strip())
    assert (args.nnodes, args.nproc_per_node) == ("2", "2")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.module) == ("c10d", "10.0.0.1:29400", True)
    assert args.training_script == "moepar"
    assert args.training_script_args == ["train", str(config), "--train.steps=3"]
    assert not (tmp_path / "run").exists()          # printing starts nothing


def test_layout_is_checked_at_every_node_count(tmp_path, capsys):
    """global batch 4 in micro-batches of 2: dp 1 and 2 fit, dp 3 does not; the error names the
    node count, before anything starts."""
    config = config_file(tmp_path, tmp_path / "run")
    common = [str(config), "--nproc", "1", "--rdzv-endpoint", "127.0.0.1:1", "--print-launch"]
    assert launch.main([*common, "--nnodes", "1:2"]) == 0
    capsys.readouterr()
    assert launch.main([*common, "--nnodes", "1:3"]) == launch.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "at 3 node(s) x 1 process(es) = world 3" in err and "global_batch_size=4" in err
    assert "at 2 node(s)" not in err and not (tmp_path / "run").exists()


def test_launcher_flags_under_torchrun_are_refused(tmp_path, monkeypatch, capsys):
    config = config_file(tmp_path, tmp_path / "run")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert launch.main([str(config), "--nnodes", "2", "--rdzv-endpoint", "h:1"]) == 2
    assert "--nnodes, --rdzv-endpoint are moepar train's launcher flags" in capsys.readouterr().err


# ---- run.resume = "auto" -----------------------------------------------------------------------

def test_resume_values():
    assert load_config(None, ["--run.resume=auto"]).run.resume == "auto"
    assert load_config(None, ["--run.resume=AUTO"]).run.resume == "auto"
    assert load_config(None, ["--run.resume=true"]).run.resume is True
    assert load_config(None, ["--run.resume=0"]).run.resume is False
    with pytest.raises(ValueError, match="run.resume='maybe' must be true, false or \"auto\""):
        load_config(None, ["--run.resume=maybe"])
    again = load_config(None, ["--run.resume=auto"])
    assert "resume = \"auto\"" in to_toml(again)


def test_resume_auto_starts_fresh_then_resumes_the_newest(tmp_path):
    run = tmp_path / "run"
    first = Trainer(tiny_config(run, "--train.steps=4", "--run.checkpoint_every=2",
                                "--run.resume=auto"), log=quiet)
    assert first.step == 0
    first.run()
    first.release()
    assert complete_steps(str(run / "checkpoints")) == [2, 4]
    again = Trainer(tiny_config(run, "--train.steps=6", "--run.checkpoint_every=2",
                                "--run.resume=auto"), log=quiet)
    assert again.step == 4
    again.release()


def test_resume_auto_restarts_its_own_run_that_saved_nothing(tmp_path):
    """A restart before the first checkpoint: run.dir holds config.toml and metrics of the same
    run (parallel.* may differ: the world changed); it starts over."""
    run = tmp_path / "run"
    crashed = Trainer(tiny_config(run, "--train.steps=3", "--run.checkpoint_every=0",
                                  "--run.log_every=1", "--run.resume=auto"), log=quiet)
    crashed.train_step = None     # dies at its first step, after writing config.toml
    with pytest.raises(TypeError):
        crashed.run()
    crashed.release()
    assert (run / "config.toml").exists() and not complete_steps(str(run / "checkpoints"))
    again = Trainer(tiny_config(run, "--train.steps=3", "--run.checkpoint_every=0",
                                "--run.log_every=1", "--run.resume=auto",
                                "--parallel.timeout_s=60"), log=quiet)
    assert again.step == 0
    again.run()
    again.release()
    assert complete_steps(str(run / "checkpoints")) == [3]


def test_resume_auto_refuses_another_runs_files(tmp_path):
    run = tmp_path / "run"
    other = Trainer(tiny_config(run, "--train.steps=3", "--run.checkpoint_every=0",
                                "--run.log_every=1"), log=quiet)
    other.train_step = None
    with pytest.raises(TypeError):
        other.run()
    other.release()
    before = sorted(os.listdir(run))
    with pytest.raises(RunDirError, match=r"run.resume=auto: .* holds another run's files .*"
                                          r"train.lr 0.003 -> 0.01"):
        Trainer(tiny_config(run, "--train.steps=3", "--train.lr=0.01", "--run.resume=auto"),
                log=quiet)
    assert sorted(os.listdir(run)) == before
    (run / "config.toml").unlink()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    with pytest.raises(RunDirError, match="its config.toml cannot be read"):
        Trainer(tiny_config(run, "--train.steps=3", "--run.resume=auto"), log=quiet)


# ---- the recipes -------------------------------------------------------------------------------

def stub(folder: pathlib.Path, name: str, body: str):
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def recipe_env(tmp_path, **extra):
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{pathlib.Path(sys.executable).parent}"
                                f"{os.pathsep}{os.environ['PATH']}", **extra)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def test_slurm_recipe_launches_every_node_and_requeues_when_preempted(tmp_path):
    """slurm.sbatch under stand-ins for scontrol and srun (srun runs its command once, as node
    1 of 4): the launch torch reads; an exit of 75 (preempted, saved) requeues the job."""
    (tmp_path / "bin").mkdir()
    log = tmp_path / "scontrol.log"
    stub(tmp_path / "bin", "scontrol", f'echo "$@" >> {log}\n'
                                       'if [ "$1" = show ]; then printf "gpu-a\\ngpu-b\\n"; fi\n')
    stub(tmp_path / "bin", "srun", 'shift\nexec "$@"\n')          # drops --kill-on-bad-exit=1
    env = recipe_env(tmp_path, SLURM_JOB_NODELIST="gpu-[a-d]", SLURM_NNODES="4",
                     SLURM_NODEID="1", SLURM_JOB_ID="4242")
    result = subprocess.run(["bash", str(CLUSTER / "slurm.sbatch"), "--print-launch"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    args = torch_reads(result.stdout.strip().splitlines()[-1])
    assert (args.nnodes, args.nproc_per_node) == ("4", "8")
    assert (args.rdzv_endpoint, args.rdzv_id, args.max_restarts) == ("gpu-a:29500", "4242", 2)
    assert args.training_script_args == ["train", "examples/cluster/moe_cluster.toml",
                                         "--parallel.gpus_per_node=8", "--run.resume=auto"]
    assert "requeue" not in log.read_text()
    stub(tmp_path / "bin", "srun", "exit 75\n")
    result = subprocess.run(["bash", str(CLUSTER / "slurm.sbatch")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 75
    assert "requeue 4242" in log.read_text()


def test_kubernetes_recipe_ranks_each_pod_by_its_index(tmp_path):
    text = (CLUSTER / "k8s-job.yaml").read_text()
    (command,) = re.findall(r"^\s+- (moepar train .*)$", text, flags=re.M)
    nodes = int(re.search(r"completions: (\d+)", text).group(1))
    assert f"--nnodes {nodes}" in command
    result = subprocess.run(["sh", "-c", command + " --print-launch"], cwd=ROOT,
                            env=recipe_env(tmp_path, JOB_COMPLETION_INDEX="1"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    args = torch_reads(result.stdout.strip().splitlines()[-1])
    assert (args.rdzv_endpoint, args.nnodes) == ("moepar-0.moepar:29500", "2")
    assert "--run.dir=/shared/runs/moe_cluster" in args.training_script_args


def test_cluster_example_fits_one_to_four_nodes_of_eight(capsys):
    """The recipes' config: the layout holds at 8, 16, 24 and 32 GPUs (an elastic 1:4 job)."""
    code = launch.main([str(CLUSTER / "moe_cluster.toml"), "--nproc", "8", "--nnodes", "1:4",
                        "--rdzv-endpoint", "head:29500", "--print-launch"])
    assert code == 0, capsys.readouterr().err
