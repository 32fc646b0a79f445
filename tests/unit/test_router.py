"""Router maths against hand-computed values and naive Python-loop references.

Legend: T tokens, E experts, K experts per token, B sequences, S tokens per sequence, C capacity.
Most tests use dim == E and an identity router weight, so the logits are exactly the input rows.
    python -m pytest tests/unit/test_router.py -q
"""

import math

import pytest
import torch

from moepar.layers.router import (ExpertChoiceRouter, RouterConfig, TopKRouter, build_router,
                                  capacity, sequence_balance_loss, switch_balance_loss, z_loss)
from moepar.parallel.sequence_router import use_token_group


# ---- helpers -------------------------------------------------------------------------------

def make_router(num_experts, top_k, weight_ED=None, cls=TopKRouter, dtype=torch.float32, **cfg):
    """A router whose weight is `weight_ED` (identity when None: logits == input)."""
    if weight_ED is None:
        weight_ED = torch.eye(num_experts)
    router = cls(weight_ED.shape[1], num_experts, top_k, RouterConfig(**cfg)).to(dtype)
    with torch.no_grad():
        router.weight.copy_(weight_ED)
    return router


def logit(p):
    """Inverse sigmoid, so a sigmoid router sees the score `p` exactly (up to rounding)."""
    return math.log(p / (1 - p))


def naive_softmax(row):
    m = max(row)
    exps = [math.exp(v - m) for v in row]
    return [e / sum(exps) for e in exps]


def naive_sigmoid(row):
    return [1 / (1 + math.exp(-v)) for v in row]


def naive_topk(row, k):
    """Indices of the k largest values (ties by lower index; tests avoid ties)."""
    return sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]


def per_token(routing, num_tokens):
    """{token: {expert: weight}} from a Routing, ignoring order within a token."""
    out = {t: {} for t in range(num_tokens)}
    for t, e, w in zip(routing.token_N.tolist(), routing.expert_N.tolist(),
                       routing.weight_N.tolist()):
        out[t][e] = w
    return out


def assert_routes(routing, expected, num_tokens):
    """expected: {token: {expert: weight}}; compares ids exactly and weights to 1e-6."""
    got = per_token(routing, num_tokens)
    for t in range(num_tokens):
        assert set(got[t]) == set(expected[t]), f"token {t}: {got[t]} vs {expected[t]}"
        for e, w in expected[t].items():
            assert got[t][e] == pytest.approx(w, rel=1e-6, abs=1e-7), f"token {t} expert {e}"


def naive_switch_loss(probs, experts, num_experts):
    """E * sum_e f_e * P_e with plain loops; probs: list of rows, experts: list of id lists."""
    copies = sum(len(ids) for ids in experts)
    total = 0.0
    for e in range(num_experts):
        f = sum(ids.count(e) for ids in experts) / copies
        p = sum(row[e] for row in probs) / len(probs)
        total += f * p
    return num_experts * total


def naive_keep(assignments, num_experts, cap, policy):
    """assignments: list of (expert, weight) in token-major order -> list of kept flags."""
    order = list(range(len(assignments)))
    if policy == "probs":
        order.sort(key=lambda n: (-assignments[n][1], n))
    used = [0] * num_experts
    keep = [False] * len(assignments)
    for n in order:
        e = assignments[n][0]
        if used[e] < cap:
            used[e] += 1
            keep[n] = True
    return keep


# ---- scores, selection, weights ------------------------------------------------------------

def test_logits_match_naive_matmul():
    torch.manual_seed(0)
    w_ED, x_TD = torch.randn(3, 5), torch.randn(4, 5)
    router = make_router(3, 1, w_ED)
    got = router.logits(x_TD)
    for t in range(4):
        for e in range(3):
            want = sum(x_TD[t, d].item() * w_ED[e, d].item() for d in range(5))
            assert got[t, e].item() == pytest.approx(want, abs=1e-5)


