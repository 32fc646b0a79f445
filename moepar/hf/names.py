"""Tensor names both ways: Hugging Face checkpoints <-> moepar's canonical (layout-free) names.

`hf_to_canonical` and `canonical_to_hf` stream tensors, holding only a gate projection until its
up projection arrives (an expert's gate and up become one `w_in`), and q and k until v arrives
(HF's separate q_proj, k_proj, v_proj become one `qkv_proj` along dim 0; export splits it again);
DeepSeek's interleaved RoPE rows are permuted into rotate-half halves on the way in and back on
the way out.

DeepSeek-V3's multi-token-prediction layers (model.layers.<num_hidden_layers + k>.*) map to
`mtp.<k>.*` (layers/mtp.py): enorm, hnorm, eh_proj, shared_head.norm -> norm, the decoder
block's tensors under `mtp.<k>.block.*`. Their embed_tokens and shared_head.head are stored
copies of the main embedding and head, which moepar shares: on import each must equal the main
one (a SHA-256 of the bytes is compared, nothing is held), on export they are written again.
"""

import hashlib

import re

import torch

from moepar.hf.arch import Arch, ConversionError
from moepar.layers import Transformer
from moepar.layers.init import canonical_tensors
from moepar.layers.model import ModelConfig
from moepar.layers.router import RouterConfig

__all__ = ["hf_to_canonical", "canonical_to_hf", "expected_canonical", "rope_interleaved",
           "layer_index", "MTP_SHARED"]

# An MTP layer's stored copies of the shared tensors: HF leaf -> the main model's HF name.
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight",
              "shared_head.head.weight": "lm_head.weight"}
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "norm.weight"}


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


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "head.weight"}


def _hf_role(arch: Arch, cfg: ModelConfig, name: str):
    """(canonical name, role, part) for an HF tensor name, or None if unknown.

    Roles: copy; cat_t (expert w_in = [gate^T | up^T], part 0/1); t (transpose: expert w_out);
    cat0 (Linear w_in = [gate; up] along dim 0, part 0/1); qkv (attention qkv_proj = [q; k; v]
    along dim 0, part 0/1/2); stacked_gate_up / stacked_down.
    """
    if name in _TOP:
        return _TOP[name], "copy", 0
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = int(m.group(1)), m.group(2)
    pre = f"layers.{i}"
    if cfg.num_layers <= i < cfg.num_layers + cfg.mtp_layers:     # an MTP depth (layers/mtp.py)
        k = i - cfg.num_layers
        if rest in _MTP_OWN:
            return f"mtp.{k}.{_MTP_OWN[rest]}", "copy", 0
        if rest in MTP_SHARED:
            return MTP_SHARED[rest], "shared", 0
        role = _block_role(arch, cfg, i, rest)
        return None if role is None else (f"mtp.{k}.block" + role[0][len(pre):], *role[1:])
    return _block_role(arch, cfg, i, rest)


def _block_role(arch: Arch, cfg: ModelConfig, i: int, rest: str):
    """_hf_role for tensor `rest` of decoder block i (a main layer or an MTP depth's block)."""
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
    m2 = re.match(r"^self_attn\.(o_proj\.weight|[qk]_norm\.weight)$", rest)
    if m2:
        return f"{pre}.attn.{m2.group(1)}", "copy", 0
    m_qkv = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", rest)
    if m_qkv:
        return f"{pre}.attn.qkv_proj.{m_qkv.group(2)}", "qkv", "qkv".index(m_qkv.group(1))
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
    with torch.device("meta"):
        model = Transformer(model_cfg, router_cfg, seed=0)
    return {name: t.shape for name, t in canonical_tensors(model).items()}


