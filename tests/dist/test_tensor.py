"""Tensor + sequence parallelism: every sharded piece equals its unsplit version, forward and
backward (outputs, input gradients, and parameter gradients gathered back to full tensors), for
building blocks, single layers and whole models (dense, MoE, GQA with kv heads < tp, "full"
q/k norm, MLA, tied embeddings, a vocabulary tp does not divide), at tp 2 and 4, in float64."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moepar.layers import ModelConfig, RouterConfig, Transformer
from moepar.parallel import comm
from moepar.parallel.checkpointing import apply_activation_checkpointing
from moepar.parallel.dims import ParallelDims
from moepar.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, TPShard, apply_tp,
                                    check_tp, copy_to_tp, full_tensor, gather_sequence,
                                    local_shard, reduce_from_tp, reduce_sequence_parallel_grads,
                                    scatter_sequence, tp_norm_parameters, tp_shard_spec)
from moepar.parallel.vocab import (VocabParallelEmbedding, padded_vocab_size,
                                   vocab_parallel_cross_entropy,
                                   vocab_parallel_linear_cross_entropy)

TOL = dict(rtol=1e-10, atol=1e-12)
B, S = 2, 8


def setup(tp: int):
    size = dist.get_world_size()
    meshes = ParallelDims(size, dp=size // tp, tp=tp).build_meshes("cpu")
    return ParallelDims(size, dp=size // tp, tp=tp), meshes, meshes.group("tp"), \
        meshes.dense.get_local_rank("tp")


def seq_slice(x, tp: int, rank: int):
    return x.chunk(tp, dim=1)[rank].detach().clone()


def assert_grads_match(sharded, reference, group, rank, expert_group=None):
    """Gradients of `sharded` after the tp reduction equal the reference's, parameter by parameter
    (sharded ones gathered to full tensors; routed experts summed over `expert_group`)."""
    reduce_sequence_parallel_grads(sharded, group)
    spec, ref = tp_shard_spec(sharded), dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        value, grad = p.detach(), p.grad
        if name in spec:   # this rank's piece, then the full tensor from every rank's piece
            torch.testing.assert_close(grad, local_shard(ref[name].grad, spec[name], rank), **TOL)
            value, grad = full_tensor(value, spec[name], group), full_tensor(grad, spec[name], group)
        elif "experts.w_" in name and expert_group is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=expert_group)
        assert torch.equal(value, ref[name].detach()), name
        torch.testing.assert_close(grad, ref[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


# ---- building blocks --------------------------------------------------------------------------

def case_linear_regions(tp: int):
    """Column then row linear, as sequence-parallel (gather / reduce-scatter) and as plain tensor
    parallel (copy / reduce) regions, against the unsplit two-layer MLP."""
    _, _, group, rank = setup(tp)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)   # the same layers on every rank
    lin1 = torch.nn.Linear(6, 4 * tp, dtype=torch.float64)
    lin2 = torch.nn.Linear(4 * tp, 6, bias=False, dtype=torch.float64)
    x = torch.randn(B, S, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(B, S, 6, dtype=torch.float64, generator=gen)
    (lin2(torch.tanh(lin1(x))) * g).sum().backward()
    col, row = ColumnParallelLinear(lin1, TPShard(0, tp), rank), RowParallelLinear(lin2, tp, rank)
    for sequence_parallel in (True, False):
        col.zero_grad(), row.zero_grad()
        if sequence_parallel:
            x_local = seq_slice(x, tp, rank).requires_grad_()
            y = scatter_sequence(row(torch.tanh(col(gather_sequence(x_local, group)))), group)
            (y * seq_slice(g, tp, rank)).sum().backward()
            torch.testing.assert_close(x_local.grad, seq_slice(x.grad, tp, rank), **TOL)
        else:
            x_full = x.detach().clone().requires_grad_()
            y = reduce_from_tp(row(torch.tanh(col(copy_to_tp(x_full, group)))), group)
            (y * g).sum().backward()
            torch.testing.assert_close(x_full.grad, x.grad, **TOL)
        for mod, ref in ((col, lin1), (row, lin2)):
            for name, p in mod.named_parameters():
                torch.testing.assert_close(full_tensor(p.grad, mod.spec, group),
                                           getattr(ref, name).grad, **TOL)


def case_vocab(tp: int, vocab: int):
    """The vocab-parallel embedding and cross-entropy against nn.Embedding and F.cross_entropy,
    with padding rows when tp does not divide the vocabulary."""
    _, _, group, rank = setup(tp)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    spec = TPShard(0, tp, padding=padded_vocab_size(vocab, tp) - vocab)
    table = torch.nn.Embedding(vocab, 5, dtype=torch.float64)
    tokens = torch.randint(vocab, (B, S), generator=gen)
    g = torch.randn(B, S, 5, dtype=torch.float64, generator=gen)
    (table(tokens) * g).sum().backward()
    local = VocabParallelEmbedding(local_shard(table.weight.detach(), spec, rank),
                                   rank * padded_vocab_size(vocab, tp) // tp, vocab, group, spec)
    x = local(tokens)
    torch.testing.assert_close(x, seq_slice(table(tokens), tp, rank), **TOL)
    (x * seq_slice(g, tp, rank)).sum().backward()
    torch.testing.assert_close(full_tensor(local.weight.grad, spec, group), table.weight.grad, **TOL)

    logits = torch.randn(B, S, vocab, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(vocab, (B, S), generator=gen)
    column_spec = TPShard(2, tp, padding=spec.padding)
    for reduction in ("mean", "sum", "none"):
        logits.grad = None
        ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        ref = ref.view(B, S) if reduction == "none" else ref
        mine = local_shard(logits.detach(), column_spec, rank).requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, targets, group, vocab, reduction)
        torch.testing.assert_close(loss, ref, **TOL)
        weight = torch.rand(ref.shape, dtype=torch.float64, generator=gen)
        (ref * weight).sum().backward()
        (loss * weight).sum().backward()
        torch.testing.assert_close(mine.grad, local_shard(logits.grad, column_spec, rank), **TOL)

    # From hidden states and this rank's head rows, chunked (3 tokens: chunks that do not divide
    # the 16 tokens; None: one chunk): dh is this rank's share, summed over tp here (the model's
    # sequence gather does it in backward).
    h = torch.randn(B, S, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    head = torch.randn(vocab, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    # ...also with targets -100 (padding: no loss, no gradient, not counted by the mean)
    ignored = targets.masked_fill(torch.rand(B, S, generator=gen) < 0.4, -100)
    for reduction, chunk, tgt in [(r, c, t) for r in ("mean", "sum", "none") for c in (3, None)
                                  for t in (targets, ignored)]:
        h.grad = head.grad = None
        ref = F.cross_entropy(F.linear(h, head).flatten(0, 1), tgt.flatten(),
                              reduction=reduction)
        ref = ref.view(B, S) if reduction == "none" else ref
        h_mine = h.detach().clone().requires_grad_()
        w_mine = local_shard(head.detach(), spec, rank).requires_grad_()
        loss = vocab_parallel_linear_cross_entropy(h_mine, w_mine, tgt, group, vocab,
                                                   reduction, chunk=chunk)
        torch.testing.assert_close(loss, ref, **TOL)
        weight = torch.rand(ref.shape, dtype=torch.float64, generator=gen)
        (ref * weight).sum().backward()
        (loss * weight).sum().backward()
        dh = h_mine.grad.clone()
        dist.all_reduce(dh, group=group)
        torch.testing.assert_close(dh, h.grad, **TOL)
        torch.testing.assert_close(w_mine.grad, local_shard(head.grad, spec, rank), **TOL)


# ---- layers and whole models ------------------------------------------------------------------

TINY = dict(vocab_size=37, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=32,
            moe_ffn_dim=16, num_experts=4, top_k=2, max_seq_len=S)

# Dropless, and only the z-loss (linear in tokens): exact when each tp rank routes its slice.
EXACT_ROUTER = dict(balance_coeff=0.0, seq_balance_coeff=0.0, z_coeff=1e-2)
MODELS = {
    # two dense layers, q/k/v biases, untied head; kv heads 2 (replicated at tp 4)
    "dense": (dict(first_k_dense=2, attention_bias=True), {}),
    # a dense then an MoE layer (shared gated expert), one kv head, per-head q/k norm, tied
    # embeddings, dropless routing with z-loss (linear in tokens, so exact under sequence splits)
    "moe": (dict(first_k_dense=1, num_kv_heads=1, qk_norm="head", tie_embeddings=True,
                 num_shared_experts=1, shared_gate=True),
            EXACT_ROUTER),
    # the norm over all heads' features: sharded (tp 2) or on replicated kv heads (tp 4)
    "full_qk_norm": (dict(first_k_dense=2, qk_norm="full", activation="gelu"), {}),
    "mla": (dict(first_k_dense=1, attention="mla", q_lora_rank=12, kv_lora_rank=8,
                 qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6), EXACT_ROUTER),
}


def build(name: str, tp: int, router_extra=None):
    model_kw, router_kw = MODELS[name]
    cfg = ModelConfig(**{**TINY, **model_kw})
    torch.manual_seed(0)
    reference = Transformer(cfg, RouterConfig(**{**router_kw, **(router_extra or {})})).double()
    dims, meshes, group, rank = setup(tp)
    return reference, apply_tp(copy.deepcopy(reference), dims, meshes, seq_len=S), group, rank


def case_layers(name: str, tp: int):
    """Each block's attention and dense FFN alone: x_BsD in, x_BsD out."""
    reference, model, group, rank = build(name, tp)
    gen = torch.Generator().manual_seed(2)
    cos, sin = reference.rope_cos[:S], reference.rope_sin[:S]
    for block_ref, block in zip(reference.layers, model.layers):
        pairs = [(block_ref.attn, block.attn, (cos, sin))]
        if not block.is_moe:
            pairs.append((block_ref.ffn, block.ffn, ()))
        for ref_layer, layer, extra in pairs:
            x = torch.randn(B, S, TINY["dim"], dtype=torch.float64, generator=gen, requires_grad=True)
            g = torch.randn(B, S, TINY["dim"], dtype=torch.float64, generator=gen)
            y_ref = ref_layer(x, *extra)
            (y_ref * g).sum().backward()
            x_local = seq_slice(x, tp, rank).requires_grad_()
            y = layer(x_local, *extra)
            torch.testing.assert_close(y, seq_slice(y_ref, tp, rank), **TOL)
            (y * seq_slice(g, tp, rank)).sum().backward()
            torch.testing.assert_close(x_local.grad, seq_slice(x.grad, tp, rank), **TOL)
            assert_grads_match(layer, ref_layer, group, rank)


