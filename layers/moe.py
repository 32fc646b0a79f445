"""The MoE layer: route, dispatch, run experts with one grouped GEMM, combine, add shared experts.

Legend: T tokens, D model dim, R rows sent to experts, S sequence length.

    x_TD -> router(defer_losses=True) -> routing
         -> dispatcher.start(x_TD, routing)                  (EP: all-to-alls in flight)
            | router losses and stats, aux-loss injection, shared experts   (overlap)
         -> dispatcher.finish(started, experts, weight_N) -> y_TD  (+ shared experts)

`finish` runs the experts (grouped GEMMs) on the dispatched rows and combines them; the local
dispatcher's pair is dispatch -> experts -> combine, the all-to-all one pipelines chunks of
experts between its asynchronous all-to-alls (parallel/alltoall.py).

Aux losses are returned, never kept in a module global. With `aux_loss_scale` set, the layer also
attaches their gradient inside autograd (scale-and-inject): the output is unchanged and backward
adds d(total)/d(router) * scale, so the losses train the router under gradient accumulation,
activation recompute and any pipeline schedule without reaching the final loss. The injection
rides on the combine weights (N numbers, not the [T, D] output), which every backward through
the layer's output reaches.
"""

from typing import NamedTuple

import torch
from torch import nn

from .dispatch import LocalDispatcher
from .experts import ACTIVATIONS, GroupedExperts, SharedExperts
from .router import RouterConfig, RouterLosses, RoutingStats, build_router

__all__ = ["MoE", "MoEOutput", "inject_aux_loss"]


class MoEOutput(NamedTuple):
    y: torch.Tensor              # same shape as the input
    aux_loss: RouterLosses       # .total carries gradient; add it to your loss unless injected
    stats: RoutingStats          # detached load statistics for this call


class _InjectAuxLoss(torch.autograd.Function):
    """Forward: a copy of y. Backward: y's gradient passes through; aux_loss gets `scale`."""

    @staticmethod
    def forward(ctx, y, aux_loss, scale: float):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return y.clone()

    @staticmethod
    def backward(ctx, grad_y):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_y.device)
        return grad_y, grad_aux, None


def inject_aux_loss(y, aux_loss, scale: float):
    """Returns y's values (a copy, so callers may modify it in place); in backward, aux_loss
    receives gradient `scale` whenever y does."""
    if not aux_loss.requires_grad:
        return y
    return _InjectAuxLoss.apply(y, aux_loss, scale)


class MoE(nn.Module):
    """A Mixture-of-Experts FFN for inputs of shape [..., dim].

    Every call is one capacity group (all its tokens compete for capacity). For the sequence-level
    balance loss the second-to-last input dim is the sequence; a 2-D input is one sequence.

    Router options are the fields of `RouterConfig`, passed as keywords or as `router=RouterConfig()`.
    `aux_loss_scale=None` returns aux losses for the caller to add; a float injects them (see above).
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int = 2, *,
                 activation: str = "swiglu", num_shared_experts: int = 0,
                 shared_ffn_dim: int | None = None, shared_gate: bool = False,
                 aux_loss_scale: float | None = None, router: RouterConfig | None = None,
                 init_std: float = 0.02, out_init_std: float | None = None, **router_kwargs):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        if router is not None and router_kwargs:
            raise ValueError(f"pass router options either as router=RouterConfig(...) or as "
                             f"keywords, not both (got {sorted(router_kwargs)})")
        cfg = router or RouterConfig(**router_kwargs)
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.aux_loss_scale = aux_loss_scale
        self.router = build_router(dim, num_experts, top_k, cfg)
        self.experts = GroupedExperts(num_experts, dim, ffn_dim, activation, init_std, out_init_std)
        self.shared = None
        if num_shared_experts > 0:
            hidden = num_shared_experts * (shared_ffn_dim or ffn_dim)
            self.shared = SharedExperts(dim, hidden, activation, shared_gate, init_std, out_init_std)
        # The seam parallelisms swap (expert parallelism installs an all-to-all dispatcher).
        self.dispatcher = LocalDispatcher(num_experts)

    def forward(self, x) -> MoEOutput:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE expects [..., {self.dim}], got {tuple(x.shape)}")
        seq_len = x.shape[-2] if x.dim() >= 2 else 1
        x_TD = x.reshape(-1, self.dim)
        # Through the modules' own calls, so their hooks (FSDP unshard) run as usual.
        routing, finish_router = self.router(x_TD, seq_len=seq_len if x.dim() > 2 else None,
                                             defer_losses=True)
        started = self.dispatcher.start(x_TD, routing)
        # While the dispatch is in flight (EP): the router's losses and the shared experts.
        losses, stats = finish_router()
        weight_N = routing.weight_N
        if self.aux_loss_scale is not None:
            weight_N = inject_aux_loss(weight_N, losses.total, self.aux_loss_scale)
        shared_TD = self.shared(x_TD) if self.shared is not None else None
        y_TD = self.dispatcher.finish(started, self.experts, weight_N).to(x.dtype)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        return MoEOutput(y_TD.view(x.shape[:-1] + (y_TD.shape[-1],)), losses, stats)