def test_softmax_topk_weights_are_chosen_scores():
    logits = [[2.0, 1.0, 0.5, -1.0],
              [0.0, 3.0, 0.1, 2.0],
              [-1.0, -2.0, 1.5, 1.4]]
    router = make_router(4, 2)
    routing, _, stats = router(torch.tensor(logits))
    # Hand: token 0 -> {0, 1}, token 1 -> {1, 3}, token 2 -> {2, 3}
    expected = {}
    for t, (row, chosen) in enumerate(zip(logits, [(0, 1), (1, 3), (2, 3)])):
        probs = naive_softmax(row)
        expected[t] = {e: probs[e] for e in chosen}
    assert_routes(routing, expected, 3)
    assert routing.token_N.tolist() == [0, 0, 1, 1, 2, 2]  # token-major, N = T*K
    assert stats.tokens_per_expert_E.tolist() == [1.0, 2.0, 1.0, 2.0]
    assert stats.num_dropped.item() == 0 and stats.num_assignments == 6


def test_softmax_score_by_hand():
    # logits log(0.5), log(0.3), log(0.2): softmax gives exactly 0.5, 0.3, 0.2
    router = make_router(3, 1)
    routing, _, _ = router(torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)],
                                         [math.log(0.2), math.log(0.3), math.log(0.5)]]))
    assert routing.expert_N.tolist() == [0, 2]
    assert routing.weight_N.tolist() == pytest.approx([0.5, 0.5], abs=1e-6)


def test_sigmoid_scores_and_selection():
    logits = [[0.0, 2.0, -1.0, 1.0],
              [3.0, -3.0, 0.5, 0.4]]
    router = make_router(4, 2, score_func="sigmoid")
    routing, _, _ = router(torch.tensor(logits))
    s0, s1 = naive_sigmoid(logits[0]), naive_sigmoid(logits[1])
    assert_routes(routing, {0: {1: s0[1], 3: s0[3]}, 1: {0: s1[0], 2: s1[2]}}, 2)
    # Sigmoid scores do not sum to 1 over the chosen experts (no implicit normalisation).
    assert sum(per_token(routing, 2)[0].values()) == pytest.approx(s0[1] + s0[3])


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_norm_topk_prob_renormalises(score_func):
    logits = [[1.0, 0.2, -0.5, 0.7, 0.0], [0.3, 0.1, 2.0, -1.0, 0.9]]
    router = make_router(5, 3, score_func=score_func, norm_topk_prob=True)
    routing, _, _ = router(torch.tensor(logits))
    expected = {}
    for t, row in enumerate(logits):
        s = naive_softmax(row) if score_func == "softmax" else naive_sigmoid(row)
        chosen = naive_topk(s, 3)
        expected[t] = {e: s[e] / sum(s[c] for c in chosen) for e in chosen}
    assert_routes(routing, expected, 2)
    for t in range(2):
        assert sum(per_token(routing, 2)[t].values()) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("norm", [False, True])
def test_routed_scaling_factor_multiplies_weights(norm):
    logits = [[1.0, 0.2, -0.5, 0.7], [0.3, 0.1, 2.0, -1.0]]
    router = make_router(4, 2, score_func="sigmoid", norm_topk_prob=norm,
                         routed_scaling_factor=2.5)
    routing, _, _ = router(torch.tensor(logits))
    expected = {}
    for t, row in enumerate(logits):
        s = naive_sigmoid(row)
        chosen = naive_topk(s, 2)
        denom = sum(s[c] for c in chosen) if norm else 1.0
        expected[t] = {e: 2.5 * s[e] / denom for e in chosen}
    assert_routes(routing, expected, 2)


# ---- group-limited routing -----------------------------------------------------------------

def test_group_limited_skips_best_expert_in_weak_group():
    # 4 groups of 2 (sigmoid scores). Group sums of the top 2: g0 0.95, g1 1.22, g2 1.08, g3 0.2.
    # Expert 0 is the best single expert, but its group is not among the best two (g1, g2).
    scores = [0.95, 0.00001, 0.62, 0.60, 0.50, 0.58, 0.10, 0.10]
    x = torch.tensor([[logit(p) for p in scores]])
    grouped = make_router(8, 3, score_func="sigmoid", n_group=4, topk_group=2)
    routing, _, _ = grouped(x)
    assert_routes(routing, {0: {2: 0.62, 3: 0.60, 5: 0.58}}, 1)
    # Sanity of the construction: without groups expert 0 is chosen.
    flat = make_router(8, 3, score_func="sigmoid")
    assert set(flat(x)[0].expert_N.tolist()) == {0, 2, 3}


