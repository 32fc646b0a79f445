"""The decoder model: shapes, causality, GQA attention and RoPE against naive maths, tied head,
where MoE layers go, and activation checkpointing against the plain model.

Legend: B batch, S sequence length, D model dim, H query heads, G key/value heads, Hd head dim,
V vocabulary.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from moepar.layers import FeedForward, ModelConfig, MoE, RouterConfig, Transformer
from moepar.layers.rope import apply_rotary, rotary_tables
from moepar.parallel import apply_activation_checkpointing

TINY = dict(vocab_size=32, dim=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=16,
            moe_ffn_dim=8, num_experts=4, top_k=2, max_seq_len=16)


def build(dtype=torch.float64, router=None, seed=0, **overrides):
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**TINY, **overrides}), router or RouterConfig())
    model = model.to(dtype)
    # Larger weights than the default init, so attention and routing are far from uniform.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def tokens(batch=2, seq=10, seed=0, vocab=TINY["vocab_size"]):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- shapes and causality

def test_shapes():
    model = build(num_layers=3, first_k_dense=1, num_shared_experts=1)
    logits, moe_outputs = model(tokens(batch=3, seq=7))
    assert logits.shape == (3, 7, TINY["vocab_size"]) and logits.dtype == torch.float64
    assert len(moe_outputs) == 2
    for out in moe_outputs:
        assert out.y.shape == (3, 7, TINY["dim"])
        assert out.aux_loss.total.shape == ()
        assert out.stats.tokens_per_expert_E.shape == (TINY["num_experts"],)
        # 21 tokens, 2 copies each, all routed (dropless).
        assert out.stats.tokens_per_expert_E.sum().item() == 42


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        build()(tokens(batch=1, seq=17))


@pytest.mark.parametrize("position", [0, 4, 9])
def test_causal(position):
    # Dropless top-k routes each token on its own, so the whole model must be causal.
    model = build(num_shared_experts=1, shared_gate=True)
    tokens_a = tokens(seed=1)
    tokens_b = tokens_a.clone()
    tokens_b[:, position] = (tokens_b[:, position] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        logits_a, _ = model(tokens_a)
        logits_b, _ = model(tokens_b)
    torch.testing.assert_close(logits_a[:, :position], logits_b[:, :position],
                               rtol=1e-12, atol=1e-12)
    assert not torch.allclose(logits_a[:, position], logits_b[:, position])


# ---------------------------------------------------------------- attention and RoPE

def naive_rope(x_Hd, pos, theta):
    """Rotate-half RoPE: pair (i, i + Hd/2) turns by pos * theta^(-2i/Hd)."""
    half = x_Hd.shape[-1] // 2
    out = x_Hd.clone()
    for i in range(half):
        angle = pos * theta ** (-2.0 * i / x_Hd.shape[-1])
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x_Hd[i] * c - x_Hd[i + half] * s
        out[i + half] = x_Hd[i + half] * c + x_Hd[i] * s
    return out


def naive_attention(attn, x_BSD, theta):
    batch, seq, _ = x_BSD.shape
    num_heads, num_kv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    # qkv_proj's rows are [q of every head; k of every kv head; v of every kv head].
    w_q, w_k, w_v = attn.qkv_proj.weight.split([num_heads * hd, num_kv * hd, num_kv * hd])
    q = (x_BSD @ w_q.t()).view(batch, seq, num_heads, hd)
    k = (x_BSD @ w_k.t()).view(batch, seq, num_kv, hd)
    v = (x_BSD @ w_v.t()).view(batch, seq, num_kv, hd)
    out = torch.zeros(batch, seq, num_heads, hd, dtype=x_BSD.dtype)
    for b in range(batch):
        for h in range(num_heads):
            g = h // (num_heads // num_kv)  # query head h reads key/value head g
            q_rot = [naive_rope(q[b, i, h], i, theta) for i in range(seq)]
            k_rot = [naive_rope(k[b, j, g], j, theta) for j in range(seq)]
            for i in range(seq):
                scores = [torch.dot(q_rot[i], k_rot[j]) / math.sqrt(hd) for j in range(i + 1)]
                exp = torch.exp(torch.stack(scores) - max(scores))
                probs = exp / exp.sum()
                out[b, i, h] = sum(probs[j] * v[b, j, g] for j in range(i + 1))
    return out.reshape(batch, seq, num_heads * hd) @ attn.o_proj.weight.t()


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_attention_matches_naive(heads):
    num_heads, num_kv_heads = heads
    model = build(num_heads=num_heads, num_kv_heads=num_kv_heads, rope_theta=100.0)
    attn = model.layers[0].attn
    seq = 6
    x_BSD = torch.randn(2, seq, TINY["dim"], dtype=torch.float64,
                        generator=torch.Generator().manual_seed(2))
    cos, sin = rotary_tables(seq, attn.head_dim, 100.0, torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x_BSD, cos, sin), naive_attention(attn, x_BSD, 100.0),
                                   rtol=1e-12, atol=1e-12)


def test_rotary_tables_hand_values():
    cos, sin = rotary_tables(3, 4, 100.0, torch.float64)
    # Hd=4: frequencies 1 and 100^(-1/2) = 0.1, each repeated for the two halves.
    angles = torch.tensor([[0, 0, 0, 0], [1, 0.1, 1, 0.1], [2, 0.2, 2, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(cos, angles.cos(), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(sin, angles.sin(), rtol=1e-15, atol=1e-15)


def test_rope_is_relative():
    seq, hd, offset = 12, 8, 5
    gen = torch.Generator().manual_seed(3)
    q_Hd = torch.randn(hd, generator=gen, dtype=torch.float64)
    k_Hd = torch.randn(hd, generator=gen, dtype=torch.float64)
    cos, sin = rotary_tables(seq, hd, 10000.0, torch.float64)
    # The same vector at every position: row p of the result is q rotated to position p.
    q_rot = apply_rotary(q_Hd.expand(1, 1, seq, hd), cos, sin)[0, 0]
    k_rot = apply_rotary(k_Hd.expand(1, 1, seq, hd), cos, sin)[0, 0]
    torch.testing.assert_close(q_rot[0], q_Hd, rtol=0, atol=0)  # position 0 is the identity
    torch.testing.assert_close(q_rot.norm(dim=-1), q_Hd.norm().expand(seq), rtol=1e-14, atol=0)
    for m, n in [(0, 0), (1, 4), (6, 2), (3, 3)]:
        torch.testing.assert_close(q_rot[m] @ k_rot[n], q_rot[m + offset] @ k_rot[n + offset],
                                   rtol=1e-12, atol=1e-12)
    assert not torch.allclose(q_rot[0] @ k_rot[0], q_rot[0] @ k_rot[3])


# ---------------------------------------------------------------- head and layer placement

def test_tie_embeddings_uses_embed_weight_as_head():
    model = build(tie_embeddings=True)
    assert model.head is None
    assert not any(name.startswith("head") for name in model.state_dict())
    captured = {}
    model.norm.register_forward_hook(lambda mod, inp, out: captured.update(h=out))
    logits, _ = model(tokens())
    torch.testing.assert_close(logits, captured["h"] @ model.embed.weight.t(), rtol=1e-12,
                               atol=1e-12)
    # The head's gradient lands on embed.weight, also on rows no input token used.
    unused = sorted(set(range(TINY["vocab_size"])) - set(tokens().flatten().tolist()))
    assert unused
    logits.sum().backward()
    assert torch.count_nonzero(model.embed.weight.grad[unused]) > 0


def test_untied_head_is_separate():
    model = build()
    logits, _ = model(tokens())
    unused = sorted(set(range(TINY["vocab_size"])) - set(tokens().flatten().tolist()))
    logits.sum().backward()
    assert model.head.weight.grad is not None
    assert torch.count_nonzero(model.embed.weight.grad[unused]) == 0


@pytest.mark.parametrize("layout", [
    (4, 0, 1, [0, 1, 2, 3]),
    (5, 1, 2, [1, 3]),
    (6, 2, 3, [2, 5]),
    (3, 3, 1, []),
    (4, 0, 5, [0]),
], ids=["all", "k1_every2", "k2_every3", "all_dense", "every5"])
def test_moe_layer_placement(layout):
    num_layers, first_k_dense, moe_every, expected = layout
    cfg = ModelConfig(**{**TINY, "num_layers": num_layers, "first_k_dense": first_k_dense,
                         "moe_every": moe_every})
    assert [i for i in range(num_layers) if cfg.is_moe_layer(i)] == expected
    model = Transformer(cfg)
    for i, block in enumerate(model.layers):
        assert block.is_moe == (i in expected)
        assert isinstance(block.ffn, MoE if i in expected else FeedForward)
    assert len(model.moe_layers()) == len(expected)
    _, moe_outputs = model(tokens(batch=1, seq=4))
    assert len(moe_outputs) == len(expected)


# ---------------------------------------------------------------- activation checkpointing

ROUTERS = {
    "dropless": RouterConfig(seq_balance_coeff=0.01, z_coeff=0.001),
    "capacity": RouterConfig(capacity_factor=0.75, drop_policy="probs", z_coeff=0.001),
    "sigmoid_capacity_position": RouterConfig(score_func="sigmoid", capacity_factor=1.0,
                                              drop_policy="position", norm_topk_prob=True),
    "expert_choice": RouterConfig(type="expert_choice", capacity_factor=1.0, z_coeff=0.001),
}


def loss_and_grads(model, batch):
    logits, moe_outputs = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, moe_outputs


@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_activation_checkpointing_is_exact(router):
    model = build(router=router, num_layers=3, first_k_dense=1, num_shared_experts=1,
                  shared_gate=True)
    checkpointed = apply_activation_checkpointing(copy.deepcopy(model))
    batch = tokens(batch=2, seq=12, seed=4)
    loss, grads, outs = loss_and_grads(model, batch)
    loss_ckpt, grads_ckpt, outs_ckpt = loss_and_grads(checkpointed, batch)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name, grad in grads.items():
        assert grad is not None and grads_ckpt[name] is not None, name
        assert torch.equal(grad, grads_ckpt[name]), name
    for out, out_ckpt in zip(outs, outs_ckpt, strict=True):
        assert torch.equal(out.aux_loss.total, out_ckpt.aux_loss.total)
        assert torch.equal(out.stats.num_dropped, out_ckpt.stats.num_dropped)


def test_activation_checkpointing_injects_aux_loss_once():
    # The injected aux gradient is counted once: dropping the aux coefficients changes the
    # router gradient by exactly the gradient of the aux losses the plain model reports.
    router = RouterConfig(balance_coeff=0.5, z_coeff=0.1)
    model = build(router=router, num_layers=1)
    batch = tokens(batch=2, seq=8, seed=5)
    checkpointed = apply_activation_checkpointing(copy.deepcopy(model))
    _, grads_ckpt, _ = loss_and_grads(checkpointed, batch)

    model.set_aux_loss_scale(0.0)
    logits, moe_outputs = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    (loss + moe_outputs[0].aux_loss.total).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads_ckpt[name], p.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_bfloat16_checkpointing_first_forward_probes_grouped_mm():
    # Regression: the grouped-GEMM capability probe used to run with grad on inside the first
    # (checkpointed) forward, leaving saved tensors in the graph that the recompute did not
    # reproduce. Clear the probe cache so this test's forward is the first call.
    from moepar.layers.grouped_mm import _native_runs
    _native_runs.cache_clear()
    model = build(dtype=torch.bfloat16)
    plain = copy.deepcopy(model)
    checkpointed = apply_activation_checkpointing(model)
    batch = tokens(batch=2, seq=8, seed=6)
    loss_ckpt, grads_ckpt, _ = loss_and_grads(checkpointed, batch)
    loss, grads, _ = loss_and_grads(plain, batch)
    assert torch.equal(loss, loss_ckpt)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ckpt[name]), name


def test_deepcopy_of_checkpointed_model_uses_its_own_weights():
    model = apply_activation_checkpointing(build())
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.layers.parameters():
            p.mul_(2.0)
        reference = copy.deepcopy(build())  # never checkpointed: deepcopy is sound here
        for p in reference.layers.parameters():
            p.mul_(2.0)
        torch.testing.assert_close(copied(tokens())[0], reference(tokens())[0], rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("mode", ["attention", "experts", "full"])
def test_selective_recompute_is_exact_and_keeps_fewer_bytes(mode):
    """train.recompute: bit-identical gradients, and fewer bytes saved for backward than none;
    'experts' drops at least each MoE layer's [rows, 2F] hidden state and its [rows, F]
    activation, 'attention' at least q, k, v and the attention output."""
    from moepar.bench.pipeline import SavedActivationMeter
    from moepar.parallel import apply_recompute
    model = build(router=ROUTERS["dropless"],
                  num_layers=3, first_k_dense=1)
    batch = tokens(batch=2, seq=12, seed=4)

    def measured(m):
        meter = SavedActivationMeter(list(m.parameters()))
        with meter.active():
            out = loss_and_grads(m, batch)
        return meter.peak, out

    plain_bytes, (loss, grads, _) = measured(copy.deepcopy(model))
    kept, (loss_r, grads_r, _) = measured(apply_recompute(copy.deepcopy(model), mode))
    assert torch.equal(loss, loss_r)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_r[name]), name
    cfg, rows = model.cfg, 2 * 12 * model.cfg.top_k           # dropless: every copy is a row
    moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    element = 8                                                 # float64
    if mode == "experts":
        least = moe_layers * rows * 3 * cfg.moe_ffn_dim * element
    elif mode == "attention":
        hd = cfg.head_dim_resolved
        least = cfg.num_layers * 2 * 12 * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd * element
    else:
        least = plain_bytes // 2
    assert plain_bytes - kept >= least, (mode, plain_bytes, kept, least)
