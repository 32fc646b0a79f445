"""Whether a run or a model load fits in this machine's memory, checked from closed-form sizes
before anything is allocated (and, for a run, before any process group exists).

The estimate is a lower bound: parameters, gradients and AdamW state per rank
(moepar/plan/memory.py's rank_memory, exact for every layout and ZeRO stage), or the
parameters alone for inference; activations and buffers come on top. So a refusal is never
wrong: what is refused could not have started. What is available: MemAvailable of
/proc/meminfo (else os.sysconf's available pages) on the host, torch.cuda.mem_get_info's free
bytes on a GPU.
"""

import os

import torch

from moepar.build import COMPUTE_DTYPES, PARAM_DTYPES, build_dims
from moepar.plan.memory import moment_bytes, rank_memory

__all__ = ["available_bytes", "check_fits", "check_run_fits", "GIB"]

GIB = 2 ** 30


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


def available_bytes(device) -> int:
    """Bytes `device` can still give (a torch.device or its name); 0 when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return torch.cuda.mem_get_info(device)[0]
        except (RuntimeError, AssertionError):
            return 0
    return _host_available()


def check_fits(need: int, device, what: str, have: int | None = None):
    """ValueError saying `what` needs `need` bytes and `device` has fewer available."""
    have = available_bytes(device) if have is None else have
    if have and need > have:
        raise ValueError(f"{what} needs at least {need / GIB:,.1f} GiB (the estimate, before "
                         f"activations), and {device} has {have / GIB:,.1f} GiB available; "
                         "choose a smaller model, more ranks (parallel.ep, parallel.tp, "
                         "parallel.pp) or parallel.zero (`moepar plan` helps)")


def _rank_bytes(cfg, dims, rank: int) -> int:
    p, dtype = cfg.parallel, cfg.train.dtype
    compute = COMPUTE_DTYPES[dtype].itemsize if dtype in COMPUTE_DTYPES else 0
    m = rank_memory(cfg.model, dims, rank, p.zero, PARAM_DTYPES[dtype].itemsize,
                    p.pp_virtual, p.pp_layers or None, compute_bytes=compute,
                    moment_bytes=moment_bytes(cfg.train))
    return int(m["params"] + m["compute_weights"] + m["grads"] + m["optimizer"])


def check_run_fits(cfg, world_size: int, ranks: list[int], device):
    """Refuses (ValueError) a run whose ranks on this machine, `ranks` of `world_size`, need more
    than `device` has: on the host their sum, on GPUs each rank against its own device
    (`device` is then rank ranks[0]'s, and rank r of this node takes device r - ranks[0])."""

    dims = build_dims(cfg, world_size)
    device = torch.device(device)
    where = f"world {world_size}, zero {cfg.parallel.zero}, {cfg.train.dtype}"
    if device.type != "cuda":
        need = sum(_rank_bytes(cfg, dims, r) for r in ranks)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        check_fits(need, device, f"this run ({who} of {where}: parameters, gradients and AdamW "
                                 "state)")
        return
    for r in ranks:
        gpu = torch.device("cuda", (device.index or 0) + r - ranks[0])
        check_fits(_rank_bytes(cfg, dims, r), gpu, f"rank {r} of this run ({where}: parameters, "
                                                   "gradients and AdamW state)")
