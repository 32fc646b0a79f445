"""Balance losses of MoE routers: the maths of each, and the holders through which the losses
that need counts from beyond one layer's call get their gradient after the forward.

Legend: T tokens of one micro-batch, E experts, K experts per token, B sequences, S tokens per
sequence, L MoE layers; c_le copies routed to expert e by layer l (top-k slots, before drops),
p_le the sum over the micro-batch's tokens of expert e's probability in layer l.

`router.balance_loss`, the definition (both are E * sum_e f_e * P_e, 1 when f and P are uniform
up to the K scaling):

| balance_loss | one micro-batch's loss                                  | as in                        |
|--------------|---------------------------------------------------------|------------------------------|
| per_layer    | sum_l E * sum_e (c_le / (T K)) * (p_le / T)             | Switch / GShard, per layer   |
| all_layers   | E * sum_e (sum_l c_le / (L T)) * (sum_l p_le / (L T))   | transformers' Mixtral, Qwen2 |
|              |   (f counted over top-k slots: it sums to K, not 1)     | and Qwen3-MoE, OLMoE         |

`router.balance_scope`, over which tokens the counts c (and T in f) are taken; P always stays
this rank's micro-batch:

| balance_scope | counts                                                                        |
|---------------|-------------------------------------------------------------------------------|
| micro_batch   | this micro-batch (every tp slice of it)                                       |
| global        | summed over the data-parallel ranks' micro-batches of the same index, and     |
|               | over the step's micro-batches up to this one (a running sum: later ones are   |
|               | not known when this one's backward runs), as Megatron-LM's global_aux_loss    |

per_layer at micro_batch scope is computed inside each router call (router.py). The others need
counts the layer cannot see when it runs, so their gradient is deferred: each MoE layer gets a
`BalanceSlot` of the micro-batch's `MicroBalance` holder, records its sums there, and injects
d(loss)/d(p_le) * scale in backward through autograd, reading `slot.coef_E`, which whoever runs
the micro-batch fills in after the forward with `BalanceStep` (a step runner, or
`Transformer.forward` alone). The coefficient does not depend on p (the counts carry no
gradient), so the loss is linear in p and coef_E is exact.
"""

from dataclasses import dataclass

import torch

__all__ = ["BALANCE_LOSSES", "BALANCE_SCOPES", "expert_counts", "switch_balance_loss",
           "sequence_balance_loss", "document_balance_loss", "document_sums", "document_loss",
           "document_loss_sum", "z_loss", "BalanceParts", "BalanceSlot", "MicroBalance", "BalanceStep"]

BALANCE_LOSSES = ("per_layer", "all_layers")
BALANCE_SCOPES = ("micro_batch", "global")


def expert_counts(experts, num_experts: int, per_row: bool = False, valid_T=None):
    """Copies per expert (int64, [E]; [B, E] per row of dim 0 with `per_row`) by a scatter-add of
    static size: no host sync, unlike `torch.bincount`, which reads the largest id on the host
    (two syncs on CUDA). Integer adds commute, so the counts are exact whatever the order of the
    GPU's atomics (float counts would be too, below 2^24, but integers need no argument).
    `valid_T` (bool per token, dim 0 of experts_TK): only those tokens' copies count (padding)."""
    ones = torch.ones_like(experts) if valid_T is None else \
        valid_T[:, None].expand_as(experts).long()
    ids_BN = experts.reshape(experts.shape[0] if per_row else 1, -1)
    counts_BE = torch.zeros(ids_BN.shape[0], num_experts, dtype=torch.long, device=ids_BN.device)
    counts_BE.scatter_add_(1, ids_BN, ones.reshape(ids_BN.shape))
    return counts_BE if per_row else counts_BE[0]


def switch_balance_loss(probs_TE, experts_TK, counts_E=None, valid_T=None):
    """Switch/GShard loss E * sum_e f_e * P_e over the group; 1.0 when perfectly balanced.

    f_e = share of the T*K routed copies sent to e (before drops), P_e = mean probability of e.
    `counts_E` (copies per expert) is computed here unless the caller already has it.
    `valid_T`: over those tokens only (padding left out); counts_E must be theirs too.
    """
    num_tokens, num_experts = probs_TE.shape
    if counts_E is None:
        counts_E = expert_counts(experts_TK, num_experts, valid_T=valid_T)
    if valid_T is not None:
        real = valid_T.sum().clamp_min(1).to(probs_TE.dtype)
        f_E = counts_E.to(probs_TE.dtype) / (real * experts_TK.shape[1])
        return num_experts * torch.sum(f_E * (probs_TE * valid_T[:, None]).sum(0) / real)
    f_E = counts_E.to(probs_TE.dtype) / experts_TK.numel()
    return num_experts * torch.sum(f_E * probs_TE.mean(0))


