"""Activation recompute: parts of each decoder block are run again in backward instead of
keeping their activations.

Talks on no process group of its own (a recomputed region re-runs the collectives inside it:
under tensor parallelism, attention's sequence all-gather and reduce-scatter, on every tp rank
alike).

| train.recompute | what is recomputed in backward        | what is no longer kept (per block)            |
|-----------------|---------------------------------------|-----------------------------------------------|
| none            | nothing                               | -                                             |
| full            | the whole block                       | everything but the block's input              |
| attention       | attention (q/k/v, scores, output)     | q, k, v, attention weights and output          |
| experts         | the routed experts' grouped GEMMs     | the [rows, 2F] hidden state and its activation |

`experts` checkpoints `GroupedExperts.ffn` (the maths alone): under expert parallelism the
dispatcher calls the experts block by block between its all-to-all waits, and a recompute of the
whole experts call would wait on all-to-alls already consumed.

Uses non-reentrant `torch.utils.checkpoint`, which returns the region's outputs (for a full
block: hidden state and MoE losses and stats) from the first forward and discards the
recomputed copy; routing is deterministic, so a recompute makes the same drop decisions, and the
MoE aux-loss gradient is injected once, by the recomputed graph. Results are bit-identical to no
recompute (tested).
"""

import types

from torch.utils.checkpoint import checkpoint

__all__ = ["RECOMPUTE", "apply_recompute", "apply_activation_checkpointing"]

RECOMPUTE = ("none", "full", "attention", "experts")


def _checkpointed_call(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _checkpointed_forward(module, *args):
    return _checkpointed_call(type(module).forward, module, *args)


def _wrap(module):
    # A method bound to the module itself, so `copy.deepcopy` rebinds it to the copy; parameter
    # names (and checkpoints) do not change.
    module.forward = types.MethodType(_checkpointed_forward, module)


def apply_recompute(model, mode: str):
    """Wraps the regions of every block that `mode` recomputes, in place; returns the model."""
    if mode not in RECOMPUTE:
        raise ValueError(f"train.recompute={mode!r} is not one of {RECOMPUTE}")
    for block in model.layers:
        if mode == "full":
            _wrap(block)
        elif mode == "attention":
            _wrap(block.attn)
        elif mode == "experts" and block.is_moe:
            # The experts' maths only: under expert parallelism the experts call also holds the
            # dispatcher's all-to-all waits, which a recompute must not run again.
            block.ffn.experts.recompute = _checkpointed_call
    return model


def apply_activation_checkpointing(model):
    """Full recompute of every block (train.recompute='full')."""
    return apply_recompute(model, "full")
