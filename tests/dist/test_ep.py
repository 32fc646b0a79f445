"""Expert parallelism: dispatchers round-trip under adversarial routing, and the EP MoE layer
equals the single-process layer (outputs, expert gradients on their owner, router gradients
after reduction), for every dispatcher, dropless and capacity, ep 2 and 4."""

import copy
import types

import pytest
import torch
import torch.distributed as dist

from idexperts import times_expert_id
from marks import Mark

from moepar.layers import MoE, Routing
from moepar.parallel.alltoall import AllToAllDispatcher
from moepar.parallel.dims import ParallelDims
from moepar.parallel.expert import apply_ep
from moepar.parallel.splitcheck import SplitMismatchError

DIM, FFN, E, K, T = 8, 12, 8, 2, 10


def setup(ep: int):
    rank, size = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.resolve(size, ep=ep, num_experts=E)
    return rank, dims, dims.build_meshes("cpu")


def routing_for(scenario: str, rank: int, gen) -> Routing:
    token = torch.arange(T).repeat_interleave(K)
    weight = torch.rand(T * K, dtype=torch.float64, generator=gen)
    if scenario == "random":
        expert = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).flatten()
    elif scenario == "one_expert":        # every copy to expert 0 (k copies of a token: 0 and 1)
        expert = torch.tensor([0, 1] * T)
    elif scenario == "empty_but_one":     # all but one expert get nothing; others dropped
        expert = torch.tensor([E - 1, E] * T)
    elif scenario == "rank0_sends_nothing":
        expert = torch.full((T * K,), E) if rank == 0 else torch.tensor([0, 2] * T)
    elif scenario == "same_rank_pairs":   # both copies on one EP rank: what dedup removes
        expert = torch.tensor([2, 3] * T)
    else:
        raise ValueError(scenario)
    return Routing(token, expert, weight, K)


