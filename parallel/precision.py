"""Mixed precision: the model computes in bfloat16 (or float16) while the optimizer steps float32
masters, as Megatron-Core does; float32 and float64 training use the parameters as they are.

Talks on no process group (the gradient syncs reduce the masters' gradients; zero.py, ddp.py).

| train.dtype        | model parameters (compute)         | masters (optimizer, checkpoints)  | gradients accumulate |
|--------------------|------------------------------------|-----------------------------------|----------------------|
| float32, float64   | the masters themselves             | the parameters                    | in `.grad`           |
| bfloat16, float16, | bf16/fp16, written from the masters| float32 copies, one per parameter | in the masters'      |
|   zero 0-2         | once per optimizer step (`refresh`)|                                   | `.grad` (float32)    |
| bfloat16, zero 3   | FSDP2 gathers the float32 shards in bf16 (MixedPrecisionPolicy, zero.py) | the shards | float32 |

Router weights stay float32 (routing maths is float32 whatever the compute dtype; they are a
few numbers per expert), and so do buffers (the expert bias). A micro-batch's backward leaves each
parameter's gradient in its compute dtype for an instant: a hook adds it into the master's
float32 gradient (the "main gradient") and frees it, so accumulation over micro-batches is float32
and no full-size compute-dtype gradient outlives its layer's backward. Nothing is cast per
micro-batch: the forward reads the compute copies as they are, and autocast is off (the residual
stream is the compute dtype) unless `train.fp32_residual` keeps today's float32 residual, where
autocast casts activations at each matmul (the weights are already cast).
"""

import contextlib
from functools import partial

import torch
from torch import nn

from moepar.layers.router import TopKRouter, ExpertChoiceRouter

__all__ = ["Masters", "Precision", "keeps_float32"]


def keeps_float32(model) -> set[int]:
    """Ids of the parameters that stay float32 under a lower compute dtype: the routers'."""
    return {id(p) for m in model.modules() if isinstance(m, (TopKRouter, ExpertChoiceRouter))
            for p in m.parameters()}


class Masters:
    """The float32 masters of a model computing in `dtype` (None: the parameters are their own).

    `master(p)` is the tensor the optimizer steps and checkpoints hold for model parameter p;
    `grad_hooks(ready)` makes every backward add each compute gradient into its master's `.grad`
    and then call `ready(master)` (the gradient syncs launch their buckets from it); `refresh()`
    writes the masters into the compute parameters after each optimizer step (and after a
    checkpoint was loaded into the masters)."""

    def __init__(self, model, dtype: torch.dtype | None = None, training: bool = True):
        self.dtype, self._master, self.pairs = dtype, {}, []
        if dtype is None:
            return
        fp32 = keeps_float32(model)
        with torch.no_grad():
            for p in model.parameters():
                if id(p) in fp32 or not p.is_floating_point() or p.dtype == dtype:
                    continue
                if training:    # (inference keeps no masters: the compute copy is all there is)
                    master = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    self._master[id(p)] = master
                    self.pairs.append((p, master))
                p.data = p.data.to(dtype)

    def master(self, p: torch.Tensor) -> torch.Tensor:
        return self._master.get(id(p), p)

    def masters(self, params) -> list:
        return [self.master(p) for p in params]

    def grad_hooks(self, ready=None) -> list:
        """Post-accumulate hooks on every model parameter that needs a gradient; returns them."""
        hooks = []
        for p, master in self.pairs:
            if p.requires_grad:
                hooks.append(p.register_post_accumulate_grad_hook(
                    partial(self._accumulate, master, ready)))
        return hooks

    @staticmethod
    def _accumulate(master, ready, p):
        if master.grad is None:
            master.grad = p.grad.to(master.dtype)
        else:
            master.grad.add_(p.grad)
        p.grad = None
        if ready is not None:
            ready(master)

    @torch.no_grad()
    def refresh(self):
        """The compute parameters from the masters: one cast per parameter per optimizer step."""
        for p, master in self.pairs:
            p.copy_(master)


class Precision:
    """How a step's forward runs: under autocast only with `fp32_residual` (see the module
    docstring); `residual_dtype` is the dtype of the hidden states between blocks (and stages)."""

    def __init__(self, device_type: str, compute_dtype: torch.dtype | None,
                 param_dtype: torch.dtype, fp32_residual: bool = False):
        self.device_type, self.compute_dtype = device_type, compute_dtype
        self.autocast_on = compute_dtype is not None and fp32_residual
        self.residual_dtype = (compute_dtype if compute_dtype is not None and not fp32_residual
                               else param_dtype)

    def autocast(self):
        if not self.autocast_on:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def widen_embeddings(self, model):
        """fp32_residual: the embedding's (compute-dtype) output joins the float32 residual."""
        if self.autocast_on and getattr(model, "embed", None) is not None:
            model.embed.register_forward_hook(lambda m, args, out: out.to(self.residual_dtype))
