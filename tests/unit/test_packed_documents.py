"""Packed documents and padding in the model (layers/documents.py): against something
independent, in float64.

- a document packed after another has the loss (and logits) it has alone at position 0, for
  both attention kinds (GQA, MLA);
- with padding, a router's statistics and losses (loads, drops, Switch, sequence and z losses,
  the deferred sums) equal those of the unpadded tokens alone;
- the sequence balance loss of packed documents is the mean of each document's loss alone;
- padding takes no capacity slot from a real token;
- activation recompute keeps the documents (gradients equal to no recompute), and so do the
  regions train.compile traces (no graph break, the eager loss);
- prompts of several lengths, padded on the left, decode as each does alone.
"""

import pytest
import torch

from moepar.infer.generate import generate
from moepar.layers import ModelConfig, RouterConfig, Transformer
from moepar.layers.balance import document_balance_loss, sequence_balance_loss
from moepar.layers.documents import build_documents
from moepar.layers.loss import linear_cross_entropy
from moepar.layers.router import TopKRouter
from moepar.parallel.checkpointing import apply_recompute
from moepar.parallel.compile import apply_compile

_MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, num_kv_heads=4)


def _model(attention: str, router=None):
    extra = _MLA if attention == "mla" else {}
    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                      moe_ffn_dim=16, ffn_dim=32, max_seq_len=32, **{"num_kv_heads": 2, **extra})
    return Transformer(cfg, router or RouterConfig(seq_balance_coeff=0.1), seed=3).double()


def _loss(model, inputs_BS, targets_BS, **kw):
    loss, _ = model(inputs_BS, head_fn=lambda h, w: linear_cross_entropy(h, w, targets_BS), **kw)
    return loss


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_document_after_another_has_its_loss_alone(attention):
    model = _model(attention)
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 64, (1, 6), generator=gen), torch.randint(0, 64, (1, 9), generator=gen)
    alone = _loss(model, second[:, :-1], second[:, 1:])
    # Row: [first | second | 3 padding]; only the second document's own next tokens count.
    inputs = torch.cat([first, second[:, :-1], torch.zeros(1, 3, dtype=torch.long)], 1)
    targets = torch.full_like(inputs, -100)
    targets[0, 6:14] = second[0, 1:]
    documents = torch.tensor([[0] * 6 + [1] * 8 + [-1] * 3])
    packed = _loss(model, inputs, targets, documents=documents)
    # Without the documents the second one sees the first: another loss (the test can fail).
    crossing = _loss(model, inputs, targets)
    assert abs(packed.item() - alone.item()) < 1e-12
    assert abs(crossing.item() - alone.item()) > 1e-6


def test_positions_follow_the_documents():
    docs = build_documents(torch.tensor([[0, 0, 0, 1, 1, -1], [3, 3, 4, 4, 4, 4]]))
    assert docs.positions_BS.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    assert docs.valid_T.tolist() == [True] * 5 + [False] + [True] * 6
    # token 4 (document 1) sees tokens 3 and 4 only
    assert docs.mask_B1SS[0, 0, 4].tolist() == [False, False, False, True, True, False]


def _router(**kw):
    torch.manual_seed(5)
    cfg = RouterConfig(seq_balance_coeff=0.1, z_coeff=0.01, **kw)
    return TopKRouter(8, 4, 2, cfg).double()


