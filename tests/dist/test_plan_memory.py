"""`moepar plan`'s memory estimate against a measured training step: on ten layouts of a small
model (pp, tp, ep, ZeRO 0-3, recompute, schedules, bfloat16, capacity routing, MLA), every rank's
parameters, gradients and AdamW state equal the estimate exactly, and the estimated peak is
within 10% of the measured one (the activations, buffers and backward transients alone within
20%).

Measured peak = the bytes alive when the step starts (parameters, optimizer state, persistent
gradient buffers, by storage) + the most bytes of tensors created during the step that are alive
at once: every tensor the step allocates (saved activations, weight casts, gradients, flat
reduction buffers, all-to-all and pipeline buffers, backward temporaries), through a
TorchDispatchMode that sees each op's outputs and frees them with their storage. The forward,
backward and gradient sync are measured; the optimizer step is not (its CPU foreach temporaries
are not what runs on a GPU, where AdamW is fused).

Why a private torch API: `TorchDispatchMode` lives in `torch.utils._python_dispatch` (the
documented way to intercept every op; torch has no public allocation statistics for CPU
tensors). It is used here only, to measure.
"""

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from configs import tiny_config
from moepar.bench.memory import _storage_bytes
from moepar.metrics import StepStats
from moepar.plan.activations import ActSpec, rows_per_rank
from moepar.plan.footprint import ITEMS, rank_footprint
from moepar.plan.memory import bucket_sizes
from moepar.build import build_dims
from moepar.train import Trainer


