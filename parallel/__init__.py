"""Everything that knows ranks exist; `parallelize` is the one place that fixes the order.

Order (see shared DESIGN.md): expert and tensor parallelism (change shapes) -> activation
checkpointing -> compile -> pipeline split -> data parallel / ZeRO (wraps parameters last).
This version runs on one process; the degrees are validated so a layout it cannot run yet is
refused before anything is built.
"""

from .checkpointing import apply_activation_checkpointing

__all__ = ["parallelize", "check_layout", "apply_activation_checkpointing"]


def check_layout(parallel):
    """Raises ValueError naming every degree this version cannot run (config time, no processes)."""
    wanted = {name: getattr(parallel, name) for name in ("dp", "tp", "pp", "ep")}
    wanted["zero"] = parallel.zero
    unsupported = {k: v for k, v in wanted.items() if v != (0 if k == "zero" else 1)}
    if unsupported:
        names = ", ".join(f"parallel.{k}={v}" for k, v in unsupported.items())
        raise ValueError(f"{names}: this version trains on one process only; set them to 1 "
                         "(parallel.zero to 0)")


def parallelize(model, parallel, activation_checkpointing: bool = False):
    """Applies the configured parallelisms to `model` in the fixed order; returns it."""
    check_layout(parallel)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    return model
