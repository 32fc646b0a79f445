"""Where local tensors sit in the canonical ones (parallel/shards.py), checked against naive
slicing: every element of a local tensor maps to the element of the canonical tensor it is."""

import itertools
import math

import pytest
import torch

from moepar.layers import ModelConfig, RouterConfig, Transformer
from moepar.layers.init import CanonicalTensor, InitSpec, canonical_tensors, draw, init_weights
from moepar.parallel.shards import (flat_segments, flat_to_boxes, fsdp_range, fsdp_segments,
                                    local_view, tp_segments, whole_segments)
from moepar.parallel.tensor import FusedShard, TPShard, local_shard


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_to_boxes_covers_the_range_with_contiguous_boxes(shape):
    numel = math.prod(shape)
    ids = torch.arange(numel).view(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        got = []
        for flat_start, box in flat_to_boxes(shape, start, stop):
            region = ids[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
            # contiguous in memory: the box's ids are consecutive from its flat offset
            assert region.flatten().tolist() == list(range(flat_start, flat_start + box.numel))
            got += region.flatten().tolist()
        assert got == list(range(start, stop)), (shape, start, stop)


@pytest.mark.parametrize("length, world", [(8, 4), (5, 4), (3, 4), (1, 2), (0, 3)])
def test_fsdp_range_is_torch_chunk(length, world):
    chunks = torch.arange(length).chunk(world) if length else []
    for i in range(world):
        start, stop = fsdp_range(length, world, i)
        want = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(start, stop)) == want


def _check(full: torch.Tensor, local: torch.Tensor, segments, names=None):
    """Every segment's local view equals its canonical box, and the segments cover the local
    tensor except padding (which must not map anywhere)."""
    covered = torch.zeros_like(local, dtype=torch.int)
    for seg in segments:
        source = full if names is None else names[seg.name]
        box = source[tuple(slice(o, o + n) for o, n in zip(seg.canon.offsets, seg.canon.sizes))]
        torch.testing.assert_close(local_view(local, seg), box, rtol=0, atol=0)
        view = local_view(covered, seg)
        view += 1
    return covered


@pytest.mark.parametrize("spec, rank", [
    (TPShard(0, 2), 1), (TPShard(0, 4, chunks=2), 3), (TPShard(1, 2), 0),
    (TPShard(0, 4, padding=1), 3), (TPShard(0, 4, padding=2), 3), (TPShard(0, 4, replicas=2), 2)])
def test_tp_segments_match_local_shard(spec, rank):
    rows = 8 - spec.padding
    full = torch.arange(rows * 4, dtype=torch.float64).view(rows, 4)
    local = local_shard(full, spec, rank)
    covered = _check(full, local, tp_segments(whole_segments("w", full.shape), spec, rank))
    # the piece's padding rows (past row `rows` of the padded tensor) map nowhere, the rest once
    first_row = (rank // spec.replicas) * (8 // spec.num_pieces) if spec.dim == 0 else 0
    real_rows = max(0, min(local.shape[0], rows - first_row)) if spec.dim == 0 else local.shape[0]
    assert covered[:real_rows].eq(1).all() and covered[real_rows:].eq(0).all()


@pytest.mark.parametrize("tp, kv_heads, rank", [(2, 2, 1), (4, 2, 3), (4, 1, 2), (4, 1, 0)])
def test_fused_qkv_segments_are_each_ranks_heads(tp, kv_heads, rank):
    # qkv_proj rows [q of 4 heads; k of G heads; v of G heads], head dim 2: rank r holds q heads
    # [r*4/tp, (r+1)*4/tp) and the kv heads they read (G/tp heads, or head r // (tp/G), shared).
    heads, hd, dim = 4, 2, 3
    rows = (heads + 2 * kv_heads) * hd
    full = torch.arange(rows * dim, dtype=torch.float64).view(rows, dim)
    replicas = max(tp // kv_heads, 1)
    kv_spec = TPShard(0, tp, replicas=replicas)
    spec = FusedShard((heads * hd, kv_heads * hd, kv_heads * hd), (TPShard(0, tp), kv_spec, kv_spec))
    local = local_shard(full, spec, rank)
    q_heads = range(rank * heads // tp, (rank + 1) * heads // tp)
    kv = range(rank // replicas * kv_heads * replicas // tp,
               (rank // replicas + 1) * kv_heads * replicas // tp)
    want = ([full[h * hd:(h + 1) * hd] for h in q_heads]
            + [full[(heads + g) * hd:(heads + g + 1) * hd] for g in kv]
            + [full[(heads + kv_heads + g) * hd:(heads + kv_heads + g + 1) * hd] for g in kv])
    torch.testing.assert_close(local, torch.cat(want), rtol=0, atol=0)
    segments = tp_segments(whole_segments("w", full.shape), spec, rank)
    assert _check(full, local, segments).eq(1).all()
    # q rows are this rank's alone; a shared kv piece is written by its first holder only
    for seg in segments:
        is_q = seg.canon.offsets[0] < heads * hd
        assert seg.writes == (is_q or rank % replicas == 0)


@pytest.mark.parametrize("dim, world, index", [(0, 4, 1), (0, 3, 2), (1, 2, 1), (0, 8, 7)])
def test_fsdp_after_tp_and_experts(dim, world, index):
    # tp piece of a gate/up weight, then an FSDP chunk of it
    full = torch.arange(8 * 6, dtype=torch.float64).view(8, 6)
    spec = TPShard(0, 2, chunks=2)
    tp_local = local_shard(full, spec, 1)
    start, stop = fsdp_range(tp_local.shape[dim], world, index)
    chunk = tp_local.narrow(dim, start, stop - start)
    segs = fsdp_segments(tp_segments(whole_segments("w", full.shape), spec, 1), dim,
                         tp_local.shape[dim], world, index)
    covered = _check(full, chunk, segs)
    assert covered.numel() == 0 or int(covered.min()) == 1
    # an expert stack [3, 2, 5] holding experts 4, 5, 6, then FSDP over its dim 0 or 2
    experts = {f"e.{g}.w": torch.randn(2, 5, dtype=torch.float64) for g in range(4, 7)}
    stack = torch.stack([experts[f"e.{g}.w"] for g in range(4, 7)])
    segs = whole_segments("e.w_EDH", stack.shape, [f"e.{g}.w" for g in range(4, 7)])
    for d in (0, 2):
        start, stop = fsdp_range(stack.shape[d], 2, 1)
        _check(None, stack.narrow(d, start, stop - start),
               fsdp_segments(segs, d, stack.shape[d], 2, 1), names=experts)


def test_flat_segments_of_a_zero_shard():
    # two parameters flattened into one bucket [a (3x4) | b (5)], padded to 18, 3 shards of 6
    a, b = torch.arange(12.).view(3, 4), 100 + torch.arange(5.)
    flat = torch.cat([a.flatten(), b, torch.zeros(1)])
    for lo in range(0, 18, 6):
        shard = flat[lo:lo + 6].clone()
        segs = (flat_segments(whole_segments("a", a.shape), a.shape, 0, lo, lo + 6)
                + flat_segments(whole_segments("b", b.shape), b.shape, 12, lo, lo + 6))
        covered = torch.zeros(6, dtype=torch.int)
        for seg in segs:
            source = {"a": a, "b": b}[seg.name]
            box = source[tuple(slice(o, o + n) for o, n in zip(seg.canon.offsets, seg.canon.sizes))]
            torch.testing.assert_close(local_view(shard, seg), box, rtol=0, atol=0)
            local_view(covered, seg).add_(1)
        real = min(6, max(0, 17 - lo))      # the bucket's last element is padding
        assert covered[:real].tolist() == [1] * real and covered[real:].sum() == 0


def test_initial_values_are_a_pure_function_of_seed_and_name():
    cfg = ModelConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      ffn_dim=32, moe_ffn_dim=8, num_experts=4, top_k=2, max_seq_len=8)
    model = Transformer(cfg, RouterConfig(), seed=7)
    canonical = canonical_tensors(model)
    # expert 2 of layer 0 is drawn by its own name, whatever else exists
    expert = draw("layers.0.ffn.experts.2.w_in", canonical["layers.0.ffn.experts.2.w_in"], 7)
    torch.testing.assert_close(model.layers[0].ffn.experts.w_in_EDU[2], expert, rtol=0, atol=0)
    assert expert.std().item() == pytest.approx(cfg.init_std, rel=0.2)
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    assert model.layers[1].attn.o_proj.weight.std().item() == pytest.approx(out_std, rel=0.2)
    assert torch.equal(model.norm.weight, torch.ones(16))
    # the same seed gives the same model, another seed another one; torch's global RNG is not used
    torch.manual_seed(123)
    again = Transformer(cfg, RouterConfig(), seed=7)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    other = Transformer(cfg, RouterConfig(), seed=8)
    assert not torch.equal(other.embed.weight, model.embed.weight)
    # drawing in place again changes nothing
    init_weights(again, 7)
    assert torch.equal(again.head.weight, model.head.weight)


def test_fused_qkv_draws_the_values_of_separate_q_k_v():
    # The fused projection starts from the values separate q_proj, k_proj, v_proj were drawn
    # with (each under its own name), so fixed expected values and old seeds keep their meaning.
    cfg = ModelConfig(vocab_size=32, dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_dim=32, max_seq_len=8, attention_bias=True)
    model = Transformer(cfg, RouterConfig(), seed=7)
    hd = cfg.head_dim_resolved
    weight = model.layers[1].attn.qkv_proj.weight
    parts = []
    for name, rows in (("q_proj", 4 * hd), ("k_proj", 2 * hd), ("v_proj", 2 * hd)):
        old = CanonicalTensor((rows, 16), torch.float32, InitSpec("normal", cfg.init_std))
        parts.append(draw(f"layers.1.attn.{name}.weight", old, 7))
    assert weight.shape == (8 * hd, 16)
    torch.testing.assert_close(weight, torch.cat(parts), rtol=0, atol=0)
    assert torch.equal(model.layers[1].attn.qkv_proj.bias, torch.zeros(8 * hd))