def run_model(reference, model, group, rank, tp):
    gen = torch.Generator().manual_seed(3)
    vocab = reference.cfg.vocab_size
    tokens, targets = torch.randint(vocab, (2, B, S), generator=gen)
    logits_ref, _ = reference(tokens)
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), targets.flatten())
    loss_ref.backward()
    with torch.no_grad():
        logits, _ = model(tokens)
    column_spec = TPShard(2, tp, padding=padded_vocab_size(vocab, tp) - vocab)
    torch.testing.assert_close(logits, local_shard(logits_ref.detach(), column_spec, rank), **TOL)
    # The training path: hidden states and this rank's head rows, no logits (parallel/loss.py).
    loss, moe_outputs = model(tokens, head_fn=lambda h, w: vocab_parallel_linear_cross_entropy(
        h, w, targets, group, vocab, chunk=5))
    torch.testing.assert_close(loss, loss_ref, **TOL)
    loss.backward()
    # Routed experts are replicated over tp at ep=1; the data-parallel reducer sums them over
    # edp, which spans these tp ranks: the test sums over tp alone (one dp replica).
    assert_grads_match(model, reference, group, rank, expert_group=group)
    # The global norm of the non-expert gradients: shards (each piece once) summed over tp.
    sharded, replicated, _ = tp_norm_parameters(model, group)
    squares = sum(p.grad.square().sum() for p in sharded)
    dist.all_reduce(squares, group=group)
    squares = squares + sum(p.grad.square().sum() for p in replicated)
    expected = sum(p.grad.square().sum() for name, p in reference.named_parameters()
                   if "experts.w_" not in name)
    torch.testing.assert_close(squares, expected, **TOL)
    return moe_outputs


