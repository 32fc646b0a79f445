"""AdamW whose moments (exp_avg, exp_avg_sq) may be stored in a narrower dtype than the masters
(`train.optim_state_dtype = "bfloat16"`: 4 bytes of state per parameter instead of 8).

Talks on no process group: the update is elementwise, so it runs the same on whole parameters
(zero 0), ZeRO-1/2 flat shards and FSDP2 DTensors (on their local shards).

| moments dtype          | step                                                               |
|------------------------|--------------------------------------------------------------------|
| as the masters (None)  | torch.optim.AdamW itself (fused kernel on CUDA, foreach elsewhere) |
| bfloat16               | per chunk: moments read into the masters' dtype, torch's foreach   |
|                        | AdamW arithmetic there, moments rounded back (nearest even)        |

The masters, the gradients and the update maths keep the masters' dtype (float32; float64 in
exact tests); only what is stored between steps is narrower. The arithmetic repeats torch's
foreach AdamW op for op (torch/optim/adam.py `_multi_tensor_adam`), so with moments in the
masters' dtype it is bit-identical to torch's (tests/unit/test_adamw.py). Why not torch's own:
it creates its moments like the parameters and has no narrower store. Chunks bound the float32 temporaries (`CHUNK` elements at a time), so the saving is not
spent again at the step's peak. Step counts stay host tensors, as torch's non-fused AdamW keeps
them: reading them is no device sync.
"""

import torch

from .placement import local_tensor, new_adamw_state

__all__ = ["AdamW", "adamw_update", "CHUNK"]

CHUNK = 1 << 24          # elements per batch of the low-precision path (64 MiB per fp32 temporary)


def adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps: list[float], *, lr: float,
                 beta1: float, beta2: float, weight_decay: float, eps: float):
    """One AdamW update of plain tensors in place, computed in the parameters' dtype (moments
    of another dtype are read into it and written back); `steps` are the counts after this
    step. Torch's foreach AdamW arithmetic, in its order."""
    dtype = params[0].dtype
    wide_m = [m.to(dtype) for m in exp_avgs]     # the moments themselves when already `dtype`
    wide_v = [v.to(dtype) for v in exp_avg_sqs]
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(wide_m, grads, 1 - beta1)
    torch._foreach_mul_(wide_v, beta2)
    torch._foreach_addcmul_(wide_v, grads, grads, 1 - beta2)
    step_size = [(lr / (1 - beta1 ** s)) * -1 for s in steps]
    bias_correction2_sqrt = [(1 - beta2 ** s) ** 0.5 for s in steps]
    denom = torch._foreach_sqrt(wide_v)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, wide_m, denom, step_size)
    for narrow, wide in ((exp_avgs, wide_m), (exp_avg_sqs, wide_v)):
        if narrow[0].dtype != dtype:
            torch._foreach_copy_(narrow, wide)


def _pieces(tensors, limit: int):
    """Flat views of each tensor (all the same shape) of at most `limit` elements."""
    if not all(t.is_contiguous() for t in tensors):
        return [tensors]
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    return [[f[i:i + limit] for f in flat] for i in range(0, n, limit)] or [tensors]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with `state_dtype`: the dtype of exp_avg and exp_avg_sq (None: the
    parameters', and then every step is torch's own). Checkpoints see the moments as they are
    stored (placement.optimizer_shards)."""

    def __init__(self, params, *, state_dtype: torch.dtype | None = None, **kwargs):
        if state_dtype is not None and (kwargs.get("fused") or kwargs.get("amsgrad")
                                        or kwargs.get("maximize") or kwargs.get("capturable")):
            raise ValueError("AdamW with a narrower state_dtype steps with foreach arithmetic: "
                             "not with fused, capturable, amsgrad or maximize")
        super().__init__(params, **kwargs)
        self.state_dtype = state_dtype

    def moment_dtype(self, param) -> torch.dtype:
        return self.state_dtype if self.state_dtype is not None else param.dtype

    def narrow(self, param) -> bool:
        return self.moment_dtype(param) != param.dtype

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("moepar's AdamW takes no closure")
        if self.state_dtype is None or not any(self.narrow(p) for g in self.param_groups
                                               for p in g["params"]):
            return super().step()
        for group in self.param_groups:
            self._step_group(group)
        return None

    def _step_group(self, group):
        beta1, beta2 = group["betas"]
        batch, size = [], 0
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(new_adamw_state(p, self))
            state["step"] += 1
            step = float(state["step"])
            tensors = [local_tensor(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            for piece in _pieces(tensors, CHUNK):
                batch.append((*piece, step))
                size += piece[0].numel()
                if size >= CHUNK:
                    self._update(batch, group, beta1, beta2)
                    batch, size = [], 0
        if batch:
            self._update(batch, group, beta1, beta2)

    @staticmethod
    def _update(batch, group, beta1, beta2):
        params, grads, exp_avgs, exp_avg_sqs, steps = (list(x) for x in zip(*batch, strict=True))
        adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"], beta1=beta1,
                     beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"])
