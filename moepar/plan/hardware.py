"""GPU presets for `moepar plan`: memory, peak bf16 FLOP/s, link bandwidths and the achievable
fractions the planner assumes; every field can be overridden from the command line.

| preset    | memory (GiB, as the driver reports) | bf16 dense TFLOP/s | HBM TB/s | NVLink GB/s per GPU, one way | network GB/s per GPU |
|-----------|------|------|-----|-----|----|
| a100-80g  | 80.0 | 312  | 2.0 | 300 (NVLink 3) | 25 (HDR 200 Gb/s per GPU) |
| h100-80g  | 79.6 | 989  | 3.35| 450 (NVLink 4) | 50 (NDR 400 Gb/s per GPU) |
| h200-141g | 140.4| 989  | 4.8 | 450 (NVLink 4) | 50 (NDR 400 Gb/s per GPU) |
| b200      | 179.0| 2250 | 8.0 | 900 (NVLink 5) | 50 (400 Gb/s per GPU)     |

Peak FLOP/s and bandwidths are the vendors' dense (no sparsity) figures for SXM parts in 8-GPU
nodes with one NIC per GPU. The planner never reaches them: compute runs at `compute_efficiency`
of peak, collectives at `comm_efficiency` of the link, and HBM-bound work (the optimizer step) at
`hbm_efficiency`. These are assumptions, stated in every plan and overridable.
"""

import dataclasses
from dataclasses import dataclass

__all__ = ["GPU", "PRESETS", "resolve_gpu", "FIELDS"]


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float           # usable device memory before the planner's margin
    tflops: float               # dense bf16 peak, TFLOP/s
    hbm_tbps: float             # memory bandwidth, TB/s
    intra_gbps: float           # inside a node (NVLink), GB/s per GPU per direction
    inter_gbps: float           # between nodes (network), GB/s per GPU per direction
    compute_efficiency: float = 0.5    # achieved fraction of peak FLOP/s on the model's matmuls
    comm_efficiency: float = 0.7       # achieved fraction of link bandwidth by NCCL collectives
    hbm_efficiency: float = 0.7        # achieved fraction of HBM bandwidth (optimizer step)
    overhead_gib: float = 3.0   # CUDA context, cuBLAS workspaces, NCCL communicators
    usable_fraction: float = 0.92  # of what remains: the caching allocator's fragmentation

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not value > 0:
                raise ValueError(f"--gpu field {f.name}={value} must be > 0")
        for name in ("compute_efficiency", "comm_efficiency", "hbm_efficiency", "usable_fraction"):
            if getattr(self, name) > 1:
                raise ValueError(f"--gpu field {name}={getattr(self, name)} must be <= 1")

    @property
    def budget_bytes(self) -> float:
        """Bytes a plan may use per GPU: (memory - overhead) * usable_fraction."""
        return (self.memory_gib - self.overhead_gib) * self.usable_fraction * 2 ** 30


PRESETS = {g.name: g for g in (
    GPU("a100-80g", 80.0, 312.0, 2.0, 300.0, 25.0),
    GPU("h100-80g", 79.6, 989.0, 3.35, 450.0, 50.0),
    GPU("h200-141g", 140.4, 989.0, 4.8, 450.0, 50.0),
    GPU("b200", 179.0, 2250.0, 8.0, 900.0, 50.0),
)}

FIELDS = [f.name for f in dataclasses.fields(GPU) if f.name != "name"]


def resolve_gpu(name: str, overrides: dict[str, str] | None = None) -> GPU:
    """The preset `name` (case-insensitive) with `overrides` {field: value} applied."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"--gpu {name!r} is not one of {', '.join(PRESETS)}")
    changes = {}
    for field, text in (overrides or {}).items():
        if field not in FIELDS:
            raise ValueError(f"--set {field}=...: unknown GPU field; fields: {', '.join(FIELDS)}")
        try:
            changes[field] = float(text)
        except ValueError:
            raise ValueError(f"--set {field}={text!r} is not a number") from None
    return dataclasses.replace(PRESETS[key], **changes)
