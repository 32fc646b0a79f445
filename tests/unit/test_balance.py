"""Deferred balance-loss maths (layers/balance.py) against hand-computed numbers and identities.

Legend: T tokens, E experts, K experts per token, L MoE layers.
    python -m pytest tests/unit/test_balance.py -q
"""

import math

import pytest
import torch

from moepar.layers import ModelConfig, MoE, RouterConfig, Transformer
from moepar.layers.balance import BalanceParts, BalanceStep, MicroBalance
from moepar.parallel.sequence_router import use_token_group


def holder_with(parts_by_layer: dict) -> MicroBalance:
    holder = MicroBalance()
    for layer_id, parts in parts_by_layer.items():
        holder.slot(layer_id).parts = parts
    return holder


def parts(counts, prob_sums, tokens):
    return BalanceParts(torch.tensor(counts, dtype=torch.float64),
                        torch.tensor(prob_sums, dtype=torch.float64), tokens)


# Two layers of T=4 tokens, E=3 experts, K=2 (counts sum to T*K = 8; probabilities to T = 4).
LAYER_A = parts([4, 3, 1], [2.0, 1.5, 0.5], 4)
LAYER_B = parts([2, 2, 4], [1.0, 1.0, 2.0], 4)


def test_per_layer_coefficients_and_value_by_hand():
    cfg = RouterConfig(balance_coeff=0.1, balance_scope="global")   # one micro-batch, one rank
    holder = holder_with({1: LAYER_A, 3: LAYER_B})
    value = BalanceStep(cfg, 3, 2).finish(holder)
    # f = c / (T K) = c / 8; d(loss)/d(prob sum) = coeff * E * f / T
    assert holder.slots[1].coef_E.tolist() == pytest.approx([0.1 * 3 * 4 / 8 / 4,
                                                             0.1 * 3 * 3 / 8 / 4,
                                                             0.1 * 3 * 1 / 8 / 4], rel=1e-15)
    # E * sum f P per layer: A: 3*(4*2 + 3*1.5 + 1*0.5)/32 = 1.21875; B: 3*(2+2+8)/32 = 1.125
    assert float(value) == pytest.approx(0.1 * (1.21875 + 1.125), rel=1e-15)


def test_all_layers_coefficients_and_value_by_hand():
    """transformers' definition: one f and one P over both layers' 2T rows, f summing to K."""
    cfg = RouterConfig(balance_coeff=0.1, balance_loss="all_layers")
    holder = holder_with({1: LAYER_A, 3: LAYER_B})
    value = BalanceStep(cfg, 3, 2).finish(holder)
    # f = (6, 5, 5) / 8, P = (3, 2.5, 2.5) / 8 -> E * sum f P = 3 * (18 + 12.5 + 12.5) / 64
    assert float(value) == pytest.approx(0.1 * 3 * 43 / 64, rel=1e-15)
    want = [0.1 * 3 * c / 8 / 8 for c in (6, 5, 5)]     # coeff * E * f / (L T), every layer
    for slot in holder.slots.values():
        assert slot.coef_E.tolist() == pytest.approx(want, rel=1e-15)


def test_pipeline_partial_sums_give_the_whole_models_coefficient():
    """Stage by stage (partial sums passed on) equals all layers at once."""
    cfg = RouterConfig(balance_coeff=0.1, balance_loss="all_layers")
    step = BalanceStep(cfg, 3, 2)
    first, last = holder_with({1: LAYER_A}), holder_with({3: LAYER_B})
    sums = step.partial(first)
    value = step.finish_all([first, last], step.partial(last, sums))
    whole = holder_with({1: LAYER_A, 3: LAYER_B})
    assert float(value) == float(BalanceStep(cfg, 3, 2).finish(whole))
    assert torch.equal(first.slots[1].coef_E, whole.slots[1].coef_E)


def test_global_scope_running_sum_over_micro_batches_and_ranks():
    """Micro-batch j's f: counts of micro-batches 0..j, summed over the dp ranks (`reduce`,
    here one other rank whose counts are LAYER_B's); earlier micro-batches keep theirs."""
    cfg = RouterConfig(balance_coeff=1.0, balance_scope="global")
    other = torch.tensor([2.0, 2.0, 4.0, 4.0], dtype=torch.float64)     # its counts and tokens

    def reduce(t):
        t += other
    step = BalanceStep(cfg, 3, 2, reduce=reduce)
    first, second = holder_with({0: LAYER_A}), holder_with({0: LAYER_A})
    step.finish(first)
    coef_first = first.slots[0].coef_E.clone()
    step.finish(second)
    # first: counts (4,3,1)+(2,2,4) over 8 tokens; second: twice that over 16 tokens (same f)
    want_first = [3 * c / (8 * 2) / 4 for c in (6, 5, 5)]
    assert coef_first.tolist() == pytest.approx(want_first, rel=1e-15)
    assert second.slots[0].coef_E.tolist() == pytest.approx(want_first, rel=1e-15)
    assert torch.equal(first.slots[0].coef_E, coef_first)       # not changed by the second
    third = holder_with({0: parts([8, 0, 0], [4.0, 0.0, 0.0], 4)})
    step.finish(third)     # counts (6,5,5)*2 + (8,0,0) + (2,2,4) = (22, 12, 14) over 24 tokens
    assert third.slots[0].coef_E.tolist() == pytest.approx(
        [3 * c / (24 * 2) / 4 for c in (22, 12, 14)], rel=1e-15)


