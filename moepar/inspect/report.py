"""The numbers of `moepar inspect`: per MoE layer, hot, cold and dead experts, drop rate, load
imbalance over time and the expert-bias range; as a JSON-ready dict and as aligned text.

Legend: S recorded steps, L MoE layers, E experts, W steps in the window.

Definitions (the README and `moepar inspect --help` repeat them):
- window: the last N recorded steps (`--last N`); shares, dead experts and drops are over it;
- share: an expert's routed tokens over all routed tokens of its layer in the window;
- dead: an expert that was routed no token in the window;
- drop rate: dropped routed copies over routed copies, in the window;
- max/mean and cv: per step, the busiest expert's load over the mean, and the population
  standard deviation over the mean; `first` and `last` average them over the first and last N
  steps, `trend` is the least-squares slope over all steps, per 100 steps;
- bias: the learned expert-selection bias after the last step: lowest, highest, their spread,
  and the spread after the first step;
- views (moepar/loadviews.py): p50/p90/p99 and max of the window's loads over the mean, load
  entropy and EP-rank rows max/mean of the window, router entropy averaged over it, and the
  straggler factor of the last measured expert time per EP rank;
- collapse: the training alarm (run.collapse_dead_steps, run.collapse_min_entropy) at the last
  step: an expert dead for the last N recorded steps in a row, or router entropy under the bar.
"""

import math

import numpy as np
import torch

from moepar.inspect.runload import InspectError, RunLoad
from moepar.loadviews import collapse_text, layer_views, straggler_L
from moepar.metrics import imbalance_L

__all__ = ["TOP", "step_index", "layer_stats", "collapse", "summarize", "format_text", "imbalance_SL"]

TOP = 3   # hottest and coldest experts listed per layer


def imbalance_SL(run: RunLoad) -> tuple[np.ndarray, np.ndarray]:
    """(max/mean, cv) per step and layer, the same numbers the training logs per step."""
    ratio, cv = imbalance_L(torch.from_numpy(run.tokens_SLE))
    return ratio.numpy(), cv.numpy()


def _trend(steps_S: np.ndarray, values_S: np.ndarray) -> float:
    """Least-squares slope per 100 steps (0 for a single step)."""
    if len(steps_S) < 2:
        return 0.0
    x = steps_S.astype(np.float64)
    x = x - x.mean()
    return float(100 * (x * (values_S - values_S.mean())).sum() / (x * x).sum())


def _over_time(steps_S, values_S, window: int) -> dict:
    return {"first": float(values_S[:window].mean()), "last": float(values_S[-window:].mean()),
            "trend_per_100_steps": _trend(steps_S, values_S)}


def _ranked(share_E: np.ndarray, hottest: bool) -> list[dict]:
    order = np.lexsort((np.arange(share_E.size), -share_E if hottest else share_E))
    return [{"expert": int(e), "share": float(share_E[e])} for e in order[:TOP]]


def _bias(bias_SE: np.ndarray) -> dict | None:
    """The last step's bias spread; None when no step recorded one."""
    recorded = ~np.isnan(bias_SE).any(-1)
    if not recorded.any():
        return None
    first, last = bias_SE[recorded][0], bias_SE[recorded][-1]
    return {"min": float(last.min()), "min_expert": int(last.argmin()),
            "max": float(last.max()), "max_expert": int(last.argmax()),
            "range": float(last.max() - last.min()),
            "first_range": float(first.max() - first.min())}


