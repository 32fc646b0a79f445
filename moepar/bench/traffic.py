"""`moepar bench traffic CONFIG [--section.key=value ...]`: the memory traffic of one training
step, counted op by op in eager mode, so that work on the GPU's speed can be measured on a CPU.

The run config's model is built as training builds it (the Trainer, one process, its device);
one step runs untraced (AdamW's moments, the grouped-GEMM probe and other first-call state), then
one full step (forward, backward, clipping, AdamW, master refresh, zero_grad) runs under a
dispatch mode that sees every aten op below autograd, in forward and backward alike:

| an op is               | which ops                                       | counted                   |
|------------------------|-------------------------------------------------|---------------------------|
| free (metadata)        | views by schema (view, transpose, expand, split, detach, ...), `_unsafe_view`, `empty*` | 0 bytes |
| matmul                 | mm, addmm, bmm, baddbmm, `_grouped_mm`, ...     | apart: 2 m n k FLOPs      |
| matmul, memory-bound   | mv, dot, and products with m, k or n <= 16 (the combine's weighted sum of K copies, [T,1,K] @ [T,K,D]) | traffic, class "matmul (memory-bound)" |
| attention kernel       | `_scaled_dot_product_*`, flash / efficient / cudnn attention | apart: FLOPs as matmuls, no causal halving (PaLM's count, as `bench train`) |
| traffic                | every other op                                  | reads: tensor inputs (each once, a broadcast dim once; a gather's source at most its output); writes: outputs and mutated inputs (an in-place scatter or index_put: only as much of its destination as its other arguments) |

Where it runs (`Scope`): inside a block (model.layers[i], MoE or dense; in backward from the
gradient of its output to that of its input), outside the blocks (batch, embedding, final norm,
head, loss), or the optimizer part: everything after the backward (statistics, clipping, AdamW,
refresh, zero_grad) and what autograd's AccumulateGrad runs (bf16: adding each gradient into its
float32 main gradient), which scale with parameters, not tokens. Ops inside an RMSNorm, its casts
included, are the class "normalization" (a fused norm kernel would do all of them).

The roofline is the GPU preset's (`moepar plan --gpu`): tensor-core FLOPs / bf16 peak + the other
bytes / HBM bandwidth, each at 100% of spec. It is eager-mode traffic, not a measurement of time.
Private torch API, used here only: `TorchDispatchMode` (the one hook under autograd that sees
every aten op) and `_current_autograd_node` (tells an AccumulateGrad hook from the backward).
"""

import tempfile
from functools import partial

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode

from moepar.bench.train import flops_per_token
from moepar.layers.model import Block, RMSNorm
from moepar.plan.hardware import resolve_gpu
from moepar.train import Trainer

__all__ = ["Counter", "Scope", "bench_traffic", "print_result", "PARTS"]

PARTS = ("moe_layers", "dense_layers", "outside", "optimizer")
FREE = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        "lift_fresh", "resize_", "set_", "t_", "transpose_", "squeeze_", "unsqueeze_",
        "as_strided_", "detach_", "_local_scalar_dense", "record_stream"}
WRITE_ONLY = {"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_", "normal_",
              "uniform_", "bernoulli_", "random_", "exponential_"}   # first argument not read
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
          "mv", "addmv", "dot"}
ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
PERMUTE = {"index_select", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
           "scatter_reduce", "index_add", "index_add_", "index_put", "index_put_", "_index_put_impl_",
           "index", "index_copy", "index_copy_", "sort", "argsort", "searchsorted", "cat", "stack",
           "topk", "embedding", "embedding_dense_backward", "masked_select", "masked_scatter",
           "repeat_interleave", "bincount", "histc", "nonzero", "gather_backward"}
# A product with a dimension of at most SKINNY (the bf16 combine's [T,1,K] @ [T,K,D]: a weighted
# sum of K rows; a batched dot) does about 2 FLOPs per element it moves, far below a GPU's ridge
# point (~200 FLOPs/byte on an H200): it moves bytes like an elementwise op, and counting it as
# tensor-core work would hide them.
SKINNY = 16
SCATTER_INTO = {"scatter_", "scatter_add_", "index_put_", "_index_put_impl_", "index_add_",
                "index_copy_", "masked_scatter_"}    # write (and read) only what they index
GATHER = {"embedding", "index_select", "gather", "index"}    # read the rows they pick
SOFTMAX_LOSS = {"_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
                "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "logsumexp",
                "cross_entropy_loss"}


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value if isinstance(v, torch.Tensor) for t in [v]]
    return []


def nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches of t: its elements, a broadcast (stride-0) dimension once."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        n *= size if stride else 1
    return n * t.element_size()


def matmul_flops(name: str, args, out) -> int:
    """2 m n k summed over the product's groups (addmm/baddbmm: the matrices are args 1, 2)."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addmv") else args[:2]
    if name.endswith("grouped_mm") and a.dim() == 2 and b.dim() == 2:   # groups split k
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out.numel() * a.shape[-1]


def attention_flops(name: str, args) -> int:
    """q k^T and p v: 2 B H Sq Sk (Dqk + Dv) forward; the backward twice that."""
    backward = name.endswith("backward")
    q, k, v = args[1:4] if backward else args[:3]
    forward = 2 * q.numel() // q.shape[-1] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return 2 * forward if backward else forward


def skinny(name: str, args) -> bool:
    """A memory-bound product: a vector one (mv, dot) or one whose m, k or n is <= SKINNY."""
    if name in ("mv", "addmv", "dot") or name.endswith("grouped_mm"):
        return name in ("mv", "addmv", "dot")
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else args[:2]
    return min(a.shape[-2], a.shape[-1], b.shape[-1]) <= SKINNY


def op_class(name: str, func, args, outs, in_norm: bool) -> str:
    if name in MATMUL:
        return "matmul (memory-bound)"
    if name.startswith(("_foreach_", "_fused_adam", "_fused_sgd")):
        return "optimizer"
    if in_norm or name in ("_fused_rms_norm", "_fused_rms_norm_backward", "native_layer_norm"):
        return "normalization"
    if name in ("_to_copy", "copy_"):
        src, dst = (args[0], outs[0]) if name == "_to_copy" else (args[1], args[0])
        return "casts" if src.dtype != dst.dtype else "copies"
    if name in ("clone", "_copy_from", "contiguous"):
        return "copies"
    if name in PERMUTE:
        return "permutation/gather/scatter"
    if name in SOFTMAX_LOSS:
        return "softmax & loss"
    if torch.Tag.pointwise in func.tags:
        return "elementwise"
    return "other"


class Counter(TorchDispatchMode):
    """Records each aten op under `where()` (a part name): {(part, op, class): [calls, read,
    written]} for traffic, {(part, op): [calls, FLOPs, read, written]} for matmul and attention."""

    def __init__(self, where=lambda: "outside", in_norm=lambda: False):
        super().__init__()
        self.where, self.in_norm = where, in_norm
        self.traffic, self.matmul, self.attention = {}, {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name.endswith("_") and name[:-1] in MATMUL:    # addmm_, baddbmm_: the same product
            name = name[:-1]
        if func.is_view or name in FREE:
            return out
        outs = _tensors(out)
        written = {id(t): t for t in outs}
        skip = set()                               # write-only arguments are not read
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.update((id(t), t) for t in _tensors(value))
                if name in WRITE_ONLY or arg.name == "out":
                    skip.update(id(t) for t in _tensors(value))
        inputs = {id(t): t for v in (*args, *kwargs.values()) for t in _tensors(v)}
        read = sum(nbytes(t) for i, t in inputs.items() if i not in skip)   # a tensor read once
        if name in GATHER:           # of the source, only the rows picked (at most all of it)
            read -= nbytes(args[0]) - min(nbytes(args[0]), sum(nbytes(t) for t in outs))
        wrote = sum(nbytes(t) for t in written.values())
        if name in SCATTER_INTO:     # in place: the kernel touches only the elements it indexes
            touched = min(nbytes(args[0]), sum(nbytes(t) for v in (*args[1:], *kwargs.values())
                                               for t in _tensors(v)))
            wrote -= nbytes(args[0]) - touched
            read -= nbytes(args[0]) - touched
        part = self.where()
        low = name in MATMUL and skinny(name, args)
        if (name in MATMUL and not low) or name.startswith(ATTENTION):
            table = self.matmul if name in MATMUL else self.attention
            flops = (matmul_flops(name, args, outs[0]) if name in MATMUL
                     else attention_flops(name, args))
            row = table.setdefault((part, name), [0, 0, 0, 0])
            row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + flops, row[2] + read, row[3] + wrote
            return out
        row = self.traffic.setdefault((part, name, op_class(name, func, args, outs, self.in_norm())),
                                      [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + read, row[2] + wrote
        return out


class Scope:
    """Which part of the step runs now. Per kind of module (MoE block, dense block, RMSNorm) a
    depth, raised by forward hooks and in backward from the gradient of the module's output to
    that of its input (multi-grad hooks). Counting, not a set of names, so that a recomputed
    forward inside the backward nests cleanly."""

    def __init__(self, model):
        self.phase, self.depth, self.handles = "outside", dict.fromkeys(("moe", "dense", "norm"), 0), []
        for m in model.modules():
            kind = (("moe" if m.is_moe else "dense") if isinstance(m, Block)
                    else "norm" if isinstance(m, RMSNorm) else None)
            if kind:
                self.handles += [m.register_forward_pre_hook(partial(self._enter, kind)),
                                 m.register_forward_hook(partial(self._leave, kind))]

    def _move(self, kind: str, step: int, *_):
        self.depth[kind] += step

    def _enter(self, kind, module, args):
        self._move(kind, 1)
        self._on_grads(args, kind, -1)            # backward leaves at the input's gradient

    def _leave(self, kind, module, args, out):
        self._move(kind, -1)
        self._on_grads(out, kind, 1)              # backward enters at the output's gradient

    def _on_grads(self, value, kind, step):
        tensors = [t for t in _tensors(value) if t.requires_grad]
        if tensors and torch.is_grad_enabled():
            self.handles.append(register_multi_grad_hook(tensors, partial(self._move, kind, step)))

    def where(self) -> str:
        node = torch._C._current_autograd_node()
        if self.phase == "optimizer" or type(node).__name__ == "AccumulateGrad":
            return "optimizer"
        if self.phase == "model" and self.depth["moe"]:
            return "moe_layers"
        return "dense_layers" if self.phase == "model" and self.depth["dense"] else "outside"

    def remove(self):
        for handle in self.handles:
            handle.remove()


def trace_step(trainer) -> tuple[Counter, Scope]:
    """One training step of `trainer` under a Counter; the engine's forward_backward marks the
    model phase (before it: the batch, outside; after it: the optimizer part)."""
    engine, scope = trainer.engine, Scope(trainer.model)
    run = engine.forward_backward

    def model_phase(*args, **kwargs):
        scope.phase = "model"
        try:
            return run(*args, **kwargs)
        finally:
            scope.phase = "optimizer"
    engine.forward_backward = model_phase
    counter = Counter(scope.where, lambda: scope.depth["norm"] > 0)
    try:
        with counter:
            trainer.train_step()
    finally:
        del engine.forward_backward              # the class's method again
        scope.remove()
    return counter, scope


def bench_traffic(cfg, gpu: str = "h200-141g", warmup: int = 1) -> dict:
    hw = resolve_gpu(gpu)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.run.dir, cfg.run.tensorboard, cfg.run.log_every = tmp, False, 0
        cfg.train.steps = warmup + 1
        trainer = Trainer(cfg, log=lambda _m: None, shared_run_dir=False)   # a scratch dir
        for _ in range(warmup):
            trainer.train_step()
        counter, _ = trace_step(trainer)
        num_params = sum(p.numel() for p in trainer.model.parameters())
        num_moe = len(trainer.engine.moe_layer_ids)
    tokens, num_layers = cfg.train.global_batch_size * cfg.train.seq_len, cfg.model.num_layers
    parts = dict.fromkeys(PARTS, 0)
    classes, ops = {}, {}
    for (part, name, cls), (calls, read, wrote) in counter.traffic.items():
        parts[part] += read + wrote
        classes.setdefault(cls, dict.fromkeys(PARTS, 0))[part] += read + wrote
        ops[f"{part} {name} ({cls})"] = {"calls": calls, "read": read, "written": wrote,
                                         "bytes": read + wrote, "part": part}
    total = sum(parts.values())
    top = sorted(ops.items(), key=lambda kv: -kv[1]["bytes"])
    token_bytes = total - parts["optimizer"]
    flops = {kind: sum(r[1] for r in table.values())
             for kind, table in (("matmul", counter.matmul), ("attention", counter.attention))}
    layer_bytes = parts["moe_layers"] + parts["dense_layers"]
    compute_s = (flops["matmul"] + flops["attention"]) / (hw.tflops * 1e12)
    memory_s = total / (hw.hbm_tbps * 1e12)
    per = lambda b, n: b / (tokens * n) if n else None      # noqa: E731 - bytes per token per layer
    return {
        "device": str(trainer.device), "dtype": cfg.train.dtype, "tokens": tokens,
        "num_layers": num_layers, "num_moe_layers": num_moe, "num_params": num_params,
        "bytes": {**parts, "total": total},
        "layer_bytes_per_token_per_layer": per(layer_bytes, num_layers),
        "moe_layer_bytes_per_token": per(parts["moe_layers"], num_moe),
        "dense_layer_bytes_per_token": per(parts["dense_layers"], num_layers - num_moe),
        "outside_bytes_per_token": parts["outside"] / tokens,
        "optimizer_bytes_per_param": parts["optimizer"] / num_params,
        # shares of the whole step, and of the token path (layers and outside: no optimizer)
        "classes": {c: {"bytes": sum(b.values()), "share": sum(b.values()) / total,
                        "token_share": (sum(b.values()) - b["optimizer"]) / token_bytes, **b}
                    for c, b in sorted(classes.items(), key=lambda kv: -sum(kv[1].values()))},
        "top_ops": dict(top[:15]),
        "top_token_ops": dict([kv for kv in top if kv[1]["part"] != "optimizer"][:15]),
        "matmul": {f"{p} {n}": {"calls": c, "flops": f, "bytes": r + w}
                   for (p, n), (c, f, r, w) in sorted(counter.matmul.items())},
        "attention": {f"{p} {n}": {"calls": c, "flops": f, "bytes": r + w}
                      for (p, n), (c, f, r, w) in sorted(counter.attention.items())},
        "matmul_flops": flops["matmul"], "attention_flops": flops["attention"],
        "model_flops_formula": flops_per_token(cfg) * tokens,
        "roofline": {"gpu": hw.name, "peak_tflops": hw.tflops, "hbm_tbps": hw.hbm_tbps,
                     "compute_s": compute_s, "memory_s": memory_s,
                     "step_s": compute_s + memory_s, "mfu": compute_s / (compute_s + memory_s)},
    }


def print_result(r: dict):
    mb = lambda b: f"{b / 1e6:,.3f} MB"                     # noqa: E731
    print(f"traffic of one training step ({r['dtype']}, {r['device']}, eager mode: bytes "
          f"counted op by op, not a measurement of time): {r['tokens']} tokens, "
          f"{r['num_layers']} layers ({r['num_moe_layers']} MoE), {r['num_params']:,} parameters")
    line = f"  per token per layer (non-matmul, blocks): {mb(r['layer_bytes_per_token_per_layer'])}"
    if r["num_moe_layers"] and r["num_moe_layers"] < r["num_layers"]:
        line += (f" (MoE layers {mb(r['moe_layer_bytes_per_token'])}, dense layers "
                 f"{mb(r['dense_layer_bytes_per_token'])})")
    print(line)
    print(f"  per token outside the layers: {mb(r['outside_bytes_per_token'])}")
    print(f"  optimizer per step: {mb(r['bytes']['optimizer'])}, "
          f"{r['optimizer_bytes_per_param']:.1f} bytes per parameter")
    print(f"  total non-matmul: {mb(r['bytes']['total'])}; matmul FLOPs {r['matmul_flops']:.4g} "
          f"+ attention {r['attention_flops']:.4g} (formula of bench train: "
          f"{r['model_flops_formula']:.4g})")
    tokens, layers = r["tokens"], r["num_layers"]
    print(f"  {'op class':<27} {'step':>14} {'share':>6} {'token path':>10} {'layer/token':>11} "
          f"{'outside/token':>13} {'optimizer':>12}")
    for cls, c in r["classes"].items():
        print(f"  {cls:<27} {mb(c['bytes']):>14} {100 * c['share']:5.1f}% "
              f"{100 * c['token_share']:9.1f}% "
              f"{mb((c['moe_layers'] + c['dense_layers']) / (tokens * layers)):>11} "
              f"{mb(c['outside'] / tokens):>13} {mb(c['optimizer']):>12}")
    for key, what in (("top_ops", "the step"), ("top_token_ops", "the token path")):
        print(f"  top ops of {what} by bytes (part, op, class): calls, bytes, per token")
        for name, o in r[key].items():
            print(f"    {name:<58} {o['calls']:>5} {mb(o['bytes']):>14} {mb(o['bytes'] / tokens):>11}")
    f = r["roofline"]
    print(f"  roofline on {f['gpu']} ({f['peak_tflops']:.0f} TFLOP/s bf16, {f['hbm_tbps']} TB/s): "
          f"matmul {1e3 * f['compute_s']:.2f} ms + memory {1e3 * f['memory_s']:.2f} ms = "
          f"{1e3 * f['step_s']:.2f} ms per step, MFU {100 * f['mfu']:.1f}% (eager traffic, "
          "not a timing)")