def case_round_trip(ep: int, dispatcher: str, scenario: str, chunks: int = 1):
    """Experts multiply by (global id + 1); combine must give sum_k w * x * (e + 1) per token."""
    rank, dims, meshes = setup(ep)
    moe = apply_ep(MoE(DIM, FFN, E, K).double(), dims, meshes, rank, dispatcher, debug=True,
                   a2a_chunks=chunks)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    routing = routing_for(scenario, rank, gen)
    x_RD, plan = moe.dispatcher.dispatch(x, routing)
    assert len(plan.chunks) == len(x_RD) == min(chunks, E // ep)
    y_RD = times_expert_id(x_RD, plan, moe.experts.expert_offset)
    y = moe.dispatcher.combine(y_RD, plan, routing.weight_N)
    expected = torch.zeros(T, DIM, dtype=torch.float64)
    for n in range(T * K):
        e = int(routing.expert_N[n])
        if e < E:
            t = int(routing.token_N[n])
            expected[t] += routing.weight_N[n] * x[t].detach() * (e + 1)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    y.sum().backward()
    scale = torch.zeros(T, dtype=torch.float64)
    for n in range(T * K):
        if int(routing.expert_N[n]) < E:
            scale[int(routing.token_N[n])] += routing.weight_N[n] * (int(routing.expert_N[n]) + 1)
    torch.testing.assert_close(x.grad, scale.unsqueeze(1).expand(-1, DIM), rtol=1e-12, atol=1e-12)


def with_chunks(moe, chunks: int, meshes, debug: bool = True):
    """The all-to-all dispatcher with `chunks` expert chunks (apply_ep builds one chunk)."""
    moe.dispatcher = AllToAllDispatcher(moe.num_experts, meshes.group("ep"), 0, debug=debug,
                                        chunks=chunks)
    return moe


def case_layer_parity(ep: int, dispatcher: str, capacity_factor, chunks: int = 1):
    rank, dims, meshes = setup(ep)
    size = dist.get_world_size()
    torch.manual_seed(0)
    kwargs = dict(capacity_factor=capacity_factor, balance_coeff=0.01, z_coeff=0.001)
    reference = MoE(DIM, FFN, E, K, num_shared_experts=1, **kwargs).double()
    sharded = apply_ep(copy.deepcopy(reference), dims, meshes, rank, dispatcher, debug=True)
    if chunks > 1:
        sharded = with_chunks(sharded, chunks, meshes)
        assert sharded.dispatcher.chunks == min(chunks, E // ep)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, T, DIM, dtype=torch.float64, generator=gen) for _ in range(size)]
    gs = [torch.randn(2, T, DIM, dtype=torch.float64, generator=gen) for _ in range(size)]
    # Reference: each rank's input is its own capacity group, as under EP.
    ref_outputs = []
    for x, g in zip(xs, gs):
        out = reference(x)
        ref_outputs.append(out.y.detach())
        ((out.y * g).sum() + out.aux_loss.total).backward()
    out = sharded(xs[rank])
    torch.testing.assert_close(out.y, ref_outputs[rank], rtol=1e-10, atol=1e-12)
    ((out.y * gs[rank]).sum() + out.aux_loss.total).backward()
    # Expert grads on their owner: the sum over the EP group's token streams, over all edp
    # groups after summing over edp.
    edp_group = meshes.group("edp")
    first, local = sharded.experts.expert_offset, sharded.experts.num_experts
    for name in ("w_in_EDU", "w_out_EFD"):
        grad = getattr(sharded.experts, name).grad.clone()
        dist.all_reduce(grad, group=edp_group)
        ref = getattr(reference.experts, name).grad[first:first + local]
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12, msg=name)
    for (name, p), q in zip(sharded.named_parameters(), reference.parameters()):
        if name.startswith("experts."):
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)  # dense parameters: summed over every rank's tokens
        torch.testing.assert_close(grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def case_split_mismatch_raises(ep: int):
    rank, dims, meshes = setup(ep)
    moe = apply_ep(MoE(DIM, FFN, E, K).double(), dims, meshes, rank, "alltoall", debug=True)
    real = moe.dispatcher.exchange_counts

    def corrupt(*args):
        sent, received, recv_PE = real(*args)
        if rank == 1:
            received[0][0] += 1   # rank 1 now expects a row rank 0 never sends
        return sent, received, recv_PE

    moe.dispatcher.exchange_counts = corrupt
    x = torch.randn(T, DIM, dtype=torch.float64)
    try:
        moe(x)
    except SplitMismatchError as e:
        assert "MoE layer 0 dispatch" in str(e) and "EP rank 0" in str(e)
        return "raised"
    raise AssertionError("no SplitMismatchError")


SCENARIOS = ["random", "one_expert", "empty_but_one", "rank0_sends_nothing", "same_rank_pairs"]
KINDS = ["alltoall", "dedup", "allgather"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(worlds, kind, scenario):
    worlds(4).run(case_round_trip, 4, kind, scenario)
    worlds(4).run(case_round_trip, 2, kind, scenario)


@pytest.mark.parametrize("scenario", ["random", "rank0_sends_nothing"])
def test_round_trip_chunked(worlds, scenario):
    worlds(4).run(case_round_trip, 2, "alltoall", scenario, 4)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_layer_parity(worlds, kind, capacity_factor):
    worlds(2).run(case_layer_parity, 2, kind, capacity_factor)
    worlds(4).run(case_layer_parity, 4, kind, capacity_factor)
    worlds(4).run(case_layer_parity, 2, kind, capacity_factor)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("chunks", [2, 4])
def test_layer_parity_chunked(worlds, chunks, capacity_factor):
    worlds(2).run(case_layer_parity, 2, "alltoall", capacity_factor, chunks)
    worlds(4).run(case_layer_parity, 4, "alltoall", capacity_factor, chunks)
    worlds(4).run(case_layer_parity, 2, "alltoall", capacity_factor, chunks)


def case_chunked_is_bitwise_one_chunk(ep: int, chunks: int, dtype, capacity_factor):
    """Overlap is the plan's chunking: the layer with `chunks` expert chunks (each chunk's GEMMs
    between its all-to-all waits) against the same layer with one, bit for bit: outputs and
    every gradient."""
    rank, dims, meshes = setup(ep)
    torch.manual_seed(0)
    moe = MoE(DIM * 2, FFN * 2, E, K, num_shared_experts=1, aux_loss_scale=1.0,
              capacity_factor=capacity_factor).to(dtype)
    moe = apply_ep(moe, dims, meshes, rank, "alltoall", debug=True)
    one = moe.dispatcher
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(2, T, DIM * 2, generator=gen, dtype=dtype)
    g = torch.randn(2, T, DIM * 2, generator=gen, dtype=dtype)
    results = []
    for dispatcher in (one, with_chunks(moe, chunks, meshes).dispatcher):
        moe.dispatcher = dispatcher
        xi = x.clone().requires_grad_()
        y = moe(xi).y
        (y * g).sum().backward()
        results.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}))
        moe.zero_grad(set_to_none=True)
    assert moe.dispatcher.chunks == min(chunks, E // ep) > 1
    (y_one, dx_one, grads_one), (y, dx, grads) = results
    assert torch.equal(y, y_one) and torch.equal(dx, dx_one)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_one[name]), name
    return True


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
# float32: the native grouped GEMM, one GEMM per expert whatever the chunk (float64's padded
# fallback pads each chunk to its own longest expert, which may change the GEMM's blocking).
@pytest.mark.parametrize("case", [(2, torch.float32), (4, torch.float32)], ids=["c2", "c4"])
def test_chunked_is_bitwise_one_chunk(worlds, case, capacity_factor):
    chunks, dtype = case
    assert worlds(2).run(case_chunked_is_bitwise_one_chunk, 2, chunks, dtype,
                         capacity_factor) == [True, True]


