"""Muon (momentum orthogonalized by Newton-Schulz) for weight matrices, AdamW for the rest, in any
layout: each matrix is orthogonalized whole, however its parameter is sharded.

Talks on `tp` (one all-gather per tensor-parallel matrix), `dp`/`edp` under ZeRO-3 (FSDP2's
DTensor `full_tensor`, one all-gather per matrix) and under ZeRO-1/2 (one all-gather of each
Muon bucket's update, `ShardedMuon`). Nothing forces a host sync.

| parameter                                   | optimizer | matrices orthogonalized             |
|---------------------------------------------|-----------|-------------------------------------|
| embed, head (the vocabulary)                | AdamW     |                                     |
| 1-D: norms, biases, expert bias             | AdamW     |                                     |
| attention qkv_proj [q; k; v]                | Muon      | q, k, v each on its own             |
| dense / shared FFN w_in [gate; up]          | Muon      | gate, up each on its own            |
| experts w_in_EDU [E, D, gate|up]            | Muon      | per expert: gate, up each on its own|
| experts w_out_EFD [E, F, D]                 | Muon      | per expert                          |
| every other matrix (o_proj, MLA projections,| Muon      | the whole matrix                    |
|   w_out, router gates, shared-expert gates) |           |                                     |

The fused tensors are moepar's own fusions of matrices the published models keep apart
(Hugging Face's q_proj/k_proj/v_proj, gate_proj/up_proj): Muon sees the matrices of the model
as published, so a converted checkpoint trains the same here as in the recipes. MLA's
kv_a_proj (latent and key RoPE part) is one matrix in DeepSeek-V3 too and stays whole.

The update of one matrix W [A, B] (torch.optim.Muon's arithmetic, Moonlight's scale):
    buf = lerp(buf, g, 1 - momentum)              (momentum_buffer, the optimizer state)
    u   = lerp(g, buf, momentum) if nesterov else buf
    W  *= 1 - lr * weight_decay
    W  -= lr * 0.2 * sqrt(max(A, B)) * NS5(u)     (update RMS ~0.2, like AdamW's)
Why not torch.optim.Muon itself: it takes 2-D parameters only (no expert stacks, no fused parts,
no shards) and runs Newton-Schulz in bfloat16 whatever the parameters' dtype, so no float64
parity. `newton_schulz` is its iteration in the input's dtype (bit-identical to torch's on a
bfloat16 input, tests/unit/test_muon.py).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moepar.layers.attention import Attention
from moepar.layers.experts import FeedForward, GroupedExperts

from .adamw import adamw_update
from .comm import all_gather_single
from .placement import local_tensor
from .shards import fsdp_range
from .tensor import full_tensor, local_shard, tp_shard_spec

__all__ = ["NS_COEFFICIENTS", "newton_schulz", "Matrices", "muon_matrices", "Muon", "ShardedMuon",
           "orthogonalize"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic; Moonlight, Kimi K2
RMS_SCALE = 0.2                                # Moonlight: update RMS matched to AdamW's


def newton_schulz(g_XAB: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS,
                  eps: float = 1e-7) -> torch.Tensor:
    """The approximate orthogonal factor of each matrix of g [..., A, B] (leading dims: a batch,
    e.g. experts), computed in g's dtype."""
    a, b, c = coefficients
    x = g_XAB.mT if g_XAB.size(-2) > g_XAB.size(-1) else g_XAB
    x = x / torch.linalg.matrix_norm(x).clamp(min=eps)[..., None, None]
    for _ in range(steps):
        if x.dim() == 2:       # torch's own ops, in its order
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if g_XAB.size(-2) > g_XAB.size(-1) else x


@dataclass(frozen=True)
class Matrices:
    """How a parameter's canonical tensor splits into the matrices Muon orthogonalizes: parts of
    lengths `sizes` along `dim` (one part: whole); dims before the last two are a batch."""
    dim: int = 0
    sizes: tuple[int, ...] = ()


def orthogonalize(full: torch.Tensor, matrices: Matrices, steps: int = 5) -> torch.Tensor:
    """NS5 of every matrix of `full` (canonical shape), each scaled by 0.2 sqrt(max(A, B))."""
    parts = full.split(matrices.sizes, matrices.dim) if len(matrices.sizes) > 1 else [full]
    out = [newton_schulz(p, steps) * (RMS_SCALE * math.sqrt(max(p.shape[-2:]))) for p in parts]
    return torch.cat(out, matrices.dim) if len(out) > 1 else out[0]


