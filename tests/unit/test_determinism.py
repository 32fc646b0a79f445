"""Deterministic sums over a token's copies: `sum_rows` / `gather_rows` against index_add, and no
float accumulation that depends on the order of GPU atomics anywhere in a MoE layer's forward
and backward (tests/atomics.py), for every routing. The EP dispatchers: tests/dist/test_ep.py."""

import pytest
import torch

from atomics import FloatAtomics
from moepar.layers import MoE
from moepar.layers.dispatch import gather_rows, segment_slots, sum_rows

DIM, FFN, E, K, T = 16, 8, 4, 2, 24


def random_index(num_src, num_dest, max_per_dest, seed):
    """A random index with at most max_per_dest sources per destination (some get none)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_dest).repeat(max_per_dest)
    return pool[torch.randperm(pool.numel(), generator=gen)[:num_src]]


@pytest.mark.parametrize("seed", range(4))
def test_segment_slots_lists_each_destination_sources_in_order(seed):
    index = random_index(17, 9, 3, seed)
    slots = segment_slots(index, 9, 3)
    for d in range(9):
        want = [s for s in range(17) if index[s] == d] + [17] * 3
        assert slots[d].tolist() == want[:3], d


def test_segment_slots_refuses_a_bound_that_is_too_small():
    with pytest.raises(IndexError):
        segment_slots(torch.tensor([0, 1, 1, 1]), 2, 2)


@pytest.mark.parametrize("seed", range(4))
def test_sum_rows_and_gather_rows_equal_index_add_and_index_select(seed):
    gen = torch.Generator().manual_seed(seed)
    num_src, num_dest, bound = 23, 11, 4
    index = random_index(num_src, num_dest, bound, seed)
    slots = segment_slots(index, num_dest, bound)
    src = torch.randn(num_src, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    grad = torch.randn(num_dest, 5, dtype=torch.float64, generator=gen)
    got = sum_rows(src, index, slots)
    want = torch.zeros(num_dest, 5, dtype=torch.float64).index_add(0, index, src.detach())
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    got.backward(grad)
    torch.testing.assert_close(src.grad, grad[index], rtol=0, atol=0)

    x = torch.randn(num_dest, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    rows = gather_rows(x, index, slots)
    assert torch.equal(rows, x.detach()[index])
    grad_rows = torch.randn(num_src, 5, dtype=torch.float64, generator=gen)
    rows.backward(grad_rows)
    want_grad = torch.zeros(num_dest, 5, dtype=torch.float64).index_add(0, index, grad_rows)
    torch.testing.assert_close(x.grad, want_grad, rtol=1e-14, atol=1e-14)


def test_float_atomics_detector_sees_repeated_index_add():
    """The detector itself: repeated destinations are found, unique ones are not."""
    src = torch.randn(3, 2)
    with FloatAtomics() as repeated:
        torch.zeros(2, 2).index_add(0, torch.tensor([0, 1, 0]), src)
    with FloatAtomics() as unique:
        torch.zeros(3, 2).index_add(0, torch.tensor([2, 0, 1]), src)
        torch.zeros(2, 2, dtype=torch.long).index_add(0, torch.tensor([0, 1, 0]),
                                                      torch.ones(3, 2, dtype=torch.long))
    assert repeated.ops == ["aten.index_add.default"] and unique.ops == []


ROUTERS = {
    "dropless": dict(),
    "capacity": dict(capacity_factor=1.0),
    "expert_choice": dict(type="expert_choice", capacity_factor=1.5),
    "seq_balance": dict(seq_balance_coeff=0.1, capacity_factor=0.75, drop_policy="position"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_moe_layer_has_no_order_dependent_float_accumulation(router, dtype):
    torch.manual_seed(0)
    moe = MoE(DIM, FFN, E, K, num_shared_experts=1, aux_loss_scale=1.0, **router).to(dtype)
    x = torch.randn(2, T // 2, DIM, dtype=dtype, requires_grad=True)
    with FloatAtomics() as atomics:
        out = moe(x)
        ((out.y * out.y).sum() + out.aux_loss.total).backward()
    assert atomics.ops == []