def layer_stats(run: RunLoad, last: int, step: int | None = None) -> list[dict]:
    """One dict per MoE layer; `step` adds that step's tokens per expert."""
    window = min(last, len(run.steps_S))
    ratio_SL, cv_SL = imbalance_SL(run)
    at = None if step is None else step_index(run, step)
    entropy_L = None
    if run.entropy_SL is not None:
        recent = run.entropy_SL[-window:]
        entropy_L = np.array([np.nanmean(c) if np.isfinite(c).any() else np.nan
                              for c in recent.T])
    ep = 1 if run.expert_ms_LP is None else run.expert_ms_LP.shape[1]
    views = layer_views(run.tokens_SLE[-window:].sum(0), ep, entropy_L)
    if run.expert_ms_LP is not None:
        views["straggler"] = straggler_L(run.expert_ms_LP)
    out = []
    for row, layer in enumerate(run.layers):
        tokens_E = run.tokens_SLE[-window:, row].sum(0)
        share_E = tokens_E / tokens_E.sum() if tokens_E.sum() > 0 else np.zeros_like(tokens_E)
        assigned = run.assigned_SL[-window:, row].sum()
        stats = {
            "layer": layer,
            "tokens": float(tokens_E.sum()),
            "hottest": _ranked(share_E, hottest=True),
            "coldest": _ranked(share_E, hottest=False),
            "dead": [int(e) for e in np.flatnonzero(tokens_E == 0)],
            "drop_rate": float(run.dropped_SL[-window:, row].sum() / assigned) if assigned else 0.0,
            "max_over_mean": _over_time(run.steps_S, ratio_SL[:, row], window),
            "cv": _over_time(run.steps_S, cv_SL[:, row], window),
            "bias": None if run.bias_SLE is None else _bias(run.bias_SLE[:, row]),
            "views": {name: (None if not math.isfinite(v[row]) else float(v[row]))
                      for name, v in views.items()},
        }
        if at is not None:
            stats["step_tokens"] = [float(v) for v in run.tokens_SLE[at, row]]
        out.append(stats)
    return out


def step_index(run: RunLoad, step: int) -> int:
    found = np.flatnonzero(run.steps_S == step)
    if not found.size:
        raise InspectError(f"step {step} is not recorded in {run.name!r} (it has steps "
                           f"{run.steps_S[0]}..{run.steps_S[-1]}, {len(run.steps_S)} recorded)")
    return int(found[0])


def collapse(run: RunLoad, dead_steps: int, min_entropy: float) -> str:
    """The training's collapse alarm at the run's last recorded step ('' when healthy)."""
    dead_SLE = run.tokens_SLE == 0
    # Steps in a row, up to the last, that each expert got no token.
    alive_before = np.cumprod(dead_SLE[::-1], axis=0).sum(0)
    entropy_L = None if run.entropy_SL is None else run.entropy_SL[-1]
    return collapse_text(run.layers, alive_before, entropy_L, dead_steps, min_entropy)


def summarize(run: RunLoad, last: int, step: int | None = None, dead_steps: int = 0,
              min_entropy: float = 0.0) -> dict:
    window = min(last, len(run.steps_S))
    return {
        "collapse": collapse(run, dead_steps, min_entropy),
        "run": run.run_dir, "num_steps": len(run.steps_S),
        "first_step": int(run.steps_S[0]), "last_step": int(run.steps_S[-1]),
        "num_experts": run.num_experts, "moe_layers": list(run.layers),
        "window": {"steps": window, "first_step": int(run.steps_S[-window]),
                   "last_step": int(run.steps_S[-1])},
        "step": step, "torn_line": run.torn_line,
        "layers": layer_stats(run, last, step),
    }


# ---- text ------------------------------------------------------------------------------------

def _experts(items: list[dict]) -> str:
    return ", ".join(f"e{i['expert']} {100 * i['share']:.1f}%" for i in items)


def _dead(ids: list[int]) -> str:
    if not ids:
        return "none"
    shown = ", ".join(f"e{e}" for e in ids[:12])
    return f"{len(ids)}: {shown}" + (", ..." if len(ids) > 12 else "")


def _over(values: dict) -> str:
    return (f"first {values['first']:.2f}, last {values['last']:.2f}, "
            f"trend {values['trend_per_100_steps']:+.3f}")


