"""The planner and the dry run under context parallelism: activations per rank fall by about
1/cp (keys stay whole: cp gathers them), and DeepSeek-V3 at 131,072 positions on 2048 H100s gets a
plan that fits, with cp 16 (the search, `moepar plan --seq-len 131072`, finds it; docs/planner.md)."""

import pathlib

from moepar.bench.simulate import simulate
from moepar.build import build_dims
from moepar.config import load_config
from moepar.dryrun import activations
from moepar.plan.activations import ActSpec, embed_bytes, head_bytes, layer_bytes
from moepar.plan.candidates import Layout, Request, evaluate
from moepar.plan.hardware import PRESETS

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_activation_bytes_fall_by_cp_but_keys_stay_whole():
    cfg = load_config(str(EXAMPLES / "tiny.toml"))
    one, two = ActSpec(1, 4096, cp=1), ActSpec(1, 4096, cp=2)
    # Token-sized pieces halve exactly; attention keeps k and v of the whole sequence.
    assert embed_bytes(cfg.model, two) == embed_bytes(cfg.model, one) / 2
    assert head_bytes(cfg.model, two)["saved"] == head_bytes(cfg.model, one)["saved"] / 2
    whole, half = (layer_bytes(cfg.model, cfg.router, 0, s)["saved"] for s in (one, two))
    G, d = cfg.model.num_kv_heads, cfg.model.head_dim_resolved
    kv = 4096 * G * d * 2 * 2               # k and v, bf16, whole sequence on every cp rank
    assert half == (whole - kv) / 2 + kv


def test_dry_run_activations_fall_with_cp():
    totals = []
    for cp in (1, 2, 4):
        cfg = load_config(str(EXAMPLES / "moe_1b.toml"), [
            f"--parallel.cp={cp}", "--parallel.dp=0", "--parallel.pp=1", "--parallel.ep=1",
            "--train.micro_batch_size=1", f"--train.global_batch_size={4 // cp}",
            "--train.seq_len=8192", "--model.max_seq_len=8192"])
        act = activations(cfg, build_dims(cfg, 4))
        assert act["positions"] == 8192 // cp
        totals.append(act["total"])
    assert 0.5 < totals[1] / totals[0] < 0.6 and 0.5 < totals[2] / totals[1] < 0.65, totals


def test_deepseek_v3_at_131072_positions_fits_on_2048_h100_with_cp():
    base = load_config(str(EXAMPLES / "deepseek_v3.toml"))
    req = Request(base, 2048, 8, 131072, 128 * 131072, PRESETS["h100-80g"])
    layout = Layout(1, 1, "1f1b", 128, 1, 8, 3, 1, "full", None, cp=16)
    plan = evaluate(req, layout)
    assert plan.fits, plan.reason
    assert plan.time["cp"] > 0       # the key all-gathers are costed


def test_simulate_builds_cp_ranks_and_their_activations_fall():
    """`bench memory --simulate` runs apply_cp on a fake world: cp ranks hold every dense
    parameter (only the sequences are split) and the activation estimate halves, about."""
    results = []
    for cp in (1, 2):
        cfg = load_config(str(EXAMPLES / "tiny.toml"), [
            f"--parallel.cp={cp}", "--parallel.dp=0", "--train.micro_batch_size=1",
            f"--train.global_batch_size={2 // cp}"])
        results.append(simulate(cfg, 2, [1]))
    one, two = results
    assert two["ranks"][0]["cp"] == 1 and one["ranks"][0]["cp"] == 0
    assert two["ranks"][0]["params"] == one["ranks"][0]["params"]
    assert 0.5 < two["activations"]["total"] / one["activations"]["total"] < 0.6
