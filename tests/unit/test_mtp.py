"""Multi-token prediction (layers/mtp.py) in float64 against a plain reference written here with
torch ops (embedding rows, RMSNorm, concatenation, a linear map, cross-entropy of full logits),
the decoder blocks called as modules: the MTP losses, and the gradients of the runner's trained
loss main + train.mtp_coeff * mean(MTP losses); evaluation reports the main loss alone."""

import re

import pytest
import torch
import torch.nn.functional as F

from moepar.config import load_config
from moepar.layers import ModelConfig, RouterConfig, Transformer
from moepar.parallel.local_runner import LocalRunner

COEFF = 0.3


def _model(num_mtp=2):
    cfg = ModelConfig(vocab_size=40, dim=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      ffn_dim=24, moe_ffn_dim=12, num_experts=4, top_k=2, first_k_dense=1,
                      mtp_layers=num_mtp, max_seq_len=16)
    return Transformer(cfg, RouterConfig(), seed=3).double()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(model, tokens_BS, targets_BS):
    """(main loss, [MTP loss per depth]) from plain ops."""
    eps, S = model.cfg.norm_eps, tokens_BS.shape[1]
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    e_BSD = model.embed.weight[tokens_BS]
    h_BSD = e_BSD
    for block in model.layers:
        h_BSD, _ = block(h_BSD, cos, sin)
    W = model.head.weight
    h_BSD = _rms(h_BSD, model.norm.weight, eps)
    main = F.cross_entropy((h_BSD @ W.T).flatten(0, 1), targets_BS.flatten())
    losses = []
    for k, m in enumerate(model.mtp, start=1):
        # depth k at position i: the hidden state at i and the embedding of the token at i + k
        joined = torch.cat([_rms(e_BSD[:, k:], m.enorm.weight, eps),
                            _rms(h_BSD[:, :S - k], m.hnorm.weight, eps)], -1)
        h_BSD, _ = m.block(joined @ m.eh_proj.weight.T, cos[:S - k], sin[:S - k])
        logits = _rms(h_BSD, m.norm.weight, eps) @ W.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets_BS[:, k:].flatten()))
    return main, losses


def test_mtp_loss_and_gradients_match_a_plain_reference():
    model = _model()
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(40, (3, 11), generator=gen)
    tokens, targets = stream[:, :-1], stream[:, 1:]
    main, losses = _reference(model, tokens, targets)
    assert len(losses) == 2
    (main + COEFF * sum(losses) / 2).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    runner = LocalRunner(model, 1, mtp_coeff=COEFF)
    loss_sum, _ = runner.run([tokens], [targets])
    torch.testing.assert_close(loss_sum, main.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(runner.mtp_sum, (sum(losses) / 2).detach(), rtol=0, atol=1e-12)
    # every MTP parameter and the shared embedding and head got the MTP loss's gradient
    assert model.mtp[1].eh_proj.weight.grad.abs().sum() > 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-12, msg=name)


def test_evaluation_reports_the_main_loss_only():
    model = _model(num_mtp=1)
    stream = torch.randint(40, (2, 9), generator=torch.Generator().manual_seed(1))
    main, _ = _reference(model, stream[:, :-1], stream[:, 1:])
    runner = LocalRunner(model, 1, mtp_coeff=COEFF)
    loss_sum, _ = runner.run([stream[:, :-1]], [stream[:, 1:]], forward_only=True)
    torch.testing.assert_close(loss_sum, main.detach().double(), rtol=0, atol=1e-12)
    assert runner.mtp_sum.item() == 0.0


@pytest.mark.parametrize("overrides, message", [
    (["--model.mtp_layers=-1"], "model.mtp_layers=-1 must be >= 0"),
    (["--model.mtp_layers=8", "--train.seq_len=8"], "model.mtp_layers=8 must be < train.seq_len=8"),
    (["--model.mtp_layers=1", "--parallel.tp=2"], "model.mtp_layers=1 with parallel.tp=2"),
    (["--model.mtp_layers=1", "--train.mtp_coeff=-1"], "train.mtp_coeff"),
])
def test_bad_mtp_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)
