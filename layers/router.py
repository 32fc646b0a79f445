"""Routers: which expert each token copy goes to, with what weight, and the balance losses.

Legend: T tokens in one capacity group (one micro-batch), E experts, K experts per token,
B sequences, S tokens per sequence, N token copies (assignments), C capacity per expert.

Both routers return the same flat form, `Routing(token_N, expert_N, weight_N)`: assignment n reads
token `token_N[n]`, goes to expert `expert_N[n]` (or to `E`, meaning dropped, never sent), and is
combined with `weight_N[n]`. Top-k routing has N = T*K in token-major order; expert-choice routing
has N = E*C in expert-major order. Scores, softmax and losses are computed in float32 (float64 when
the input is float64), whatever the autocast dtype. The loss maths lives in balance.py.

Code paths are fixed when the router is built: this file's `TopKRouter` routes a whole micro-batch;
under sequence parallelism `moepar.parallel.sequence_router` swaps in a subclass that routes one
tp slice with the capacity and losses of the whole micro-batch; whether the balance loss is this
call's or deferred to the micro-batch's holder (balance.py) follows the config, read once.
"""

import math
from fractions import Fraction
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .balance import (BALANCE_LOSSES, BALANCE_SCOPES, BalanceParts, document_balance_loss,
                      expert_counts, sequence_balance_loss, switch_balance_loss, z_loss)