def case_model(name: str, tp: int, checkpointing: bool = False):
    reference, model, group, rank = build(name, tp)
    if checkpointing:   # recompute re-runs the sequence collectives inside backward
        apply_activation_checkpointing(model)
    run_model(reference, model, group, rank, tp)


def case_moe_capacity_and_balance_as_unsplit(tp: int):
    """With capacity and balance losses the micro-batch is still one routing group: the routers'
    sequence token group gathers drop decisions and loss sums over tp, so the sharded model
    equals the unsplit one (drops, aux losses and every gradient)."""
    extra = dict(capacity_factor=1.0, balance_coeff=0.1, seq_balance_coeff=0.05, z_coeff=1e-2)
    reference, model, group, rank = build("moe", tp, extra)
    for m in (reference, model):
        m.set_aux_loss_scale(1.0)
    outputs = run_model(reference, model, group, rank, tp)
    dropped = torch.stack([o.stats.num_dropped for o in outputs]).sum()
    dist.all_reduce(dropped, group=group)
    assert dropped > 0   # capacity 1.0 drops something: the test exercises the drop path
    return float(dropped), [float(o.aux_loss.total) for o in outputs]


def case_collective_counts(tp: int):
    """Collectives per phase (forward and backward): the tables in parallel/tensor.py."""
    reference, model, group, rank = build("full_qk_norm", tp)
    counts, patched = {}, []
    # The functions comm.py and tensor/vocab.py call, spied on wherever a module holds them.
    real = {"all_gather": getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            "reduce_scatter": getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
            "all_reduce": dist.all_reduce}

    def spy(kind):
        def call(*args, **kwargs):
            counts[kind] = counts.get(kind, 0) + 1
            return real[kind](*args, **kwargs)
        return call

    for kind, fn in real.items():
        for module in (dist, comm):
            for attr in [a for a, v in vars(module).items() if v is fn]:
                patched.append((module, attr, fn))
                setattr(module, attr, spy(kind))
    phases = {}

    def phase(name, fn):
        counts.clear()
        out = fn()
        phases[name] = dict(counts)
        return out

    try:
        gen = torch.Generator().manual_seed(4)
        tokens, targets = torch.randint(TINY["vocab_size"], (2, B, S), generator=gen)
        x = torch.randn(B, S // tp, TINY["dim"], dtype=torch.float64, requires_grad=True)
        cos, sin = model.rope_cos[:S], model.rope_sin[:S]
        y, _ = phase("block forward", lambda: model.layers[0](x, cos, sin))
        phase("block backward", lambda: y.sum().backward())
        (hidden, weight), _ = phase("model forward",
                                    lambda: model(tokens, head_fn=lambda h, w: (h, w)))
        loss = phase("loss forward", lambda: vocab_parallel_linear_cross_entropy(
            hidden, weight, targets, group, TINY["vocab_size"], chunk=5))
        phase("model backward", lambda: loss.backward())
        phase("after backward", lambda: reduce_sequence_parallel_grads(model, group))
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)
    return phases


