"""ZeRO stages: memory per rank as the formula says, accumulation equal to one big batch, the
reduce-scatter schedule of stages 1 and 2, and reduced-precision gradients on the wire."""

import math

import pytest
import torch
import torch.distributed as dist

from configs import tiny_config
from moepar.bench.memory import formula, measure
from moepar.data import WindowSampler
from moepar.metrics import StepStats
from moepar.parallel import comm
from moepar.train import Trainer


def quiet(_msg):
    pass


def case_memory(run_dir: str, zero: int, overrides: list[str]):
    trainer = Trainer(tiny_config(f"{run_dir}/z{zero}", f"--parallel.zero={zero}", *overrides),
                      log=quiet)
    trainer.train_step()
    buckets = getattr(trainer.sync, "buckets", [])
    # flat buffers align each parameter to 16 elements and pad each bucket to 16 * its group
    slack = 16 * (len(list(trainer.model.parameters())) + sum(b.size for b in buckets
                                                              if hasattr(b, "size")))
    return measure(trainer), formula(trainer), 4 * slack


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_per_rank_matches_the_formula(worlds, tmp_path, zero):
    # dp=4, ep=2: dense state over 4 ranks, expert state over edp=2. 8 experts so that the
    # expert stacks are big enough for padding to be noise.
    overrides = ["--parallel.dp=4", "--parallel.ep=2", "--model.num_experts=8",
                 "--train.global_batch_size=8"]
    results = worlds(4).run(case_memory, str(tmp_path), zero, overrides, timeout=120)
    for measured, want, _ in results:
        for part in ("params", "grads", "optimizer"):
            assert math.isclose(measured[part], want[part], rel_tol=0.05), (zero, part, measured, want)
    # Independently of the formula: what is sharded is under half its replicated size (N >= 2);
    # what is not is the whole, up to the flat buffers' alignment padding.
    measured, want, slack = results[0]
    replicated = 4 * (want["dense_params"] + want["expert_params_per_rank"])   # float32
    sharded = {0: [], 1: ["optimizer"], 2: ["optimizer", "grads"],
               3: ["optimizer", "grads", "params"]}[zero]
    for part, per_element in (("params", 1), ("grads", 1), ("optimizer", 2)):
        full = per_element * replicated
        if part in sharded:
            assert measured[part] < 0.5 * full, part
        else:
            assert full <= measured[part] <= full + slack, (part, measured[part], full, slack)


def case_steps(run_dir: str, overrides: list[str]):
    records = Trainer(tiny_config(run_dir, *overrides), log=quiet).run()
    dist.barrier()
    return [(r["loss"], r["grad_norm"]) for r in records]


