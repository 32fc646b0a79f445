"""The MoE layer and the local dispatcher against a naive per-token, per-assignment reference.

Legend: T tokens, D model dim, F hidden dim per expert, E experts, K experts per token,
B sequences, S tokens per sequence, N assignments, R rows sent to experts.

The reference re-derives everything from the layer's raw weights with Python loops: softmax or
sigmoid scores per token, top-k by sorting, capacity by ranking each expert's assignments, the
balance and z losses from their definitions, and y_t = sum over kept (e, w) of w * ffn_e(x_t)
plus the shared experts. Checks run in float64 (the padded grouped-GEMM path) to ~1e-10.
"""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from moepar.layers import FeedForward, LocalDispatcher, MoE, Routing

DIM, FFN_DIM, NUM_EXPERTS, TOP_K = 8, 6, 4, 2
TOL64 = dict(rtol=1e-10, atol=1e-10)
AUX_COEFFS = dict(balance_coeff=0.01, seq_balance_coeff=0.02, z_coeff=0.003)

# The documented defaults, written out here so the reference never reads the layer's own config.
SPEC_DEFAULTS = dict(
    num_experts=NUM_EXPERTS, top_k=TOP_K, activation="swiglu", num_shared_experts=0,
    shared_ffn_dim=None, shared_gate=False,
    type="topk", score_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
    n_group=1, topk_group=1, capacity_factor=None, drop_policy="probs",
    balance_coeff=0.01, seq_balance_coeff=0.0, z_coeff=0.0)


# ---------------------------------------------------------------- naive reference

def naive_scores(logits_E, score_func):
    if score_func == "softmax":
        exp_E = torch.exp(logits_E - logits_E.max())
        return exp_E / exp_E.sum()
    return 1.0 / (1.0 + torch.exp(-logits_E))


