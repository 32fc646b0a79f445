"""Every layout for a model on a cluster, checked by the rules `moepar train` applies (the run
config's own validation and `build.build_dims`), then costed: memory per GPU (footprint.py) and
step time (steptime.py). Families (pp, tp, ep) with no layout that fits get one reason.

Searched: tp over the divisors of a node (TP stays inside a node), pp over the divisors of the
rest (at most one layer per stage), dp the remainder, ep over the divisors of dp * tp (experts fold
over the data and tensor ranks of a stage), schedules 1F1B and interleaved 1F1B with 2 or 4
virtual stages (GPipe on request), ZeRO 0-3, micro-batch sizes dividing each dp rank's share,
the recompute modes asked for, and the routing (the config's, or dropless and capacity).
"""

import dataclasses
import functools
from dataclasses import dataclass

from moepar.build import build_dims
from moepar.layers.shapes import tensor_shapes
from moepar.parallel.dims import ParallelDims

from .activations import ActSpec, rows_per_rank
from .flops import model_flops_per_token
from .footprint import rank_footprint, stage_layers
from .memory import rank_memory
from .steptime import step_seconds

__all__ = ["Layout", "Plan", "Request", "search", "evaluate", "config_layout", "run_config",
           "TRAINER_RECOMPUTE"]

# Recompute modes the trainer runs (train.recompute).
TRAINER_RECOMPUTE = ("none", "full", "attention", "experts")


@dataclass(frozen=True)
class Layout:
    pp: int
    virtual: int
    schedule: str
    dp: int
    tp: int
    ep: int
    zero: int
    micro_batch: int
    recompute: str
    capacity_factor: float | None     # None: dropless

    @property
    def family(self) -> tuple[int, int, int]:
        return (self.pp, self.tp, self.ep)

    def describe(self) -> str:
        pp = f"{self.pp}x{self.virtual}" if self.virtual > 1 else f"{self.pp}"
        return f"pp {pp} dp {self.dp} tp {self.tp} ep {self.ep} zero {self.zero}"


@dataclass
class Request:
    base: object                  # the model's RunConfig (model, router, train.dtype, ...)
    world: int
    gpus_per_node: int
    seq_len: int
    global_tokens: int
    gpu: object                   # hardware.GPU
    imbalance: float = 1.5        # dropless: busiest EP rank's rows over the mean
    recompute: tuple = TRAINER_RECOMPUTE
    routing: tuple = ("config",)  # "config", "dropless", "capacity"
    capacity_factor: float = 1.25  # for "capacity" when the config is dropless
    schedules: tuple = ("1f1b", "interleaved_1f1b")
    max_bubble: float = 0.25
    max_micro_batch: int = 16
    imbalance_by_ep: dict | None = None   # --placement: the imbalance per ep (overrides it)

    @property
    def global_seqs(self) -> int:
        return self.global_tokens // self.seq_len


@dataclass
class Plan:
    layout: Layout
    num_micro: int                # micro-batches per step per dp rank
    memory: dict                  # footprint of the binding rank (bytes)
    memory_rank: int              # its pipeline rank
    time: dict                    # steptime.step_seconds
    tokens_per_s_gpu: float
    mfu: float
    bubble: float
    a2a_share: float
    fits: bool
    reason: str = ""              # why it does not fit ("" if it does)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def run_config(base, layout: Layout, req: Request):
    """The run config of `layout` (validated by its dataclasses; raises ValueError)."""
    node = req.gpus_per_node if req.gpus_per_node < req.world else 0
    parallel = dataclasses.replace(base.parallel, pp=layout.pp, dp=layout.dp, tp=layout.tp,
                                   ep=layout.ep, zero=layout.zero, pp_schedule=layout.schedule,
                                   pp_virtual=layout.virtual, pp_layers=[], gpus_per_node=node)
    train = dataclasses.replace(base.train, micro_batch_size=layout.micro_batch,
                                global_batch_size=req.global_seqs, seq_len=req.seq_len,
                                activation_checkpointing=False, recompute=layout.recompute)
    router = dataclasses.replace(base.router, capacity_factor=layout.capacity_factor)
    model = base.model
    if req.seq_len > model.max_seq_len:
        model = dataclasses.replace(model, max_seq_len=req.seq_len)
    return dataclasses.replace(base, model=model, router=router, parallel=parallel, train=train)