__all__ = ["RouterConfig", "Routing", "RouterLosses", "RoutingStats", "RouterOutput", "TopKRouter",
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
    balance_coeff: float = 0.01        # weight of the balance loss defined by the next two
    balance_loss: str = "per_layer"    # "per_layer": Switch/GShard loss of each MoE layer, summed;
                                       # "all_layers": one loss over all MoE layers' counts
                                       # (transformers' Mixtral, Qwen2/3-MoE, OLMoE); balance.py
    balance_scope: str = "micro_batch" # counts of the "micro_batch", or "global": summed over dp
                                       # ranks and the step's micro-batches so far (Qwen3, Megatron)
    seq_balance_coeff: float = 0.0     # the same loss per sequence, averaged (DeepSeek-V3)
    z_coeff: float = 0.0               # mean squared logsumexp of the router logits
    bias_update_rate: float = 0.0      # aux-loss-free balancing: bias += rate * sign(mean - load)

    def __post_init__(self):
        _check_choice("router.type", self.type, _ROUTER_TYPES)
        _check_choice("router.score_func", self.score_func, _SCORE_FUNCS)
        _check_choice("router.drop_policy", self.drop_policy, _DROP_POLICIES)
        _check_choice("router.balance_loss", self.balance_loss, BALANCE_LOSSES)
        _check_choice("router.balance_scope", self.balance_scope, BALANCE_SCOPES)
        if self.type == "expert_choice" and (self.balance_loss, self.balance_scope) != (
                "per_layer", "micro_batch"):
            raise ValueError(f"router.balance_loss={self.balance_loss!r} and router.balance_scope="
                             f"{self.balance_scope!r} need router.type='topk': expert-choice "
                             "routing is balanced by construction and has no balance loss")
        if self.n_group > 1 << 16:
            raise ValueError(f"router.n_group={self.n_group} exceeds {1 << 16:,}, more than any "
                             "model has experts")
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

    @property
    def deferred_balance(self) -> bool:
        """True when the balance loss needs counts beyond one router call (all_layers, or the
        global scope): its gradient then comes through the micro-batch's holder (balance.py)."""
        return self.balance_coeff > 0 and (self.balance_loss, self.balance_scope) != (
            "per_layer", "micro_batch")

    def check_experts(self, num_experts: int, top_k: int):
        """Checks that need the model's expert counts; raises naming both sides."""
        if num_experts == 0:        # a dense model (model.num_experts = 0) builds no router
            return
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
    # True when no assignment can be dropped (dropless top-k, expert choice): then all N are
    # kept, a number the host knows without reading the device (no sync on one rank).
    dropless: bool = False
    # Top-k routing: each copy's expert before capacity drops (what a routing record keeps).
    choice_N: torch.Tensor | None = None


@dataclass(frozen=True)
class RouterLosses:
    total: torch.Tensor        # coefficient-weighted sum; the one that is back-propagated
    balance: torch.Tensor      # unweighted values, detached, for logging
    seq_balance: torch.Tensor
    z: torch.Tensor
    # With a deferred balance loss (RouterConfig.deferred_balance): the layer's sums it is built
    # from; `total` then leaves the balance term out. prob_sum_E carries gradient from the router.
    parts: BalanceParts | None = None


@dataclass(frozen=True)
class RoutingStats:
    tokens_per_expert_E: torch.Tensor  # routed copies per expert before drops (float, detached)
    num_dropped: torch.Tensor          # dropped assignments (top-k) or unchosen tokens (expert choice)
    num_assignments: int               # T*K (top-k) or T (expert choice): drop fraction's denominator
    # Sum over the T tokens of the entropy (nats) of each token's distribution over experts.
    entropy_sum: torch.Tensor | None = None
    num_tokens: int = 0


def entropy_sum(probs_TE, valid_T=None) -> torch.Tensor:
    """Sum over tokens of -sum_e p log p (detached; 0 log 0 = 0): the router-entropy view.
    `valid_T` (packed with padding): the real tokens' only, masked without a host sync."""
    with torch.no_grad():
        entropy_T = -torch.special.xlogy(probs_TE, probs_TE).sum(-1)
        return entropy_T.sum() if valid_T is None else (entropy_T * valid_T).sum()


class RouterOutput(NamedTuple):
    """What every router returns: the routing the dispatcher needs, the losses (`total` carries
    gradient) and the detached load statistics of the call."""
    routing: Routing
    losses: RouterLosses
    stats: RoutingStats


def capacity(num_tokens: int, top_k: int, capacity_factor: float, num_experts: int) -> int:
    """Expert capacity for one group: ceil(tokens * k * capacity_factor / experts).

    Exact in decimal: 100 tokens at factor 1.1 over 10 experts is 11, not ceil(110.00000000000001).
    Host numbers only: a compiled router (parallel/compile.py, static shapes) takes the result
    as a constant of its graph instead of tracing the Fraction arithmetic (compile.py marks this
    function so; marking it here would import torch's compiler into every process at start).
    """
    factor = Fraction(repr(float(capacity_factor)))
    return math.ceil(Fraction(num_tokens * top_k) * factor / num_experts)


def _logged_unless(coeff: float, loss_fn, *args):
    """loss_fn(*args), with autograd only when `coeff` makes it part of the trained total."""
    if coeff:
        return loss_fn(*args)
    with torch.no_grad():
        return loss_fn(*args)


class RouterBase(nn.Module):
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


class TopKRouter(RouterBase):
    """Token choice: each token picks its K best experts (optionally within its best groups).

    `expert_bias_E` (aux-loss-free balancing) shifts which experts are selected but never the
    weights; `update_bias` moves it by the sign rule from one step's load.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, cfg: RouterConfig):
        super().__init__(dim, num_experts, top_k, cfg)
        self.register_buffer("expert_bias_E", torch.zeros(num_experts, dtype=torch.float32))
        # Read once: the balance loss is this call's (trained here, with its coefficient) or
        # deferred to the micro-batch's holder (then only logged here, and `parts` returned).
        self.deferred_balance = cfg.deferred_balance
        self.call_balance_coeff = 0.0 if self.deferred_balance else cfg.balance_coeff

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

    def forward(self, x_TD, seq_len: int | None = None, valid_T=None, doc_T=None,
                replay_TK: torch.Tensor | None = None) -> "RouterOutput":
        """(Routing, RouterLosses, RoutingStats) for one capacity group of T tokens. Packed
        documents (layers/documents.py): `valid_T` marks real tokens (padding takes no expert
        slot, is never sent and counts in no statistic or loss), `doc_T` each token's document
        (the sequence balance loss per document).

        `replay_TK` (routing replay, layers/replay.py): the experts to use instead of selecting
        and dropping, id E + e for a copy of expert e that capacity dropped; the combine weights
        are still the scores at those experts, so the router gets its gradient. (Replay with
        packed documents is refused by the config.)"""
        cfg, num_tokens = self.cfg, x_TD.shape[0]
        logits_TE = self.logits(x_TD)
        scores_TE = self.scores(logits_TE)
        if replay_TK is not None:
            return self._replayed(logits_TE, scores_TE, replay_TK, seq_len or num_tokens)
        experts_TK = self.select(scores_TE.detach())
        weights_TK = self._weights(scores_TE, experts_TK)
        seq_len = seq_len or num_tokens

        expert_N = experts_TK.flatten()
        weight_N = weights_TK.flatten()
        valid_N = None if valid_T is None else valid_T.repeat_interleave(self.top_k)
        if cfg.capacity_factor is not None:
            packed = () if valid_N is None else (valid_N,)
            keep_N = self._keep(expert_N, weight_N.detach(), seq_len, *packed)
            expert_N = torch.where(keep_N, expert_N, self.num_experts)
        elif valid_N is not None:
            expert_N = torch.where(valid_N, expert_N, self.num_experts)   # padding: not sent
        token_N = torch.arange(num_tokens, device=x_TD.device).repeat_interleave(self.top_k)
        routing = Routing(token_N, expert_N, weight_N, self.top_k,
                          cfg.capacity_factor is None and valid_T is None, experts_TK.flatten())
        return RouterOutput(routing, *self._losses(logits_TE, scores_TE, experts_TK, expert_N,
                                                   seq_len, valid_T, doc_T))

    def _weights(self, scores_TE, experts_TK):
        """Combine weights: the scores at the chosen experts, normalised and scaled by config."""
        cfg = self.cfg
        weights_TK = scores_TE.gather(1, experts_TK)
        if cfg.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * cfg.routed_scaling_factor
        return weights_TK

    def _replayed(self, logits_TE, scores_TE, replay_TK, seq_len: int):
        """The routing of replayed experts: no selection and no capacity; the recorded drops
        (id E + e) stay dropped, and their expert e still counts in the balance losses and in
        norm_topk_prob's sum, as in the recorded run."""
        num_tokens, num_experts = scores_TE.shape
        if tuple(replay_TK.shape) != (num_tokens, self.top_k):
            raise ValueError(f"routing replay gives experts of shape {tuple(replay_TK.shape)} "
                             f"for {num_tokens} tokens of top-{self.top_k} routing")
        replay_TK = replay_TK.to(device=scores_TE.device, dtype=torch.long)
        experts_TK = replay_TK % num_experts                 # the choice before drops
        weights_TK = self._weights(scores_TE, experts_TK)
        expert_N = torch.where(replay_TK < num_experts, replay_TK, num_experts).flatten()
        token_N = torch.arange(num_tokens, device=scores_TE.device).repeat_interleave(self.top_k)
        # dropless=False: a replayed copy may be a recorded drop, which the host cannot know.
        routing = Routing(token_N, expert_N, weights_TK.flatten(), self.top_k, False,
                          experts_TK.flatten())
        return RouterOutput(routing, *self._losses(logits_TE, scores_TE, experts_TK, expert_N,
                                                   seq_len))

    def _keep(self, expert_N, weight_N, seq_len: int, valid_N=None):
        """Capacity: True for the assignments kept (the group is this call's tokens; padding's
        positions count in the capacity, but padding is kept by no expert)."""
        cap = capacity(expert_N.numel() // self.top_k, self.top_k, self.cfg.capacity_factor,
                       self.num_experts)
        return self._within_capacity(expert_N, weight_N, cap, valid_N)

    def balance_probs(self, scores_TE):
        """The distribution over experts the balance losses see: sigmoid scores normalised."""
        if self.cfg.score_func == "softmax":
            return scores_TE
        return scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)

    def _losses(self, logits_TE, scores_TE, experts_TK, expert_N, seq_len: int, valid_T=None,
                doc_T=None):
        cfg = self.cfg
        probs_TE = self.balance_probs(scores_TE)
        # the loss's and the stats' (real tokens only, when packed with padding)
        counts_E = expert_counts(experts_TK, self.num_experts, valid_T=valid_T)
        if valid_T is not None:
            balance, seq_balance, z, parts = self._packed_loss_values(
                probs_TE, experts_TK, logits_TE, counts_E, seq_len, valid_T, doc_T)
            dropped = ((expert_N == self.num_experts) & valid_T.repeat_interleave(self.top_k))
            assignments = valid_T.sum() * self.top_k
        else:
            balance, seq_balance, z, parts = self._loss_values(probs_TE, experts_TK, logits_TE,
                                                               counts_E, seq_len)
            dropped, assignments = expert_N == self.num_experts, expert_N.numel()
        terms = [c * loss for c, loss in ((self.call_balance_coeff, balance),
                                          (cfg.seq_balance_coeff, seq_balance),
                                          (cfg.z_coeff, z)) if c]
        total = sum(terms[1:], terms[0]) if terms else balance.detach() * 0.0
        losses = RouterLosses(total, balance.detach(), seq_balance.detach(), z.detach(), parts)
        stats = RoutingStats(counts_E.to(torch.float32), dropped.sum(), assignments,
                             entropy_sum(probs_TE, valid_T),
                             probs_TE.shape[0] if valid_T is None else valid_T.sum())
        return losses, stats

    def _loss_values(self, probs_TE, experts_TK, logits_TE, counts_E, seq_len: int):
        """(balance, sequence balance, z, deferred parts or None) of this call's tokens."""
        cfg, num_tokens = self.cfg, probs_TE.shape[0]
        # A loss whose coefficient is zero is only logged: no graph, no backward through it.
        balance = _logged_unless(self.call_balance_coeff, switch_balance_loss, probs_TE,
                                 experts_TK, counts_E)
        if seq_len == num_tokens and not cfg.seq_balance_coeff:
            seq_balance = balance   # one sequence, only logged: the same loss
        else:
            seq_balance = _logged_unless(cfg.seq_balance_coeff, sequence_balance_loss,
                                         probs_TE.view(-1, seq_len, self.num_experts),
                                         experts_TK.view(-1, seq_len, self.top_k))
        z = _logged_unless(cfg.z_coeff, z_loss, logits_TE)
        parts = BalanceParts(counts_E.to(torch.float64), probs_TE.sum(0), num_tokens) \
            if self.deferred_balance else None
        return balance, seq_balance, z, parts

    def _packed_loss_values(self, probs_TE, experts_TK, logits_TE, counts_E, seq_len: int,
                            valid_T, doc_T):
        """_loss_values of packed documents: over real tokens, the sequence loss per document."""
        cfg = self.cfg
        balance = _logged_unless(self.call_balance_coeff, switch_balance_loss, probs_TE,
                                 experts_TK, counts_E, valid_T)
        seq_balance = _logged_unless(cfg.seq_balance_coeff, document_balance_loss, probs_TE,
                                     experts_TK, doc_T, valid_T)
        z = _logged_unless(cfg.z_coeff, z_loss, logits_TE, valid_T)
        parts = BalanceParts(counts_E.to(torch.float64), (probs_TE * valid_T[:, None]).sum(0),
                             valid_T.sum()) if self.deferred_balance else None
        return balance, seq_balance, z, parts

    def _within_capacity(self, expert_N, weight_N, cap: int, valid_N=None):
        """True for the assignments each expert keeps: its `cap` best by the drop policy;
        never padding (`valid_N` False: ranked after every real assignment)."""
        num_assign = expert_N.numel()
        if self.cfg.drop_policy == "probs":
            # Rank by the weight on a 2^-20 grid, ties to the earlier token. Repeated text puts the
            # same token in the same context at different positions; RoPE makes their weights
            # equal up to rounding (seen: 3e-17 apart at the capacity boundary), and without the
            # grid any change of summation order (another layout, kernel or reduction) flips
            # which copy is dropped.
            grid_N = torch.round(weight_N * 2.0 ** 20)
            if valid_N is not None:      # weights are >= 0: padding ranks last
                grid_N = grid_N.where(valid_N, -1.0)
            priority_N = torch.argsort(grid_N, descending=True, stable=True)
        elif valid_N is not None:   # position: earlier real tokens first, then padding
            priority_N = torch.argsort((~valid_N).to(torch.uint8), stable=True)
        else:  # position: earlier tokens first
            priority_N = torch.arange(num_assign, device=expert_N.device)
        expert_sorted, idx = torch.sort(expert_N[priority_N], stable=True)
        order_N = priority_N[idx]
        # Where each expert's run starts in the sorted ids: a binary search, no host sync.
        starts_E = torch.searchsorted(expert_sorted, torch.arange(
            self.num_experts, device=expert_N.device, dtype=expert_sorted.dtype))
        rank_N = torch.empty_like(expert_N)
        rank_N[order_N] = torch.arange(num_assign, device=expert_N.device) - starts_E[expert_sorted]
        return rank_N < cap if valid_N is None else (rank_N < cap) & valid_N

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor):
        """Aux-loss-free balancing (DeepSeek-V3): raise under-loaded experts, lower over-loaded."""
        load_E = tokens_per_expert_E.to(self.expert_bias_E)
        self.expert_bias_E += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)


