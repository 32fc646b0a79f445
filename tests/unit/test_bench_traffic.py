"""`moepar bench traffic`: the op counter against bytes and FLOPs worked out by hand, and one
step of the tiny model split into parts that add up and scale as they should."""

import json

import pytest
import torch
import torch.nn.functional as F

from moepar.bench import main as bench_main
from moepar.bench.traffic import Counter, bench_traffic
from moepar.config import load_config

TINY = ["--train.seq_len=32", "--train.dtype=float32", "--model.max_seq_len=32"]


def test_counts_casts_views_copies_and_broadcasts_by_hand():
    x_84 = torch.randn(8, 4)                     # 32 float32 elements: 128 bytes
    row_4 = torch.randn(4)
    ids_3, table_1004 = torch.tensor([1, 5, 7]), torch.randn(100, 4)
    with Counter() as c:
        x_84.to(torch.bfloat16)                  # reads 128, writes 64
        x_84.view(32), x_84.t(), x_84.expand(2, 8, 4), x_84.split(2), x_84.detach()   # free
        x_84 + row_4.expand(8, 4)                # the broadcast row is read once: 128 + 16, 128
        x_84.mul_(x_84)                          # one tensor read once, written in place
        torch.empty(8, 4).copy_(x_84)            # copy_: the destination is written, not read
        F.embedding(ids_3, table_1004)           # 3 of the 100 rows are read
    assert c.traffic == {("outside", "_to_copy", "casts"): [1, 128, 64],
                         ("outside", "add", "elementwise"): [1, 144, 128],
                         ("outside", "mul_", "elementwise"): [1, 128, 128],
                         ("outside", "copy_", "copies"): [1, 128, 128],
                         ("outside", "embedding", "permutation/gather/scatter"): [1, 48 + 24, 48]}
    assert c.matmul == {} and c.attention == {}


