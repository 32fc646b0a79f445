"""The local token dispatcher: sort token copies by expert, and weight and sum the results back.

Legend: T tokens, D model dim, N assignments (token copies), R rows kept (N minus drops), E experts.

This is the seam between single-device maths and communication: an expert-parallel dispatcher
(in `moepar.parallel`) has the same two methods. `dispatch` returns a frozen plan that `combine`
consumes, so nothing lives on `self` between the two (safe under recompute and pipelining).
The one host sync is `rows_per_expert` (the grouped GEMM needs group sizes on the host).
"""

from dataclasses import dataclass

import torch

from .router import Routing

__all__ = ["LocalPlan", "LocalDispatcher"]


@dataclass(frozen=True)
class LocalPlan:
    token_R: torch.Tensor         # source token of each row, rows in expert-major order
    weight_R: torch.Tensor        # combine weight of each row
    rows_per_expert: list[int]    # host copy of the kept rows per expert (the one sync)
    num_tokens: int


class LocalDispatcher:
    """Dispatch for experts that all live on this device."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """Returns (x_RD rows grouped by expert, plan). Dropped copies (expert == E) are cut off."""
        # A stable sort keeps token order inside each expert: the same rows in every layout.
        expert_sorted_N, order_N = torch.sort(routing.expert_N, stable=True)
        counts = torch.bincount(expert_sorted_N, minlength=self.num_experts + 1)
        rows_per_expert = counts[: self.num_experts].tolist()
        kept_R = order_N[: sum(rows_per_expert)]
        token_R = routing.token_N[kept_R]
        plan = LocalPlan(token_R, routing.weight_N[kept_R], rows_per_expert, x_TD.shape[0])
        return x_TD[token_R], plan

    def combine(self, y_RD: torch.Tensor, plan: LocalPlan) -> torch.Tensor:
        """y_TD = sum over each token's kept copies of weight * expert output (zero if all dropped)."""
        weighted_RD = y_RD * plan.weight_R.unsqueeze(-1)
        y_TD = weighted_RD.new_zeros(plan.num_tokens, y_RD.shape[-1])
        return y_TD.index_add(0, plan.token_R, weighted_RD)
