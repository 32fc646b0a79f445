"""`moepar convert --from moepar` takes a run directory (its newest complete checkpoint, named in
the log), and `--to hf` without `--arch` guesses no architecture: the one the model fits, or a
refusal naming the choices and the flag."""

import json
import pathlib

import pytest

from moepar.config import load_config
from moepar.hf.arch import ARCHS
from moepar.hf.cli import main
ROOT = pathlib.Path(__file__).resolve().parents[2]

SMALL = ["--train.global_batch_size=4", "--train.micro_batch_size=4", "--train.seq_len=32",
         "--run.tensorboard=false", "--run.log_every=0"]


def _train(run_dir, extra):
    from moepar.train import Trainer
    cfg = load_config(str(ROOT / "examples" / "tiny.toml"),
                      SMALL + [f"--run.dir={run_dir}"] + extra)
    Trainer(cfg, log=lambda _m: None).run()
    return run_dir


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    """tiny.toml with per-head q/k norm (it fits qwen3_moe alone), checkpoints at steps 1 and 2."""
    return _train(tmp_path_factory.mktemp("q") / "run",
                  ["--model.qk_norm=head", "--train.steps=2", "--run.checkpoint_every=1"])


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_run_directory_converts_its_newest_checkpoint_and_says_so(qwen3_run, tmp_path, capsys):
    assert main(["--from", "moepar", str(qwen3_run), "--to", "hf", str(tmp_path / "run_hf")]) == 0
    out = capsys.readouterr().out
    newest = qwen3_run / "checkpoints" / "step_2"
    assert f"converting {newest}: the newest complete checkpoint of run {qwen3_run}" in out
    assert "architecture qwen3_moe: the only one this model fits (--arch NAME to choose)" in out
    # the same bytes as the step_2 checkpoint exported by name with --arch, and not step_1's
    for step, name in ((2, "step2_hf"), (1, "step1_hf")):
        assert main(["--from", "moepar", str(qwen3_run / "checkpoints" / f"step_{step}"),
                     "--to", "hf", str(tmp_path / name), "--arch", "qwen3_moe"]) == 0
    assert _files(tmp_path / "run_hf") == _files(tmp_path / "step2_hf")
    assert _files(tmp_path / "run_hf") != _files(tmp_path / "step1_hf")
    assert json.loads((tmp_path / "run_hf" / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_a_model_that_fits_no_architecture_is_refused_with_the_choices(tmp_path, capsys):
    run = _train(tmp_path / "tiny", ["--train.steps=1"])
    assert main(["--from", "moepar", str(run), "--to", "hf", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "moepar: conversion error: this model fits no Hugging Face architecture, and --arch " \
           "was not given; the choices for --arch NAME, and what each needs:" in err
    for name in ARCHS:
        assert f"\n  {name}: this model has " in err
    assert "cannot write this model as" not in err and "never committed" not in err
    assert not (tmp_path / "out").exists()


def test_several_fitting_architectures_are_not_guessed(qwen3_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("moepar.hf.arch.matching_archs", lambda _m, _r: ["mixtral", "qwen3_moe"])
    assert main(["--from", "moepar", str(qwen3_run), "--to", "hf", str(tmp_path / "out")]) == 1
    assert ("this model fits several Hugging Face architectures (mixtral, qwen3_moe); choose one "
            "with --arch NAME") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_without_a_checkpoint_is_named(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["--from", "moepar", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "has no complete checkpoint" in err and "never committed" not in err
