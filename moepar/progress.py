"""The training progress line: loss and router health of the step, throughput averaged over the
logging window, elapsed time and ETA; pure functions of host numbers, so printing adds no sync.

    step   40/200 | loss 4.1234 | ... | 12.3k tok/s | 0:00:41 elapsed, eta 0:02:44

tok/s is the tokens of the steps since the last printed line over the wall time since it (one
step's rate swings with checkpoint saves, validation and the first step's warm-up; a window's
does not hide them either, it spreads them). The ETA is the steps left at the window's step rate.
"""

__all__ = ["Progress", "progress_line", "duration", "count_text", "params_text", "start_summary"]


def duration(seconds: float) -> str:
    """'H:MM:SS' (hours unbounded), rounded to the second."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def count_text(n: float) -> str:
    """2822272 -> '2.82M' (k, M, B, T)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def params_text(counts: dict) -> str:
    """The start-up line of `moepar.layers.shapes.param_count`'s numbers."""
    return (f"parameters: {counts['total']:,} total ({count_text(counts['total'])}), "
            f"{counts['active']:,} active per token ({count_text(counts['active'])})")


def start_summary(cfg, config: str, overrides: list[str]) -> str:
    """What `moepar train` prints at start instead of the whole resolved config (which goes to
    run.dir/config.toml, and to the screen with --verbose): the config and its overrides, the
    model's shape, the run's length and where it writes."""
    m, r, t = cfg.model, cfg.router, cfg.train
    moe = sum(map(m.is_moe_layer, range(m.num_layers)))
    if moe:
        cap = "dropless" if r.capacity_factor is None else f"capacity {r.capacity_factor:g}"
        ffn = (f"{m.num_layers - moe} dense, {moe} MoE: top-{m.top_k} of {m.num_experts} "
               f"experts, {r.type} {r.score_func}, {cap}")
    else:
        ffn = "all dense, no MoE layer"
    given = f" {' '.join(overrides)}" if overrides else ""
    return "\n".join([
        f"config: {config}{given}",
        f"model: {m.num_layers} layers ({ffn}), dim {m.dim}, {m.attention} attention, "
        f"vocabulary {m.vocab_size}",
        f"train: {t.steps} steps of {t.global_batch_size} x {t.seq_len} tokens, lr {t.lr:g}, "
        f"{t.dtype}, seed {t.seed}; data {cfg.data.source}"
        + (f" {cfg.data.path or ','.join(cfg.data.paths)}" if cfg.data.source != "builtin" else ""),
        f"run: {cfg.run.dir} (the resolved config: {cfg.run.dir}/config.toml; --verbose prints "
        "it here)"])


def progress_line(r: dict, total_steps: int, tokens_per_s: float, elapsed_s: float,
                  eta_s: float | None) -> str:
    """One record of `Trainer.train_step` with the window's rate and the clock; the router's
    fields (aux and z loss, load, drops) only when the model has MoE layers (the record has
    them)."""
    eta = duration(eta_s) if eta_s is not None else "?"
    moe = "aux_loss" in r
    return (f"step {r['step']:>5}/{total_steps} | loss {r['loss']:.4f} | "
            + (f"mtp {r['mtp_loss']:.4f} | " if "mtp_loss" in r else "")
            + (f"aux {r['aux_loss']:.4f} | z {r['z_loss']:.2e} | " if moe else "")
            + f"gnorm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | {tokens_per_s / 1000:.1f}k tok/s | "
            + (f"load max/mean {r['max_load_ratio']:.2f} | drop {100 * r['drop_fraction']:.1f}% | "
               if moe else "")
            + f"{duration(elapsed_s)} elapsed, eta {eta}")


class Progress:
    """The window between printed lines. `start_step`: the step training starts from (a resumed
    run's), `now`: the clock (time.perf_counter) when it starts."""

    def __init__(self, total_steps: int, tokens_per_step: int, start_step: int, now: float):
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.started = now
        self.mark = (start_step, now)          # (step, time) of the last printed line

    def window(self, step: int, now: float) -> tuple[float, float | None]:
        """(tokens/s over the window, seconds left at its step rate) at `step`, `now`."""
        steps, seconds = step - self.mark[0], now - self.mark[1]
        if steps <= 0 or seconds <= 0:
            return 0.0, None
        rate = steps / seconds
        return steps * self.tokens_per_step / seconds, (self.total_steps - step) / rate

    def line(self, record: dict, now: float) -> str:
        """The progress line for `record`; starts the next window."""
        tokens_per_s, eta = self.window(record["step"], now)
        self.mark = (record["step"], now)
        return progress_line(record, self.total_steps, tokens_per_s, now - self.started, eta)
