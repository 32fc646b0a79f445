"""Several "nodes" on localhost, each a `moepar train` launcher of its own joined by torch's c10d
rendezvous: 2 nodes x 2 processes give the single-process losses in float64; an elastic job that
loses a node restarts at the smaller world from its newest checkpoint and trains to the end,
with the losses of an uninterrupted run resumed from that checkpoint at that layout."""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from configs import tiny_config
from net import free_port
from moepar.config import load_config, to_toml


def config_file(tmp_path, *overrides) -> str:
    """tiny_config in float64 with experts over 2 ranks, as a TOML file."""
    cfg = tiny_config(tmp_path / "unused", "--train.dtype=float64", "--train.global_batch_size=8",
                      "--parallel.ep=2", "--parallel.zero=1", "--parallel.timeout_s=60",
                      "--run.log_every=1", *overrides)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    return str(path)


def env():
    out = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        out.pop(key, None)
    return out


def start(*args, log: pathlib.Path) -> subprocess.Popen:
    """One node's launcher, in a session of its own (killing it kills that node alone)."""
    return subprocess.Popen([sys.executable, "-m", "moepar", "train", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env(),
                            start_new_session=True)


def wait_for_store(port: int, launcher: subprocess.Popen, timeout: float = 120):
    """Until the first launcher's agent listens on the rendezvous port (it hosts the store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"no rendezvous store on port {port} (launcher exit {launcher.poll()})")


def losses(run_dir) -> dict[int, float]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_two_nodes_of_two_processes_equal_one_process(tmp_path):
    config = config_file(tmp_path, "--train.steps=3")
    one = subprocess.run([sys.executable, "-m", "moepar", "train", config, "--parallel.ep=1",
                          "--parallel.zero=0", f"--run.dir={tmp_path / 'one'}"], capture_output=True, text=True,
                         env=env(), timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    port = free_port()
    nodes = [start(config, "--nproc", "2", "--nnodes", "2", "--node-rank", str(r),
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                   f"--run.dir={tmp_path / 'four'}", log=tmp_path / f"node{r}.log")
             for r in range(2)]
    try:
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    out = "".join(logs)
    assert "world 4 = pp 1 x dp 4 x tp 1; experts: pp 1 x edp 2 x ep 2" in out
    assert "nodes: 2 nodes of 2 ranks; inside a node: ep" in out   # from LOCAL_WORLD_SIZE
    single, four = losses(tmp_path / "one"), losses(tmp_path / "four")
    assert sorted(single) == sorted(four) == [1, 2, 3]
    for step in single:
        assert abs(single[step] - four[step]) <= 1e-9 * abs(single[step]), (step, single, four)


def test_elastic_job_loses_a_node_and_finishes_at_the_smaller_world(tmp_path):
    steps = 40
    config = config_file(tmp_path, f"--train.steps={steps}", "--run.checkpoint_every=4",
                         "--run.keep_checkpoints=0")
    run_dir = tmp_path / "run"
    port = free_port()
    common = [config, "--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "elastic", "--max-restarts", "1",
              "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2",
              "--run.resume=auto", f"--run.dir={run_dir}"]
    node_a = start(*common, log=tmp_path / "a.log")
    wait_for_store(port, node_a)     # node A hosts the rendezvous store: B is the one lost
    node_b = start(*common, log=tmp_path / "b.log")
    try:
        first = run_dir / "checkpoints" / "step_4" / "manifest.json"
        deadline = time.monotonic() + 180
        while not first.exists() and node_a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.exists(), (tmp_path / "a.log").read_text()[-3000:]
        os.killpg(node_b.pid, signal.SIGKILL)      # node B is lost, its workers with it
        node_b.wait(timeout=30)
        code = node_a.wait(timeout=240)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    log_a, log_b = (tmp_path / "a.log").read_text(), (tmp_path / "b.log").read_text()
    assert code == 0, log_a[-4000:]
    assert "world 4 = pp 1 x dp 4" in log_a + log_b          # the first round: both nodes
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", log_a)
    assert len(resumed) == 1, log_a[-4000:]
    path, step = resumed[0][0], int(resumed[0][1])
    assert 4 <= step < steps and "world 2 = pp 1 x dp 2" in log_a
    after = losses(run_dir)
    assert sorted(after) == list(range(1, steps + 1))
    # the reference: an uninterrupted run at world 2 from a copy of that checkpoint
    ref = tmp_path / "ref"
    shutil.copytree(path, ref / "checkpoints" / f"step_{step}")
    result = subprocess.run([sys.executable, "-m", "moepar", "train", config, "--nproc", "2",
                             "--run.resume=true", f"--run.dir={ref}"], capture_output=True,
                            text=True, env=env(), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = losses(ref)
    assert sorted(reference) == list(range(step + 1, steps + 1))
    for s in reference:
        assert reference[s] == after[s], (s, reference[s], after[s])
    assert load_config(str(run_dir / "config.toml")).run.resume is False
