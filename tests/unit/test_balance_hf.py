"""router.balance_loss='all_layers' against transformers' own `load_balancing_loss_func`, on tiny
Mixtral, Qwen3-MoE and OLMoE models built with transformers' config classes and converted: the
loss value and its gradients in float64; the HF models' own aux loss and router gradients; import
and export of the coefficient; DeepSeek-V3, for which transformers trains no balance loss.
    python -m pytest tests/unit/test_balance_hf.py -q
"""

import importlib
import json
import math
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moepar.hf import from_hf, hf_to_moepar, moepar_to_hf  # noqa: E402
from moepar.hf.arch import ARCHS as HF_ARCHS, hf_config_dict, read_hf_config  # noqa: E402
from moepar.layers import ModelConfig, RouterConfig  # noqa: E402
from moepar.layers.balance import BalanceStep, MicroBalance  # noqa: E402

COEF = 0.02
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
              initializer_range=0.1, router_aux_loss_coef=COEF)
# (config class, model class, modeling module, options); every arch has >= 2 MoE layers, so
# the loss over all layers differs from any per-layer one.
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral",
                dict(intermediate_size=48, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe",
                  dict(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                       norm_topk_prob=True, head_dim=16, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "olmoe",
              dict(intermediate_size=24, num_experts=4)),
}


def hf_model(arch: str, tmp_path, **extra):
    config_cls, model_cls, _, kwargs = ARCHS[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **extra})
    model = getattr(transformers, model_cls)(config)
    path = tmp_path / arch
    model.save_pretrained(path)
    return model, str(path)


class _Torch64:
    """`torch` as transformers' loss function sees it, with float32 read as float64."""
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def hf_loss_float64(arch: str, monkeypatch):
    """transformers' load_balancing_loss_func for `arch`, its own code, run in float64: it
    accumulates in float32 (its zeros, histc dtype and `.float()`), which would round the
    comparison to ~1e-7; here those read as float64 and nothing else changes."""
    module = importlib.import_module(f"transformers.models.{ARCHS[arch][2]}.modeling_{ARCHS[arch][2]}")
    fn = module.load_balancing_loss_func
    to_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t, *a, **k: t if t.dtype == torch.float64
                        else to_float(t, *a, **k))
    widened = type(fn)(fn.__code__, {**fn.__globals__, "torch": _Torch64()}, fn.__name__,
                       fn.__defaults__, fn.__closure__)
    return fn, widened


def recording_logits(model) -> list:
    """Makes each MoE router record its logits (with their graph) as the model runs."""
    record = []
    for moe in model.moe_layers():
        moe.router.logits = (lambda f: lambda x: record.append(f(x)) or record[-1])(moe.router.logits)
    return record


def ids(batch=2, seq=12, seed=1):
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_value_and_gradients_equal_transformers_loss_function(arch, tmp_path, monkeypatch):
    """On the converted model's own router logits: the loss moepar trains equals transformers'
    function (float64, 1e-12), and so does its gradient into every parameter, through the
    deferred injection (the output gets a zero gradient: only the balance loss reaches the
    parameters) against autograd through transformers' function."""
    _, path = hf_model(arch, tmp_path)
    model = from_hf(path, torch.float64).model
    cfg, router = model.cfg, model.router_cfg
    assert (router.balance_loss, router.balance_coeff) == ("all_layers", COEF)
    logits = recording_logits(model)
    params = dict(model.named_parameters())
    plain, widened = hf_loss_float64(arch, monkeypatch)
    # The reference: transformers' function on the logits of a forward that injects nothing
    # (an injection would add its gradient wherever autograd passes the layer).
    model.set_aux_loss_scale(None)
    model(ids(), MicroBalance())        # (a holder of its own: nothing finishes it)
    want = widened(tuple(logits), cfg.num_experts, cfg.top_k)
    assert want.dtype == torch.float64 and len(logits) == len(model.moe_layers()) >= 2
    want_grads = torch.autograd.grad(COEF * want, list(params.values()), allow_unused=True)
    # transformers' function unchanged (float32 sums) agrees to its own precision
    want32 = plain(tuple(logits), cfg.num_experts, cfg.top_k)
    model.set_aux_loss_scale(1.0)
    holder = MicroBalance()
    out, _ = model(ids(), holder)
    value = BalanceStep(router, cfg.num_experts, cfg.top_k).finish(holder)
    assert math.isclose(float(value), COEF * float(want.detach()), rel_tol=1e-12)
    assert math.isclose(float(value), COEF * float(want32.detach()), rel_tol=1e-6)
    (out * 0).sum().backward()
    checked = 0
    for (name, p), g in zip(params.items(), want_grads, strict=True):
        if g is None:      # (the head, after the last router: no balance gradient)
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-15, msg=name)
        checked += "router" in name
    assert checked == len(model.moe_layers())


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_models_own_aux_loss_and_router_gradients(arch, tmp_path):
    """The HF model itself (float64 parameters; it rounds router probabilities and norms
    through float32, hence the tolerance): its aux_loss equals moepar's unweighted value, and
    the router gradients of its training loss (cross-entropy + router_aux_loss_coef * aux)
    equal the converted model's."""
    hf, path = hf_model(arch, tmp_path)
    hf.config._experts_implementation = "eager"   # (its grouped GEMM takes no float64)
    hf = hf.double().train()
    tokens = ids()
    out = hf(tokens, labels=tokens, output_router_logits=True)
    out.loss.backward()
    model = from_hf(path, torch.float64).model
    holder = MicroBalance()
    logits, _ = model(tokens, holder)
    value = BalanceStep(model.router_cfg, model.cfg.num_experts, model.cfg.top_k).finish(holder)
    assert math.isclose(float(value) / COEF, float(out.aux_loss.detach()), rel_tol=1e-5)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    ce.backward()
    moe_layers = [i for i in range(COMMON["num_hidden_layers"]) if model.cfg.is_moe_layer(i)]
    gates = {int(n.split(".")[2]): p for n, p in hf.named_parameters() if n.endswith(".gate.weight")
             and "shared" not in n}
    assert sorted(gates) == moe_layers
    for i in moe_layers:
        want = gates[i].grad
        got = model.get_parameter(f"layers.{i}.ffn.router.weight").grad
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"layer {i}")
    # without the balance loss the routers' gradients differ: the loss is not vanishing here
    model.zero_grad()
    plain, _ = model(tokens, MicroBalance())          # a holder never finished: no coefficient
    with pytest.raises(RuntimeError, match="got no coefficient"):
        plain.sum().backward()


