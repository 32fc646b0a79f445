"""Hugging Face architectures: config.json fields and tensor names, both ways.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 map onto one moepar model (options: q/k
norms, q/k/v biases, shared experts with or without a sigmoid gate, dense layers by step, list or
first k, multi-head latent attention, sigmoid group-limited routing with a selection bias). `read_hf_config`
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
    shared: str = ""       # the shared MLP's attribute: Qwen2-MoE "shared_expert", DeepSeek "shared_experts"
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on it
    norm_topk_default: bool = False
    mla: bool = False      # DeepSeek multi-head latent attention


ARCHS = {a.name: a for a in (
    Arch("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), norm_topk_default=True),
    Arch("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
         shared="shared_expert", shared_gate=True),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), qk_norm="head"),
    Arch("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), qk_norm="full"),
    Arch("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
         shared="shared_experts", mla=True, norm_topk_default=True),
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


_REQUIRED = ("model_type", "hidden_size", "num_attention_heads", "num_hidden_layers",
             "vocab_size", "num_experts_per_tok")
_WHOLE = _REQUIRED[1:] + (
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "n_routed_experts", "num_local_experts", "num_experts", "decoder_sparse_step",
    "first_k_dense_replace", "n_shared_experts", "shared_expert_intermediate_size",
    "max_position_embeddings", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "sliding_window")
_REAL = ("rope_theta", "rms_norm_eps", "initializer_range", "routed_scaling_factor",
         "router_aux_loss_coef")
_FLAGS = ("tie_word_embeddings", "attention_bias", "qkv_bias", "norm_topk_prob",
          "use_sliding_window", "rope_interleave")


def load_config_json(file: str) -> dict:
    """config.json as a dict whose settings have the types read_hf_config relies on; a
    ConversionError naming the file and the key otherwise (never a traceback)."""
    import math
    try:
        with open(file, "rb") as f:
            cfg = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConversionError(f"{file} holds a JSON {type(cfg).__name__}, not an object of "
                              "settings")
    if not isinstance(cfg.get("model_type", "?"), str):
        raise ConversionError(f"{file}: model_type={cfg['model_type']!r} is not a string")
    arch_by_name(cfg.get("model_type", "?"))     # an unsupported model: say so first
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise ConversionError(f"{file} lacks {', '.join(missing)}")

    def bad(key, what):
        raise ConversionError(f"{file}: {key}={cfg[key]!r} is not {what}")
    for key in _WHOLE:
        if cfg.get(key) is not None and (type(cfg[key]) is not int or cfg[key] < 0):
            bad(key, "a whole number >= 0")
    for key in _REAL:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            bad(key, "a finite number")
    for key in _FLAGS:
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            bad(key, "true or false")
    for key in ("model_type", "hidden_act", "topk_method", "scoring_func"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            bad(key, "a string")
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            bad(key, "an object")
    layers = cfg.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list)
                                   and all(type(i) is int and i >= 0 for i in layers)):
        bad("mlp_only_layers", "a list of layer numbers")
    return cfg


def read_hf_config(path: str) -> tuple[Arch, ModelConfig, RouterConfig]:
    """Reads config.json under all the names these architectures use; refuses what we cannot run."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConversionError(f"{path!r} has no config.json")
    cfg = load_config_json(file)
    arch = arch_by_name(cfg.get("model_type", "?"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={cfg['hidden_act']!r}: only silu (SwiGLU) is supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConversionError(f"rope scaling {rope!r} is not supported (only plain RoPE)")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and window < cfg.get("max_position_embeddings", 0):
        raise ConversionError(f"sliding_window={window} attention is not supported")
    if arch.mla and cfg.get("attention_bias"):
        raise ConversionError("attention_bias=true is not supported for deepseek_v3")
    if arch.name in ("qwen3_moe", "olmoe") and cfg.get("attention_bias"):
        raise ConversionError("attention_bias=true (o_proj bias too) is not supported")
    if cfg.get("clip_qkv") is not None:
        raise ConversionError(f"clip_qkv={cfg['clip_qkv']} is not supported")
    dim = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    num_layers = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    expert_ffn = _first(cfg, "moe_intermediate_size", "intermediate_size")
    model = ModelConfig(
        vocab_size=cfg["vocab_size"], dim=dim, num_layers=num_layers, num_heads=heads,
        num_kv_heads=heads if arch.mla else (cfg.get("num_key_value_heads") or heads),
        head_dim=0 if arch.mla else (cfg.get("head_dim") or 0),
        ffn_dim=cfg.get("intermediate_size", expert_ffn), moe_ffn_dim=expert_ffn,
        num_experts=_first(cfg, "n_routed_experts", "num_local_experts", "num_experts"),
        top_k=cfg["num_experts_per_tok"], moe_every=step, moe_offset=step - 1,
        first_k_dense=cfg.get("first_k_dense_replace", 0) or 0,
        dense_layers=list(cfg.get("mlp_only_layers") or []),
        num_shared_experts=(cfg.get("n_shared_experts") or 1) if arch.shared else 0,
        shared_ffn_dim=cfg.get("shared_expert_intermediate_size", expert_ffn) if arch.shared else 0,
        shared_gate=arch.shared_gate,
        attention_bias=bool(cfg.get("qkv_bias", True)) if arch.name == "qwen2_moe" else False,
        qk_norm=arch.qk_norm, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **_mla_fields(arch, cfg),
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), init_std=cfg.get("initializer_range", 0.02))
    routing = {}
    if arch.mla:   # sigmoid scores, score-correction bias, group-limited top-k, scaling
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConversionError("deepseek_v3 routing other than sigmoid noaux_tc is not supported")
        routing = dict(score_func="sigmoid", n_group=cfg.get("n_group") or 1,
                       topk_group=cfg.get("topk_group") or 1,
                       routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    router = RouterConfig(norm_topk_prob=bool(cfg.get("norm_topk_prob", arch.norm_topk_default)),
                          balance_coeff=float(cfg.get("router_aux_loss_coef", 0.0 if arch.mla else 0.01)),
                          **routing)
    return arch, model, router


def _mla_fields(arch: Arch, cfg: dict) -> dict:
    if not arch.mla:
        return {}
    return dict(attention="mla", q_lora_rank=cfg.get("q_lora_rank") or 0,
                kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"])


def rope_interleaved(cfg_json: dict) -> bool:
    """DeepSeek checkpoints store RoPE dims as interleaved pairs unless rope_interleave is false."""
    return cfg_json.get("model_type") == "deepseek_v3" and cfg_json.get("rope_interleave", True)


def _rope_rows(cfg: ModelConfig, which: str, inverse: bool) -> torch.Tensor:
    """Row order turning interleaved RoPE pairs (x0,x1),(x2,x3).. into halves [x0,x2,..|x1,x3,..]."""
    r = cfg.qk_rope_head_dim
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    if inverse:
        perm = torch.argsort(perm)
    if which == "q":
        head = cfg.qk_nope_head_dim + r
        rows = torch.arange(cfg.num_heads * head).view(cfg.num_heads, head)
        rows[:, cfg.qk_nope_head_dim:] = rows[:, cfg.qk_nope_head_dim:][:, perm]
        return rows.flatten()
    rows = torch.arange(cfg.kv_lora_rank + r)
    rows[cfg.kv_lora_rank:] = rows[cfg.kv_lora_rank:][perm]
    return rows


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
    if arch.mla:
        mla = {"self_attn.q_a_proj.weight": ("q_a_proj.weight", "copy"),
               "self_attn.q_a_layernorm.weight": ("q_a_norm.weight", "copy"),
               "self_attn.q_b_proj.weight": ("q_b_proj.weight", "rope_q"),
               "self_attn.q_proj.weight": ("q_proj.weight", "rope_q"),
               "self_attn.kv_a_proj_with_mqa.weight": ("kv_a_proj.weight", "rope_kv"),
               "self_attn.kv_a_layernorm.weight": ("kv_a_norm.weight", "copy"),
               "self_attn.kv_b_proj.weight": ("kv_b_proj.weight", "copy"),
               "self_attn.o_proj.weight": ("o_proj.weight", "copy")}
        if rest in mla:
            return f"{pre}.attn.{mla[rest][0]}", mla[rest][1], 0
        if rest.startswith("self_attn."):
            return None
    m2 = re.match(r"^self_attn\.([qkvo]_proj\.(?:weight|bias)|[qk]_norm\.weight)$", rest)
    if m2:
        return f"{pre}.attn.{m2.group(1)}", "copy", 0
    gate, up, down = arch.expert
    moe = arch.moe
    if cfg.is_moe_layer(i):
        if rest == f"{moe}.gate.weight":
            return f"{pre}.ffn.router.weight", "copy", 0
        if rest == f"{moe}.gate.e_score_correction_bias":
            return f"{pre}.ffn.router.expert_bias_E", "copy", 0
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
            m4 = re.match(rf"^{moe}\.{arch.shared}\.(gate|up|down)_proj\.weight$", rest)
            if m4:
                if m4.group(1) == "down":
                    return f"{pre}.ffn.shared.ffn.w_out.weight", "copy", 0
                return f"{pre}.ffn.shared.ffn.w_in.weight", "cat0", 0 if m4.group(1) == "gate" else 1
            if arch.shared_gate and rest == f"{moe}.{arch.shared}_gate.weight":
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
    from moepar.layers import Transformer
    from moepar.layers.init import canonical_tensors
    with torch.device("meta"):
        model = Transformer(model_cfg, router_cfg, seed=0)
    return {name: t.shape for name, t in canonical_tensors(model).items()}


def hf_to_canonical(arch: Arch, cfg: ModelConfig, tensors, interleaved: bool = False):
    """Streams (canonical name, tensor) from (HF name, tensor); holds only unpaired halves.

    `interleaved`: the checkpoint's RoPE rows are interleaved pairs (DeepSeek); they are
    reordered into rotate-half halves on the way in."""
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
        elif how in ("rope_q", "rope_kv"):
            yield target, (tensor[_rope_rows(cfg, how[5:], inverse=False)] if interleaved else tensor)
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


_MLA_OUT = {"q_a_proj.weight": "q_a_proj.weight", "q_a_norm.weight": "q_a_layernorm.weight",
            "q_b_proj.weight": "q_b_proj.weight", "q_proj.weight": "q_proj.weight",
            "kv_a_proj.weight": "kv_a_proj_with_mqa.weight", "kv_a_norm.weight": "kv_a_layernorm.weight",
            "kv_b_proj.weight": "kv_b_proj.weight", "o_proj.weight": "o_proj.weight"}


def canonical_to_hf(arch: Arch, cfg: ModelConfig, tensors, interleaved: bool = False):
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
        elif rest.startswith("attn.") and arch.mla:
            local = rest[5:]
            if interleaved and local in ("q_b_proj.weight", "q_proj.weight", "kv_a_proj.weight"):
                t = t[_rope_rows(cfg, "kv" if local.startswith("kv") else "q", inverse=True)]
            yield f"{pre}.self_attn.{_MLA_OUT[local]}", t
        elif rest.startswith("attn."):
            yield f"{pre}.self_attn.{rest[5:]}", t
        elif rest == "ffn.router.weight":
            yield f"{pre}.{arch.moe}.gate.weight", t
        elif rest == "ffn.router.expert_bias_E" and arch.mla:
            yield f"{pre}.{arch.moe}.gate.e_score_correction_bias", t
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
            base = f"{pre}.mlp" + (f".{arch.shared}" if "shared" in rest else "")
            half = t.shape[0] // 2
            yield f"{base}.gate_proj.weight", t[:half].contiguous()
            yield f"{base}.up_proj.weight", t[half:].contiguous()
        elif rest in ("ffn.w_out.weight", "ffn.shared.ffn.w_out.weight"):
            yield f"{pre}.mlp" + (f".{arch.shared}" if "shared" in rest else "") + ".down_proj.weight", t
        elif rest == "ffn.shared.gate.weight":
            yield f"{pre}.mlp.{arch.shared}_gate.weight", t
        else:
            raise ConversionError(f"unexpected moepar tensor {name!r}")


def hf_config_dict(arch: Arch, cfg: ModelConfig, router: RouterConfig) -> dict:
    """config.json for a model that did not come from Hugging Face (refuses what arch cannot say)."""
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    problems = []
    if cfg.qk_norm != arch.qk_norm:
        problems.append(f"model.qk_norm={cfg.qk_norm!r} ({arch.name} has {arch.qk_norm!r})")
    if (cfg.num_shared_experts > 0) != bool(arch.shared) or cfg.shared_gate != arch.shared_gate:
        problems.append("shared experts" + (" with a sigmoid gate" if arch.shared_gate else ""))
    if cfg.attention_bias and arch.name != "qwen2_moe":
        problems.append("model.attention_bias=true")
    if (cfg.attention == "mla") != arch.mla:
        problems.append(f"model.attention={cfg.attention!r}")
    if arch.name in ("mixtral", "olmoe") and len(moe_layers) != cfg.num_layers:
        problems.append("dense layers")
    if arch.mla and moe_layers != list(range(cfg.first_k_dense, cfg.num_layers)):
        problems.append("dense layers other than the first model.first_k_dense")
    score = "sigmoid" if arch.mla else "softmax"
    if router.score_func != score or router.type != "topk" or (router.n_group > 1 and not arch.mla):
        problems.append(f"a router other than {score} top-k" + ("" if arch.mla else " without groups"))
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
    if arch.mla:
        out.update(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_dim,
                   intermediate_size=cfg.ffn_dim, n_shared_experts=cfg.num_shared_experts,
                   first_k_dense_replace=cfg.first_k_dense, q_lora_rank=cfg.q_lora_rank or None,
                   kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                   head_dim=cfg.qk_rope_head_dim, n_group=router.n_group,
                   topk_group=router.topk_group, routed_scaling_factor=router.routed_scaling_factor,
                   topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                   attention_bias=False, num_key_value_heads=cfg.num_heads)
        out.pop("num_experts", None)
        if cfg.num_shared_experts and (cfg.shared_ffn_dim or cfg.moe_ffn_dim) != cfg.moe_ffn_dim:
            raise ConversionError("deepseek_v3 shared experts have moe_intermediate_size each")
    return out


