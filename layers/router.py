"""Routers: which expert each token copy goes to, with what weight, and the balance losses.

Legend: T tokens in one capacity group (one micro-batch), E experts, K experts per token,
B sequences, S tokens per sequence, N token copies (assignments), C capacity per expert.

Both routers return the same flat form, `Routing(token_N, expert_N, weight_N)`: assignment n reads
token `token_N[n]`, goes to expert `expert_N[n]` (or to `E`, meaning dropped, never sent), and is
combined with `weight_N[n]`. Top-k routing has N = T*K in token-major order; expert-choice routing
has N = E*C in expert-major order. Scores, softmax and losses are computed in float32 (float64 when
the input is float64), whatever the autocast dtype.
"""

import math
from fractions import Fraction
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RouterConfig", "Routing", "RouterLosses", "RoutingStats", "TopKRouter",
           "ExpertChoiceRouter", "build_router", "capacity", "expert_counts", "switch_balance_loss",
           "sequence_balance_loss", "z_loss"]

_ROUTER_TYPES = ("topk", "expert_choice")
_SCORE_FUNCS = ("softmax", "sigmoid")
_DROP_POLICIES = ("probs", "position")


@dataclass
class RouterConfig:
    """Router settings; the `[router]` section of a run config."""
    type: str = "topk"                 # "topk" (token choice) or "expert_choice"
    score_func: str = "softmax"        # "softmax" or "sigmoid"
    norm_topk_prob: bool = False       # renormalise the K chosen weights to sum to 1
    routed_scaling_factor: float = 1.0 # multiplies the combine weights (DeepSeek-V3)
    n_group: int = 1                   # expert groups for group-limited routing (DeepSeek-V3)
    topk_group: int = 1                # groups each token may pick experts from
    capacity_factor: float | None = None  # None: dropless; else C = ceil(T*K*cf/E) per group
    drop_policy: str = "probs"         # over capacity, keep highest "probs" or earliest "position"
    balance_coeff: float = 0.01        # Switch/GShard loss over the micro-batch
    seq_balance_coeff: float = 0.0     # the same loss per sequence, averaged (DeepSeek-V3)
    z_coeff: float = 0.0               # mean squared logsumexp of the router logits
    bias_update_rate: float = 0.0      # aux-loss-free balancing: bias += rate * sign(mean - load)

    def __post_init__(self):
        _check_choice("router.type", self.type, _ROUTER_TYPES)
        _check_choice("router.score_func", self.score_func, _SCORE_FUNCS)
        _check_choice("router.drop_policy", self.drop_policy, _DROP_POLICIES)
        if self.n_group < 1 or self.topk_group < 1 or self.topk_group > self.n_group:
            raise ValueError(f"router.topk_group={self.topk_group} must be in [1, router.n_group="
                             f"{self.n_group}] and router.n_group >= 1")
        if self.capacity_factor is not None and not (
                self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ValueError(f"router.capacity_factor={self.capacity_factor} must be a finite "
                             "number > 0, or none for dropless routing")
        if self.type == "expert_choice" and self.capacity_factor is None:
            raise ValueError("router.type='expert_choice' needs router.capacity_factor > 0 "
                             "(each expert picks C = ceil(T*K*cf/E) tokens)")
        for name in ("balance_coeff", "seq_balance_coeff", "z_coeff", "bias_update_rate"):
            check_number(f"router.{name}", getattr(self, name))
        check_number("router.routed_scaling_factor", self.routed_scaling_factor, strict=True)

    def check_experts(self, num_experts: int, top_k: int):
        """Checks that need the model's expert counts; raises naming both sides."""
        if num_experts % self.n_group:
            raise ValueError(f"model.num_experts={num_experts} must be divisible by "
                             f"router.n_group={self.n_group}")
        per_group = num_experts // self.n_group
        if self.n_group > 1 and top_k > self.topk_group * per_group:
            raise ValueError(f"model.top_k={top_k} exceeds the experts reachable in "
                             f"router.topk_group={self.topk_group} groups of {per_group}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model.top_k={top_k} must be in [1, model.num_experts={num_experts}]")


def check_number(name: str, value, low: float = 0.0, strict: bool = False):
    """Raises naming the field unless value is a finite number >= low (> low when strict)."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (
        value > low if strict else value >= low)
    if not ok:
        raise ValueError(f"{name}={value} must be a finite number {'>' if strict else '>='} {low}")


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class Routing:
    token_N: torch.Tensor   # int64, the token each assignment reads
    expert_N: torch.Tensor  # int64, its expert; num_experts marks a dropped assignment
    weight_N: torch.Tensor  # float32/64, combine weight; carries the router's gradient
    # Set by token-choice routing: then n = token * top_k + k (every token has top_k slots), which
    # lets the dispatcher combine by a gather and a K-way sum instead of a scatter-add.
    top_k: int | None = None


@dataclass(frozen=True)
class RouterLosses:
    total: torch.Tensor        # coefficient-weighted sum; the one that is back-propagated
    balance: torch.Tensor      # unweighted values, detached, for logging
    seq_balance: torch.Tensor
    z: torch.Tensor


@dataclass(frozen=True)
class RoutingStats:
    tokens_per_expert_E: torch.Tensor  # routed copies per expert before drops (float, detached)
    num_dropped: torch.Tensor          # dropped assignments (top-k) or unchosen tokens (expert choice)
    num_assignments: int               # T*K (top-k) or T (expert choice): drop fraction's denominator


def capacity(num_tokens: int, top_k: int, capacity_factor: float, num_experts: int) -> int:
    """Expert capacity for one group: ceil(tokens * k * capacity_factor / experts).

    Exact in decimal: 100 tokens at factor 1.1 over 10 experts is 11, not ceil(110.00000000000001).
    """
    factor = Fraction(repr(float(capacity_factor)))
    return math.ceil(Fraction(num_tokens * top_k) * factor / num_experts)


def expert_counts(experts, num_experts: int, per_row: bool = False):
    """Copies per expert (int64, [E]; [B, E] per row of dim 0 with `per_row`) by a scatter-add of
    static size: no host sync, unlike `torch.bincount`, which reads the largest id on the host
    (two syncs on CUDA). Integer adds commute, so the counts are exact whatever the order of the
    GPU's atomics (float counts would be too, below 2^24, but integers need no argument)."""
    ids_BN = experts.reshape(experts.shape[0] if per_row else 1, -1)
    counts_BE = torch.zeros(ids_BN.shape[0], num_experts, dtype=torch.long, device=ids_BN.device)
    counts_BE.scatter_add_(1, ids_BN, torch.ones_like(ids_BN))
    return counts_BE if per_row else counts_BE[0]


def switch_balance_loss(probs_TE, experts_TK, counts_E=None):
    """Switch/GShard loss E * sum_e f_e * P_e over the group; 1.0 when perfectly balanced.

    f_e = share of the T*K routed copies sent to e (before drops), P_e = mean probability of e.
    `counts_E` (copies per expert) is computed here unless the caller already has it.
    """
    num_tokens, num_experts = probs_TE.shape
    if counts_E is None:
        counts_E = expert_counts(experts_TK, num_experts)
    f_E = counts_E.to(probs_TE.dtype) / experts_TK.numel()
    return num_experts * torch.sum(f_E * probs_TE.mean(0))


def sequence_balance_loss(probs_BSE, experts_BSK):
    """The Switch loss computed within each sequence and averaged over sequences."""
    num_seqs, seq_len, num_experts = probs_BSE.shape
    counts_BE = expert_counts(experts_BSK, num_experts, per_row=True).to(probs_BSE.dtype)
    f_BE = counts_BE / experts_BSK[0].numel()
    return num_experts * torch.sum(f_BE * probs_BSE.mean(1), dim=1).mean()


def z_loss(logits_TE):
    """Mean over tokens of logsumexp(logits)^2 (ST-MoE): keeps router logits small."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def _logged_unless(coeff: float, loss_fn, *args):
    """loss_fn(*args), with autograd only when `coeff` makes it part of the trained total."""
    if coeff:
        return loss_fn(*args)
    with torch.no_grad():
        return loss_fn(*args)


class _RouterBase(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, cfg: RouterConfig):
        super().__init__()
        cfg.check_experts(num_experts, top_k)
        self.num_experts, self.top_k, self.cfg = num_experts, top_k, cfg
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight, std=0.02)

    def logits(self, x_TD):
        # Router maths never runs below float32: cast up, and keep autocast out of it.
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        with torch.autocast(x_TD.device.type, enabled=False):
            return F.linear(x_TD.to(dtype), self.weight.to(dtype))

    def scores(self, logits_TE):
        if self.cfg.score_func == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)


class TopKRouter(_RouterBase):
    """Token choice: each token picks its K best experts (optionally within its best groups).

    `expert_bias_E` (aux-loss-free balancing) shifts which experts are selected but never the
    weights; `update_bias` moves it by the sign rule from one step's load.
    """

    # The seam sequence (tensor) parallelism sets: this router then sees only a slice of every
    # sequence, and the group object (gather / local / total, see _group_losses) makes capacity
    # and the balance and z losses cover the whole micro-batch, as without the split.
    token_group = None

    def __init__(self, dim: int, num_experts: int, top_k: int, cfg: RouterConfig):
        super().__init__(dim, num_experts, top_k, cfg)
        self.register_buffer("expert_bias_E", torch.zeros(num_experts, dtype=torch.float32))

    def select(self, scores_TE):
        """Top-k expert ids per token, chosen on scores + bias within the best topk_group groups."""
        choice_TE = scores_TE + self.expert_bias_E.to(scores_TE.dtype)
        n_group = self.cfg.n_group
        if n_group > 1:
            num_tokens = choice_TE.shape[0]
            choice_TGe = choice_TE.view(num_tokens, n_group, -1)
            # DeepSeek-V3: a group's score is the sum of its two best experts.
            top2 = min(2, choice_TGe.shape[-1])
            group_scores_TG = choice_TGe.topk(top2, dim=-1).values.sum(-1)
            best_groups = group_scores_TG.topk(self.cfg.topk_group, dim=-1).indices
            keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_groups, True)
            choice_TE = choice_TGe.masked_fill(~keep_TG[..., None], float("-inf")).view(num_tokens, -1)
        return choice_TE.topk(self.top_k, dim=-1).indices

    def forward(self, x_TD, seq_len: int | None = None, defer_losses: bool = False):
        """Returns (Routing, RouterLosses, RoutingStats) for one capacity group of T tokens.

        With `defer_losses`: (Routing, finish), the routing the dispatch needs and a callable
        that returns (RouterLosses, RoutingStats). The MoE layer calls `finish` while the
        dispatch is in flight: nothing the dispatch reads waits for the balance and z losses,
        and `finish` reads only tensors this call made (no parameter: under FSDP they may be
        resharded by then). With a token group (sequence parallelism) the losses talk on the tp
        group, so they are computed here, before the dispatch's collectives.
        """
        routing, finish = self._route(x_TD, seq_len)
        return (routing, finish) if defer_losses else (routing, *finish())

    def _route(self, x_TD, seq_len: int | None = None):
        cfg, num_tokens = self.cfg, x_TD.shape[0]
        logits_TE = self.logits(x_TD)
        scores_TE = self.scores(logits_TE)
        experts_TK = self.select(scores_TE.detach())
        weights_TK = scores_TE.gather(1, experts_TK)
        if cfg.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * cfg.routed_scaling_factor
        seq_len = seq_len or num_tokens
        group = self.token_group

        expert_N = experts_TK.flatten()
        weight_N = weights_TK.flatten()
        if cfg.capacity_factor is not None:
            group_tokens = num_tokens * (group.size if group is not None else 1)
            cap = capacity(group_tokens, self.top_k, cfg.capacity_factor, self.num_experts)
            if group is None:
                keep_N = self._within_capacity(expert_N, weight_N.detach(), cap)
            else:
                keep_N = self._group_within_capacity(expert_N, weight_N.detach(), cap, seq_len, group)
            expert_N = torch.where(keep_N, expert_N, self.num_experts)
        token_N = torch.arange(num_tokens, device=x_TD.device).repeat_interleave(self.top_k)
        routing = Routing(token_N, expert_N, weight_N, self.top_k)

        def finish():
            return self._losses(logits_TE, scores_TE, experts_TK, expert_N, seq_len)

        if group is not None:
            done = finish()
            return routing, lambda: done
        return routing, finish

    def _losses(self, logits_TE, scores_TE, experts_TK, expert_N, seq_len: int):
        cfg, num_tokens, group = self.cfg, logits_TE.shape[0], self.token_group
        # Balance losses see a distribution over experts; sigmoid scores are normalised for them.
        probs_TE = scores_TE if cfg.score_func == "softmax" else scores_TE / (
            scores_TE.sum(-1, keepdim=True) + 1e-20)
        counts_E = expert_counts(experts_TK, self.num_experts)   # the loss's and the stats'
        if group is None:
            # A loss whose coefficient is zero is only logged: no graph, no backward through it.
            balance = _logged_unless(cfg.balance_coeff, switch_balance_loss, probs_TE,
                                     experts_TK, counts_E)
            if seq_len == num_tokens and not cfg.seq_balance_coeff:
                seq_balance = balance   # one sequence, only logged: the same loss
            else:
                seq_balance = _logged_unless(cfg.seq_balance_coeff, sequence_balance_loss,
                                             probs_TE.view(-1, seq_len, self.num_experts),
                                             experts_TK.view(-1, seq_len, self.top_k))
            z = _logged_unless(cfg.z_coeff, z_loss, logits_TE)
        else:
            balance, seq_balance, z = self._group_losses(probs_TE, experts_TK, logits_TE,
                                                         seq_len, group)
        terms = [c * loss for c, loss in ((cfg.balance_coeff, balance),
                                          (cfg.seq_balance_coeff, seq_balance),
                                          (cfg.z_coeff, z)) if c]
        total = sum(terms[1:], terms[0]) if terms else balance.detach() * 0.0
        losses = RouterLosses(total, balance.detach(), seq_balance.detach(), z.detach())
        stats = RoutingStats(counts_E.to(torch.float32), (expert_N == self.num_experts).sum(),
                             expert_N.numel())
        return losses, stats

    def _within_capacity(self, expert_N, weight_N, cap: int):
        """True for the assignments each expert keeps: its `cap` best by the drop policy."""
        num_assign = expert_N.numel()
        if self.cfg.drop_policy == "probs":
            # Rank by the weight on a 2^-20 grid, ties to the earlier token. Repeated text puts the
            # same token in the same context at different positions; RoPE makes their weights
            # equal up to rounding (seen: 3e-17 apart at the capacity boundary), and without the
            # grid any change of summation order (another layout, kernel or reduction) flips
            # which copy is dropped.
            priority_N = torch.argsort(torch.round(weight_N * 2.0 ** 20), descending=True, stable=True)
        else:  # position: earlier tokens first
            priority_N = torch.arange(num_assign, device=expert_N.device)
        expert_sorted, idx = torch.sort(expert_N[priority_N], stable=True)
        order_N = priority_N[idx]
        # Where each expert's run starts in the sorted ids: a binary search, no host sync.
        starts_E = torch.searchsorted(expert_sorted, torch.arange(
            self.num_experts, device=expert_N.device, dtype=expert_sorted.dtype))
        rank_N = torch.empty_like(expert_N)
        rank_N[order_N] = torch.arange(num_assign, device=expert_N.device) - starts_E[expert_sorted]
        return rank_N < cap

    def _group_within_capacity(self, expert_N, weight_N, cap: int, seq_len: int, group):
        """Drops decided on the whole micro-batch: every slice's (expert, weight) pairs are gathered
        into the canonical [B, S, K] order, ranked as one group, and this slice's verdicts kept."""
        batch = expert_N.numel() // (seq_len * self.top_k)
        pairs = torch.stack([expert_N.to(torch.float64), weight_N.to(torch.float64)], -1)
        full = group.gather(pairs.view(batch, seq_len, -1)).reshape(-1, 2)
        keep = self._within_capacity(full[:, 0].long(), full[:, 1].to(weight_N.dtype), cap)
        return group.local(keep.view(batch, -1, self.top_k)).reshape(-1)

    def _group_losses(self, probs_TE, experts_TK, logits_TE, seq_len: int, group):
        """The three losses of the whole micro-batch from this slice: the sums they are built from
        (expert counts, probability sums, per sequence too, and the z-loss sum) are totalled over
        the group in one call; `group.total` sums forward and passes gradients straight back, so
        each slice's tokens get exactly their share of the whole loss's gradient."""
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
        return balance, seq_balance, total[4][0] / n

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor):
        """Aux-loss-free balancing (DeepSeek-V3): raise under-loaded experts, lower over-loaded."""
        load_E = tokens_per_expert_E.to(self.expert_bias_E)
        self.expert_bias_E += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)


