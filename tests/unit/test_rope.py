"""YaRN rotary tables (layers/rope.py) without transformers: the config checks, the limits where
YaRN is plain RoPE, and a hand-worked small case. test_hf_deepseek.py compares with transformers."""

import math

import pytest
import torch

from moepar.layers import Transformer
from moepar.layers.model import ModelConfig
from moepar.layers.rope import YaRN, rotary_tables


def test_factor_one_is_plain_rope():
    plain = rotary_tables(40, 16, 500.0)
    for got, want in zip(rotary_tables(40, 16, 500.0, yarn=YaRN(1.0, 16)), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_hand_worked_frequencies():
    """dim 8, theta 10000, original 64, beta_fast 2, beta_slow 1: the correction dims are
    8 ln(64 / (b 2 pi)) / (2 ln 10000) = 0.707 (b=2) and 1.008 (b=1); truncated to 0 and 2,
    so the ramp over the 4 frequencies is (0, 0.5, 1, 1): frequency 0 kept, 1 half-way,
    2 and 3 divided by the factor 4. cos/sin are scaled by 0.1 ln 4 + 1."""
    base = [10000.0 ** (-i / 8) for i in (0, 2, 4, 6)]
    want = [base[0], 0.5 * base[1] / 4 + 0.5 * base[1], base[2] / 4, base[3] / 4]
    yarn = YaRN(4.0, 64, beta_fast=2, beta_slow=1)
    torch.testing.assert_close(yarn.inv_freq(8, 10000.0), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-15, atol=0)
    cos, sin = rotary_tables(3, 8, 10000.0, yarn=yarn)
    scale = 0.1 * math.log(4) + 1
    assert cos[2, 1].item() == pytest.approx(math.cos(2 * want[1]) * scale, rel=1e-14)
    assert sin[2, 5].item() == pytest.approx(math.sin(2 * want[1]) * scale, rel=1e-14)
    assert YaRN(4.0, 64, mscale=0.5, mscale_all_dim=1.0).cos_sin_scale == pytest.approx(
        (0.05 * math.log(4) + 1) / scale, rel=1e-15)
    assert YaRN(4.0, 64, mscale_all_dim=1.0).softmax_scale_factor == pytest.approx(scale ** 2)


def test_mla_softmax_scale_follows_mscale_all_dim():
    cfg = dict(attention="mla", num_kv_heads=4, kv_lora_rank=8, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=8, max_seq_len=32)
    plain = Transformer(ModelConfig(**cfg)).layers[0].attn.softmax_scale
    yarn = Transformer(ModelConfig(**cfg, rope_scaling="yarn", rope_factor=4.0,
                                   rope_original_max_seq_len=8, rope_mscale_all_dim=0.5))
    assert plain is None     # SDPA's own 1/sqrt(16)
    assert yarn.layers[0].attn.softmax_scale == pytest.approx(16 ** -0.5 * (0.05 * math.log(4) + 1) ** 2)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_scaling="ntk"), "model.rope_scaling='ntk' is not one of"),
    (dict(rope_scaling="yarn", rope_factor=0.5, rope_original_max_seq_len=8), "model.rope_factor=0.5"),
    (dict(rope_scaling="yarn", rope_factor=2.0), "model.rope_original_max_seq_len=0 must be >= 1"),
    (dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max_seq_len=8, rope_mscale=-1.0),
     "model.rope_mscale=-1.0"),
])
def test_bad_yarn_fields_named(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelConfig(**fields)
