"""The handle `parallelize` returns: this rank's model (or pipeline stage) with everything a
training step needs, so the trainer has one code path for every layout.

Talks on: dp and edp (gradient sync, step statistics), tp (partial gradients of replicated
parameters, the vocabulary-parallel loss), pp (the schedule's point-to-point traffic, statistics,
the expert bias for logging), ep (the gradient norm).

| the trainer calls        | what it does here                                                   |
|--------------------------|---------------------------------------------------------------------|
| forward_backward         | the step's micro-batches through the local loop or the pipeline     |
|                          | schedule, gradient sync armed on each rank's last backward          |
| finish_step              | tp partial gradients summed; statistics and loss reduced over       |
|                          | dp (and tp, pp): every rank ends with the same global numbers       |
| clip_grad_norm           | the exact global norm over every gradient group, then clipping      |
| optimizer_step           | AdamW (sharded under ZeRO), expert bias update                      |
| model_shards /           | each local tensor with its `shards.Segment`s (checkpoints, init)    |
|   optimizer_shards       |                                                                     |
"""

import contextlib
import dataclasses
from typing import NamedTuple

import torch

from moepar.layers.balance import MicroBalance
from moepar.layers.experts import CastCache, GroupedExperts
from moepar.layers.init import expert_split
from moepar.layers.router import TopKRouter

from .data import clip_grad_norm, grad_norm_groups
from .pipeline_runner import step_balance
from .schedules import Action, _statistics_only, default_loss
from .shards import fsdp_segments, tp_segments, whole_segments, flat_segments
from .tensor import reduce_sequence_parallel_grads, tp_norm_parameters, tp_shard_spec
from .vocab import vocab_parallel_cross_entropy

__all__ = ["ParallelModel", "LocalRunner", "LocalTensor", "local_tensor"]


