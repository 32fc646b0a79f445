"""`moepar bench train --against-hf`: the plain-loop baseline is transformers' Mixtral with
exactly moepar's shapes (checked by parameter count against moepar's own model), it refuses
what Mixtral cannot run by name, and one step of each side runs through the command line."""

import json
import subprocess
import sys

import pytest

from moepar.bench.hf_baseline import bench_against_hf, hf_mixtral
from moepar.layers import Transformer
from tests.configs import tiny_config

MIXTRAL = ["--router.capacity_factor=none", "--router.norm_topk_prob=true"]


def test_baseline_has_moepar_shapes(tmp_path):
    cfg = tiny_config(tmp_path, *MIXTRAL)
    hf = hf_mixtral(cfg)
    ours = Transformer(cfg.model, cfg.router)
    count = lambda model: sum(p.numel() for p in model.parameters())
    assert count(hf) == count(ours)
    assert hf.config.num_local_experts == cfg.model.num_experts
    assert hf.config.num_experts_per_tok == cfg.model.top_k


@pytest.mark.parametrize("override, named", [
    ("--router.capacity_factor=1.25", "router.capacity_factor=1.25"),
    ("--model.first_k_dense=1", "dense (non-MoE) layers [0]"),
])
def test_refuses_what_mixtral_cannot_run(tmp_path, override, named):
    cfg = tiny_config(tmp_path, *MIXTRAL, override)
    with pytest.raises(ValueError, match="cannot run this model") as err:
        hf_mixtral(cfg)
    assert named in str(err.value)


def test_one_alternating_step_each(tmp_path):
    cfg = tiny_config(tmp_path, *MIXTRAL)
    r = bench_against_hf(cfg, steps=1, warmup=0)
    assert r["speedup"] == pytest.approx(r["hf_step_ms"] / r["moepar_step_ms"])
    assert r["tokens_per_step"] == cfg.train.global_batch_size * cfg.train.seq_len


def test_cli_refuses_by_name_with_exit_2():
    result = subprocess.run([sys.executable, "-m", "moepar", "bench", "train", "--config", "tiny",
                             "--against-hf"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "router.capacity_factor=1.25" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_overrides_reach_the_config():
    result = subprocess.run([sys.executable, "-m", "moepar", "bench", "train", "--config", "tiny",
                             "--model.num_layers=1", "--model.dim=32", "--model.num_heads=4",
                             "--model.num_kv_heads=2", "--model.moe_ffn_dim=32",
                             "--train.seq_len=16", "--train.global_batch_size=2",
                             "--train.micro_batch_size=2", "--steps", "1", "--warmup", "0",
                             "--json"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["tokens_per_step"] == 32
