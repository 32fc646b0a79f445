"""The local token dispatcher, and the plan every dispatcher returns: sort token copies by
expert, run them through the experts chunk by chunk, weight and sum the results back.

Legend: T tokens, D model dim, N assignments (token copies), R rows kept (N minus drops),
E experts, K slots per token (token-choice routing).

The MoE layer (moe.py) runs four named phases, the same for every dispatcher:

    routing, losses, stats = router(x_TD)                     route
    x_RD, plan = dispatcher.dispatch(x_TD, routing)           dispatch
    y_RD = experts(x_RD, plan)                                experts (experts.py)
    y_TD = dispatcher.combine(y_RD, plan, weight_N)           combine

This is the seam between single-device maths and communication: an expert-parallel dispatcher
(in `moepar.parallel`) has the same two methods. `dispatch` returns a frozen plan that `combine`
consumes, so nothing lives on `self` between the two (safe under recompute and pipelining), and
`combine` takes the combine weights then, not at dispatch (the aux-loss injection rides on them,
computed while the rows travel). `plan.chunks` are blocks of local experts whose rows travel
together; `x_RD` and `y_RD` hold one tensor per chunk. A chunk's `arrive(rows)` gives its rows in
expert order, ready for the grouped GEMM, and `depart(y)` sends the results on: here both are the
identity (one chunk, rows already here); an all-to-all chunk waits for its rows and starts their
way back (parallel/alltoall.py). Overlap is that chunking: chunk i's experts run while chunk i+1's
rows arrive; the synchronous path is the same code with one chunk.

Host syncs: at most one per layer, `counts_to_host` (the all-to-all needs split sizes on the
host, and so does the count of kept rows when capacity drops copies); everything else (counts,
offsets, permutations) is built on the device, and backward never syncs. Routing that drops
nothing (dropless top-k, expert choice) on one rank makes none: all N copies are kept, and the
native grouped GEMM reads the device offsets; the host list of rows per expert is then read
only if a GEMM path needs it (the padded float64 fallback), once (`ExpertChunk.host_rows`).

Token-choice routing (every token has K slots, n = t*K + k) moves rows by gathers only, forward
and backward: the sort is a permutation of the N slots, so its inverse is a gather too, and the
K copies of a token meet in a K-way sum. Routings without that structure (expert choice) and the
dedup dispatcher sum rows into tokens with `sum_rows` / `gather_rows`: a stable sort builds a
[T, M] table of each token's rows (M a static bound on the copies per token), and the rows are
summed slot by slot in that fixed order. No float `index_add` (atomics on GPUs, whose order
changes from run to run), so results are bit-reproducible on CUDA too.
"""

import functools
from dataclasses import dataclass

import torch

from .router import Routing

__all__ = ["ExpertChunk", "Sorted", "LocalPlan", "LocalDispatcher", "sort_by_expert",
           "gather_sorted", "combine_sorted", "permute_rows", "inverse_permutation",
           "counts_to_host", "group_offsets", "segment_slots", "sum_rows", "gather_rows"]


@dataclass(frozen=True)
class ExpertChunk:
    """A block of this rank's experts whose rows travel together (the unit of overlap)."""
    first_expert: int             # local experts [first_expert, first_expert + num_experts)
    known_rows: list[int] | None  # host copy of the rows per expert, or None: not read (yet)
    offs_E: torch.Tensor          # their int32 cumulative sum on the device (grouped GEMM offsets)

    # Whether the experts' weight gradients are worth computing after the input gradient has
    # been sent back (experts.py `defer_weight_grads`): only when arrive's backward communicates.
    defers_weight_grads = False

    @property
    def num_experts(self) -> int:
        return self.offs_E.numel()

    @property
    def rows_per_expert(self) -> list[int]:
        return self.host_rows()

    def host_rows(self) -> list[int]:
        """The rows per expert on the host. A dropless plan on one rank leaves them on the
        device (the native grouped GEMM reads `offs_E`): the first call here then reads them,
        one sync, kept for the layer's later GEMMs and its backward (the padded fallback)."""
        if self.known_rows is None:
            ends = counts_to_host(self.offs_E)
            # (a cache on a frozen plan: the value is fixed by offs_E, whoever asks first)
            object.__setattr__(self, "known_rows", [b - a for a, b in zip([0] + ends[:-1], ends)])
        return self.known_rows

    def arrive(self, rows):
        """The chunk's rows in expert order, ready for the GEMMs (here: as they are)."""
        return rows

    def depart(self, y):
        """Sends the chunk's expert outputs on toward combine (here: as they are)."""
        return y


