"""Context parallelism without processes: which positions a cp rank holds, its attention over
the gathered keys against plain causal attention, the layout maths and the config errors."""

import pytest
import torch
import torch.nn.functional as F

from configs import tiny_config
from moepar.layers import blockwise
from moepar.parallel.context import ContextParallel, local_positions, take_local
from moepar.parallel.dims import Coords, ParallelDims


def test_each_rank_holds_a_head_and_a_tail_chunk():
    # seq 16, cp 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    tokens_BS = torch.arange(32).view(2, 16)
    assert take_local(tokens_BS, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11],
                                                    [20, 21, 22, 23, 24, 25, 26, 27]]
    held = torch.cat([local_positions(24, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(24))


def _rank_attention_and_grads(attend, q_BHSd, k_BGSd, v_BGSe, mine, grad_BHse):
    """attend(q rows of `mine`, whole k, v) and the gradients of <out, grad> in q, k, v."""
    q, k, v = (t.detach().requires_grad_() for t in (q_BHSd, k_BGSd, v_BGSe))
    out = attend(q[:, :, mine], k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_BHse))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads, kv_heads, qk_dim, v_dim", [
    (4, 2, 8, 8),      # GQA: 4 query heads read 2 key/value heads
    (4, 4, 12, 8),     # MLA: every head its own keys, the value head dim below the query's
], ids=["gqa", "mla"])
def test_chunk_attention_equals_causal_attention_rows(monkeypatch, cp, heads, kv_heads, qk_dim,
                                                      v_dim):
    """Each rank's queries over the whole keys give the rows of one causal SDPA over the whole
    sequence, forward and backward (the ranks' gradients of k and v sum to the whole one's, as
    the gather's reduce-scatter sums them), with tiles smaller than a chunk so the prefix, the
    diagonal and ragged tiles all occur; every rank attends over the same number of pairs."""
    monkeypatch.setattr(blockwise, "TILE", 3)
    torch.manual_seed(0)
    seq = 10 * cp
    q_BHSd = torch.randn(2, heads, seq, qk_dim, dtype=torch.float64)
    k_BGSd = torch.randn(2, kv_heads, seq, qk_dim, dtype=torch.float64)
    v_BGSe = torch.randn(2, kv_heads, seq, v_dim, dtype=torch.float64)
    grad_BHSe = torch.randn(2, heads, seq, v_dim, dtype=torch.float64)
    scale = 0.3
    everything = torch.arange(seq)
    want, *want_grads = _rank_attention_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                       enable_gqa=heads != kv_heads),
        q_BHSd, k_BGSd, v_BGSe, everything, grad_BHSe)
    summed = [torch.zeros_like(t) for t in want_grads]
    pairs = set()
    for rank in range(cp):
        mine = local_positions(seq, cp, rank)
        got, *grads = _rank_attention_and_grads(
            lambda q, k, v: ContextParallel(None, cp, rank).attention(q, k, v, scale),
            q_BHSd, k_BGSd, v_BGSe, mine, grad_BHSe[:, :, mine])
        torch.testing.assert_close(got, want[:, :, mine], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads[0][:, :, mine], want_grads[0][:, :, mine], rtol=1e-12,
                                   atol=1e-12)
        summed = [a + b for a, b in zip(summed, grads, strict=True)]
        pairs.add(sum(int(p) + 1 for p in mine))
    for got, want_grad in zip(summed, want_grads, strict=True):
        torch.testing.assert_close(got, want_grad, rtol=1e-12, atol=1e-12)
    assert len(pairs) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_attention_in_lower_precision_is_close_to_sdpa(dtype):
    """float32 and bf16 (computed in float32 inside) stay within their precision of SDPA."""
    torch.manual_seed(0)
    q_BHSd, k_BGSd, v_BGSd = (torch.randn(1, 2, 64, 8).to(dtype) for _ in range(3))
    mine = local_positions(64, 2, 0)
    want = F.scaled_dot_product_attention(q_BHSd.double(), k_BGSd.double(), v_BGSd.double(),
                                          is_causal=True)[:, :, mine]
    got = ContextParallel(None, 2, 0).attention(q_BHSd[:, :, mine], k_BGSd, v_BGSd)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:      # autocast does not move the float32 inside down to bf16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = ContextParallel(None, 2, 0).attention(q_BHSd[:, :, mine], k_BGSd, v_BGSd)
        assert torch.equal(autocast, got)


def test_chunk_attention_saves_nothing_quadratic():
    """At 2,048 positions over cp 2 the attention of rank 0 saves q, k, v, the output and its
    log-sum-exp: linear in S. A saved causal mask (what SDPA with a mask keeps on CPU) alone
    would be (2cp+1) c^2 = 5 * 512^2 floats, 5.2 MB: the bound is far below it."""
    seq, cp = 2048, 2
    q_BHSd, k_BGSd, v_BGSd = (torch.randn(1, 2, seq, 8, requires_grad=True) for _ in range(3))
    mine = local_positions(seq, cp, 0)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ContextParallel(None, cp, 0).attention(q_BHSd[:, :, mine], k_BGSd, v_BGSd)
    # q's rows, k, v, the two chunks' outputs (each [1, 2, S or S/2, 8] float32), the two
    # log-sum-exps and the rows' index: under five [1, 2, S, 8] tensors, 0.66 MB.
    assert sum(saved.values()) <= 5 * seq * 2 * 8 * 4
    out.sum().backward()                    # and the saved pieces are what backward needs
    assert q_BHSd.grad is not None and k_BGSd.grad.abs().sum() > 0


def test_dims_fold_cp_between_dp_and_tp():
    dims = ParallelDims(8, dp=2, tp=2, ep=4, cp=2)
    assert dims.edp == 2 and dims.dense_data_axis == "dp_cp"
    # rank = (dp * cp + cp_rank) * tp + tp_rank; experts read the stage's 8 ranks as (edp, ep).
    assert dims.coords(5) == Coords(pp=0, dp=1, tp=1, edp=1, ep=1, cp=0)
    assert dims.coords(2) == Coords(pp=0, dp=0, tp=0, edp=0, ep=2, cp=1)
    assert dims.group_ranks("cp", 5) == [5, 7]
    assert dims.group_ranks("dp_cp", 5) == [1, 3, 5, 7]
    assert dims.group_ranks("cp_tp", 5) == [4, 5, 6, 7]
    assert "cp 2" in dims.describe()
    with pytest.raises(ValueError, match=r"parallel.cp=2 \* parallel.tp=2"):
        ParallelDims(6, dp=2, tp=2, cp=2)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.cp=2", "--train.seq_len=30"], r"train.seq_len=30 must be divisible by 2 \* "
                                                r"parallel.cp \* parallel.tp = 2 \* 2 \* 1 = 4"),
    (["--parallel.cp=2", "--parallel.tp=2", "--train.seq_len=28"], r"2 \* 2 \* 2 = 8"),
    (["--parallel.cp=0"], r"parallel.cp=0 must be >= 1"),
    (["--parallel.cp=2", "--router.type=expert_choice", "--router.capacity_factor=1.0"],
     r"router.type='expert_choice' with "
                                                         r"parallel.cp=2"),
    (["--parallel.cp=2", "--train.compile=true"], r"train.compile=true with parallel.cp=2"),
    (["--parallel.cp=2", "--train.qk_clip=100"], r"train.qk_clip=100.0 with parallel.cp=2"),
])
def test_config_refuses_what_cp_cannot_split(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, *overrides)
