"""The training loss: mean next-token cross-entropy, computed in float32 or wider whatever the
logits' dtype; vocabulary-parallel under tp (vocab.py), chosen once at build.

Talks on the `tp` group under tensor parallelism (vocab.py's two all-reduces), else on none.
"""

import torch
import torch.nn.functional as F

from .comm import group_size
from .vocab import vocab_parallel_cross_entropy

__all__ = ["cross_entropy", "build_loss"]


def cross_entropy(logits_BSV, targets_BS):
    """Mean cross-entropy, in float32 or wider whatever the logits' dtype."""
    logits_BSV = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())


def build_loss(tp_group=None, vocab_size: int = 0):
    """loss(logits, targets): `cross_entropy`, or under tensor parallelism (logits holding this
    rank's vocabulary columns) the vocabulary-parallel one over `tp_group`."""
    if tp_group is None or group_size(tp_group) == 1:
        return cross_entropy

    def vocab_parallel(logits_BSV, targets_BS):
        logits_BSV = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
        return vocab_parallel_cross_entropy(logits_BSV, targets_BS, tp_group, vocab_size)
    return vocab_parallel