def naive_group_select(row, k, n_group, topk_group):
    per = len(row) // n_group
    group_score = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:2])
                   for g in range(n_group)]
    groups = naive_topk(group_score, topk_group)
    allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
    return sorted(allowed, key=lambda e: -row[e])[:k]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_group_limited_matches_naive_reference(score_func):
    torch.manual_seed(1)
    x = torch.randn(20, 16)
    router = make_router(16, 4, score_func=score_func, n_group=4, topk_group=2)
    routing, _, _ = router(x)
    got = per_token(routing, 20)
    for t in range(20):
        row = x[t].tolist()
        s = naive_softmax(row) if score_func == "softmax" else naive_sigmoid(row)
        assert set(got[t]) == set(naive_group_select(s, 4, 4, 2)), f"token {t}"


# ---- aux-loss-free bias --------------------------------------------------------------------

def test_expert_bias_changes_selection_not_weights():
    probs = [0.4, 0.3, 0.2, 0.1]
    x = torch.tensor([[math.log(p) for p in probs]])
    router = make_router(4, 1)
    assert router(x)[0].expert_N.tolist() == [0]
    router.expert_bias_E.copy_(torch.tensor([0.0, 0.0, 0.0, 0.5]))  # 0.1 + 0.5 beats 0.4
    routing, _, stats = router(x)
    assert routing.expert_N.tolist() == [3]
    assert routing.weight_N.tolist() == pytest.approx([0.1], abs=1e-6)  # raw score, no bias
    assert stats.tokens_per_expert_E.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_update_bias_sign_rule():
    router = make_router(4, 1, bias_update_rate=0.1)
    router.update_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]))  # mean 3: signs -1, +1, 0, 0
    assert router.expert_bias_E.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    router.update_bias(torch.tensor([0, 4, 4, 0]))          # integer counts, mean 2: +1 -1 -1 +1
    assert router.expert_bias_E.tolist() == pytest.approx([0.0, 0.0, -0.1, 0.1])
    assert router.expert_bias_E.dtype == torch.float32


# ---- capacity and drops --------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, cf, experts, want", [
    (8, 2, 1.0, 4, 4),      # 16/4
    (10, 2, 1.0, 4, 5),     # 20/4
    (10, 1, 1.0, 4, 3),     # ceil(2.5)
    (6, 2, 1.25, 4, 4),     # ceil(3.75)
    (7, 2, 0.5, 8, 1),      # ceil(0.875)
    (16, 2, 2.0, 8, 8),     # 64/8
])
def test_capacity_values(tokens, k, cf, experts, want):
    assert capacity(tokens, k, cf, experts) == want


def test_capacity_exact_for_decimal_factor():
    assert capacity(100, 1, 1.1, 10) == 11   # 100 * 1.1 / 10 = 11 exactly


def drop_case_input():
    # K=1, E=2, T=4, cf=1.0 -> C = 2. Tokens 0, 1, 2 pick expert 0 with scores 0.6, 0.9, 0.7;
    # token 3 picks expert 1.
    return torch.tensor([[math.log(p), math.log(1 - p)] for p in (0.6, 0.9, 0.7, 0.2)])


@pytest.mark.parametrize("policy, want", [("position", [0, 0, 2, 1]),   # keeps tokens 0, 1
                                          ("probs", [2, 0, 0, 1])])     # keeps 0.9, 0.7
def test_capacity_drop_by_hand(policy, want):
    router = make_router(2, 1, capacity_factor=1.0, drop_policy=policy)
    routing, _, stats = router(drop_case_input())
    assert routing.expert_N.tolist() == want           # 2 == num_experts marks a drop
    assert routing.weight_N.tolist() == pytest.approx([0.6, 0.9, 0.7, 0.8], abs=1e-6)
    assert stats.num_dropped.item() == 1
    assert stats.tokens_per_expert_E.tolist() == [3.0, 1.0]   # before drops
    assert stats.num_assignments == 4