def config_layout(req: Request) -> Layout:
    """The layout the base config asks for (dp resolved for req.world)."""
    p, t = req.base.parallel, req.base.train
    dp = p.dp or req.world // (p.pp * p.tp)
    return Layout(p.pp, p.pp_virtual, p.pp_schedule if p.pp > 1 else "1f1b", dp, p.tp, p.ep,
                  p.zero, t.micro_batch_size, t.recompute,
                  req.base.router.capacity_factor)


def evaluate(req: Request, layout: Layout) -> Plan:
    """One layout's plan (raises ValueError when `moepar train` would refuse it)."""
    cfg = run_config(req.base, layout, req)
    return _Context(req).evaluate(cfg, build_dims(cfg, req.world), layout)


def _routings(req: Request) -> list[float | None]:
    own = req.base.router.capacity_factor
    out = []
    for r in req.routing:
        out.append(own if r == "config" else None if r == "dropless" else own or req.capacity_factor)
    return list(dict.fromkeys(out))


def _shapes(req: Request):
    """(pp, virtual, schedule, tp, ep, micro_batch) before validation."""
    model, world = req.base.model, req.world
    node = min(req.gpus_per_node, world)
    for tp in _divisors(node):
        for pp in _divisors(world // tp):
            if pp > model.num_layers:
                continue
            dp = world // (pp * tp)
            schedules = [("1f1b", 1)] if pp == 1 else \
                [(s, v) for s in req.schedules for v in ((2, 4) if s == "interleaved_1f1b" else (1,))]
            per_dp = req.global_seqs // dp if req.global_seqs % dp == 0 else 0
            mbs = [m for m in _divisors(per_dp) if m <= req.max_micro_batch] if per_dp else [1]
            for ep in _divisors(dp * tp):
                for schedule, virtual in schedules:
                    for micro in mbs:
                        yield pp, virtual, schedule, dp, tp, ep, micro


def search(req: Request) -> tuple[list[Plan], dict]:
    """(every valid plan, best first: fitting ones by step time, then the rest by memory;
    {family: reason} for the families without a fitting plan)."""
    base = req.base
    if req.global_tokens % req.seq_len:
        raise ValueError(f"--global-batch-tokens {req.global_tokens} is not a multiple of "
                         f"--seq-len {req.seq_len} (whole sequences per step)")
    plans, errors = [], {}
    ctx = _Context(req)
    full = set()      # shapes whose every layout ran out of memory at a smaller micro-batch
    for pp, virtual, schedule, dp, tp, ep, micro in _shapes(req):
        for capacity in _routings(req):
            probe = Layout(pp, virtual, schedule, dp, tp, ep, 0, micro, "none", capacity)
            shape = (pp, virtual, schedule, tp, ep, capacity)
            # Memory grows with the micro-batch (in-flight count x size does not shrink), except
            # that one micro-batch per step drops ZeRO-3's unsharded accumulation.
            if shape in full and req.global_seqs // (micro * dp) > 1:
                continue
            try:
                cfg = run_config(base, probe, req)
                dims = build_dims(cfg, req.world)
            except ValueError as e:
                errors.setdefault(probe.family, str(e))
                continue
            batch = [ctx.evaluate(cfg, dims, dataclasses.replace(probe, zero=z, recompute=r))
                     for z in range(4) for r in req.recompute]
            plans += batch
            if all(p.reason.startswith("out of memory") for p in batch):
                full.add(shape)
    plans.sort(key=lambda p: (not p.fits, p.time["step"] if p.fits else p.memory["total"]))
    return plans, _rejected(plans, errors)


class _Context:
    """Caches shared by every layout of one search: static bytes per (layout, pipeline rank),
    per-layer activation bytes, node spans per layout, the model's FLOPs per token."""

    def __init__(self, req: Request):
        self.req, self.model = req, req.base.model
        self.layer_cache: dict = {}
        self.shapes: dict = {}
        self.static = functools.lru_cache(maxsize=None)(self._static)
        self.links = functools.lru_cache(maxsize=None)(_links)
        self.groups = functools.lru_cache(maxsize=None)(self._groups)
        self.flops = model_flops_per_token(self.model, req.seq_len)

    def _static(self, dims, pp_rank: int, zero: int, r: int, virtual: int,
                compute: int = 0) -> dict:
        """rank_memory of the stage's first rank: `r` bytes per master, `compute` per bf16
        compute weight (0: none)."""
        if zero in (1, 2):          # the same element counts as ZeRO-0, sharded by formula
            out = dict(self.static(dims, pp_rank, 0, r, virtual, compute))
            dense, expert = out["dense_params"], out["expert_params"]
            shard = r * (dense / dims.dp + expert / dims.edp)
            out.update(grads=shard if zero == 2 else out["grads"], optimizer=2 * shard)
            return out
        if dims.tp not in self.shapes:
            self.shapes[dims.tp] = tensor_shapes(self.model, tp=dims.tp)
        return rank_memory(self.model, dims, pp_rank * dims.dp * dims.tp, zero, r, virtual,
                           shapes=self.shapes[dims.tp], compute_bytes=compute)

    def evaluate(self, cfg, dims, layout: Layout) -> Plan:
        req, model, gpu = self.req, cfg.model, self.req.gpu
        t = cfg.train
        num_micro = t.global_batch_size // (t.micro_batch_size * dims.dp)
        imbalance = (req.imbalance_by_ep or {}).get(dims.ep, req.imbalance)
        row_factor = rows_per_rank(dims.ep, model.top_k, layout.capacity_factor, imbalance)
        spec = ActSpec(layout.micro_batch, req.seq_len, dims.tp, dims.ep, t.dtype, layout.zero,
                       layout.recompute, row_factor, kernels="cuda")
        wire = {"": None, "float32": 4, "bfloat16": 2}[cfg.parallel.grad_reduce_dtype]
        overhead = gpu.overhead_gib * 2 ** 30
        budget = gpu.budget_bytes + overhead
        bubble = (dims.pp - 1) / (layout.virtual * num_micro + dims.pp - 1)
        memory, binding = None, 0
        for r, _, _ in self.groups(dims.pp, layout.virtual):
            footprint = rank_footprint(
                cfg, dims, r * dims.dp * dims.tp, spec, num_micro=num_micro,
                schedule=layout.schedule, virtual=layout.virtual, wire_bytes=wire,
                overhead_bytes=overhead, cache=self.layer_cache,
                static=self.static(dims, r, layout.zero, spec.p, layout.virtual,
                                   spec.a if spec.a < spec.p else 0))
            if memory is None or footprint["total"] > memory["total"]:
                memory, binding = footprint, r
            if memory["total"] > budget:
                return Plan(layout, num_micro, memory, binding, {"step": float("inf")}, 0.0, 0.0,
                            bubble, 0.0, False,
                            f"out of memory: {memory['total'] / 2 ** 30:.1f} GiB per GPU on pp "
                            f"rank {binding} > {budget / 2 ** 30:.1f} GiB")
        time = step_seconds(cfg, spec, gpu, self._stages(dims, layout, spec),
                            self.links(dims), num_micro, wire or spec.p)
        tokens = t.global_batch_size * req.seq_len
        step = time["step"]
        plan = Plan(layout, num_micro, memory, binding, time, tokens / step / req.world,
                    3 * self.flops * tokens / (step * req.world * gpu.tflops * 1e12),
                    bubble, time["a2a"] / step, True)
        if bubble > req.max_bubble:
            plan.fits = False
            plan.reason = f"bubble too large: {100 * bubble:.0f}% > {100 * req.max_bubble:.0f}%"
        return plan

    def _groups(self, pp: int, virtual: int) -> list[tuple[int, int, dict]]:
        """Pipeline ranks that hold the same kinds of layers: (first such rank, how many,
        {dense, moe, first, last}). Within a group the first rank keeps the most micro-batches
        in flight, so it stands for the group's memory."""
        groups: dict = {}
        for r in range(pp):
            layers, first, last = stage_layers(self.model.num_layers, pp, r, virtual)
            moe = sum(self.model.is_moe_layer(i) for i in layers)
            key = (len(layers) - moe, moe, first, last)
            if key not in groups:
                groups[key] = [r, 0]
            groups[key][1] += 1
        return [(r, n, {"dense": k[0], "moe": k[1], "first": k[2], "last": k[3]})
                for k, (r, n) in groups.items()]

    def _stages(self, dims, layout: Layout, spec) -> list[tuple[dict, int]]:
        """(stage, pipeline ranks it stands for) for steptime."""
        out = []
        for r, n, kinds in self.groups(dims.pp, layout.virtual):
            s = self.static(dims, r, layout.zero, spec.p, layout.virtual)
            stage = {**kinds, "virtual": layout.virtual, "dense_params": s["dense_params"],
                     "expert_params": s["expert_params"], "stepped": s["optimizer"] / (2 * spec.p)}
            out.append((stage, n))
        return out


def _links(dims) -> dict:
    """Which groups leave a node, from `ParallelDims.spans_nodes` (the trainer's rank order),
    and the group sizes. When a pipeline stage fills whole nodes every stage repeats the first
    one's node pattern, so the axes inside a stage are asked of that one stage (the world-wide
    scan is what costs time at thousands of ranks)."""
    node = dims.gpus_per_node or dims.world_size
    stage = dims.dp * dims.tp
    one = dims
    if dims.pp > 1 and stage % node == 0:
        one = ParallelDims(stage, 1, dims.dp, dims.tp, dims.ep, gpus_per_node=node)
    out = {axis: getattr(dims, axis) > 1 and one.spans_nodes(axis)
           for axis in ("tp", "ep", "dp", "edp")}
    out["pp"] = dims.pp > 1 and (stage % node == 0 or dims.spans_nodes("pp"))
    return {**out, "ep_inside": min(dims.ep, node) / dims.ep, "pp_size": dims.pp,
            "dp_size": dims.dp, "edp_size": dims.edp}


def _rejected(plans: list[Plan], errors: dict) -> dict:
    """{family: {kind, reason, value, closest}} for every (pp, tp, ep) without a fitting plan:
    'indivisible' (the validation error `moepar train` gives), or the reason of its least bad
    layout ('out of memory', value: GiB; 'bubble too large', value: the bubble)."""
    fitting = {p.layout.family for p in plans if p.fits}
    best = {}
    for p in plans:
        f = p.layout.family
        if f not in fitting and (f not in best or _badness(p) < _badness(best[f])):
            best[f] = p
    out = {f: {"kind": "indivisible", "reason": e, "value": None, "closest": None}
           for f, e in errors.items() if f not in fitting and f not in best}
    for f, p in best.items():
        oom = p.reason.startswith("out of memory")
        lo = p.layout
        out[f] = {"kind": "out of memory" if oom else "bubble too large", "reason": p.reason,
                  "value": p.memory["total"] / 2 ** 30 if oom else p.bubble,
                  "closest": f"{lo.describe()}, micro-batch {lo.micro_batch}, recompute "
                             f"{lo.recompute}"}
    return dict(sorted(out.items()))


def _badness(p: Plan):
    oom = p.reason.startswith("out of memory")
    return (oom, p.memory["total"] if oom else p.bubble)