def muon_matrices(model) -> dict[int, Matrices]:
    """{id(parameter): Matrices} for every parameter Muon steps (see the table above): all of
    2 or more dims except the embedding and the head. Canonical part sizes come from the
    tensor-parallel spec where the parameter is sharded."""
    specs = tp_shard_spec(model)
    out = {}
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if p.dim() < 2 or full.split(".")[0] in ("embed", "head"):
                continue
            spec = specs.get(full)
            if isinstance(module, GroupedExperts) and name == "w_in_EDU" \
                    and module.activation == "swiglu":
                half = p.shape[-1] // 2
                out[id(p)] = Matrices(-1, (half, half))
            elif prefix.endswith("qkv_proj") and hasattr(spec, "sizes"):
                out[id(p)] = Matrices(0, spec.sizes)
            elif prefix.endswith("w_in") and spec is not None and spec.chunks == 2:
                half = (p.shape[0] * spec.num_pieces) // 2
                out[id(p)] = Matrices(0, (half, half))
            else:
                out[id(p)] = _unsharded_parts(model, prefix, p)
    return out


def _unsharded_parts(model, prefix: str, p) -> Matrices:
    """Parts of a parameter that tensor parallelism did not shard."""
    owner = model.get_submodule(prefix.rsplit(".", 1)[0]) if "." in prefix else None
    if isinstance(owner, Attention) and prefix.endswith("qkv_proj"):
        return Matrices(0, owner.qkv_sizes())
    if isinstance(owner, FeedForward) and prefix.endswith("w_in") and owner.activation == "swiglu":
        half = p.shape[0] // 2
        return Matrices(0, (half, half))
    return Matrices()


@dataclass(frozen=True)
class MatrixLayout:
    """A Muon parameter on this rank: its matrices and, under tp, its spec and group."""
    matrices: Matrices
    tp_spec: object = None
    tp_group: object = None

    def gather(self, upd):
        """The canonical tensor from this rank's piece: FSDP2's all-gather, then tp's."""
        full = upd.full_tensor() if hasattr(upd, "full_tensor") else upd
        return full if self.tp_spec is None else full_tensor(full, self.tp_spec, self.tp_group)

    def local(self, full, param):
        """This rank's piece of a canonical tensor shaped like `param`'s local tensor."""
        if self.tp_spec is not None:
            full = local_shard(full, self.tp_spec, dist.get_rank(self.tp_group))
        if hasattr(param, "placements"):
            (placement,) = param.placements
            mesh = param.device_mesh
            start, stop = fsdp_range(full.shape[placement.dim], mesh.size(), mesh.get_local_rank())
            full = full.narrow(placement.dim, start, stop - start)
        return full


def build_layouts(model, masters, tp_group=None) -> dict[int, MatrixLayout]:
    """{id(master): MatrixLayout} for every parameter Muon steps."""
    specs = tp_shard_spec(model) if tp_group is not None else {}
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for pid, matrices in muon_matrices(model).items():
        p = next(q for q in model.parameters() if id(q) == pid)
        spec = specs.get(by_id[pid])
        out[id(masters.master(p))] = MatrixLayout(matrices, spec, tp_group if spec else None)
    return out


