"""Routing tape: records each MoE layer's final expert choices, or hands them back for replay.

Legend: T tokens of one micro-batch, K experts per token, E experts; a recorded id E + e marks a
copy of expert e that capacity dropped (the router's `Routing.expert_N` holds E there).

The training step owns one `RoutingTape` for the whole model (moepar/routing.py reads and writes
its files). Between `begin` and `end` it is active: each training forward of the whole model
(`Transformer.forward`) calls `next_micro`, and each MoE layer asks its `LayerTape` for the
replayed experts of the current micro-batch (`replayed`, [T, K] on the device) and records what
it routed (`record`). Activation recompute re-runs a block inside the same micro-batch's
backward, before the next micro-batch's forward (pipelining is refused for this reason), so the
cursor still names that micro-batch; a recomputed record overwrites the same values. Outside
`begin`/`end` (validation, generation) the tape is inert. No device-to-host copy here: the
recorded tensors stay on the device until the step's end.
"""

import torch

__all__ = ["RoutingTape", "LayerTape", "attach_tape", "final_choices"]


class RoutingTape:
    def __init__(self):
        self.active = False
        self.micro = -1
        self.replay = None            # [micro] -> {layer id: expert_TK}, or None (recording)
        self.recorded = []            # [micro] -> {layer id: expert_TK}

    def begin(self, replay: list[dict] | None = None):
        """Starts a step; `replay`: per local micro-batch, the experts each MoE layer must use."""
        self.active, self.micro, self.replay, self.recorded = True, -1, replay, []

    def next_micro(self):
        if self.active:
            self.micro += 1
            self.recorded.append({})

    def end(self) -> list[dict]:
        """Stops the step; returns what was recorded, per micro-batch {layer id: expert_TK}."""
        self.active, recorded, self.recorded, self.replay = False, self.recorded, [], None
        return recorded


class LayerTape:
    """One MoE layer's view of the tape (the layer does not know its own number)."""

    def __init__(self, tape: RoutingTape, layer_id: int):
        self.tape, self.layer_id = tape, layer_id

    def replayed(self) -> torch.Tensor | None:
        tape = self.tape
        if not tape.active or tape.replay is None:
            return None
        if tape.micro >= len(tape.replay) or self.layer_id not in tape.replay[tape.micro]:
            raise RuntimeError(f"routing replay has no experts for MoE layer {self.layer_id} in "
                               f"micro-batch {tape.micro} of this step")
        return tape.replay[tape.micro][self.layer_id]

    def record(self, routing, top_k: int):
        """Keeps a top-k `Routing`'s final choices: id e for a copy kept by expert e, E + e for
        a copy of e that capacity dropped (so a replay drops it and still counts it)."""
        tape = self.tape
        if tape.active and tape.micro >= 0:
            tape.recorded[tape.micro][self.layer_id] = final_choices(routing, top_k)


def final_choices(routing, top_k: int) -> torch.Tensor:
    """[T, K] of a top-k `Routing`: e for a copy expert e kept, E + e for one capacity dropped."""
    expert_N, choice_N = routing.expert_N.detach(), routing.choice_N.detach()
    return torch.where(expert_N == choice_N, expert_N, expert_N + choice_N).view(-1, top_k)


def attach_tape(model, tape: RoutingTape | None):
    """Gives `model` (a Transformer) and each of its MoE layers the tape, or takes it away."""
    model.routing_tape = tape
    for block in model.layers:
        if block.is_moe:
            block.ffn.routing_tape = None if tape is None else LayerTape(tape, block.layer_id)