def sequence_balance_loss(probs_BSE, experts_BSK):
    """The Switch loss computed within each sequence and averaged over sequences."""
    num_seqs, seq_len, num_experts = probs_BSE.shape
    counts_BE = expert_counts(experts_BSK, num_experts, per_row=True).to(probs_BSE.dtype)
    f_BE = counts_BE / experts_BSK[0].numel()
    return num_experts * torch.sum(f_BE * probs_BSE.mean(1), dim=1).mean()


def document_balance_loss(probs_TE, experts_TK, doc_T, valid_T):
    """The Switch loss within each document of a packed micro-batch, averaged over documents
    (padding left out): sequence_balance_loss with documents for sequences. `doc_T`: each
    token's document number in [0, T) (layers/documents.py). Sums into [T, E] (T an upper bound
    on the documents), so no host sync."""
    sums = document_sums(probs_TE, experts_TK, doc_T, valid_T.to(probs_TE.dtype),
                         probs_TE.shape[0])
    return document_loss(*sums, experts_TK.shape[1])


def document_sums(probs_TE, experts_TK, doc_T, weight_T, num_docs: int):
    """(copies [D, E], probability sums [D, E], lengths [D]) of documents numbered below
    `num_docs`, over the tokens of weight 1 (padding: 0). Sums: a document's over several calls
    (tensor-parallel slices) add up."""
    num_experts, top_k = probs_TE.shape[1], experts_TK.shape[1]
    slot_N = (doc_T[:, None] * num_experts + experts_TK).reshape(-1)
    counts_DE = probs_TE.new_zeros(num_docs * num_experts).scatter_add_(
        0, slot_N, weight_T.repeat_interleave(top_k)).view(num_docs, num_experts)
    prob_sum_DE = probs_TE.new_zeros(num_docs, num_experts).index_add(
        0, doc_T, probs_TE * weight_T[:, None])
    return counts_DE, prob_sum_DE, weight_T.new_zeros(num_docs).index_add(0, doc_T, weight_T)


def document_loss(counts_DE, prob_sum_DE, len_D, top_k: int):
    """The mean over documents of length > 0 of E * sum_e f_de * P_de, from document_sums."""
    loss_sum, num_docs = document_loss_sum(counts_DE, prob_sum_DE, len_D, top_k)
    return loss_sum / num_docs.clamp_min(1)


def document_loss_sum(counts_DE, prob_sum_DE, len_D, top_k: int):
    """(the sum over documents of E * sum_e f_de * P_de, how many have length > 0), from
    document_sums: sums of disjoint sets of documents add up."""
    num_experts = counts_DE.shape[1]
    loss_D = num_experts * (counts_DE * prob_sum_DE).sum(1) / (top_k * len_D.square().clamp_min(1))
    return loss_D.sum(), (len_D > 0).sum().to(loss_D.dtype)


def z_loss(logits_TE, valid_T=None):
    """Mean over tokens (`valid_T`: those only) of logsumexp(logits)^2 (ST-MoE): keeps router
    logits small."""
    z_T = torch.logsumexp(logits_TE, dim=-1).square()
    if valid_T is None:
        return z_T.mean()
    return (z_T * valid_T).sum() / valid_T.sum().clamp_min(1)


@dataclass(frozen=True)
class BalanceParts:
    """One MoE layer's sums over one micro-batch (every tp slice of it): what the deferred
    balance losses are built from."""
    counts_E: torch.Tensor     # copies routed per expert (top-k slots, before drops)
    prob_sum_E: torch.Tensor   # sum over the tokens of each expert's probability
    num_tokens: int | torch.Tensor   # T (packed with padding: the real tokens, on the device)

    def detach(self) -> "BalanceParts":
        return BalanceParts(self.counts_E, self.prob_sum_E.detach(), self.num_tokens)


def _tokens(parts: BalanceParts) -> torch.Tensor:
    """T as a float64 scalar on the device (filled there: no host-to-device copy)."""
    if isinstance(parts.num_tokens, torch.Tensor):
        return parts.num_tokens.to(torch.float64)
    return parts.counts_E.new_full((), parts.num_tokens, dtype=torch.float64)


class BalanceSlot:
    """One MoE layer's call in one micro-batch: its sums (`parts`, set by its first forward; a
    recompute finds them set) and `coef_E`, d(trained balance loss)/d(parts.prob_sum_E) in
    float64, set once the counts it needs are known; the injection's backward reads it."""
    __slots__ = ("parts", "coef_E")

    def __init__(self):
        self.parts, self.coef_E = None, None


class MicroBalance:
    """The holder of one micro-batch's deferred balance loss: made by whoever runs the
    micro-batch, passed down the model; each MoE layer takes its slot by its model layer number
    (so a recomputed forward finds the same one). `value`, set by `BalanceStep`: the trained
    balance loss of the micro-batch, coefficient-weighted, detached, for logging."""

    def __init__(self):
        self.slots: dict[int, BalanceSlot] = {}
        self.value, self.coef_E = None, None

    def slot(self, layer_id: int) -> BalanceSlot:
        if layer_id not in self.slots:
            self.slots[layer_id] = BalanceSlot()
        return self.slots[layer_id]

    def set_coef(self, coef_E: torch.Tensor):
        """The same coefficient for every layer (all_layers: f and the P normaliser are shared)."""
        self.coef_E = coef_E
        for slot in self.slots.values():
            slot.coef_E = coef_E


