"""Grouped GEMM over contiguous row groups: the one wrapper around the private `torch._grouped_mm`.

Legend: R rows (tokens sorted by expert), G groups (experts), I input features, O output features.

`torch._grouped_mm` is private API, so it is used here only: it runs all groups in one call (no
Python loop over experts) with its own autograd formula. Which path runs is decided once per
(device type, GPU capability, dtype) and cached, never re-decided inside the math:

| device              | dtype          | path                                                      |
|---------------------|----------------|-----------------------------------------------------------|
| CUDA sm90 and newer | bfloat16       | native `torch._grouped_mm` (the fast CUTLASS kernel)      |
| CUDA                | anything else  | fallback (float32 on GPU takes it: per-expert GEMMs)      |
| CPU                 | float32, bf16  | native (torch's CPU kernel, one GEMM per group in C++)    |
| any                 | float64        | fallback                                                  |

The fallback is a padded batched GEMM: rows are scattered into a [G, max_rows, I] buffer, one
`bmm`, gathered back; when routing is so skewed that the padding would exceed twice the rows, one
GEMM per group. It is never torch's own CUDA fallback, which reads the offsets on the host (a
sync per call). The native path also needs 16-byte aligned row strides (dims multiple of 8 in
bf16); other dims take the fallback.

Empty groups: on Blackwell (sm100) the native kernel returns non-zero weight gradients for groups
with no rows (an open PyTorch issue; correct on sm90). On CUDA the weight gradients of empty
groups are therefore zeroed by a mask built on the device from the offsets (no sync), when the
host list of rows per group has an empty one, and always when the caller left that list on the
device (a dropless layer on one rank: a pass over the weight gradient rather than a host sync).
"""

import functools
from collections.abc import Callable

import torch

__all__ = ["grouped_mm", "grouped_mm_backend", "zero_empty_group_grads", "HostRows"]

# Rows per group on the host, or a function giving them on demand (it may sync once).
HostRows = list[int] | Callable[[], list[int]]


@functools.lru_cache(maxsize=None)
def _capability(device_type: str, index: int | None):
    """(major, minor) of a CUDA device, None elsewhere; cached (grouped_mm runs every layer)."""
    if device_type != "cuda":
        return None
    return torch.cuda.get_device_capability(index)


def _backend_key(device: torch.device, dtype: torch.dtype):
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return device.type, index, _capability(device.type, index), dtype


@functools.lru_cache(maxsize=None)
def _native_runs(device_type: str, index: int | None, capability, dtype: torch.dtype) -> bool:
    """True if the fast `torch._grouped_mm` runs here, probed on a 2-group toy in the two forms
    autograd uses. On CUDA only sm90+ bfloat16 qualifies: below that, or in another dtype, torch
    runs its own per-group fallback, which syncs on the offsets.

    The probe runs under no_grad with autocast off: it is first called inside a forward (maybe
    under activation checkpointing), and must leave no trace in that graph.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda" and (capability < (9, 0) or dtype != torch.bfloat16):
        return False
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            x_RI = torch.ones(16, 16, dtype=dtype, device=device)
            w_GIO = torch.ones(2, 16, 16, dtype=dtype, device=device)
            offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
            y_RO = torch._grouped_mm(x_RI, w_GIO, offs=offs)          # forward, grad of x
            dw_GIO = torch._grouped_mm(x_RI.t(), y_RO, offs=offs)     # grad of w
            return bool((y_RO == 16).all() and (dw_GIO == 128).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_backend(device, dtype: torch.dtype) -> str:
    """'native' when the fast torch._grouped_mm runs for this device and dtype (and dims whose
    rows are 16-byte aligned), else 'padded' (the fallback)."""
    return "native" if _native_runs(*_backend_key(device, dtype)) else "padded"


def _masks_empty_groups(device: torch.device) -> bool:
    """Whether the native kernel's weight gradients of empty groups are zeroed here (CUDA)."""
    return device.type == "cuda"


class _ZeroEmptyGroupGrads(torch.autograd.Function):
    """Forward: w itself. Backward: the gradient of groups with no rows is set to zero."""

    @staticmethod
    def forward(ctx, w_GIO, offs_G):
        ctx.save_for_backward(offs_G)
        return w_GIO.view_as(w_GIO)

    @staticmethod
    def backward(ctx, grad_GIO):
        (offs_G,) = ctx.saved_tensors
        ends_G = offs_G.long()
        empty_G = ends_G.diff(prepend=ends_G.new_zeros(1)) == 0
        return grad_GIO.masked_fill(empty_G.view(-1, 1, 1), 0), None


