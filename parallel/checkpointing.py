"""Activation checkpointing: each decoder block's activations are recomputed in backward.

Talks on no process group. Uses non-reentrant `torch.utils.checkpoint`, which returns the
block's full output (hidden state and MoE losses and stats) from the first forward and discards
the recomputed copy; routing is deterministic, so the recompute makes the same drop decisions,
and the MoE aux-loss gradient is injected once, by the recomputed graph.
"""

import types

from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def _checkpointed_forward(block, *args):
    return checkpoint(type(block).forward, block, *args, use_reentrant=False)


def apply_activation_checkpointing(model):
    """Wraps every block's forward in place; parameter names (and checkpoints) do not change.

    The wrapper is a method bound to the block itself, so `copy.deepcopy` rebinds it to the copy.
    """
    for block in model.layers:
        block.forward = types.MethodType(_checkpointed_forward, block)
    return model
