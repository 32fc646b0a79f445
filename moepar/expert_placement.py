"""A run's expert placement (parallel.expert_placement): contiguous, balanced from a run's
measured load (parallel.placement_from, its expert_load.jsonl), or a JSON file; resolved on
every rank from files alone, before any collective, into one ExpertMap per MoE layer
(moepar/parallel/expert_map.py).

The JSON file (`write_placement` writes one):

    {"format": "moepar.expert_placement", "version": 1, "num_experts": 8, "ep": 2,
     "layers": {"1": [[5, 0, 3, 6, 5], [1, 2, 4, 7, 0]], ...}}

one list per EP rank and MoE layer: the experts it owns first (E/ep of them), then its replica
slots (parallel.expert_replicas of them).
"""

import json
import os

import numpy as np

from moepar.jsonfile import open_regular, parse_json
from moepar.metrics import LOAD_FILE, LOAD_FORMAT, moe_layer_numbers
from moepar.parallel.expert_map import ExpertMap, balanced, check_slots, contiguous, imbalance

__all__ = ["build_expert_maps", "read_placement", "write_placement", "measured_load", "describe",
           "Replacer", "PLACEMENT_FORMAT"]

PLACEMENT_FORMAT = "moepar.expert_placement"


def _load_lines(run_dir: str) -> tuple[dict, list[list[list[float]]]]:
    """(header, each recorded step's tokens [L][E]) of `run_dir`'s expert_load.jsonl; a torn last
    line (a crash mid-write) is left out. (`moepar inspect` reads the same file with every check;
    the engine does not import the tool.)"""
    path = os.path.join(run_dir, LOAD_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"parallel.placement_from={run_dir!r} has no {LOAD_FILE} (a run "
                         "directory of `moepar train` has one)")
    with open_regular(path, "parallel.placement_from:") as f:
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    header = parse_json(lines[0], f"{path}:1") if lines else None
    if not isinstance(header, dict) or header.get("format") != LOAD_FORMAT:
        raise ValueError(f"{path}: not a moepar expert-load file (no {LOAD_FORMAT!r} header)")
    steps = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            steps.append(parse_json(line, f"{path}:{number}")["tokens"])
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not an expert-load line") from None
    return header, steps


def measured_load(run_dir: str, window: int, layers: list[int], num_experts: int,
                  later_half: bool = False):
    """Routed copies per expert [L][E], summed over the last `window` recorded steps (0: all;
    `later_half`: the later half, as `moepar plan --from-run` reads) of `run_dir`'s
    expert_load.jsonl; errors name parallel.placement_from."""
    header, steps = _load_lines(run_dir)
    if header.get("num_experts") != num_experts or header.get("layers") != layers:
        raise ValueError(f"parallel.placement_from={run_dir!r} measured "
                         f"{header.get('num_experts')} experts on MoE layers "
                         f"{header.get('layers')}; this model has {num_experts} on {layers}")
    if not steps:
        raise ValueError(f"parallel.placement_from={run_dir!r} has recorded no step yet")
    if later_half:
        window = len(steps) - len(steps) // 2
    tokens_SLE = np.asarray(steps[-window:] if window else steps, dtype=np.float64)
    if tokens_SLE.shape[1:] != (len(layers), num_experts):
        raise ValueError(f"parallel.placement_from={run_dir!r}: its expert_load.jsonl lines are "
                         f"not [{len(layers)}][{num_experts}] tokens per layer and expert")
    return tokens_SLE.sum(0)


