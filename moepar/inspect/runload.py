"""Reads a run directory's expert_load.jsonl (written by moepar.metrics.MetricsWriter) into arrays,
with errors that say what is wrong with the directory or which line of the file.

Legend: S recorded steps, L MoE layers, E experts.

A crash can tear the file's last line only (each step is appended as one line): a last line that
is not JSON is left out and reported (`RunLoad.torn_line`); any other bad line (not JSON, or JSON
of the wrong shape) means the file is damaged or foreign, and is refused with its line number.
"""

import math
import os
from dataclasses import dataclass

import numpy as np

from moepar.jsonfile import open_regular, parse_json

from moepar.metrics import LOAD_FILE, LOAD_FORMAT, LOAD_VERSION

__all__ = ["InspectError", "RunLoad", "read_run"]


class InspectError(ValueError):
    """A run directory or expert-load file that cannot be inspected; the message says why."""


@dataclass
class RunLoad:
    run_dir: str
    layers: list[int]              # the model's layer numbers of the MoE layers (rows)
    num_experts: int
    steps_S: np.ndarray            # int64, strictly increasing
    tokens_SLE: np.ndarray         # routed copies per expert (before drops), float64
    dropped_SL: np.ndarray
    assigned_SL: np.ndarray        # routed copies per layer (tokens * top_k, or the router's)
    bias_SLE: np.ndarray | None    # the expert-selection bias after each step, when learned
    torn_line: int | None = None   # 1-based line number of a torn last line that was left out
    entropy_SL: np.ndarray | None = None   # router entropy over log E (NaN where not recorded)
    expert_ms_LP: np.ndarray | None = None  # the last measured expert time per EP rank

    @property
    def name(self) -> str:
        return self.run_dir.rstrip("/") or self.run_dir


def _check_dir(run_dir: str) -> str:
    if not os.path.exists(run_dir):
        raise InspectError(f"run directory {run_dir!r} does not exist")
    if not os.path.isdir(run_dir):
        raise InspectError(f"{run_dir!r} is not a directory; give the run's directory (run.dir)")
    path = os.path.join(run_dir, LOAD_FILE)
    if os.path.isfile(path):
        return path
    if any(os.path.exists(os.path.join(run_dir, f)) for f in ("config.toml", "metrics.jsonl")):
        raise InspectError(f"{run_dir!r} is a moepar run without {LOAD_FILE}: it was written by "
                           "an older moepar, or has not finished a step yet")
    raise InspectError(f"{run_dir!r} is not a moepar run directory: it has none of config.toml, "
                       f"metrics.jsonl, {LOAD_FILE}")


def _header(path: str, line: str) -> tuple[list[int], int]:
    try:
        header = parse_json(line, f"{path}:1")
        if header.get("format") != LOAD_FORMAT:
            raise ValueError
    except (ValueError, AttributeError):
        raise InspectError(f"{path}:1: not a moepar expert-load file (its first line is not a "
                           f"{LOAD_FORMAT!r} header)") from None
    if header.get("version") != LOAD_VERSION:
        raise InspectError(f"{path}:1: format version {header.get('version')!r}; this moepar "
                           f"reads version {LOAD_VERSION}")
    layers, num_experts = header.get("layers"), header.get("num_experts")
    if not (isinstance(layers, list) and all(isinstance(x, int) for x in layers)
            and isinstance(num_experts, int) and num_experts > 0):
        raise InspectError(f"{path}:1: the header needs 'layers' (a list of layer numbers) and "
                           f"'num_experts' (a positive integer), got {line.strip()[:200]}")
    return layers, num_experts


def _matrix(record: dict, key: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        value = np.asarray(record[key], dtype=np.float64)
    except KeyError:
        raise ValueError(f"no {key!r}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{key!r} is not a list of numbers") from None
    if value.shape != shape:
        raise ValueError(f"{key!r} has shape {list(value.shape)}, expected {list(shape)} "
                         "(layers x experts from the header)")
    return value


def read_run(run_dir: str) -> RunLoad:
    """The run's recorded expert loads; raises InspectError naming the problem."""
    path = _check_dir(run_dir)
    with open_regular(path) as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()                      # the newline that ends the last complete line
    if not lines:
        raise InspectError(f"{path} is empty: the run has not started writing")
    layers, num_experts = _header(path, lines[0])
    if not layers:
        raise InspectError(f"{run_dir!r}: the model has no MoE layers, so there is no expert "
                           "load to inspect")
    shape_LE, shape_L = (len(layers), num_experts), (len(layers),)
    steps, tokens, dropped, assigned, bias = [], [], [], [], []
    entropy, expert_ms = [], None
    torn = None
    for number, line in enumerate(lines[1:], start=2):
        try:
            record = parse_json(line, f"{path}:{number}")
        except ValueError as e:
            if number == len(lines):     # only the last line can be torn by a crash mid-write
                torn = number
                break
            raise InspectError(str(e)) from None
        try:
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("no integer 'step'")
            if steps and record["step"] <= steps[-1]:
                raise ValueError(f"step {record['step']} after step {steps[-1]} (steps must "
                                 "increase; two runs written into one file?)")
            row = (_matrix(record, "tokens", shape_LE), _matrix(record, "dropped", shape_L),
                   _matrix(record, "assigned", shape_L),
                   _matrix(record, "bias", shape_LE) if "bias" in record else None)
        except ValueError as e:
            raise InspectError(f"{path}:{number}: {e}") from None
        steps.append(record["step"])
        entropy.append(record.get("entropy", [math.nan] * len(layers)))
        if isinstance(record.get("expert_ms"), list):
            expert_ms = record["expert_ms"]
        for target, value in zip((tokens, dropped, assigned, bias), row, strict=True):
            target.append(value)
    if not steps:
        note = f" (line {torn} is torn)" if torn else ""
        raise InspectError(f"{run_dir!r} has no recorded steps yet: {LOAD_FILE} holds only its "
                           f"header{note}")
    bias_SLE = None
    if any(b is not None for b in bias):
        bias_SLE = np.stack([np.full(shape_LE, np.nan) if b is None else b for b in bias])
    try:
        entropy_SL = np.asarray(entropy, dtype=np.float64).reshape(len(steps), len(layers))
        ms_LP = None if expert_ms is None else np.asarray(expert_ms, dtype=np.float64)
        if ms_LP is not None and (ms_LP.ndim != 2 or ms_LP.shape[0] != len(layers)):
            raise ValueError("expert_ms is not [layers][EP ranks]")
    except ValueError as e:
        raise InspectError(f"{path}: 'entropy' or 'expert_ms' is malformed ({e})") from None
    return RunLoad(run_dir, layers, num_experts, np.asarray(steps, dtype=np.int64),
                   np.stack(tokens), np.stack(dropped), np.stack(assigned), bias_SLE, torn,
                   entropy_SL, ms_LP)
