"""Routing record and replay files: every MoE layer's final expert choices per step, keyed by
token position, so that a run in another layout (or a rollout) can replay them.

Legend: n sequences of one file, S tokens per sequence, K experts per token, E experts.

    DIR/routing.json                              the header (below)
    DIR/step_00000001/seq_000000-000004.safetensors   sequences [0, 4) of step 1's global batch

Header: {"format": "moepar.routing", "version": 1, "layers": [model layer number of each MoE
layer], "num_experts": E, "top_k": K, "seq_len": S, "sequences_per_step": global batch}. A step
file holds `input_ids` [n, S] (int64: the replay checks that it trains on the same tokens) and
`layer_<L>` [n, S, K] per MoE layer (int16, int32 from E > 16384): the experts of each token's
K copies after capacity drops, id E + e for a copy of expert e that capacity dropped (a replay
drops it too, and counts it in the balance losses as the recorded run did). Position (step, sequence of the step's
global batch, token) is the key, so any micro-batch size and any dp/ep split read it; each
rank writes the sequences it routed, and a reader takes the rows it needs from whichever
files hold them. Pipeline and tensor parallelism (each rank routes part of a sequence or some
layers) are refused by the config.

`train.record_routing = DIR` writes a file per rank per step (one device-to-host copy at the
step's end); `train.router_replay = DIR` reads them at each step's start (host file reads, one
host-to-device copy per layer and micro-batch, before the step's forward). Neither talks to
other ranks: every rank reads and writes its own sequences. `moepar generate
--record-routing DIR` writes a rollout as step 1; `from_routed_experts` reads the
`routed_experts` array vLLM and SGLang return ([tokens, layers, K], int32, -1 where a layer has
no routed expert).
"""

import base64
import json
import os
import re
import shutil

import numpy as np
import torch

from moepar.jsonfile import parse_json
from moepar.layers.replay import RoutingTape, attach_tape, final_choices
from moepar.metrics import moe_layer_numbers
from moepar.tensorfile import read_box, read_header, write_tensors

__all__ = ["ROUTING_FORMAT", "RoutingError", "routing_header", "check_replay_dir",
           "write_step", "read_step", "from_routed_experts", "StepRouting", "RolloutRecorder"]

ROUTING_FORMAT = "moepar.routing"
ROUTING_VERSION = 1
HEADER = "routing.json"
_FILE = re.compile(r"seq_(\d+)-(\d+)\.safetensors$")


class RoutingError(ValueError):
    """A routing directory that does not match the run (layers, experts, steps, tokens)."""


def routing_header(model_cfg, seq_len: int, sequences: int) -> dict:
    return {"format": ROUTING_FORMAT, "version": ROUTING_VERSION,
            "layers": moe_layer_numbers(model_cfg), "num_experts": model_cfg.num_experts,
            "top_k": model_cfg.top_k, "seq_len": seq_len, "sequences_per_step": sequences}


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def write_header(root: str, header: dict):
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, HEADER)
    with open(path + ".tmp", "w") as f:
        json.dump(header, f)
    os.replace(path + ".tmp", path)


def check_replay_dir(root: str, header: dict, steps: range):
    """Raises RoutingError naming the key unless `root` was recorded for this model and shape
    and holds every step in `steps`; before any process group exists."""
    path = os.path.join(root, HEADER)
    if not os.path.isfile(path):
        raise RoutingError(f"train.router_replay={root!r}: no {HEADER} there (record one with "
                           "train.record_routing or moepar generate --record-routing)")
    with open(path) as f:
        found = parse_json(f.read(), path)
    if not isinstance(found, dict) or found.get("format") != ROUTING_FORMAT:
        raise RoutingError(f"train.router_replay={root!r}: {path} is not a {ROUTING_FORMAT} header")
    for key, what in (("layers", "MoE layer numbers"), ("num_experts", "model.num_experts"),
                      ("top_k", "model.top_k"), ("seq_len", "train.seq_len")):
        if found.get(key) != header[key]:
            raise RoutingError(f"train.router_replay={root!r} was recorded with {key}="
                               f"{found.get(key)}, this run has {what}={header[key]}")
    missing = [s for s in steps if not os.path.isdir(step_dir(root, s))]
    if missing:
        raise RoutingError(f"train.router_replay={root!r} has no routing for step {missing[0]} "
                           f"({len(missing)} of steps {steps.start}-{steps.stop - 1} missing; "
                           "lower train.steps or record more)")