class BalanceStep:
    """The deferred balance maths of one training step, on one rank.

    `reduce(t)`, given for the global scope when dp > 1: sums a float64 tensor over the
    data-parallel ranks in place (every dp rank calls it for the same micro-batches in the same
    order). Running sums (global scope) live here, one step long: make one per step.
    """

    def __init__(self, cfg, num_experts: int, top_k: int, reduce=None, device=None):
        self.coeff, self.num_experts, self.top_k = cfg.balance_coeff, num_experts, top_k
        self.device = device      # of the sums of a stage without MoE layers
        self.all_layers = cfg.balance_loss == "all_layers"
        self.global_scope = cfg.balance_scope == "global"
        self.reduce = reduce if self.global_scope else None
        self._running = {}   # key -> float64 [..., E+1]: counts and tokens of the step so far

    def _counted(self, key, counts_XE1: torch.Tensor) -> torch.Tensor:
        """[..., E+1] counts and tokens that f is taken over: this micro-batch's, or (global) its
        sum over the dp ranks added to the step's running sum. A new tensor each time: earlier
        micro-batches keep the coefficient they were given."""
        if not self.global_scope:
            return counts_XE1
        if self.reduce is not None:
            self.reduce(counts_XE1)
        before = self._running.get(key)
        self._running[key] = counts_XE1 if before is None else before + counts_XE1
        return self._running[key]

    def finish(self, holder: MicroBalance) -> torch.Tensor:
        """Fills the coefficients of a holder whose slots are every MoE layer this definition
        needs (the whole model, or, for per_layer, any subset); returns the weighted value."""
        if self.all_layers:
            return self.finish_all([holder], self.partial(holder))
        return self.finish_layers(holder)

    def finish_layers(self, holder: MicroBalance) -> torch.Tensor:
        """per_layer: each slot's coefficient from its own layer's counts."""
        items = [(layer_id, s) for layer_id, s in holder.slots.items()]
        if not items:
            holder.value = torch.zeros((), dtype=torch.float64, device=self.device)
            return holder.value
        parts = [s.parts for _, s in items]
        # (filled on the device: no host-to-device copy)
        tokens_L = torch.stack([_tokens(p) for p in parts])
        counts_LE1 = torch.cat([torch.stack([p.counts_E.to(torch.float64) for p in parts]),
                                tokens_L[:, None]], 1)
        counted = self._counted(tuple(layer_id for layer_id, _ in items), counts_LE1)
        f_LE = counted[:, :-1] / (counted[:, -1:] * self.top_k)
        coef_LE = (self.coeff * self.num_experts) * f_LE / tokens_L[:, None]
        for (_, slot), coef_E in zip(items, coef_LE, strict=True):
            slot.coef_E = coef_E
        prob_sum_LE = torch.stack([p.prob_sum_E.to(torch.float64) for p in parts])
        holder.value = torch.sum(coef_LE * prob_sum_LE)
        return holder.value

    def partial(self, holder: MicroBalance, incoming: torch.Tensor | None = None) -> torch.Tensor:
        """all_layers: float64 [2E+1], (sum c_le, sum p_le, sum T) over the holder's layers,
        added to `incoming` (the same sums over the layers before them: pipeline stages)."""
        total = incoming.clone() if incoming is not None else None
        for slot in holder.slots.values():
            p = slot.parts
            row = torch.cat([p.counts_E.to(torch.float64), p.prob_sum_E.to(torch.float64),
                             _tokens(p).reshape(1)])
            total = row if total is None else total + row
        if total is None:
            total = torch.zeros(2 * self.num_experts + 1, dtype=torch.float64, device=self.device)
        return total

    def finish_all(self, holders: list[MicroBalance], total: torch.Tensor) -> torch.Tensor:
        """all_layers: the coefficient from the micro-batch's sums over every MoE layer (`total`,
        from `partial`), given to every slot of `holders` (this rank's holders of the
        micro-batch); returns the weighted value (in holders[-1].value)."""
        E = self.num_experts
        counts_E, prob_sum_E, rows = total[:E], total[E:2 * E], total[2 * E:].clamp_min(1)
        counted = self._counted("all_layers", torch.cat([counts_E, total[2 * E:]]))
        f_E = counted[:E] / counted[E:].clamp_min(1)      # sums to K: HF's K-scaled fractions
        coef_E = (self.coeff * E) * f_E / rows
        for holder in holders:
            holder.set_coef(coef_E)
        holders[-1].value = torch.sum(coef_E * prob_sum_E)
        return holders[-1].value
