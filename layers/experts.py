"""Feed-forward networks: stacked routed experts (one grouped GEMM), the dense FFN, shared experts.

Legend: R rows (token copies sorted by expert), E experts on this module, D model dim,
F hidden dim per expert, U the in-projection's width (2F for SwiGLU: gate then up; F otherwise),
T tokens.

SwiGLU keeps the gate and up projections fused in one weight (`w_in`, last dim 2F: gate first,
then up) so each expert costs two GEMMs, not three.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .grouped_mm import HostRows, grouped_mm

__all__ = ["ACTIVATIONS", "GroupedExperts", "FeedForward", "SharedExperts", "expert_ffn",
           "activate", "defer_weight_grads"]

ACTIVATIONS = ("swiglu", "gelu")


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up for h = [gate | up], saving h alone (no silu output): backward recomputes
    the sigmoid inside silu_backward (the ATen op autograd itself uses for silu) and silu(gate)
    for the up half, and joins the halves' gradients in one cat, which torch.compile fuses with
    the elementwise ops before it (no out= into views of a buffer: compile rejects those). The
    results are bit-identical to autograd of the plain formula, forward and backward."""

    @staticmethod
    def forward(ctx, h):
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(h)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate)
        return torch.cat([grad_gate, grad_out * F.silu(gate)], dim=-1)


def activate(h, activation):
    """The activation named `activation`, or `activation(h)` when it is a callable (the
    compiled one parallel/compile.py gives `GroupedExperts.activate`)."""
    if callable(activation):
        return activation(h)
    if activation != "swiglu":
        return F.gelu(h)
    if torch.compiler.is_compiling():
        # Inside a torch.compile region (parallel/compile.py) the plain formula: Inductor fuses
        # silu, the product and their backward (both halves of the [R, 2F] gradient written by
        # one kernel) by itself, with no custom Function to trace.
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(h)


def _in_features(ffn_dim: int, activation: str) -> int:
    return 2 * ffn_dim if activation == "swiglu" else ffn_dim


class GroupedExperts(nn.Module):
    """E experts with weights stacked on dim 0: `w_in_EDU` [E, D, 2F or F], `w_out_EFD` [E, F, D].

    forward(x_RD, plan) runs expert e on its contiguous block of rows of each chunk of a
    dispatcher's plan; no Python loop over experts. Expert parallelism shards dim 0 (each rank
    holds its local experts). `ffn(x_RD, rows_per_expert, offs_E, w_in, w_out)` is the maths
    alone, for rows already grouped by expert (`rows_per_expert`: the host list, or a plan's
    `host_rows`, read only if the GEMM's path needs it: layers/grouped_mm.py).
    """

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, activation: str = "swiglu",
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        self.num_experts, self.activation = num_experts, activation
        # Expert parallelism keeps some experts; these name them by global id (the stack's row
        # j is expert expert_ids[j]; contiguous blocks start at expert_offset).
        self.expert_offset, self.num_global_experts = 0, num_experts
        self.expert_ids = tuple(range(num_experts))
        self.w_in_EDU = nn.Parameter(torch.empty(num_experts, dim, _in_features(ffn_dim, activation)))
        self.w_out_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        nn.init.normal_(self.w_in_EDU, std=init_std)
        nn.init.normal_(self.w_out_EFD, std=out_init_std or init_std)
        # Set by parallel/checkpointing.py (train.recompute="experts"): recompute(fn, *args) runs
        # fn so that backward runs it again instead of keeping its activations.
        self.recompute: Callable | None = None
        # Set by parallel/compile.py (train.compile): the activation as a compiled h -> a.
        self.activate: Callable | None = None
        # Set by parallel/replicas.py (parallel.expert_replicas): (w_in, w_out) -> the stacks
        # with this rank's replica slots appended (their gradients flow back to the owners).
        self.with_replicas: Callable | None = None

    def forward(self, x_RD, plan):
        """y_RD: the experts on the rows of each chunk of `plan` (a dispatcher's, see
        layers/dispatch.py). `x_RD` and `y_RD` hold one tensor per chunk: chunk c's rows reach
        the GEMMs through `chunk.arrive` (under expert parallelism, a wait for their all-to-all)
        and its outputs leave through `chunk.depart`, so chunk c's GEMMs run while the next
        chunk's rows travel. One call for every chunk, so module hooks (FSDP's unshard and
        reshard) see the experts called once, with the rows as their tensor input."""
        w_in, w_out = self.w_in_EDU, self.w_out_EFD
        if self.with_replicas is not None:
            w_in, w_out = self.with_replicas(w_in, w_out)
        chunks = plan.chunks
        if len(chunks) > 1:
            sizes = [chunk.num_experts for chunk in chunks]
            w_ins, w_outs = w_in.split(sizes), w_out.split(sizes)
        else:
            w_ins, w_outs = (w_in,), (w_out,)
        y_RD = []
        for chunk, rows, w_in, w_out in zip(chunks, x_RD, w_ins, w_outs, strict=True):
            later = None
            if chunk.defers_weight_grads:
                # Before arrive records its wait: backward then sends the input gradient back
                # first and computes the weight gradients while it travels.
                w_in, w_out, later = defer_weight_grads(w_in, w_out)
            y = self.ffn(chunk.arrive(rows), chunk.host_rows, chunk.offs_E, w_in, w_out,
                         later)
            y_RD.append(chunk.depart(y))
        return tuple(y_RD)

    def ffn(self, x_RD, rows_per_expert: HostRows, offs_E, w_in_EDU, w_out_EFD, later=None):
        """`expert_ffn` with this module's activation on (a block of) its weights. Under
        recompute only this is run again in backward (never a dispatcher's all-to-alls), and
        nothing is deferred (`later` is not used)."""
        activation = self.activate or self.activation
        if self.recompute is not None:
            return self.recompute(expert_ffn, x_RD, rows_per_expert, offs_E, w_in_EDU, w_out_EFD,
                                  activation)
        return expert_ffn(x_RD, rows_per_expert, offs_E, w_in_EDU, w_out_EFD, activation, later)