@dataclass(frozen=True)
class Sorted:
    """How one rank's token copies were put in expert order, and how to sum them back."""
    kept_R: torch.Tensor          # assignment (slot) index of each row, rows in expert-major order
    token_R: torch.Tensor         # source token of each row
    num_tokens: int
    top_k: int | None             # set: slot layout (gather combine); None: scatter combine
    slot_to_row_N: torch.Tensor | None  # inverse of the sort; dropped slots point at row R (zero)
    rows_of_token_TM: torch.Tensor | None  # scatter layout: each token's rows (segment_slots)


@dataclass(frozen=True)
class LocalPlan:
    """The local dispatcher's plan: the sort, and one chunk holding every expert."""
    sorted: Sorted
    chunks: tuple[ExpertChunk, ...]

    @property
    def rows_per_expert(self) -> list[int]:
        return [n for chunk in self.chunks for n in chunk.rows_per_expert]


def counts_to_host(counts: torch.Tensor) -> list[int]:
    """The one device-to-host sync of a MoE layer: split sizes the host needs (grouped GEMM
    groups, all-to-all splits). On CUDA the copy lands in pinned memory and waits on an event
    for that copy alone, not on a pageable `.tolist()` copy."""
    if counts.device.type != "cuda":
        return counts.tolist()
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(counts.device))
    copied.synchronize()
    return host.tolist()


def group_offsets(counts_G: torch.Tensor) -> torch.Tensor:
    """int32 cumulative row counts on the device: the `offs` of torch._grouped_mm."""
    return torch.cumsum(counts_G, 0, dtype=torch.int32)


def sort_by_expert(expert_N: torch.Tensor, num_experts: int):
    """Stable sort of assignments by expert; returns (order_N, counts_E) on the device, no sync.

    Dropped assignments carry expert id E and sort last (and are not counted); a stable sort keeps
    token order within each expert, so every layout sees the same rows in the same order. The
    counts come from a binary search of the sorted ids (no `bincount`, which syncs on CUDA).
    """
    expert_sorted_N, order_N = torch.sort(expert_N, stable=True)
    bounds = torch.searchsorted(expert_sorted_N, torch.arange(
        num_experts + 1, device=expert_N.device, dtype=expert_sorted_N.dtype))
    return order_N, bounds.diff()


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x, index, inverse):
    """x[index] for a permutation `index` whose inverse is `inverse`: a gather both ways."""
    return _PermuteRows.apply(x, index, inverse)


def inverse_permutation(index):
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return inverse


class _GatherTokens(torch.autograd.Function):
    """x_RD = x_TD[kept_R // K]. Backward: each token sums the gradients of its K rows (gathers
    by slot; dropped slots read a zero row): no scatter."""

    @staticmethod
    def forward(ctx, x_TD, token_R, slot_to_row_N, top_k: int):
        ctx.save_for_backward(slot_to_row_N)
        ctx.num_tokens = x_TD.shape[0]
        return x_TD.index_select(0, token_R)

    @staticmethod
    def backward(ctx, grad_RD):
        (slot_to_row_N,) = ctx.saved_tensors
        if grad_RD.dtype in _HALF:
            # Half precision: the K copies gathered into [T, K, D] and summed by one reduction,
            # which accumulates in float32 and rounds once (K-1 bf16 adds would round K-1
            # times); float32 and float64 keep the slot-by-slot sum, unchanged.
            if slot_to_row_N.numel() > grad_RD.shape[0]:
                grad_RD = torch.cat([grad_RD, grad_RD.new_zeros(1, grad_RD.shape[-1])])
            grad_TKD = grad_RD.index_select(0, slot_to_row_N).view(ctx.num_tokens, -1,
                                                                   grad_RD.shape[-1])
            return grad_TKD.sum(1), None, None, None
        return _segment_sum(grad_RD, slot_to_row_N.view(ctx.num_tokens, -1)), None, None, None


