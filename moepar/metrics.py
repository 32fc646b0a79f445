"""Per-step router statistics and where they go: metrics.jsonl, TensorBoard, the progress line.

Legend: L MoE layers, E experts.

`StepStats` is owned by one training step: every micro-batch adds each MoE layer's losses and
loads (device tensors, no sync); `summary()` turns them into numbers once at step end. Parallel
runs reduce the same tensors across ranks before that (every rank, same order).
"""

import json
import math
import os

import torch

__all__ = ["StepStats", "MetricsWriter", "load_heatmap"]


class StepStats:
    def __init__(self, num_layers: int, num_experts: int, device=None):
        self.tokens_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.dropped_L = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.assignments_L = torch.zeros(num_layers, dtype=torch.float64, device=device)
        # weighted balance (incl. sequence-level), weighted z, unweighted balance; summed over layers
        self.losses_3 = torch.zeros(3, dtype=torch.float64, device=device)
        self.num_micro_batches = 0

    def add(self, moe_outputs, router_cfg, layers: list[int] | None = None):
        """One micro-batch's MoE outputs; `layers` are their positions among all MoE layers (a
        pipeline stage holds only some), default 0, 1, ..."""
        self.num_micro_batches += 1
        layers = range(len(moe_outputs)) if layers is None else layers
        for layer, out in zip(layers, moe_outputs, strict=True):
            self.tokens_LE[layer] += out.stats.tokens_per_expert_E.to(self.tokens_LE)
            self.dropped_L[layer] += out.stats.num_dropped.to(self.dropped_L)
            self.assignments_L[layer] += out.stats.num_assignments
            loss = out.aux_loss
            self.losses_3 += torch.stack([
                router_cfg.balance_coeff * loss.balance + router_cfg.seq_balance_coeff * loss.seq_balance,
                router_cfg.z_coeff * loss.z, loss.balance]).to(self.losses_3)

    def reduce(self, group, extra: list[torch.Tensor] = (), stage_group=None, slice_group=None):
        """Sums the step's statistics (and `extra` scalars, in place) over `group` (the dp ranks),
        in one all-reduce, then over `stage_group` (pipeline stages: each holds other layers, and
        the loss lives on the last). Loads and drops are also summed over `slice_group` (tensor
        parallel ranks each route a slice of the sequence; their losses are already the whole
        micro-batch's). Every rank calls this, MoE layers or not, in the same order."""
        from moepar.parallel.data import all_reduce_sum
        parts = [self.tokens_LE, self.dropped_L, self.assignments_L, self.losses_3]
        extra = list(extra)
        packed = [t.to(torch.float64) for t in extra]
        if slice_group is not None:
            all_reduce_sum(parts[:3], slice_group)
        all_reduce_sum(parts + packed, group)
        if stage_group is not None:
            all_reduce_sum(parts + packed, stage_group)
        for target, value in zip(extra, packed):
            target.copy_(value)
        if group is not None:
            import torch.distributed as dist
            self.num_micro_batches *= dist.get_world_size(group)

    def summary(self) -> dict:
        """Scalars for this step; loads are routed copies before drops."""
        num_layers = max(self.tokens_LE.shape[0], 1)
        losses = (self.losses_3 / max(self.num_micro_batches, 1)).tolist()
        max_ratio_L, cv_L = imbalance_L(self.tokens_LE)
        return {
            "aux_loss": losses[0],
            "z_loss": losses[1],
            "balance": losses[2] / num_layers,
            "drop_fraction": float(self.dropped_L.sum() / self.assignments_L.sum().clamp_min(1)),
            "max_load_ratio": float(max_ratio_L.max()) if max_ratio_L.numel() else 0.0,
            "load_cv": float(cv_L.mean()) if cv_L.numel() else 0.0,
        }


def imbalance_L(tokens_LE: torch.Tensor):
    """Per layer: busiest expert over the mean load, and the coefficient of variation."""
    mean_L = tokens_LE.mean(1).clamp_min(1e-12)
    return tokens_LE.amax(1) / mean_L, tokens_LE.std(1, correction=0) / mean_L