def read_placement(path: str, layers: list[int], num_experts: int, ep: int,
                   replicas: int) -> dict[int, ExpertMap]:
    """The placement file at `path`, checked against the model and the layout."""
    where = f"parallel.expert_placement={path!r}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file (give 'contiguous', 'balanced' or the path of a "
                         "placement JSON file)")
    with open_regular(path, where) as f:
        data = parse_json(f.read().decode("utf-8", errors="replace"), path)
    if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
        raise ValueError(f"{where}: not a {PLACEMENT_FORMAT!r} file (no such 'format' field)")
    if data.get("num_experts") != num_experts or data.get("ep") != ep:
        raise ValueError(f"{where}: written for num_experts={data.get('num_experts')} and "
                         f"ep={data.get('ep')}; this run has num_experts={num_experts}, ep={ep}")
    per_layer = data.get("layers")
    if not isinstance(per_layer, dict) or sorted(per_layer) != sorted(map(str, layers)):
        got = sorted(per_layer) if isinstance(per_layer, dict) else per_layer
        raise ValueError(f"{where}: 'layers' must map every MoE layer number {layers} to its "
                         f"slots, got {got}")
    maps = {}
    for layer in layers:
        ranks = per_layer[str(layer)]
        lw = f"{where}, layer {layer}"
        if not (isinstance(ranks, list) and len(ranks) == ep and all(isinstance(r, list)
                                                                     for r in ranks)):
            raise ValueError(f"{lw}: needs one list of slots per EP rank ({ep} lists)")
        sizes = sorted({len(r) for r in ranks})
        if sizes != [num_experts // ep + replicas]:
            raise ValueError(f"{lw}: each rank needs {num_experts // ep} owned + {replicas} "
                             f"replica slots (parallel.expert_replicas), got {sizes}")
        slots = [e for r in ranks for e in r]
        check_slots(slots, num_experts, ep, lw)
        maps[layer] = ExpertMap(tuple(slots), num_experts, ep)
    return maps


def write_placement(path: str, maps: dict[int, ExpertMap], note: dict | None = None):
    """Writes `maps` in the file format above (`note`: extra fields, e.g. the imbalances)."""
    first = next(iter(maps.values()))
    data = {"format": PLACEMENT_FORMAT, "version": 1, "num_experts": first.num_experts,
            "ep": first.ep, "layers": {str(k): m.per_rank() for k, m in maps.items()}}
    data.update(note or {})
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.write("\n")
    os.replace(tmp, path)


def build_expert_maps(cfg, ep: int, gpus_per_node: int = 0) -> dict[int, ExpertMap] | None:
    """The run's placement per MoE layer at this ep; None: contiguous (or ep 1: nothing to
    place). Raises ValueError naming the config key."""
    p, m = cfg.parallel, cfg.model
    if p.expert_placement == "contiguous" or ep == 1:
        return None
    layers = moe_layer_numbers(m)
    if not layers:
        return None
    if p.expert_placement != "balanced":
        return read_placement(p.expert_placement, layers, m.num_experts, ep, p.expert_replicas)
    load_LE = measured_load(p.placement_from, p.placement_window, layers, m.num_experts)
    return {layer: balanced(load_E, ep, p.expert_replicas, gpus_per_node)
            for layer, load_E in zip(layers, load_LE, strict=True)}


def describe(cfg, ep: int, gpus_per_node: int = 0) -> str | None:
    """The start-up log line of a run's placement; for `balanced`, the busiest EP rank's rows over
    the mean of the measured load, contiguous and placed (worst layer). None: contiguous."""
    maps = build_expert_maps(cfg, ep, gpus_per_node)
    if maps is None:
        return None
    p = cfg.parallel
    line = (f"expert placement: {p.expert_placement}, {p.expert_replicas} replica slot(s) per "
            f"EP rank")
    if p.expert_placement != "balanced":
        return line
    layers = list(maps)
    load_LE = measured_load(p.placement_from, p.placement_window, layers, cfg.model.num_experts)
    plain = contiguous(cfg.model.num_experts, ep)
    before = max(imbalance(plain, load_E) for load_E in load_LE)
    after = max(imbalance(m, load_E) for m, load_E in zip(maps.values(), load_LE, strict=True))
    return (f"{line}, from {p.placement_from}'s load: busiest EP rank's rows / mean "
            f"{before:.2f} contiguous -> {after:.2f} (worst layer)")


class Replacer:
    """parallel.replace_every = K: after every K-th step, the balanced placement (with
    parallel.expert_replicas slots) of the load of the last K steps, which every rank holds
    reduced in its step statistics, so every rank computes the same maps; the engine moves the
    experts (parallel/expert_move.py)."""

    def __init__(self, cfg, engine, ep: int, gpus_per_node: int = 0):
        self.cfg, self.engine, self.ep, self.node = cfg, engine, ep, gpus_per_node
        E, layers = cfg.model.num_experts, moe_layer_numbers(cfg.model)
        self.maps = build_expert_maps(cfg, ep, gpus_per_node) or {
            layer: contiguous(E, ep) for layer in layers}
        self.load_LE = None

    def after_step(self, step: int, tokens_LE) -> str | None:
        """Adds the step's load [L, E] (on the device); on a K-th step moves the experts (a
        collective and one host sync) and returns a log line."""
        self.load_LE = tokens_LE.clone() if self.load_LE is None else self.load_LE + tokens_LE
        if step % self.cfg.parallel.replace_every:
            return None
        load_LE, self.load_LE = self.load_LE.tolist(), None
        new = {layer: balanced(load_E, self.ep, self.cfg.parallel.expert_replicas, self.node)
               for layer, load_E in zip(self.maps, load_LE, strict=True)}
        before = max(imbalance(self.maps[k], load) for k, load in zip(self.maps, load_LE))
        after = max(imbalance(new[k], load) for k, load in zip(new, load_LE))
        self.engine.replace_experts(self.maps, new)
        self.maps = new
        return (f"step {step}: experts re-placed from the last {self.cfg.parallel.replace_every} "
                f"step(s)' load: busiest EP rank's rows / mean {before:.2f} -> {after:.2f}")
