"""On a GPU: the grouped GEMM's native path (sm90+ bf16) and its fallback against a float64 loop
on the CPU, with empty groups, bf16 and fp32, aligned and unaligned dims, forward and backward,
under `torch.cuda.set_sync_debug_mode("error")` (no host sync anywhere in either path)."""

import pytest
import torch

from moepar.layers import grouped_mm as gmm
from moepar.layers.dispatch import group_offsets

pytestmark = pytest.mark.cuda

ROWS = {"mixed": [37, 5, 0, 90], "empty_ends": [0, 64, 3, 0], "all_in_one": [0, 0, 129, 0]}
DIMS = {"aligned": (64, 48), "unaligned": (36, 20)}
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=6e-2)}


def loop_reference(x, w, rows, grad):
    x = x.detach().cpu().double().requires_grad_()
    w = w.detach().cpu().double().requires_grad_()
    y = torch.cat([xg @ w[g] for g, xg in enumerate(x.split(rows))])
    y.backward(grad.cpu().double())
    return y.detach(), x.grad, w.grad


def sm90() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
@pytest.mark.parametrize("rows", ROWS.values(), ids=ROWS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fn", ["grouped_mm", "padded"])
def test_grouped_mm_matches_loop_without_syncs(fn, dtype, rows, dims, monkeypatch):
    in_dim, out_dim = dims
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(rows), in_dim, generator=gen).to("cuda", dtype).requires_grad_()
    w = torch.randn(len(rows), in_dim, out_dim, generator=gen).to("cuda", dtype).requires_grad_()
    grad = torch.randn(sum(rows), out_dim, generator=gen).to("cuda", dtype)
    offs = group_offsets(torch.tensor(rows, device="cuda"))
    gmm.grouped_mm_backend("cuda", dtype)     # the probe syncs once: before the check
    expect_native = (fn == "grouped_mm" and dtype == torch.bfloat16 and sm90()
                     and dims == DIMS["aligned"])
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if fn == "grouped_mm":
            y = gmm.grouped_mm(x, w, rows, offs)
        else:
            y = gmm._padded_mm(x, w, rows, offs)
        y.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert bool(calls) == expect_native
    ref_y, ref_dx, ref_dw = loop_reference(x, w, rows, grad)
    torch.testing.assert_close(y.cpu().double(), ref_y, **TOL[dtype])
    torch.testing.assert_close(x.grad.cpu().double(), ref_dx, **TOL[dtype])
    torch.testing.assert_close(w.grad.cpu().double(), ref_dw, **TOL[dtype])
    for g, n in enumerate(rows):
        if n == 0:   # exact zeros, also where the native kernel leaves garbage (sm100)
            assert torch.count_nonzero(w.grad[g]) == 0, g


def test_backend_by_capability_and_dtype():
    assert gmm.grouped_mm_backend("cuda", torch.float32) == "padded"
    assert gmm.grouped_mm_backend("cuda", torch.float64) == "padded"
    assert gmm.grouped_mm_backend("cuda", torch.bfloat16) == ("native" if sm90() else "padded")