def case_weight_grads_after_input_grad_leaves(ep: int, dispatcher: str):
    """Backward issues the all-to-all that takes the experts' input gradient back before it
    computes their weight gradients (which then run while it travels): the experts' weights get
    their gradients after the last all-to-all of the step is issued. One backward would compute
    them first, with the input gradient of the same GEMMs."""
    import time

    from moepar.parallel.comm import A2ATimer
    rank, dims, meshes = setup(ep)
    torch.manual_seed(0)
    moe = apply_ep(MoE(DIM, FFN, E, K), dims, meshes, rank, dispatcher)
    moe.dispatcher.timer = timer = A2ATimer()
    accumulated = {}

    def clock(name):
        def hook(_):
            accumulated[name] = time.perf_counter()
        return hook

    for name, p in moe.experts.named_parameters():
        p.register_post_accumulate_grad_hook(clock(name))
    x = torch.randn(2, T, DIM, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    moe(x).y.pow(2).sum().backward()
    assert len(timer.issue_times) >= 5      # counts; rows out, back; their gradients back, out
    return {name: at > timer.issue_times[-1] for name, at in accumulated.items()}


@pytest.mark.parametrize("dispatcher", ["alltoall", "dedup"])
def test_weight_grads_after_input_grad_leaves(worlds, dispatcher):
    expected = {"w_in_EDU": True, "w_out_EFD": True}
    assert worlds(2).run(case_weight_grads_after_input_grad_leaves, 2, dispatcher) == [expected] * 2


def case_zero3_experts_reshard_within_backward(ep: int, dispatcher: str, recompute: bool,
                                               chunks: int = 1, bf16: bool = False):
    """Under FSDP2 (zero=3) the experts' post-backward (reshard, reduce-scatter the gradients)
    runs once their weight gradients are complete, within the layer's backward, not in the
    final callback at the end of the whole backward (which would hold every layer's unsharded
    experts until then): the chunks' rows are the experts call's tensor inputs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from moepar.parallel.checkpointing import apply_recompute
    rank, dims, meshes = setup(ep)
    torch.manual_seed(0)
    moe = apply_ep(MoE(DIM, FFN, E, K), dims, meshes, rank, dispatcher)
    if chunks > 1:
        moe = with_chunks(moe, chunks, meshes)
    if recompute:
        apply_recompute(types.SimpleNamespace(layers=[types.SimpleNamespace(is_moe=True, ffn=moe)]),
                        "experts")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  cast_forward_inputs=False)
    fully_shard(moe.experts, mesh=meshes.expert["edp"], mp_policy=policy)
    events, post_backward = [], FSDPParamGroup.post_backward

    def recorded(group, *args, **kwargs):
        events.append("post-backward")
        return post_backward(group, *args, **kwargs)

    FSDPParamGroup.post_backward = recorded
    try:
        x = torch.randn(2, T, DIM, generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)
        reached = Mark.apply(x, events, "backward reached the layer's input")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = moe(reached).y
        y.float().pow(2).sum().backward()
    finally:
        FSDPParamGroup.post_backward = post_backward
    return events


@pytest.mark.parametrize("case", [("alltoall", False, 1, False), ("dedup", False, 1, False),
                                  ("alltoall", True, 1, False), ("alltoall", False, 2, True)],
                         ids=["alltoall", "dedup", "recompute-experts", "chunks2-bf16"])
def test_zero3_experts_reshard_within_backward(worlds, case):
    expected = ["post-backward", "backward reached the layer's input"]
    assert worlds(2).run(case_zero3_experts_reshard_within_backward, 2, *case) == [expected] * 2


def test_split_mismatch_raises_instead_of_hanging(worlds):
    assert worlds(2).run(case_split_mismatch_raises, 2, timeout=60) == ["raised", "raised"]


def case_bf16_rows_travel_as_bf16(dispatcher: str):
    """Under bf16 autocast the fp32 residual stream crosses the wire in bf16 (half the bytes)."""
    rank, dims, meshes = setup(2)
    moe = apply_ep(MoE(DIM * 2, FFN * 2, E, K), dims, meshes, rank, dispatcher)
    seen = []
    real = dist.all_to_all_single

    def spy(output, input, *args, **kwargs):
        if input.dim() == 2 and input.shape[-1] == DIM * 2:
            seen.append(input.dtype)
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = spy
    try:
        x = torch.randn(T, DIM * 2, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(x).y
        y.float().sum().backward()
    finally:
        dist.all_to_all_single = real
    assert y.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert seen and all(d == torch.bfloat16 for d in seen), seen
    return len(seen)


@pytest.mark.parametrize("dispatcher", ["alltoall", "dedup"])
def test_bf16_rows_travel_as_bf16(worlds, dispatcher):
    assert all(n >= 4 for n in worlds(2).run(case_bf16_rows_travel_as_bf16, dispatcher))


def case_sync_budget(ep: int, dispatcher: str, capacity_factor, chunks: int = 1):
    """One forward syncs the host once (the split sizes), backward never: the counts as CUDA
    would pay them (tests/synccount.py), on every rank, after a warm-up call."""
    from synccount import SyncCounter
    rank, dims, meshes = setup(ep)
    torch.manual_seed(0)
    moe = apply_ep(MoE(DIM * 2, FFN, E, K, num_shared_experts=1, aux_loss_scale=1.0,
                       capacity_factor=capacity_factor), dims, meshes, rank, dispatcher)
    if chunks > 1:
        moe = with_chunks(moe, chunks, meshes, debug=False)
    x = torch.randn(2, T, DIM * 2, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    moe(x).y.sum().backward()
    with SyncCounter() as fwd:
        y = moe(x).y
    with SyncCounter() as bwd:
        y.square().sum().backward()
    return fwd.count, bwd.count, fwd.report() + "\n" + bwd.report()


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_sync_budget(worlds, kind, capacity_factor):
    for fwd, bwd, report in worlds(2).run(case_sync_budget, 2, kind, capacity_factor):
        assert (fwd, bwd) == (1, 0), report


def test_sync_budget_with_chunks(worlds):
    for fwd, bwd, report in worlds(2).run(case_sync_budget, 2, "alltoall", 1.0, 4):
        assert (fwd, bwd) == (1, 0), report


def case_no_float_atomics(ep: int, dispatcher: str, router: dict):
    """No float accumulation whose rounding depends on the order of GPU atomics, forward and
    backward (tests/atomics.py); returns the offending ops."""
    from atomics import FloatAtomics
    rank, dims, meshes = setup(ep)
    torch.manual_seed(0)
    moe = apply_ep(MoE(DIM, FFN, E, K, num_shared_experts=1, aux_loss_scale=1.0, **router).double(),
                   dims, meshes, rank, dispatcher)
    x = torch.randn(2, T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    with FloatAtomics() as atomics:
        moe(x).y.square().sum().backward()
    return atomics.ops


ATOMIC_ROUTERS = {"dropless": {}, "capacity": dict(capacity_factor=1.0),
                  "expert_choice": dict(type="expert_choice", capacity_factor=1.5)}


@pytest.mark.parametrize("router", ATOMIC_ROUTERS.values(), ids=ATOMIC_ROUTERS.keys())
@pytest.mark.parametrize("kind", KINDS)
def test_no_order_dependent_float_accumulation(worlds, kind, router):
    assert worlds(2).run(case_no_float_atomics, 2, kind, router) == [[], []]
