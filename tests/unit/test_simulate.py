"""The meta-device simulation of a large world (bench/simulate.py) equals the closed-form bytes
per rank (plan/memory.py): Mixtral-8x7B at world 64, a DeepSeek-V3-sized model at world 2048,
and small layouts with tensor parallelism and every ZeRO stage."""

import math
import pathlib

import pytest

from moepar.bench.simulate import simulate
from moepar.config import load_config
from moepar.layers.shapes import param_count
from moepar.plan.memory import rank_memory
from moepar.build import build_dims

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def check(cfg, world, ranks):
    result = simulate(cfg, world, ranks)
    dims = build_dims(cfg, world)
    p = cfg.parallel
    for got in result["ranks"]:
        want = rank_memory(cfg.model, dims, got["rank"], p.zero, 4, p.pp_virtual, p.pp_layers)
        assert got["params"] == want["params"], (got, want)
        # ZeRO-1/2 pad each flat bucket to a multiple of its group (at most N-1 elements)
        pad = got["buckets"] * max(dims.dp, dims.edp) * 4 if p.zero in (1, 2) else 0
        assert abs(got["grads"] - want["grads"]) <= pad, (got, want)
        assert abs(got["optimizer"] - 2 * pad - want["optimizer"]) <= 2 * pad, (got, want)
    return result


def test_mixtral_8x7b_at_world_64():
    cfg = load_config(str(EXAMPLES / "mixtral_8x7b.toml"))
    result = check(cfg, 64, [0, 16, 63])
    assert result["total_params"] == param_count(cfg.model)["total"]
    assert abs(result["total_params"] / 1e9 - 46.7) < 0.05          # Mixtral's published size
    first, _, last = result["ranks"]
    # 8 layers per stage, 1 of 8 experts per EP rank; the last stage adds the head
    assert first["moe_layers"] == list(range(8)) and last["moe_layers"] == list(range(24, 32))
    assert first["params"] / 4 == pytest.approx(1.876e9, rel=1e-3)


def test_deepseek_v3_sized_at_world_2048():
    cfg = load_config(str(EXAMPLES / "deepseek_v3.toml"))
    result = check(cfg, 2048, [0, 1664, 2047])
    assert abs(result["total_params"] / 1e9 - 671.0) < 0.5        # DeepSeek-V3 without MTP
    counts = param_count(cfg.model)
    assert abs(counts["active"] / 1e9 - 37.5) < 1.0                 # ~37B active per token


@pytest.mark.parametrize("overrides, world", [
    (["--parallel.tp=2", "--parallel.ep=2", "--parallel.pp=2", "--parallel.zero=3"], 8),
    (["--parallel.tp=4", "--parallel.ep=4", "--parallel.zero=2"], 8),
    (["--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=1", "--model.num_kv_heads=1",
      "--parallel.tp=2"], 8),
    (["--parallel.ep=8", "--parallel.zero=3", "--model.attention=mla", "--model.q_lora_rank=16",
      "--model.kv_lora_rank=8", "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=4",
      "--model.v_head_dim=8", "--parallel.tp=2"], 16),
])
def test_small_layouts_match_the_formula_on_every_rank(overrides, world):
    cfg = load_config(str(EXAMPLES / "tiny.toml"), [*overrides, "--model.vocab_size=257",
                                                     "--train.global_batch_size=32",
                                                     "--train.micro_batch_size=1"])
    check(cfg, world, list(range(world)))


def test_moe_1b_on_one_gpu():
    """examples/moe_1b.toml (the GPU check's end-to-end model): about 1B parameters, 0.22B
    active, on one rank."""
    cfg = load_config(str(EXAMPLES / "moe_1b.toml"))
    result = check(cfg, 1, [0])
    assert abs(result["total_params"] / 1e9 - 1.01) < 0.01


def test_model_flops_per_token_by_hand():
    """PaLM's count for bench train's MFU: 6 x the non-embedding parameters a token uses + 12 x
    layers x seq x heads x head dim, here counted tensor by tensor."""
    from moepar.bench.train import flops_per_token
    cfg = load_config(str(EXAMPLES / "tiny.toml"))
    m = cfg.model
    D, L, H, G, hd, V = m.dim, m.num_layers, m.num_heads, m.num_kv_heads, m.dim // m.num_heads, m.vocab_size
    attention = D * H * hd * 2 + D * G * hd * 2             # q, o and k, v
    dense_ffn = 3 * D * m.ffn_dim
    moe = m.num_experts * D + m.top_k * 3 * D * m.moe_ffn_dim   # router + the k experts used
    norms = 2 * D                                              # counted, as PaLM's N does
    layers = sum(attention + norms + (moe if m.is_moe_layer(i) else dense_ffn) for i in range(L))
    matmul = layers + V * D + D                                # + the head and the final norm
    want = 6 * matmul + 12 * L * cfg.train.seq_len * H * hd
    assert flops_per_token(cfg) == want
