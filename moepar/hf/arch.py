"""Hugging Face architectures: config.json fields, both ways (tensor names are in names.py).

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 map onto one moepar model (options: q/k
norms, q/k/v biases, shared experts with or without a sigmoid gate, dense layers by step, list or
first k, multi-head latent attention, sigmoid group-limited routing with a selection bias, YaRN
rope scaling). `read_hf_config` reads config.json under all the names these architectures use and
refuses what moepar cannot run; `hf_config_dict` writes config.json for a moepar model and refuses
what the architecture cannot say, naming what this model has and what the architecture needs.

The balance loss travels with the model: transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
train `router_aux_loss_coef` * load_balancing_loss_func (one loss over all MoE layers, f counted
over top-k slots), which is moepar's router.balance_loss='all_layers' (layers/balance.py);
import sets it with that coefficient, export writes it back (`router_loss_fields`). A per_layer
model's loss has an HF coefficient only with one MoE layer (HF's loss is then K times moepar's);
otherwise export keeps the coefficient and says what differs (`export_notes`). transformers'
DeepSeek-V3 trains no balance loss at all (no aux loss in DeepseekV3ForCausalLM; its
e_score_correction_bias is a buffer nothing updates): import sets every balance coefficient to 0.
"""

import math
import os
from dataclasses import dataclass

from moepar.jsonfile import read_json
from moepar.layers.model import ModelConfig
from moepar.layers.router import RouterConfig

__all__ = ["ARCHS", "Arch", "ConversionError", "read_hf_config", "load_hf_json", "hf_config_dict",
           "arch_by_name", "arch_problems", "matching_archs", "mtp_layers", "router_loss_fields",
           "export_notes"]


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
    # transformers' router_aux_loss_coef default (config classes of 5.24); None: the model
    # class computes no balance loss (DeepSeek-V3)
    aux_coef_default: float | None = 0.001


ARCHS = {a.name: a for a in (
    Arch("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), norm_topk_default=True),
    Arch("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
         shared="shared_expert", shared_gate=True),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), qk_norm="head"),
    Arch("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), qk_norm="full",
         aux_coef_default=0.01),
    Arch("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
         shared="shared_experts", mla=True, norm_topk_default=True, aux_coef_default=None),
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
    "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "sliding_window",
    "num_nextn_predict_layers", "num_mtp_layers", "original_max_position_embeddings")
_REAL = ("rope_theta", "rms_norm_eps", "initializer_range", "routed_scaling_factor",
         "router_aux_loss_coef")
_FLAGS = ("tie_word_embeddings", "attention_bias", "qkv_bias", "norm_topk_prob",
          "use_sliding_window", "rope_interleave")


def load_config_json(file: str) -> dict:
    """config.json as a dict whose settings have the types read_hf_config relies on; a
    ConversionError naming the file and the key otherwise (never a traceback)."""

    try:
        cfg = read_json(file)      # a regular file, nesting limited
    except ValueError as e:
        raise ConversionError(str(e)) from None
    if not isinstance(cfg, dict):
        raise ConversionError(f"{file} holds a JSON {type(cfg).__name__}, not an object of "
                              "settings")
    if not isinstance(cfg.get("model_type", "?"), str):
        raise ConversionError(f"{file}: model_type={cfg['model_type']!r} is not a string")
    arch_by_name(cfg.get("model_type", "?"))     # an unsupported model: say so first
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise ConversionError(f"{file} lacks {', '.join(map(repr, missing))}")

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
    for key in ("rope_parameters", "rope_scaling", "quantization_config"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            bad(key, "an object")
    layers = cfg.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list)
                                   and all(type(i) is int and i >= 0 for i in layers)):
        bad("mlp_only_layers", "a list of layer numbers")
    return cfg


