"""Routing record and replay (moepar/routing.py, layers/replay.py): a replayed float64 run equals
the recorded one although its router alone would route otherwise; the router still gets
gradients; directories that do not match are refused naming what differs; vLLM/SGLang's
`routed_experts` layout is read."""

import base64
import os

import numpy as np
import pytest
import torch

from configs import tiny_config
from moepar.infer import load
from moepar.infer.generate import main as generate_main
from moepar.layers import MoE
from moepar.layers.replay import RoutingTape, attach_tape
from moepar.routing import RoutingError, from_routed_experts, read_step
from moepar.train import Trainer

# Capacity drops and norm_topk_prob: a replay must also keep the recorded drops and their sums.
COMMON = ["--train.dtype=float64", "--train.steps=2", "--router.capacity_factor=1.0",
          "--router.norm_topk_prob=true", "--router.seq_balance_coeff=0.01",
          "--router.z_coeff=0.001"]
HOT = torch.tensor([10.0, 0.0, 0.0, 0.0])     # a moved bias: the router alone picks expert 0


def train(run_dir, *overrides, bias=None):
    trainer = Trainer(tiny_config(run_dir, *COMMON, *overrides), log=lambda _m: None)
    if bias is not None:
        for moe in trainer.model.moe_layers():
            moe.router.expert_bias_E.copy_(bias)
    records = trainer.run()
    return trainer, [(r["loss"], r["grad_norm"], r["aux_loss"]) for r in records]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    trainer, records = train(root / "run", f"--train.record_routing={root / 'routes'}")
    return str(root / "routes"), trainer, records


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_replay_equals_recorded_run_with_moved_bias(tmp_path, recorded, recompute):
    """Also under full recompute: backward runs each block's routing again, by the same tape."""
    routes, ref, want = recorded
    # The recorded choices are not what the moved bias selects: some token avoids expert 0.
    _, experts = read_step(routes, 1, 0, 4, [0, 1])
    assert not (experts[0] % 4 == 0).any(-1).all()
    assert (experts[0] >= 4).any(), "capacity 1.0 drops some copy: the test covers drops"
    trainer, got = train(tmp_path / "run", f"--train.router_replay={routes}",
                         f"--train.recompute={recompute}", bias=HOT)
    assert got == want
    for (name, p), q in zip(trainer.model.state_dict().items(), ref.model.state_dict().values(),
                            strict=True):
        if not name.endswith("expert_bias_E"):
            assert torch.equal(p, q), name


def test_router_gets_gradient_at_replayed_experts():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2, norm_topk_prob=False).double()
    moe.router.expert_bias_E.copy_(HOT)
    tape = RoutingTape()
    model = torch.nn.Module()
    model.layers = [type("Block", (), {"is_moe": True, "ffn": moe, "layer_id": 3})()]
    attach_tape(model, tape)
    x = torch.randn(5, 8, dtype=torch.float64)
    replay_TK = torch.tensor([[1, 2], [3, 1], [2, 3], [1, 4 + 2], [3, 2]])   # 4 + 2: dropped 2
    tape.begin([{3: replay_TK}])
    tape.next_micro()
    out = moe(x)
    recorded = tape.end()
    assert torch.equal(recorded[0][3], replay_TK)
    out.y.sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0
    # Naive: the dropped copy adds nothing; each kept one is its expert times its softmax score.
    probs = torch.softmax(x @ moe.router.weight.detach().T, -1)
    w_in, w_out = moe.experts.w_in_EDU.detach(), moe.experts.w_out_EFD.detach()
    want = torch.zeros(5, 8, dtype=torch.float64)
    for t in range(5):
        for e in replay_TK[t].tolist():
            if e < 4:
                gate, up = (x[t] @ w_in[e]).chunk(2)
                want[t] += probs[t, e] * ((torch.nn.functional.silu(gate) * up) @ w_out[e])
    torch.testing.assert_close(out.y.detach(), want, rtol=1e-12, atol=1e-12)