def _storage(t):
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created under the mode and alive at once. Storages that existed
    before (`known`) are not counted; others that ops read but that were made elsewhere (FSDP2
    re-allocates its gathered parameters with a storage resize, which is no op) are counted at
    their current size at every op."""

    def __init__(self, known):
        super().__init__()
        self.known = {id(_storage(t)) for t in known if t is not None}
        self.live, self.foreign = {}, {}
        self.total = self.peak = 0

    def _free(self, key):
        self.total -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                key = id(_storage(t))
                if key not in self.live and key not in self.known and key not in self.foreign:
                    self.foreign[key] = weakref.ref(_storage(t))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = _storage(t)
                key = id(storage)
                if key not in self.live and key not in self.known and key not in self.foreign:
                    self.live[key] = storage.nbytes()
                    self.total += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        foreign = sum(s().nbytes() for s in self.foreign.values() if s() is not None)
        self.peak = max(self.peak, self.total + foreign)
        return out


def _held(trainer) -> list:
    """Every tensor alive between steps: parameters (and their float32 masters under bf16),
    gradients, buffers, optimizer state, ZeRO-1/2 flat buffers."""
    out = []
    for p in trainer.model.parameters():
        master = trainer.engine.masters.master(p)
        out += [p, p.grad] + ([master, master.grad] if master is not p else [])
    out += list(trainer.model.buffers())
    inner = getattr(trainer.optimizer, "inner", trainer.optimizer)
    out += [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    for b in getattr(trainer.sync, "buckets", []):
        out += [getattr(b, name, None) for name in ("flat", "flat_grad")]
        if hasattr(b, "shard"):
            out += [b.shard, b.shard.grad]
    return out


def case_measure(run_dir: str, overrides: list[str]):
    trainer = Trainer(tiny_config(run_dir, *overrides), log=lambda _m: None)
    trainer.train_step()                   # creates the optimizer state
    trainer.engine.zero_grad()
    held = _held(trainer)
    # The peak of two steps: when the asynchronous reductions release their buffers varies a
    # little from run to run (seen: up to 10% on one rank), and the estimate is the worst case.
    peak = 0
    for _ in range(2):
        tracker = LiveBytes(held)
        stats = StepStats(len(trainer.engine.moe_layer_ids), trainer.cfg.model.num_experts,
                          trainer.device)
        gc.collect()
        gc.disable()      # frees by reference counts only
        try:
            with tracker:
                loss_sum = trainer.forward_backward(stats)
                trainer.engine.finish_step(stats, loss_sum)
        finally:
            gc.enable()
        peak = max(peak, tracker.peak)
        if _ == 0:
            trainer.engine.zero_grad()
    # the gradients as the optimizer step sees them (bench/memory.py's counting)
    params = list(trainer.model.parameters())
    masters = trainer.engine.masters.masters(params)
    inner = getattr(trainer.optimizer, "inner", trainer.optimizer)
    grads = [p.grad for p in params + masters] + [p.grad for g in inner.param_groups
                                                  for p in g["params"]]
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    static = {"params": _storage_bytes(params + masters), "grads": _storage_bytes(grads),
              "optimizer": _storage_bytes(state)}
    held_bytes = sum({id(_storage(t)): _storage(t).nbytes() for t in held if t is not None}.values())
    trainer.engine.zero_grad()
    # Flat gradient buffers align every tensor to 16 elements and pad each bucket's shards to
    # 16-element multiples (parallel/ddp.py): at most 15 elements per tensor and 16 per shard.
    buckets = getattr(trainer.sync, "buckets", [])
    slack = 16 * (len(params) + sum(getattr(b, "size", 1) for b in buckets)) * 4
    return {"rank": trainer.rank, "static": static, "peak": held_bytes + peak,
            "tokens_LE": stats.tokens_LE.tolist(), "alignment_slack": slack}


def rank_load(tokens_LE: list, ep: int, ep_rank: int) -> tuple[float, float]:
    """The step's own load on one EP rank: the routed tokens its experts received over the mean
    per EP rank, averaged over the MoE layers (what its dispatch buffers hold, summed over the
    layers of one micro-batch) and in the busiest layer (what one layer's backward holds)."""
    ratios = []
    for row in tokens_LE:
        size = len(row) // ep          # EP rank k holds experts [k*size, (k+1)*size)
        total = sum(row)
        if total:
            ratios.append(sum(row[ep_rank * size:(ep_rank + 1) * size]) * ep / total)
    return (sum(ratios) / len(ratios), max(ratios)) if ratios else (1.0, 1.0)


def estimate(cfg, world: int, rank: int, load: tuple[float, float]) -> dict:
    dims = build_dims(cfg, world)
    p, t = cfg.parallel, cfg.train
    rows = [rows_per_rank(dims.ep, cfg.model.top_k, cfg.router.capacity_factor, f) for f in load]
    spec = ActSpec(t.micro_batch_size, t.seq_len, dims.tp, dims.ep, t.dtype, p.zero,
                   t.recompute, rows[0], rows[1],
                   kernels="cpu")
    return rank_footprint(cfg, dims, rank, spec,
                          num_micro=t.global_batch_size // (t.micro_batch_size * dims.dp),
                          schedule=p.pp_schedule, virtual=p.pp_virtual)


BASE = ["--model.dim=64", "--model.num_layers=4", "--model.vocab_size=512",
        "--model.max_seq_len=64", "--train.seq_len=64", "--model.ffn_dim=128",
        "--model.moe_ffn_dim=96", "--model.first_k_dense=1", "--train.micro_batch_size=2"]
MLA = ["--model.attention=mla", "--model.q_lora_rank=32", "--model.kv_lora_rank=24",
       "--model.qk_nope_head_dim=16", "--model.qk_rope_head_dim=8", "--model.v_head_dim=16",
       "--model.num_kv_heads=4"]

LAYOUTS = {
    "pp2-1f1b": (2, ["--parallel.pp=2"]),
    "pp2-interleaved-recompute": (2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                      "--parallel.pp_virtual=2",
                                      "--train.activation_checkpointing=true"]),
    "tp2-ep2-zero1": (2, ["--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1"]),
    "ep2-zero2-bf16-capacity": (2, ["--parallel.ep=2", "--parallel.zero=2",
                                    "--train.dtype=bfloat16", "--router.capacity_factor=1.25"]),
    "ep2-zero3-recompute": (2, ["--parallel.ep=2", "--parallel.zero=3",
                                "--train.activation_checkpointing=true"]),
    # Expert weights heavy against activations: each layer's experts must be resharded within
    # backward (held to its end, as before 2026-12-01, the part above the static state measured
    # 1.4-1.5x the estimate: dyn 0.65-0.72).
    "ep2-zero3-experts-heavy": (2, ["--parallel.ep=2", "--parallel.zero=3",
                                    "--model.num_experts=32", "--model.moe_ffn_dim=512"]),
    "tp2-zero3-bf16": (2, ["--parallel.tp=2", "--parallel.zero=3", "--train.dtype=bfloat16"]),
    "tp2-mla": (2, ["--parallel.tp=2", *MLA]),
    "pp2-tp2-ep2-zero1": (4, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.ep=2",
                              "--parallel.zero=1"]),
    "ep4-zero2-recompute": (4, ["--parallel.ep=4", "--parallel.zero=2",
                                "--train.recompute=full"]),
    "pp2-ep2-bf16": (4, ["--parallel.pp=2", "--parallel.ep=2", "--train.dtype=bfloat16"]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_estimated_peak_memory_per_rank_is_within_10_percent(worlds, tmp_path, name):
    world, extra = LAYOUTS[name]
    # two micro-batches per data-parallel rank: gradients exist while activations do
    overrides = [*BASE, f"--train.global_batch_size={2 * 2 * world}", *extra]
    results = worlds(world).run(case_measure, str(tmp_path), overrides, timeout=120)
    cfg = tiny_config(str(tmp_path), *overrides)
    dims = build_dims(cfg, world)
    for got in results:
        load = rank_load(got["tokens_LE"], dims.ep, dims.coords(got["rank"]).ep)
        want = estimate(cfg, world, got["rank"], load)
        assert got["static"]["params"] == want["params"], (name, got["rank"], got, want)
        for part in ("grads", "optimizer"):   # exact but for the flat buffers' alignment
            assert 0 <= got["static"][part] - want[part] <= got["alignment_slack"], \
                (name, got["rank"], part, got, want)
        static = sum(want[k] for k in ("params", "grads", "optimizer"))
        assert want["total"] == pytest.approx(sum(want[k] for k in ITEMS))
        ratio = want["total"] / got["peak"]
        dynamic = (want["total"] - static) / (got["peak"] - static)
        assert 0.90 <= ratio <= 1.10, (name, got["rank"], ratio, dynamic, want, got["peak"])
        assert abs(dynamic - 1) <= 0.20, (name, got["rank"], dynamic)
        # the layouts are chosen so that activations matter: at least a quarter of the peak
        # (a sixth where the expert weights are the point: measured 21-23%)
        least = 0.15 if name == "ep2-zero3-experts-heavy" else 0.25
        assert got["peak"] - static > least * got["peak"], (name, got["peak"], static)


def case_buckets(run_dir: str, overrides: list[str]):
    trainer = Trainer(tiny_config(run_dir, *overrides), log=lambda _m: None)
    return trainer.rank, [sum(p.numel() for p in b.params) for b in trainer.sync.buckets]


@pytest.mark.parametrize("extra", [["--parallel.ep=2"], ["--parallel.pp=2", "--parallel.dp=1"],
                                   ["--parallel.tp=2", "--parallel.dp=1", *MLA],
                                   ["--model.attention_bias=true", "--model.qk_norm=head",
                                    "--model.num_shared_experts=1", "--model.shared_gate=true"]])
def test_planned_gradient_buckets_are_the_reducers(worlds, tmp_path, extra):
    """ZeRO-2's flat copies in flight are a window of buckets (parallel/zero.py); the planner
    forms the buckets from shapes alone, and they are the reducer's, element for element."""
    overrides = [*BASE, "--parallel.zero=2", "--parallel.bucket_mb=0.02", *extra]
    cfg = tiny_config(str(tmp_path), *overrides)
    dims = build_dims(cfg, 2)
    for rank, real in worlds(2).run(case_buckets, str(tmp_path), overrides, timeout=120):
        planned = bucket_sizes(cfg.model, dims, rank, 0.02 * 2 ** 20)
        assert len(real) > 4 and planned == real, (rank, planned, real)
