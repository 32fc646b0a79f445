"""What one attention layer attends over when the whole sequence is on this rank: the seam that
context parallelism (parallel/context.py `ContextParallel`) swaps, with the same two methods.

Legend: B batch, H query heads, G key/value heads, S sequence length, Hd head dim.
"""

from .cache import causal_attention

__all__ = ["LocalContext", "LOCAL"]


class LocalContext:
    """Every position of each sequence is here: nothing to gather, plain causal attention."""

    def gather(self, seq_dims: int | tuple[int, ...], *tensors):
        """The whole sequence of each tensor, along `seq_dims` (one for all, or one per tensor):
        here, the tensors themselves."""
        return list(tensors)

    def attention(self, q_BHSd, k_BGSd, v_BGSd, scale: float | None = None, mask_B1SL=None):
        """Causal SDPA of the local queries over the gathered keys and values (`mask_B1SL`, packed
        documents: who sees whom, in place of causal)."""
        return causal_attention(q_BHSd, k_BGSd, v_BGSd, 0, scale, mask_B1TL=mask_B1SL)


LOCAL = LocalContext()