def hf_to_canonical(arch: Arch, cfg: ModelConfig, tensors, interleaved: bool = False):
    """Streams (canonical name, tensor) from (HF name, tensor); holds only unpaired halves.

    `interleaved`: the checkpoint's RoPE rows are interleaved pairs (DeepSeek); they are
    reordered into rotate-half halves on the way in."""
    pending: dict[str, list] = {}
    digests, copies = {}, []     # the shared tensors' SHA-256; (MTP copy, main HF name, digest)
    for name, tensor in tensors:
        if _IGNORED.search(name):
            continue
        if name in MTP_SHARED.values() and cfg.mtp_layers:
            digests[name] = _digest(tensor)
        role = _hf_role(arch, cfg, name)
        if role is None:
            raise ConversionError(f"unexpected tensor {name!r} for {arch.name} (layer kinds: "
                                  f"MoE layers {[i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]})")
        target, how, part = role
        if how == "shared":    # an MTP layer's copy of the main embedding or head: compared
            main = "model.embed_tokens.weight" if cfg.tie_embeddings else target
            copies.append((name, main, _digest(tensor)))
        elif how == "copy":
            yield target, tensor
        elif how in ("rope_q", "rope_kv"):
            yield target, (tensor[_rope_rows(cfg, how[5:], inverse=False)] if interleaved else tensor)
        elif how == "t":
            yield target, tensor.t().contiguous()
        elif how in ("cat_t", "cat0", "qkv"):
            halves = pending.setdefault(target, [None] * (3 if how == "qkv" else 2))
            if halves[part] is not None:
                raise ConversionError(f"tensor {name!r} appears twice")
            halves[part] = tensor
            if all(h is not None for h in halves):
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
        raise ConversionError(f"gate/up halves or q/k/v parts without their partners for "
                              f"{missing}")
    for name, main, digest in copies:
        if digests.get(main) != digest:
            raise ConversionError(f"{name} differs from {main}: moepar's multi-token prediction "
                                  "shares the main model's embedding and head, so the MTP layer's "
                                  "stored copy must equal them")


def _digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    h.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


_MLA_OUT = {"q_a_proj.weight": "q_a_proj.weight", "q_a_norm.weight": "q_a_layernorm.weight",
            "q_b_proj.weight": "q_b_proj.weight", "q_proj.weight": "q_proj.weight",
            "kv_a_proj.weight": "kv_a_proj_with_mqa.weight", "kv_a_norm.weight": "kv_a_layernorm.weight",
            "kv_b_proj.weight": "kv_b_proj.weight", "o_proj.weight": "o_proj.weight"}


def canonical_to_hf(arch: Arch, cfg: ModelConfig, tensors, interleaved: bool = False):
    """Streams (HF name, tensor) from (canonical name, tensor): the inverse of hf_to_canonical."""
    gate, up, down = arch.expert
    for name, t in tensors:
        if name in _TOP.values():
            hf_name = next(k for k, v in _TOP.items() if v == name)
            yield hf_name, t
            shared = [leaf for leaf, main in MTP_SHARED.items()
                      if main == hf_name or (cfg.tie_embeddings and name == "embed.weight")]
            for k in range(cfg.mtp_layers):      # each MTP layer's stored copy (see above)
                for leaf in shared:
                    yield f"model.layers.{cfg.num_layers + k}.{leaf}", t.clone()
            continue
        m_mtp = re.match(r"^mtp\.(\d+)\.(.+)$", name)
        if m_mtp:
            pre = f"model.layers.{cfg.num_layers + int(m_mtp.group(1))}"
            own = {v: hf for hf, v in _MTP_OWN.items()}
            if m_mtp.group(2) in own:
                yield f"{pre}.{own[m_mtp.group(2)]}", t
                continue
            if not m_mtp.group(2).startswith("block."):
                raise ConversionError(f"unexpected moepar tensor {name!r}")
            name = f"layers.{cfg.num_layers + int(m_mtp.group(1))}.{m_mtp.group(2)[6:]}"
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
        elif rest in ("attn.qkv_proj.weight", "attn.qkv_proj.bias"):
            hd, leaf = cfg.head_dim_resolved, rest.rsplit(".", 1)[1]
            sizes = (cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd)
            if t.shape[0] != sum(sizes):
                raise ConversionError(f"{name} has {t.shape[0]} rows, the config's q, k, v heads "
                                      f"{sizes} make {sum(sizes)}")
            for proj, part in zip("qkv", t.split(sizes), strict=True):
                yield f"{pre}.self_attn.{proj}_proj.{leaf}", part.contiguous()
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


def layer_index(name: str) -> int | None:
    """The decoder layer an HF tensor belongs to (`model.layers.<i>.`), or None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None