def test_replay_dir_that_does_not_match(tmp_path, recorded):
    routes = recorded[0]
    with pytest.raises(RoutingError, match="model.num_experts=8"):
        Trainer(tiny_config(tmp_path / "a", *COMMON, "--model.num_experts=8",
                            f"--train.router_replay={routes}"), log=lambda _m: None)
    with pytest.raises(RoutingError, match=r"layers=\[0, 1\], this run has MoE layer numbers"):
        Trainer(tiny_config(tmp_path / "e", *COMMON, "--model.num_layers=3",
                            f"--train.router_replay={routes}"), log=lambda _m: None)
    with pytest.raises(RoutingError, match="no routing for step 3"):
        Trainer(tiny_config(tmp_path / "b", *COMMON, "--train.steps=3",
                            f"--train.router_replay={routes}"), log=lambda _m: None)
    with pytest.raises(RoutingError, match="tokens .* differ"):
        train(tmp_path / "c", "--train.seed=5", f"--train.router_replay={routes}")
    with pytest.raises(ValueError, match="parallel.pp=2"):
        tiny_config(tmp_path / "d", "--parallel.pp=2", f"--train.record_routing={routes}")
    with pytest.raises(ValueError, match="model.mtp_layers=1"):
        tiny_config(tmp_path / "e", "--model.mtp_layers=1", f"--train.router_replay={routes}")


def test_routed_experts_of_vllm_and_sglang():
    # 3 tokens, a 3-layer model whose layer 0 is dense (-1), top-2 of 4 experts.
    ids = np.array([[[-1, -1], [0, 3], [1, 2]],
                    [[-1, -1], [2, 1], [3, 0]],
                    [[-1, -1], [1, 0], [2, 2]]], dtype=np.int32)
    vllm = from_routed_experts(ids, top_k=2, moe_layers=[1, 2], num_layers=3)
    sglang = from_routed_experts(base64.b64encode(ids.tobytes()).decode(), top_k=2,
                                 moe_layers=[1, 2], num_layers=3)
    want = {1: torch.tensor([[0, 3], [2, 1], [1, 0]]), 2: torch.tensor([[1, 2], [3, 0], [2, 2]])}
    for got in (vllm, sglang):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(RoutingError, match="MoE layer 0"):
        from_routed_experts(ids, top_k=2, moe_layers=[0, 1], num_layers=3)


def test_generate_records_rollout_routing(tmp_path, recorded, capsys):
    """`moepar generate --record-routing`: the decode's choices, position by position, equal the
    router's own top-k on a teacher-forced forward of the same sequence (float64, dropless)."""
    run_dir = os.path.join(os.path.dirname(recorded[0]), "run")
    rollout = str(tmp_path / "rollout")
    assert generate_main([run_dir, "--prompt", "the", "--max-new-tokens", "4", "--temperature",
                          "0", "--ignore-eos", "--dtype", "float64", "--record-routing",
                          rollout]) == 0
    model = load(run_dir, dtype=torch.float64).model     # dropless, as generate builds it
    ids, experts = read_step(rollout, 1, 0, 1, [0, 1])
    assert ids.shape == (1, 3 + 4 - 1)                   # 3 prompt bytes, 4 new, the last unfed
    routed = {}
    hooks = [m.router.register_forward_hook(
        lambda _m, _a, out, i=i: routed.__setitem__(i, out.routing.expert_N.view(-1, 2)))
        for i, m in enumerate(model.moe_layers())]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    for layer in (0, 1):
        assert torch.equal(experts[layer][0].sort(-1).values, routed[layer].sort(-1).values)
    capsys.readouterr()
    assert generate_main([run_dir, "--prompt", "the", "--max-new-tokens", "2",
                          "--record-routing", rollout]) == 1
    assert "already holds recorded steps" in capsys.readouterr().err
