"""An autograd mark for tests of backward order: identity forward; its backward appends a label
to a list when the gradient passes that point of the graph."""

import torch

__all__ = ["Mark"]


class Mark(torch.autograd.Function):
    """Mark.apply(x, events, label): x as is; backward appends `label` to `events`."""

    @staticmethod
    def forward(ctx, x, events: list, label: str):
        ctx.events, ctx.label = events, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(ctx.label)
        return grad, None, None
