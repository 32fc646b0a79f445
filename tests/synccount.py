"""Counts, on any device, the operations that would make the host wait for a CUDA device.

On CPU nothing syncs, so the count is of what each op would cost on CUDA: a TorchDispatchMode
sees every aten op (forward and backward, on the calling thread for CPU graphs), and the few
Python-level reads that bypass dispatch (`tolist`, `numpy`, `cpu`) are patched. The table below
is what torch 2.13 does on CUDA; `torch.cuda.set_sync_debug_mode("error")` is the GPU check of
the same budget (tests/cuda).

| op                                               | syncs on CUDA | why                           |
|--------------------------------------------------|---------------|-------------------------------|
| _local_scalar_dense (.item, bool, int, float)    | 1             | reads one value               |
| tolist, numpy, cpu                               | 1             | device-to-host copy           |
| bincount                                         | 2             | reads min and max of the ids  |
| nonzero, masked_select, unique*, equal           | 1             | output size or value on host  |
| index / index_put with a boolean mask            | 1             | nonzero of the mask           |
| repeat_interleave(Tensor) without output_size    | 1             | sum of repeats on host        |
| lift_fresh (torch.tensor(host data))             | 1             | pageable host-to-device copy  |
"""

import pathlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter"]

aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense: 1, aten.bincount: 2, aten.nonzero: 1, aten.masked_select: 1,
           aten._unique2: 1, aten.unique_consecutive: 1, aten.unique_dim: 1, aten.equal: 1,
           aten.is_nonzero: 1, aten.lift_fresh: 1, aten.allclose: 1}
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PROJECT_DIRS = {_ROOT / "layers", _ROOT / "parallel", _ROOT / "moepar"}
_MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _has_mask(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices or ())


def _syncs(func, args, kwargs) -> int:
    packet = func.overloadpacket
    if packet in _ALWAYS:
        return _ALWAYS[packet]
    if packet in _MASK_INDEXED:
        return int(_has_mask(args[1] if len(args) > 1 else kwargs.get("indices")))
    if packet is aten.repeat_interleave and func._overloadname in ("Tensor", "self_Tensor"):
        return int(kwargs.get("output_size") is None)
    return 0


def _where() -> str:
    """The innermost frame of project code (layers/, parallel/, moepar/) that caused the op."""
    for frame in reversed(traceback.extract_stack()):
        path = pathlib.Path(frame.filename)
        if path.parent in _PROJECT_DIRS:
            return f"{path.parent.name}/{path.name}:{frame.lineno} {frame.line}"
    return "(outside the project)"


class SyncCounter(TorchDispatchMode):
    """`with SyncCounter() as c: ...`; then `c.count` and `c.report()` (op and line of each)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, int, str]] = []
        self._saved = {}

    @property
    def count(self) -> int:
        return sum(n for _, n, _ in self.events)

    def report(self) -> str:
        return "\n".join(f"  {n} x {op} at {where}" for op, n, where in self.events) or "  none"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        n = _syncs(func, args, kwargs)
        if n:
            self.events.append((str(func), n, _where()))
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu"):
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def counted(tensor, *args, _real=real, _name=name, **kwargs):
                self.events.append((f"Tensor.{_name}", 1, _where()))
                return _real(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)