@pytest.mark.parametrize("kw", [{}, {"balance_loss": "all_layers"}, {"capacity_factor": 4.0}])
def test_padding_counts_in_no_router_statistic(kw):
    """The router's statistics and losses of 7 real tokens and 5 padding ones equal those of
    the 7 alone (the capacity case: padding positions enlarge the group's capacity, so
    compare a roomy factor where no real token drops in either)."""
    router = _router(**kw)
    x_TD = torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    real = 7
    valid_T = torch.arange(12) < real
    doc_T = torch.zeros(12, dtype=torch.long)
    _, padded_losses, padded_stats = router(x_TD, valid_T=valid_T, doc_T=doc_T)
    routing, losses, stats = router(x_TD[:real])
    assert torch.equal(padded_stats.tokens_per_expert_E, stats.tokens_per_expert_E)
    assert int(padded_stats.num_dropped) == int(stats.num_dropped) == 0
    assert int(padded_stats.num_assignments) == stats.num_assignments == real * 2
    for name in ("balance", "seq_balance", "z"):
        assert torch.allclose(getattr(padded_losses, name), getattr(losses, name),
                              rtol=1e-12, atol=0), name
    assert torch.allclose(padded_losses.total, losses.total, rtol=1e-12, atol=0)
    if losses.parts is not None:
        assert torch.equal(padded_losses.parts.counts_E, losses.parts.counts_E)
        assert torch.allclose(padded_losses.parts.prob_sum_E, losses.parts.prob_sum_E, rtol=1e-12)
        assert int(padded_losses.parts.num_tokens) == losses.parts.num_tokens


def test_padding_takes_no_capacity_slot():
    """Padding ranks after every real token: with capacity for exactly the real copies of the
    busiest expert, no real token drops and no padding is sent."""
    router = _router(capacity_factor=0.5, drop_policy="position")
    x_TD = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    valid_T = torch.arange(16) >= 12      # padding first: "position" would favour it
    routing, _, stats = router(x_TD, valid_T=valid_T, doc_T=torch.zeros(16, dtype=torch.long))
    sent_N = routing.expert_N != 4
    assert not sent_N.view(16, 2)[:12].any()      # no padding copy is sent
    assert sent_N.view(16, 2)[12:].all()          # capacity 4 per expert: 8 real copies fit
    assert int(stats.num_dropped) == 0


def test_document_balance_loss_is_the_mean_over_documents():
    gen = torch.Generator().manual_seed(4)
    probs_TE = torch.softmax(torch.randn(10, 4, dtype=torch.float64, generator=gen), -1)
    experts_TK = torch.randint(0, 4, (10, 2), generator=gen)
    docs = build_documents(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, -1, -1]]))
    got = document_balance_loss(probs_TE, experts_TK, docs.doc_T, docs.valid_T)
    spans = [(0, 3), (3, 7), (7, 8)]
    want = sum(sequence_balance_loss(probs_TE[None, a:b], experts_TK[None, a:b])
               for a, b in spans) / 3
    assert abs(got.item() - want.item()) < 1e-14


@pytest.mark.parametrize("mode", ["full", "attention"])
def test_recompute_keeps_the_documents(mode):
    """Activation recompute passes the documents' mask on (positionally, as it passes every
    argument): the gradients equal those without recompute."""
    gen = torch.Generator().manual_seed(6)
    inputs = torch.randint(0, 64, (2, 12), generator=gen)
    targets = torch.randint(0, 64, (2, 12), generator=gen)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])
    targets[1, 9:] = -100
    grads = []
    for recompute in (None, mode):
        model = _model("gqa")
        if recompute:
            apply_recompute(model, recompute)
        _loss(model, inputs, targets, documents=documents).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_compiled_regions_take_the_documents(attention):
    """train.compile's regions (attention with its mask, the router with padding) trace
    without a graph break (fullgraph) and give the eager loss."""
    gen = torch.Generator().manual_seed(7)
    inputs = torch.randint(0, 64, (2, 12), generator=gen)
    targets = torch.randint(0, 64, (2, 12), generator=gen)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])
    targets[1, 9:] = -100
    model = _model(attention)
    want = _loss(model, inputs, targets, documents=documents)
    apply_compile(model, "aot_eager")
    got = _loss(model, inputs, targets, documents=documents)
    assert abs(got.item() - want.item()) < 1e-12


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_prompts_of_several_lengths_decode_as_if_alone(attention):
    """generate() pads prompts of several lengths on the left and masks the padding as packed
    training does: each row's greedy continuation is the one it gets alone."""
    model = _model(attention)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 64, (n,), generator=gen) for n in (3, 9, 6)]
    together = generate(model, prompts, max_new_tokens=5, temperature=0)
    for prompt, row in zip(prompts, together, strict=True):
        assert row.tolist() == generate(model, prompt, max_new_tokens=5, temperature=0)[0].tolist()