class ExpertChoiceRouter(RouterBase):
    """Expert choice (Zhou et al. 2022): each expert picks its C best tokens by softmax score.

    Balanced by construction (every expert gets exactly C tokens); a token may get 0..E experts.
    C = ceil(T*K*cf/E), capped at T. `num_dropped` counts tokens no expert picked.
    """

    def forward(self, x_TD, seq_len: int | None = None) -> "RouterOutput":
        """As `TopKRouter.forward`; the balance losses are zero (balanced by construction)."""
        num_tokens = x_TD.shape[0]
        logits_TE = self.logits(x_TD)
        scores_TE = torch.softmax(logits_TE, dim=-1)
        cap = min(num_tokens, capacity(num_tokens, self.top_k, self.cfg.capacity_factor,
                                       self.num_experts))
        weight_EC, token_EC = scores_TE.t().topk(cap, dim=-1)
        expert_N = torch.arange(self.num_experts, device=x_TD.device).repeat_interleave(cap)
        routing = Routing(token_EC.flatten(), expert_N, weight_EC.flatten(), dropless=True)
        z = _logged_unless(self.cfg.z_coeff, z_loss, logits_TE)
        zero = z.new_zeros(())
        losses = RouterLosses(self.cfg.z_coeff * z if self.cfg.z_coeff else zero, zero, zero,
                              z.detach())
        # index_fill_ takes the value as a scalar; `chosen_T[idx] = True` copies it from the host.
        chosen_T = torch.zeros(num_tokens, dtype=torch.bool, device=x_TD.device).index_fill_(
            0, token_EC.flatten(), True)
        stats = RoutingStats(torch.full((self.num_experts,), float(cap), device=x_TD.device),
                             (~chosen_T).sum(), num_tokens, entropy_sum(scores_TE), num_tokens)
        return RouterOutput(routing, losses, stats)


def build_router(dim: int, num_experts: int, top_k: int, cfg: RouterConfig) -> nn.Module:
    cls = TopKRouter if cfg.type == "topk" else ExpertChoiceRouter
    return cls(dim, num_experts, top_k, cfg)
