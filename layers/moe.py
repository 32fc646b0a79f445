"""The MoE layer: route, dispatch, run experts with one grouped GEMM, combine, add shared experts.

Legend: T tokens, D model dim, R rows sent to experts, S sequence length.

    routing, losses, stats = router(x_TD)                      route
    x_RD, plan = dispatcher.dispatch(x_TD, routing)            dispatch (EP: rows in flight)
        aux-loss injection, shared experts                     (while the rows travel)
    y_RD = experts(x_RD, plan)                                 experts: grouped GEMMs per chunk
    y_TD = dispatcher.combine(y_RD, plan, weight_N)            combine (+ shared experts)

The dispatcher is the seam parallelisms swap (layers/dispatch.py has the local one and the plan
every dispatcher returns; parallel/alltoall.py, dedup.py, allgather.py the expert-parallel ones);
overlap of communication with the experts' GEMMs is the plan's chunking, not another code path.

Aux losses are returned, never kept in a module global. With `aux_loss_scale` set, the layer also
attaches their gradient inside autograd (scale-and-inject): the output is unchanged and backward
adds d(total)/d(router) * scale, so the losses train the router under gradient accumulation,
activation recompute and any pipeline schedule without reaching the final loss. The injection
rides on the combine weights (N numbers, not the [T, D] output), which every backward through
the layer's output reaches. A balance loss that needs counts beyond this call (all MoE layers of
the micro-batch, or the global scope: layers/balance.py) is injected the same way, as
d(loss)/d(probability sums) * scale, read in backward from the layer's `BalanceSlot`, which the
micro-batch's runner fills in after the forward; how it is injected is fixed at build time.
"""

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from .balance import BalanceSlot, BalanceStep, MicroBalance
from .dispatch import LocalDispatcher
from .experts import ACTIVATIONS, GroupedExperts, SharedExperts
from .router import RouterConfig, RouterLosses, RoutingStats, build_router

__all__ = ["MoE", "MoEOutput", "inject_aux_loss"]


class MoEOutput(NamedTuple):
    y: torch.Tensor              # same shape as the input
    aux_loss: RouterLosses       # .total carries gradient; add it to your loss unless injected
    stats: RoutingStats          # detached load statistics for this call

    def statistics(self) -> "MoEOutput":
        """This output without its activation and with its losses detached: what a step keeps
        for its statistics once the micro-batch's forward is done (nothing kept alive)."""
        return self._replace(y=None, aux_loss=dataclasses.replace(
            self.aux_loss, total=self.aux_loss.total.detach()))


class _InjectAuxLoss(torch.autograd.Function):
    """Forward: a copy of y. Backward: y's gradient passes through; aux_loss gets `scale`, and
    prob_sum_E (a deferred balance loss's input) gets slot.coef_E * scale, read only now."""

    @staticmethod
    def forward(ctx, y, aux_loss, prob_sum_E, scale: float, slot):
        ctx.scale, ctx.slot = scale, slot
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        ctx.sum_dtype = None if prob_sum_E is None else prob_sum_E.dtype
        return y.clone()

    @staticmethod
    def backward(ctx, grad_y):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_y.device)
        grad_sum = None
        if ctx.sum_dtype is not None:
            coef_E = ctx.slot.coef_E
            if coef_E is None:
                raise RuntimeError(
                    "an MoE layer's deferred balance loss (router.balance_loss='all_layers' or "
                    "router.balance_scope='global') got no coefficient: run the micro-batch "
                    "through Transformer.forward, or a step runner, which fill it in after the "
                    "forward")
            grad_sum = (coef_E * ctx.scale).to(ctx.sum_dtype)
        return grad_y, grad_aux, grad_sum, None, None


def inject_aux_loss(y, aux_loss, scale: float, prob_sum_E=None, slot: BalanceSlot | None = None):
    """Returns y's values (a copy, so callers may modify it in place); in backward, aux_loss
    receives gradient `scale` whenever y does, and `prob_sum_E` (when given) slot.coef_E * scale."""
    deferred = prob_sum_E is not None and prob_sum_E.requires_grad
    if not aux_loss.requires_grad and not deferred:
        return y
    return _InjectAuxLoss.apply(y, aux_loss, prob_sum_E if deferred else None, scale, slot)


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
        # How the losses' gradient is attached, fixed here (see the module docstring).
        self._inject = self._inject_deferred if cfg.deferred_balance else self._inject_total
        if cfg.deferred_balance and aux_loss_scale is None:
            raise ValueError(f"router.balance_loss={cfg.balance_loss!r} with router.balance_scope="
                             f"{cfg.balance_scope!r} is injected, never returned as a number to "
                             "add: build the MoE layer with aux_loss_scale set")

    def forward(self, x, balance: BalanceSlot | None = None, docs=None) -> MoEOutput:
        """`balance`: this layer's slot of the micro-batch's holder (layers/balance.py), for a
        deferred balance loss; without one (a layer used alone) the layer's own tokens are the
        whole micro-batch and it finishes the loss itself. `docs`: packed documents
        (layers/documents.py) of x's [B, S] tokens: padding routed nowhere and counted nowhere,
        the sequence balance loss per document."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE expects [..., {self.dim}], got {tuple(x.shape)}")
        seq_len = x.shape[-2] if x.dim() >= 2 else 1
        x_TD = x.reshape(-1, self.dim)
        # Through the modules' own calls, so their hooks (FSDP unshard) run as usual.
        packed = {} if docs is None else {"valid_T": docs.valid_T, "doc_T": docs.doc_T}
        routing, losses, stats = self.router(x_TD, seq_len=seq_len if x.dim() > 2 else None,
                                             **packed)
        x_RD, plan = self.dispatcher.dispatch(x_TD, routing)
        weight_N = routing.weight_N
        if self.aux_loss_scale is not None:
            weight_N, losses = self._inject(weight_N, losses, balance)
        shared_TD = self.shared(x_TD) if self.shared is not None else None
        y_RD = self.experts(x_RD, plan)
        y_TD = self.dispatcher.combine(y_RD, plan, weight_N).to(x.dtype)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        return MoEOutput(y_TD.view(x.shape[:-1] + (y_TD.shape[-1],)), losses, stats)

    def _inject_total(self, weight_N, losses: RouterLosses, balance):
        return inject_aux_loss(weight_N, losses.total, self.aux_loss_scale), losses

    def _inject_deferred(self, weight_N, losses: RouterLosses, balance):
        parts = losses.parts
        if balance is None and torch.is_grad_enabled():
            holder = MicroBalance()     # alone: this call is the whole micro-batch and model
            balance = holder.slot(0)
            balance.parts = parts.detach()
            BalanceStep(self.router.cfg, self.num_experts, self.top_k,
                        device=weight_N.device).finish(holder)
        if balance is not None and balance.parts is None:   # (a recompute finds them set)
            balance.parts = parts.detach()
        weight_N = inject_aux_loss(weight_N, losses.total, self.aux_loss_scale, parts.prob_sum_E,
                                   balance)
        return weight_N, dataclasses.replace(losses, parts=parts.detach())