def expert_ffn(x_RD, rows_per_expert: HostRows, offs_E, w_in_EDU, w_out_EFD, activation,
               later: "LaterWeightGrads | None" = None):
    """The experts' maths on rows grouped by expert, for any block of experts' weights (the
    all-to-all pipeline runs a block of local experts per chunk); `activation` is a name of
    ACTIVATIONS or a callable h -> a. With `later` (from
    `defer_weight_grads` on these weights), backward gives the input gradient first and leaves
    the weight gradients to that node."""
    if later is not None and x_RD.requires_grad and torch.is_grad_enabled():
        return _DeferredFFN.apply(x_RD, w_in_EDU, w_out_EFD, rows_per_expert, offs_E, activation,
                                  later)
    return _ffn(x_RD, rows_per_expert, offs_E, w_in_EDU, w_out_EFD, activation)[-1]


def _ffn(x_RD, rows_per_expert, offs_E, w_in_EDU, w_out_EFD, activation, cut=lambda t: t):
    """(h, its activation, output); `cut` is applied to h and to the activation before use."""
    h_RU = grouped_mm(x_RD, w_in_EDU, rows_per_expert, offs_E)
    a_RF = activate(cut(h_RU), activation)
    return h_RU, a_RF, grouped_mm(cut(a_RF), w_out_EFD, rows_per_expert, offs_E)


# -- weight gradients after the input gradient ---------------------------------------------------
#
# Under expert parallelism the input gradient of a chunk of experts goes back over an all-to-all,
# and nothing after it in backward needs the weight gradients: computed after that all-to-all is
# issued, the two weight-gradient GEMMs (half the experts' backward) run while it travels, and
# the last chunk's all-to-all, which otherwise nothing hides, is hidden too (the "W" of
# zero-bubble schedules; Megatron-Core's delayed wgrad). Autograd computes a node's gradients all
# at once, so the experts run as one Function over an inner graph of their own, cut at h and at
# its activation: its backward asks the inner graph for the input gradient only (autograd then
# skips the weight halves of the GEMM backward), and the weight gradients are asked for by
# another node, `_WeightGrads`, which the weights pass through before the all-to-all's wait is
# recorded. Autograd runs, of the nodes ready, the one recorded last first: the input gradient's
# path (through the wait, which issues the all-to-all) before `_WeightGrads`. Each gradient is the
# same ATen call on the same tensors as in one backward, so results are bit-identical.


class LaterWeightGrads:
    """What a deferring expert call leaves for its weight gradients: the inner graph's ends (as
    gradient edges: no tensor is kept alive for them) and leaves (`inner`, set in forward), and
    the gradients at those ends (`grads`, set in backward)."""

    __slots__ = ("inner", "grads")

    def __init__(self):
        self.inner = self.grads = None


_ONCE = ("the experts' deferred weight gradients (layers/experts.py) allow one backward per "
         "forward: no second backward over a graph kept with retain_graph=True, and no double "
         "backward (create_graph=True)")


class _WeightGrads(torch.autograd.Function):
    """Forward: views of the weights. Backward: their gradients from the deferring call's inner
    graph (what arrives is the zeros that call returned for them)."""

    @staticmethod
    def forward(ctx, w_in_EDU, w_out_EFD, later):
        ctx.later = later
        outs = w_in_EDU.view_as(w_in_EDU), w_out_EFD.view_as(w_out_EFD)
        ctx.mark_non_differentiable(*(o for o, w in zip(outs, (w_in_EDU, w_out_EFD))
                                      if not w.requires_grad))
        return outs

    @staticmethod
    def backward(ctx, grad_in, grad_out):
        later = ctx.later
        if later.grads is None:
            return grad_in, grad_out, None
        if later.inner is None or torch.is_grad_enabled():
            raise RuntimeError(_ONCE)
        (h_edge, y_edge, w_in_, w_out_), (grad_h, grad_y) = later.inner, later.grads
        later.inner = later.grads = None
        if w_in_.requires_grad:
            (grad_in,) = torch.autograd.grad(h_edge, w_in_, grad_h)
        if w_out_.requires_grad:
            (grad_out,) = torch.autograd.grad(y_edge, w_out_, grad_y)
        return grad_in, grad_out, None


