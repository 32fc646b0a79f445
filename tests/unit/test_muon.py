"""Muon (parallel/muon.py) against independent references: torch's own Newton-Schulz, and a
naive float64 Moonlight-recipe step written out matrix by matrix (experts one by one, q/k/v and
gate/up apart) with torch's AdamW for the rest."""

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz   # torch's iteration, the reference

from configs import tiny_model, token_batches
from moepar.config import load_config
from moepar.parallel.muon import NS_COEFFICIENTS, Muon, build_layouts, newton_schulz
from moepar.parallel.precision import Masters


@pytest.mark.parametrize("shape", [(8, 24), (24, 8)])
def test_newton_schulz_is_torchs_in_bfloat16(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    want = _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(newton_schulz(g.bfloat16()), want)


def _naive_ns(g):
    """Keller Jordan's NS5 on one matrix, in float64 (the norm clamped at eps, as torch does,
    not eps added: a momentum buffer of norm ~1e-3 would feel the 1e-7 at 1e-4)."""
    a, b, c = NS_COEFFICIENTS
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _naive_update(name, m):
    """The Moonlight update direction of canonical tensor `name` from its Nesterov blend m."""
    def one(w):
        return _naive_ns(w) * 0.2 * math.sqrt(max(w.shape))
    if name.endswith("w_in_EDU"):           # per expert, gate and up apart
        half = m.shape[-1] // 2
        return torch.stack([torch.cat([one(e[:, :half]), one(e[:, half:])], 1) for e in m])
    if name.endswith("w_out_EFD"):
        return torch.stack([one(e) for e in m])
    if name.endswith("qkv_proj.weight"):    # 4 q heads, 2 kv heads of 8 features
        return torch.cat([one(part) for part in m.split((32, 16, 16))], 0)
    if name.endswith("w_in.weight"):        # dense SwiGLU [gate; up]
        return torch.cat([one(part) for part in m.chunk(2, 0)], 0)
    return one(m)


def _loss(model, seed):
    inputs, targets = token_batches(1, seed)
    logits, _ = model(inputs[0])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[0].flatten())


def test_two_steps_equal_the_naive_recipe():
    lr, wd, mu = 1e-2, 0.1, 0.95
    model = tiny_model(num_layers=2, moe_every=2, moe_offset=1)     # one dense, one MoE layer
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    layouts = build_layouts(model, Masters(model))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [p for p in model.parameters() if id(p) in layouts]
    assert sorted(names[id(p)] for p in muon) == sorted(
        n for n, p in model.named_parameters()
        if p.dim() >= 2 and n.split(".")[0] not in ("embed", "head"))
    rest = [p for p in model.parameters() if id(p) not in layouts]
    opt = Muon([{"params": muon, "weight_decay": wd, "muon": True},
                {"params": rest, "weight_decay": 0.0}], layouts, lr=lr, betas=(0.9, 0.95),
               eps=1e-8, momentum=mu)
    # The reference: Moonlight's momentum form (buf = mu buf + g; g + mu buf), which differs
    # from torch's lerp form by a factor Newton-Schulz normalizes away; torch's AdamW elsewhere.
    ref_model = tiny_model(num_layers=2, moe_every=2, moe_offset=1)
    ref_params = dict(ref_model.named_parameters())
    ref_adamw = torch.optim.AdamW([ref_params[names[id(p)]] for p in rest], lr=lr,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    bufs = {}
    for seed in (1, 2):
        for m in (model, ref_model):
            m.zero_grad()
            model_loss = _loss(m, seed)
            model_loss.backward()
        opt.step()
        ref_adamw.step()
        with torch.no_grad():
            for p in muon:
                name = names[id(p)]
                q = ref_params[name]
                bufs[name] = mu * bufs.get(name, 0) + q.grad
                q.mul_(1 - lr * wd).sub_(lr * _naive_update(name, q.grad + mu * bufs[name]))
    for name, p in model.named_parameters():
        assert not torch.equal(p, reference[name]), name     # every parameter moved
        torch.testing.assert_close(p, ref_params[name], rtol=1e-10, atol=1e-12, msg=name)


def test_config_names_the_optimizer_key():
    with pytest.raises(ValueError, match="train.optimizer='sgd'"):
        load_config(None, ["--train.optimizer=sgd"])
    with pytest.raises(ValueError, match="train.optim_state_dtype"):
        load_config(None, ["--train.optimizer=muon", "--train.optim_state_dtype=bfloat16"])