def naive_topk_assignments(logits_TE, cfg, num_experts, top_k):
    """Token-major list of {token, expert, weight, kept}, weight carrying gradient."""
    assignments = []
    for t in range(logits_TE.shape[0]):
        s_E = naive_scores(logits_TE[t], cfg.score_func)
        allowed = list(range(num_experts))
        if cfg.n_group > 1:
            per_group = num_experts // cfg.n_group
            group_score = [sum(sorted(s_E[g * per_group:(g + 1) * per_group].tolist(),
                                      reverse=True)[:2]) for g in range(cfg.n_group)]
            best = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[:cfg.topk_group]
            allowed = [e for e in allowed if e // per_group in best]
        chosen = sorted(allowed, key=lambda e: -s_E[e].item())[:top_k]
        weights = [s_E[e] for e in chosen]
        if cfg.norm_topk_prob:
            total = sum(weights)
            weights = [w / total for w in weights]
        for e, w in zip(chosen, weights):
            assignments.append(dict(token=t, expert=e, weight=w * cfg.routed_scaling_factor,
                                    kept=True))
    if cfg.capacity_factor is not None:
        cap = math.ceil(logits_TE.shape[0] * top_k * cfg.capacity_factor / num_experts)
        for e in range(num_experts):
            mine = [n for n, a in enumerate(assignments) if a["expert"] == e]
            if cfg.drop_policy == "probs":  # highest weight first; sort is stable, ties by position
                mine.sort(key=lambda n: -assignments[n]["weight"].item())
            for rank, n in enumerate(mine):
                assignments[n]["kept"] = rank < cap
    return assignments


def naive_expert_choice_assignments(logits_TE, cfg, num_experts, top_k):
    num_tokens = logits_TE.shape[0]
    s_TE = torch.stack([naive_scores(logits_TE[t], "softmax") for t in range(num_tokens)])
    cap = min(num_tokens, math.ceil(num_tokens * top_k * cfg.capacity_factor / num_experts))
    assignments = []
    for e in range(num_experts):
        for t in sorted(range(num_tokens), key=lambda t: -s_TE[t, e].item())[:cap]:
            assignments.append(dict(token=t, expert=e, weight=s_TE[t, e], kept=True))
    return assignments


def naive_balance(probs_TE, assignments, tokens, num_experts, top_k):
    """E * sum_e f_e * P_e over `tokens`, f_e counting routed copies before drops."""
    counts = [0] * num_experts
    for a in assignments:
        if a["token"] in tokens:
            counts[a["expert"]] += 1
    mean_prob_E = probs_TE[list(tokens)].mean(0)
    return num_experts * sum(counts[e] / (len(tokens) * top_k) * mean_prob_E[e]
                             for e in range(num_experts))


def naive_aux(logits_TE, assignments, cfg, num_experts, top_k, seq_len):
    num_tokens = logits_TE.shape[0]
    z = sum(torch.log(torch.exp(logits_TE[t]).sum()) ** 2 for t in range(num_tokens)) / num_tokens
    if cfg.type == "expert_choice":
        return dict(total=cfg.z_coeff * z, z=z)
    s_TE = torch.stack([naive_scores(logits_TE[t], cfg.score_func) for t in range(num_tokens)])
    probs_TE = s_TE if cfg.score_func == "softmax" else s_TE / s_TE.sum(-1, keepdim=True)
    balance = naive_balance(probs_TE, assignments, range(num_tokens), num_experts, top_k)
    seq_balance = sum(naive_balance(probs_TE, assignments, range(b * seq_len, (b + 1) * seq_len),
                                    num_experts, top_k)
                      for b in range(num_tokens // seq_len)) / (num_tokens // seq_len)
    total = cfg.balance_coeff * balance + cfg.seq_balance_coeff * seq_balance + cfg.z_coeff * z
    return dict(total=total, balance=balance, seq_balance=seq_balance, z=z)


def naive_ffn(x_D, w_in_DH, w_out_FD, activation):
    h_H = x_D @ w_in_DH
    if activation == "swiglu":
        gate, up = h_H[:w_out_FD.shape[0]], h_H[w_out_FD.shape[0]:]
        a_F = gate * torch.sigmoid(gate) * up
    else:
        a_F = 0.5 * h_H * (1.0 + torch.erf(h_H / math.sqrt(2.0)))
    return a_F @ w_out_FD


def naive_moe(x, p, cfg):
    """(y, aux dict, assignments) from leaves `p` (the layer's parameters by name) and the spec."""
    num_experts, top_k, activation = cfg.num_experts, cfg.top_k, cfg.activation
    x_TD = x.reshape(-1, x.shape[-1])
    seq_len = x.shape[-2] if x.dim() > 2 else x_TD.shape[0]
    logits_TE = x_TD @ p["router.weight"].t()
    if cfg.type == "expert_choice":
        assignments = naive_expert_choice_assignments(logits_TE, cfg, num_experts, top_k)
    else:
        assignments = naive_topk_assignments(logits_TE, cfg, num_experts, top_k)
    rows = []
    for t in range(x_TD.shape[0]):
        y_D = torch.zeros_like(x_TD[t])
        for a in assignments:
            if a["token"] == t and a["kept"]:
                y_D = y_D + a["weight"] * naive_ffn(x_TD[t], p["experts.w_in_EDU"][a["expert"]],
                                                    p["experts.w_out_EFD"][a["expert"]], activation)
        if cfg.num_shared_experts:
            shared_D = naive_ffn(x_TD[t], p["shared.ffn.w_in.weight"].t(),
                                 p["shared.ffn.w_out.weight"].t(), activation)
            if cfg.shared_gate:
                shared_D = torch.sigmoid(x_TD[t] @ p["shared.gate.weight"][0]) * shared_D
            y_D = y_D + shared_D
        rows.append(y_D)
    aux = naive_aux(logits_TE, assignments, cfg, num_experts, top_k, seq_len)
    return torch.stack(rows).reshape(x.shape), aux, assignments


# ---------------------------------------------------------------- helpers

def build_moe(seed=0, dim=DIM, ffn_dim=FFN_DIM, dtype=torch.float64, **kwargs):
    """(MoE, spec): weights large enough that routing is decisive and outputs are O(1); the spec
    is what the naive reference reads (the test's own arguments over SPEC_DEFAULTS)."""
    spec = SimpleNamespace(**{**SPEC_DEFAULTS, **kwargs})
    torch.manual_seed(seed)
    num_experts, top_k = kwargs.pop("num_experts", NUM_EXPERTS), kwargs.pop("top_k", TOP_K)
    moe = MoE(dim, ffn_dim, num_experts, top_k, **kwargs).to(dtype)
    if spec.num_shared_experts:
        hidden = spec.num_shared_experts * (spec.shared_ffn_dim or ffn_dim)
        assert moe.shared.ffn.w_out.weight.shape == (dim, hidden)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return moe, spec


def leaves(module):
    return {name: p.detach().clone().requires_grad_() for name, p in module.named_parameters()}


def check_against_naive(moe, spec, shape, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(shape, generator=gen, dtype=torch.float64)
    out = moe(x)
    ((out.y * grad_y).sum() + out.aux_loss.total).backward()

    p = leaves(moe)
    x_ref = x.detach().clone().requires_grad_()
    y_ref, aux_ref, assignments = naive_moe(x_ref, p, spec)
    ((y_ref * grad_y).sum() + aux_ref["total"]).backward()

    torch.testing.assert_close(out.y, y_ref, **TOL64)
    torch.testing.assert_close(out.aux_loss.total, aux_ref["total"].detach(), **TOL64)
    for name in ("balance", "seq_balance", "z"):
        if name in aux_ref:
            torch.testing.assert_close(getattr(out.aux_loss, name), aux_ref[name].detach(), **TOL64)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL64)
    for name, param in moe.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, p[name].grad, **TOL64, msg=name)
    return out, assignments


# ---------------------------------------------------------------- the layer against the reference

TOPK_CASES = {
    "softmax_dropless": dict(),
    "softmax_norm_topk": dict(norm_topk_prob=True),
    "sigmoid_dropless": dict(score_func="sigmoid"),
    "sigmoid_norm_topk_scaled": dict(score_func="sigmoid", norm_topk_prob=True,
                                     routed_scaling_factor=2.5),
    "top1": dict(top_k=1),
    "gelu": dict(activation="gelu"),
    "group_limited": dict(n_group=2, topk_group=1),
    "capacity_probs": dict(capacity_factor=0.5, drop_policy="probs"),
    "capacity_position": dict(capacity_factor=0.5, drop_policy="position"),
    "sigmoid_capacity_probs": dict(score_func="sigmoid", capacity_factor=0.75),
    "shared": dict(num_shared_experts=2, shared_ffn_dim=3),
    "shared_gated_capacity": dict(num_shared_experts=1, shared_gate=True, capacity_factor=0.5,
                                  drop_policy="position"),
}
SHAPES = {"2d": (12, DIM), "3d": (2, 6, DIM)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("case", TOPK_CASES.values(), ids=TOPK_CASES.keys())
def test_topk_moe_matches_naive(case, shape):
    moe, spec = build_moe(**{**AUX_COEFFS, **case})
    out, assignments = check_against_naive(moe, spec, shape)
    dropped = sum(not a["kept"] for a in assignments)
    if "capacity_factor" in case:
        assert dropped > 0, "the capacity case should drop something"
    assert out.stats.num_dropped.item() == dropped
    counts = [sum(a["expert"] == e for a in assignments) for e in range(spec.num_experts)]
    assert out.stats.tokens_per_expert_E.tolist() == counts


EC_CASES = {"cf0.5": dict(capacity_factor=0.5), "cf1": dict(capacity_factor=1.0),
            "cf_capped_at_T": dict(capacity_factor=3.0),
            "cf1_shared": dict(capacity_factor=1.0, num_shared_experts=1, shared_gate=True)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("case", EC_CASES.values(), ids=EC_CASES.keys())
def test_expert_choice_moe_matches_naive(case, shape):
    moe, spec = build_moe(type="expert_choice", z_coeff=0.003, **case)
    out, assignments = check_against_naive(moe, spec, shape)
    num_tokens = math.prod(shape[:-1])
    unchosen = num_tokens - len({a["token"] for a in assignments})
    assert out.stats.num_dropped.item() == unchosen
    assert out.aux_loss.balance.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_one_expert_top1_equals_dense_ffn(dtype):
    # dim/ffn multiples of 4 so float32 runs the native grouped GEMM.
    moe, _ = build_moe(dim=16, ffn_dim=8, num_experts=1, top_k=1, dtype=dtype)
    ffn = FeedForward(16, 8).to(dtype)
    with torch.no_grad():
        ffn.w_in.weight.copy_(moe.experts.w_in_EDU[0].t())
        ffn.w_out.weight.copy_(moe.experts.w_out_EFD[0].t())
    x = torch.randn(2, 5, 16, dtype=dtype, generator=torch.Generator().manual_seed(3))

    routing, _, _ = moe.router(x.reshape(-1, 16))
    assert torch.equal(routing.weight_N, torch.ones_like(routing.weight_N))

    out = moe(x)
    (out.y.sum() + out.aux_loss.total).backward()
    y_dense = ffn(x)
    y_dense.sum().backward()
    tol = TOL64 if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.y, y_dense, **tol)
    torch.testing.assert_close(moe.experts.w_in_EDU.grad[0], ffn.w_in.weight.grad.t(), **tol)
    torch.testing.assert_close(moe.experts.w_out_EFD.grad[0], ffn.w_out.weight.grad.t(), **tol)
    # The one softmax weight is the constant 1 and the balance loss the constant 1: no gradient.
    assert torch.count_nonzero(moe.router.weight.grad) == 0


@pytest.mark.parametrize("shared", [False, True], ids=["no_shared", "shared"])
@pytest.mark.parametrize("drop_policy", ["probs", "position"])
def test_fully_dropped_tokens_output_zero_or_shared(drop_policy, shared):
    # T=16, K=2, E=4, cf=0.25: capacity ceil(16*2*0.25/4) = 2, so 8 of 32 copies are kept.
    moe, spec = build_moe(capacity_factor=0.25, drop_policy=drop_policy,
                    num_shared_experts=1 if shared else 0, shared_gate=shared)
    x_TD = torch.randn(16, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out = moe(x_TD)
    logits_TE = x_TD @ moe.router.weight.detach().t()
    assignments = naive_topk_assignments(logits_TE, spec, NUM_EXPERTS, TOP_K)
    assert sum(a["kept"] for a in assignments) == 8
    fully_dropped = [t for t in range(16) if not any(a["kept"] for a in assignments
                                                     if a["token"] == t)]
    assert fully_dropped, "the setting should drop every copy of some token"
    assert out.stats.num_dropped.item() == 24
    expected_TD = moe.shared(x_TD) if shared else torch.zeros_like(x_TD)
    for t in range(16):
        if t in fully_dropped:
            assert torch.equal(out.y[t], expected_TD[t]), t
        else:
            assert not torch.equal(out.y[t], expected_TD[t]), t


# ---------------------------------------------------------------- shape, dtype, aux losses

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("shape", [(16,), (5, 16), (2, 3, 16), (2, 2, 3, 16)],
                         ids=["1d", "2d", "3d", "4d"])
def test_output_keeps_shape_and_dtype(shape, dtype):
    moe, _ = build_moe(dim=16, ffn_dim=8, dtype=dtype, num_shared_experts=1, capacity_factor=1.0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    out = moe(x)
    assert out.y.shape == x.shape and out.y.dtype == dtype
    assert out.aux_loss.total.shape == () and out.aux_loss.total.requires_grad
    out.y.sum().backward()
    assert x.grad.shape == x.shape and x.grad.dtype == dtype


def test_output_keeps_dtype_under_autocast():
    moe, _ = build_moe(dim=16, ffn_dim=8, dtype=torch.float32, num_shared_experts=1)
    x = torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.y.shape == x.shape and out.y.dtype == torch.float32
    # Router maths stays in float32 under autocast.
    assert out.aux_loss.total.dtype == torch.float32


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_injected_aux_loss_equals_adding_it_to_the_loss(capacity_factor):
    scale = 0.37
    plain, _ = build_moe(capacity_factor=capacity_factor, **AUX_COEFFS)
    injected = copy.deepcopy(plain)
    injected.aux_loss_scale = scale
    x = torch.randn(2, 6, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    out_plain, out_injected = plain(x), injected(x)
    assert torch.equal(out_plain.y, out_injected.y)
    assert torch.equal(out_plain.aux_loss.total, out_injected.aux_loss.total)

    # aux_loss_scale=None: y.sum() alone leaves the aux gradient to the caller.
    grad_y_only = torch.autograd.grad(out_plain.y.sum(), plain.router.weight, retain_graph=True)[0]
    (out_plain.y.sum() + scale * out_plain.aux_loss.total).backward()
    out_injected.y.sum().backward()
    aux_grad = plain.router.weight.grad - grad_y_only
    assert aux_grad.abs().max() > 1e-6, "the aux loss should move the router"
    torch.testing.assert_close(injected.router.weight.grad, plain.router.weight.grad,
                               rtol=1e-12, atol=1e-14)
    for name, param in injected.named_parameters():
        torch.testing.assert_close(param.grad, dict(plain.named_parameters())[name].grad,
                                   rtol=1e-12, atol=1e-14, msg=name)


def test_injected_output_allows_in_place_ops():
    scale = 0.5
    plain, _ = build_moe(**AUX_COEFFS)
    injected = copy.deepcopy(plain)
    injected.aux_loss_scale = scale
    x = torch.randn(12, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    out_plain = plain(x)
    (2.0 * out_plain.y.sum() + scale * out_plain.aux_loss.total).backward()
    y = injected(x).y
    y.mul_(2.0)
    y.sum().backward()
    torch.testing.assert_close(injected.router.weight.grad, plain.router.weight.grad,
                               rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- the local dispatcher

def naive_dispatch_order(token_N, expert_N, num_experts):
    """Row order the dispatcher must produce: expert-major, assignment order within an expert."""
    return [(token_N[n], e) for e in range(num_experts)
            for n in range(len(expert_N)) if expert_N[n] == e]


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dispatch_combine_round_trip(top_k):
    num_tokens, num_experts = 10, 4
    gen = torch.Generator().manual_seed(top_k)
    x_TD = torch.randn(num_tokens, DIM, generator=gen, dtype=torch.float64)
    token_N = torch.arange(num_tokens).repeat_interleave(top_k)
    # A random expert per copy; the value num_experts marks a dropped copy.
    expert_N = torch.randint(0, num_experts + 1, (num_tokens * top_k,), generator=gen)
    routing = Routing(token_N, expert_N, torch.ones(num_tokens * top_k, dtype=torch.float64))
    dispatcher = LocalDispatcher(num_experts)
    (x_RD,), plan = dispatcher.dispatch(x_TD, routing)

    rows = naive_dispatch_order(token_N.tolist(), expert_N.tolist(), num_experts)
    assert plan.rows_per_expert == [sum(e == g for _, e in rows) for g in range(num_experts)]
    assert plan.sorted.token_R.tolist() == [t for t, _ in rows]
    assert torch.equal(x_RD, torch.stack([x_TD[t] for t, _ in rows]))

    kept_T = [sum(1 for n in range(len(expert_N)) if token_N[n] == t and expert_N[n] < num_experts)
              for t in range(num_tokens)]
    y_TD = dispatcher.combine((x_RD,), plan, routing.weight_N)  # identity experts, weight 1
    assert torch.equal(y_TD, x_TD * torch.tensor(kept_T, dtype=torch.float64)[:, None])


def test_combine_weights_rows_per_token():
    num_tokens, num_experts = 6, 3
    gen = torch.Generator().manual_seed(7)
    x_TD = torch.randn(num_tokens, DIM, generator=gen, dtype=torch.float64)
    token_N = torch.arange(num_tokens).repeat_interleave(2)
    expert_N = torch.tensor([0, 2, 1, 3, 3, 3, 2, 0, 1, 2, 0, 1])
    weight_N = torch.rand(12, generator=gen, dtype=torch.float64)
    dispatcher = LocalDispatcher(num_experts)
    (x_RD,), plan = dispatcher.dispatch(x_TD, Routing(token_N, expert_N, weight_N))
    y_TD = dispatcher.combine((2.0 * x_RD,), plan, weight_N)
    expected = torch.zeros_like(x_TD)
    for n in range(12):
        if expert_N[n] < num_experts:
            expected[token_N[n]] += weight_N[n] * 2.0 * x_TD[token_N[n]]
    torch.testing.assert_close(y_TD, expected, **TOL64)
    assert torch.equal(y_TD[2], torch.zeros(DIM, dtype=torch.float64))  # token 2: both dropped


def test_dispatch_rows_from_the_router_are_expert_major_in_token_order():
    moe, _ = build_moe(capacity_factor=0.75, drop_policy="probs")
    x_TD = torch.randn(12, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    routing, _, _ = moe.router(x_TD)
    (x_RD,), plan = moe.dispatcher.dispatch(x_TD, routing)
    expert_R = [e for e in range(NUM_EXPERTS) for _ in range(plan.rows_per_expert[e])]
    rows = naive_dispatch_order(routing.token_N.tolist(), routing.expert_N.tolist(), NUM_EXPERTS)
    assert [e for _, e in rows] == expert_R
    assert plan.sorted.token_R.tolist() == [t for t, _ in rows]
    for e in range(NUM_EXPERTS):  # token order within each expert
        tokens = [t for t, g in rows if g == e]
        assert tokens == sorted(tokens)
    assert torch.equal(x_RD, x_TD[plan.sorted.token_R])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_moe_with_unaligned_dims_matches_naive(dtype):
    # Regression: dims whose rows are not 16-byte aligned once crashed the native grouped GEMM.
    moe, spec = build_moe(dim=6, ffn_dim=5, dtype=dtype)
    x_TD = torch.randn(7, 6, generator=torch.Generator().manual_seed(9)).to(dtype)
    out = moe(x_TD)
    out.y.sum().backward()
    y_ref, _, _ = naive_moe(x_TD.double(), {k: v.double() for k, v in leaves(moe).items()}, spec)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.y.double(), y_ref, **tol)