class _DeferredFFN(torch.autograd.Function):
    """The experts over an inner graph; backward returns the input gradient only (zeros, no
    memory, for the weights: `_WeightGrads` gives theirs). The inner graph keeps what one
    backward would; its ends are held as gradient edges, so no output stays alive for it."""

    @staticmethod
    def forward(ctx, x_RD, w_in_EDU, w_out_EFD, rows_per_expert, offs_E, activation, later):
        cuts = []

        def cut(t):   # a leaf of the inner graph in t's place, so each step is asked for alone
            cuts.append(t.detach().requires_grad_(t.requires_grad))
            return cuts[-1]

        with torch.enable_grad():
            x_, w_in_, w_out_ = (cut(t) for t in (x_RD, w_in_EDU, w_out_EFD))
            h_RU, a_RF, y_RD = _ffn(x_, rows_per_expert, offs_E, w_in_, w_out_, activation, cut)
        edges = [get_gradient_edge(t) for t in (h_RU, a_RF, y_RD)]
        ctx.inner = (x_, *edges, *cuts[3:])
        ctx.later = later
        ctx.shapes = [(w.shape, w.dtype, w.device) for w in (w_in_EDU, w_out_EFD)]
        later.inner = (edges[0], edges[2], w_in_, w_out_)
        return y_RD.detach()

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.inner is None or torch.is_grad_enabled():
            raise RuntimeError(_ONCE)
        (x_, h_edge, a_edge, y_edge, h_cut, a_cut), ctx.inner = ctx.inner, None
        (grad_a,) = torch.autograd.grad(y_edge, a_cut, grad_y, retain_graph=True)
        (grad_h,) = torch.autograd.grad(a_edge, h_cut, grad_a)
        (grad_x,) = torch.autograd.grad(h_edge, x_, grad_h, retain_graph=True)
        ctx.later.grads, ctx.later = (grad_h, grad_y), None
        zeros = [torch.zeros((), dtype=dtype, device=device).expand(shape)
                 for shape, dtype, device in ctx.shapes]
        return grad_x, *zeros, None, None, None, None


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (a `torch.utils.checkpoint` region, `save_on_cpu`) are active:
    the one private torch call in this file, as torch has no public query, and a checkpointed
    region, recomputed in backward, must run the plain backward."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def defer_weight_grads(w_in_EDU, w_out_EFD):
    """(w_in, w_out, later): pass the weights and `later` to `expert_ffn`, and its backward gives
    the input gradient, and then, as the next node autograd runs after those recorded since
    this call, the weight gradients. Call it before recording the node that should run in
    between (the all-to-all's wait). `later` is None when nothing is to be deferred: no
    gradient to compute, or saved-tensor hooks at work (activation recompute, or offloading:
    the inner graph would hide its tensors from them)."""
    if not (torch.is_grad_enabled() and (w_in_EDU.requires_grad or w_out_EFD.requires_grad)):
        return w_in_EDU, w_out_EFD, None
    if _saved_tensor_hooks_active():
        return w_in_EDU, w_out_EFD, None
    later = LaterWeightGrads()
    return *_WeightGrads.apply(w_in_EDU, w_out_EFD, later), later


class FeedForward(nn.Module):
    """The dense FFN (the dense layers of the model, and the shared experts)."""

    def __init__(self, dim: int, ffn_dim: int, activation: str = "swiglu",
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        self.activation = activation
        self.w_in = nn.Linear(dim, _in_features(ffn_dim, activation), bias=False)
        self.w_out = nn.Linear(ffn_dim, dim, bias=False)
        nn.init.normal_(self.w_in.weight, std=init_std)
        nn.init.normal_(self.w_out.weight, std=out_init_std or init_std)

    def forward(self, x):
        return self.w_out(activate(self.w_in(x), self.activation))


class SharedExperts(nn.Module):
    """Always-on experts (DeepSeek/Qwen2-MoE): one FFN of num_shared * ffn_dim hidden units,
    optionally scaled per token by sigmoid(x @ gate) as in Qwen2-MoE."""

    def __init__(self, dim: int, ffn_dim: int, activation: str = "swiglu", gated: bool = False,
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        self.ffn = FeedForward(dim, ffn_dim, activation, init_std, out_init_std)
        self.gate = nn.Linear(dim, 1, bias=False) if gated else None
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=init_std)

    def forward(self, x_TD):
        y_TD = self.ffn(x_TD)
        if self.gate is not None:
            y_TD = torch.sigmoid(self.gate(x_TD)) * y_TD
        return y_TD
