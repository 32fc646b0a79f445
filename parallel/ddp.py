"""Data-parallel gradient reduction overlapped with backward (DDP semantics, two groups).

Talks on `dp` (dense gradients) and `edp` (expert gradients), asynchronously during backward.

| parameters                     | bucketed over | reduction                          |
|--------------------------------|---------------|------------------------------------|
| dense (everything not experts) | dp            | all-reduce sum, then / dp (a mean) |
| experts (GroupedExperts)       | edp           | all-reduce sum, then / dp          |

Parameters are grouped into buckets (~`bucket_mb` each, one group per bucket) in reverse
registration order, roughly the order backward finishes them. On the last micro-batch of a step
(`arm`), a hook fires as each gradient becomes final; a bucket whose gradients are all final is
flattened and all-reduced asynchronously while backward goes on. Buckets launch strictly in index
order on every rank (a ready bucket waits for the ones before it), so every rank issues the same
collectives in the same order across both groups. Earlier micro-batches only accumulate locally.
`finish` launches whatever is left, waits, and writes the results back. torch's DDP cannot do
this: it reduces every parameter over one group, and expert parameters need another group and
divisor.
"""

import torch
import torch.distributed as dist

from .data import split_parameters

__all__ = ["OverlappedReducer"]


class _Bucket:
    def __init__(self, params, group):
        self.params, self.group = params, group
        self.ready, self.buffer, self.handle = set(), None, None


class OverlappedReducer:
    def __init__(self, model, meshes, dims, bucket_mb: float = 25.0):
        self.scale = 1.0 / dims.dp
        _, experts = split_parameters(model)
        in_expert = {id(p) for p in experts}
        limit = bucket_mb * 2 ** 20
        self.buckets: list[_Bucket] = []
        current, size, current_group = [], 0, None
        for p in reversed([p for p in model.parameters() if p.requires_grad]):
            group = meshes.group("edp") if id(p) in in_expert else meshes.group("dp")
            nbytes = p.numel() * p.element_size()
            if current and (group is not current_group or size + nbytes > limit):
                self.buckets.append(_Bucket(current, current_group))
                current, size = [], 0
            current.append(p)
            current_group, size = group, size + nbytes
        if current:
            self.buckets.append(_Bucket(current, current_group))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.armed, self.next_launch = False, 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                      for b in self.buckets for p in b.params]

    def arm(self):
        """The next backward is the step's last: reduce as its gradients become final."""
        self.armed, self.next_launch = True, 0
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.buffer = bucket.handle = None

    def _on_grad(self, param):
        if not self.armed:
            return
        self.bucket_of[id(param)].ready.add(id(param))
        buckets = self.buckets
        while self.next_launch < len(buckets) and \
                len(buckets[self.next_launch].ready) == len(buckets[self.next_launch].params):
            self._launch(buckets[self.next_launch])

    def _launch(self, bucket: _Bucket):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.buffer = torch.cat([g.reshape(-1) for g in grads])
        bucket.handle = dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)
        self.next_launch += 1

    def finish(self):
        """Launches the buckets backward did not complete, waits for all, writes the results."""
        if not self.armed:
            self.arm()
        while self.next_launch < len(self.buckets):
            self._launch(self.buckets[self.next_launch])
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.buffer.mul_(self.scale)
            offset = 0
            for p in bucket.params:
                chunk = bucket.buffer[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += p.numel()
            bucket.buffer = bucket.handle = None
        self.armed = False