@pytest.mark.parametrize("field, value, message", [
    ("balance_loss", "hf", "router.balance_loss='hf' is not one of 'per_layer', 'all_layers'"),
    ("balance_scope", "step", "router.balance_scope='step' is not one of 'micro_batch', 'global'"),
])
def test_config_names_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**{field: value})


def test_expert_choice_has_no_balance_definition_to_choose():
    with pytest.raises(ValueError, match="expert-choice routing is balanced by construction"):
        RouterConfig(type="expert_choice", capacity_factor=1.0, balance_loss="all_layers")


def test_deferred_only_when_it_differs_from_the_per_call_loss():
    assert not RouterConfig().deferred_balance
    assert RouterConfig(balance_loss="all_layers").deferred_balance
    assert RouterConfig(balance_scope="global").deferred_balance
    assert not RouterConfig(balance_loss="all_layers", balance_coeff=0.0).deferred_balance


def moe_grads(dim=16, **router):
    torch.manual_seed(0)
    moe = MoE(dim, 24, 8, 2, aux_loss_scale=1.0, router=RouterConfig(**router)).double()
    x = torch.randn(3, 10, dim, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    (out.y * 0).sum().backward()       # only the injected losses reach the parameters
    return moe.router.weight.grad, x.grad, out


def test_one_layer_all_layers_is_k_times_per_layer():
    """With one MoE layer transformers' loss is K times the Switch loss (f sums to K, not 1):
    all_layers at coefficient c trains as per_layer at c*K (the export's exact conversion)."""
    w_all, x_all, out = moe_grads(balance_loss="all_layers", balance_coeff=0.01)
    w_per, x_per, _ = moe_grads(balance_coeff=0.02)
    torch.testing.assert_close(w_all, w_per, rtol=1e-12, atol=1e-18)
    torch.testing.assert_close(x_all, x_per, rtol=1e-12, atol=1e-18)
    assert out.aux_loss.parts.prob_sum_E.requires_grad is False     # returned detached


def test_global_scope_alone_is_the_micro_batch():
    """A layer (or model) run without a step has only its own micro-batch to count."""
    w_global, x_global, _ = moe_grads(balance_scope="global", balance_coeff=0.03)
    w_micro, x_micro, _ = moe_grads(balance_coeff=0.03)
    torch.testing.assert_close(w_global, w_micro, rtol=1e-12, atol=1e-18)
    torch.testing.assert_close(x_global, x_micro, rtol=1e-12, atol=1e-18)


def test_recompute_finds_the_slot_and_injects_once():
    """Activation recompute (full blocks) re-runs each MoE layer in backward: the slot it finds
    keeps the first forward's sums and its coefficient, so gradients are unchanged."""
    from moepar.parallel.checkpointing import apply_recompute
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                      num_experts=4, top_k=2)
    router = RouterConfig(balance_loss="all_layers", balance_scope="global", balance_coeff=0.1)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg, router, seed=3).double()
        if recompute:
            apply_recompute(model, "full")
        logits, _ = model(tokens)
        logits.square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


from test_router import _WholeGroup  # noqa: E402  (a token group of one slice)


def test_sequence_parallel_router_gives_the_same_deferred_sums():
    cfg = RouterConfig(balance_loss="all_layers", capacity_factor=1.0)
    torch.manual_seed(0)
    from moepar.layers.router import TopKRouter
    router = TopKRouter(16, 8, 2, cfg).double()
    x = torch.randn(30, 16, dtype=torch.float64)
    _, plain, _ = router(x, seq_len=10)
    use_token_group(router, _WholeGroup())
    _, grouped, _ = router(x, seq_len=10)
    assert type(router).__name__ == "SequenceParallelRouter"
    assert torch.equal(grouped.parts.counts_E, plain.parts.counts_E)
    assert grouped.parts.num_tokens == plain.parts.num_tokens == 30
    torch.testing.assert_close(grouped.parts.prob_sum_E, plain.parts.prob_sum_E, rtol=1e-14, atol=0)
    assert math.isclose(float(plain.total), 0.0)      # the balance term is the holder's now


@pytest.mark.parametrize("router", [dict(balance_loss="all_layers"), dict(balance_scope="global"),
                                    dict(balance_loss="all_layers", balance_scope="global")],
                         ids=["all_layers", "global", "all_layers_global"])
def test_deferred_balance_adds_no_host_sync(router):
    """The budget of tests/unit/test_syncs.py holds with a deferred balance loss: dropless
    float32 layers make no sync in forward (their offsets stay on the device), finishing
    included; none in backward."""
    from synccount import SyncCounter
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                      num_experts=4, top_k=2)
    model = Transformer(cfg, RouterConfig(**router), seed=1)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens)[0].sum().backward()      # warm-up (grouped-GEMM probe cache)
    with SyncCounter() as fwd:
        holder = MicroBalance()
        logits, _ = model(tokens, holder)
        BalanceStep(model.router_cfg, 4, 2).finish(holder)
    with SyncCounter() as bwd:
        logits.sum().backward()
    assert fwd.count == 0, f"forward syncs:\n{fwd.report()}"
    assert bwd.count == 0, f"backward syncs:\n{bwd.report()}"