def load_hf_json(path: str) -> dict:
    """config.json of a HF folder, type-checked (load_config_json); a missing file is a
    ConversionError."""
    file = os.path.join(path, "config.json")
    if not os.path.lexists(file):
        raise ConversionError(f"{path!r} has no config.json")
    return load_config_json(file)


def mtp_layers(cfg: dict) -> int:
    """Multi-token-prediction layers stored after the decoder layers (DeepSeek-V3: one, as
    model.layers.<num_hidden_layers>.*); transformers 5 calls the field num_mtp_layers."""
    return int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)


def read_hf_config(path: str) -> tuple[Arch, ModelConfig, RouterConfig]:
    """Reads config.json under all the names these architectures use; refuses what we cannot run.
    Each refusal names what config.json has."""
    cfg = load_hf_json(path)
    arch = arch_by_name(cfg.get("model_type", "?"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json has hidden_act={cfg['hidden_act']!r}; moepar runs only "
                              "'silu' (SwiGLU) experts")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and window < cfg.get("max_position_embeddings", 0):
        raise ConversionError(f"config.json has sliding_window={window} (below max_position_embeddings="
                              f"{cfg.get('max_position_embeddings')}); moepar attends to the whole context")
    if (arch.mla or arch.name in ("qwen3_moe", "olmoe")) and cfg.get("attention_bias"):
        raise ConversionError(f"config.json has attention_bias=true; moepar's {arch.name} attention "
                              "has no projection biases")
    if cfg.get("clip_qkv") is not None:
        raise ConversionError(f"config.json has clip_qkv={cfg['clip_qkv']}; moepar does not clip q/k/v")
    try:
        return arch, *_model_and_router(arch, cfg)
    except KeyError as e:
        raise ConversionError(f"config.json lacks {e.args[0]!r}, which {arch.name} needs") from None
    except ValueError as e:   # a ModelConfig/RouterConfig check, naming moepar's field
        raise ConversionError(f"config.json converts to an invalid moepar config: {e}") from None


def _model_and_router(arch: Arch, cfg: dict) -> tuple[ModelConfig, RouterConfig]:
    dim = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    expert_ffn = _first(cfg, "moe_intermediate_size", "intermediate_size")
    model = ModelConfig(
        vocab_size=cfg["vocab_size"], dim=dim, num_layers=cfg["num_hidden_layers"], num_heads=heads,
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
        **_mla_fields(arch, cfg), **_rope_fields(cfg),
        max_seq_len=cfg.get("max_position_embeddings", 4096),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), init_std=cfg.get("initializer_range", 0.02),
        mtp_layers=mtp_layers(cfg) if arch.mla else 0)   # others' MTP layers are dropped
    routing = {}
    if arch.mla:   # sigmoid scores, score-correction bias, group-limited top-k, scaling
        for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            if cfg.get(key, want) != want:
                raise ConversionError(f"config.json has {key}={cfg[key]!r}; moepar's deepseek_v3 "
                                      f"routing is {want!r}")
        routing = dict(score_func="sigmoid", n_group=cfg.get("n_group") or 1,
                       topk_group=cfg.get("topk_group") or 1,
                       routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    if arch.aux_coef_default is None:   # transformers trains no balance loss for it
        balance = dict(balance_coeff=0.0)
    else:
        balance = dict(balance_loss="all_layers", balance_coeff=float(
            _first(cfg, "router_aux_loss_coef", default=arch.aux_coef_default)))
    router = RouterConfig(norm_topk_prob=bool(cfg.get("norm_topk_prob", arch.norm_topk_default)),
                          **balance, **routing)
    return model, router


def _mla_fields(arch: Arch, cfg: dict) -> dict:
    if not arch.mla:
        return {}
    return dict(attention="mla", q_lora_rank=cfg.get("q_lora_rank") or 0,
                kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"])


def _rope_fields(cfg: dict) -> dict:
    """ModelConfig's rope_* fields, read as transformers 5 reads them: `rope_scaling` (older
    configs, DeepSeek's own) wins over `rope_parameters`; a rope_theta inside them wins over the
    top-level one; YaRN's original length is the top-level original_max_position_embeddings, else
    the one inside, else max_position_embeddings; a missing factor is their ratio."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ConversionError(f"config.json has RoPE parameters per layer type ({rope!r}); moepar "
                              "uses one RoPE for all layers")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ConversionError(f"config.json has partial_rotary_factor={partial} (RoPE on part of "
                              "each head); moepar rotates whole heads")
    fields = dict(rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return fields
    if kind != "yarn":
        raise ConversionError(f"config.json has rope_type={kind!r} ({rope}); moepar supports "
                              "'default' and 'yarn'")
    max_pos = cfg.get("max_position_embeddings", 4096)
    original = (cfg.get("original_max_position_embeddings")
                or rope.get("original_max_position_embeddings") or max_pos)
    return dict(fields, rope_scaling="yarn", rope_factor=float(rope.get("factor") or max_pos / original),
                rope_original_max_seq_len=int(original),
                rope_beta_fast=float(rope.get("beta_fast") or 32),
                rope_beta_slow=float(rope.get("beta_slow") or 1),
                rope_mscale=float(rope.get("mscale") or 0),
                rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                rope_attention_factor=float(rope.get("attention_factor") or 0),
                rope_truncate=bool(rope.get("truncate", True)))


def _rope_parameters(cfg: ModelConfig) -> dict:
    """rope_parameters for config.json: the inverse of _rope_fields (zeros mean absent)."""
    out = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    yarn = cfg.yarn
    if yarn is None:
        return out
    out.update(rope_type="yarn", factor=yarn.factor,
               original_max_position_embeddings=yarn.original_max_seq_len,
               beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(yarn, key):
            out[key] = getattr(yarn, key)
    if not yarn.truncate:
        out["truncate"] = False
    return out


# ---- export: what an architecture can say ------------------------------------------------------

def arch_problems(arch: Arch, cfg: ModelConfig, router: RouterConfig) -> list[str]:
    """What this model has that `arch` cannot say: one "this model has X; ARCH needs Y" each."""
    name, has = arch.name, "this model has"
    problems = []
    if cfg.qk_norm != arch.qk_norm:
        problems.append(f"{has} model.qk_norm={cfg.qk_norm!r}; {name} needs {arch.qk_norm!r}")
    if cfg.num_shared_experts and not arch.shared:
        problems.append(f"{has} model.num_shared_experts={cfg.num_shared_experts}; {name} has no "
                        "shared experts (needs 0)")
    elif arch.shared and not cfg.num_shared_experts:
        problems.append(f"{has} model.num_shared_experts=0; {name} needs shared experts (>= 1)")
    elif arch.shared and cfg.shared_gate != arch.shared_gate:
        problems.append(f"{has} model.shared_gate={str(cfg.shared_gate).lower()}; {name} needs "
                        f"{str(arch.shared_gate).lower()}")
    if cfg.mtp_layers and not arch.mla:
        problems.append(f"{has} model.mtp_layers={cfg.mtp_layers}; {name} has no "
                        "multi-token-prediction layers (needs 0; deepseek_v3 has them)")
    if cfg.attention_bias and arch.name != "qwen2_moe":
        problems.append(f"{has} model.attention_bias=true; {name} has no q/k/v biases (needs false)")
    if (cfg.attention == "mla") != arch.mla:
        problems.append(f"{has} model.attention={cfg.attention!r}; {name} needs "
                        f"{'mla' if arch.mla else 'gqa'!r}")
    if cfg.activation != "swiglu":
        problems.append(f"{has} model.activation={cfg.activation!r}; {name} needs 'swiglu'")
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    dense = [i for i in range(cfg.num_layers) if i not in moe_layers]
    if arch.name in ("mixtral", "olmoe") and dense:
        problems.append(f"{has} dense (non-MoE) layers {dense}; {name} needs every layer MoE")
    if arch.mla and dense != list(range(len(dense))):
        problems.append(f"{has} dense layers {dense}; {name} needs them first (layers 0..k-1, "
                        "model.first_k_dense=k)")
    if arch.mla and cfg.num_shared_experts and \
            (cfg.num_shared_experts * (cfg.shared_ffn_dim or cfg.moe_ffn_dim)) % cfg.moe_ffn_dim:
        problems.append(f"{has} shared experts of {cfg.num_shared_experts} x model.shared_ffn_dim="
                        f"{cfg.shared_ffn_dim} hidden units; {name} needs a multiple of "
                        f"model.moe_ffn_dim={cfg.moe_ffn_dim}")
    score = "sigmoid" if arch.mla else "softmax"
    if router.type != "topk":
        problems.append(f"{has} router.type={router.type!r}; {name} needs 'topk'")
    if router.score_func != score:
        problems.append(f"{has} router.score_func={router.score_func!r}; {name} needs {score!r}")
    if not arch.mla:
        if router.n_group > 1:
            problems.append(f"{has} router.n_group={router.n_group} (group-limited routing); "
                            f"{name} needs 1")
        if router.routed_scaling_factor != 1.0:
            problems.append(f"{has} router.routed_scaling_factor={router.routed_scaling_factor}; "
                            f"{name} needs 1.0")
        if router.bias_update_rate:
            problems.append(f"{has} router.bias_update_rate={router.bias_update_rate} (an expert "
                            f"selection bias); {name} has none (needs 0)")
    if arch.name == "mixtral" and not router.norm_topk_prob:
        problems.append(f"{has} router.norm_topk_prob=false; {name} needs true (it always "
                        "renormalises the top-k weights)")
    return problems


def matching_archs(cfg: ModelConfig, router: RouterConfig) -> list[str]:
    """The architectures this model can be written as."""
    return [name for name, arch in ARCHS.items() if not arch_problems(arch, cfg, router)]


def router_loss_fields(arch: Arch, cfg: ModelConfig, router: RouterConfig) -> dict:
    """config.json's balance-loss field for this model: router_aux_loss_coef, the same loss where
    one exists (all_layers: the coefficient itself; per_layer with one MoE layer: coefficient / K,
    as HF's loss is then K times moepar's), else the coefficient as it is (see export_notes)."""
    if arch.aux_coef_default is None:
        return {}
    coeff = router.balance_coeff
    if router.balance_loss == "per_layer" and _num_moe_layers(cfg) == 1:
        coeff = coeff / cfg.top_k
    return {"router_aux_loss_coef": coeff}


def _num_moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def _balance_notes(arch: Arch, cfg: ModelConfig | None, router: RouterConfig) -> list[str]:
    """How transformers' balance loss differs from this model's (said, not refused)."""
    name, notes = arch.name, []
    if arch.aux_coef_default is None:
        trained = [f"router.{k}={getattr(router, k)}" for k in ("balance_coeff", "seq_balance_coeff")
                   if getattr(router, k)]
        if trained:
            notes.append(f"this model trains {' and '.join(trained)}; transformers' {name} "
                         "computes no balance loss (none is written to config.json)")
        return notes
    if router.balance_coeff and router.balance_scope == "global":
        notes.append(f"this model has router.balance_scope='global' (counts over the step's "
                     f"micro-batches and dp ranks); transformers' {name} counts each forward "
                     "call's batch")
    if not router.balance_coeff or router.balance_loss == "all_layers" or cfg is None:
        return notes
    num_moe, k = _num_moe_layers(cfg), cfg.top_k
    if num_moe == 1:
        notes.append(f"this model has router.balance_loss='per_layer' with one MoE layer: "
                     f"transformers' {name} loss is K={k} times it, so config.json has "
                     f"router_aux_loss_coef = router.balance_coeff / {k} = "
                     f"{router.balance_coeff / k:g} (the same loss)")
    else:
        notes.append(f"this model has router.balance_loss='per_layer' (a Switch loss per MoE "
                     f"layer, summed over {num_moe}); transformers' {name} takes one loss over "
                     "all layers' counts, which no coefficient matches: config.json keeps "
                     f"router_aux_loss_coef={router.balance_coeff:g}, about K/L={k}/{num_moe} of "
                     f"this model's balance pressure (about {router.balance_coeff * num_moe / k:g} "
                     "would match it under even load; router.balance_loss='all_layers' is "
                     "transformers' loss exactly)")
    return notes


def export_notes(arch: Arch, router: RouterConfig, cfg: ModelConfig | None = None) -> list[str]:
    """What exports but behaves differently in transformers (said, not refused)."""
    notes = []
    if router.capacity_factor is not None:
        notes.append(f"this model has router.capacity_factor={router.capacity_factor}: moepar drops "
                     f"token copies over an expert's capacity; transformers' {arch.name} is "
                     "dropless, so its outputs differ wherever moepar would drop")
    return notes + _balance_notes(arch, cfg, router)


def hf_config_dict(arch: Arch, cfg: ModelConfig, router: RouterConfig) -> dict:
    """config.json for a model that did not come from Hugging Face (refuses what arch cannot say)."""
    problems = arch_problems(arch, cfg, router)
    if problems:
        fits = matching_archs(cfg, router)
        raise ConversionError(f"cannot write this model as {arch.name}:\n  " + "\n  ".join(problems)
                              + f"\n(architectures this model fits: {', '.join(fits) or 'none'})")
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    rope = _rope_parameters(cfg)
    out = {"architectures": [arch.hf_class], "model_type": arch.name, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "head_dim": cfg.head_dim_resolved, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "rope_parameters": rope,
           "tie_word_embeddings": cfg.tie_embeddings, "num_experts_per_tok": cfg.top_k,
           "norm_topk_prob": router.norm_topk_prob, **router_loss_fields(arch, cfg, router),
           "initializer_range": cfg.init_std, "torch_dtype": "float32"}
    if cfg.yarn is not None:   # older readers (transformers 4, DeepSeek's own code) read this key
        out["rope_scaling"] = dict(rope, type="yarn")
    if arch.name == "mixtral":
        out.update(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_ffn_dim)
    else:
        out.update(num_experts=cfg.num_experts)
    if arch.name == "olmoe":
        out.update(intermediate_size=cfg.moe_ffn_dim, attention_bias=False, clip_qkv=None)
    if arch.name in ("qwen2_moe", "qwen3_moe"):
        out.update(intermediate_size=cfg.ffn_dim, moe_intermediate_size=cfg.moe_ffn_dim,
                   decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe_layers])
    shared_hidden = cfg.num_shared_experts * (cfg.shared_ffn_dim or cfg.moe_ffn_dim)
    if arch.name == "qwen2_moe":
        out.update(shared_expert_intermediate_size=shared_hidden, qkv_bias=cfg.attention_bias)
    if arch.name == "qwen3_moe":
        out.update(attention_bias=False)
    if arch.mla:
        out.update(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_dim,
                   intermediate_size=cfg.ffn_dim, n_shared_experts=shared_hidden // cfg.moe_ffn_dim,
                   first_k_dense_replace=cfg.num_layers - len(moe_layers),
                   q_lora_rank=cfg.q_lora_rank or None,
                   kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                   head_dim=cfg.qk_rope_head_dim, n_group=router.n_group,
                   topk_group=router.topk_group, routed_scaling_factor=router.routed_scaling_factor,
                   topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                   attention_bias=False, num_key_value_heads=cfg.num_heads,
                   num_nextn_predict_layers=cfg.mtp_layers)
        out.pop("num_experts", None)
    return out
