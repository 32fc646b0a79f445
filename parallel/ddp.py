"""Data-parallel gradient reduction overlapped with backward (DDP semantics, two groups).

Talks on `dp` (dense gradients) and `edp` (expert gradients), asynchronously during backward.

| parameters                     | bucketed over | reduction                          |
|--------------------------------|---------------|------------------------------------|
| dense (everything not experts) | dp            | all-reduce sum, then / dp (a mean) |
| experts (GroupedExperts)       | edp           | all-reduce sum, then / dp          |

Parameters are grouped into buckets (~`bucket_mb` each, one group per bucket) in reverse
registration order, roughly the order backward finishes them. Each bucket's gradients live in
one flat buffer (every `p.grad` a view of it, each parameter 16-element aligned), so backward
accumulates straight into what is all-reduced, and the result is scaled in place, one operation
per bucket. On the last micro-batch of a step
(`arm`), a hook fires as each gradient becomes final; a bucket whose gradients are all final is
flattened and all-reduced asynchronously while backward goes on. Buckets launch strictly in index
order on every rank (a ready bucket waits for the ones before it), so every rank issues the same
collectives in the same order across both groups. Earlier micro-batches only accumulate locally.
`finish` launches whatever is left, waits, and writes the results back. torch's DDP cannot do
this: it reduces every parameter over one group, and expert parameters need another group and
divisor. ZeRO stages 1 and 2 (zero.py) reuse the buckets and the launch order with
reduce-scatters instead.

`reduce_dtype` (parallel.grad_reduce_dtype) sends gradients in bfloat16 and converts the sums
back; accumulation over micro-batches stays in the parameters' dtype. Under bf16 training the
buckets hold the float32 masters' gradients (precision.py): a model parameter's gradient is
added into its master's view of the flat buffer by the masters' hook, which then says it is ready.
"""

import torch
import torch.distributed as dist

from .grads import rows_of, split_parameters
from .precision import Masters

__all__ = ["OverlappedReducer", "ALIGN", "align"]


ALIGN = 16   # elements: each parameter starts 16-element aligned in a flat buffer (vector loads)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Bucket:
    def __init__(self, params, axis, group, decay):
        self.params, self.axis, self.group, self.decay = params, axis, group, decay
        self.ready, self.wire, self.handle = set(), None, None
        self.offsets, offset = {}, 0
        for p in params:
            self.offsets[id(p)] = offset
            offset = align(offset + p.numel())
        self.numel = offset          # the flat length with alignment gaps (zeros)
        self.flat_grad = None        # the bucket's gradients, each p.grad a view of it


