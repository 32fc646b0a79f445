"""The engine on a GPU (`pytest -m cuda`; skipped without one): a training step equals the CPU
step, the pieces run in the autocast dtypes they should, a launcher that sets only RANK and
WORLD_SIZE finds its GPU, checkpoints hold one box at a time in GPU memory, pipeline timings come
from CUDA events; with two or more GPUs, pipelines and ZeRO on NCCL."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from configs import tiny_config
from moepar.train import Trainer
from net import free_port

pytestmark = pytest.mark.cuda
ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.toml")


def quiet(_msg):
    pass


def two_gpus():
    return pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")


def run_steps(tmp_path, name, *overrides):
    trainer = Trainer(tiny_config(tmp_path / name, "--train.steps=2", *overrides), log=quiet)
    return trainer, trainer.run()


@pytest.mark.parametrize("dtype, rel", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_training_steps_on_cuda_equal_the_cpu_steps(tmp_path, dtype, rel):
    """Initial values are drawn on the host, so both devices start from the same weights."""
    _, cpu = run_steps(tmp_path, "cpu", "--train.device=cpu", "--router.capacity_factor=none")
    _, gpu = run_steps(tmp_path, "gpu", "--train.device=cuda", f"--train.dtype={dtype}",
                       "--router.capacity_factor=none")
    for a, b in zip(cpu, gpu, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=rel), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=5 * rel), (a, b)


@pytest.mark.parametrize("fp32_residual", [False, True])
def test_dtype_of_each_piece(tmp_path, fp32_residual):
    """bfloat16 training: attention and experts compute in bf16, router scores in float32; the
    residual stream (a block's output) is bf16, or float32 with train.fp32_residual."""
    trainer = Trainer(tiny_config(tmp_path, "--train.device=cuda", "--train.dtype=bfloat16",
                                  f"--train.fp32_residual={str(fp32_residual).lower()}"),
                      log=quiet)
    seen = {}

    def hook(name):
        def record(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(out):
                seen.setdefault(name, out.dtype)
        return record

    block = next(b for b in trainer.model.layers if b.is_moe)
    block.attn.register_forward_hook(hook("attention"))
    block.ffn.experts.register_forward_hook(hook("experts"))
    block.register_forward_hook(hook("block"))
    real_logits = type(block.ffn.router).logits

    def logits(router, x):
        out = real_logits(router, x)
        seen.setdefault("router", out.dtype)
        return out

    type(block.ffn.router).logits = logits
    try:
        record = trainer.train_step()
    finally:
        type(block.ffn.router).logits = real_logits
    block_dtype = torch.float32 if fp32_residual else torch.bfloat16
    assert seen == {"attention": torch.bfloat16, "experts": torch.bfloat16,
                    "router": torch.float32, "block": block_dtype}, seen
    assert math.isfinite(record["loss"])


def test_launch_with_only_rank_and_world_size(tmp_path):
    """SLURM-style launch: RANK and WORLD_SIZE, no LOCAL_RANK: the rank finds cuda:RANK%GPUs."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run([sys.executable, "-m", "moepar", "train", TINY, "--train.steps=1",
                             "--train.device=cuda", f"--run.dir={tmp_path}"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "device cuda:0" in result.stdout


def test_checkpoint_holds_one_box_at_a_time_in_gpu_memory(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "--train.device=cuda", "--model.dim=256",
                                  "--model.moe_ffn_dim=1024", "--model.num_experts=16",
                                  "--train.steps=1"), log=quiet)
    trainer.train_step()
    engine = trainer.engine
    largest = max(seg.canon.numel * lt.tensor.element_size()
                  for lt in engine.model_shards() for seg in lt.segments)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    path = trainer.save()
    assert torch.cuda.max_memory_allocated() - before <= largest + (1 << 20)
    shard = sum(lt.tensor.numel() * lt.tensor.element_size() for lt in engine.model_shards())
    del trainer, engine
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    Trainer(tiny_config(tmp_path / "b", "--train.device=cuda", "--model.dim=256",
                        "--model.moe_ffn_dim=1024", "--model.num_experts=16",
                        f"--run.resume_from={path}"), log=quiet)
    # parameters + AdamW moments, and what a box read needs on the device (one box at a time)
    assert torch.cuda.max_memory_allocated() - before <= 3 * shard + largest + (8 << 20)


def _torchrun(tmp_path, nproc, *overrides):
    result = subprocess.run([sys.executable, "-m", "moepar", "train", TINY, "--nproc", str(nproc),
                             "--train.steps=3", "--run.log_every=1", f"--run.dir={tmp_path}",
                             "--train.device=cuda", "--parallel.timeout_s=120", *overrides],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@two_gpus()
def test_pipeline_on_nccl_with_a_short_timeout(tmp_path):
    one = _torchrun(tmp_path / "one", 1)
    two = _torchrun(tmp_path / "pp", 2, "--parallel.pp=2")
    for a, b in zip(one, two, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4)


@two_gpus()
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_bfloat16_pipeline_on_nccl(tmp_path, recompute):
    """pp 2 in bf16 (rank 0 has two micro-batches in flight, computing with the step's bf16
    weights), with and without full recompute on CUDA's autograd threads: the losses of one GPU,
    to bf16 precision."""
    args = ["--train.dtype=bfloat16", f"--train.recompute={recompute}"]
    one = _torchrun(tmp_path / "one", 1, *args)
    two = _torchrun(tmp_path / "pp", 2, "--parallel.pp=2", *args)
    for a, b in zip(one, two, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-2)


@two_gpus()
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_in_bfloat16_on_nccl_against_zero0(tmp_path, zero):
    base = _torchrun(tmp_path / "z0", 2, "--parallel.ep=2", "--train.dtype=bfloat16")
    other = _torchrun(tmp_path / f"z{zero}", 2, "--parallel.ep=2", "--train.dtype=bfloat16",
                      f"--parallel.zero={zero}")
    for a, b in zip(base, other, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-2)


def test_pipeline_action_times_come_from_cuda_events():
    from moepar.parallel.pipeline_runner import _Clock
    clock = _Clock(torch.device("cuda"))
    clock.begin()
    a = clock.now()
    torch.cuda._sleep(1_000_000)
    b = clock.now()
    assert isinstance(a, torch.cuda.Event)
    assert clock.seconds(b) > clock.seconds(a) >= clock.start
