"""Hugging Face architectures: config.json fields and tensor names, both ways.

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE map onto one moepar model (options: q/k norms, q/k/v
biases, shared experts with a sigmoid gate, dense layers by step and list). `read_hf_config`
reads config.json under all the names these architectures use; `hf_to_canonical` and
`canonical_to_hf` stream tensors between HF names and moepar's canonical (layout-free) names,
holding only a gate projection until its up projection arrives.
"""

import json
import os
import re
from dataclasses import dataclass

import torch

from moepar.layers.model import ModelConfig
from moepar.layers.router import RouterConfig

__all__ = ["ARCHS", "Arch", "ConversionError", "read_hf_config", "hf_to_canonical",
           "canonical_to_hf", "hf_config_dict", "expected_canonical", "arch_by_name"]


class ConversionError(ValueError):
    pass


@dataclass(frozen=True)
class Arch:
    name: str              # config.json model_type
    hf_class: str          # architectures[0]
    moe: str               # the MoE block's attribute name
    expert: tuple          # (gate, up, down) projection names inside an expert
    qk_norm: str = "none"
    shared: bool = False   # Qwen2-MoE shared expert (+ sigmoid gate)
    norm_topk_default: bool = False


ARCHS = {a.name: a for a in (
    Arch("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), norm_topk_default=True),
    Arch("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), shared=True),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), qk_norm="head"),
    Arch("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), qk_norm="full"),
)}


def arch_by_name(model_type: str) -> Arch:
    if model_type not in ARCHS:
        raise ConversionError(f"unsupported architecture model_type={model_type!r}; supported: "
                              f"{', '.join(ARCHS)}")
    return ARCHS[model_type]


def _first(cfg: dict, *names, default=None):
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is None:
        raise ConversionError(f"config.json has none of {names}")
    return default


def read_hf_config(path: str) -> tuple[Arch, ModelConfig, RouterConfig]:
    """Reads config.json under all the names these architectures use; refuses what we cannot run."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConversionError(f"{path!r} has no config.json")
    with open(file) as f:
        cfg = json.load(f)
    arch = arch_by_name(cfg.get("model_type", "?"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={cfg['hidden_act']!r}: only silu (SwiGLU) is supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConversionError(f"rope scaling {rope!r} is not supported (only plain RoPE)")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and window < cfg.get("max_position_embeddings", 0):
        raise ConversionError(f"sliding_window={window} attention is not supported")
    if cfg.get("clip_qkv") is not None:
        raise ConversionError(f"clip_qkv={cfg['clip_qkv']} is not supported")
    dim = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    num_layers = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    expert_ffn = _first(cfg, "moe_intermediate_size", "intermediate_size")
    model = ModelConfig(
        vocab_size=cfg["vocab_size"], dim=dim, num_layers=num_layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or 0,
        ffn_dim=cfg.get("intermediate_size", expert_ffn), moe_ffn_dim=expert_ffn,
        num_experts=_first(cfg, "num_local_experts", "num_experts", "n_routed_experts"),
        top_k=cfg["num_experts_per_tok"], moe_every=step, moe_offset=step - 1,
        dense_layers=list(cfg.get("mlp_only_layers") or []),
        num_shared_experts=1 if arch.shared else 0,
        shared_ffn_dim=cfg.get("shared_expert_intermediate_size", 0) if arch.shared else 0,
        shared_gate=arch.shared, attention_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", False))),
        qk_norm=arch.qk_norm, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), init_std=cfg.get("initializer_range", 0.02))
    router = RouterConfig(norm_topk_prob=bool(cfg.get("norm_topk_prob", arch.norm_topk_default)),
                          balance_coeff=float(cfg.get("router_aux_loss_coef", 0.01)))
    return arch, model, router


# ---- names ------------------------------------------------------------------------------------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "head.weight"}


def _hf_role(arch: Arch, cfg: ModelConfig, name: str):
    """(canonical name, role, part) for an HF tensor name, or None if unknown.

    Roles: copy; cat_t (expert w_in = [gate^T | up^T], part 0/1); t (transpose: expert w_out);
    cat0 (Linear w_in = [gate; up] along dim 0, part 0/1); stacked_gate_up / stacked_down.
    """
    if name in _TOP:
        return _TOP[name], "copy", 0
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = int(m.group(1)), m.group(2)
    pre = f"layers.{i}"
    simple = {"input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight"}
    if rest in simple:
        return f"{pre}.{simple[rest]}", "copy", 0
    m2 = re.match(r"^self_attn\.([qkvo]_proj\.(?:weight|bias)|[qk]_norm\.weight)$", rest)
    if m2:
        return f"{pre}.attn.{m2.group(1)}", "copy", 0
    gate, up, down = arch.expert
    moe = arch.moe
    if cfg.is_moe_layer(i):
        if rest == f"{moe}.gate.weight":
            return f"{pre}.ffn.router.weight", "copy", 0
        m3 = re.match(rf"^{moe}\.experts\.(\d+)\.(\w+)\.weight$", rest)
        if m3 and m3.group(2) in (gate, up, down) and int(m3.group(1)) < cfg.num_experts:
            e, proj = m3.group(1), m3.group(2)
            if proj == down:
                return f"{pre}.ffn.experts.{e}.w_out", "t", 0
            return f"{pre}.ffn.experts.{e}.w_in", "cat_t", 0 if proj == gate else 1
        if rest == f"{moe}.experts.gate_up_proj":
            return f"{pre}.ffn.experts", "stacked_gate_up", 0
        if rest == f"{moe}.experts.down_proj":
            return f"{pre}.ffn.experts", "stacked_down", 0
        if arch.shared:
            m4 = re.match(r"^mlp\.shared_expert\.(gate|up|down)_proj\.weight$", rest)
            if m4:
                if m4.group(1) == "down":
                    return f"{pre}.ffn.shared.ffn.w_out.weight", "copy", 0
                return f"{pre}.ffn.shared.ffn.w_in.weight", "cat0", 0 if m4.group(1) == "gate" else 1
            if rest == "mlp.shared_expert_gate.weight":
                return f"{pre}.ffn.shared.gate.weight", "copy", 0
        return None
    m5 = re.match(r"^mlp\.(gate|up|down)_proj\.weight$", rest)
    if m5:
        if m5.group(1) == "down":
            return f"{pre}.ffn.w_out.weight", "copy", 0
        return f"{pre}.ffn.w_in.weight", "cat0", 0 if m5.group(1) == "gate" else 1
    return None


def expected_canonical(model_cfg: ModelConfig, router_cfg: RouterConfig) -> dict[str, tuple]:
    """Canonical name -> shape for a full model of this config (built on the meta device)."""
    from moepar.checkpoint import canonical_items, Owner
    from moepar.layers import Transformer
    with torch.device("meta"):
        model = Transformer(model_cfg, router_cfg)
    return {name: tuple(t.shape) for name, t in
            canonical_items(model, model.state_dict(), Owner())}


def hf_to_canonical(arch: Arch, cfg: ModelConfig, tensors):
    """Streams (canonical name, tensor) from (HF name, tensor); holds only unpaired halves."""
    pending: dict[str, list] = {}
    for name, tensor in tensors:
        if _IGNORED.search(name):
            continue
        role = _hf_role(arch, cfg, name)
        if role is None:
            raise ConversionError(f"unexpected tensor {name!r} for {arch.name} (layer kinds: "
                                  f"MoE layers {[i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]})")
        target, how, part = role
        if how == "copy":
            yield target, tensor
        elif how == "t":
            yield target, tensor.t().contiguous()
        elif how in ("cat_t", "cat0"):
            halves = pending.setdefault(target, [None, None])
            if halves[part] is not None:
                raise ConversionError(f"tensor {name!r} appears twice")
            halves[part] = tensor
            if halves[0] is not None and halves[1] is not None:
                del pending[target]
                yield target, (torch.cat([halves[0].t(), halves[1].t()], dim=1) if how == "cat_t"
                               else torch.cat(halves, dim=0))
        elif how == "stacked_gate_up":
            for e in range(tensor.shape[0]):
                yield f"{target}.{e}.w_in", tensor[e].t().contiguous()
        else:  # stacked_down
            for e in range(tensor.shape[0]):
                yield f"{target}.{e}.w_out", tensor[e].t().contiguous()
    if pending:
        missing = sorted(pending)[:5]
        raise ConversionError(f"gate/up halves without their partner for {missing}")


def canonical_to_hf(arch: Arch, cfg: ModelConfig, tensors):
    """Streams (HF name, tensor) from (canonical name, tensor): the inverse of hf_to_canonical."""
    gate, up, down = arch.expert
    for name, t in tensors:
        if name in _TOP.values():
            yield next(k for k, v in _TOP.items() if v == name), t
            continue
        m = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if not m:
            raise ConversionError(f"unexpected moepar tensor {name!r}")
        i, rest = m.group(1), m.group(2)
        pre = f"model.layers.{i}"
        if rest == "attn_norm.weight":
            yield f"{pre}.input_layernorm.weight", t
        elif rest == "ffn_norm.weight":
            yield f"{pre}.post_attention_layernorm.weight", t
        elif rest.startswith("attn."):
            yield f"{pre}.self_attn.{rest[5:]}", t
        elif rest == "ffn.router.weight":
            yield f"{pre}.{arch.moe}.gate.weight", t
        elif rest == "ffn.router.expert_bias_E":
            if torch.count_nonzero(t):
                raise ConversionError(f"{name} is non-zero (aux-loss-free balancing bias): "
                                      f"{arch.name} has no field for it")
        elif m2 := re.match(r"^ffn\.experts\.(\d+)\.(w_in|w_out)$", rest):
            e = m2.group(1)
            base = f"{pre}.{arch.moe}.experts.{e}"
            if m2.group(2) == "w_out":
                yield f"{base}.{down}.weight", t.t().contiguous()
            else:
                half = t.shape[1] // 2
                yield f"{base}.{gate}.weight", t[:, :half].t().contiguous()
                yield f"{base}.{up}.weight", t[:, half:].t().contiguous()
        elif rest in ("ffn.w_in.weight", "ffn.shared.ffn.w_in.weight"):
            base = f"{pre}.mlp" + (".shared_expert" if "shared" in rest else "")
            half = t.shape[0] // 2
            yield f"{base}.gate_proj.weight", t[:half].contiguous()
            yield f"{base}.up_proj.weight", t[half:].contiguous()
        elif rest in ("ffn.w_out.weight", "ffn.shared.ffn.w_out.weight"):
            yield f"{pre}.mlp" + (".shared_expert" if "shared" in rest else "") + ".down_proj.weight", t
        elif rest == "ffn.shared.gate.weight":
            yield f"{pre}.mlp.shared_expert_gate.weight", t
        else:
            raise ConversionError(f"unexpected moepar tensor {name!r}")


def hf_config_dict(arch: Arch, cfg: ModelConfig, router: RouterConfig) -> dict:
    """config.json for a model that did not come from Hugging Face (refuses what arch cannot say)."""
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    problems = []
    if cfg.qk_norm != arch.qk_norm:
        problems.append(f"model.qk_norm={cfg.qk_norm!r} ({arch.name} has {arch.qk_norm!r})")
    if (cfg.num_shared_experts > 0) != arch.shared or (arch.shared and not cfg.shared_gate):
        problems.append("shared experts" + (" with a sigmoid gate" if arch.shared else ""))
    if cfg.attention_bias and arch.name != "qwen2_moe":
        problems.append("model.attention_bias=true")
    if arch.name in ("mixtral", "olmoe") and len(moe_layers) != cfg.num_layers:
        problems.append("dense layers")
    if router.score_func != "softmax" or router.type != "topk" or router.n_group > 1:
        problems.append("a router other than softmax top-k")
    if cfg.activation != "swiglu":
        problems.append(f"model.activation={cfg.activation!r}")
    if problems:
        raise ConversionError(f"this model cannot be written as {arch.name}: {', '.join(problems)}")
    out = {"architectures": [arch.hf_class], "model_type": arch.name, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "head_dim": cfg.head_dim_resolved, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta,
           "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
           "tie_word_embeddings": cfg.tie_embeddings, "num_experts_per_tok": cfg.top_k,
           "norm_topk_prob": router.norm_topk_prob, "router_aux_loss_coef": router.balance_coeff,
           "initializer_range": cfg.init_std, "torch_dtype": "float32"}
    if arch.name == "mixtral":
        out.update(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_ffn_dim)
        if not router.norm_topk_prob:
            raise ConversionError("mixtral always renormalises the top-k weights: "
                                  "router.norm_topk_prob must be true")
    else:
        out.update(num_experts=cfg.num_experts)
    if arch.name == "olmoe":
        out.update(intermediate_size=cfg.moe_ffn_dim, attention_bias=False, clip_qkv=None)
    if arch.name in ("qwen2_moe", "qwen3_moe"):
        out.update(intermediate_size=cfg.ffn_dim, moe_intermediate_size=cfg.moe_ffn_dim,
                   decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe_layers])
    if arch.name == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.num_shared_experts * (cfg.shared_ffn_dim or cfg.moe_ffn_dim),
                   qkv_bias=cfg.attention_bias)
    if arch.name == "qwen3_moe":
        out.update(attention_bias=False)
    return out


