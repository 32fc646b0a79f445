"""Per-step router statistics and where they go: metrics.jsonl, expert_load.jsonl, TensorBoard.

Legend: L MoE layers, E experts, P expert-parallel ranks.

`StepStats` is owned by one training step: every micro-batch adds each MoE layer's losses and
loads (device tensors, no sync); parallel runs reduce them across ranks at step end (every rank,
same order). `PendingMetrics` keeps each step's numbers on the device and reads every pending
step in one device-to-host copy when the trainer flushes (every run.log_every steps, before
saves, at the end); `summary()` reads one step's at once.

Its rows are the MoE layers in model order; everything a user reads names a layer by the model's
layer number (`layer_3` is model layer 3, see `moe_layer_numbers`), never by its row.

Files in the run directory, written by rank 0 only, one JSON object per line and step, appended
a flush at a time (a crash can tear only the last line) and trimmed to the resumed checkpoint's
step on resume:

| file               | first line | one line per step                                            |
|--------------------|------------|--------------------------------------------------------------|
| metrics.jsonl      | -          | step, loss, aux losses, drop fraction, imbalance, lr, ...    |
|                    |            | (+ val_loss, val_ppl at validation steps: TensorBoard val/)  |
| expert_load.jsonl  | a header   | step, tokens [L][E], dropped [L], assigned [L], bias [L][E]  |

The expert-load header names the format, the model's MoE layer numbers and the expert count;
`moepar inspect` reads it (moepar/inspect/runload.py). `bias` is there when the routers learn an
expert bias (router.bias_update_rate > 0).
"""

import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist

from moepar.jsonfile import parse_json
from moepar.parallel.grads import all_reduce_sum
from moepar.plots import heatmap_rgb, ratio_to_mean

__all__ = ["StepStats", "PendingMetrics", "MetricsWriter", "SUMMARY_KEYS", "imbalance_L", "moe_layer_numbers", "LOAD_FILE",
           "LOAD_FORMAT", "LOAD_VERSION"]

LOAD_FILE = "expert_load.jsonl"
LOAD_FORMAT = "moepar.expert_load"
LOAD_VERSION = 1


def moe_layer_numbers(model_cfg) -> list[int]:
    """The model layer number of each StepStats row (first_k_dense, moe_every, ... applied)."""
    ids = range(model_cfg.num_layers + model_cfg.mtp_layers)   # the MTP depths' blocks last
    return [i for i in ids if model_cfg.is_moe_layer(i)]


