"""The command line: every command answers --help with exit 0, and benchmark options never
reach torch's launcher (a worker option is not parsed as one of the launcher's)."""

import json
import subprocess
import sys

import pytest

from moepar.cli import COMMANDS


def moepar(*args):
    return subprocess.run([sys.executable, "-m", "moepar", *args], capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    result = moepar(command, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"moepar {command}" in result.stdout


def test_train_help_lists_config_keys_with_defaults():
    result = moepar("train", "--help")
    assert result.returncode == 0
    assert "model.num_experts = 8" in result.stdout and "[parallel]" in result.stdout


def test_train_help_after_config_is_help_not_a_config_error():
    result = moepar("train", "examples/tiny.toml", "--help")
    assert result.returncode == 0 and "config keys" in result.stdout


def test_version_and_top_level_help():
    assert moepar("--version").stdout.startswith("moepar ")
    result = moepar("--help")
    assert result.returncode == 0 and all(c in result.stdout for c in COMMANDS)


def test_bench_pipeline_virtual_is_not_taken_by_the_launcher():
    """`--virtual` is a prefix of torchrun's `--virtual-local-rank`; it must reach the workers."""
    result = moepar("bench", "pipeline", "--pp", "2", "--microbatches", "2", "--schedule",
                    "interleaved_1f1b", "--virtual", "2", "--layers", "4", "--dim", "32",
                    "--heads", "4", "--experts", "4", "--seq", "16", "--repeats", "1",
                    "--warmup", "0", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["virtual"] == 2 and record["schedule"] == "interleaved_1f1b"