class _CombineSlots(torch.autograd.Function):
    """y_TD = sum_k w_TK * y_RD[slot_TK] (dropped slots zero), one gather and one fused
    multiply-add per slot. Backward: grad of row r = w_r * g[token_r] (a gather, scaled in
    place); grad of w_r = y_r . g[token_r] (a row-wise dot on the same gather). No scatter."""

    @staticmethod
    def forward(ctx, y_RD, weight_N, slot_to_row_N, kept_R, token_R, num_tokens: int):
        dtype = torch.promote_types(y_RD.dtype, weight_N.dtype)
        w_TK = weight_N.to(dtype).view(num_tokens, -1)
        ctx.save_for_backward(y_RD, weight_N.to(dtype).index_select(0, kept_R), slot_to_row_N,
                              token_R)
        ctx.dtype = dtype
        return _segment_sum(y_RD, slot_to_row_N.view(num_tokens, -1), w_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_RD, w_R, slot_to_row_N, token_R = ctx.saved_tensors
        g_RD = grad_TD.to(ctx.dtype).index_select(0, token_R)
        grad_y = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w_R = torch.linalg.vecdot(y_RD.to(ctx.dtype), g_RD)
            grad_w = _slot_values(grad_w_R, slot_to_row_N)
        if ctx.needs_input_grad[0]:
            grad_y = g_RD.mul_(w_R.unsqueeze(-1)).to(y_RD.dtype)
        return grad_y, grad_w, None, None, None, None


@functools.lru_cache(maxsize=None)
def _bmm_out_dtype_runs(device_type: str) -> bool:
    """Whether `torch.bmm(..., out_dtype=float32)` of bf16 runs here (CUDA: yes; CPU: no),
    probed once on a toy under no_grad (it is first called inside a backward)."""
    try:
        with torch.no_grad():
            a = torch.ones(1, 1, 8, dtype=torch.bfloat16, device=device_type)
            return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _bmm_float32(a, b):
    """a @ b of half-precision batches, accumulated in float32: returned in float32 where the
    device can, else in a's dtype."""
    if _bmm_out_dtype_runs(a.device.type):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b)


class _CombineHalf(torch.autograd.Function):
    """_CombineSlots for half-precision rows (bf16/fp16 training), without a float32 copy of any
    [R, D] tensor: the slots are gathered into [T, K, D] (rows' dtype) and each token's K copies
    are summed by one batched GEMM, y_T1D = w_T1K @ y_TKD, which accumulates in float32 inside.
    The weights enter the GEMM in the rows' dtype (bf16 w: 8 bits of mantissa; the error this
    adds is measured in tests/unit/test_combine.py against float64). Dropped slots read row 0
    with weight 0 (no zero row appended, which would copy y; a non-finite row 0 would leak into
    them, as it has already broken the step). Backward: grad of row r =
    w_r * g[token_r], one in-place multiply of the gathered bf16 rows by the float32 weights
    (computed in float32, rounded once); grad of w = y_TKD @ g_TD1, one batched GEMM on the
    saved slots (float32 accumulation; its float32 result where the device's bmm returns one,
    as CUDA's does, else rounded to the rows' dtype, as on the CPU)."""

    @staticmethod
    def forward(ctx, y_RD, weight_N, slot_to_row_N, kept_R, token_R, num_tokens: int):
        num_rows, dim = y_RD.shape
        dropped_N = None
        if slot_to_row_N.numel() > num_rows:    # drops (shapes say so: no sync)
            dropped_N = slot_to_row_N == num_rows
            slot_to_row_N = slot_to_row_N.clamp(max=max(num_rows - 1, 0))
            weight_N = weight_N.masked_fill(dropped_N, 0)
        if num_rows == 0:
            y_RD = y_RD.new_zeros(1, dim)
        y_TKD = y_RD.index_select(0, slot_to_row_N).view(num_tokens, -1, dim)
        ctx.save_for_backward(y_TKD, weight_N, dropped_N, kept_R, token_R)
        return torch.bmm(weight_N.to(y_RD.dtype).view(num_tokens, 1, -1), y_TKD).view(-1, dim)

    @staticmethod
    def backward(ctx, grad_TD):
        y_TKD, weight_N, dropped_N, kept_R, token_R = ctx.saved_tensors
        grad_TD = grad_TD.to(y_TKD.dtype)
        grad_y = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _bmm_float32(y_TKD, grad_TD.unsqueeze(-1)).view(-1).to(weight_N.dtype)
            if dropped_N is not None:
                grad_w = grad_w.masked_fill(dropped_N, 0)
        if ctx.needs_input_grad[0]:
            g_RD = grad_TD.index_select(0, token_R)
            grad_y = g_RD.mul_(weight_N.index_select(0, kept_R).unsqueeze(-1))
        return grad_y, grad_w, None, None, None, None