class StepStats:
    def __init__(self, num_layers: int, num_experts: int, device=None):
        self.tokens_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.dropped_L = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.assignments_L = torch.zeros(num_layers, dtype=torch.float64, device=device)
        # weighted balance (incl. sequence-level), weighted z, unweighted balance; summed over layers
        self.losses_3 = torch.zeros(3, dtype=torch.float64, device=device)
        # the sum over micro-batches of their mean MTP loss (model.mtp_layers), unweighted
        self.mtp_1 = torch.zeros(1, dtype=torch.float64, device=device)
        self.num_micro_batches = 0

    def add(self, moe_outputs, router_cfg, layers: list[int] | None = None, balance=None):
        """One micro-batch's MoE outputs; `layers` are their positions among all MoE layers (a
        pipeline stage holds only some), default 0, 1, ... `balance`: this rank's part of the
        micro-batch's trained balance loss, coefficient-weighted, when it is deferred
        (router.balance_loss='all_layers' or balance_scope='global', layers/balance.py): it
        stands in the aux loss for the layers' own balance terms, which are then only the
        per-layer diagnostic `balance`."""
        self.num_micro_batches += 1
        layers = range(len(moe_outputs)) if layers is None else layers
        for layer, out in zip(layers, moe_outputs, strict=True):
            self.tokens_LE[layer] += out.stats.tokens_per_expert_E.to(self.tokens_LE)
            self.dropped_L[layer] += out.stats.num_dropped.to(self.dropped_L)
            self.assignments_L[layer] += out.stats.num_assignments
            loss = out.aux_loss
            trained = router_cfg.seq_balance_coeff * loss.seq_balance
            if balance is None:
                trained = trained + router_cfg.balance_coeff * loss.balance
            self.losses_3 += torch.stack([trained, router_cfg.z_coeff * loss.z,
                                          loss.balance]).to(self.losses_3)
        if balance is not None:
            self.losses_3[0] += balance.to(self.losses_3)

    def reduce(self, group, extra: list[torch.Tensor] = (), stage_group=None, slice_group=None):
        """Sums the step's statistics (and `extra` scalars, in place) over `group` (the dp ranks),
        in one all-reduce, then over `stage_group` (pipeline stages: each holds other layers, and
        the loss lives on the last). Loads and drops are also summed over `slice_group` (tensor
        parallel ranks each route a slice of the sequence; their losses are already the whole
        micro-batch's). Every rank calls this, MoE layers or not, in the same order."""
        parts = [self.tokens_LE, self.dropped_L, self.assignments_L, self.losses_3, self.mtp_1]
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
            self.num_micro_batches *= dist.get_world_size(group)

    def summary_6(self) -> torch.Tensor:
        """The step's scalars on the device, no sync: [aux_loss, z_loss, balance (mean over
        layers), drop_fraction, max_load_ratio, load_cv] (float64); loads are routed copies
        before drops. Empty for a model without MoE layers."""
        num_layers = self.tokens_LE.shape[0]
        if num_layers == 0:
            return self.losses_3.new_zeros(0)
        losses_3 = self.losses_3 / max(self.num_micro_batches, 1)
        max_ratio_L, cv_L = imbalance_L(self.tokens_LE)
        return torch.stack([losses_3[0], losses_3[1], losses_3[2] / num_layers,
                            self.dropped_L.sum() / self.assignments_L.sum().clamp_min(1),
                            max_ratio_L.max(), cv_L.mean()])

    def summary(self) -> dict:
        """`summary_6` read on the host (one sync) and named. A model without MoE layers
        (model.num_experts = 0, or every layer dense) has none of them."""
        return dict(zip(SUMMARY_KEYS, self.summary_6().tolist()))


SUMMARY_KEYS = ("aux_loss", "z_loss", "balance", "drop_fraction", "max_load_ratio", "load_cv")


def imbalance_L(tokens_LE: torch.Tensor):
    """Per row (layer, or step and layer): busiest expert over the mean load, and the coefficient
    of variation (population std over mean); a row with no tokens gives 0 for both."""
    mean_L = tokens_LE.mean(-1).clamp_min(1e-12)
    return tokens_LE.amax(-1) / mean_L, tokens_LE.std(-1, correction=0) / mean_L


def _step_of(line: str):
    """The step of a step line, or None for a torn or foreign line (a crash mid-write)."""
    try:
        step = parse_json(line, "a step line")["step"]
        return step if type(step) is int else None
    except (ValueError, KeyError, TypeError):
        return None


def _restart_file(path: str, resume_step: int, header: str | None = None):
    """Prepares a per-step file for this run: on resume, keeps the lines of steps up to the
    checkpoint (they are not run again) and drops later or torn ones; otherwise starts it empty.
    A file with another header (another model) starts over. Rewritten by rename, so a crash
    here leaves the old file whole."""
    kept = []
    if resume_step and os.path.exists(path):
        with open(path) as f:
            lines = f.readlines()
        if header is not None:
            same = bool(lines) and lines[0].rstrip("\n") == header
            lines = lines[1:] if same else []
        for line in lines:
            step = _step_of(line)
            if step is not None and step <= resume_step and line.endswith("\n"):
                kept.append(line)
    if header is None and not kept:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path + ".tmp", "w") as f:
        f.writelines(([header + "\n"] if header is not None else []) + kept)
    os.replace(path + ".tmp", path)


def _numbers(values: list[float]) -> list:
    """Whole numbers (token counts) as JSON integers: shorter, and read back exactly."""
    return [int(v) if math.isfinite(v) and v.is_integer() else v for v in values]