def _bias_text(bias: dict | None) -> str:
    if bias is None:
        return "not learned"
    # Three significant digits of the spread, the same decimals for every number (a bias of
    # 1e-10 is float32 rounding beside steps of 1e-3, and reads as 0.000).
    spread = max(bias["range"], bias["first_range"], 1e-12)
    d = min(max(2 - math.floor(math.log10(spread)), 0), 12)
    return (f"e{bias['min_expert']} {bias['min']:+.{d}f} .. e{bias['max_expert']} "
            f"{bias['max']:+.{d}f} (spread {bias['range']:.{d}f}; after the first step "
            f"{bias['first_range']:.{d}f})")


def _rows(stats: dict | None, with_step: bool) -> list[tuple[str, str]]:
    if stats is None:
        return [("", "(not a MoE layer here)")]
    rows = [("hottest", _experts(stats["hottest"])), ("coldest", _experts(stats["coldest"])),
            ("dead", _dead(stats["dead"])), ("dropped", f"{100 * stats['drop_rate']:.2f}%"),
            ("max/mean", _over(stats["max_over_mean"])), ("cv", _over(stats["cv"])),
            ("bias", _bias_text(stats["bias"])), ("views", _views(stats["views"]))]
    if with_step:
        rows.append(("at step", " ".join(f"{v:g}" for v in stats["step_tokens"])))
    return rows


def _views(views: dict) -> str:
    def num(name, fmt):
        return "-" if views.get(name) is None else format(views[name], fmt)
    text = (f"p50 {num('p50', '.2f')}, p90 {num('p90', '.2f')}, p99 {num('p99', '.2f')}, "
            f"max {num('max_over_mean', '.2f')} x mean; entropy load {num('load_entropy', '.2f')}"
            f", router {num('router_entropy', '.2f')}; EP rows max/mean "
            f"{num('rank_rows', '.2f')}")
    return text + (f", straggler {num('straggler', '.2f')}" if "straggler" in views else "")


def _header(report: dict) -> list[str]:
    w = report["window"]
    lines = [f"run {report['run']}: steps {report['first_step']}..{report['last_step']} "
             f"({report['num_steps']} recorded); MoE layers {report['moe_layers']}; "
             f"{report['num_experts']} experts (uniform share "
             f"{100 / report['num_experts']:.1f}%); window: the last {w['steps']} steps "
             f"({w['first_step']}..{w['last_step']})"]
    if report.get("collapse"):
        lines.append(f"  COLLAPSE {report['collapse']}")
    if report["torn_line"]:
        lines.append(f"  note: the last line ({report['torn_line']}) of its expert_load.jsonl "
                     "is torn (a crash mid-write?) and was left out")
    return lines


def format_text(reports: list[dict]) -> str:
    """One report, or several side by side in columns (layers matched by model layer number)."""
    lines = [line for r in reports for line in _header(r)]
    lines.append("first/last: mean over the first/last window of steps; trend: slope per 100 "
                 "steps; shares and dead experts: in the window")
    with_step = reports[0]["step"] is not None
    layers = sorted({s["layer"] for r in reports for s in r["layers"]})
    by_layer = [{s["layer"]: s for s in r["layers"]} for r in reports]
    tables = []
    for layer in layers:
        columns = [_rows(b.get(layer), with_step) for b in by_layer]
        labels = [label for label, _ in max(columns, key=len)]
        cells = [[text for _, text in c] + [""] * (len(labels) - len(c)) for c in columns]
        head = [f"layer {layer}"] + ([r["run"] for r in reports] if len(reports) > 1 else [])
        tables.append([head] + [[f"  {label}"] + [col[i] for col in cells]
                                for i, label in enumerate(labels)])
    # One set of column widths for every layer, so the runs line up down the whole report.
    rows = [row for table in tables for row in table]
    widths = [max(len(row[c]) for row in rows if c < len(row))
              for c in range(max(map(len, rows)))]
    for table in tables:
        lines.append("")
        lines += ["   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                  for row in table]
    return "\n".join(lines)