@pytest.mark.parametrize("arch", ARCHS)
def test_import_sets_and_export_writes_back_the_coefficient(arch, tmp_path):
    _, path = hf_model(arch, tmp_path, router_aux_loss_coef=0.037)
    _, model_cfg, router = read_hf_config(path)
    assert (router.balance_loss, router.balance_scope, router.balance_coeff) == (
        "all_layers", "micro_batch", 0.037)
    hf_to_moepar(path, str(tmp_path / "mp"), log=lambda _m: None)
    # as if fine-tuned with another coefficient: the export writes the one it trains with
    from moepar.checkpoint import MANIFEST, commit
    shutil.copytree(tmp_path / "mp", tmp_path / "mp.tmp")
    os.remove(tmp_path / "mp.tmp" / MANIFEST)
    state = tmp_path / "mp.tmp" / "state.json"
    meta = json.loads(state.read_text())
    meta["config"]["router"]["balance_coeff"] = 0.05
    state.write_text(json.dumps(meta))
    commit(str(tmp_path / "mp.tmp"), str(tmp_path / "tuned"), 0)
    notes = []
    moepar_to_hf(str(tmp_path / "tuned"), str(tmp_path / "back"), log=notes.append)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["router_aux_loss_coef"] == 0.05 and not any("balance" in n for n in notes)
    # transformers' default when config.json has no router_aux_loss_coef
    cfg = json.loads((tmp_path / arch / "config.json").read_text())
    del cfg["router_aux_loss_coef"]
    (tmp_path / arch / "config.json").write_text(json.dumps(cfg))
    default = getattr(transformers, ARCHS[arch][0])().router_aux_loss_coef
    assert read_hf_config(path)[2].balance_coeff == default


def _qwen3(num_layers: int, **router):
    model = ModelConfig(vocab_size=64, dim=32, num_layers=num_layers, num_heads=4,
                        num_kv_heads=2, head_dim=8, qk_norm="head", num_experts=4, top_k=2)
    return model, RouterConfig(norm_topk_prob=True, **router)


def test_export_of_per_layer_with_one_moe_layer_converts_the_coefficient(tmp_path):
    """One MoE layer: transformers' loss is K times the per-layer one, so coefficient / K gives
    the same training loss, shown on transformers' function."""
    model_cfg, router = _qwen3(1, balance_coeff=0.03)
    out = hf_config_dict(HF_ARCHS["qwen3_moe"], model_cfg, router)
    assert out["router_aux_loss_coef"] == pytest.approx(0.03 / 2, rel=1e-15)
    from moepar.layers import Transformer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    torch.manual_seed(0)
    model = Transformer(model_cfg, router).double()
    record = recording_logits(model)
    _, outs = model(ids())
    per_layer = router.balance_coeff * outs[0].aux_loss.balance
    hf = out["router_aux_loss_coef"] * load_balancing_loss_func(tuple(record), 4, 2)
    assert math.isclose(float(per_layer), float(hf.detach()), rel_tol=1e-6)   # (float32 sums)


