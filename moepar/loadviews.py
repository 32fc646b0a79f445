"""Load views that scale: per MoE layer a handful of numbers whatever the expert and EP counts,
per-rank detail in histograms and images, the collapse alarm, and the measured expert time.

Legend: L MoE layers, E experts, P expert-parallel ranks (EP rank r holds the r-th block of E/P
experts, as the contiguous placement puts them).

Per layer and step (host numbers, from the step's loads: no device work):

| view              | what                                                              |
|-------------------|-------------------------------------------------------------------|
| p50, p90, p99     | percentiles of the experts' loads over the mean load (1 = even)    |
| max_over_mean     | the busiest expert over the mean (train/max_load_ratio: the worst) |
| dead              | experts routed no token this step                                 |
| load_entropy      | entropy of the experts' shares over log E (1 even, 0 one expert)  |
| router_entropy    | mean over tokens of the router's distribution's entropy over log E |
| rank_rows         | max over mean of the rows each EP rank's experts receive           |
| straggler         | max over mean of the EP ranks' measured expert time (`ExpertTimer`) |

TensorBoard gets these as `views/<view>/layer_<L>` scalars (the same tags at every ep; the
busiest expert is metrics.py's `imbalance/max_over_mean/layer_<L>`), and
per-rank detail as histograms `ep_rank_rows/layer_<L>` and `ep_rank_expert_ms/layer_<L>`
(bucket r = EP rank r) and the `load/layer_x_ep_rank` image.
"""

import math

import numpy as np

from moepar.parallel.expert_map import rank_rows

__all__ = ["bar_histogram", "layer_views", "straggler_L", "rank_rows_LP", "CollapseWatch", "write_views_tb", "VIEWS"]

VIEWS = ("p50", "p90", "p99", "max_over_mean", "dead", "load_entropy", "router_entropy",
         "rank_rows")


def rank_rows_LP(tokens_LE: np.ndarray, ep: int, maps_L=None) -> np.ndarray:
    """Rows each EP rank's experts receive, per layer: the r-th block of E/ep experts (contiguous
    placement), or under `maps_L` (one ExpertMap or None per row; parallel.expert_placement)
    each rank's slots, a replicated expert's rows split evenly over its copies."""
    rows_LP = tokens_LE.reshape(tokens_LE.shape[0], ep, -1).sum(-1)
    for row, expert_map in enumerate(maps_L or []):
        if expert_map is not None:
            rows_LP[row] = rank_rows(expert_map, tokens_LE[row])
    return rows_LP


def _over_mean(values: np.ndarray) -> np.ndarray:
    mean = values.mean(-1, keepdims=True)
    return np.where(mean > 0, values / np.where(mean > 0, mean, 1.0), 0.0)


def straggler_L(expert_ms_LP) -> np.ndarray:
    """Per layer, the slowest EP rank's expert time over the mean (1: no straggler)."""
    return _over_mean(np.asarray(expert_ms_LP, dtype=np.float64)).max(-1)


def layer_views(tokens_LE: np.ndarray, ep: int = 1, entropy_L=None, maps_L=None) -> dict:
    """{view: [L] numbers} (VIEWS) of one step's or window's loads; router_entropy needs the
    router's `entropy_L` (None: NaN)."""
    ratio_LE = _over_mean(tokens_LE)
    p50, p90, p99 = np.percentile(ratio_LE, [50, 90, 99], axis=-1)
    total_L = tokens_LE.sum(-1, keepdims=True)
    share_LE = tokens_LE / np.where(total_L > 0, total_L, 1.0)
    load_entropy = -(share_LE * np.log(np.where(share_LE > 0, share_LE, 1.0))).sum(-1) / \
        math.log(max(tokens_LE.shape[-1], 2))
    num_layers = tokens_LE.shape[0]
    return {"p50": p50, "p90": p90, "p99": p99, "max_over_mean": ratio_LE.max(-1),
            "dead": (tokens_LE == 0).sum(-1).astype(np.float64), "load_entropy": load_entropy,
            "router_entropy": (np.full(num_layers, np.nan) if entropy_L is None
                               else np.asarray(entropy_L, dtype=np.float64)),
            "rank_rows": _over_mean(rank_rows_LP(tokens_LE, ep, maps_L)).max(-1)}