def new_muon_state(param) -> dict:
    """Zero Muon state of `param`: a host step count (for checkpoints) and the momentum."""
    return {"step": torch.zeros((), dtype=torch.float32),
            "momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked {"muon": True} (their parameters in `layouts`), moepar's AdamW
    arithmetic (adamw.py) for the others. Parameters may be whole, tp shards or FSDP2 DTensors:
    each matrix is gathered whole (the same on every rank that holds a piece), orthogonalized,
    and each rank keeps its piece of the update."""

    def __init__(self, groups, layouts: dict, *, lr: float, betas, eps: float, momentum: float,
                 nesterov: bool = True, ns_steps: int = 5):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps, weight_decay=0.0,
                                      muon=False))
        self.layouts = layouts

    def new_state(self, param) -> dict:
        group = next(g for g in self.param_groups if any(q is param for q in g["params"]))
        if group["muon"]:
            return new_muon_state(param)
        return {"step": torch.zeros((), dtype=torch.float32),
                **{k: torch.zeros_like(param, memory_format=torch.preserve_format)
                   for k in ("exp_avg", "exp_avg_sq")}}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("moepar's Muon takes no closure")
        for group in self.param_groups:
            if group["muon"]:
                for p in self._counted(group):
                    self._muon(p, self.state[p]["momentum_buffer"], group)
        self.step_adamw()

    def _counted(self, group) -> list:
        """The group's parameters with a gradient, their state created and step counted."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p].update(self.new_state(p))
            self.state[p]["step"] += 1
        return params

    @torch.no_grad()
    def step_adamw(self):
        """The AdamW groups alone (ShardedMuon steps the Muon shards itself)."""
        for group in self.param_groups:
            params = [] if group["muon"] else self._counted(group)
            if params:
                beta1, beta2 = group["betas"]
                state = [self.state[p] for p in params]
                adamw_update([local_tensor(p) for p in params],
                             [local_tensor(p.grad) for p in params],
                             [local_tensor(s["exp_avg"]) for s in state],
                             [local_tensor(s["exp_avg_sq"]) for s in state],
                             [float(s["step"]) for s in state], lr=group["lr"], beta1=beta1,
                             beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"])

    def _muon(self, p, buf, group):
        mu, g = group["momentum"], p.grad
        buf.lerp_(g, 1 - mu)          # DTensors under FSDP2: elementwise on their shards
        upd = g.lerp(buf, mu) if group["nesterov"] else buf
        layout = self.layouts[id(p)]
        full = orthogonalize(layout.gather(upd), layout.matrices, group["ns_steps"])
        mine = layout.local(full, p)
        w = local_tensor(p)
        w.mul_(1 - group["lr"] * group["weight_decay"])
        w.add_(mine, alpha=-group["lr"])


class ShardedMuon:
    """ZeRO-1/2: Muon on the Muon buckets' flat shards, AdamW on the others' (zero.py's buckets,
    split by optimizer). A Muon bucket's update is all-gathered whole, each matrix that meets this
    rank's shard is orthogonalized (under tp, gathered whole over tp first), and the shard takes
    its slice; then, as ShardedAdamW, one all-gather per bucket refreshes the parameters."""

    def __init__(self, reducer, layouts: dict, make_muon):
        self.reducer = reducer
        buckets = reducer.buckets
        self.inner = make_muon([b.shard for b in buckets if b.decay == "muon"],
                               [b.shard for b in buckets if b.decay is True],
                               [b.shard for b in buckets if b.decay is False])
        self.layouts = layouts
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @torch.no_grad()
    def step(self):
        muon_group = next(g for g in self.param_groups if g["muon"])
        self.inner.step_adamw()
        for b in self.reducer.buckets:
            if b.decay == "muon" and b.shard.grad is not None:
                self._muon_bucket(b, muon_group)
        handles = [all_gather_single(b.flat, b.shard.detach(), group=b.group, async_op=True)
                   for b in self.reducer.buckets if b.size > 1]
        for handle in handles:
            handle.wait()

    def _muon_bucket(self, b, group):
        state = self.state[b.shard]
        if not state:
            state.update(new_muon_state(b.shard))
        state["step"] += 1
        mu, g, buf = group["momentum"], b.shard.grad, state["momentum_buffer"]
        buf.lerp_(g, 1 - mu)
        upd = g.lerp(buf, mu) if group["nesterov"] else buf.clone()
        flat = torch.empty_like(b.flat)
        if b.size > 1:
            all_gather_single(flat, upd, group=b.group)
        else:
            flat.copy_(upd)
        out = torch.zeros_like(flat)
        lo, hi = b.mine.start, b.mine.stop
        for p in b.params:   # the same list on every tp peer: their gathers line up
            start = b.offsets[id(p)]
            stop = start + p.numel()
            if stop <= lo or start >= hi:
                continue
            layout = self.layouts[id(p)]
            full = layout.gather(flat[start:stop].view_as(p))
            out[start:stop].copy_(layout.local(orthogonalize(full, layout.matrices,
                                                             group["ns_steps"]), p).reshape(-1))
        b.shard.mul_(1 - group["lr"] * group["weight_decay"])
        b.shard.add_(out[lo:hi], alpha=-group["lr"])

    def zero_grad(self, set_to_none: bool = True):
        self.reducer.zero_grad()