@pytest.mark.parametrize("policy", ["position", "probs"])
@pytest.mark.parametrize("score_func, norm", [("softmax", False), ("sigmoid", True)])
def test_capacity_drop_matches_naive_reference(policy, score_func, norm):
    torch.manual_seed(2)
    num_tokens, num_experts, k, cf = 40, 4, 2, 0.75
    # Skew the logits so some experts overflow.
    x = torch.randn(num_tokens, num_experts) + torch.tensor([1.5, 0.5, 0.0, -1.0])
    undropped = make_router(num_experts, k, score_func=score_func, norm_topk_prob=norm)
    dropping = make_router(num_experts, k, score_func=score_func, norm_topk_prob=norm,
                           capacity_factor=cf, drop_policy=policy)
    ref, _, _ = undropped(x)
    routing, _, stats = dropping(x)
    cap = math.ceil(num_tokens * k * cf / num_experts)
    assignments = list(zip(ref.expert_N.tolist(), ref.weight_N.tolist()))
    keep = naive_keep(assignments, num_experts, cap, policy)
    want = [e if kept else num_experts for (e, _), kept in zip(assignments, keep)]
    assert routing.expert_N.tolist() == want
    assert torch.equal(routing.weight_N, ref.weight_N)
    assert torch.equal(routing.token_N, ref.token_N)
    assert stats.num_dropped.item() == keep.count(False) > 0
    counts = [sum(1 for e, _ in assignments if e == i) for i in range(num_experts)]
    assert stats.tokens_per_expert_E.tolist() == counts
    for e in range(num_experts):
        assert want.count(e) == min(cap, counts[e])


# ---- expert choice -------------------------------------------------------------------------

def naive_expert_choice(probs, cap):
    """{expert: [tokens]}: each expert's `cap` highest-score tokens."""
    num_tokens, num_experts = len(probs), len(probs[0])
    return {e: sorted(range(num_tokens), key=lambda t: (-probs[t][e], t))[:cap]
            for e in range(num_experts)}


def check_expert_choice(router, x, cap):
    routing, losses, stats = router(x)
    probs = [naive_softmax(row) for row in x.tolist()]
    want = naive_expert_choice(probs, cap)
    num_experts = len(probs[0])
    assert routing.expert_N.tolist() == [e for e in range(num_experts) for _ in range(cap)]
    for e in range(num_experts):
        tokens = routing.token_N[e * cap:(e + 1) * cap].tolist()
        weights = routing.weight_N[e * cap:(e + 1) * cap].tolist()
        assert sorted(tokens) == sorted(want[e]), f"expert {e}"
        assert weights == pytest.approx([probs[t][e] for t in tokens], abs=1e-6)
    chosen = {t for ts in want.values() for t in ts}
    assert stats.num_dropped.item() == len(probs) - len(chosen)
    assert stats.num_assignments == len(probs)
    assert stats.tokens_per_expert_E.tolist() == [float(cap)] * num_experts
    return routing, losses, stats


def test_expert_choice_by_hand():
    # T=6, E=3, K=1, cf=1 -> C = 2. Token 5 is nobody's top-2, so it is dropped.
    x = torch.tensor([[3.0, 0.0, 0.0],
                      [2.0, 0.0, 0.0],
                      [0.0, 3.0, 0.0],
                      [0.0, 0.0, 3.0],
                      [0.0, 2.0, 2.0],
                      [0.0, 0.0, 0.0]])
    router = make_router(3, 1, cls=ExpertChoiceRouter, capacity_factor=1.0)
    routing, _, stats = check_expert_choice(router, x, 2)
    chosen = {e: sorted(routing.token_N[2 * e:2 * e + 2].tolist()) for e in range(3)}
    assert chosen == {0: [0, 1], 1: [2, 4], 2: [3, 4]}
    assert stats.num_dropped.item() == 1


def test_expert_choice_random_and_capped_at_tokens():
    torch.manual_seed(3)
    x = torch.randn(12, 4)
    router = make_router(4, 2, cls=ExpertChoiceRouter, capacity_factor=1.25)
    check_expert_choice(router, x, math.ceil(12 * 2 * 1.25 / 4))   # 8
    # ceil(4 * 2 * 2 / 2) = 8 > T = 4: every expert takes every token.
    x = torch.randn(4, 2)
    router = make_router(2, 2, cls=ExpertChoiceRouter, capacity_factor=2.0)
    routing, _, stats = check_expert_choice(router, x, 4)
    assert stats.num_dropped.item() == 0


