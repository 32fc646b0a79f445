"""Regional compilation (train.compile): the pure maths of each decoder block goes through
torch.compile, region by region, so its memory-bound elementwise work (norms, RoPE, softmax,
SwiGLU, residual scaling, and their backward) runs as fused kernels.

Talks on no process group: every region compiled here is collective-free, and the collectives,
the dispatcher and its one host sync stay outside, in eager code that calls the regions.

| region (per block)          | what runs compiled                                | shapes  |
|-----------------------------|---------------------------------------------------|---------|
| attn_norm, ffn_norm         | RMSNorm                                           | static  |
| attention (GQA or MLA)      | q/k/v projections, q/k norms, RoPE, SDPA, o_proj; | static  |
|                             | under tp the local maths between the sequence     |         |
|                             | all-gather and reduce-scatter (`local_forward`)   |         |
| dense FFN (dense blocks)    | w_in, activation, w_out (under tp: local_forward) | static  |
| MoE router (tp = 1)         | logits, scores, top-k, capacity, balance/z losses | static  |
| MoE shared experts          | their FFN and gate                                | static  |
| MoE experts' activation     | SwiGLU (or GELU) on the [R, 2F] hidden rows       | dynamic |

What stays eager, and why:
- the dispatcher (sort, `counts_to_host`, the all-to-all / all-gather, combine): its split sizes
  are a host sync whose values change every step, and the collectives are process-group calls
  inside autograd Functions; compiled, each would be a graph break and every new set of splits
  a guard failure (recompile);
- the experts' grouped GEMMs: each is one extern kernel (nothing to fuse), and their host list
  of rows per expert (the padded fallback's shapes, the native kernel's probe) would put the
  routing into the guards; under expert parallelism the experts run inside `_DeferredFFN`,
  whose backward calls autograd itself. The activation between the GEMMs is the elementwise
  work, compiled with dynamic rows (R changes every step);
- the router under tp > 1 (sequence_router.py): its capacity and losses all-gather and
  all-reduce over tp in the middle of its maths;
- residual adds, the embedding, the final norm, the head and the loss (outside the blocks).

Every region is compiled with fullgraph=True: a graph break inside one is an error, not a slow
fallback, so "no break inside attention, norm, RoPE, router or experts' maths" holds by
construction (and tests/unit/test_compile.py counts them). Regions are compiled by
function, so blocks of one kind share one compiled graph (Dynamo guards on module attributes,
not identity): the count of compiled graphs does not grow with depth. The hand-written
`_SwiGLU` backward (out= writes into views) cannot be traced; inside a region the activation
is the plain formula (layers/experts.py `activate`), which Inductor fuses forward and
backward. Compiling happens on the first call (the first step); `CompiledRegions.seconds()`
is the time Dynamo and Inductor spent, which the trainer logs once.

Order (parallel/__init__.py): after expert/tensor parallelism (which swap the classes whose
maths is compiled) and activation recompute (a recomputed region is compiled with its
checkpoint, which Dynamo traces), before the pipeline split and data parallelism (whose hooks
run outside the compiled forwards, in the modules' eager `__call__`).

Private torch API, here only: `torch._dynamo.utils.compilation_time_metrics` (the compile time;
torch has no public query) and `torch._dynamo.maybe_mark_dynamic` (one dynamic dim; the public
`dynamic=True` makes every dim a symbol).
"""

import functools
import types
from dataclasses import dataclass

import torch

from moepar.layers.experts import activate
from moepar.layers.router import ExpertChoiceRouter, TopKRouter, capacity

__all__ = ["apply_compile", "CompiledRegions", "COMPILE_BACKENDS"]

# inductor: fused kernels (the point); aot_eager and eager trace the same regions without
# generating code (seconds instead of minutes on a CPU: finding graph breaks, tests).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class CompiledRegions:
    """What `apply_compile` installed: compiled callables per block (by layer id)."""
    per_layer: dict[int, int]
    backend: str

    @property
    def count(self) -> int:
        return sum(self.per_layer.values())

    def held_by(self, model) -> "CompiledRegions":
        """The regions of the blocks `model` (a pipeline stage) still holds."""
        return CompiledRegions({i: self.per_layer[i] for i in model.layer_ids}, self.backend)

    @staticmethod
    def seconds() -> float:
        """Seconds Dynamo and Inductor spent compiling in this process so far (forward and
        backward graphs)."""
        times = torch._dynamo.utils.compilation_time_metrics
        return sum(sum(times.get(key, ())) for key in _COMPILE_TIMERS)

    def summary(self) -> str:
        """The start-up log line, once the first step has compiled everything."""
        return f"compile: {self.count} regions ({self.backend}), {self.seconds():.1f} s"


# Outermost timers of a forward (Dynamo's whole frame, AOTAutograd and Inductor inside it) and
# of the backward graph, which Inductor compiles on the first backward.
_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def _compile_maths(module, backend: str) -> int:
    """Compiles the module's collective-free maths: `local_forward` where tensor parallelism
    wraps it in collectives (tensor.py), else `forward` as currently bound (the class's, or
    activation recompute's wrapper). The compiled function is bound to the module as an
    instance attribute, so a `copy.deepcopy` of the module rebinds it to the copy."""
    name = "local_forward" if hasattr(type(module), "local_forward") else "forward"
    func = getattr(module, name).__func__
    compiled = torch.compile(func, fullgraph=True, dynamic=False, backend=backend)
    setattr(module, name, types.MethodType(compiled, module))
    return 1


@functools.lru_cache(maxsize=None)
def _compiled_activate(backend: str):
    """One compiled activation for every experts module (static unless marked)."""
    return torch.compile(activate, fullgraph=True, backend=backend)


def _activate_rows(compiled, activation: str, h_RH):
    # R (rows) changes every step: dim 0 is dynamic from the first call, the width static. Not
    # `dynamic=True`: it would also make the width a symbol, and Dynamo's duck sizing would tie
    # the two whenever R happens to equal it (a recompile when they part again).
    torch._dynamo.maybe_mark_dynamic(h_RH, 0)
    return compiled(h_RH, activation)


def apply_compile(model, backend: str = "inductor") -> CompiledRegions:
    """Compiles the regions of every block of `model` in place (see the module docstring);
    returns what it installed. Nothing compiles before the first forward."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"train.compile_backend={backend!r} is not one of {COMPILE_BACKENDS}")
    # The routers' capacity is host arithmetic (a Fraction): a constant of each compiled graph.
    torch.compiler.assume_constant_result(capacity)
    per_layer = {}
    for block in model.layers:
        count = sum(_compile_maths(m, backend) for m in (block.attn_norm, block.ffn_norm,
                                                          block.attn))
        if not block.is_moe:
            count += _compile_maths(block.ffn, backend)
        else:
            moe = block.ffn
            if type(moe.router) in (TopKRouter, ExpertChoiceRouter):   # the tp router talks
                count += _compile_maths(moe.router, backend)
            if moe.shared is not None:
                count += _compile_maths(moe.shared, backend)
            moe.experts.activate = functools.partial(_activate_rows, _compiled_activate(backend),
                                                     moe.experts.activation)
            count += 1
        per_layer[block.layer_id] = count
    return CompiledRegions(per_layer, backend)
