"""Each differentiable collective, forward and backward, against values computed by hand."""

import pytest
import torch
import torch.distributed as dist

from moepar.parallel import comm


def case_all_to_all_uneven():
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    # rank r sends (r + j) % 3 rows to rank j (some zero); row value encodes (src, dst, index)
    send = [(rank + j) % 3 for j in range(size)]
    recv = [(j + rank) % 3 for j in range(size)]
    rows = [torch.full((1, 2), 100.0 * rank + 10 * j + i, dtype=torch.float64)
            for j in range(size) for i in range(send[j])]
    x = (torch.cat(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)).requires_grad_()
    y = comm.all_to_all(x, recv, send, group)
    expected = [100.0 * j + 10 * rank + i for j in range(size) for i in range(recv[j])]
    assert y[:, 0].tolist() == expected, (y[:, 0].tolist(), expected)
    # backward routes each received row's gradient back to its sender's row
    weight = torch.arange(y.shape[0], dtype=torch.float64).unsqueeze(1) + 1000 * rank
    (y * weight).sum().backward()
    # row i of mine went to rank j at its position: check via a second forward of the gradient
    back = comm.all_to_all(weight.expand(-1, 2).contiguous(), send, recv, group)
    assert torch.equal(x.grad, back)
    return y.shape[0]


def case_gather_and_reduce_scatter():
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    g = comm.all_gather_rows(x, group)
    assert g[:, 0].tolist() == [float(r + 1) for r in range(size) for _ in range(2)]
    (g * (rank + 1)).sum().backward()
    # every rank weights all gathered rows by (its rank + 1); my rows' grad sums those weights
    assert torch.all(x.grad == sum(r + 1 for r in range(size)))
    y = torch.arange(2 * size, dtype=torch.float64).unsqueeze(1).repeat(1, 3).requires_grad_()
    s = comm.reduce_scatter_rows(y * (rank + 1), group)
    total = sum(r + 1 for r in range(size))
    assert s[:, 0].tolist() == [total * v for v in (2 * rank, 2 * rank + 1)]
    s.sum().backward()
    assert torch.all(y.grad == rank + 1)


def case_size_one_group_short_circuits():
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    x = torch.randn(3, 2, requires_grad=True)
    assert comm.all_to_all(x, [3], [3], group) is x
    assert comm.all_gather_rows(x, group) is x
    assert comm.reduce_scatter_rows(x, group) is x


@pytest.mark.parametrize("size", [2, 4])
def test_all_to_all_uneven(worlds, size):
    worlds(size).run(case_all_to_all_uneven)


@pytest.mark.parametrize("size", [2, 4])
def test_gather_and_reduce_scatter(worlds, size):
    worlds(size).run(case_gather_and_reduce_scatter)


def test_size_one_group_short_circuits(worlds):
    worlds(2).run(case_size_one_group_short_circuits)


def case_async_all_to_all_equals_blocking():
    """all_to_all_start / all_to_all_wait: the same rows and gradients as the blocking all_to_all,
    with two transfers in flight at once, compute between start and wait, and backward issuing
    the reverse in the wait's backward (timed by an A2ATimer: every call is clocked)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    send = [(rank + 2 * j) % 4 for j in range(size)]
    recv = [(j + 2 * rank) % 4 for j in range(size)]
    xs = [torch.randn(sum(send), 3, dtype=torch.float64, generator=gen) for _ in range(2)]
    grads = [torch.randn(sum(recv), 3, dtype=torch.float64, generator=gen) for _ in range(2)]
    timer = comm.A2ATimer()
    a, b = (x.clone().requires_grad_() for x in xs)
    flights = [comm.flight(recv, send, group, timer) for _ in range(2)]
    in_flight = [(comm.all_to_all_start(a, flights[0]), flights[0]),
                 (comm.all_to_all_start(b * 2.0, flights[1]), flights[1])]
    busy = torch.randn(64, 64, dtype=torch.float64, generator=gen)
    for _ in range(3):
        busy = busy @ busy / 64      # compute while both transfers are in flight
    ya, yb = (comm.all_to_all_wait(rows, flight) for rows, flight in in_flight)
    ((ya * grads[0]).sum() + (yb * grads[1]).sum()).backward()
    c, d = (x.clone().requires_grad_() for x in xs)
    za, zb = comm.all_to_all(c, recv, send, group), comm.all_to_all(d * 2.0, recv, send, group)
    ((za * grads[0]).sum() + (zb * grads[1]).sum()).backward()
    assert torch.equal(ya, za) and torch.equal(yb, zb)
    assert torch.equal(a.grad, c.grad) and torch.equal(b.grad, d.grad)
    dist.barrier()
    assert len(timer.done_times) == 4   # two transfers, each forward and backward


@pytest.mark.parametrize("size", [2, 4])
def test_async_all_to_all_equals_blocking(worlds, size):
    worlds(size).run(case_async_all_to_all_equals_blocking)
