"""`moepar inspect RUN`: how a run's experts are loaded, from its expert_load.jsonl.

    moepar inspect runs/tiny                       # text report per MoE layer
    moepar inspect runs/tiny --plots plots/        # + heatmap.png, imbalance.png, tokens_step_S.png
    moepar inspect runs/a --compare runs/b --last 50 --step 100 --json

| module      | what it does                                                         |
|-------------|----------------------------------------------------------------------|
| runload.py  | reads and checks the run directory and its expert_load.jsonl         |
| report.py   | the per-layer numbers (hot, cold, dead, drops, imbalance, bias) and text |
| ../plots.py | the matplotlib pictures (moepar/plots.py: TensorBoard draws them too) |
"""

import argparse
import json
import os
import sys

from moepar import plots
from moepar.config import RunDirConfig

from .report import format_text, imbalance_SL, step_index, summarize
from .runload import InspectError, read_run

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moepar inspect", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Summarize a run's expert load per MoE layer (named by the model's layer "
                    "numbers): hottest and coldest experts with their share of routed tokens, "
                    "dead experts (no token in the window), drop rate, busiest-expert/mean and "
                    "coefficient of variation over time, the learned expert-bias range, the "
                    "load views (percentiles, entropies, EP-rank rows, straggler) and the "
                    "collapse alarm.",
        epilog="window: the last N recorded steps; first/last: the mean over the first/last N "
               "steps; trend: least-squares slope per 100 steps.\nPlots (--plots DIR): "
               "heatmap.png (layer x expert load over the window, 1 = uniform share), "
               "imbalance.png (busiest expert / mean per step and layer), tokens_step_S.png "
               "(tokens per expert at step S).")
    parser.add_argument("run", metavar="RUN", help="a run directory (the config's run.dir)")
    parser.add_argument("--last", type=int, default=20, metavar="N",
                        help="window of the last N recorded steps (default 20)")
    parser.add_argument("--step", type=int, metavar="S",
                        help="a recorded step to show tokens per expert for (default for the "
                             "plot: the last step)")
    parser.add_argument("--plots", metavar="DIR", help="write the PNG plots into DIR (created)")
    parser.add_argument("--compare", metavar="RUN2", help="a second run, side by side")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--dead-steps", type=int, default=RunDirConfig.collapse_dead_steps,
                        metavar="N", help="collapse alarm: an expert dead for the last N "
                        "recorded steps (default: run.collapse_dead_steps's, %(default)s; 0: off)")
    parser.add_argument("--min-entropy", type=float, default=RunDirConfig.collapse_min_entropy,
                        metavar="X", help="collapse alarm: router entropy over log E under X at "
                        "the last step (default %(default)s; 0: off)")
    return parser


def write_plots(runs, reports, plots_dir: str, step: int | None) -> list[str]:
    """heatmap.png, imbalance.png and tokens_step_S.png for one run or two side by side."""
    os.makedirs(plots_dir, exist_ok=True)
    paths = []
    panels = [(run.name if len(runs) > 1 else "", plots.ratio_to_mean(
        run.tokens_SLE[-r["window"]["steps"]:].sum(0)), run.layers)
        for run, r in zip(runs, reports, strict=True)]
    spans = "; ".join(f"{r['window']['first_step']}..{r['window']['last_step']}" for r in reports)
    fig = plots.heatmap_figure(panels, f"expert load over steps {spans}")
    paths.append(plots.save(fig, os.path.join(plots_dir, "heatmap.png")))
    fig = plots.imbalance_figure([(run.name, run.steps_S, imbalance_SL(run)[0], run.layers)
                                  for run in runs])
    paths.append(plots.save(fig, os.path.join(plots_dir, "imbalance.png")))
    chosen = step if step is not None else int(runs[0].steps_S[-1])
    at = [(run.name, chosen, run.tokens_SLE[step_index(run, chosen)], run.layers)
          for run in runs]
    fig = plots.tokens_figure(at)
    paths.append(plots.save(fig, os.path.join(plots_dir, f"tokens_step_{chosen}.png")))
    return paths


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.last < 1:
        print(f"moepar inspect: --last {args.last} must be >= 1", file=sys.stderr)
        return 2
    try:
        runs = [read_run(args.run)] + ([read_run(args.compare)] if args.compare else [])
        reports = [summarize(run, args.last, args.step, args.dead_steps, args.min_entropy)
                   for run in runs]
        paths = write_plots(runs, reports, args.plots, args.step) if args.plots else []
    except InspectError as e:
        print(f"moepar inspect: {e}", file=sys.stderr)
        return 1
    if args.json:
        out = reports[0] if len(reports) == 1 else {"runs": reports}
        if paths:
            out = {**out, "plots": paths}
        print(json.dumps(out, indent=1))
    else:
        print(format_text(reports))
        for path in paths:
            print(f"wrote {path}")
    return 0
