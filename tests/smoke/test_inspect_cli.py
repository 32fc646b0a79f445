"""`moepar train tiny` then `moepar inspect` through the real command line: the report names the
model's MoE layers (1, 2, 3 of examples/tiny.toml), the plots are written, errors are one line."""

import json
import subprocess
import sys


def moepar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "moepar", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_train_then_inspect(tmp_path):
    train = moepar("train", "tiny", "--train.steps=3", "--train.warmup_steps=1",
                   "--train.global_batch_size=4", "--train.micro_batch_size=4",
                   "--router.bias_update_rate=0.001", "--run.dir=run", "--run.log_every=0",
                   "--run.tb_image_every=2", cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    result = moepar("inspect", "run", "--last", "2", "--step", "2", "--plots", "plots", "--json",
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["moe_layers"] == [1, 2, 3] and report["num_steps"] == 3
    copies = 4 * 128 * 2                      # sequences x seq_len x top_k, per layer and step
    assert [layer["layer"] for layer in report["layers"]] == [1, 2, 3]
    for layer in report["layers"]:
        assert sum(layer["step_tokens"]) == copies
        assert layer["tokens"] == 2 * copies              # the window: the last 2 steps
        assert layer["bias"] is not None
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "heatmap.png", "imbalance.png", "tokens_step_2.png"]
    text = moepar("inspect", "run", "--compare", "run", cwd=tmp_path)
    assert text.returncode == 0 and "layer 3" in text.stdout and "hottest" in text.stdout


def test_inspect_errors_are_one_line(tmp_path):
    result = moepar("inspect", "nowhere", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr == "moepar inspect: run directory 'nowhere' does not exist\n"
    result = moepar("inspect", ".", "--last", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--last 0 must be >= 1" in result.stderr
