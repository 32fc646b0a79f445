"""Expert-load pictures, drawn with matplotlib's Agg renderer: the layer x expert heatmap (for
TensorBoard and `moepar inspect`), load imbalance over steps, and tokens per expert at one step.

Legend: L MoE layers, E experts (or EP ranks), S steps.

Figures are `matplotlib.figure.Figure` objects with their own Agg canvas, never pyplot: no global
figure registry, no display, nothing shared with a training loop that draws now and then. Layers
are labelled with the model's layer numbers. Sizes are fixed by the data's shape (see the
`*_size` functions, in inches at DPI dots per inch), so a picture's size says what it holds; they
are multiples of 1/4 inch, exact in binary, so every matplotlib rounds them to the same pixels.
"""

import math

import numpy as np

__all__ = ["DPI", "ratio_to_mean", "heatmap_size", "heatmap_figure", "heatmap_rgb",
           "imbalance_size", "imbalance_figure", "tokens_size", "tokens_figure", "save"]

DPI = 100
CMAP = "viridis"       # perceptually uniform, readable in grey: darker is always fewer tokens
MAX_TICKS = 32         # label every row/column up to this many, then a readable subset


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def ratio_to_mean(tokens_LE: np.ndarray) -> np.ndarray:
    """Each expert's tokens over its layer's mean (1 = a uniform share); 0 for an empty layer."""
    mean_L1 = tokens_LE.mean(-1, keepdims=True)
    return np.divide(tokens_LE, mean_L1, out=np.zeros(tokens_LE.shape), where=mean_L1 > 0)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _index_ticks(axis, labels: list):
    """Ticks at integer positions 0..n-1 showing labels[i]: all of them up to MAX_TICKS, else an
    evenly spaced subset (positions stay integers, so a label always names its own row)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter
    n = len(labels)
    stride = max(1, math.ceil(n / MAX_TICKS))
    axis.set_major_locator(FixedLocator(list(range(0, n, stride))))
    axis.set_major_formatter(FuncFormatter(
        lambda v, _: str(labels[int(round(v))]) if 0 <= round(v) < n else ""))


def heatmap_size(num_layers: int, num_experts: int, panels: int = 1) -> tuple[float, float]:
    """(width, height) in inches: per panel 2 + 0.25 per column, within [5, 20]; plus 1.25 for
    the colour bar; height 1.5 + 0.25 per layer, within [3, 20]."""
    width = panels * _clamp(2 + 0.25 * num_experts, 5, 20) + 1.25
    return width, _clamp(1.5 + 0.25 * num_layers, 3, 20)


def heatmap_figure(panels: list[tuple[str, np.ndarray, list[int]]], title: str,
                   xlabel: str = "expert"):
    """Layer x expert heatmaps side by side, one per (panel title, ratio_LE, model layer numbers),
    on one colour scale: 0 (no tokens) .. max(2, the largest ratio), so a uniform load (1) sits
    mid-scale unless an expert takes over twice its share."""
    num_layers = max(r.shape[0] for _, r, _ in panels)
    num_cols = max(r.shape[1] for _, r, _ in panels)
    fig = _figure(*heatmap_size(num_layers, num_cols, len(panels)))
    vmax = max([2.0] + [float(r.max()) for _, r, _ in panels if r.size])
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, ratio_LE, layers) in zip(axes, panels, strict=True):
        image = ax.imshow(ratio_LE, cmap=CMAP, vmin=0.0, vmax=vmax, aspect="auto",
                          interpolation="nearest")
        _index_ticks(ax.xaxis, list(range(ratio_LE.shape[1])))
        _index_ticks(ax.yaxis, layers)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("model layer")
        if name:
            ax.set_title(name, fontsize="medium")
    fig.colorbar(image, ax=list(axes), label="tokens / layer mean (1 = uniform)")
    fig.suptitle(title)
    return fig


def heatmap_rgb(ratio_LE: np.ndarray, layers: list[int], title: str,
                xlabel: str = "expert") -> np.ndarray:
    """The heatmap as a [H, W, 3] uint8 image (TensorBoard's add_image with dataformats='HWC')."""
    fig = heatmap_figure([("", ratio_LE, layers)], title, xlabel)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def imbalance_size(panels: int = 1) -> tuple[float, float]:
    """(width, height) in inches: 7 per panel plus 1.25 for the legend, by 4."""
    return 7.0 * panels + 1.25, 4.0


def imbalance_figure(panels: list[tuple[str, np.ndarray, np.ndarray, list[int]]]):
    """Busiest expert over the mean, per step, one line per layer; one panel per
    (run name, steps_S, max_over_mean_SL, model layer numbers), sharing the y axis."""
    from matplotlib import colormaps
    fig = _figure(*imbalance_size(len(panels)))
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    all_layers = sorted({layer for *_, layers in panels for layer in layers})
    colours = colormaps["tab10" if len(all_layers) <= 10 else "viridis"]
    pick = {layer: colours(i if len(all_layers) <= 10 else i / max(len(all_layers) - 1, 1))
            for i, layer in enumerate(all_layers)}
    for ax, (name, steps_S, ratio_SL, layers) in zip(axes, panels, strict=True):
        for row, layer in enumerate(layers):
            ax.plot(steps_S, ratio_SL[:, row], color=pick[layer], linewidth=1.2,
                    label=f"layer {layer}")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.set_title(name, fontsize="medium")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("busiest expert / mean (1 = balanced)")
    if len(all_layers) <= 12:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
        scale = ScalarMappable(Normalize(all_layers[0], all_layers[-1]), cmap=colours)
        fig.colorbar(scale, ax=list(axes), label="model layer")
    fig.suptitle("load imbalance over steps")
    return fig


def tokens_size(num_layers: int) -> tuple[float, float]:
    """(width, height) in inches: up to 4 layer panels a row, each 3.25 by 2.5, plus 0.5 of
    margin across and 0.75 down (title, legend)."""
    cols = min(num_layers, 4)
    return 3.25 * cols + 0.5, 2.5 * math.ceil(num_layers / cols) + 0.75


def tokens_figure(runs: list[tuple[str, int, np.ndarray, list[int]]]):
    """Tokens per expert at one step, one small panel per model layer; with two runs, paired bars
    (run name, step, tokens_LE, model layer numbers). The dashed line is a uniform share."""
    all_layers = sorted({layer for *_, layers in runs for layer in layers})
    num_experts = max(tokens_LE.shape[1] for _, _, tokens_LE, _ in runs)
    cols = min(len(all_layers), 4)
    fig = _figure(*tokens_size(len(all_layers)))
    axes = fig.subplots(math.ceil(len(all_layers) / cols), cols, squeeze=False).ravel()
    width = 0.8 / len(runs)
    for ax, layer in zip(axes, all_layers):
        for i, (name, step, tokens_LE, layers) in enumerate(runs):
            if layer not in layers:
                continue
            load_E = tokens_LE[layers.index(layer)]
            x_E = np.arange(load_E.size) + (i - (len(runs) - 1) / 2) * width
            bars = ax.bar(x_E, load_E, width=width, label=f"{name} (step {step})")
            ax.axhline(load_E.mean(), color=bars.patches[0].get_facecolor(), linestyle="--",
                       linewidth=1)
        _index_ticks(ax.xaxis, list(range(num_experts)))
        ax.set_title(f"layer {layer}", fontsize="medium")
        ax.set_xlabel("expert", fontsize="small")
        ax.set_ylabel("tokens", fontsize="small")
        ax.tick_params(labelsize="x-small")
    for ax in axes[len(all_layers):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    at = f" at step {runs[0][1]}" if len(runs) == 1 else ""
    fig.suptitle(f"tokens per expert{at} (dashed: uniform share)")
    if len(runs) > 1:
        fig.legend(handles, labels, loc="outside lower center", ncols=len(runs), fontsize="small")
    return fig


def save(fig, path: str) -> str:
    """Writes the figure as PNG at its own size (width x height x DPI pixels)."""
    fig.savefig(path, dpi=DPI, format="png")
    return path
