"""`moepar train CFG --dry-run`: the counts against the real model (built on CPU or on the meta
device by the trainer's own path) and published figures; nothing started or written."""

import math
import pathlib

import pytest

from moepar.config import load_config
from moepar.dryrun import dry_run
from moepar.launch import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
EX = ROOT / "examples"


@pytest.fixture
def train(monkeypatch, tmp_path, capsys):
    """Runs `moepar train ARGS --dry-run` in an empty folder: (exit code, stdout, stderr)."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args):
        code = main([*map(str, args), "--dry-run"])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


@pytest.mark.parametrize("example", ["tiny.toml", "tiny_dsv3.toml"])   # the latter: MTP, MLA
def test_tiny_counts_equal_the_real_model_and_nothing_is_written(train, tmp_path, example):
    import torch

    from moepar.layers import Transformer
    code, out, err = train(EX / example, "--run.dir=runs/dry")
    assert code == 0, err
    assert list(tmp_path.iterdir()) == []          # no run.dir, no lock file, nothing
    cfg = load_config(str(EX / example))
    model = Transformer(cfg.model, cfg.router, seed=0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    expert = sum(n for name, n in sizes.items() if ".experts." in name)
    total = sum(sizes.values())
    active = total - expert + expert * cfg.model.top_k // cfg.model.num_experts
    assert f"total {total:,} " in out
    assert f"active per token {active:,} " in out
    assert 'dir = "runs/dry"' in out               # the resolved config, overrides applied
    assert "world 1 = pp 1 x dp 1 x tp 1" in out
    # one rank holds everything: 4 bytes of parameters, 4 of gradients, 8 of AdamW per element
    assert f"holds {total:,} parameters" in out
    assert torch.get_default_device().type == "cpu"


def test_per_stage_counts_equal_the_real_model_split_by_hand():
    """pp 2, ep 2 on 4 ranks: stage 0 holds the embedding and layers 0-1, stage 1 layers 2-3,
    the norm and the head; each EP rank half of each expert stack."""
    from moepar.layers import Transformer
    cfg = load_config(str(EX / "tiny.toml"), ["--parallel.pp=2", "--parallel.ep=2"])
    model = Transformer(cfg.model, cfg.router, seed=0)

    def held(prefixes):
        dense = expert = 0
        for name, p in model.named_parameters():
            if name.startswith(prefixes):
                if ".experts." in name:
                    expert += p.numel() // 2
                else:
                    dense += p.numel()
        return dense, expert
    want = [held(("embed.", "layers.0.", "layers.1.")),
            held(("layers.2.", "layers.3.", "norm.", "head."))]
    kinds = dry_run(cfg, 4)["kinds"]
    got = [(k["memory"]["dense_params"], k["memory"]["expert_params"]) for k in kinds]
    assert got == want
    assert [k["ranks"] for k in kinds] == [[0, 1], [2, 3]]
    assert [k["pp"] for k in kinds] == [[0], [1]]


@pytest.mark.parametrize("example, layout", [
    ("tiny.toml", ["--parallel.pp=2", "--parallel.ep=2"]),
    ("tiny.toml", ["--parallel.ep=4", "--parallel.zero=3"]),
    ("tiny.toml", ["--parallel.tp=2", "--parallel.ep=2"]),
    ("tiny_dsv3.toml", ["--parallel.pp=2", "--parallel.ep=2", "--train.optimizer=adamw"])])
def test_bytes_per_rank_equal_the_meta_device_simulation(example, layout):
    """The trainer's own build path (meta device, fake world of 4, parallelize) counts each
    rank's bytes; the dry run's arithmetic must give the same numbers (tiny_dsv3: its MTP
    depth on the last stage)."""
    from moepar.bench.simulate import simulate
    cfg = load_config(str(EX / example), layout)
    by_rank = {r: k["memory"] for k in dry_run(cfg, 4)["kinds"] for r in k["ranks"]}
    sim = simulate(cfg, 4, ranks=[0, 1, 2, 3])
    for r in sim["ranks"]:
        mine = by_rank[r["rank"]]
        assert (mine["params"], mine["grads"], mine["optimizer"]) == (
            r["params"], r["grads"], r["optimizer"]), (layout, r["rank"])


def test_mixtral_matches_the_published_counts(train):
    code, out, err = train(EX / "mixtral_8x7b.toml", "--nproc", 64)
    assert code == 0, err
    r = dry_run(load_config(str(EX / "mixtral_8x7b.toml")), 64)
    # Mistral's figures: 46.7B parameters, 12.9B active per token
    assert round(r["params"]["total"] / 1e9, 1) == 46.7
    assert round(r["params"]["active"] / 1e9, 1) == 12.9
    # pp 4 of 32 layers, ep 8 of 8 experts: each rank one expert of 8 layers, SwiGLU 3*D*F each
    experts = 8 * 3 * 4096 * 14336
    assert [k["memory"]["expert_params"] for k in r["kinds"]] == [experts] * 3
    assert [k["pp"] for k in r["kinds"]] == [[0], [1, 2], [3]]
    assert "world 64 = pp 4 x dp 16 x tp 1; experts: pp 4 x edp 2 x ep 8" in out


def test_deepseek_v3_and_moe_1b_dry_run(train):
    code, out, err = train(EX / "deepseek_v3.toml", "--nproc", 2048)
    assert code == 0, err
    # DeepSeek-V3's published 671B total, 37B active (main model, without the MTP module)
    assert "(671.03B)" in out and "(37.55B;" in out
    code, out, err = train(EX / "moe_1b.toml")
    assert code == 0, err
    cfg = load_config(str(EX / "moe_1b.toml"))
    # bfloat16 training: a float32 master (4 bytes) and a bf16 compute weight (2) per parameter
    assert f"params {dry_run(cfg, 1)['params']['total'] * (4 + 2) / 2 ** 30:.2f}," in out


def test_cluster_shows_the_node_split_at_every_node_count(train):
    args = (EX / "cluster" / "moe_cluster.toml", "--nproc", 8, "--rdzv-endpoint", "h:1")
    code, out, err = train(*args, "--nnodes", 4)
    assert code == 0, err
    assert "4 node(s) x 8 process(es): world 32 = pp 1 x dp 32" in out
    assert "4 nodes of 8 ranks; inside a node: ep; across nodes: dp, edp" in out
    code, out, err = train(*args, "--nnodes", "2:4")
    assert code == 0, err
    lines = [line for line in out.splitlines() if " node(s) x 8 process(es): " in line]
    assert [line.split(" ")[0] for line in lines] == ["2", "3", "4"]
    assert "world 16 (the smallest world of --nnodes)" in out


def test_zero_shards_by_hand():
    """ZeRO-1 on 4 dp ranks: parameters and gradients whole, AdamW state a quarter."""
    cfg = load_config(str(EX / "tiny.toml"), ["--parallel.zero=1"])
    m = dry_run(cfg, 4)["kinds"][0]["memory"]
    n = m["dense_params"] + m["expert_params"]
    assert (m["params"], m["grads"], m["optimizer"]) == (4 * n, 4 * n, 2 * 4 * n / 4)
    assert math.isclose(m["optimizer"], 2 * n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_bf16_moments_count_4_bytes_of_adamw_state(dtype):
    """train.optim_state_dtype = "bfloat16": m and v take 2 bytes each, whatever the masters."""
    cfg = load_config(str(EX / "tiny.toml"), [f"--train.dtype={dtype}",
                                              "--train.optim_state_dtype=bfloat16"])
    m = dry_run(cfg, 1)["kinds"][0]["memory"]
    assert m["optimizer"] == 4 * (m["dense_params"] + m["expert_params"])


@pytest.mark.parametrize("args, named", [
    (["--nproc", "3", "--parallel.ep=2"], "parallel.ep=2"),
    (["--model.nope=1"], "nope"),
    (["--nproc", "2", "--nnodes", "1:3", "--rdzv-endpoint", "h:1"],   # 16 sequences, 6 dp ranks
     "at 3 node(s) x 2 process(es)"),
])
def test_bad_configs_still_exit_2_naming_the_problem(train, tmp_path, args, named):
    code, out, err = train(EX / "tiny.toml", *args)
    assert code == 2 and out == ""
    assert "config error" in err and named in err
    assert list(tmp_path.iterdir()) == []
