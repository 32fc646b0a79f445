"""The measured expert time per EP rank: the straggler view (moepar/loadviews.py).

Legend: L MoE layers (all of the model's), P expert-parallel ranks.

What is timed: each MoE layer's `GroupedExperts.forward` on this rank (its grouped GEMMs over
the rows it received, every micro-batch, recompute included), by forward hooks set once:
- on CUDA, a pair of CUDA events around it (recorded on the stream, no host sync); the events
  are read when the window is read, once per log window;
- on CPU, `time.perf_counter` around it: CPU kernels finish before forward returns, so the host
  clock is the kernels' time and costs nothing extra. With parallel.a2a_chunks > 1 it includes
  waiting for the chunks' all-to-all arrivals (the experts start on a chunk as it lands).
Backward is not timed. The times of a log window become host numbers after the metrics flush
that ends it (`harvest`; its device-to-host read has waited for the events already), and reach
the files at the next flush (`reduced`: one all-reduce of L*P numbers over the world, read in
that flush's one copy): the views lag one log window and add no host sync. The number is the
mean forward time per step of EP rank r's experts in each layer, averaged over the ranks that
hold the same experts (edp replicas).
"""

import time

import torch

__all__ = ["ExpertTimer"]


class ExpertTimer:
    def __init__(self, model, layout, num_moe_layers: int):
        self.layout, self.num_layers = layout, num_moe_layers
        self.cuda = layout.device.type == "cuda" if hasattr(layout.device, "type") else False
        self.ms_L = [0.0] * num_moe_layers          # CPU: milliseconds so far in the window
        self.events = []                            # CUDA: (row, start, end)
        self.steps = 0
        for row, moe in zip(model.moe_indices(), model.moe_layers(), strict=True):
            moe.experts.register_forward_pre_hook(self._start(row))
            moe.experts.register_forward_hook(self._stop(row))

    def _start(self, row: int):
        def hook(_module, _args):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self.events.append([row, start, None])
            else:
                self._t0 = time.perf_counter()
        return hook

    def _stop(self, row: int):
        def hook(_module, _args, _out):
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events[-1][2] = end
            else:
                self.ms_L[row] += 1e3 * (time.perf_counter() - self._t0)
        return hook

    def step(self):
        self.steps += 1

    def harvest(self):
        """Right after a host sync (the metrics flush): the window's times become host numbers
        (CUDA events already passed need no wait) and the next window starts."""
        ms_L = list(self.ms_L)
        for row, start, end in self.events:
            ms_L[row] += start.elapsed_time(end)
        self.ready = (ms_L, self.steps) if self.steps else None
        self.ms_L, self.events, self.steps = [0.0] * self.num_layers, [], 0

    ready = None

    def reduced(self):
        """[L, P] milliseconds per step of each EP rank's experts in the last harvested window,
        on the device, averaged over the ranks holding the same experts; None before the first.
        A collective (one all-reduce over the world: every rank at the same steps); no host
        read, no host-to-device copy (scalar fills)."""
        if self.ready is None:        # the same on every rank: they harvest at the same steps
            return None
        ms_L, steps = self.ready
        dims = self.layout.dims
        ms_LP = torch.zeros(self.num_layers, dims.ep, dtype=torch.float64,
                            device=self.layout.device)
        for row, ms in enumerate(ms_L):
            ms_LP[row, self.layout.coords.ep].fill_(ms / steps)   # a scalar: no copy
        self.layout.all_reduce(ms_LP, "sum")
        return ms_LP / max(self.layout.world // (dims.pp * dims.ep), 1)