def _pack(stats: StepStats, expert_bias_LE=None) -> torch.Tensor:
    """Everything a step's lines need, as one float64 device vector (no sync): summary_6, then
    tokens [L*E], dropped [L], assigned [L], max/mean [L], cv [L], bias [L*E] if any."""
    max_ratio_L, cv_L = (imbalance_L(stats.tokens_LE) if stats.tokens_LE.numel() else
                         (stats.dropped_L, stats.dropped_L))     # no MoE layers: all empty
    parts = [stats.summary_6(), stats.tokens_LE.reshape(-1), stats.dropped_L, stats.assignments_L,
             max_ratio_L, cv_L]
    if expert_bias_LE is not None:
        parts.append(expert_bias_LE.reshape(-1))
    return torch.cat([p.to(torch.float64) for p in parts])


def _unpack(values: list[float], num_layers: int, num_experts: int, has_bias: bool):
    """(summary dict, host loads) from a `_pack` vector read on the host."""
    L, E = num_layers, num_experts
    summary = dict(zip(SUMMARY_KEYS, values[:6])) if L else {}
    at = 6 if L else 0

    def take(n):
        nonlocal at
        at += n
        return values[at - n:at]
    tokens = take(L * E)
    load = {"tokens_LE": [tokens[i * E:(i + 1) * E] for i in range(L)], "dropped_L": take(L),
            "assigned_L": take(L), "max_ratio_L": take(L), "cv_L": take(L), "bias_LE": None}
    if has_bias:
        bias = take(L * E)
        load["bias_LE"] = [bias[i * E:(i + 1) * E] for i in range(L)]
    return summary, load


class PendingMetrics:
    """Steps whose device numbers (StepStats, expert bias) wait to be read: `add` packs them on
    the device, `flush` reads every pending step in one device-to-host copy, completes each
    step's record with its summary (the keys in their usual order) and returns
    [(record, loads)] for MetricsWriter.write_many. The trainer flushes every run.log_every
    steps, before saves and at the end: one host sync per flush instead of several per step."""

    def __init__(self):
        self.items = []

    def add(self, record: dict, stats: StepStats, expert_bias_LE=None):
        shape = tuple(stats.tokens_LE.shape)
        self.items.append((record, _pack(stats, expert_bias_LE), shape,
                           expert_bias_LE is not None))

    def flush(self) -> list[tuple[dict, dict]]:
        if not self.items:
            return []
        items, self.items = self.items, []
        values = torch.cat([packed for _, packed, _, _ in items]).tolist()   # the one sync
        out, at = [], 0
        for record, packed, (L, E), has_bias in items:
            summary, load = _unpack(values[at:at + packed.numel()], L, E, has_bias)
            at += packed.numel()
            head = {"step": record["step"], "loss": record["loss"]}
            rest = {k: v for k, v in record.items() if k not in head}
            record.clear()
            record.update({**head, **summary, **rest})
            out.append((record, load))
        return out


def load_record(step: int, load: dict) -> dict:
    """One expert_load.jsonl line: this step's loads (routed copies before drops) per layer."""
    record = {"step": step, "tokens": [_numbers(row) for row in load["tokens_LE"]],
              "dropped": _numbers(load["dropped_L"]), "assigned": _numbers(load["assigned_L"])}
    if load["bias_LE"] is not None:
        # 5 significant digits: a bias moves by router.bias_update_rate a step (1e-3 typical),
        # so this tells every step's value apart up to 100; float32's 9 digits double the line.
        record["bias"] = [[float(f"{v:.5g}") for v in row] for row in load["bias_LE"]]
    return record


