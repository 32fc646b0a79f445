"""Stand-in experts for dispatcher round trips: each row times its expert's global id + 1,
run through the plan's chunk protocol (layers/dispatch.py) as GroupedExperts runs it."""

import torch

__all__ = ["times_expert_id"]


def times_expert_id(x_RD, plan, offset: int):
    """y_RD for `combine`: chunk by chunk, the arrived rows times (global expert id + 1);
    `offset` is the global id of this rank's first expert."""
    y_RD = []
    for chunk, rows in zip(plan.chunks, x_RD, strict=True):
        x = chunk.arrive(rows)
        assert sum(chunk.rows_per_expert) == x.shape[0]
        first = offset + chunk.first_expert
        ids = torch.repeat_interleave(
            torch.arange(chunk.num_experts, device=x.device) + first,
            torch.tensor(chunk.rows_per_expert, device=x.device), output_size=x.shape[0])
        y_RD.append(chunk.depart(x * (ids + 1).unsqueeze(1).to(x.dtype)))
    return tuple(y_RD)
