"""What `moepar plan` plans for: MODEL as a moepar run config (TOML) or a Hugging Face config.json
(the file, or the folder holding it) of any architecture `moepar convert` reads; and the expert
load factor a run measured (`--from-run RUN`)."""

import math
import os
import shutil
import tempfile

from moepar.config import DataConfig, RunConfig, load_config, to_toml
from moepar.expert_placement import measured_load
from moepar.hf.arch import ConversionError, read_hf_config
from moepar.jsonfile import open_regular, parse_json
from moepar.metrics import moe_layer_numbers
from moepar.parallel.expert_map import balanced, contiguous, imbalance

__all__ = ["load_model", "imbalance_from_run", "placement_imbalance"]


def load_model(path: str, overrides: list[str] = ()) -> tuple[RunConfig, str]:
    """(base run config, what it is) for a TOML config or a Hugging Face config.json / folder,
    with `--section.key=value` overrides applied. Raises ValueError naming the problem."""
    cfg, source = _load(path)
    if not overrides:
        return cfg, source
    if source.startswith("moepar config"):
        return load_config(path, list(overrides)), source
    with tempfile.TemporaryDirectory() as tmp:    # the trainer's own override path
        toml = os.path.join(tmp, "base.toml")
        with open(toml, "w") as f:
            f.write(to_toml(cfg))
        try:
            return load_config(toml, list(overrides)), source
        except ValueError as e:
            raise ValueError(str(e).replace(toml, path)) from None


def _load(path: str) -> tuple[RunConfig, str]:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return _from_hf(path)
        raise ValueError(f"MODEL {path!r} is a folder without config.json (give a moepar TOML "
                         "config or a Hugging Face model folder)")
    if not os.path.isfile(path):
        raise ValueError(f"MODEL {path!r} does not exist")
    if path.endswith(".json"):
        if os.path.basename(path) == "config.json":
            return _from_hf(os.path.dirname(path) or ".")
        with tempfile.TemporaryDirectory() as tmp:   # read_hf_config reads <folder>/config.json
            shutil.copyfile(path, os.path.join(tmp, "config.json"))
            cfg, _ = _from_hf(tmp)
        return cfg, f"Hugging Face config {path}"
    return load_config(path), f"moepar config {path}"


def _from_hf(folder: str) -> tuple[RunConfig, str]:
    try:
        arch, model, router = read_hf_config(folder)
    except ConversionError as e:
        raise ValueError(str(e)) from None
    except (KeyError, TypeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{os.path.join(folder, 'config.json')}: {what}") from None
    if model.vocab_size < 256:
        raise ValueError(f"{folder}/config.json: vocab_size={model.vocab_size} is below the 256 "
                         "byte ids of moepar's builtin data, which a written plan trains on")
    return (RunConfig(model=model, router=router, data=DataConfig(source="builtin")),
            f"Hugging Face {arch.name} config {folder}")


def imbalance_from_run(run_dir: str) -> tuple[float, str]:
    """The dropless imbalance factor a run measured: the largest `max_load_ratio` (busiest
    expert's routed tokens over the mean, worst layer) in the later half of its metrics.jsonl
    (early steps, with a fresh router, are not what a continued run sees). Returns (factor,
    where it came from)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise ValueError(f"--from-run {run_dir!r} is not a directory")
    if not os.path.isfile(path):
        raise ValueError(f"--from-run {run_dir!r} has no metrics.jsonl (a run directory of "
                         "`moepar train` has one)")
    records = []
    with open_regular(path, "--from-run:") as f:
        for line in f:
            try:
                record = parse_json(line, path)
                ratio = float(record["max_load_ratio"])
            except (ValueError, KeyError, TypeError, OverflowError):
                continue        # a torn line from a crash, or a foreign one
            if not record.get("skipped") and math.isfinite(ratio) and ratio > 0:
                records.append((record.get("step", len(records) + 1), ratio))
    if not records:
        raise ValueError(f"{path} holds no step with a max_load_ratio")
    later = records[len(records) // 2:]
    factor = max(r for _, r in later)
    return max(factor, 1.0), (f"max_load_ratio of {path}, max over steps {later[0][0]}.."
                              f"{later[-1][0]} ({len(later)} steps)")


def placement_imbalance(run_dir: str, model_cfg, world: int, placement: str,
                        replicas: int) -> tuple[dict[int, float], str]:
    """Per EP size (every divisor of the expert count up to `world`), the busiest EP rank's rows
    over the mean under `placement` (contiguous, or balanced with `replicas` replica slots) of
    the load `run_dir` measured in the later half of its expert_load.jsonl, worst layer: what
    `--from-run RUN --placement` plans with. Returns (factors, where they came from)."""
    E, layers = model_cfg.num_experts, moe_layer_numbers(model_cfg)
    load_LE = measured_load(run_dir, 0, layers, E, later_half=True)
    factors = {}
    for ep in (n for n in range(1, min(E, world) + 1) if E % n == 0):
        maps = [balanced(load_E, ep, replicas) if placement == "balanced" else contiguous(E, ep)
                for load_E in load_LE]
        factors[ep] = max(max(imbalance(m, load_E) for m, load_E in zip(maps, load_LE,
                                                                         strict=True)), 1.0)
    extra = f" with {replicas} replica slot(s) per rank" if placement == "balanced" else ""
    return factors, (f"{placement} placement{extra} of the load in {run_dir}'s expert_load.jsonl "
                     f"(later half), busiest EP rank over the mean, per ep")
