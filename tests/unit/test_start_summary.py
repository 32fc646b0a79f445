"""`moepar train` starts with a few lines that say what runs (config, overrides, model, length,
where it writes), not the ~170-line resolved config: that goes to run.dir/config.toml, and to the
screen with --verbose."""

import pathlib

from moepar.config import load_config, to_toml
from moepar.launch import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.toml")


def start(tmp_path, *extra):
    overrides = ["--train.steps=1", "--train.global_batch_size=2", "--train.micro_batch_size=2",
                 "--train.seq_len=16", "--run.tensorboard=false", "--run.log_every=1",
                 f"--run.dir={tmp_path / 'run'}", *extra]
    assert main([TINY, *overrides]) == 0
    return overrides


def test_the_start_is_a_summary_and_the_full_config_is_in_the_run_dir(tmp_path, capsys):
    overrides = start(tmp_path)
    out = capsys.readouterr().out.splitlines()
    head = out[:out.index(next(line for line in out if line.startswith("layout:")))]
    run = tmp_path / "run"
    assert head == [
        f"config: {TINY} {' '.join(overrides)}",
        "model: 4 layers (1 dense, 3 MoE: top-2 of 8 experts, topk softmax, capacity 1.25), "
        "dim 128, gqa attention, vocabulary 256",
        "train: 1 steps of 2 x 16 tokens, lr 0.003, float32, seed 0; data builtin",
        f"run: {run} (the resolved config: {run}/config.toml; --verbose prints it here)"]
    assert not any(line.startswith("[") for line in out)          # no TOML section on screen
    cfg = load_config(TINY, overrides)
    assert load_config(str(run / "config.toml")) == cfg            # the whole config, written
    assert len(to_toml(cfg).splitlines()) > 100                    # what is no longer printed


def test_verbose_prints_the_resolved_config(tmp_path, capsys):
    overrides = start(tmp_path, "--verbose")
    out = capsys.readouterr().out
    assert out.startswith(to_toml(load_config(TINY, overrides[:-1])))     # less --verbose


def test_a_dense_model_says_so(tmp_path, capsys):
    start(tmp_path, "--model.num_experts=0")
    assert "model: 4 layers (all dense, no MoE layer), dim 128" in capsys.readouterr().out
