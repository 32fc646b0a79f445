"""Activation checkpointing: each decoder block's activations are recomputed in backward.

Talks on no process group. Uses non-reentrant `torch.utils.checkpoint`, which returns the
block's full output (hidden state and MoE losses and stats) from the first forward and discards
the recomputed copy; routing is deterministic, so the recompute makes the same drop decisions,
and the MoE aux-loss gradient is injected once, by the recomputed graph.
"""

from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model):
    """Wraps every block's forward in place; parameter names (and checkpoints) do not change."""
    for block in model.layers:
        inner = block.forward

        def checkpointed(*args, _inner=inner):
            return checkpoint(_inner, *args, use_reentrant=False)

        block.forward = checkpointed
    return model