def load_heatmap(tokens_LE: torch.Tensor, cell: int = 24) -> torch.Tensor:
    """A [3, L*cell, E*cell] image in [0, 1]: blue = idle, white = mean load, red = 2x mean or more."""
    ratio = tokens_LE / tokens_LE.mean(1, keepdim=True).clamp_min(1e-12)
    t = (ratio / 2).clamp(0, 1).float()                    # 0 idle, 0.5 mean, 1 hot
    up, down = (2 * t - 1).clamp(0, 1), (1 - 2 * t).clamp(0, 1)
    rgb = torch.stack([1 - down, 1 - up - down, 1 - up])   # blue->white->red
    rgb = rgb.clamp(0, 1)
    return rgb.repeat_interleave(cell, 1).repeat_interleave(cell, 2)


def _step_of(line: str):
    """The step of a metrics.jsonl line, or None for a torn or foreign line (a crash mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl and mirrors it to TensorBoard."""

    def __init__(self, run_dir: str, tensorboard: bool, resume_step: int = 0, ep: int = 1):
        self.ep = ep
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step and os.path.exists(self.path):
            # Steps after the checkpoint will be run again: drop their old lines, keep the earlier.
            with open(self.path) as f:
                kept = [line for line in f if _step_of(line) is not None and _step_of(line) <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(kept)
        elif os.path.exists(self.path):
            os.remove(self.path)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict, stats: StepStats | None = None, expert_bias_LE=None):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is None:
            return
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(f"train/{key}", value, step)
        if stats is not None and stats.tokens_LE.numel():
            self._write_load(stats, step)
        if expert_bias_LE is not None:
            for layer, bias_E in enumerate(expert_bias_LE):
                self.tb.add_histogram(f"expert_bias/layer_{layer}", bias_E.float(), step)

    def _write_load(self, stats: StepStats, step: int):
        tokens_LE = stats.tokens_LE.cpu()
        num_experts = tokens_LE.shape[1]
        max_ratio_L, cv_L = imbalance_L(tokens_LE)
        for layer, load_E in enumerate(tokens_LE):
            # Expert index on the x axis, tokens routed to it as the bar height.
            self.tb.add_histogram_raw(
                f"tokens_per_expert/layer_{layer}", min=0, max=num_experts,
                num=float(load_E.sum()), sum=float((load_E * torch.arange(num_experts)).sum()),
                sum_squares=float((load_E * torch.arange(num_experts) ** 2).sum()),
                bucket_limits=[float(e + 1) for e in range(num_experts)],
                bucket_counts=load_E.tolist(), global_step=step)
            self.tb.add_scalar(f"imbalance/max_over_mean/layer_{layer}", float(max_ratio_L[layer]), step)
            self.tb.add_scalar(f"imbalance/cv/layer_{layer}", float(cv_L[layer]), step)
            drop = stats.dropped_L[layer] / stats.assignments_L[layer].clamp_min(1)
            self.tb.add_scalar(f"dropped_fraction/layer_{layer}", float(drop), step)
        self.tb.add_image("load/layer_x_expert", load_heatmap(tokens_LE), step)
        if self.ep > 1:
            # Which EP rank is hot: the experts of EP rank r are the r-th block of E/ep.
            rank_load_LP = tokens_LE.view(tokens_LE.shape[0], self.ep, -1).sum(-1)
            for layer, load_P in enumerate(rank_load_LP):
                share = load_P / load_P.sum().clamp_min(1)
                for r, value in enumerate(share.tolist()):
                    self.tb.add_scalar(f"ep_rank_load/layer_{layer}/rank_{r}", value, step)
            self.tb.add_image("load/layer_x_ep_rank", load_heatmap(rank_load_LP), step)

    def close(self):
        if self.tb is not None:
            self.tb.close()