def test_matmuls_and_attention_are_counted_apart_with_their_flops():
    n = 128                                    # 2 n^3 FLOPs over 3 n^2 float32: 21 FLOPs/byte
    a_nn, b_nn = torch.randn(n, n), torch.randn(n, n)
    x_2nn, w_2nn = torch.randn(2 * n, n), torch.randn(2, n, n)
    offs = torch.tensor([n // 2, 2 * n], dtype=torch.int32)   # groups of n/2 and 3n/2 rows
    q_1248 = torch.randn(1, 2, 4, 8, requires_grad=True)
    with Counter(where=lambda: "here") as c:
        a_nn @ b_nn
        torch.bmm(w_2nn, w_2nn.transpose(1, 2))
        torch._grouped_mm(x_2nn, w_2nn, offs)
        F.scaled_dot_product_attention(q_1248, q_1248, q_1248, is_causal=True).sum().backward()
    assert c.matmul[("here", "mm")] == [1, 2 * n * n * n, 4 * 2 * n * n, 4 * n * n]
    assert c.matmul[("here", "bmm")][:2] == [1, 2 * 2 * n * n * n]
    assert c.matmul[("here", "_grouped_mm")][:2] == [1, 2 * 2 * n * n * n]   # rows n k, summed
    (fwd, fwd_row), = [(n, r) for (_, n), r in c.attention.items() if not n.endswith("backward")]
    (bwd, bwd_row), = [(n, r) for (_, n), r in c.attention.items() if n.endswith("backward")]
    # q k^T and p v, causal not halved: 2 * (B H Sq Sk) * (Dqk + Dv); the backward twice that
    assert fwd_row[1] == 2 * (1 * 2 * 4 * 4) * (8 + 8) and bwd_row[1] == 2 * fwd_row[1]
    assert not any(name in ("mm", "bmm", "_grouped_mm") for _, name, _ in c.traffic)


def test_a_memory_bound_matmul_is_traffic():
    """The bf16 combine's weighted sum of K copies, [T,1,K] @ [T,K,D], does 2 T K D FLOPs on
    2 (T K D + T K + T D) bytes (under 1 FLOP per byte): it moves bytes like an elementwise op,
    and is counted with them, not as tensor-core work (a product with m, k or n <= 16)."""
    t, k, d = 64, 4, 32
    w_T1K = torch.randn(t, 1, k, dtype=torch.bfloat16)
    y_TKD = torch.randn(t, k, d, dtype=torch.bfloat16)
    with Counter() as c:
        torch.bmm(w_T1K, y_TKD)
    assert c.matmul == {}
    assert c.traffic == {("outside", "bmm", "matmul (memory-bound)"):
                         [1, 2 * (t * k + t * k * d), 2 * t * d]}


@pytest.fixture(scope="module")
def two_batches(tmp_path_factory):
    """One step of the tiny model at 2 and 6 sequences: the first through the CLI (JSON)."""
    path = tmp_path_factory.mktemp("traffic") / "out.json"
    assert bench_main(["traffic", "tiny", *TINY, "--train.global_batch_size=2",
                       "--train.micro_batch_size=2", "--json", str(path)]) == 0
    small = json.loads(path.read_text())
    cfg = load_config("tiny", [*TINY, "--train.global_batch_size=6", "--train.micro_batch_size=6"])
    return small, bench_traffic(cfg)


def test_the_parts_add_up_and_the_per_token_figures_are_the_parts(two_batches):
    for r in two_batches:
        b, tokens, layers, moe = r["bytes"], r["tokens"], r["num_layers"], r["num_moe_layers"]
        assert tokens == r["tokens"] and moe == 3 and layers == 4       # tiny: one dense layer
        assert b["moe_layers"] + b["dense_layers"] + b["outside"] + b["optimizer"] == b["total"]
        assert sum(c["bytes"] for c in r["classes"].values()) == b["total"]
        assert r["layer_bytes_per_token_per_layer"] == pytest.approx(
            (b["moe_layers"] + b["dense_layers"]) / (tokens * layers))
        assert r["moe_layer_bytes_per_token"] == pytest.approx(b["moe_layers"] / (tokens * moe))
        assert r["outside_bytes_per_token"] == pytest.approx(b["outside"] / tokens)
        assert r["optimizer_bytes_per_param"] == pytest.approx(b["optimizer"] / r["num_params"])
        assert min(b["moe_layers"], b["dense_layers"], b["outside"], b["optimizer"]) > 0


def test_the_optimizer_scales_with_parameters_and_the_rest_with_tokens(two_batches):
    small, large = two_batches
    assert large["tokens"] == 3 * small["tokens"]
    assert large["bytes"]["optimizer"] == small["bytes"]["optimizer"]
    # AdamW (foreach, float32): about 12 reads and writes of 4 bytes per parameter, plus the
    # clipping and the parameters' norm
    assert 60 < small["optimizer_bytes_per_param"] < 140
    for key in ("layer_bytes_per_token_per_layer", "outside_bytes_per_token"):
        assert large[key] == pytest.approx(small[key], rel=0.15), key
    # the matmul FLOPs are per token too, and close to bench train's formula (PaLM's)
    assert large["matmul_flops"] == pytest.approx(3 * small["matmul_flops"], rel=0.05)
    flops = small["matmul_flops"] + small["attention_flops"]
    assert flops == pytest.approx(small["model_flops_formula"], rel=0.25)


def test_bad_override_is_refused_by_name(capsys):
    assert bench_main(["traffic", "tiny", "--model.no_such_key=3"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_in_place_scatter_and_addmm_count_what_they_touch():
    """scatter_add_ of 4 values into a [4, 100] table reads and writes those 4 elements (plus
    its index and source), not the table; addmm_ is a matmul like addmm."""
    table_4C = torch.zeros(4, 100)
    ids_41, ones_41 = torch.tensor([[1], [5], [7], [9]]), torch.ones(4, 1)
    a_nn = torch.randn(128, 128)
    with Counter() as c:
        table_4C.scatter_add_(1, ids_41, ones_41)
        a_nn.clone().addmm_(a_nn, a_nn)
    touched = 4 * 8 + 4 * 4                     # int64 index + float32 source
    assert c.traffic[("outside", "scatter_add_", "permutation/gather/scatter")] == \
        [1, touched + touched, touched]
    assert ("outside", "addmm") in c.matmul
