"""The combine of half-precision rows (layers/dispatch.py `_CombineHalf`): no float32 tensor of
the token copies' size exists in a bf16 MoE layer's forward or backward, and its results stay
within a stated tolerance of float64 (against the float32 combine's own error).

Legend: T tokens, K slots per token, N = T*K copies, R kept rows, D model dim.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moepar.layers import MoE
from moepar.layers import dispatch
from moepar.layers.router import Routing

DIM, FFN, E, K, T = 64, 32, 4, 2, 48
BF16_EPS = 2.0 ** -8


class _Float32Rows(TorchDispatchMode):
    """Records every op output that is float32 with last dim D and more than T rows' worth of
    elements ([R, D], [N, D], [T, K, D], ...): the copies' size, not the tokens'."""

    def __init__(self, dim: int, num_tokens: int):
        super().__init__()
        self.dim, self.num_tokens, self.seen = dim, num_tokens, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 2
                    and t.shape[-1] == self.dim and t.numel() > self.num_tokens * self.dim):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _bf16_moe(**router):
    """The layer as bf16 training holds it (parallel/precision.py): bf16 experts, fp32 router."""
    torch.manual_seed(0)
    moe = MoE(DIM, FFN, E, K, **router)
    moe.experts.to(torch.bfloat16)
    return moe


@pytest.mark.parametrize("router", [{}, dict(capacity_factor=0.75)], ids=["dropless", "capacity"])
def test_bf16_moe_layer_makes_no_float32_copy_of_the_rows(router):
    moe = _bf16_moe(**router)
    x = torch.randn(2, T // 2, DIM, dtype=torch.bfloat16, requires_grad=True)
    moe(x).y.sum().backward()              # warm-up (grouped-GEMM probe)
    with _Float32Rows(DIM, T) as mode:
        out = moe(x)
        (out.y.float().square().sum() + out.aux_loss.total).backward()
    assert out.y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert mode.seen == [], mode.seen


def _routing(drop: bool, generator):
    expert_TK = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    expert_N = expert_TK.flatten()
    if drop:
        expert_N = torch.where(torch.rand(T * K, generator=generator) < 0.3, E, expert_N)
    weight_N = torch.rand(T * K, generator=generator) + 0.05
    return Routing(torch.arange(T).repeat_interleave(K), expert_N, weight_N, K, not drop)


def _reference(y_RD, weight_N, sorted_):
    """float64, by the definition: each kept row times its weight, added into its token."""
    w_R = weight_N.double().index_select(0, sorted_.kept_R)
    return torch.zeros(T, y_RD.shape[1], dtype=torch.float64).index_add(
        0, sorted_.token_R, y_RD.double() * w_R.unsqueeze(-1))


def _combine(y_RD, weight_N, sorted_, grad_TD, dtype=None):
    y = (y_RD if dtype is None else y_RD.to(dtype)).clone().requires_grad_()
    w = (weight_N if dtype is None else weight_N.to(dtype)).clone().requires_grad_()
    out = dispatch.combine_sorted(y, sorted_, w)
    out.backward(grad_TD.to(out.dtype))
    return out, y.grad, w.grad


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("drop", [False, True], ids=["dropless", "drops"])
def test_half_combine_is_within_bf16_rounding_of_float64(drop):
    """Stated tolerance (measured at T=2048, K=4, D=256: output 2.3e-3 against the float32
    combine's 1.7e-3, weight gradient 1.6e-3 against 6e-8): output and weight gradient within
    one bf16 epsilon (2^-8) in relative norm, the output within 1.6x the error of the float32
    combine rounded to bf16 (the weights enter the GEMM as bf16); the rows' gradient is the
    float32 product rounded once, as the float32 combine's."""
    gen = torch.Generator().manual_seed(1)
    routing = _routing(drop, gen)
    order_N, counts_E = dispatch.sort_by_expert(routing.expert_N, E)
    num_rows = int(counts_E.sum())
    _, sorted_ = dispatch.gather_sorted(torch.zeros(T, DIM), routing, order_N, num_rows, E)
    y_RD = torch.randn(num_rows, DIM, generator=gen).bfloat16()
    grad_TD = torch.randn(T, DIM, generator=gen).bfloat16()

    out, grad_y, grad_w = _combine(y_RD, routing.weight_N, sorted_, grad_TD)
    assert out.dtype == torch.bfloat16 and grad_y.dtype == torch.bfloat16
    assert grad_w.dtype == torch.float32
    out32, grad_y32, _ = _combine(y_RD, routing.weight_N, sorted_, grad_TD, torch.float32)

    ref = _reference(y_RD, routing.weight_N, sorted_)
    assert _rel(out, ref) < BF16_EPS
    assert _rel(out, ref) < 1.6 * _rel(out32.bfloat16(), ref)
    y64 = y_RD.double().requires_grad_()
    w64 = routing.weight_N.double().requires_grad_()
    _reference(y64, w64, sorted_).backward(grad_TD.double())
    assert torch.equal(grad_y, grad_y32.bfloat16())
    assert _rel(grad_y, y64.grad) < BF16_EPS
    assert _rel(grad_w, w64.grad) < BF16_EPS
    if drop:    # dropped copies get no gradient, and tokens without a kept copy a zero row
        dropped = routing.expert_N == E
        assert dropped.any() and (grad_w[dropped] == 0).all()


def test_half_combine_of_no_rows_is_zero():
    routing = Routing(torch.arange(T).repeat_interleave(K), torch.full((T * K,), E),
                      torch.rand(T * K), K)
    order_N, _ = dispatch.sort_by_expert(routing.expert_N, E)
    _, sorted_ = dispatch.gather_sorted(torch.zeros(T, DIM), routing, order_N, 0, E)
    out, grad_y, grad_w = _combine(torch.zeros(0, DIM, dtype=torch.bfloat16), routing.weight_N,
                                   sorted_, torch.ones(T, DIM))
    assert out.shape == (T, DIM) and not out.any() and grad_y.shape == (0, DIM)
    assert not grad_w.any()


def test_bf16_moe_layer_is_close_to_float64():
    """The whole layer in bf16 (bf16 experts and tokens, float32 router) against the same layer
    in float64 on the same (bf16-representable) values: output, input and expert-weight
    gradients within 2% in relative norm (a few bf16 roundings in a row)."""
    moe = _bf16_moe()
    moe64 = MoE(DIM, FFN, E, K).double()
    moe64.load_state_dict({k: v.double() for k, v in moe.state_dict().items()})
    x = torch.randn(2, T // 2, DIM).bfloat16()
    outs = []
    for layer, xx in ((moe, x.clone()), (moe64, x.double())):
        xx.requires_grad_()
        y = layer(xx).y
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype))
        outs.append((y, xx.grad, layer.experts.w_in_EDU.grad, layer.experts.w_out_EFD.grad))
    for got, want in zip(*outs, strict=True):
        assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("drop", [False, True], ids=["dropless", "drops"])
def test_half_gather_gradient_sums_a_tokens_copies_once(drop):
    """The gather's backward in bf16: each token's K row gradients summed in float32 and
    rounded once (the float32 sum of a few bf16 numbers is exact here), dropped copies adding
    nothing."""
    gen = torch.Generator().manual_seed(2)
    routing = _routing(drop, gen)
    order_N, counts_E = dispatch.sort_by_expert(routing.expert_N, E)
    num_rows = int(counts_E.sum())
    x = torch.randn(T, DIM, generator=gen).bfloat16().requires_grad_()
    x_RD, sorted_ = dispatch.gather_sorted(x, routing, order_N, num_rows, E)
    grad_RD = torch.randn(num_rows, DIM, generator=gen).bfloat16()
    x_RD.backward(grad_RD)
    want = torch.zeros(T, DIM).index_add(0, sorted_.token_R, grad_RD.float())
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, want.bfloat16())
