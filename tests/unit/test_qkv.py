"""The fused q/k/v projection (layers/model.py Attention.qkv_proj) against attention built from
three separate nn.Linear layers holding the same weights, in float64: outputs, input gradients
and every parameter gradient (the fused gradient is the three stacked), with and without biases
and q/k norms; and the GEMMs one attention forward and backward runs (counted by the profiler).

Legend: B batch, S sequence, D model dim, H/G query/kv heads, Hd head dim."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from moepar.layers import ModelConfig, RouterConfig, Transformer
from moepar.layers.rope import apply_rotary, rotary_tables

B, S, D, H, G = 2, 6, 16, 4, 2
HD = D // H


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class SeparateQKV(nn.Module):
    """Attention as it was before the fusion: q_proj, k_proj, v_proj each a Linear; SDPA with
    the kv heads repeated for their query heads."""

    def __init__(self, fused, qk_norm: str, eps: float):
        super().__init__()
        bias = fused.qkv_proj.bias is not None
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, n * HD, bias=bias).double()
                                                 for n in (H, G, G))
        self.o_proj = nn.Linear(H * HD, D, bias=False).double()
        with torch.no_grad():
            for lin, w in zip((self.q_proj, self.k_proj, self.v_proj),
                              fused.qkv_proj.weight.split([H * HD, G * HD, G * HD]), strict=True):
                lin.weight.copy_(w)
            if bias:
                for lin, b in zip((self.q_proj, self.k_proj, self.v_proj),
                                  fused.qkv_proj.bias.split([H * HD, G * HD, G * HD]), strict=True):
                    lin.bias.copy_(b)
            self.o_proj.weight.copy_(fused.o_proj.weight)
        self.qk_norm, self.eps = qk_norm, eps
        if qk_norm != "none":
            self.q_norm_weight = nn.Parameter(fused.q_norm.weight.detach().clone())
            self.k_norm_weight = nn.Parameter(fused.k_norm.weight.detach().clone())

    def forward(self, x_BSD, cos, sin):
        q, k, v = self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)
        if self.qk_norm == "full":
            q, k = _rms(q, self.q_norm_weight, self.eps), _rms(k, self.k_norm_weight, self.eps)
        q, k, v = (t.view(B, S, -1, HD).transpose(1, 2) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = _rms(q, self.q_norm_weight, self.eps), _rms(k, self.k_norm_weight, self.eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * HD))


def _fused(bias: bool, qk_norm: str):
    cfg = ModelConfig(vocab_size=32, dim=D, num_layers=1, num_heads=H, num_kv_heads=G,
                      ffn_dim=16, max_seq_len=S, attention_bias=bias, qk_norm=qk_norm)
    attn = Transformer(cfg, RouterConfig(), seed=3).double().layers[0].attn
    with torch.no_grad():       # non-trivial biases and norm weights, so their paths show
        gen = torch.Generator().manual_seed(4)
        for name, p in attn.named_parameters():
            if name != "qkv_proj.weight" and name != "o_proj.weight":
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=gen))
    return attn, cfg.norm_eps


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
def test_fused_qkv_equals_three_linears(bias, qk_norm):
    fused, eps = _fused(bias, qk_norm)
    separate = SeparateQKV(fused, qk_norm, eps)
    cos, sin = rotary_tables(S, HD, 100.0, torch.float64)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, S, D, dtype=torch.float64, generator=gen)
    g = torch.randn(B, S, D, dtype=torch.float64, generator=gen)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = fused(x1, cos, sin), separate(x2, cos, sin)
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y1, y2, **tol)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, **tol)
    three = (separate.q_proj, separate.k_proj, separate.v_proj)
    torch.testing.assert_close(fused.qkv_proj.weight.grad,
                               torch.cat([lin.weight.grad for lin in three]), **tol)
    if bias:
        torch.testing.assert_close(fused.qkv_proj.bias.grad,
                                   torch.cat([lin.bias.grad for lin in three]), **tol)
    torch.testing.assert_close(fused.o_proj.weight.grad, separate.o_proj.weight.grad, **tol)
    if qk_norm != "none":
        torch.testing.assert_close(fused.q_norm.weight.grad, separate.q_norm_weight.grad, **tol)
        torch.testing.assert_close(fused.k_norm.weight.grad, separate.k_norm_weight.grad, **tol)


def _gemms(fn) -> int:
    """aten::mm and aten::addmm calls while fn runs (SDPA's own kernels are not counted)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = Counter(e.name for e in prof.events())
    return names["aten::mm"] + names["aten::addmm"]


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_one_gemm_forward_two_backward(bias):
    # q/k/v: 3 forward + 6 backward GEMMs as separate Linears, 1 + 2 fused; o_proj adds 1 + 2.
    fused, eps = _fused(bias, "none")
    cos, sin = rotary_tables(S, HD, 100.0, torch.float64)
    counts = {}
    for name, attn in (("fused", fused), ("separate", SeparateQKV(fused, "none", eps))):
        x = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
        out = []
        forward = _gemms(lambda: out.append(attn(x, cos, sin)))
        backward = _gemms(lambda: out[0].sum().backward())
        counts[name] = (forward, backward)
    assert counts == {"fused": (1 + 1, 2 + 2), "separate": (3 + 1, 6 + 2)}