def write_step(root: str, step: int, first: int, input_ids_nS, experts: dict, num_experts: int):
    """Writes sequences [first, first + n) of `step`: input ids and {layer: [n, S, K]} (host)."""
    folder = step_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    dtype = torch.int16 if 2 * num_experts <= 2 ** 15 else torch.int32
    entries = [("input_ids", torch.int64, tuple(input_ids_nS.shape), lambda: input_ids_nS)]
    for layer, e_nSK in sorted(experts.items()):
        value = e_nSK.to(dtype)
        entries.append((f"layer_{layer}", dtype, tuple(value.shape), lambda v=value: v))
    name = f"seq_{first:06d}-{first + input_ids_nS.shape[0]:06d}.safetensors"
    write_tensors(os.path.join(folder, name + ".tmp"), entries)
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))


def read_step(root: str, step: int, first: int, stop: int, layers: list[int]):
    """(input_ids [n, S], {layer: [n, S, K] int64}) for sequences [first, stop) of `step`, from
    whichever files hold them; RoutingError if a sequence is missing or held twice."""
    folder = step_dir(root, step)
    spans = sorted((int(m[1]), int(m[2]), m[0]) for m in map(_FILE.match, os.listdir(folder))
                   if m) if os.path.isdir(folder) else []
    ids, out, at = [], {layer: [] for layer in layers}, first
    for a, b, name in spans:
        if b <= at or a >= stop:
            continue
        if a > at:
            break
        header, data = read_header(os.path.join(folder, name))
        lo, hi = at - a, min(b, stop) - a

        def rows(key):
            entry = header.get(key)
            if entry is None:
                raise RoutingError(f"{folder}/{name} has no {key}")
            sizes = [hi - lo] + entry["shape"][1:]
            return read_box(os.path.join(folder, name), entry, data, [lo] + [0] * (len(sizes) - 1),
                            sizes)
        ids.append(rows("input_ids"))
        for layer in layers:
            out[layer].append(rows(f"layer_{layer}").long())
        at = a + hi
    if at < stop:
        raise RoutingError(f"routing replay: step {step} in {folder} has no routing for sequence "
                           f"{at} (this rank trains on sequences {first}-{stop - 1})")
    return torch.cat(ids), {layer: torch.cat(parts) for layer, parts in out.items()}


def from_routed_experts(data, top_k: int, moe_layers: list[int], num_layers: int | None = None):
    """{model layer: [T, K] int64} from a vLLM/SGLang `routed_experts`: a [T, layers, K] int32
    array, or its flat bytes base64-encoded (SGLang's `meta_info["routed_experts"]`). Its layer
    axis is every model layer (`num_layers`, -1 on dense ones) or only the MoE layers. SGLang
    returns positions [0, seqlen - 1): the inputs a training step sees for the whole sequence."""
    if isinstance(data, (str, bytes)):
        data = np.frombuffer(base64.b64decode(data), dtype="<i4")
    array = np.asarray(data)
    if array.dtype.kind not in "iu":
        raise RoutingError(f"routed_experts has dtype {array.dtype}, expected integer expert ids")
    width = array.size // max(top_k, 1)
    counts = [n for n in (num_layers, len(moe_layers)) if n]
    axis = next((n for n in counts if width % n == 0), None)
    if axis is None or array.size % top_k:
        raise RoutingError(f"routed_experts of {array.size} ids does not split into [tokens, "
                           f"layers, top_k={top_k}] with layers = {' or '.join(map(str, counts))}")
    array = array.reshape(-1, axis, top_k)
    rows = moe_layers if axis == num_layers and axis != len(moe_layers) else range(axis)
    out = {}
    for layer, row in zip(moe_layers, rows, strict=True):
        e_TK = torch.from_numpy(array[:, row].astype(np.int64))
        if (e_TK < 0).any():
            raise RoutingError(f"routed_experts has no expert (-1) for MoE layer {layer}")
        out[layer] = e_TK
    return out