class ExpertChoiceRouter(_RouterBase):
    """Expert choice (Zhou et al. 2022): each expert picks its C best tokens by softmax score.

    Balanced by construction (every expert gets exactly C tokens); a token may get 0..E experts.
    C = ceil(T*K*cf/E), capped at T. `num_dropped` counts tokens no expert picked.
    """

    def forward(self, x_TD, seq_len: int | None = None, defer_losses: bool = False):
        """As `TopKRouter.forward`; deferred, the z-loss and the stats come from `finish`."""
        routing, finish = self._route(x_TD, seq_len)
        return (routing, finish) if defer_losses else (routing, *finish())

    def _route(self, x_TD, seq_len: int | None = None):
        num_tokens = x_TD.shape[0]
        logits_TE = self.logits(x_TD)
        scores_TE = torch.softmax(logits_TE, dim=-1)
        cap = min(num_tokens, capacity(num_tokens, self.top_k, self.cfg.capacity_factor,
                                       self.num_experts))
        weight_EC, token_EC = scores_TE.t().topk(cap, dim=-1)
        expert_N = torch.arange(self.num_experts, device=x_TD.device).repeat_interleave(cap)
        routing = Routing(token_EC.flatten(), expert_N, weight_EC.flatten())

        def finish():
            z = _logged_unless(self.cfg.z_coeff, z_loss, logits_TE)
            zero = z.new_zeros(())
            losses = RouterLosses(self.cfg.z_coeff * z if self.cfg.z_coeff else zero, zero, zero,
                                  z.detach())
            # index_fill_ takes the value as a scalar; `chosen_T[idx] = True` copies it from
            # the host.
            chosen_T = torch.zeros(num_tokens, dtype=torch.bool, device=x_TD.device).index_fill_(
                0, token_EC.flatten(), True)
            stats = RoutingStats(torch.full((self.num_experts,), float(cap), device=x_TD.device),
                                 (~chosen_T).sum(), num_tokens)
            return losses, stats

        return routing, finish


def build_router(dim: int, num_experts: int, top_k: int, cfg: RouterConfig) -> nn.Module:
    cls = TopKRouter if cfg.type == "topk" else ExpertChoiceRouter
    return cls(dim, num_experts, top_k, cfg)
