"""The training loss: mean next-token cross-entropy from the final hidden states and the LM head's
weight, chunked over tokens so no [tokens, vocab] logits exist (layers/loss.py); float32 or wider
per chunk whatever the compute dtype; vocabulary-parallel under tp (vocab.py), chosen once at
build.

Talks on the `tp` group under tensor parallelism (vocab.py's two all-reduces), else on none.
"""

from moepar.layers.loss import linear_cross_entropy

from .comm import group_size
from .vocab import vocab_parallel_linear_cross_entropy

__all__ = ["cross_entropy", "build_loss"]


def cross_entropy(h_BSD, w_VD, targets_BS, grad_scale: float | None = None):
    """Mean cross-entropy of the logits h_BSD @ w_VD.T, in float32 or wider, never formed whole
    (targets -100 not counted). `grad_scale`: the gradient the runner backpropagates into it, so
    the gradients can be formed in forward (layers/loss.py)."""
    return linear_cross_entropy(h_BSD, w_VD, targets_BS, grad_scale=grad_scale)


def build_loss(tp_group=None, vocab_size: int = 0):
    """loss(h, head weight, targets, grad_scale=None) for the runners: `cross_entropy`, or under
    tensor parallelism (the weight holding this rank's vocabulary rows) the vocabulary-parallel
    one over `tp_group` (which recomputes its gradients in backward and ignores grad_scale)."""
    if tp_group is None or group_size(tp_group) == 1:
        return cross_entropy

    def vocab_parallel(h_BSD, w_VlD, targets_BS, grad_scale=None):
        return vocab_parallel_linear_cross_entropy(h_BSD, w_VlD, targets_BS, tp_group, vocab_size)
    return vocab_parallel