class StepRouting:
    """The trainer's side: before a step, the replayed experts of this rank's micro-batches; after
    it, this rank's recorded choices written. `first_sequence`: the rank's first sequence of each
    step's global batch (its micro-batches are contiguous)."""

    def __init__(self, cfg, model, first_sequence: int, resume_step: int, rank0: bool):
        t = cfg.train
        self.record, self.replay = t.record_routing, t.router_replay
        self.layers = moe_layer_numbers(cfg.model)
        self.num_experts, self.top_k = cfg.model.num_experts, cfg.model.top_k
        self.first, self.micro_size = first_sequence, t.micro_batch_size
        self.tape = RoutingTape()
        attach_tape(model, self.tape)
        self.device = next(model.parameters()).device
        if self.record and rank0:
            write_header(self.record, routing_header(cfg.model, t.seq_len, t.global_batch_size))
            # Steps after the checkpoint are recorded again, maybe split otherwise: none kept.
            for name in os.listdir(self.record):
                if name.startswith("step_") and int(name[5:]) > resume_step:
                    shutil.rmtree(os.path.join(self.record, name))

    def begin(self, step: int, inputs: list):
        replay = None
        if self.replay:
            stop = self.first + self.micro_size * len(inputs)
            ids, experts = read_step(self.replay, step, self.first, stop, self.layers)
            for layer, e in experts.items():
                if e.numel() and not (0 <= int(e.min()) and int(e.max()) < 2 * self.num_experts):
                    raise RoutingError(f"train.router_replay={self.replay!r}: step {step}, MoE "
                                       f"layer {layer} has expert ids outside [0, "
                                       f"{2 * self.num_experts})")
            mine = torch.cat(inputs)
            if mine.device.type == "cpu" and not torch.equal(ids, mine):
                raise RoutingError(f"train.router_replay={self.replay!r}: step {step}'s tokens "
                                   f"(sequences {self.first}-{stop - 1}) differ from this run's; "
                                   "replay needs the recorded data order (data, seed, batch size)")
            replay = [{layer: e[n * self.micro_size:(n + 1) * self.micro_size].reshape(
                -1, self.top_k).to(self.device, non_blocking=True)
                for layer, e in experts.items()} for n in range(len(inputs))]
        self.tape.begin(replay)
        self.inputs = inputs

    def end(self, step: int):
        recorded = self.tape.end()
        if not self.record:
            return
        if len(recorded) != len(self.inputs):
            raise RuntimeError(f"routing record: {len(recorded)} forwards for "
                               f"{len(self.inputs)} micro-batches")
        seq_len = self.inputs[0].shape[1]
        flat = torch.cat([micro[layer].reshape(-1) for layer in self.layers
                          for micro in recorded]).cpu()          # the step's one copy
        per_layer = flat.view(len(self.layers), -1, seq_len, self.top_k)
        write_step(self.record, step, self.first, torch.cat(self.inputs).cpu(),
                   dict(zip(self.layers, per_layer, strict=True)), self.num_experts)


class RolloutRecorder:
    """`moepar generate --record-routing DIR`: forward hooks on each MoE layer's router keep the
    choices of every decoding call (prefill, then one token at a time) in position order; `write`
    saves them as step 1 of DIR for the sequence's positions 0 .. S-2 (the last sampled token is
    never fed), with input_ids = the sequence without its last token, as a training step would
    see it."""

    def __init__(self, model, batch_size: int):
        self.cfg, self.batch_size = model.cfg, batch_size
        self.calls = {block.layer_id: [] for block in model.layers if block.is_moe}
        for block in model.layers:
            if block.is_moe:
                block.ffn.router.register_forward_hook(self._keep(block.layer_id,
                                                                  block.ffn.top_k))

    def _keep(self, layer: int, top_k: int):
        def hook(_module, _args, out):
            e_TK = final_choices(out.routing, top_k)
            self.calls[layer].append(e_TK.view(self.batch_size, -1, top_k))
        return hook

    def write(self, root: str, output_ids_BS: torch.Tensor):
        if os.path.isdir(root) and any(n.startswith("step_") for n in os.listdir(root)):
            raise RoutingError(f"--record-routing {root!r} already holds recorded steps; choose "
                               "a new directory")
        experts = {layer: torch.cat(calls, dim=1).cpu() for layer, calls in self.calls.items()}
        seq_len = output_ids_BS.shape[1] - 1
        write_header(root, routing_header(self.cfg, seq_len, self.batch_size))
        write_step(root, 1, 0, output_ids_BS[:, :seq_len].cpu().long(),
                   {k: v[:, :seq_len] for k, v in experts.items()}, self.cfg.num_experts)
