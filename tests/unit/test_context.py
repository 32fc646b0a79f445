"""Context parallelism without processes: which positions a cp rank holds, its attention over
the gathered keys against plain causal attention, the layout maths and the config errors."""

import pytest
import torch
import torch.nn.functional as F

from configs import tiny_config
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


@pytest.mark.parametrize("cp", [2, 4])
def test_chunk_attention_equals_causal_attention_rows(cp):
    """Each rank's queries over the whole keys give the rows of one causal SDPA over the whole
    sequence (GQA: 4 query heads read 2 key/value heads), and every rank attends over the same
    number of (query, key) pairs."""
    torch.manual_seed(0)
    seq = 8 * cp
    q_BHSd = torch.randn(2, 4, seq, 8, dtype=torch.float64)
    k_BGSd = torch.randn(2, 2, seq, 8, dtype=torch.float64)
    v_BGSd = torch.randn(2, 2, seq, 8, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q_BHSd, k_BGSd, v_BGSd, is_causal=True, enable_gqa=True)
    pairs = set()
    for rank in range(cp):
        mine = local_positions(seq, cp, rank)
        got = ContextParallel(None, cp, rank).attention(q_BHSd[:, :, mine], k_BGSd, v_BGSd)
        torch.testing.assert_close(got, want[:, :, mine], rtol=1e-12, atol=1e-12)
        pairs.add(sum(int(p) + 1 for p in mine))
    assert len(pairs) == 1


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