class MetricsWriter:
    """Appends one line per step to metrics.jsonl and expert_load.jsonl and mirrors them to
    TensorBoard. `model` is the ModelConfig (for the MoE layer numbers); the layer x expert
    heatmap image goes to TensorBoard every `image_every` steps (and at step 1; 0: never)."""

    def __init__(self, run_dir: str, tensorboard: bool, resume_step: int = 0, ep: int = 1, *,
                 model, image_every: int = 10):
        self.ep = ep
        self.image_every = image_every
        self.layers = moe_layer_numbers(model)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.load_path = os.path.join(run_dir, LOAD_FILE)
        header = {"format": LOAD_FORMAT, "version": LOAD_VERSION, "layers": self.layers,
                  "num_experts": model.num_experts}
        _restart_file(self.path, resume_step)
        _restart_file(self.load_path, resume_step, json.dumps(header))
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict, stats: StepStats | None = None, expert_bias_LE=None):
        """One step's lines, its device numbers read now (a host sync); training batches its
        steps through PendingMetrics and `write_many` instead."""
        load = None
        if stats is not None:
            L, E = stats.tokens_LE.shape
            _, load = _unpack(_pack(stats, expert_bias_LE).tolist(), L, E,
                              expert_bias_LE is not None)
        self.write_many([(record, load)])

    def write_many(self, steps: list[tuple[dict, dict | None]]):
        """[(record, host loads or None)] in step order: the lines of each, the files opened
        once."""
        if not steps:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(record) + "\n" for record, _ in steps)
        if self.layers:
            lines = [json.dumps(load_record(record["step"], load), separators=(",", ":")) + "\n"
                     for record, load in steps if load is not None]
            if lines:
                with open(self.load_path, "a") as f:
                    f.writelines(lines)
        if self.tb is not None:
            for record, load in steps:
                self._write_tb(record, load)

    def _write_tb(self, record: dict, load: dict | None):
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
                self.tb.add_scalar(tag, value, step)
        if load is not None and self.layers:
            self._write_load(load, step)
            if load["bias_LE"] is not None:
                for layer, bias_E in zip(self.layers, load["bias_LE"], strict=True):
                    self.tb.add_histogram(f"expert_bias/layer_{layer}", np.array(bias_E), step)

    def _write_load(self, load: dict, step: int):
        tokens_LE = np.array(load["tokens_LE"], dtype=np.float64)
        num_experts = tokens_LE.shape[1]
        experts = np.arange(num_experts)
        for row, layer in enumerate(self.layers):
            load_E = tokens_LE[row]
            # Expert index on the x axis, tokens routed to it as the bar height.
            self.tb.add_histogram_raw(
                f"tokens_per_expert/layer_{layer}", min=0, max=num_experts,
                num=float(load_E.sum()), sum=float((load_E * experts).sum()),
                sum_squares=float((load_E * experts ** 2).sum()),
                bucket_limits=[float(e + 1) for e in range(num_experts)],
                bucket_counts=load_E.tolist(), global_step=step)
            self.tb.add_scalar(f"imbalance/max_over_mean/layer_{layer}", load["max_ratio_L"][row],
                               step)
            self.tb.add_scalar(f"imbalance/cv/layer_{layer}", load["cv_L"][row], step)
            drop = load["dropped_L"][row] / max(load["assigned_L"][row], 1.0)
            self.tb.add_scalar(f"dropped_fraction/layer_{layer}", drop, step)
        draw = self.image_every and (step == 1 or step % self.image_every == 0)
        if draw:
            self.tb.add_image("load/layer_x_expert", heatmap_rgb(
                ratio_to_mean(tokens_LE), self.layers,
                f"step {step}: tokens per expert / layer mean"), step, dataformats="HWC")
        if self.ep > 1:
            # Which EP rank is hot: the experts of EP rank r are the r-th block of E/ep.
            rank_load_LP = tokens_LE.reshape(tokens_LE.shape[0], self.ep, -1).sum(-1)
            for layer, load_P in zip(self.layers, rank_load_LP, strict=True):
                share = load_P / max(load_P.sum(), 1.0)
                for r, value in enumerate(share.tolist()):
                    self.tb.add_scalar(f"ep_rank_load/layer_{layer}/rank_{r}", value, step)
            if draw:
                self.tb.add_image("load/layer_x_ep_rank", heatmap_rgb(
                    ratio_to_mean(rank_load_LP), self.layers,
                    f"step {step}: tokens per EP rank / layer mean", xlabel="EP rank"),
                    step, dataformats="HWC")

    def close(self):
        if self.tb is not None:
            self.tb.close()
