"""The blocks' hand-written elementwise ops against their plain formulas: SwiGLU
(layers/experts.py) and RoPE (layers/rope.py) as autograd Functions that save only what
backward needs, and RMSNorm's output dtype under bf16.

Legend: R rows, F hidden dim, B batch, H heads, S sequence, Hd head dim.
"""

import pytest
import torch
import torch.nn.functional as F

from moepar.layers.experts import _SwiGLU
from moepar.layers.rope import RMSNorm, apply_rotary, rotary_tables


def _plain_swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _plain_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


def _saved_bytes(fn, *args):
    """(output, bytes autograd keeps for backward) of fn(*args)."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(saved)


def _value_and_grads(fn, *inputs, grad):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    out.backward(grad)
    return out, *[t.grad for t in inputs if t.requires_grad]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_swiglu_equals_autograd_of_the_plain_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(37, 2 * 24, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(37, 24, generator=gen).to(dtype)
    got = _value_and_grads(_SwiGLU.apply, h, grad=grad)
    want = _value_and_grads(_plain_swiglu, h, grad=grad)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)        # the same ATen ops on the same values: bit-identical


def test_swiglu_gradcheck_and_saves_h_alone():
    h = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (h,))
    h = torch.randn(64, 2 * 32, dtype=torch.float32, requires_grad=True)
    _, saved = _saved_bytes(_SwiGLU.apply, h)
    assert saved == h.untyped_storage().nbytes()        # no silu output kept
    _, plain = _saved_bytes(_plain_swiglu, h)
    assert plain > saved


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotary_equals_autograd_of_the_plain_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    cos, sin = rotary_tables(12, 16, 100.0, torch.float64)
    # a transposed view, as attention passes it
    x = torch.randn(2, 12, 3, 16, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    grad = torch.randn(2, 3, 12, 16, generator=gen).to(dtype)
    got = _value_and_grads(lambda t: apply_rotary(t, cos, sin), x, grad=grad)
    want = _value_and_grads(lambda t: _plain_rotary(t, cos, sin), x, grad=grad)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_rotary_gradcheck_is_a_rotation_and_saves_only_the_tables():
    cos, sin = rotary_tables(5, 8, 50.0, torch.float64)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))
    y = apply_rotary(x, cos, sin)     # a rotation: norms of each (i, i + Hd/2) pair are kept
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    cos32, sin32 = rotary_tables(64, 32, 50.0, torch.float32)
    x32 = torch.randn(2, 4, 64, 32, requires_grad=True)
    _, saved = _saved_bytes(apply_rotary, x32, cos32, sin32)
    assert saved == cos32.untyped_storage().nbytes() + sin32.untyped_storage().nbytes()


def test_rotary_tables_with_gradient_take_plain_autograd():
    cos, sin = (t.requires_grad_() for t in rotary_tables(5, 8, 50.0, torch.float64))
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    apply_rotary(x, cos, sin).sum().backward()
    assert cos.grad is not None and sin.grad is not None


def test_rms_norm_returns_the_input_dtype_computing_in_float32():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen).bfloat16()
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=gen))
    x32 = x.float()
    ref = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6)
    norm.to(torch.bfloat16)            # as bf16 training holds it: torch's fused kernel
    got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, (ref * norm.weight.float()).bfloat16(), rtol=0, atol=0)
    norm.float()                       # a float32 weight on bf16 input: still bf16 out
    assert norm(x).dtype == torch.bfloat16
    norm.to(torch.bfloat16)            # a bf16 weight on a float32 residual: float32 out
    assert norm(x32).dtype == torch.float32