def zero_empty_group_grads(w_GIO: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """w_GIO, whose gradient is zero for every group g with no rows (offs_G[g] == offs_G[g-1])."""
    return _ZeroEmptyGroupGrads.apply(w_GIO, offs_G)


def _offsets(rows_per_group: list[int], device) -> torch.Tensor:
    # A host-to-device copy: only for callers that do not pass the plan's device offsets.
    return torch.tensor(rows_per_group, device=device).cumsum(0).to(torch.int32)


def _padded_mm(x_RI, w_GIO, rows_per_group: list[int], offs_G: torch.Tensor | None = None):
    num_groups = len(rows_per_group)
    max_rows = max(rows_per_group) if rows_per_group else 0
    if num_groups * max_rows > 2 * x_RI.shape[0] + 1024:
        # Skewed routing would make the padded buffer up to E/k times the rows: per group instead.
        return torch.cat([x @ w_GIO[g] for g, x in enumerate(x_RI.split(rows_per_group))])
    if offs_G is None:
        offs_G = _offsets(rows_per_group, x_RI.device)
    ends_G = offs_G.long()
    counts_G = ends_G.diff(prepend=ends_G.new_zeros(1))
    group_R = torch.repeat_interleave(torch.arange(num_groups, device=x_RI.device), counts_G,
                                      output_size=x_RI.shape[0])
    starts_G = ends_G - counts_G
    slot_R = group_R * max_rows + torch.arange(x_RI.shape[0], device=x_RI.device) - starts_G[group_R]
    buf_SI = x_RI.new_zeros(num_groups * max_rows, x_RI.shape[1])
    buf_SI = buf_SI.index_copy(0, slot_R, x_RI)
    y_GMO = torch.bmm(buf_SI.view(num_groups, max_rows, -1), w_GIO)
    return y_GMO.reshape(num_groups * max_rows, -1)[slot_R]


def grouped_mm(x_RI: torch.Tensor, w_GIO: torch.Tensor, rows_per_group: "HostRows",
               offs_G: torch.Tensor | None = None) -> torch.Tensor:
    """y[rows of group g] = x[rows of group g] @ w[g]; rows are contiguous per group, in group order.

    `rows_per_group` is the host list of rows per group, or a function that gives it (a
    dispatcher's plan, `ExpertChunk.host_rows`, whose first call reads the device: one sync),
    called only where a path needs the list: the padded fallback, or no `offs_G`. `offs_G` is
    the int32 cumulative sum on the device, passed in so several GEMMs of one layer build it once;
    the native path needs nothing else, so a dropless layer on one rank never syncs.
    """
    if torch.is_autocast_enabled(x_RI.device.type):
        # autocast does not cover the private op: cast to the autocast dtype as F.linear would.
        dtype = torch.get_autocast_dtype(x_RI.device.type)
        x_RI, w_GIO = x_RI.to(dtype), w_GIO.to(dtype)
    if x_RI.shape[0] == 0:
        # No rows: keep both inputs in the graph so their gradients are real zeros, not None.
        return x_RI.new_zeros(0, w_GIO.shape[-1]) + 0.0 * w_GIO.sum() + 0.0 * x_RI.sum()
    host = rows_per_group if callable(rows_per_group) else lambda: rows_per_group
    if offs_G is None:
        offs_G = _offsets(host(), x_RI.device)
    if _native_fits(x_RI, w_GIO):
        if w_GIO.requires_grad and _masks_empty_groups(x_RI.device) and (
                callable(rows_per_group) or 0 in rows_per_group):
            # The host list, when given, says whether any group is empty (no sync); a plan that
            # left it on the device gets the mask always rather than a sync. The mask is a pass
            # over the whole weight gradient (2.1 ms for Mixtral's [8, 4096, 28672] on an H200,
            # 4.2 of the layer's 70.8 ms with both projections).
            w_GIO = zero_empty_group_grads(w_GIO, offs_G)
        y_RO = torch._grouped_mm(x_RI, w_GIO, offs=offs_G)
        if y_RO.requires_grad:
            # The kernel's backward rejects stride-0 gradients (as from y.sum()): densify them.
            y_RO.register_hook(torch.Tensor.contiguous)
        return y_RO
    return _padded_mm(x_RI, w_GIO, host(), offs_G)


def _native_fits(x_RI, w_GIO) -> bool:
    """The kernel needs 16-byte aligned row strides for every operand it sees, backward included."""
    itemsize = x_RI.element_size()
    aligned = all(n * itemsize % 16 == 0 for n in (x_RI.shape[1], w_GIO.shape[-1]))
    return aligned and _native_runs(*_backend_key(x_RI.device, x_RI.dtype))
