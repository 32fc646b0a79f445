"""On a GPU: the MoE layer's forward and backward against the float64 CPU layer, and bit-for-bit
the same on a second run (no float accumulation in an order set by atomics)."""

import copy

import pytest
import torch

from moepar.layers import MoE

pytestmark = pytest.mark.cuda

DIM, FFN, E, K = 64, 32, 8, 2
ROUTERS = {"dropless": {}, "capacity": dict(capacity_factor=1.0),
           "expert_choice": dict(type="expert_choice", capacity_factor=1.5)}
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def run(moe, x, grad):
    x = x.detach().requires_grad_()
    out = moe(x)
    (out.y.float() * grad).sum().add(out.aux_loss.total).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    return out.y.detach(), x.grad, grads


def build(router, seed=0):
    torch.manual_seed(seed)
    return MoE(DIM, FFN, E, K, num_shared_experts=1, aux_loss_scale=1.0, **router).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_cuda_layer_matches_float64_cpu(router, dtype):
    reference = build(router)
    cuda = copy.deepcopy(reference).to("cuda", dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, DIM, dtype=torch.float64, generator=gen)
    grad = torch.randn(4, 32, DIM, dtype=torch.float64, generator=gen)
    y_ref, dx_ref, grads_ref = run(reference, x, grad)
    y, dx, grads = run(cuda, x.to("cuda", dtype), grad.to("cuda", torch.float32))
    if dtype == torch.float32:    # bf16 can flip near-tied routing choices; fp32 must not
        torch.testing.assert_close(y.cpu().double(), y_ref, **TOL[dtype])
        torch.testing.assert_close(dx.cpu().double(), dx_ref, **TOL[dtype])
        for name, g in grads.items():
            torch.testing.assert_close(g.cpu().double(), grads_ref[name], **TOL[dtype], msg=name)
    else:                         # bf16 rounding of weights and inputs: a relative bound
        err = (y.cpu().double() - y_ref).norm() / y_ref.norm()
        assert err < 0.05, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_cuda_layer_is_bitwise_reproducible(router, dtype):
    moe = build(router).to("cuda", dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, DIM, generator=gen).to("cuda", dtype)
    grad = torch.randn(8, 64, DIM, generator=gen).to("cuda")
    first, second = run(moe, x, grad), run(moe, x, grad)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name, g in first[2].items():
        assert torch.equal(g, second[2][name]), name