def case_qkv_rows(tp: int):
    """Each rank's qkv_proj shard (weight and bias) is the rows of its q heads, then of the k
    heads and the v heads they read, cut from the unsplit fused weight by head index."""
    reference, model, _, rank = build("dense", tp)
    H, G = TINY["num_heads"], TINY["num_kv_heads"]
    hd = TINY["dim"] // H
    q_heads = range(rank * H // tp, (rank + 1) * H // tp)
    # G >= tp: G/tp kv heads each; G < tp: the one kv head rank r's q heads read (h // (H/G)).
    kv_heads = range(rank * G // tp, (rank + 1) * G // tp) if G >= tp else [q_heads[0] // (H // G)]
    rows = ([range(h * hd, (h + 1) * hd) for h in q_heads]
            + [range((H + g) * hd, (H + g + 1) * hd) for g in kv_heads]
            + [range((H + G + g) * hd, (H + G + g + 1) * hd) for g in kv_heads])
    index = torch.tensor([i for r in rows for i in r])
    for block_ref, block in zip(reference.layers, model.layers, strict=True):
        full, local = block_ref.attn.qkv_proj, block.attn.qkv_proj
        assert torch.equal(local.weight.detach(), full.weight.detach()[index])
        assert torch.equal(local.bias.detach(), full.bias.detach()[index])
        assert (block.attn.num_heads, block.attn.num_kv_heads) == (len(q_heads), len(kv_heads))


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_shard_is_the_rows_of_its_heads(worlds, tp):
    worlds(tp).run(case_qkv_rows, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_building_blocks(worlds, tp):
    worlds(tp).run(case_linear_regions, tp)
    worlds(tp).run(case_vocab, tp, 4 * tp + 1)


@pytest.mark.parametrize("name", list(MODELS))
def test_layers(worlds, name):
    worlds(2).run(case_layers, name, 2)
    worlds(4).run(case_layers, name, 4)


@pytest.mark.parametrize("name", list(MODELS))
def test_model(worlds, name):
    worlds(2).run(case_model, name, 2)
    worlds(4).run(case_model, name, 4)


def test_model_tp_within_dp(worlds):
    """tp 2 inside a world of 4 (dp 2): each tp pair is its own group."""
    worlds(4).run(case_model, "moe", 2)


def test_model_with_activation_checkpointing(worlds):
    worlds(2).run(case_model, "moe", 2, True)


@pytest.mark.parametrize("tp", [2, 4])
def test_moe_capacity_and_balance_as_unsplit(worlds, tp):
    results = worlds(tp).run(case_moe_capacity_and_balance_as_unsplit, tp)
    assert all(r == results[0] for r in results)     # every rank reports the same losses


def test_collective_counts(worlds):
    phases = worlds(2).run(case_collective_counts, 2)[0]
    layers = TINY["num_layers"]
    # A dense block with a "full" q/k norm: sequence all-gather and reduce-scatter around
    # attention and the FFN, and an all-reduce of the sum of squares per norm (q and k), each way.
    assert phases["block forward"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}
    assert phases["block backward"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}
    # The model adds the embedding's reduce-scatter and the head's all-gather; the loss two
    # all-reduces forward (once per call, whatever its chunks) and nothing backward; one
    # all-reduce of replicated grads per step.
    per_model = {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1,
                 "all_reduce": 2 * layers}
    assert phases["model forward"] == per_model
    assert phases["loss forward"] == {"all_reduce": 2}
    assert phases["model backward"] == per_model
    assert phases["after backward"] == {"all_reduce": 1}


def test_check_tp_names_the_problem():
    cfg = ModelConfig(**{**TINY, "num_heads": 6, "num_kv_heads": 3, "dim": 36, "ffn_dim": 30})
    with pytest.raises(ValueError, match="model.num_heads=6 must be divisible by parallel.tp=4"):
        check_tp(cfg, 4)
    with pytest.raises(ValueError, match="model.num_kv_heads=3 and parallel.tp=2"):
        check_tp(ModelConfig(**{**TINY, "num_kv_heads": 3, "num_heads": 6, "dim": 36}), 2)
    with pytest.raises(ValueError, match="model.ffn_dim=30 must be divisible by parallel.tp=4"):
        check_tp(ModelConfig(**{**TINY, "ffn_dim": 30, "first_k_dense": 1}), 4)
    with pytest.raises(ValueError, match="train.seq_len=6 must be divisible by parallel.tp=4"):
        check_tp(ModelConfig(**TINY), 4, seq_len=6)
    check_tp(ModelConfig(**{**TINY, "num_kv_heads": 1}), 4, seq_len=8)
    # an all-MoE model has no dense FFN to split
    check_tp(ModelConfig(**{**TINY, "ffn_dim": 30, "first_k_dense": 0}), 4)


def test_local_shard_round_trip_by_hand():
    """[gate; up] chunks and vocab padding, on a tensor whose values name their row."""
    full = torch.arange(8.0).unsqueeze(1)
    assert local_shard(full, TPShard(0, 2, chunks=2), 1).flatten().tolist() == [2, 3, 6, 7]
    assert local_shard(full[:7], TPShard(0, 4, padding=1), 3).flatten().tolist() == [6, 0]
