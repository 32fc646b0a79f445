"""MuonClip's QK-clip (parallel/qkclip.py): the tracked per-head maximum logit against a naive
computation, and after the clip the same input gives every head max(logit) = min(before, tau),
for MHA, GQA and MLA (whose RoPE parts scale differently)."""

import pytest
import torch

from configs import tiny_model
from moepar.layers.rope import apply_rotary
from moepar.parallel.precision import Masters
from moepar.parallel.qkclip import QKClip

MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def _maxima(model, clip, x):
    clip.reset()
    model(x)
    return clip.max_logits()


def test_tracked_maximum_is_the_naive_one():
    model = tiny_model(num_layers=1, num_kv_heads=2)
    attn = model.layers[0].attn
    clip = QKClip(model, 1.0, Masters(model), None, torch.device("cpu"))
    x = torch.randint(0, 64, (2, 8))
    tracked = _maxima(model, clip, x)
    with torch.no_grad():
        h_BSD = model.layers[0].attn_norm(model.embed(x))
        q, k, _ = attn.qkv_proj(h_BSD).split(attn.qkv_sizes(), dim=-1)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    q = apply_rotary(q.view(2, 8, 4, 8).transpose(1, 2), cos, sin)
    k = apply_rotary(k.view(2, 8, 2, 8).transpose(1, 2), cos, sin)
    want = []
    for h in range(4):
        logits = [q[b, h, i] @ k[b, h // 2, j] / 8 ** 0.5
                  for b in range(2) for i in range(8) for j in range(i + 1)]
        want.append(max(float(v) for v in logits))
    torch.testing.assert_close(tracked, torch.tensor(want, dtype=torch.float64))


def test_tracked_maximum_of_packed_documents_counts_only_logits_within_a_document():
    """Two documents in one row: the logits across them are masked out of the softmax, so they
    must not count either (else a head would be clipped for logits attention never uses)."""
    model = tiny_model(num_layers=1, num_kv_heads=2)
    attn = model.layers[0].attn
    clip = QKClip(model, 1.0, Masters(model), None, torch.device("cpu"))
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    clip.reset()
    model(x, documents=documents)
    tracked = clip.max_logits()
    with torch.no_grad():
        h_BSD = model.layers[0].attn_norm(model.embed(x))
        q, k, _ = attn.qkv_proj(h_BSD).split(attn.qkv_sizes(), dim=-1)
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    q = apply_rotary(q.view(1, 8, 4, 8).transpose(1, 2), cos, sin)
    k = apply_rotary(k.view(1, 8, 2, 8).transpose(1, 2), cos, sin)
    want = [max(float(q[0, h, i] @ k[0, h // 2, j]) / 8 ** 0.5 for i in range(8)
                for j in range(i + 1) if documents[0, i] == documents[0, j]) for h in range(4)]
    torch.testing.assert_close(tracked, torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("fields", [dict(num_kv_heads=4), dict(num_kv_heads=2), MLA],
                         ids=["mha", "gqa", "mla"])
def test_clipped_heads_reach_tau_exactly(fields):
    model = tiny_model(num_layers=1, **fields)    # later layers' inputs would change too
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    clip = QKClip(model, 1.0, Masters(model), None, torch.device("cpu"))
    before = _maxima(model, clip, x)
    clip.tau = float(before.median())          # about half of the heads are over it
    model(x)
    clip.apply()
    after = _maxima(model, clip, x)
    assert (before > clip.tau).any() and (before <= clip.tau).any()
    torch.testing.assert_close(after, before.clamp(max=clip.tau), rtol=1e-12, atol=1e-12)
