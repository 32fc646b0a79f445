"""Vocabulary parallelism: the embedding table and the cross-entropy with the vocabulary split over tp.

Talks on the `tp` group. Legend: B batch, S sequence, s = S/tp, D model dim, V vocabulary,
Vp = V padded to a multiple of tp, Vl = Vp/tp rows per rank, N tokens.

| piece                         | forward                                           | backward                        | host sync |
|-------------------------------|---------------------------------------------------|---------------------------------|-----------|
| VocabParallelEmbedding        | local lookup, reduce-scatter along the sequence   | all-gather along the sequence   | none      |
| vocab_parallel_cross_entropy  | all-reduce max; all-reduce [sum exp, target logit]| none (local softmax - one-hot)  | none      |
| vocab_parallel_linear_cross_  | the same two, once per call on [N] vectors        | none (dh partial: summed by the | none      |
|   entropy (from hidden states)|                                                   | head input's reduce-scatter)    |           |

Rank r holds rows [r*Vl, (r+1)*Vl) of the padded table (and of the LM head). Rows >= V are
zeros that no id looks up, and the loss masks their logits to -inf, so they never get
probability mass or gradient. A size-1 group skips every collective.
"""

import torch
import torch.distributed as dist
from torch import nn

from moepar.layers.loss import linear_cross_entropy_tokens, reduce_tokens

from .comm import group_size, reduce_scatter_rows

__all__ = ["padded_vocab_size", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "vocab_parallel_linear_cross_entropy"]


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The smallest multiple of tp that holds the vocabulary."""
    return -(-vocab_size // tp) * tp


class VocabParallelEmbedding(nn.Module):
    """forward(tokens_BS) -> x_BsD: this rank's sequence slice of the embeddings.

    `weight` [Vl, D] holds global ids [vocab_start, vocab_start + Vl). Each rank looks up the ids
    it holds (zero elsewhere); the reduce-scatter sums the one non-zero row per token (exact in any
    dtype) and leaves each rank its sequence slice, the layout between blocks.
    """

    def __init__(self, weight_local: torch.Tensor, vocab_start: int, vocab_size: int, group,
                 spec=None):
        super().__init__()
        self.weight = nn.Parameter(weight_local)
        self.vocab_start, self.vocab_size, self.group = vocab_start, vocab_size, group
        self.spec = spec   # the tensor.TPShard that maps `weight` to the full table (checkpoints)

    def forward(self, tokens_BS):
        local_BS = tokens_BS - self.vocab_start
        mine_BS = (local_BS >= 0) & (local_BS < self.weight.shape[0])
        x_BSD = nn.functional.embedding(local_BS.where(mine_BS, 0), self.weight)
        x_BSD = x_BSD * mine_BS.unsqueeze(-1).to(x_BSD.dtype)
        # Sequence on dim 0 for the row collective: [S, B, D] -> [s, B, D] -> [B, s, D].
        return reduce_scatter_rows(x_BSD.transpose(0, 1), self.group).transpose(0, 1)


def _all_reduce(x, op, group):
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss logsumexp(logits) - logits[target] with the vocabulary split over ranks."""

    @staticmethod
    def forward(ctx, logits_NVl, targets_N, group, vocab_start: int, vocab_size: int):
        num_local = logits_NVl.shape[-1]
        column_Vl = torch.arange(vocab_start, vocab_start + num_local, device=logits_NVl.device)
        logits_NVl = logits_NVl.masked_fill(column_Vl >= vocab_size, float("-inf"))
        max_N = _all_reduce(logits_NVl.max(-1).values, dist.ReduceOp.MAX, group)
        shifted_NVl = logits_NVl - max_N.unsqueeze(-1)
        local_N = targets_N - vocab_start
        mine_N = (local_N >= 0) & (local_N < num_local)
        local_N = local_N.where(mine_N, 0)
        target_N = shifted_NVl.gather(1, local_N.unsqueeze(1)).squeeze(1).where(mine_N, 0.0)
        exp_NVl = shifted_NVl.exp_()
        # One all-reduce for both sums: each token's target logit lives on exactly one rank.
        sums_2N = _all_reduce(torch.stack([exp_NVl.sum(-1), target_N]), dist.ReduceOp.SUM, group)
        loss_N = sums_2N[0].log() - sums_2N[1]
        softmax_NVl = exp_NVl.div_(sums_2N[0].unsqueeze(-1))
        ctx.save_for_backward(softmax_NVl, local_N, mine_N)
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        softmax_NVl, local_N, mine_N = ctx.saved_tensors
        grad_NVl = softmax_NVl * grad_N.unsqueeze(-1)
        rows_N = torch.arange(grad_NVl.shape[0], device=grad_NVl.device)
        grad_NVl.index_put_((rows_N, local_N), -grad_N * mine_N.to(grad_N.dtype), accumulate=True)
        return grad_NVl, None, None, None, None


