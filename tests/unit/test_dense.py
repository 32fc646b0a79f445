"""Dense models for MoE-vs-dense comparisons: `model.num_experts = 0` (or `first_k_dense =
num_layers`) builds no router, trains without warnings, logs no router fields, and its dry run
says dense; with `ffn_dim = top_k * moe_ffn_dim` its active parameters are the MoE model's less
the routers."""

import json
import pathlib
import warnings

import pytest

from moepar.config import load_config
from moepar.dryrun import dry_run_text
from moepar.layers import Transformer
from moepar.layers.shapes import param_count
from moepar.progress import progress_line
ROOT = pathlib.Path(__file__).resolve().parents[2]

SMALL = ["--train.steps=2", "--train.global_batch_size=4", "--train.micro_batch_size=2",
         "--train.seq_len=32", "--run.tensorboard=false", "--run.log_every=0"]
WAYS = {"num_experts=0": ["--model.num_experts=0"], "first_k_dense": ["--model.first_k_dense=4"]}


def config(tmp_path, extra):
    return load_config(str(ROOT / "examples" / "tiny.toml"),
                       SMALL + [f"--run.dir={tmp_path}"] + extra)


def train(cfg):
    from moepar.train import Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # metrics.py's std() warning was one
        return Trainer(cfg, log=lambda _m: None).run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {name: (train(config(tmp_path_factory.mktemp(name), extra)), extra)
            for name, extra in WAYS.items()}


def test_both_ways_train_the_same_dense_model_without_warnings(runs):
    (a, _), (b, _) = runs.values()
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 2
    for records, _ in runs.values():
        for r in records:
            assert set(r) == {"step", "loss", "grad_norm", "lr", "tokens_per_s", "skipped"}


def test_the_progress_line_has_no_router_fields(runs):
    record = runs["num_experts=0"][0][-1]
    line = progress_line(record, 2, 1234.0, 61.0, 0.0)
    assert line == (f"step     2/2 | loss {record['loss']:.4f} | gnorm {record['grad_norm']:.3f} | "
                    f"lr {record['lr']:.2e} | 1.2k tok/s | 0:01:01 elapsed, eta 0:00:00")
    moe = {**record, "aux_loss": 0.0317, "z_loss": 0.0114, "max_load_ratio": 3.58,
           "drop_fraction": 0.368}
    assert " | aux 0.0317 | z 1.14e-02 | " in progress_line(moe, 2, 1234.0, 61.0, 0.0)
    assert " | load max/mean 3.58 | drop 36.8% | " in progress_line(moe, 2, 1234.0, 61.0, 0.0)


def test_metrics_files_hold_no_router_fields(runs, tmp_path):
    cfg = config(tmp_path, WAYS["num_experts=0"])
    train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(x) for x in lines] == [sorted(r) for r in runs["num_experts=0"][0]]
    assert len((tmp_path / "expert_load.jsonl").read_text().splitlines()) == 1   # the header


@pytest.mark.parametrize("way", WAYS)
def test_the_dry_run_says_dense(tmp_path, way):
    text = dry_run_text(config(tmp_path, WAYS[way]), 1)
    assert "(1.05M; dense: no MoE layer, every one of the 4 layers a plain FFN)" in text
    assert "top_k" not in text.split("# parameters")[1]
    moe = dry_run_text(config(tmp_path, []), 1)
    assert "top_k 2 of 8 experts in 3 of 4 layers)" in moe


def test_equal_active_parameters_but_the_routers(tmp_path):
    """tiny.toml (3 MoE layers, top-2 of 8 experts of 256) against a dense model whose FFN is
    top_k * moe_ffn_dim = 512 wide: the same active parameters per token, less the 3 routers'
    8 x 128 weights, which the dense model has no use for."""
    moe = config(tmp_path, [])
    dense = config(tmp_path, ["--model.num_experts=0", "--model.ffn_dim=512"])
    m, d = param_count(moe.model), param_count(dense.model)
    assert m["active"] - d["active"] == 3 * 8 * 128
    built = Transformer(dense.model, dense.router)
    assert sum(p.numel() for p in built.parameters()) == d["total"] == d["active"]
    assert d["expert"] == 0


def test_num_experts_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match=r"model\.num_experts=-1 must be >= 0"):
        config(tmp_path, ["--model.num_experts=-1"])
