"""On a GPU: the bf16 combine's weight gradient comes from `bmm(..., out_dtype=float32)`
(layers/dispatch.py `_bmm_float32`, CUDA only), so it is float32-accurate there, where the CPU's
is rounded to bf16 (tests/unit/test_combine.py states that tolerance)."""

import pytest
import torch

from moepar.layers import dispatch
from moepar.layers.router import Routing

pytestmark = pytest.mark.cuda

T, K, E, D = 256, 4, 8, 128


def test_half_combine_weight_gradient_is_float32_on_cuda():
    assert dispatch._bmm_out_dtype_runs("cuda")
    gen = torch.Generator().manual_seed(0)
    expert_N = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).flatten()
    routing = Routing(torch.arange(T).repeat_interleave(K).cuda(), expert_N.cuda(),
                      torch.rand(T * K, generator=gen).cuda(), K, True)
    order_N, _ = dispatch.sort_by_expert(routing.expert_N, E)
    _, sorted_ = dispatch.gather_sorted(torch.zeros(T, D, device="cuda"), routing, order_N,
                                        T * K, E)
    y_RD = torch.randn(T * K, D, generator=gen).bfloat16().cuda().requires_grad_()
    w_N = routing.weight_N.clone().requires_grad_()
    grad_TD = torch.randn(T, D, generator=gen).bfloat16().cuda()
    dispatch.combine_sorted(y_RD, sorted_, w_N).backward(grad_TD)
    # float64 by the definition: grad of w_n = y[row of n] . g[token of n]
    row_N = torch.empty_like(sorted_.kept_R)
    row_N[sorted_.kept_R] = torch.arange(T * K, device="cuda")
    want = (y_RD.detach().double()[row_N] * grad_TD.double()[routing.token_N]).sum(-1)
    torch.testing.assert_close(w_N.grad.double(), want, rtol=1e-5, atol=1e-5)
