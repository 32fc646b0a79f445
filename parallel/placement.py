"""Which boxes of the canonical tensors each tensor of this rank holds (parameters or their float32
masters, buffers, optimizer state), and drawing a rank's initial shards: what initialization and
checkpoints read and write, without gathering anything.

Talks on no process group: the layout, the model's module types, tensor-parallel specs and
DTensor placements are enough (the segment maths is shards.py).
"""

import dataclasses
from typing import NamedTuple

import torch

from moepar.layers.experts import GroupedExperts
from moepar.layers.init import draw, expert_split, reset_rope_buffers

from .shards import flat_segments, fsdp_segments, local_view, tp_segments, whole_segments
from .tensor import tp_shard_spec

__all__ = ["LocalTensor", "local_tensor", "Placement", "persistent_buffers", "new_adamw_state",
           "new_state", "state_kinds",
           "materialize"]


class LocalTensor(NamedTuple):
    """A tensor on this rank and where it sits in the canonical tensors."""
    name: str               # parameter / buffer name, or "<kind>/<parameter name>" for state
    tensor: torch.Tensor    # plain tensor (DTensors are given as their local shard)
    segments: list          # shards.Segment


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2); plain tensors unchanged."""
    return t.to_local() if hasattr(t, "to_local") else t


def persistent_buffers(model):
    """(name, buffer) for every buffer a state_dict would hold."""
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def new_adamw_state(param, optimizer) -> dict:
    """Zero AdamW state for `param`, laid out as torch.optim.AdamW creates it (step on the
    parameter's device for fused/capturable optimizers, else a host scalar), with the moments in
    the optimizer's `moment_dtype(param)` where it has one (moepar's AdamW, adamw.py)."""
    group = next(g for g in optimizer.param_groups if any(q is param for q in g["params"]))
    on_device = group.get("fused") or group.get("capturable")
    step = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
    dtype = optimizer.moment_dtype(param) if hasattr(optimizer, "moment_dtype") else param.dtype
    return {"step": step, **{kind: torch.zeros_like(param, dtype=dtype,
                                                    memory_format=torch.preserve_format)
                             for kind in ("exp_avg", "exp_avg_sq")}}


def new_state(param, optimizer) -> dict:
    """Zero state for `param`: the optimizer's own `new_state` (muon.py: Muon's momentum or
    AdamW's moments, by group), else AdamW's."""
    if hasattr(optimizer, "new_state"):
        return optimizer.new_state(param)
    return new_adamw_state(param, optimizer)


def state_kinds(state: dict) -> list[str]:
    """The tensors of one parameter's optimizer state that checkpoints hold, first the one whose
    name carries the step count: exp_avg, exp_avg_sq (AdamW) or momentum_buffer (Muon)."""
    return [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if k in state]


class Placement:
    """Segments of this rank's tensors; `masters` (precision.py) names the tensor that holds
    each parameter's value between steps (its float32 master under bf16 training)."""

    def __init__(self, model, layout, canonical: dict, masters=None):
        self.model, self.layout, self.canonical, self.masters = model, layout, canonical, masters
        self.experts = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
        self.tp_specs = tp_shard_spec(model) if layout.dims.tp > 1 else {}

    def segments(self, name: str, tensor, data_replicas: bool) -> list:
        """Segments of local tensor `name` (a parameter, a buffer, or a state shaped like one).
        `data_replicas`: the tensor is replicated over dp (edp for experts) unless FSDP shards it;
        False for ZeRO-1/2 flat shards, which every data rank writes."""
        coords = self.layout.coords
        split = expert_split(name, self.experts)
        spec = self.tp_specs.get(name)
        fsdp = hasattr(tensor, "placements")
        if split is not None:
            prefix, module, short = split
            names = [f"{prefix}.{e}.{short}" for e in module.expert_ids]
            segments = whole_segments(name, tuple(tensor.shape), names)
            writes = fsdp or not data_replicas or coords.edp == 0
        else:
            segments = whole_segments(name, self.canonical[name].shape)
            if spec is not None and tensor.dim() > 0:   # marks the replicas that do not write
                segments = tp_segments(segments, spec, coords.tp)
            elif spec is None and coords.tp != 0:       # whole on every tp rank: the first writes
                segments = [dataclasses.replace(s, writes=False) for s in segments]
            writes = fsdp or not data_replicas or coords.dp == 0
        if fsdp:
            (placement,) = tensor.placements
            mesh = tensor.device_mesh
            segments = fsdp_segments(segments, placement.dim, tensor.shape[placement.dim],
                                     mesh.size(), mesh.get_local_rank())
        return [dataclasses.replace(s, writes=writes and s.writes) for s in segments]

    def master(self, p):
        return p if self.masters is None else self.masters.master(p)

    def loaded(self):
        """After values were written into `model_shards()`: the compute weights follow."""
        if self.masters is not None:
            self.masters.refresh()

    def model_shards(self) -> list[LocalTensor]:
        """Every parameter (its master) and persistent buffer of this rank with its segments."""
        out = [LocalTensor(n, local_tensor(self.master(p)), self.segments(n, p, True))
               for n, p in self.model.named_parameters()]
        return out + [LocalTensor(n, b, self.segments(n, b, True))
                      for n, b in persistent_buffers(self.model)]

    def optimizer_shards(self, optimizer, create: bool = False):
        """(moments, steps) of an optimizer stepping the masters one by one (zero 0 and 3):
        AdamW's state tensors as LocalTensors named '<kind>/<parameter>', and {LocalTensor name:
        the step count tensor it goes with}. `create` makes zero state first (to load into);
        without it, parameters without state are left out."""
        state = optimizer.state
        moments, steps = [], {}
        for name, p in self.model.named_parameters():
            master = self.master(p)
            if create:
                state[master] = new_state(master, optimizer)
            if master not in state:
                continue
            segments = self.segments(name, p, True)
            for kind in state_kinds(state[master]):
                key = f"{kind}/{name}"
                moments.append(LocalTensor(key, local_tensor(state[master][kind]), segments))
                steps[key] = state[master]["step"]
        return moments, steps

    def flat_optimizer_shards(self, reducer, inner, create: bool = False):
        """The same for ZeRO-1/2, whose optimizer steps each bucket's flat shard."""
        names = {id(self.master(p)): n for n, p in self.model.named_parameters()}
        moments, steps = [], {}
        for index, b in enumerate(reducer.buckets):
            if create:
                inner.state[b.shard] = new_state(b.shard, inner)
            if b.shard not in inner.state:
                continue
            segments = []
            for p in b.params:
                segments += flat_segments(self.segments(names[id(p)], p, False), tuple(p.shape),
                                          b.offsets[id(p)], b.mine.start, b.mine.stop)
            for kind in state_kinds(inner.state[b.shard]):
                key = f"{kind}/bucket{index}"
                moments.append(LocalTensor(key, inner.state[b.shard][kind], segments))
                steps[key] = inner.state[b.shard]["step"]
        return moments, steps


@torch.no_grad()
def materialize(model, layout, canonical: dict, seed: int):
    """Allocates this rank's shards on its device and draws their initial values: each
    canonical tensor this rank touches is drawn once on the host (layers/init.py), its boxes
    copied in, and dropped before the next (peak host memory: one canonical tensor)."""
    model.to_empty(device=layout.device)
    items = []
    for lt in Placement(model, layout, canonical).model_shards():
        lt.tensor.zero_()       # anything no segment covers (tp vocabulary padding) is zero
        items += [(seg.name, lt.tensor, seg) for seg in lt.segments]
    items.sort(key=lambda item: item[0])
    name, full = None, None
    for seg_name, tensor, seg in items:
        if seg_name != name:
            name, full = seg_name, draw(seg_name, canonical[seg_name], seed)
        box = tuple(slice(o, o + n) for o, n in zip(seg.canon.offsets, seg.canon.sizes,
                                                    strict=True))
        local_view(tensor, seg).copy_(full[box])
    reset_rope_buffers(model, model.cfg)