class CollapseWatch:
    """The collapse alarm: an expert routed no token for `dead_steps` steps in a row, or a
    layer's router entropy (over log E) under `min_entropy`; 0 turns either off. Fed every
    step in order (rank 0's writer); `update` returns the alarm text, or "" when healthy."""

    def __init__(self, layers: list[int], num_experts: int, dead_steps: int, min_entropy: float):
        self.layers, self.dead_steps, self.min_entropy = layers, dead_steps, min_entropy
        self.dead_for_LE = np.zeros((len(layers), num_experts), dtype=np.int64)

    def update(self, tokens_LE: np.ndarray, entropy_L=None) -> str:
        self.dead_for_LE = np.where(tokens_LE == 0, self.dead_for_LE + 1, 0)
        return collapse_text(self.layers, self.dead_for_LE, entropy_L, self.dead_steps,
                             self.min_entropy)


def collapse_text(layers, dead_for_LE, entropy_L, dead_steps: int, min_entropy: float) -> str:
    """'layer 3: 2 experts dead >= 50 steps (e1, e5); layer 5: router entropy 0.08 < 0.10', or ''
    (also `moepar inspect`'s, from a run's recorded steps)."""
    parts = []
    for row, layer in enumerate(layers):
        says = []
        if dead_steps:
            dead = np.flatnonzero(dead_for_LE[row] >= dead_steps)
            if dead.size:
                shown = ", ".join(f"e{e}" for e in dead[:4]) + (", ..." if dead.size > 4 else "")
                says.append(f"{dead.size} expert{'s' * (dead.size > 1)} dead >= {dead_steps} "
                            f"steps ({shown})")
        if min_entropy and entropy_L is not None and entropy_L[row] < min_entropy:
            says.append(f"router entropy {entropy_L[row]:.3f} < {min_entropy:.3f}")
        if says:
            parts.append(f"layer {layer}: " + ", ".join(says))
    return "; ".join(parts)


def bar_histogram(tb, tag: str, counts: np.ndarray, step: int):
    """Bucket i of height counts[i] (expert i, EP rank i): TensorBoard's bar view of a vector."""
    index = np.arange(len(counts))
    tb.add_histogram_raw(tag, min=0, max=len(counts), num=float(counts.sum()),
                         sum=float((counts * index).sum()),
                         sum_squares=float((counts * index ** 2).sum()),
                         bucket_limits=[float(i + 1) for i in range(len(counts))],
                         bucket_counts=counts.tolist(), global_step=step)


def write_views_tb(tb, layers: list[int], tokens_LE: np.ndarray, ep: int, step: int,
                   entropy_L=None, expert_ms_LP=None, maps_L=None):
    """One step's views: 7 scalars per layer (8 with a measured expert time), whatever ep is,
    and per layer the histograms of expert shares and of each EP rank's rows (and time)."""
    views = layer_views(tokens_LE, ep, entropy_L, maps_L)
    if expert_ms_LP is not None:
        views["straggler"] = straggler_L(expert_ms_LP)
    rows_LP = rank_rows_LP(tokens_LE, ep, maps_L)
    for row, layer in enumerate(layers):
        for name, values in views.items():
            # max_over_mean is metrics.py's imbalance/max_over_mean already.
            if name != "max_over_mean" and math.isfinite(values[row]):
                tb.add_scalar(f"views/{name}/layer_{layer}", float(values[row]), step)
        total = tokens_LE[row].sum()
        if total > 0:
            tb.add_histogram(f"expert_share/layer_{layer}", tokens_LE[row] / total, step)
        bar_histogram(tb, f"ep_rank_rows/layer_{layer}", rows_LP[row], step)
        if expert_ms_LP is not None:
            bar_histogram(tb, f"ep_rank_expert_ms/layer_{layer}", np.asarray(expert_ms_LP[row]),
                       step)
    return views
