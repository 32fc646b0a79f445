"""The router under sequence parallelism: each tp rank routes its slice of every sequence, with
the capacity group and the balance and z losses of the whole micro-batch (as at tp = 1).

Talks on the `tp` group, through the token group (tensor.py `SequenceTokenGroup`) that
`apply_tp` gives each router.
Legend: B sequences, S sequence length, s = S/tp this rank's positions, E experts, K experts per
token, T = B*s tokens of this slice.

| step                       | forward                                 | backward                   |
|----------------------------|-----------------------------------------|----------------------------|
| capacity (when set)        | all-gather of (expert, weight) pairs    | - (decisions, no gradient) |
| losses                     | one all-reduce of their sums            | none (identity: each slice |
|                            |                                         | gets its tokens' share)    |

Packed documents (layers/documents.py): the model hands every router the whole micro-batch's
`valid_T` and `doc_T` ([B*S], as attention needs the whole mask); the router takes its slice's.
Padding is gathered with the capacity pairs, as weight -1 (it ranks after every real copy and
is kept by no expert), and the losses are sums over real tokens. The sequence balance loss is
per document: a document inside the slice is finished here (its loss summed, counted), and
only the documents cut by slice edges (at most B*(tp-1): one per edge and row) send their sums
(copies and probabilities per expert, length) in the same all-reduce: B*(tp-1)*(2E+1) + 2 more
elements.

`apply_tp` swaps a `TopKRouter`'s class for `SequenceParallelRouter` (`use_token_group`), so the
choice is made once, at build time; forward never asks whether a group is set.
"""

import torch

from moepar.layers.balance import BalanceParts, document_loss_sum, document_sums, expert_counts
from moepar.layers.router import TopKRouter, capacity

__all__ = ["SequenceParallelRouter", "use_token_group"]