# Dropless and no batch-level balance loss: then 4 micro-batches of 2 are one batch of 8.
LINEAR = ["--train.dtype=float64", "--train.steps=2", "--router.balance_coeff=0",
          "--router.z_coeff=0.001", "--model.num_experts=8", "--train.global_batch_size=16"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_accumulating_four_micro_batches_equals_one_big_batch(worlds, tmp_path, zero):
    big = Trainer(tiny_config(tmp_path / "big", *LINEAR, "--train.micro_batch_size=16"), log=quiet)
    # The big batch of step i holds exactly the 8 micro-batches of 2 that step i accumulates.
    small = WindowSampler(big.sampler.tokens, big.sampler.seq_len, 2, big.sampler.seed,
                          big.sampler.vocab_size)
    big.sampler.batch = lambda i: tuple(torch.cat(parts) for parts in zip(
        *(small.batch(8 * i + j) for j in range(8))))
    want = [(r["loss"], r["grad_norm"]) for r in big.run()]
    # dp=2, ep=2: each rank runs 4 micro-batches of 2 sequences per step.
    overrides = [*LINEAR, "--train.micro_batch_size=2", "--parallel.ep=2",
                 f"--parallel.zero={zero}", "--parallel.bucket_mb=0.002"]
    results = worlds(2).run(case_steps, str(tmp_path / "acc"), overrides, timeout=120)
    for rank_records in results:
        for got, ref in zip(rank_records, want):
            for g, w in zip(got, ref):
                assert math.isclose(g, w, rel_tol=1e-9), (zero, got, ref)


def case_reduce_schedule(run_dir: str, zero: int, wire: str):
    cfg = tiny_config(run_dir, "--parallel.ep=2", f"--parallel.zero={zero}",
                      "--parallel.bucket_mb=0.002", "--train.global_batch_size=8",
                      f"--parallel.grad_reduce_dtype={wire}")
    trainer = Trainer(cfg, log=quiet)
    per_micro, real = [], comm.reduce_scatter_single

    def spy(output, input, *args, **kwargs):
        per_micro[-1].append(str(input.dtype))
        return real(output, input, *args, **kwargs)

    stats = StepStats(len(trainer.model.moe_layers()), 4)
    comm.reduce_scatter_single = spy
    try:
        for i in range(trainer.num_local_micro):
            per_micro.append([])
            trainer._micro_batch(*trainer.sampler.batch(trainer.first_micro + i), stats,
                                 last=i == trainer.num_local_micro - 1)
    finally:
        comm.reduce_scatter_single = real
    return per_micro, len(trainer.sync.buckets)


@pytest.mark.parametrize("zero", [1, 2])
def test_stage_1_reduces_on_the_last_micro_batch_stage_2_on_every_one(worlds, tmp_path, zero):
    results = worlds(2).run(case_reduce_schedule, str(tmp_path), zero, "", timeout=120)
    per_micro, buckets = results[0]
    assert len(per_micro) == 2 and buckets > 4
    if zero == 1:
        assert [len(m) for m in per_micro] == [0, buckets]
    else:
        assert [len(m) for m in per_micro] == [buckets, buckets]
    assert results[0] == results[1]


def case_stage2_in_flight(run_dir: str, in_flight: int):
    """One ZeRO-2 micro-batch with `in_flight` as the window: the largest total of full-size
    flat gradient copies alive after each launch, the bucket count, and the shard gradients."""
    from moepar.parallel.zero import ZeroReducer
    trainer = Trainer(tiny_config(run_dir, "--parallel.zero=2", "--parallel.bucket_mb=0.002"),
                      log=quiet)
    sync, real = trainer.sync, ZeroReducer._launch
    peak = [0]

    def spy(self, b):
        real(self, b)
        live = sum(x.wire.numel() * x.wire.element_size() for x in self.buckets
                   if x.wire is not None)
        peak[0] = max(peak[0], live)

    ZeroReducer._launch, ZeroReducer.IN_FLIGHT = spy, in_flight
    try:
        stats = StepStats(len(trainer.model.moe_layers()), 4)
        trainer._micro_batch(*trainer.sampler.batch(trainer.first_micro), stats, last=True)
    finally:
        ZeroReducer._launch, ZeroReducer.IN_FLIGHT = real, 2
    largest = max(b.flat.numel() * b.flat.element_size() for b in sync.buckets)
    return peak[0], largest, len(sync.buckets), [b.shard.grad.clone() for b in sync.buckets]


def test_stage_2_keeps_two_full_size_gradient_buckets_in_flight(worlds, tmp_path):
    """The point of ZeRO-2 is 1/N gradient memory: its flat copies on the wire are settled two
    buckets behind, not held until backward ends (which made its peak ZeRO-1's); same sums."""
    bounded = worlds(2).run(case_stage2_in_flight, str(tmp_path / "a"), 2, timeout=120)[0]
    held = worlds(2).run(case_stage2_in_flight, str(tmp_path / "b"), 10 ** 6, timeout=120)[0]
    peak, largest, buckets, grads = bounded
    assert buckets > 6
    assert peak <= 2 * largest
    assert held[0] > 4 * largest          # all of them: what the window prevents
    assert all(torch.equal(a, b) for a, b in zip(grads, held[3], strict=True))


def test_bfloat16_wire_dtype(worlds, tmp_path):
    (per_micro, _), _ = worlds(2).run(case_reduce_schedule, str(tmp_path), 2, "bfloat16",
                                      timeout=120)
    assert {d for m in per_micro for d in m} == {"torch.bfloat16"}


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_bfloat16_gradient_reduction_stays_close_to_float32(worlds, tmp_path, zero):
    base = ["--parallel.ep=2", f"--parallel.zero={zero}", "--train.steps=3",
            "--train.global_batch_size=8"]
    exact = worlds(2).run(case_steps, str(tmp_path / "f32"), base, timeout=120)[0]
    wire = worlds(2).run(case_steps, str(tmp_path / "bf16"),
                         [*base, "--parallel.grad_reduce_dtype=bfloat16"], timeout=120)[0]
    for (loss, gnorm), (w_loss, w_gnorm) in zip(wire, exact):
        assert math.isclose(loss, w_loss, rel_tol=1e-3), (wire, exact)
        assert math.isclose(gnorm, w_gnorm, rel_tol=2e-2), (wire, exact)
    assert wire != exact, "bfloat16 on the wire should round something"


def case_zero3_bfloat16(run_dir: str, *extra: str):
    trainer = Trainer(tiny_config(run_dir, "--parallel.ep=2", "--parallel.zero=3",
                                  "--train.dtype=bfloat16", "--train.steps=3", *extra), log=quiet)
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, module.weight.dtype)
        return hook

    block = trainer.model.layers[1]
    block.attn.qkv_proj.register_forward_pre_hook(record("attention"))
    block.ffn.router.register_forward_pre_hook(record("router"))
    trainer.model.embed.register_forward_pre_hook(record("embedding"))
    records = trainer.run()
    dist.barrier()
    return {k: str(v) for k, v in seen.items()}, [r["loss"] for r in records]


