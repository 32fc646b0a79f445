"""Layout-free initialization: every canonical tensor is drawn from its own generator.

Legend: E experts of a stack, D model dim, F hidden, U the in-projection's width (2F for SwiGLU).

A canonical tensor is a parameter (or persistent buffer) under its model name, except that a
stacked expert tensor is one tensor per global expert: `layers.1.ffn.experts.w_in_EDU` [E, D, U]
is `layers.1.ffn.experts.5.w_in` [D, U] for expert 5 (the checkpoint's names). Each canonical
tensor is drawn on the host from a generator seeded by (seed, its name), so its values do not
depend on which rank holds it, how it is sliced, or the device: a rank can draw just the tensors
it holds (one at a time), and every layout starts from the same weights as one process.

| module                 | tensor                          | initial value            |
|------------------------|---------------------------------|--------------------------|
| RMSNorm                | weight                          | ones                     |
| nn.Linear, nn.Embedding| weight                          | normal(0, init_std)      |
|   output projections   | attention o_proj, FFN w_out     | normal(0, init_std / sqrt(2 * layers)) |
|   biases               | qkv bias                        | zeros                    |
|   fused q/k/v          | attention qkv_proj weight       | its q, k, v row blocks   |
|                        |                                 | drawn as `q_proj.weight`,|
|                        |                                 | `k_proj.weight`, `v_proj.|
|                        |                                 | weight` each (the values |
|                        |                                 | of separate projections) |
| routers                | weight                          | normal(0, 0.02)          |
|                        | expert_bias_E (buffer)          | zeros                    |
| GroupedExperts         | w_in per expert / w_out per exp.| normal(init_std) / normal(output std) |
"""

import hashlib
from typing import NamedTuple

import torch
from torch import nn

from .attention import Attention
from .experts import FeedForward, GroupedExperts, SharedExperts
from .mla import MLA
from .rope import RMSNorm, model_rotary_tables
from .router import RouterBase

__all__ = ["InitSpec", "CanonicalTensor", "canonical_tensors", "expert_split", "draw",
           "init_weights", "reset_rope_buffers"]

ROUTER_STD = 0.02


class InitSpec(NamedTuple):
    kind: str            # "normal", "ones" or "zeros"
    std: float = 0.0
    # A tensor fused from parts along dim 0: ((name each part is drawn under, its rows), ...).
    parts: tuple = ()


class CanonicalTensor(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: InitSpec
    trainable: bool = True       # a parameter (with optimizer state), not a buffer


def expert_split(name: str, experts: dict):
    """(stack module name, module, short name 'w_in'/'w_out') for a stacked expert tensor, else None."""
    owner, _, leaf = name.rpartition(".")
    if owner in experts:
        return owner, experts[owner], leaf.rsplit("_", 1)[0]
    return None


def _module_specs(model: nn.Module) -> dict[str, InitSpec]:
    """InitSpec per parameter / persistent buffer name of the (unsharded) model."""
    cfg = model.cfg
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
    specs = {}
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        if isinstance(module, RMSNorm):
            specs[f"{at}weight"] = InitSpec("ones")
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            specs[f"{at}weight"] = InitSpec("normal", std)
            if getattr(module, "bias", None) is not None:
                specs[f"{at}bias"] = InitSpec("zeros")
        elif isinstance(module, RouterBase):
            specs[f"{at}weight"] = InitSpec("normal", ROUTER_STD)
            if hasattr(module, "expert_bias_E"):
                specs[f"{at}expert_bias_E"] = InitSpec("zeros")
        elif isinstance(module, GroupedExperts):
            specs[f"{at}w_in_EDU"] = InitSpec("normal", std)
            specs[f"{at}w_out_EFD"] = InitSpec("normal", out_std)
    # Output projections (named_modules visits parents first, so these override the Linear rule).
    for prefix, module in model.named_modules():
        if isinstance(module, (Attention, MLA)):
            specs[f"{prefix}.o_proj.weight"] = InitSpec("normal", out_std)
        if isinstance(module, Attention):
            hd = cfg.head_dim_resolved        # the whole model's heads, whatever a rank holds
            sizes = (cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd)
            rows = zip(("q_proj", "k_proj", "v_proj"), sizes, strict=True)
            specs[f"{prefix}.qkv_proj.weight"] = InitSpec(
                "normal", std, tuple((f"{prefix}.{name}.weight", n) for name, n in rows))
        elif isinstance(module, FeedForward):
            specs[f"{prefix}.w_out.weight"] = InitSpec("normal", out_std)
        elif isinstance(module, SharedExperts) and module.gate is not None:
            specs[f"{prefix}.gate.weight"] = InitSpec("normal", std)
    return specs


def canonical_tensors(model: nn.Module) -> dict[str, CanonicalTensor]:
    """Every canonical tensor of a whole (unsharded, possibly meta) model: name -> shape, dtype,
    initial value. Stacked experts are split into one tensor per expert."""
    specs = _module_specs(model)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    params = {name for name, _ in model.named_parameters()}
    out = {}
    for name, tensor in model.state_dict().items():
        if name not in specs:
            raise ValueError(f"no initial value is defined for {name!r}")
        split = expert_split(name, experts)
        if split is None:
            out[name] = CanonicalTensor(tuple(tensor.shape), tensor.dtype, specs[name],
                                        name in params)
            continue
        prefix, module, short = split
        for e in range(module.num_global_experts):     # global ids, whatever this stack holds
            out[f"{prefix}.{e}.{short}"] = CanonicalTensor(
                tuple(tensor.shape[1:]), tensor.dtype, specs[name], name in params)
    return out


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def draw(name: str, tensor: CanonicalTensor, seed: int) -> torch.Tensor:
    """The initial value of canonical tensor `name` on the host: a pure function of (seed, name).

    Normal values are drawn in float64 for float64 models and in float32 otherwise, then cast.
    A fused tensor (init.parts) is its parts, each drawn under its own name, concatenated."""
    kind, std, parts = tensor.init
    if parts:
        return torch.cat([draw(part, tensor._replace(shape=(rows,) + tensor.shape[1:],
                                                     init=InitSpec(kind, std)), seed)
                          for part, rows in parts])
    if kind == "ones":
        return torch.ones(tensor.shape, dtype=tensor.dtype)
    if kind == "zeros":
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    gen = torch.Generator().manual_seed(_seed(seed, name))
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.empty(tensor.shape, dtype=wide).normal_(0.0, std, generator=gen).to(tensor.dtype)


def reset_rope_buffers(model: nn.Module, cfg):
    """Recomputes the rotary tables of every module that holds them (after `to_empty`)."""
    cos, sin = model_rotary_tables(cfg)
    for module in model.modules():
        if "rope_cos" in module._buffers:   # keep each table's device and dtype
            old = module.rope_cos
            module.rope_cos = cos.to(device=old.device, dtype=old.dtype)
            module.rope_sin = sin.to(device=old.device, dtype=old.dtype)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int):
    """Draws every tensor of a whole model in place (one process: no sharding), as every layout
    does for its shards; rotary tables recomputed."""
    tensors = canonical_tensors(model)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    for name, target in model.state_dict().items():
        split = expert_split(name, experts)
        if split is None:
            target.copy_(draw(name, tensors[name], seed))
            continue
        prefix, module, short = split
        for row, e in enumerate(module.expert_ids):
            canonical = f"{prefix}.{e}.{short}"
            target[row].copy_(draw(canonical, tensors[canonical], seed))
    reset_rope_buffers(model, model.cfg)
