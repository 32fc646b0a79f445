"""The measured expert time per EP rank: the straggler view (moepar/loadviews.py).

Legend: L MoE layers (all of the model's), P expert-parallel ranks.

What is timed: each MoE layer's `GroupedExperts.forward` on this rank (its grouped GEMMs over
the rows it received, every micro-batch, recompute included), by forward hooks set once:
- on CUDA, a pair of CUDA events around it (recorded on the stream, no host sync); the events
  are read when the window is read, once per log window;
- on CPU, `time.perf_counter` around it: CPU kernels finish before forward returns, so the host
  clock is the kernels' time and costs nothing extra. With parallel.a2a_chunks > 1 it includes
  waiting for the chunks' all-to-all arrivals (the experts start on a chunk as it lands).
Backward is not timed. `read` is a collective (one all-reduce of L*P numbers over the world),
called by every rank at the same log steps: the mean forward time per step of EP rank r's
experts in each layer, averaged over the ranks that hold the same experts (edp replicas).
"""

import time

import numpy as np
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

    def read(self) -> np.ndarray:
        """[L, P] milliseconds per step of each EP rank's experts over the window since the last
        read (a collective: every rank calls it); starts the next window."""
        ms_L = list(self.ms_L)
        if self.events:
            self.events[-1][2].synchronize()        # once per window, not per step
            for row, start, end in self.events:
                ms_L[row] += start.elapsed_time(end)
        dims, coords = self.layout.dims, self.layout.coords
        ms_LP = torch.zeros(self.num_layers, dims.ep, dtype=torch.float64,
                            device=self.layout.device)
        ms_LP[:, coords.ep] = torch.tensor(ms_L, dtype=torch.float64)
        self.layout.all_reduce(ms_LP, "sum")
        holders = self.layout.world // (dims.pp * dims.ep) if self.layout.world > 1 else 1
        out = ms_LP.cpu().numpy() / max(holders, 1) / max(self.steps, 1)
        self.ms_L, self.events, self.steps = [0.0] * self.num_layers, [], 0
        return out