@pytest.mark.skipif(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 12),
                    reason="ZeRO-3 with bfloat16 needs torch >= 2.12 (refused below)")
@pytest.mark.parametrize("fp32_residual", [False, True])
def test_zero3_bfloat16_gathers_bf16_weights_but_keeps_the_router_float32(worlds, tmp_path,
                                                                          fp32_residual):
    """Blocks compute from bf16 gathers (half the bytes, nothing full-size saved in float32);
    the router maths stays float32; the embedding (and so the residual stream) is bf16 unless
    train.fp32_residual keeps it float32; losses match one bf16 process."""
    extra = ["--train.fp32_residual=true"] if fp32_residual else []
    single = Trainer(tiny_config(tmp_path / "one", "--train.dtype=bfloat16", "--train.steps=3",
                                 *extra), log=quiet)
    want = [r["loss"] for r in single.run()]
    dtypes, losses = worlds(2).run(case_zero3_bfloat16, str(tmp_path / "z3"), *extra,
                                   timeout=120)[0]
    embedding = "torch.float32" if fp32_residual else "torch.bfloat16"
    assert dtypes == {"attention": "torch.bfloat16", "router": "torch.float32",
                      "embedding": embedding}
    for got, ref in zip(losses, want):
        assert math.isclose(got, ref, rel_tol=2e-3), (losses, want)


def case_bf16_moments(run_dir: str, zero: int):
    """Float32 and bf16 moments side by side, then the bf16 run resumed from step 2."""
    base = ["--parallel.ep=2", f"--parallel.zero={zero}", "--parallel.bucket_mb=0.002",
            "--train.steps=3", "--run.checkpoint_every=2", "--run.keep_checkpoints=0"]
    out = {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(tiny_config(f"{run_dir}/{dtype}", *base,
                                      f"--train.optim_state_dtype={dtype}"), log=quiet)
        records = trainer.run()
        moments, _ = trainer.engine.optimizer_shards()
        out[dtype] = {"records": [(r["loss"], r["grad_norm"]) for r in records],
                      "dtypes": {m.tensor.dtype for m in moments},
                      "bytes": measure(trainer)["optimizer"],
                      "masters": [t.tensor.clone() for t in trainer.engine.model_shards()]}
    resumed = Trainer(tiny_config(f"{run_dir}/resumed", *base, "--train.optim_state_dtype=bfloat16",
                                  f"--run.resume_from={run_dir}/bfloat16/checkpoints/step_2"),
                      log=quiet)
    record = resumed.train_step()
    out["resumed"] = (record["loss"], record["grad_norm"])
    out["resumed_equal"] = all(torch.equal(a, b.tensor) for a, b in zip(
        out["bfloat16"]["masters"], resumed.engine.model_shards(), strict=True))
    for dtype in ("float32", "bfloat16"):
        del out[dtype]["masters"]
    dist.barrier()
    return out


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_moments_halve_the_state_and_resume_bit_exactly(worlds, tmp_path, zero):
    """train.optim_state_dtype = "bfloat16" on ZeRO's flat shards (1, 2) and FSDP2 DTensors (3):
    the moments are bf16, the state's bytes exactly half, training follows the float32-moment
    run closely, and a resume from step 2 repeats step 3 bit for bit."""
    for out in worlds(2).run(case_bf16_moments, str(tmp_path), zero, timeout=180):
        wide, narrow = out["float32"], out["bfloat16"]
        assert wide["dtypes"] == {torch.float32} and narrow["dtypes"] == {torch.bfloat16}
        assert narrow["bytes"] * 2 == wide["bytes"]
        assert narrow["records"][0] == wide["records"][0]       # before any update
        for (a, _), (b, _) in zip(narrow["records"], wide["records"], strict=True):
            assert math.isclose(a, b, rel_tol=1e-3)
        assert out["resumed"] == narrow["records"][2] and out["resumed_equal"]
