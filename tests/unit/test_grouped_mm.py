"""grouped_mm against a per-group loop of x_g @ w[g], forward and backward, on both backends.

Legend: R rows, G groups, I input features, O output features.

The reference is always float64 on the same (possibly rounded) values, so each backend is judged
against exact maths, not against the other backend. Dims are multiples of 16 bytes for every
dtype used (I=16, O=8), so the native kernel runs; unaligned dims have their own test.
"""

import pytest
import torch

from moepar.layers.grouped_mm import _padded_mm, grouped_mm, grouped_mm_backend

I_DIM, O_DIM = 16, 8

# Group sizes: mixed, empty groups inside and at both ends, all rows in one group, one group.
ROWS = {
    "mixed": [2, 3, 1, 4],
    "empty_inside_and_last": [3, 0, 7, 0],
    "all_in_last": [0, 0, 10],
    "all_in_first": [10, 0, 0],
    "one_group": [5],
}
TOLERANCE = {torch.float64: dict(rtol=1e-12, atol=1e-12),
             torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}

native_available = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                      reason="this torch has no torch._grouped_mm")


def loop_reference(x_RI, w_GIO, rows_per_group, grad_RO):
    """Per-group x_g @ w[g] in float64, with its gradients; returns (y, dx, dw)."""
    x_RI = x_RI.detach().double().requires_grad_()
    w_GIO = w_GIO.detach().double().requires_grad_()
    parts, start = [], 0
    for g, n in enumerate(rows_per_group):
        parts.append(x_RI[start:start + n] @ w_GIO[g])
        start += n
    y_RO = torch.cat(parts)
    y_RO.backward(grad_RO.double())
    return y_RO.detach(), x_RI.grad, w_GIO.grad