class SequenceParallelRouter(TopKRouter):
    """A TopKRouter that routes one slice of the micro-batch; `token_group` (gather / local /
    total, duck-typed: tests pass a one-slice stand-in) makes capacity and losses the whole
    micro-batch's."""

    token_group = None

    def forward(self, x_TD, seq_len: int | None = None, valid_T=None, doc_T=None, **kwargs):
        """TopKRouter.forward on this slice's B*s tokens; `valid_T` and `doc_T` (packed
        documents) are the whole micro-batch's [B*S], of which this slice's are taken."""
        if valid_T is not None:
            batch = valid_T.numel() // (seq_len * self.token_group.size)
            valid_T = self.token_group.local(valid_T.view(batch, -1)).reshape(-1)
            doc_T = self._slice_documents(doc_T.view(batch, -1), seq_len)
        return super().forward(x_TD, seq_len, valid_T, doc_T, **kwargs)

    def _slice_documents(self, doc_BS, seq_len: int):
        """This slice's document numbers, local: a document inside the slice gets row b's
        b*s + its count from the slice's start (below B*s); one cut by a slice edge gets B*s +
        b*(tp-1) + the first edge it spans (edge j: between slices j and j+1), the same number
        on every slice it reaches. No host sync."""
        group, (batch, _) = self.token_group, doc_BS.shape
        edges_J = torch.arange(1, group.size, device=doc_BS.device) * seq_len
        # doc_T >= 0 everywhere (padding too), so -1 marks an edge no document spans.
        cut_BJ = torch.where(doc_BS[:, edges_J - 1] == doc_BS[:, edges_J], doc_BS[:, edges_J], -1)
        local_Bs = group.local(doc_BS)
        spans_BsJ = local_Bs[..., None] == cut_BJ[:, None, :]
        first_Bs = (~spans_BsJ).long().cumprod(-1).sum(-1)   # edges before the first it spans
        rows_B1 = torch.arange(batch, device=doc_BS.device)[:, None]
        inner_Bs = rows_B1 * seq_len + local_Bs - local_Bs[:, :1]
        cut_Bs = batch * seq_len + rows_B1 * (group.size - 1) + first_Bs
        return torch.where(spans_BsJ.any(-1), cut_Bs, inner_Bs).reshape(-1)

    def _keep(self, expert_N, weight_N, seq_len: int, valid_N=None):
        """Drops decided on the whole micro-batch: every slice's (expert, weight) pairs are
        gathered into the canonical [B, S, K] order, ranked as one group, and this slice's
        verdicts kept."""
        group, k = self.token_group, self.top_k
        cap = capacity(expert_N.numel() // k * group.size, k, self.cfg.capacity_factor,
                       self.num_experts)
        batch = expert_N.numel() // (seq_len * k)
        if valid_N is not None:   # weights are >= 0: padding travels as weight -1
            weight_N = weight_N.where(valid_N, -1.0)
        pairs = torch.stack([expert_N.to(torch.float64), weight_N.to(torch.float64)], -1)
        full = group.gather(pairs.view(batch, seq_len, -1)).reshape(-1, 2)
        keep = self._within_capacity(full[:, 0].long(), full[:, 1].to(weight_N.dtype), cap,
                                     None if valid_N is None else full[:, 1] >= 0)
        return group.local(keep.view(batch, -1, k)).reshape(-1)

    def _loss_values(self, probs_TE, experts_TK, logits_TE, counts_E, seq_len: int):
        """The losses of the whole micro-batch from this slice: the sums they are built from
        (expert counts, probability sums, per sequence too, and the z-loss sum) are totalled over
        the group in one call; `group.total` sums forward and passes gradients straight back, so
        each slice's tokens get exactly their share of the whole loss's gradient."""
        group = self.token_group
        num_tokens, num_experts = probs_TE.shape
        batch, k = num_tokens // seq_len, self.top_k
        counts_BE = expert_counts(experts_TK.reshape(batch, -1), num_experts,
                                  per_row=True).to(probs_TE.dtype)
        parts = [counts_BE.sum(0), probs_TE.sum(0), counts_BE.flatten(),
                 probs_TE.view(batch, seq_len, num_experts).sum(1).flatten(),
                 torch.logsumexp(logits_TE, dim=-1).square().sum().reshape(1).to(probs_TE.dtype)]
        total = group.total(torch.cat(parts)).split([p.numel() for p in parts])
        n, full_seq = num_tokens * group.size, seq_len * group.size
        balance = num_experts * torch.sum(total[0] / (n * k) * (total[1] / n))
        f_BE = total[2].view(batch, num_experts) / (full_seq * k)
        p_BE = total[3].view(batch, num_experts) / full_seq
        seq_balance = num_experts * torch.sum(f_BE * p_BE, dim=1).mean()
        deferred = BalanceParts(total[0].detach().to(torch.float64), total[1], n) \
            if self.deferred_balance else None
        return balance, seq_balance, total[4][0] / n, deferred

    def _packed_loss_values(self, probs_TE, experts_TK, logits_TE, counts_E, seq_len: int,
                            valid_T, doc_T):
        """_loss_values of packed documents over the whole micro-batch: real tokens only; the
        sequence loss per document, the documents inside this slice finished here, the ones cut
        by its edges (`_slice_documents`) from their sums totalled over the slices."""
        group = self.token_group
        num_tokens, num_experts = probs_TE.shape
        k, weight_T = self.top_k, valid_T.to(probs_TE.dtype)
        cut_T = doc_T >= num_tokens
        inner = document_loss_sum(*document_sums(probs_TE, experts_TK, doc_T.where(~cut_T, 0),
                                                 weight_T * ~cut_T, num_tokens), k)
        num_cut = num_tokens // seq_len * (group.size - 1)
        cut_DE, cut_prob_DE, cut_len_D = document_sums(
            probs_TE, experts_TK, (doc_T - num_tokens).where(cut_T, 0), weight_T * cut_T, num_cut)
        z_T = torch.logsumexp(logits_TE, dim=-1).square()
        parts = [counts_E.to(probs_TE.dtype), (probs_TE * weight_T[:, None]).sum(0),
                 cut_DE.flatten(), cut_prob_DE.flatten(), cut_len_D,
                 torch.stack([(z_T * weight_T).sum().to(probs_TE.dtype), weight_T.sum(), *inner])]
        total = group.total(torch.cat(parts)).split([p.numel() for p in parts])
        z_sum, real, inner_sum, inner_docs = total[5]
        real = real.clamp_min(1)
        balance = num_experts * torch.sum(total[0] / (real * k) * (total[1] / real))
        cut_sum, cut_docs = document_loss_sum(total[2].view(-1, num_experts),
                                              total[3].view(-1, num_experts), total[4], k)
        seq_balance = (inner_sum + cut_sum) / (inner_docs + cut_docs).clamp_min(1)
        deferred = BalanceParts(total[0].detach().to(torch.float64), total[1],
                                total[5][1].detach()) if self.deferred_balance else None
        return balance, seq_balance, z_sum / real, deferred


def use_token_group(router: TopKRouter, token_group) -> TopKRouter:
    """Makes `router` route slices of `token_group` (a class swap: the module, its parameters
    and buffers stay); returns it."""
    if not isinstance(router, TopKRouter):
        raise ValueError("router.type='expert_choice' with parallel.tp > 1 is not supported "
                         "(each expert would need every slice's scores); use router.type='topk'")
    router.__class__ = SequenceParallelRouter
    router.token_group = token_group
    return router
