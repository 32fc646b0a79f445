"""Finds float accumulations whose result depends on the order of GPU atomics.

On CUDA, `index_add`, `scatter_add`, `index_put(accumulate=True)` and friends add into a float
destination with atomics; where two sources hit the same destination row, the order of the adds
(so the rounding) changes from run to run. With unique indices each destination gets one add
and the result is exact. A TorchDispatchMode sees every aten op (forward and backward, on the
calling thread for CPU graphs) and records the accumulating ops on float tensors whose indices
repeat; on CPU it checks what would be nondeterministic on CUDA.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FloatAtomics"]

aten = torch.ops.aten


def _repeats(index: torch.Tensor, dim: int = 0) -> bool:
    """True if two entries of `index` along `dim` (in the same line) are equal."""
    if index.numel() < 2:
        return False
    ordered = index.sort(dim=dim).values
    return bool((ordered.diff(dim=dim) == 0).any())


def _stacked_repeats(indices) -> bool:
    """index_put with a tuple of index tensors: repeated positions = repeated index tuples."""
    tensors = [i for i in indices if i is not None]
    if not tensors or tensors[0].dtype == torch.bool:
        return False
    flat = torch.stack(torch.broadcast_tensors(*tensors)).flatten(1)
    return flat.shape[1] > 1 and torch.unique(flat, dim=1).shape[1] < flat.shape[1]


def _nondeterministic(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if not (args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
        return False
    if packet in (aten.index_add, aten.index_add_):
        return _repeats(args[2])
    if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_):
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        return bool(accumulate) and _stacked_repeats(args[1])
    if packet in (aten.scatter_add, aten.scatter_add_):
        return _repeats(args[2], args[1])
    if packet in (aten.scatter_reduce, aten.scatter_reduce_, aten.index_reduce,
                  aten.index_reduce_):
        return True
    return packet in (aten.put_, aten.put, aten.embedding_dense_backward, aten._unsafe_index_put)


class FloatAtomics(TorchDispatchMode):
    """`with FloatAtomics() as f: ...`; then `f.ops`, the offending ops in call order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _nondeterministic(func, args, kwargs):
            self.ops.append(str(func))
        return func(*args, **kwargs)