def make_inputs(rows_per_group, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(rows_per_group)
    x_RI = torch.randn(num_rows, I_DIM, generator=gen, dtype=torch.float64).to(dtype)
    w_GIO = torch.randn(len(rows_per_group), I_DIM, O_DIM, generator=gen,
                        dtype=torch.float64).to(dtype)
    # A dense random upstream gradient; the expanded one y.sum() gives has its own test.
    grad_RO = torch.randn(num_rows, O_DIM, generator=gen, dtype=torch.float64).to(dtype)
    return x_RI.requires_grad_(), w_GIO.requires_grad_(), grad_RO


def check_against_loop(fn, rows_per_group, dtype):
    x_RI, w_GIO, grad_RO = make_inputs(rows_per_group, dtype)
    y_RO = fn(x_RI, w_GIO, rows_per_group)
    y_RO.backward(grad_RO)
    ref_y, ref_dx, ref_dw = loop_reference(x_RI, w_GIO, rows_per_group, grad_RO)
    tol = TOLERANCE[dtype]
    assert y_RO.dtype == dtype and y_RO.shape == (sum(rows_per_group), O_DIM)
    assert x_RI.grad.dtype == dtype and w_GIO.grad.dtype == dtype
    torch.testing.assert_close(y_RO.double(), ref_y, **tol)
    torch.testing.assert_close(x_RI.grad.double(), ref_dx, **tol)
    torch.testing.assert_close(w_GIO.grad.double(), ref_dw, **tol)
    # An empty group's weight gets an exact zero gradient.
    for g, n in enumerate(rows_per_group):
        if n == 0:
            assert torch.count_nonzero(w_GIO.grad[g]) == 0


@native_available
def test_backend_reports_native_for_float32_and_padded_for_float64():
    assert grouped_mm_backend("cpu", torch.float32) == "native"
    assert grouped_mm_backend("cpu", torch.float64) == "padded"


@pytest.fixture
def native_calls(monkeypatch):
    """Counts calls of torch._grouped_mm, to know which backend a case exercised."""
    calls = []
    if hasattr(torch, "_grouped_mm"):
        real = torch._grouped_mm

        def counting(*args, **kwargs):
            calls.append(args[0].dtype)
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls


@native_available
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows_per_group", ROWS.values(), ids=ROWS.keys())
def test_native_matches_loop(rows_per_group, dtype, native_calls):
    check_against_loop(grouped_mm, rows_per_group, dtype)
    assert native_calls, "the native torch._grouped_mm path was not taken"


@pytest.mark.parametrize("rows_per_group", ROWS.values(), ids=ROWS.keys())
def test_float64_uses_padded_and_matches_loop(rows_per_group, native_calls):
    check_against_loop(grouped_mm, rows_per_group, torch.float64)
    assert not native_calls, "float64 must not reach torch._grouped_mm on CPU"


@pytest.mark.parametrize("rows_per_group", ROWS.values(), ids=ROWS.keys())
def test_padded_mm_float32_matches_loop(rows_per_group):
    check_against_loop(_padded_mm, rows_per_group, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_explicit_offsets_match_implicit(dtype):
    rows = [3, 0, 7, 0]
    x_RI, w_GIO, _ = make_inputs(rows, dtype)
    offs_G = torch.tensor([3, 3, 10, 10], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(x_RI, w_GIO, rows, offs_G), grouped_mm(x_RI, w_GIO, rows),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_zero_rows_gives_empty_output_and_zero_weight_grad(dtype):
    x_RI = torch.randn(0, I_DIM, dtype=dtype, requires_grad=True)
    w_GIO = torch.randn(3, I_DIM, O_DIM, dtype=dtype, requires_grad=True)
    y_RO = grouped_mm(x_RI, w_GIO, [0, 0, 0])
    assert y_RO.shape == (0, O_DIM) and y_RO.dtype == dtype
    (y_RO.sum() + 0.0).backward()
    assert w_GIO.grad is not None, "the weight must get a zero gradient, not None"
    assert torch.equal(w_GIO.grad, torch.zeros_like(w_GIO))


@native_available
def test_autocast_bfloat16_returns_bfloat16():
    x_RI, w_GIO, grad_RO = make_inputs([4, 0, 6], torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_RO = grouped_mm(x_RI, w_GIO, [4, 0, 6])
    assert y_RO.dtype == torch.bfloat16
    y_RO.backward(grad_RO.to(torch.bfloat16))
    # The float32 leaves get float32 gradients through the autocast cast.
    assert x_RI.grad.dtype == torch.float32 and w_GIO.grad.dtype == torch.float32
    # Reference on the bf16-rounded operands: the only error left is the bf16 output rounding.
    ref_y, _, _ = loop_reference(x_RI.to(torch.bfloat16), w_GIO.to(torch.bfloat16), [4, 0, 6],
                                 grad_RO)
    torch.testing.assert_close(y_RO.double(), ref_y, **TOLERANCE[torch.bfloat16])


def test_autocast_zero_rows_returns_bfloat16():
    # Regression: the zero-row early return once ran before the autocast cast (float32 out).
    w_GIO = torch.randn(2, I_DIM, O_DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_RO = grouped_mm(torch.randn(0, I_DIM), w_GIO, [0, 0])
    assert y_RO.dtype == torch.bfloat16 and y_RO.shape == (0, O_DIM)
    (y_RO.sum() + 0.0).backward()
    assert torch.equal(w_GIO.grad, torch.zeros_like(w_GIO))


@pytest.mark.parametrize("in_out", [(5, 3), (6, 10), (16, 3)], ids=["5x3", "6x10", "16x3"])
def test_unaligned_dims_match_loop(in_out, native_calls):
    # Regression: float32 rows that are not 16-byte aligned once reached torch._grouped_mm, which
    # raised 'strides should be multiple of 16 bytes'; they must fall back to the padded GEMM.
    in_dim, out_dim = in_out
    gen = torch.Generator().manual_seed(0)
    rows = [2, 0, 3, 1]
    x_RI = torch.randn(6, in_dim, generator=gen, requires_grad=True)
    w_GIO = torch.randn(4, in_dim, out_dim, generator=gen, requires_grad=True)
    grad_RO = torch.randn(6, out_dim, generator=gen)
    y_RO = grouped_mm(x_RI, w_GIO, rows)
    y_RO.backward(grad_RO)
    ref_y, ref_dx, ref_dw = loop_reference(x_RI, w_GIO, rows, grad_RO)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(y_RO.double(), ref_y, **tol)
    torch.testing.assert_close(x_RI.grad.double(), ref_dx, **tol)
    torch.testing.assert_close(w_GIO.grad.double(), ref_dw, **tol)
    assert not native_calls


@native_available
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_backward_of_sum(dtype, native_calls):
    # Regression: y.sum() hands backward an expanded (stride-0) gradient, which the native kernel's
    # backward rejects unless grouped_mm makes it dense.
    x_RI, w_GIO, _ = make_inputs([3, 0, 7], dtype)
    grouped_mm(x_RI, w_GIO, [3, 0, 7]).sum().backward()
    assert native_calls
    _, ref_dx, ref_dw = loop_reference(x_RI, w_GIO, [3, 0, 7], torch.ones(10, O_DIM))
    torch.testing.assert_close(x_RI.grad.double(), ref_dx, **TOLERANCE[dtype])
    torch.testing.assert_close(w_GIO.grad.double(), ref_dw, **TOLERANCE[dtype])


def test_padded_fallback_with_skewed_groups_matches_loop():
    """One group holding almost every row takes the per-group path; same result and grads."""
    torch.manual_seed(3)
    rows = [61, 0, 1, 1, 0, 1, 0, 0]
    x = torch.randn(sum(rows), 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 6, 5, dtype=torch.float64, requires_grad=True)
    y = grouped_mm(x, w, rows)
    ref = torch.cat([xi @ w[g] for g, xi in enumerate(x.split(rows))])
    torch.testing.assert_close(y, ref)
    gx, gw = torch.autograd.grad(y.square().sum(), (x, w))
    rx, rw = torch.autograd.grad(ref.square().sum(), (x, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


# ---- empty groups and the backend choice (issue: CUDA and NCCL) ------------------------------

def test_zero_empty_group_grads_masks_only_empty_groups():
    from moepar.layers.grouped_mm import zero_empty_group_grads
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, 2, generator=gen, requires_grad=True)
    offs = torch.tensor([0, 4, 4, 9, 9], dtype=torch.int32)        # groups 0, 2 and 4 are empty
    upstream = torch.randn(5, 3, 2, generator=gen)
    upstream[2] = float("nan")                                      # garbage in an empty group
    masked = zero_empty_group_grads(w, offs)
    assert torch.equal(masked, w)
    masked.backward(upstream)
    for g, empty in enumerate([True, False, True, False, True]):
        want = torch.zeros(3, 2) if empty else upstream[g]
        assert torch.equal(w.grad[g], want), g


class _BlackwellLikeGroupedMm(torch.autograd.Function):
    """torch._grouped_mm's values, but 7.0 in the weight gradient of every empty group, as the
    sm100 kernel is reported to return (a CPU stand-in for that bug)."""

    @staticmethod
    def forward(ctx, x_RI, w_GIO, offs_G):
        ctx.save_for_backward(x_RI, w_GIO, offs_G)
        return torch._grouped_mm_real(x_RI, w_GIO, offs=offs_G)

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, w_GIO, offs_G = ctx.saved_tensors
        grad_x = torch._grouped_mm_real(grad_RO.contiguous(), w_GIO.transpose(-2, -1), offs=offs_G)
        grad_w = torch._grouped_mm_real(x_RI.t(), grad_RO.contiguous(), offs=offs_G)
        ends = offs_G.long()
        empty = ends.diff(prepend=ends.new_zeros(1)) == 0
        return grad_x, grad_w.masked_fill(empty.view(-1, 1, 1), 7.0), None


@native_available
@pytest.mark.parametrize("masking", [True, False], ids=["masked", "unmasked"])
def test_empty_group_weight_grads_are_zeroed_where_the_kernel_leaves_garbage(monkeypatch, masking):
    import moepar.layers.grouped_mm as gmm
    monkeypatch.setattr(torch, "_grouped_mm_real", torch._grouped_mm, raising=False)
    monkeypatch.setattr(torch, "_grouped_mm", lambda x, w, offs: _BlackwellLikeGroupedMm.apply(
        x, w, offs), raising=True)
    monkeypatch.setattr(gmm, "_masks_empty_groups", lambda device: masking)
    rows = [3, 0, 7, 0]
    x_RI, w_GIO, grad_RO = make_inputs(rows, torch.float32)
    grouped_mm(x_RI, w_GIO, rows).backward(grad_RO)
    _, ref_dx, ref_dw = loop_reference(x_RI, w_GIO, rows, grad_RO)
    torch.testing.assert_close(x_RI.grad.double(), ref_dx, **TOLERANCE[torch.float32])
    nonempty = [0, 2]
    torch.testing.assert_close(w_GIO.grad[nonempty].double(), ref_dw[nonempty],
                               **TOLERANCE[torch.float32])
    empty_grads = w_GIO.grad[[1, 3]]
    if masking:
        assert torch.count_nonzero(empty_grads) == 0
    else:   # the stand-in really leaves garbage: without the mask this test would fail
        assert torch.equal(empty_grads, torch.full_like(empty_grads, 7.0))


@pytest.mark.parametrize("capability,dtype", [((8, 0), torch.bfloat16), ((9, 0), torch.float32),
                                              ((10, 0), torch.float16), ((9, 0), torch.float64)])
def test_cuda_native_path_needs_sm90_and_bfloat16(capability, dtype, monkeypatch):
    """Below sm90, or in any dtype but bf16, CUDA takes the fallback without even probing
    (torch's own CUDA fallback would read the offsets on the host)."""
    from moepar.layers.grouped_mm import _native_runs
    probed = []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: probed.append(1), raising=False)
    assert _native_runs("cuda", 0, capability, dtype) is False
    assert probed == []
    _native_runs.cache_clear()


@native_available
def test_no_mask_pass_when_no_group_is_empty(monkeypatch):
    """The mask costs a pass over the whole weight gradient: it is applied only when the host
    list of rows has an empty group, and the gradients are right either way."""
    import moepar.layers.grouped_mm as gmm
    monkeypatch.setattr(gmm, "_masks_empty_groups", lambda device: True)
    calls = []
    real = gmm.zero_empty_group_grads
    monkeypatch.setattr(gmm, "zero_empty_group_grads",
                        lambda w, offs: calls.append(1) or real(w, offs))
    for rows, masked in (([3, 2, 7, 1], False), ([3, 0, 7, 1], True)):
        calls.clear()
        x_RI, w_GIO, grad_RO = make_inputs(rows, torch.float32)
        grouped_mm(x_RI, w_GIO, rows).backward(grad_RO)
        _, ref_dx, ref_dw = loop_reference(x_RI, w_GIO, rows, grad_RO)
        torch.testing.assert_close(w_GIO.grad.double(), ref_dw, **TOLERANCE[torch.float32])
        assert calls == ([1] if masked else []), rows