def _slot_values(value_R, slot_to_row_N):
    """Per-row values put back in slot order; dropped slots (row R) get zero."""
    if slot_to_row_N.numel() > value_R.numel():
        value_R = torch.cat([value_R, value_R.new_zeros(1)])
    return value_R.index_select(0, slot_to_row_N)


def _segment_sum(src_SD, slots_DM, weight_DM=None):
    """y[d] = sum over j of (weight[d, j] *) src[slots[d, j]], where slot S reads a zero row:
    one gather and one add per column j, in column order (deterministic, no scatter). The
    result has the promoted dtype of src and weight, and is a fresh tensor (safe in place)."""
    if slots_DM.numel() > src_SD.shape[0]:
        # Some slots are empty (drops, or tokens with fewer copies than the bound).
        src_SD = torch.cat([src_SD, src_SD.new_zeros(1, src_SD.shape[-1])])
    y_DD = src_SD.index_select(0, slots_DM[:, 0])
    if weight_DM is not None:   # in place when no promotion (the gather is a fresh tensor)
        w_D1 = weight_DM[:, :1]
        y_DD = y_DD.mul_(w_D1) if y_DD.dtype == w_D1.dtype else y_DD * w_D1
    for j in range(1, slots_DM.shape[1]):
        part_DD = src_SD.index_select(0, slots_DM[:, j])
        if weight_DM is None:
            y_DD += part_DD
        else:
            y_DD.addcmul_(part_DD, weight_DM[:, j:j + 1])
    return y_DD


def segment_slots(index_S: torch.Tensor, num_dest: int, max_per_dest: int) -> torch.Tensor:
    """[num_dest, M] table: row d lists, in source order, the sources s with index_S[s] == d,
    then S (a zero row). `max_per_dest` (M) must bound the sources per destination (a larger
    count raises an index error). A stable sort and a binary search: no host sync, no atomics."""
    num_src, device = index_S.numel(), index_S.device
    sorted_S, order_S = torch.sort(index_S, stable=True)
    start_D = torch.searchsorted(sorted_S, torch.arange(num_dest, device=device,
                                                        dtype=sorted_S.dtype))
    rank_S = torch.arange(num_src, device=device) - start_D[sorted_S]
    slots_DM = torch.full((num_dest, max(max_per_dest, 1)), num_src, dtype=torch.long,
                          device=device)
    return slots_DM.index_put_((sorted_S, rank_S), order_S)


class _SumRows(torch.autograd.Function):
    """forward: the segment sum (index_add's values); backward: a gather."""

    @staticmethod
    def forward(ctx, src_SD, index_S, slots_DM):
        ctx.save_for_backward(index_S)
        return _segment_sum(src_SD, slots_DM)

    @staticmethod
    def backward(ctx, grad_DD):
        (index_S,) = ctx.saved_tensors
        return grad_DD.index_select(0, index_S), None, None


class _GatherRows(torch.autograd.Function):
    """forward: a gather; backward: the segment sum (where autograd would index_add)."""

    @staticmethod
    def forward(ctx, x_DD, index_S, slots_DM):
        ctx.save_for_backward(slots_DM)
        return x_DD.index_select(0, index_S)

    @staticmethod
    def backward(ctx, grad_SD):
        (slots_DM,) = ctx.saved_tensors
        return _segment_sum(grad_SD, slots_DM), None, None