def vocab_parallel_cross_entropy(logits_local, targets, group, vocab_size: int,
                                 reduction: str = "mean"):
    """F.cross_entropy(full logits, targets) from this rank's vocabulary columns.

    logits_local [..., Vl]: columns [tp_rank*Vl, (tp_rank+1)*Vl) of the padded vocabulary (the
    tensor-parallel model's output). targets [...]: global ids < vocab_size. `reduction` is
    "mean", "sum" or "none" (no ignore_index). Every tp rank returns the same loss; backward
    gives each rank the gradient of its own columns with no communication.
    Forward: all-reduce (max) and all-reduce (sum, 2 floats per token) over `group`; no host sync.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    num_local = logits_local.shape[-1]
    vocab_start = dist.get_rank(group) * num_local if group_size(group) > 1 else 0
    if num_local * group_size(group) < vocab_size:
        raise ValueError(f"{num_local} logits per rank x tp={group_size(group)} do not cover "
                         f"vocab_size={vocab_size}")
    loss_N = _VocabParallelCrossEntropy.apply(logits_local.reshape(-1, num_local),
                                              targets.reshape(-1), group, vocab_start, vocab_size)
    if reduction == "mean":
        return loss_N.mean()
    return loss_N.sum() if reduction == "sum" else loss_N.view(targets.shape)


def _combine_over(group):
    """combine() for layers/loss.py over the vocabulary slices of `group`: each rank's [N]
    logsumexp of its slice (-inf for a slice of padding only) and target logits (zero where
    another rank holds the target) -> the full vocabulary's logsumexp and target logit."""
    def combine(lse_N, target_N):
        global_N = _all_reduce(lse_N.clone(), dist.ReduceOp.MAX, group)
        # One all-reduce for both sums: each token's target logit lives on exactly one rank.
        sums_2N = _all_reduce(torch.stack([(lse_N - global_N).exp(), target_N]),
                              dist.ReduceOp.SUM, group)
        return global_N + sums_2N[0].log(), sums_2N[1]
    return combine


def vocab_parallel_linear_cross_entropy(h, w_local, targets, group, vocab_size: int,
                                        reduction: str = "mean", chunk: int | None = None):
    """F.cross_entropy(h @ W_full.T, targets, ignore_index=-100) from this rank's head rows
    `w_local` [Vl, D] (rows [tp_rank*Vl, (tp_rank+1)*Vl) of the padded vocabulary), chunked over
    tokens so no [N, Vl] logits exist at once (layers/loss.py). h [..., D]: every position's
    final hidden state (the same on every rank); targets [...]: global ids < vocab_size, or -100
    (no loss, no gradient, not counted by the mean). Every tp rank returns the same loss; backward gives each rank its rows' dW and its columns' share of dh (summed over tp by
    the backward of the sequence gather that made h), with no communication.
    Forward: all-reduce (max, 1 float per token) and all-reduce (sum, 2 floats per token) over
    `group`, once per call; no host sync."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    num_local = w_local.shape[0]
    vocab_start = dist.get_rank(group) * num_local if group_size(group) > 1 else 0
    if num_local * group_size(group) < vocab_size:
        raise ValueError(f"{num_local} head rows per rank x tp={group_size(group)} do not cover "
                         f"vocab_size={vocab_size}")
    loss_N = linear_cross_entropy_tokens(h.reshape(-1, h.shape[-1]), w_local, targets.reshape(-1),
                                         vocab_start=vocab_start, vocab_size=vocab_size,
                                         combine=_combine_over(group), chunk=chunk)
    return reduce_tokens(loss_N, targets, reduction)
