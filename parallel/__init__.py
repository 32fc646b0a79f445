"""Everything that knows ranks exist; `parallelize` is the one place that fixes the order.

Order (see shared DESIGN.md): expert and tensor parallelism (change shapes) -> activation
checkpointing -> compile -> pipeline split -> data parallel / ZeRO (wraps parameters last).
This version has expert and plain data parallelism; tensor and pipeline parallelism and ZeRO are
refused at config time, before anything is built.
"""

from .checkpointing import apply_activation_checkpointing
from .dims import ParallelDims
from .expert import apply_ep

__all__ = ["parallelize", "check_layout", "apply_activation_checkpointing", "apply_ep",
           "ParallelDims"]


def check_layout(parallel):
    """Raises ValueError naming every degree this version cannot run (config time, no processes)."""
    unsupported = {f"parallel.{k}": getattr(parallel, k) for k in ("tp", "pp") if getattr(parallel, k) != 1}
    if parallel.zero:
        unsupported["parallel.zero"] = parallel.zero
    if unsupported:
        names = ", ".join(f"{k}={v}" for k, v in unsupported.items())
        raise ValueError(f"{names}: tensor and pipeline parallelism and ZeRO are not in this "
                         "version yet; set parallel.tp=1, parallel.pp=1, parallel.zero=0 "
                         "(parallel.ep and parallel.dp are supported)")


def parallelize(model, parallel, dims=None, meshes=None, rank: int = 0,
                activation_checkpointing: bool = False):
    """Applies the configured parallelisms to `model` in the fixed order; returns it.

    Order: expert parallelism (changes shapes) -> activation checkpointing. Data parallelism is
    the gradient reduction in `moepar.parallel.data`, run by the training step.
    """
    check_layout(parallel)
    if dims is not None and dims.ep > 1:
        apply_ep(model, dims, meshes, rank, parallel.dispatcher, parallel.dedup,
                 parallel.debug_splits)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    return model