def test_expert_choice_losses_are_z_only():
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    router = make_router(2, 1, cls=ExpertChoiceRouter, capacity_factor=1.0, z_coeff=0.1)
    _, losses, _ = router(x)
    want_z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in x.tolist()) / 2
    assert losses.z.item() == pytest.approx(want_z, rel=1e-6)
    assert losses.total.item() == pytest.approx(0.1 * want_z, rel=1e-6)
    assert losses.balance.item() == 0.0


def test_build_router_picks_class():
    assert type(build_router(4, 4, 2, RouterConfig())) is TopKRouter
    cfg = RouterConfig(type="expert_choice", capacity_factor=1.0)
    assert type(build_router(4, 4, 2, cfg)) is ExpertChoiceRouter


# ---- losses --------------------------------------------------------------------------------

def test_switch_balance_loss_by_hand():
    # f = [1, 0], P = [0.7, 0.3] -> 2 * 0.7
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    assert switch_balance_loss(probs, torch.tensor([[0], [0]])).item() == pytest.approx(1.4)
    uniform = torch.full((4, 4), 0.25)
    assert switch_balance_loss(uniform, torch.tensor([[0], [1], [2], [3]])).item() == \
        pytest.approx(1.0)
    # Uniform with K=2: every expert gets 2 of 8 copies.
    assert switch_balance_loss(uniform, torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])).item() \
        == pytest.approx(1.0)


def test_switch_balance_loss_matches_naive():
    torch.manual_seed(4)
    probs = torch.softmax(torch.randn(10, 5), -1)
    experts = torch.randint(0, 5, (10, 3))
    want = naive_switch_loss(probs.tolist(), experts.tolist(), 5)
    assert switch_balance_loss(probs, experts).item() == pytest.approx(want, rel=1e-6)


def test_sequence_balance_loss_is_mean_of_per_sequence():
    torch.manual_seed(5)
    num_seqs, seq_len, num_experts, k = 3, 4, 5, 2
    probs = torch.softmax(torch.randn(num_seqs, seq_len, num_experts), -1)
    experts = torch.stack([torch.stack([torch.randperm(num_experts)[:k] for _ in range(seq_len)])
                           for _ in range(num_seqs)])
    want = sum(naive_switch_loss(probs[b].tolist(), experts[b].tolist(), num_experts)
               for b in range(num_seqs)) / num_seqs
    assert sequence_balance_loss(probs, experts).item() == pytest.approx(want, rel=1e-6)


def test_z_loss_matches_naive():
    logits = [[1.0, 2.0, 3.0], [0.0, -1.0, 0.5]]
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 2
    assert z_loss(torch.tensor(logits)).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_losses_total_is_weighted_sum(score_func):
    torch.manual_seed(6)
    num_seqs, seq_len, num_experts, k = 2, 5, 4, 2
    x = torch.randn(num_seqs * seq_len, num_experts)
    router = make_router(num_experts, k, score_func=score_func, balance_coeff=0.01,
                         seq_balance_coeff=0.1, z_coeff=0.001)
    routing, losses, _ = router(x, seq_len=seq_len)
    rows = x.tolist()
    if score_func == "softmax":
        probs = [naive_softmax(r) for r in rows]
    else:  # balance losses see sigmoid scores normalised to sum to 1
        probs = [[s / sum(naive_sigmoid(r)) for s in naive_sigmoid(r)] for r in rows]
    experts = [list(per_token(routing, len(rows))[t]) for t in range(len(rows))]
    balance = naive_switch_loss(probs, experts, num_experts)
    seq_balance = sum(naive_switch_loss(probs[b * seq_len:(b + 1) * seq_len],
                                        experts[b * seq_len:(b + 1) * seq_len], num_experts)
                      for b in range(num_seqs)) / num_seqs
    z = sum(math.log(sum(math.exp(v) for v in r)) ** 2 for r in rows) / len(rows)
    assert losses.balance.item() == pytest.approx(balance, rel=1e-5)
    assert losses.seq_balance.item() == pytest.approx(seq_balance, rel=1e-5)
    assert losses.z.item() == pytest.approx(z, rel=1e-5)
    assert losses.total.item() == pytest.approx(0.01 * balance + 0.1 * seq_balance + 0.001 * z,
                                                rel=1e-5)
    assert not losses.balance.requires_grad and losses.total.requires_grad


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_gradients_reach_router_weight(score_func):
    torch.manual_seed(7)
    router = make_router(6, 2, torch.randn(6, 5), dtype=torch.float64, score_func=score_func,
                         norm_topk_prob=True, routed_scaling_factor=1.5, balance_coeff=0.3,
                         seq_balance_coeff=0.2, z_coeff=0.1)
    x = torch.randn(8, 5, dtype=torch.float64)

    def f(weight_ED):
        routing, losses, _ = torch.func.functional_call(router, {"weight": weight_ED}, (x, 4))
        return losses.total, routing.weight_N

    w = router.weight.detach().clone().requires_grad_(True)
    # Finite differences vs autograd; the selection is locally constant at a random point.
    assert torch.autograd.gradcheck(f, (w,), eps=1e-6, atol=1e-6)
    _, losses, _ = router(x, seq_len=4)
    losses.total.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# ---- dtypes --------------------------------------------------------------------------------