class LocalTensor(NamedTuple):
    """A tensor on this rank and where it sits in the canonical tensors."""
    name: str               # parameter / buffer name, or "<kind>/<parameter name>" for state
    tensor: torch.Tensor    # plain tensor (DTensors are given as their local shard)
    segments: list          # shards.Segment


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2); plain tensors unchanged."""
    return t.to_local() if hasattr(t, "to_local") else t


class LocalRunner:
    """pp = 1: the step's micro-batches one after another (forward, loss, backward), with the
    hooks of `PipelineRunner.run` so the handle drives both the same way.

    A deferred balance loss (layers/balance.py) is finished after each micro-batch's forward,
    its counts summed over `balance_group` (the dp ranks; global scope) by one all-reduce of
    (L+1)*E numbers or fewer. After `run`: `balance_values`, per micro-batch its weighted value
    (None when the balance loss is each router call's own)."""

    def __init__(self, model, num_micro: int, loss_fn, autocast, balance_group=None):
        self.model, self.num_micro, self.loss_fn, self.autocast = model, num_micro, loss_fn, autocast
        self.order = [Action(kind, 0, n) for n in range(num_micro) for kind in "FB"]
        self.loss_scale = 1.0
        self.balance_group = balance_group
        self.balance_values = []
        model.set_aux_loss_scale(1.0 / num_micro)

    def run(self, inputs: list, targets: list, before_action=None, after_action=None,
            limit: int | None = None, forward_only: bool = False):
        """The step's micro-batches (or the first `limit`); returns (loss sum, per micro-batch
        the MoE outputs' statistics). `forward_only`: no autograd, no backward (evaluation)."""
        device = next(self.model.parameters()).device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        outputs, self.balance_values = [], []
        step = None if forward_only else step_balance(self.model, self.balance_group, device)
        for n in range(self.num_micro if limit is None else limit):
            inputs_BS = inputs[n].to(device, non_blocking=True)
            targets_BS = targets[n].to(device, non_blocking=True)
            holder = None if step is None else MicroBalance()
            with self.autocast(), torch.no_grad() if forward_only else contextlib.nullcontext():
                logits, moe_outputs = (self.model(inputs_BS) if holder is None
                                       else self.model(inputs_BS, holder))
                loss = self.loss_fn(logits, targets_BS)
            if forward_only:
                loss_sum += loss
                continue
            self.balance_values.append(None if step is None else step.finish(holder))
            # Only statistics outlive the forward: the logits ([B, S, V], the largest activation)
            # and the MoE outputs are not needed by backward and go before it runs.
            outputs.append([_statistics_only(o) for o in moe_outputs])
            del logits, moe_outputs
            backward = Action("B", 0, n)
            if before_action is not None:
                before_action(backward)
            (loss * self.loss_scale / self.num_micro).backward()
            if after_action is not None:
                after_action(backward)
            loss_sum += loss.detach()
        return loss_sum, outputs


@dataclasses.dataclass
class ParallelModel:
    """Built by `parallelize`; see the module docstring for what each call does."""
    model: torch.nn.Module            # the local model, or this rank's pipeline stage
    layout: object                    # dims.Layout
    canonical: dict                   # layers.init.CanonicalTensor per canonical name
    moe_layer_ids: list[int]          # the model's layer number of each MoE layer (all ranks)
    zero: int
    compute_dtype: torch.dtype | None
    num_micro: int                    # micro-batches per step on this rank
    vocab_size: int
    moe_indices: list[int] = None     # positions of this rank's MoE layers among all MoE layers
    sync: object = None               # gradient sync (ddp.py, zero.py, or LocalSync): `attach`
    optimizer: object = None
    runner: object = None             # LocalRunner or pipeline_runner.PipelineRunner
    casts: CastCache = dataclasses.field(default_factory=CastCache)   # see step_scope

    def __post_init__(self):
        self.tp_group = self.layout.group("tp") if self.layout.dims.tp > 1 else None
        if self.moe_indices is None:
            self.moe_indices = (self.model.moe_indices() if hasattr(self.model, "moe_indices")
                                else list(range(len(self.moe_layer_ids))))
        self.moe_router_cfg = next((m.router.cfg for m in self.model.moe_layers()), None)

    def attach(self, sync, optimizer, runner):
        """The last pieces, once the parameters are materialized and wrapped: the norm's tp
        groups come from the parameters as wrapped (FSDP swaps in new ones)."""
        self.sync, self.optimizer, self.runner = sync, optimizer, runner
        self._tp_split = (tp_norm_parameters(self.model, self.tp_group)
                          if self.tp_group is not None else None)
        self._final_backward = None if runner is None else [
            a for a in runner.order if a.kind == "B"][-1]

    # ---- the step ----------------------------------------------------------------------------
    def autocast(self):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.layout.device.type, dtype=self.compute_dtype)

    @contextlib.contextmanager
    def step_scope(self):
        """Around one step's forwards and backwards, on a pipeline rank that keeps several
        micro-batches in flight (parallelize decides; the runner enters it): each weight is cast
        to the compute dtype once per step, not once per micro-batch, and the micro-batches in
        flight share it. Autocast keeps its casts of `F.linear` weights while its outermost
        region lasts, so the step runs inside one (each forward enters its own inside it;
        backward runs with autocast off, `backward_scope`); the grouped experts, which autocast
        does not cover, share `casts` (layers/experts.py CastCache). Both are dropped when the
        step ends, before the optimizer updates the weights. (Installed only under autocast.)"""
        try:
            with self.autocast():
                yield
        finally:
            self.casts.clear()

    def backward_scope(self):
        return torch.autocast(self.layout.device.type, enabled=False)

    def loss_fn(self, logits_BSV, targets_BS):
        """Mean cross-entropy in float32 or wider; vocabulary-parallel under tp (logits split)."""
        if self.tp_group is None:
            return default_loss(logits_BSV, targets_BS)
        logits_BSV = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
        return vocab_parallel_cross_entropy(logits_BSV, targets_BS, self.tp_group,
                                            self.vocab_size)

    def _around(self, action: Action, after: bool):
        if action.kind == "B":
            hook = self.sync.after_backward if after else self.sync.before_backward
            hook(action.micro == self.num_micro - 1, action == self._final_backward)

    def forward_backward(self, inputs: list, targets: list, stats) -> torch.Tensor:
        """This rank's micro-batches of one step, gradients synced; adds each micro-batch's MoE
        statistics to `stats`; returns the sum of their losses (under pp: on the last stage,
        zero elsewhere; `finish_step` sums it over pp)."""
        if self.layout.device.type == "cuda":    # pinned: the copies to the GPU are async
            inputs, targets = [t.pin_memory() for t in inputs], [t.pin_memory() for t in targets]
        loss_sum, moe_outputs = self.runner.run(
            inputs, targets, before_action=lambda a: self._around(a, False),
            after_action=lambda a: self._around(a, True))
        for outs, balance in zip(moe_outputs, self.runner.balance_values, strict=True):
            stats.add(outs, self.moe_router_cfg, self.moe_indices, balance)
        return loss_sum

    def set_loss_scale(self, scale: float):
        """Multiplies the loss (and the injected MoE aux losses) by `scale` before backward;
        `clip_grad_norm` divides the gradients by it again (float16 loss scaling)."""
        self.runner.loss_scale = scale
        self.model.set_aux_loss_scale(scale / self.num_micro)

    def micro_batch(self, inputs_BS, targets_BS, stats, last: bool = True) -> torch.Tensor:
        """One micro-batch (pp = 1) with the gradient sync armed when `last`: the step broken
        into its parts, for tests that look between micro-batches. Returns its loss."""
        if self.layout.dims.pp > 1:
            raise ValueError("micro_batch runs one micro-batch of a whole model (pp = 1)")
        runner = self.runner
        action = Action("B", 0, self.num_micro - 1 if last else 0)
        loss, outs = runner.run([inputs_BS] * runner.num_micro, [targets_BS] * runner.num_micro,
                                before_action=lambda a: self._around(action, False),
                                after_action=lambda a: self._around(action, True),
                                limit=1)
        stats.add(outs[0], self.moe_router_cfg, self.moe_indices, runner.balance_values[0])
        return loss

    def evaluate(self, inputs: list, targets: list) -> torch.Tensor:
        """The sum over every rank's micro-batches of their mean cross-entropy (float64, the same
        on every rank): forward only, no gradients, no statistics. Every rank passes its share
        of the batches (pipeline ranks the same ones), as for a training step."""
        loss_sum, _ = self.runner.run(inputs, targets, forward_only=True)
        if self.zero == 3:      # FSDP2 keeps the root's parameters gathered after a forward, for
            self.model.reshard()  # the backward that would follow; none does: shard them again
        from .data import all_reduce_sum
        all_reduce_sum([loss_sum], self.layout.group("dp"))
        if self.layout.dims.pp > 1:     # the loss lives on the last stage
            all_reduce_sum([loss_sum], self.layout.group("pp"))
        return loss_sum

    def finish_step(self, stats, loss_sum: torch.Tensor):
        """Step-end reductions, on every rank in the same order: tp partial gradients of
        replicated parameters, then statistics and the loss over dp (and tp slices, pp)."""
        if self.tp_group is not None:   # replicated parameters saw 1/tp of the tokens each
            reduce_sequence_parallel_grads(self.model, self.tp_group, self.sync.grad_view)
        layout = self.layout
        stats.reduce(layout.group("dp"), extra=[loss_sum],
                     stage_group=layout.group("pp") if layout.dims.pp > 1 else None,
                     slice_group=self.tp_group)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (float64, before clipping); clips in place to max_norm."""
        groups = grad_norm_groups(self.model, self.sync, self.layout.dims, self._tp_split)
        scale = self.runner.loss_scale
        if scale != 1.0:    # loss scaling: gradients back to the loss's own scale first
            grads = [g for group, _ in groups for g in group]
            if grads:
                torch._foreach_mul_(grads, 1.0 / scale)
        return clip_grad_norm(groups, max_norm, self.layout.meshes, self.layout.device)

    def optimizer_step(self, lr: float, stats):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.update_expert_bias(stats)

    def zero_grad(self):
        """Gradients to zero: in place where the sync keeps them in flat buffers (DDP, ZeRO),
        else set to None."""
        if hasattr(self.sync, "zero_grad"):
            self.sync.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def update_expert_bias(self, stats):
        for layer, moe in zip(self.moe_indices, self.model.moe_layers(), strict=True):
            router = moe.router
            if isinstance(router, TopKRouter) and router.cfg.bias_update_rate > 0:
                router.update_bias(stats.tokens_LE[layer])

    def expert_bias_LE(self, num_experts: int) -> torch.Tensor:
        """Every MoE layer's selection bias [L, E] (float64); a collective over pp under pp > 1
        (every rank calls it, MoE layers or not)."""
        bias_LE = torch.zeros(len(self.moe_layer_ids), num_experts, dtype=torch.float64,
                              device=self.layout.device)
        for layer, moe in zip(self.moe_indices, self.model.moe_layers(), strict=True):
            if isinstance(moe.router, TopKRouter):
                bias_LE[layer] = moe.router.expert_bias_E.to(bias_LE)
        if self.layout.dims.pp > 1:
            import torch.distributed as dist
            dist.all_reduce(bias_LE, group=self.layout.group("pp"))
        return bias_LE

    # ---- where tensors sit (init and checkpoints) --------------------------------------------
    def model_shards(self) -> list[LocalTensor]:
        """Every parameter and persistent buffer of this rank with its segments."""
        return model_shards(self.model, self.layout, self.canonical)

    @property
    def _shards(self) -> "_Shards":
        if getattr(self, "_shards_cache", None) is None:
            self._shards_cache = _Shards(self.model, self.layout, self.canonical)
        return self._shards_cache

    def optimizer_shards(self, create: bool = False) -> tuple[list[LocalTensor], dict]:
        """(moments, steps): AdamW's state tensors as LocalTensors named '<kind>/<parameter>',
        and {LocalTensor name: the step count tensor it goes with}. `create` makes zero state
        first (to load into); without it, parameters without state are left out."""
        if self.zero in (1, 2):
            return self._flat_optimizer_shards(create)
        state = self.optimizer.state
        moments, steps = [], {}
        for name, p in self.model.named_parameters():
            if create:
                state[p] = new_adamw_state(p, self.optimizer)
            if p not in state:
                continue
            segments = self._shards.segments(name, p, True)
            for kind in ("exp_avg", "exp_avg_sq"):
                key = f"{kind}/{name}"
                moments.append(LocalTensor(key, local_tensor(state[p][kind]), segments))
                steps[key] = state[p]["step"]
        return moments, steps

    def _flat_optimizer_shards(self, create: bool):
        reducer, inner = self.sync, self.optimizer.inner
        params = dict((id(p), n) for n, p in self.model.named_parameters())
        moments, steps = [], {}
        for index, b in enumerate(reducer.buckets):
            if create:
                inner.state[b.shard] = new_adamw_state(b.shard, inner)
            if b.shard not in inner.state:
                continue
            segments = []
            for p in b.params:
                name = params[id(p)]
                segments += flat_segments(self._shards.segments(name, p, False), tuple(p.shape),
                                          b.offsets[id(p)], b.mine.start, b.mine.stop)
            for kind in ("exp_avg", "exp_avg_sq"):
                key = f"{kind}/bucket{index}"
                moments.append(LocalTensor(key, inner.state[b.shard][kind], segments))
                steps[key] = inner.state[b.shard]["step"]
        return moments, steps


def new_adamw_state(param, optimizer) -> dict:
    """Zero AdamW state for `param`, laid out as torch.optim.AdamW creates it (step on the
    parameter's device for fused/capturable optimizers, else a host scalar)."""
    group = next(g for g in optimizer.param_groups if any(q is param for q in g["params"]))
    on_device = group.get("fused") or group.get("capturable")
    step = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
    return {"step": step, "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


def persistent_buffers(model):
    """(name, buffer) for every buffer a state_dict would hold."""
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


class _Shards:
    """Segments of this rank's tensors, from the model's module types, tp specs and DTensor
    placements."""

    def __init__(self, model, layout, canonical: dict):
        self.model, self.layout, self.canonical = model, layout, canonical
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
            names = [f"{prefix}.{module.expert_offset + e}.{short}" for e in range(tensor.shape[0])]
            segments = whole_segments(name, tuple(tensor.shape), names)
            writes = fsdp or not data_replicas or coords.edp == 0
        else:
            segments = whole_segments(name, self.canonical[name].shape)
            if spec is not None and tensor.dim() > 0:
                segments = tp_segments(segments, spec, coords.tp)
            tp_ok = coords.tp % spec.replicas == 0 if spec is not None else coords.tp == 0
            writes = tp_ok and (fsdp or not data_replicas or coords.dp == 0)
        if fsdp:
            (placement,) = tensor.placements
            mesh = tensor.device_mesh
            segments = fsdp_segments(segments, placement.dim, tensor.shape[placement.dim],
                                     mesh.size(), mesh.get_local_rank())
        return [dataclasses.replace(s, writes=writes) for s in segments]


def model_shards(model, layout, canonical: dict) -> list[LocalTensor]:
    """Every parameter and persistent buffer of this rank's model with its segments."""
    shards = _Shards(model, layout, canonical)
    out = [LocalTensor(n, local_tensor(p), shards.segments(n, p, True))
           for n, p in model.named_parameters()]
    return out + [LocalTensor(n, b, shards.segments(n, b, True))
                  for n, b in persistent_buffers(model)]


@torch.no_grad()
def materialize(model, layout, canonical: dict, seed: int):
    """Allocates this rank's shards on its device and draws their initial values: each
    canonical tensor this rank touches is drawn once on the host (layers/init.py), its boxes
    copied in, and dropped before the next (peak host memory: one canonical tensor)."""
    from moepar.layers.init import draw, reset_rope_buffers
    from .shards import local_view
    model.to_empty(device=layout.device)
    items = []
    for lt in model_shards(model, layout, canonical):
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
