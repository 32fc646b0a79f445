"""This process's place in a run: its device, its process group (with timeouts), and its tie to
the launcher that started it. Below everything else in moepar: imports torch and nothing of
moepar, so the trainer, `moepar eval` and the benchmarks set a process up the same way.

| function                | when                                                                |
|-------------------------|---------------------------------------------------------------------|
| die_with_launcher       | first thing in a worker: dies with torch's elastic launcher (Linux) |
| select_device           | before any process group: train.device and the backend, checked    |
| init_process_group      | joins the launcher's world (a no-op at world size 1)                |
| end_process_group       | the end: waits for every rank after a clean run, then tears down    |
"""

import ctypes
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["LAUNCHER_ENV", "EXIT_FAILED", "die_with_launcher", "device_index", "select_device",
           "timeout_for_new_groups", "init_process_group", "end_process_group"]

LAUNCHER_ENV = "MOEPAR_RUN_LOCK_PID"     # set by `moepar train --nproc`: the launcher holds it
EXIT_FAILED = 1                          # `moepar train`'s exit code for a failed worker


def die_with_launcher(env=None) -> bool:
    """In a worker of torch's elastic launcher (Linux): the kernel sends SIGKILL when the launcher
    dies, whatever kills it, so no worker trains on as an orphan (the launcher starts workers in
    their own sessions, so nothing else would reach them). If `moepar train --nproc`'s launcher
    is already gone (it died before this ran), exit now. Returns whether it applied. (The signal
    follows the thread that started the worker; torch's launcher starts them from its main
    thread, which lives as long as the launcher.)"""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env or not sys.platform.startswith("linux"):
        return False
    PR_SET_PDEATHSIG = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    expected = env.get(LAUNCHER_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        print("moepar: the launcher that started this worker is gone; exiting", file=sys.stderr)
        os._exit(EXIT_FAILED)
    return True


def device_index(env, cuda_count: int) -> int:
    """The CUDA device of this process (pure): LOCAL_RANK when the launcher sets it (torchrun),
    else RANK modulo the devices on this node (launchers such as SLURM's srun set only RANK and
    WORLD_SIZE; every rank taking cuda:0 would make NCCL fail with "Duplicate GPU detected")."""
    if "LOCAL_RANK" in env:
        index = int(env["LOCAL_RANK"])
        if index >= cuda_count:
            raise ValueError(f"LOCAL_RANK={index} but this node has {cuda_count} CUDA device(s): "
                             "start at most that many processes per node")
        return index
    return int(env.get("RANK", 0)) % cuda_count


def select_device(want: str, backend: str = "auto", env=None, cuda_count: int | None = None):
    """The device for train.device (auto, cpu, cuda) on this process; refuses a backend that
    cannot carry that device's tensors (before any process group exists)."""
    env = os.environ if env is None else env
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if want == "cpu" or (want == "auto" and cuda_count == 0):
        device = torch.device("cpu")
    elif cuda_count == 0:
        raise ValueError("train.device='cuda' but CUDA is not available")
    else:
        device = torch.device("cuda", device_index(env, cuda_count))
    if backend == "gloo" and device.type == "cuda":
        raise ValueError(f"parallel.backend='gloo' with train.device={want!r} on a CUDA host "
                         f"(device {device}): gloo's all-to-all carries CPU tensors only; use "
                         "parallel.backend='nccl' (or auto), or train.device='cpu'")
    if backend == "nccl" and device.type == "cpu":
        raise ValueError(f"parallel.backend='nccl' with train.device={want!r} resolving to the "
                         "CPU: NCCL needs CUDA tensors; use parallel.backend='gloo' (or auto)")
    return device


def timeout_for_new_groups(seconds: float):
    """Makes `seconds` the timeout of every process group created from now on in this process.

    DeviceMesh creates its per-axis groups (new_group / split_group) without a timeout, so torch
    gives them its backend default (30 min for gloo, 10 min for NCCL) instead of the world's:
    `parallel.timeout_s` would reach only the world group, and a rank that stopped answering
    would hold its dp, ep or tp peers far longer. torch has no public setting for that default;
    these two module attributes are what `new_group` reads (torch 2.13,
    distributed_c10d._get_default_timeout), the one private touch in this file."""
    timeout = datetime.timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def init_process_group(parallel, device, world_size: int):
    """Sets this process's CUDA device (always, also when a process group exists) and joins the
    launcher's world when there is more than one rank, with `parallel.timeout_s` for every
    collective (the world's and every group made after it) and `device_id` so NCCL barriers
    and object collectives use the right GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        return
    timeout_for_new_groups(parallel.timeout_s)
    if dist.is_initialized():
        return
    backend = parallel.backend if parallel.backend != "auto" else (
        "nccl" if device.type == "cuda" else "gloo")
    kwargs = {"timeout": datetime.timedelta(seconds=parallel.timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, **kwargs)


def end_process_group(clean: bool = True):
    """Destroys the process group; after a clean run, only once every rank got here (a rank
    tearing its communicators down while a peer still talks aborts that peer)."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