def test_export_of_per_layer_with_several_moe_layers_states_the_mismatch():
    from moepar.hf.arch import export_notes
    model_cfg, router = _qwen3(3, balance_coeff=0.03)
    out = hf_config_dict(HF_ARCHS["qwen3_moe"], model_cfg, router)
    assert out["router_aux_loss_coef"] == 0.03
    (note,) = export_notes(HF_ARCHS["qwen3_moe"], router, model_cfg)
    assert "router.balance_loss='per_layer'" in note and "summed over 3" in note
    assert "about K/L=2/3" in note and "about 0.045 would match" in note
    all_layers = RouterConfig(norm_topk_prob=True, balance_coeff=0.03, balance_loss="all_layers")
    assert export_notes(HF_ARCHS["qwen3_moe"], all_layers, model_cfg) == []
    assert hf_config_dict(HF_ARCHS["qwen3_moe"], model_cfg, all_layers)["router_aux_loss_coef"] \
        == 0.03


# ---- DeepSeek-V3: transformers trains no balance loss; the selection bias --------------------

def deepseek_v3(tmp_path):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=24,
        n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        routed_scaling_factor=2.5)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():     # the score-correction bias must steer selection, not sit at 0
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "ds")
    return model, str(tmp_path / "ds")


def test_deepseek_v3_trains_no_balance_loss_in_transformers(tmp_path):
    """transformers' DeepseekV3ForCausalLM: the training loss is the cross-entropy alone, even
    asked for router logits (no aux loss in the output); so import sets no balance loss."""
    hf, path = deepseek_v3(tmp_path)
    tokens = ids()
    out = hf.train()(tokens, labels=tokens, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(),
                                           tokens[:, 1:].flatten())
    assert float(out.loss.detach()) == float(ce.detach())
    assert getattr(out, "aux_loss", None) is None
    assert len(out.router_logits) == 2       # computed, and left unused
    _, _, router = read_hf_config(path)
    assert (router.balance_coeff, router.seq_balance_coeff, router.z_coeff) == (0.0, 0.0, 0.0)
    assert not router.deferred_balance


def test_deepseek_v3_bias_steers_selection_not_weights_as_in_transformers(tmp_path):
    """The converted router picks transformers' experts (e_score_correction_bias added for the
    choice, group-limited) and weighs them as it does (the unbiased sigmoid scores, normalised,
    times routed_scaling_factor); with the bias zeroed the choice changes, the rule does not."""
    hf, path = deepseek_v3(tmp_path)
    model = from_hf(path, torch.float32).model
    x = torch.randn(40, COMMON["hidden_size"], generator=torch.Generator().manual_seed(2))
    for i in (1, 2):
        gate, router = hf.model.layers[i].mlp.gate, model.layers[i].ffn.router
        for zero_bias in (False, True):
            if zero_bias:
                with torch.no_grad():
                    gate.e_score_correction_bias.zero_()
                    router.expert_bias_E.zero_()
            _, want_w, want_e = gate(x)
            routing, _, _ = router(x)
            got_e, got_w = routing.expert_N.view(40, -1), routing.weight_N.view(40, -1)
            order_want, order_got = want_e.argsort(-1), got_e.argsort(-1)
            assert torch.equal(got_e.gather(1, order_got), want_e.gather(1, order_want))
            torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want),
                                       rtol=1e-6, atol=1e-7)
            if not zero_bias:
                biased = got_e.sort(-1).values
        assert not torch.equal(biased, got_e.sort(-1).values)     # the bias did steer


def test_sequence_balance_loss_is_deepseek_v3_formula():
    """router.seq_balance_coeff's loss is DeepSeek-V3's complementary sequence-wise loss
    (arXiv 2412.19437, eqs. 17-20) with the routed experts as its indicator: per sequence,
    f_i = E/(K S) * #tokens routed to i, P_i = mean over tokens of s_i / sum_j s_j (sigmoid
    affinities normalised), loss = sum_i f_i P_i, averaged over sequences. Written here
    loop by loop from the paper; moepar's router computes it from its own tensors."""
    from moepar.layers.router import TopKRouter
    E, K, B, S = 8, 2, 3, 10
    torch.manual_seed(0)
    router = TopKRouter(16, E, K, RouterConfig(score_func="sigmoid", n_group=2, topk_group=1,
                                               seq_balance_coeff=1.0)).double()
    x = torch.randn(B * S, 16, dtype=torch.float64)
    routing, losses, _ = router(x, seq_len=S)
    s = torch.sigmoid(x @ router.weight.detach().t())
    chosen = routing.expert_N.view(B, S, K)
    want = 0.0
    for b in range(B):
        for i in range(E):
            f = E / (K * S) * sum(int(i in chosen[b, t].tolist()) for t in range(S))
            p = sum(float(s[b * S + t, i] / s[b * S + t].sum()) for t in range(S)) / S
            want += f * p / B
    assert math.isclose(float(losses.seq_balance), want, rel_tol=1e-12)
