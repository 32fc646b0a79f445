"""Deferred expert weight gradients (layers/experts.py `defer_weight_grads`): the same bits as one
backward, and the input gradient leaves the experts before their weight gradients are computed."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from marks import Mark

from moepar.layers.experts import defer_weight_grads, expert_ffn

D, F = 16, 24


def _inputs(dtype, rows, activation="swiglu", seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = 2 * F if activation == "swiglu" else F
    x = torch.randn(sum(rows), D, generator=gen, dtype=dtype)
    w_in = torch.randn(len(rows), D, hidden, generator=gen, dtype=dtype) * 0.2
    w_out = torch.randn(len(rows), F, D, generator=gen, dtype=dtype) * 0.2
    g = torch.randn(sum(rows), D, generator=gen, dtype=dtype)
    offs = torch.tensor(rows).cumsum(0).to(torch.int32)
    return [t.to(device) for t in (x, w_in, w_out, g, offs)]


def _run(defer, dtype, rows, activation="swiglu", autocast=False, device="cpu"):
    x, w_in, w_out, g, offs = _inputs(dtype, rows, activation, device=device)
    leaves = [t.requires_grad_() for t in (x, w_in, w_out)]
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        later = None
        if defer:
            w_in, w_out, later = defer_weight_grads(w_in, w_out)
            assert later is not None
        y = expert_ffn(x * 1.0, rows, offs, w_in, w_out, activation, later)
    (y.float() * g).sum().backward()
    if defer:
        assert later.inner is None and later.grads is None     # nothing kept after backward
    return [y.detach()] + [t.grad for t in leaves]


def _assert_bitwise(plain, deferred):
    for name, a, b in zip(["y", "dx", "dw_in", "dw_out"], plain, deferred, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("dtype,activation,autocast",
                         [(torch.float32, "swiglu", False), (torch.float64, "swiglu", False),
                          (torch.float64, "gelu", False), (torch.float32, "swiglu", True)],
                         ids=["fp32-native", "fp64-padded", "fp64-gelu", "bf16-autocast"])
@pytest.mark.parametrize("rows", [[5, 0, 9, 2], [16, 8]], ids=["empty-group", "full"])
def test_bit_identical_to_one_backward(dtype, activation, autocast, rows):
    _assert_bitwise(_run(False, dtype, rows, activation, autocast),
                    _run(True, dtype, rows, activation, autocast))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True),
                                            (torch.float32, False)],
                         ids=["bf16-native", "bf16-autocast", "fp32-fallback"])
@pytest.mark.parametrize("rows", [[16, 0, 24, 8], [32, 16]], ids=["empty-group", "full"])
def test_bit_identical_to_one_backward_on_cuda(dtype, autocast, rows):
    """The native grouped GEMM (sm90+, bf16) with its empty-group mask, and the fallback."""
    _assert_bitwise(_run(False, dtype, rows, autocast=autocast, device="cuda"),
                    _run(True, dtype, rows, autocast=autocast, device="cuda"))


def _order(defer: bool):
    rows = [6, 3, 7]
    x, w_in, w_out, g, offs = _inputs(torch.float32, rows)
    events = []
    x.requires_grad_()
    for name, w in (("w_in", w_in), ("w_out", w_out)):
        w.requires_grad_().register_post_accumulate_grad_hook(
            lambda p, name=name: events.append(f"{name} grad"))
    later = None
    if defer:    # before the marker is recorded, as the dispatcher does before its wait
        w_in, w_out, later = defer_weight_grads(w_in, w_out)
    x_RD = Mark.apply(x, events, "input grad out")
    (expert_ffn(x_RD, rows, offs, w_in, w_out, "swiglu", later) * g).sum().backward()
    return events


def test_input_gradient_leaves_before_weight_gradients():
    assert _order(defer=True)[0] == "input grad out"
    assert sorted(_order(defer=True)[1:]) == ["w_in grad", "w_out grad"]
    # One backward computes each GEMM's gradients together: the weights' come first.
    assert _order(defer=False)[-1] == "input grad out"


def test_weight_gradients_pass_through_without_input_gradient():
    """An input that needs no gradient: the experts run undeferred, and the weights get the
    gradients that arrive."""
    rows = [4, 4]
    x, w_in, w_out, g, offs = _inputs(torch.float64, rows)
    ref = [w.clone().requires_grad_() for w in (w_in, w_out)]
    (expert_ffn(x, rows, offs, *ref, "swiglu") * g).sum().backward()
    w_in.requires_grad_(), w_out.requires_grad_()
    w_in2, w_out2, later = defer_weight_grads(w_in, w_out)
    (expert_ffn(x, rows, offs, w_in2, w_out2, "swiglu", later) * g).sum().backward()
    assert later.grads is None
    assert torch.equal(w_in.grad, ref[0].grad) and torch.equal(w_out.grad, ref[1].grad)


def test_nothing_deferred_without_grad_or_under_recompute():
    w_in, w_out = (torch.zeros(2, 3, 4, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        assert defer_weight_grads(w_in, w_out)[2] is None
    assert defer_weight_grads(w_in.detach(), w_out.detach())[2] is None
    seen = []
    checkpoint(lambda t: seen.append(defer_weight_grads(w_in, w_out)[2]) or t * t,
               torch.ones(1, requires_grad=True), use_reentrant=False).sum().backward()
    assert seen == [None, None]    # the forward and its recompute, alike


def test_frozen_weight_gets_no_gradient_and_costs_no_gemm():
    """A frozen w_in: the same other gradients as one backward, and its weight-gradient GEMM is
    not computed (backward runs 3 grouped GEMMs, as one backward does, not 4)."""
    from torch.profiler import profile
    rows = [8, 16]
    results = []
    for defer in (False, True):
        x, w_in, w_out, g, offs = _inputs(torch.float32, rows)
        x.requires_grad_(), w_out.requires_grad_()
        w_in2, w_out2, later = defer_weight_grads(w_in, w_out) if defer else (w_in, w_out, None)
        loss = (expert_ffn(x * 1.0, rows, offs, w_in2, w_out2, "swiglu", later) * g).sum()
        with profile() as prof:
            loss.backward()
        gemms = sum(e.count for e in prof.key_averages() if e.key == "aten::_grouped_mm")
        results.append((x.grad, w_out.grad, w_in.grad, gemms))
    (dx, dw_out, dw_in, gemms), (dx_d, dw_out_d, dw_in_d, gemms_d) = results
    assert torch.equal(dx, dx_d) and torch.equal(dw_out, dw_out_d)
    assert dw_in is None and dw_in_d is None
    assert gemms == gemms_d == 3


def test_second_backward_is_refused_with_a_clear_error():
    rows = [3, 5]
    x, w_in, w_out, g, offs = _inputs(torch.float64, rows)
    x.requires_grad_(), w_in.requires_grad_(), w_out.requires_grad_()
    w_in2, w_out2, later = defer_weight_grads(w_in, w_out)
    loss = (expert_ffn(x * 1.0, rows, offs, w_in2, w_out2, "swiglu", later) * g).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()
