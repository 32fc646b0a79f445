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
| grad_norm                | the exact global norm over every gradient group (left on the device)|
| clip_gradients           | given the norm read on the host: multiplies only when over the limit|
| optimizer_step           | AdamW (sharded under ZeRO) on the masters, the compute weights      |
|                          | written from them, expert bias update                               |
| model_shards /           | each local tensor with its `shards.Segment`s (checkpoints, init)    |
|   optimizer_shards       |                                                                     |
"""

import dataclasses

import torch
from torch.nn.utils import get_total_norm

from moepar.layers.router import TopKRouter

from .dims import Layout
from .expert import moe_layers_by_id
from .expert_move import apply_map, move_experts
from .grads import all_reduce_sum, clip_gradients, grad_norm, grad_norm_groups
from .local_runner import LocalRunner
from .pipeline_runner import PipelineRunner
from .placement import LocalTensor, Placement, local_tensor
from .precision import Masters, Precision
from .schedules import Action
from .tensor import reduce_sequence_parallel_grads, tp_norm_parameters
from .zero import ShardedAdamW

__all__ = ["ParallelModel"]


@dataclasses.dataclass
class ParallelModel:
    """Built once, by `parallelize`, from its finished parts; see the module docstring."""
    model: torch.nn.Module            # the local model, or this rank's pipeline stage
    layout: Layout
    canonical: dict                   # layers.init.CanonicalTensor per canonical name
    moe_layer_ids: list[int]          # the model's layer number of each MoE layer (all ranks)
    zero: int
    num_micro: int                    # micro-batches per step on this rank
    sync: object                      # gradient sync: ddp.py's, zero.py's, or LocalSync
    optimizer: torch.optim.Optimizer | ShardedAdamW   # over the masters (ZeRO: flat shards)
    runner: LocalRunner | PipelineRunner | None       # None: a memory simulation
    masters: Masters
    precision: Precision
    compiled: object = None           # compile.CompiledRegions (train.compile), or None
    qk_clip: object = None            # qkclip.QKClip (train.qk_clip), or None

    def __post_init__(self):
        self.tp_group = self.layout.group("tp") if self.layout.dims.tp > 1 else None
        self.moe_indices = self.model.moe_indices()
        self.moe_router_cfg = next((m.router.cfg for m in self.model.moe_layers()), None)
        self.placement = Placement(self.model, self.layout, self.canonical, self.masters)
        # The norm's tp groups come from the parameters as wrapped (FSDP swaps in new ones).
        self._tp_split = (tp_norm_parameters(self.model, self.tp_group)
                          if self.tp_group is not None else None)
        self._final_backward = None if self.runner is None else [
            a for a in self.runner.order if a.kind == "B"][-1]

    # ---- the step ----------------------------------------------------------------------------
    def _around(self, action: Action, after: bool):
        if action.kind == "B":
            hook = self.sync.after_backward if after else self.sync.before_backward
            hook(action.micro == self.num_micro - 1, action == self._final_backward)

    def forward_backward(self, inputs: list, targets: list, stats, **packed) -> torch.Tensor:
        """This rank's micro-batches of one step, gradients synced; adds each micro-batch's MoE
        statistics to `stats`; returns the sum of their losses (under pp: on the last stage,
        zero elsewhere; `finish_step` sums it over pp). `packed` (data.pack, the local runner
        only): `documents` per micro-batch and loss `weights` (LocalRunner.run)."""
        if self.layout.device.type == "cuda":    # pinned: the copies to the GPU are async
            inputs, targets = [t.pin_memory() for t in inputs], [t.pin_memory() for t in targets]
            if "documents" in packed:
                packed["documents"] = [t.pin_memory() for t in packed["documents"]]
        loss_sum, moe_outputs = self.runner.run(
            inputs, targets, before_action=lambda a: self._around(a, False),
            after_action=lambda a: self._around(a, True), **packed)
        for outs, balance in zip(moe_outputs, self.runner.balance_values, strict=True):
            stats.add(outs, self.moe_router_cfg, self.moe_indices, balance)
        stats.mtp_1 += self.runner.mtp_sum    # reduced with the statistics (finish_step)
        return loss_sum

    def set_loss_scale(self, scale: float):
        """Multiplies the loss (and the injected MoE aux losses) by `scale` before backward;
        `grad_norm` divides the gradients by it again (float16 loss scaling)."""
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

    def evaluate(self, inputs: list, targets: list, **packed) -> torch.Tensor:
        """The sum over every rank's micro-batches of their mean cross-entropy (float64, the same
        on every rank): forward only, no gradients, no statistics. Every rank passes its share
        of the batches (pipeline ranks the same ones), as for a training step. `packed`: as
        forward_backward's (the micro-batches' documents and loss weights)."""
        loss_sum, _ = self.runner.run(inputs, targets, forward_only=True, **packed)
        if self.zero == 3:      # FSDP2 keeps the root's parameters gathered after a forward, for
            self.model.reshard()  # the backward that would follow; none does: shard them again
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

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (float64, on the device: the trainer reads it in the step's
        one host sync); under loss scaling the gradients are first brought back to the loss's
        own scale."""
        groups = grad_norm_groups(self.model, self.sync, self.layout.dims, self._tp_split)
        scale = self.runner.loss_scale
        if scale != 1.0:
            grads = [g for group, _ in groups for g in group]
            if grads:
                torch._foreach_mul_(grads, 1.0 / scale)
        return grad_norm(groups, self.layout.meshes, self.layout.device)

    def clip_gradients(self, norm: float, max_norm: float) -> bool:
        """Clips to max_norm given the norm `grad_norm` returned (read on the host): gradients
        are multiplied only when it is over the limit; True if they were."""
        groups = grad_norm_groups(self.model, self.sync, self.layout.dims, self._tp_split)
        return clip_gradients(groups, norm, max_norm)

    def optimizer_step(self, lr: float, stats):
        """The optimizer on the masters, then the compute weights from them (one cast per
        parameter per step), then the routers' expert bias from the step's loads."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.qk_clip is not None:     # on the masters, before the compute weights follow
            self.qk_clip.apply()
        self.masters.refresh()
        self.update_expert_bias(stats)

    def zero_grad(self):
        """Gradients to zero: in place where the sync keeps them in flat buffers (DDP, ZeRO),
        else set to None."""
        if hasattr(self.sync, "zero_grad"):
            self.sync.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def parameters_norm(self) -> torch.Tensor:
        """The norm of this rank's parameter values (masters), left on the device: non-finite
        exactly when one of them is (one read of the parameters, no sync)."""
        return get_total_norm([local_tensor(self.masters.master(p).detach())
                               for p in self.model.parameters()])

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
            all_reduce_sum([bias_LE], self.layout.group("pp"))
        return bias_LE

    def replace_experts(self, old: dict, new: dict):
        """Moves each MoE layer's experts from placement `old[layer]` to `new[layer]` (layer
        number -> ExpertMap; expert_move.py): weights, masters and AdamW moments in one
        all-to-all over ep per layer, between steps (zero 0 only). Every rank of the EP group
        calls it with the same maps."""
        if self.zero:
            raise ValueError(f"re-placing experts (parallel.replace_every) needs parallel.zero=0, "
                             f"not {self.zero}: ZeRO shards expert rows by position")
        group, ep_rank = self.layout.group("ep"), self.layout.coords.ep
        for layer_id, moe in moe_layers_by_id(self.model):
            tensors = []
            for p in (moe.experts.w_in_EDU, moe.experts.w_out_EFD):
                master = self.masters.master(p)
                tensors += [p] + ([master] if master is not p else [])
                tensors += [s for s in self.optimizer.state.get(master, {}).values()
                            if torch.is_tensor(s) and s.shape == p.shape]
            move_experts(tensors, old[layer_id], new[layer_id], group, ep_rank)
            apply_map(moe, new[layer_id], group, ep_rank)

    # ---- where tensors sit (init and checkpoints) --------------------------------------------
    def model_shards(self) -> list[LocalTensor]:
        """Every parameter (its master under bf16 training) and persistent buffer of this rank
        with its segments."""
        return self.placement.model_shards()

    def optimizer_shards(self, create: bool = False) -> tuple[list[LocalTensor], dict]:
        """(moments, steps): AdamW's state tensors as LocalTensors named '<kind>/<parameter>'
        (ZeRO-1/2: '<kind>/bucket<i>'), and {LocalTensor name: the step count tensor it goes
        with}. `create` makes zero state first (to load into)."""
        if self.zero in (1, 2):
            return self.placement.flat_optimizer_shards(self.sync, self.optimizer.inner, create)
        return self.placement.optimizer_shards(self.optimizer, create)

    def loaded(self):
        """After a checkpoint was read into `model_shards()`: the compute weights follow."""
        self.placement.loaded()