class OverlappedReducer:
    """zero=0: every rank keeps full gradients, reduced on the step's last micro-batch."""

    reduce_every_micro = False

    def __init__(self, model, meshes, dims, bucket_mb: float = 25.0, reduce_dtype=None,
                 split_decay=False, grad_views: bool = True, masters: Masters | None = None):
        self.meshes, self.scale, self.reduce_dtype = meshes, 1.0 / dims.dp, reduce_dtype
        self.masters = masters = masters or Masters(model)
        _, experts = split_parameters(model)
        in_expert = {id(p) for p in experts}
        limit = bucket_mb * 2 ** 20
        self.buckets: list[_Bucket] = []
        current, size, key = [], 0, None

        def close():
            axis, decay = key
            self.buckets.append(_Bucket(current, axis, meshes.group(axis), decay))

        for q in reversed([q for q in model.parameters() if q.requires_grad]):
            p = masters.master(q)     # what is reduced and stepped (q itself without masters)
            # split_decay: a bucket holds one weight decay (or one optimizer: a callable's key)
            kind = split_decay(q) if callable(split_decay) else split_decay and p.dim() >= 2
            p_key = ("edp" if id(q) in in_expert else "dp", kind)
            nbytes = p.numel() * p.element_size()
            if current and (p_key != key or size + nbytes > limit):
                close()
                current, size = [], 0
            current.append(p)
            key, size = p_key, size + nbytes
        if current:
            close()
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.grad_views = grad_views
        self.armed, self.next_launch = False, 0
        # A parameter says its gradient is final itself; a master through the masters' hook on
        # its compute parameter, once that gradient has been added into it.
        mastered = {id(m) for _, m in masters.pairs}
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                      for b in self.buckets for p in b.params if id(p) not in mastered]
        self.hooks += masters.grad_hooks(self._on_grad)

    # -- the training step's view -----------------------------------------------------------
    def _reduces(self, last: bool, step_final: bool | None) -> bool:
        return self.reduce_every_micro or (last if step_final is None else step_final)

    def before_backward(self, last: bool, step_final: bool | None = None):
        self._ensure_grad_buffers()
        if self._reduces(last, step_final):
            self.arm()

    def after_backward(self, last: bool, step_final: bool | None = None):
        if self._reduces(last, step_final):
            self.finish()

    # Where each gradient lives after the sync, and the axes its storage is sharded over
    # (grads.grad_norm_groups adds ep, tp and pp).
    dense_axes, expert_axes = (), ()

    def grad_view(self, p, rows=None):
        """Where model parameter p's gradient (of rows [start, stop) of dim 0 when `rows`) lives
        after the sync (its master's)."""
        return rows_of(self.masters.master(p).grad, rows)

    # -- overlap machinery --------------------------------------------------------------------
    def arm(self):
        """The next backward reduces as its gradients become final."""
        self.armed, self.next_launch = True, 0
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.wire = bucket.handle = None

    def _on_grad(self, param):
        if not self.armed:
            return
        self.bucket_of[id(param)].ready.add(id(param))
        buckets = self.buckets
        while self.next_launch < len(buckets) and \
                len(buckets[self.next_launch].ready) == len(buckets[self.next_launch].params):
            self._launch(buckets[self.next_launch])
            self.next_launch += 1

    def _to_wire(self, flat):
        return flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)

    def _attach_grads(self, b):
        for p in b.params:
            start = b.offsets[id(p)]
            p.grad = b.flat_grad[start:start + p.numel()].view_as(p)

    def _ensure_grad_buffers(self):
        """Allocates the flat gradient buffers before the first backward (not at build: a rank
        holds only its parameters until it trains) and points each p.grad into them, so
        gradients accumulate straight into what is reduced."""
        if not self.grad_views or self.buckets[0].flat_grad is not None:
            return
        for b in self.buckets:
            b.flat_grad = torch.zeros(self._flat_length(b), dtype=b.params[0].dtype,
                                      device=b.params[0].device)
            self._attach_grads(b)

    def _flat_length(self, b) -> int:
        return b.numel

    def zero_grad(self):
        """Zeros the gradient buffers (and re-attaches the views, in case anything replaced a
        parameter's .grad); the trainer calls this instead of the optimizer's set-to-None."""
        for b in self.buckets:
            if b.flat_grad is not None:
                b.flat_grad.zero_()
                self._attach_grads(b)

    def _launch(self, bucket: _Bucket):
        bucket.wire = self._to_wire(bucket.flat_grad)
        bucket.handle = dist.all_reduce(bucket.wire, group=bucket.group, async_op=True)

    def _complete(self, bucket: _Bucket):
        # Whole-bucket operations: one copy back (reduced-precision wire only) and one scale.
        if bucket.wire is not bucket.flat_grad:
            bucket.flat_grad.copy_(bucket.wire)
        bucket.flat_grad.mul_(self.scale)

    def finish(self):
        """Launches the buckets backward did not complete, waits for all, writes the results."""
        if not self.armed:
            self.arm()
        while self.next_launch < len(self.buckets):
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1
        for bucket in self.buckets:
            if bucket.handle is not None:      # (ZeRO-2 settles buckets during backward)
                self._settle(bucket)
        self.armed = False

    def _settle(self, bucket: _Bucket):
        """Waits for one bucket's collective, writes its result, drops its wire buffer."""
        bucket.handle.wait()
        self._complete(bucket)
        bucket.wire = bucket.handle = None