def sum_rows(src_SD, index_S, slots_DM):
    """zeros(num_dest, D).index_add(0, index_S, src_SD), deterministically on every device;
    `slots_DM = segment_slots(index_S, num_dest, M)`."""
    return _SumRows.apply(src_SD, index_S, slots_DM)


def gather_rows(x_DD, index_S, slots_DM):
    """x_DD[index_S], whose gradient is summed by `slots_DM` (see sum_rows), not by index_add."""
    return _GatherRows.apply(x_DD, index_S, slots_DM)


def gather_sorted(x_TD, routing: Routing, order_N, num_rows: int, num_experts: int):
    """(x_RD, Sorted): the rows of x for the first `num_rows` (kept) assignments of `order_N`,
    and how to combine them back. `num_rows` is a host number (the sum of the host counts);
    `num_experts` the experts the copies were sorted over (it bounds a token's copies)."""
    if torch.is_autocast_enabled(x_TD.device.type):
        # (train.fp32_residual) the experts compute in the autocast dtype: cast the T tokens
        # once, not the R >= T rows after the gather (the same values, fewer bytes).
        x_TD = x_TD.to(torch.get_autocast_dtype(x_TD.device.type))
    kept_R = order_N[:num_rows]
    token_R = routing.token_N[kept_R]
    slot_to_row_N = rows_of_token_TM = None
    if routing.top_k is not None:
        slot_to_row_N = torch.empty_like(order_N)
        slot_to_row_N[order_N] = torch.arange(order_N.numel(), device=order_N.device).clamp_(
            max=num_rows)
        x_RD = _GatherTokens.apply(x_TD, token_R, slot_to_row_N, routing.top_k)
    else:
        # A token meets each expert at most once: as many rows as experts bound its copies.
        rows_of_token_TM = segment_slots(token_R, x_TD.shape[0], num_experts)
        x_RD = gather_rows(x_TD, token_R, rows_of_token_TM)
    return x_RD, Sorted(kept_R, token_R, x_TD.shape[0], routing.top_k, slot_to_row_N,
                        rows_of_token_TM)


class LocalDispatcher:
    """Dispatch for experts that all live on this device: one chunk, no communication."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """((x_RD,), plan): rows grouped by expert, dropped copies (expert == E) cut off.
        Dropless routing keeps all N copies, so nothing is read from the device: the plan's
        offsets stay there (0 host syncs); with drops the kept rows are counted on the host."""
        order_N, counts_E = sort_by_expert(routing.expert_N, self.num_experts)
        rows_per_expert = None if routing.dropless else counts_to_host(counts_E)
        num_rows = routing.expert_N.numel() if routing.dropless else sum(rows_per_expert)
        x_RD, sorted_ = gather_sorted(x_TD, routing, order_N, num_rows, self.num_experts)
        chunk = ExpertChunk(0, rows_per_expert, group_offsets(counts_E))
        return (x_RD,), LocalPlan(sorted_, (chunk,))

    def combine(self, y_RD, plan: LocalPlan, weight_N: torch.Tensor) -> torch.Tensor:
        (y,) = y_RD
        return combine_sorted(y, plan.sorted, weight_N)


_HALF = (torch.bfloat16, torch.float16)


def combine_sorted(y_RD: torch.Tensor, sorted_: Sorted, weight_N: torch.Tensor) -> torch.Tensor:
    """y_TD = sum over each token's kept copies of weight * expert output (zero if all dropped)."""
    if sorted_.top_k is not None:
        # Half-precision rows: the one-GEMM combine (no float32 [R, D]); float32 and float64
        # keep the exact slot-by-slot sum, unchanged.
        combine = _CombineHalf if y_RD.dtype in _HALF else _CombineSlots
        return combine.apply(y_RD, weight_N, sorted_.slot_to_row_N, sorted_.kept_R,
                             sorted_.token_R, sorted_.num_tokens)
    dtype = torch.promote_types(y_RD.dtype, weight_N.dtype)
    weighted_RD = y_RD.to(dtype) * weight_N.index_select(0, sorted_.kept_R).to(dtype).unsqueeze(-1)
    return sum_rows(weighted_RD, sorted_.token_R, sorted_.rows_of_token_TM)
