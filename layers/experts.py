"""Feed-forward networks: stacked routed experts (one grouped GEMM), the dense FFN, shared experts.

Legend: R rows (token copies sorted by expert), E experts on this module, D model dim,
F hidden dim per expert, T tokens.

SwiGLU keeps the gate and up projections fused in one weight (`w_in`, last dim 2F: gate first,
then up) so each expert costs two GEMMs, not three.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .grouped_mm import grouped_mm

__all__ = ["ACTIVATIONS", "GroupedExperts", "FeedForward", "SharedExperts", "expert_ffn",
           "CastCache"]

ACTIVATIONS = ("swiglu", "gelu")


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up for h = [gate | up]. Backward writes both halves of one [R, 2F] gradient
    in place, instead of autograd's two half-size gradients joined by a cat (a full extra copy of
    the largest activation in the layer), and allocates nothing else: grad * up is formed in the
    gate half and turned into the gate gradient there."""

    @staticmethod
    def forward(ctx, h):
        gate, up = h.chunk(2, dim=-1)
        silu_gate = F.silu(gate)
        ctx.save_for_backward(h, silu_gate)
        return silu_gate * up

    @staticmethod
    def backward(ctx, grad_out):
        h, silu_gate = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        grad_h = torch.empty_like(h)
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        torch.mul(grad_out, silu_gate, out=grad_up)
        torch.mul(grad_out, up, out=grad_gate)
        # The ATen op autograd itself uses for silu, in its out= form, in place on the half
        # (an elementwise op may write over its own input).
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_h


def _activate(h, activation: str):
    if activation == "swiglu":
        return _SwiGLU.apply(h)
    return F.gelu(h)


def _in_features(ffn_dim: int, activation: str) -> int:
    return 2 * ffn_dim if activation == "swiglu" else ffn_dim


class CastCache:
    """Expert weights in the autocast dtype, cast once and shared until `clear()`: what autocast's
    own cache does for the weights of `F.linear` within its outermost region, for the stacks
    that `torch._grouped_mm` takes (autocast does not cover it, so each call would cast again).
    A training loop that runs a whole step in one autocast region clears it when the step ends;
    every micro-batch then shares one copy (and its one cast node in autograd), instead of each
    micro-batch casting and keeping its own. Entries are keyed by the weight and grad mode (a
    cast made under no_grad has no graph); whoever updates the weights clears it first."""

    def __init__(self):
        self._casts = {}

    def get(self, w: torch.Tensor) -> torch.Tensor:
        device = w.device.type
        if not torch.is_autocast_enabled(device) or w.dtype != torch.float32:
            return w
        dtype = torch.get_autocast_dtype(device)
        key = (id(w), torch.is_grad_enabled(), dtype)
        hit = self._casts.get(key)
        if hit is None or hit[0] is not w:
            hit = self._casts[key] = (w, w.to(dtype))
        return hit[1]

    def clear(self):
        self._casts.clear()

    def __len__(self):
        return len(self._casts)


class GroupedExperts(nn.Module):
    """E experts with weights stacked on dim 0: `w_in_EDH` [E, D, 2F or F], `w_out_EFD` [E, F, D].

    forward(x_RD, rows_per_expert, offs_E) runs expert e on its contiguous block of rows; no Python loop
    over experts. Expert parallelism shards dim 0 (each rank holds its local experts).
    """

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, activation: str = "swiglu",
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        self.num_experts, self.activation = num_experts, activation
        # Expert parallelism keeps a block of experts; these name them by global id.
        self.expert_offset, self.num_global_experts = 0, num_experts
        self.w_in_EDH = nn.Parameter(torch.empty(num_experts, dim, _in_features(ffn_dim, activation)))
        self.w_out_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        nn.init.normal_(self.w_in_EDH, std=init_std)
        nn.init.normal_(self.w_out_EFD, std=out_init_std or init_std)
        self.casts: CastCache | None = None     # set by a training loop (see CastCache)

    def forward(self, x_RD, rows_per_expert: list[int] | None = None,
                offs_E: torch.Tensor | None = None):
        """`offs_E`: the int32 cumulative rows per expert on the device, as the dispatchers' plans
        carry it; built from the host list (a host-to-device copy) only when not given.

        `x_RD` may instead be a pipeline: a callable of (w_in_EDH, w_out_EFD, activation) that
        runs the experts itself, block by block between its all-to-alls (the all-to-all
        dispatcher's overlap). It runs inside this call so module hooks (FSDP's unshard and
        reshard) see the experts called once, as on the synchronous path.
        """
        w_in, w_out = self.w_in_EDH, self.w_out_EFD
        if self.casts is not None:
            w_in, w_out = self.casts.get(w_in), self.casts.get(w_out)
        if callable(x_RD) and not isinstance(x_RD, torch.Tensor):
            return x_RD(w_in, w_out, self.activation)
        if offs_E is None:
            offs_E = torch.tensor(rows_per_expert, device=x_RD.device).cumsum(0).to(torch.int32)
        return expert_ffn(x_RD, rows_per_expert, offs_E, w_in, w_out, self.activation)


def expert_ffn(x_RD, rows_per_expert: list[int], offs_E, w_in_EDH, w_out_EFD, activation: str):
    """The experts' maths on rows grouped by expert, for any block of experts' weights (the
    all-to-all pipeline runs a block of local experts per chunk)."""
    h_RH = grouped_mm(x_RD, w_in_EDH, rows_per_expert, offs_E)
    return grouped_mm(_activate(h_RH, activation), w_out_EFD, rows_per_expert, offs_E)


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
        return self.w_out(_activate(self.w_in(x), self.activation))


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