def test_float64_input_keeps_float64():
    router = make_router(4, 2, capacity_factor=1.0)
    x = torch.tensor([[0.1, 0.2, 0.3, 0.4000000001]], dtype=torch.float64)
    routing, losses, _ = router(x)
    assert routing.weight_N.dtype == torch.float64
    assert losses.total.dtype == losses.z.dtype == torch.float64
    # Float32 would round 0.4000000001 to 0.4; float64 keeps the difference.
    p = naive_softmax(x[0].tolist())
    assert routing.weight_N[0].item() == pytest.approx(p[3], rel=1e-12)


def test_bfloat16_autocast_gives_float32_weights():
    torch.manual_seed(8)
    router = make_router(4, 2, torch.randn(4, 8), score_func="softmax", z_coeff=0.01)
    x = torch.randn(5, 8).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing, losses, _ = router(x)
    assert routing.weight_N.dtype == torch.float32
    assert losses.total.dtype == torch.float32
    # Computed from the bf16 input in float32, not rounded to bf16 along the way.
    logits = x.float() @ router.weight.detach().t()
    want = torch.softmax(logits, -1).topk(2, -1).values
    got = routing.weight_N.view(5, 2).sort(-1, descending=True).values
    assert torch.allclose(got, want, atol=1e-6)


def test_probs_policy_ranks_near_ties_by_position():
    """Weights closer than 2^-20 count as equal, so the earlier token keeps the slot; a real
    difference still wins. (Rounding noise must not decide which copy is dropped.)"""
    router = TopKRouter(2, 2, 1, RouterConfig(capacity_factor=0.5, drop_policy="probs"))
    expert_N = torch.tensor([0, 0, 1, 1])
    weight_N = torch.tensor([0.3, 0.3 + 1e-12, 0.3, 0.3 + 1e-3], dtype=torch.float64)
    keep = router._within_capacity(expert_N, weight_N, cap=1)
    # expert 0: near tie -> the earlier (index 0) stays; expert 1: a real gap -> index 3 stays
    assert keep.tolist() == [True, False, False, True]


class _WholeGroup:
    """A token group of one slice: the router must then compute exactly what it computes alone."""
    size = 1

    def gather(self, t):
        return t.clone()

    def local(self, t):
        return t

    def total(self, t):
        return t


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_token_group_of_one_slice_equals_the_plain_router(policy):
    cfg = RouterConfig(capacity_factor=0.75, drop_policy=policy, balance_coeff=0.1,
                       seq_balance_coeff=0.05, z_coeff=0.01)
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, cfg).double()
    x = torch.randn(3 * 10, 16, dtype=torch.float64, requires_grad=True)
    plain, plain_losses, plain_stats = router(x, seq_len=10)
    grad_plain = torch.autograd.grad(plain_losses.total + plain.weight_N.sum(), x)[0]
    use_token_group(router, _WholeGroup())
    grouped, losses, stats = router(x, seq_len=10)
    grad_grouped = torch.autograd.grad(losses.total + grouped.weight_N.sum(), x)[0]
    assert torch.equal(grouped.expert_N, plain.expert_N) and int(stats.num_dropped) > 0
    for a, b in ((losses.balance, plain_losses.balance), (losses.seq_balance, plain_losses.seq_balance),
                 (losses.z, plain_losses.z)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_grouped, grad_plain, rtol=1e-12, atol=1e-15)
