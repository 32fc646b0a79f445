"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) and the runner that executes them.

Talks on the `pp` group: point-to-point sends and receives of hidden states (forward) and of
their gradients (backward), one `dist.batch_isend_irecv` per time step that has any; plus one
all-reduce when a runner is built (NCCL wants a collective on the group before partial P2P).

A schedule is, per pipeline rank, an ordered list of actions F(chunk, micro) / B(chunk, micro)
on global chunks (`rank_order`). `timetable` folds the orders of all ranks into one lock-step
grid: at step t a rank runs its next action if that action's inputs were produced at an earlier
step, else it idles. Every rank computes the same grid (pure maths, no processes), so at step t
each rank knows what its neighbours produce and posts the matching receives; the step's sends
and receives go out as one batch, matched within the same step on both sides, so no ordering of
sends and receives can deadlock (tested on gloo), and the ranks of a stage run the same actions in
the same order, so the MoE all-to-alls inside a stage line up too.

| schedule         | order on pp rank r (m micro-batches, p ranks, v chunks per rank) | alive             |
|------------------|------------------------------------------------------------------|-------------------|
| gpipe            | F0 .. F(m-1), then B0 .. B(m-1)                                  | m                 |
| 1f1b             | min(p-r-1, m) warm-up F, then F/B pairs, then the remaining B    | min(p - r, m)     |
| interleaved_1f1b | Megatron-LM's order over m*v chunk-micro-batches; m % p == 0     | 2(p-r-1)+(v-1)p+1 |

"alive" (`peak_in_flight`): chunk-micro-batches whose activations a rank holds at once, never more
than m*v (interleaved with m == p runs all forwards first, as Megatron-LM does, so holds m*v).
With equal-cost actions the grid's idle fraction is exactly `ideal_bubble`: (p-1)/(m+p-1), and
(p-1)/(v*m+p-1) interleaved.

Why not `torch.distributed.pipelining`: its schedules run on gloo, but (torch 2.13) a
PipelineStage infers shapes by running a real forward and backward of the first micro-batch
inside the first step (an extra MoE forward with its all-to-alls and routing statistics, and
behaviour that differs across the torch versions we support), and the schedules expose no hook
per action: the trainer needs each micro-batch's MoE statistics per stage, per-action busy
intervals (the measured bubble), the number of micro-batches alive, and a point to arm the
data-parallel reducer. The schedules are a few dozen lines; writing them keeps all of that plain.
"""

import contextlib
import dataclasses
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["SCHEDULES", "Action", "Event", "check_schedule", "rank_order", "timetable",
           "peak_in_flight", "ideal_bubble", "measured_bubble", "PipelineRunner", "default_loss"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class Action(NamedTuple):
    kind: str    # "F" forward or "B" backward
    chunk: int   # global chunk (owned by pp rank chunk % pp)
    micro: int   # micro-batch index


class Event(NamedTuple):
    """One action's compute interval on this rank (time.perf_counter seconds, no comm inside)."""
    action: Action
    start: float
    end: float


def check_schedule(schedule: str, pp: int, virtual: int, num_micro: int):
    """Raises ValueError naming the numbers when the micro-batches do not fit the schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {SCHEDULES}")
    if num_micro < 1:
        raise ValueError(f"pipeline needs >= 1 micro-batch per step, got {num_micro}")
    if virtual != 1 and schedule != "interleaved_1f1b":
        raise ValueError(f"{virtual} virtual stages per rank need schedule 'interleaved_1f1b'; "
                         f"{schedule!r} runs one chunk per rank (virtual=1)")
    if schedule == "interleaved_1f1b" and num_micro % pp:
        raise ValueError(f"schedule 'interleaved_1f1b' needs the micro-batches per step "
                         f"({num_micro}) to be a multiple of pp={pp}")


def rank_order(schedule: str, pp_rank: int, pp: int, virtual: int, num_micro: int) -> list[Action]:
    """The actions of pipeline rank `pp_rank`, in the order it runs them."""
    check_schedule(schedule, pp, virtual, num_micro)
    m, r = num_micro, pp_rank
    if schedule == "gpipe":
        return [Action("F", r, n) for n in range(m)] + [Action("B", r, n) for n in range(m)]
    if schedule == "1f1b":
        fwd = [Action("F", r, n) for n in range(m)]
        bwd = [Action("B", r, n) for n in range(m)]
        warmup = min(pp - r - 1, m)
    else:
        # Megatron-LM's interleaved order: micro-batches go through the local chunks in groups of
        # pp (forward: chunk 0, 1, ..; backward: the last chunk first).
        total = m * virtual

        def at(k: int, forward: bool) -> tuple[int, int]:
            local = (k % (pp * virtual)) // pp
            local = local if forward else virtual - 1 - local
            return r + local * pp, (k // (pp * virtual)) * pp + k % pp

        fwd = [Action("F", *at(k, True)) for k in range(total)]
        bwd = [Action("B", *at(k, False)) for k in range(total)]
        warmup = total if m == pp else min((pp - r - 1) * 2 + (virtual - 1) * pp, total)
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[len(fwd) - warmup:]


def _inputs_of(action: Action, num_chunks: int) -> list[Action]:
    """The actions whose results `action` consumes."""
    c, n = action.chunk, action.micro
    if action.kind == "F":
        return [Action("F", c - 1, n)] if c > 0 else []
    return [Action("F", c, n)] + ([Action("B", c + 1, n)] if c < num_chunks - 1 else [])


def timetable(schedule: str, pp: int, virtual: int, num_micro: int) -> list[list[Action | None]]:
    """The lock-step grid: grid[rank][step] is the action that rank runs at that step, or None."""
    orders = [rank_order(schedule, r, pp, virtual, num_micro) for r in range(pp)]
    num_chunks = pp * virtual
    done_at: dict[Action, int] = {}
    pos, grid = [0] * pp, [[] for _ in range(pp)]
    step = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        ran = []
        for r in range(pp):
            action = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            if action is not None and all(done_at.get(a, step) < step
                                          for a in _inputs_of(action, num_chunks)):
                ran.append(action)
                pos[r] += 1
            else:
                action = None
            grid[r].append(action)
        if not ran:
            raise RuntimeError(f"schedule {schedule!r} (pp={pp}, virtual={virtual}, "
                               f"micro={num_micro}) cannot make progress at step {step}")
        done_at.update((a, step) for a in ran)
        step += 1
    return grid


def peak_in_flight(order: list[Action]) -> int:
    """The most chunk-micro-batches forwarded but not yet backwarded at once, along `order`."""
    alive = peak = 0
    for action in order:
        alive += 1 if action.kind == "F" else -1
        peak = max(peak, alive)
    return peak


def ideal_bubble(pp: int, num_micro: int, virtual: int = 1) -> float:
    """The idle fraction with equal-cost chunks: (p-1)/(m+p-1), (p-1)/(v*m+p-1) interleaved."""
    return (pp - 1) / (virtual * num_micro + pp - 1)


def measured_bubble(events: list[Event], start: float, end: float) -> float:
    """1 - (time inside actions) / (wall time of the step) on one rank."""
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (end - start) if end > start else 0.0


def default_loss(logits_BSV, targets_BS):
    """Mean cross-entropy, in float32 or wider whatever the logits' dtype (as the trainer)."""
    logits_BSV = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())


def _statistics_only(out):
    """A MoEOutput without its activation and with its losses detached (nothing kept alive)."""
    losses = dataclasses.replace(out.aux_loss, total=out.aux_loss.total.detach())
    return out._replace(y=None, aux_loss=losses)


class PipelineRunner:
    """Runs one step's forwards and backwards of a StageModule under a schedule.

    Each micro-batch's loss is weighted 1/num_micro before backward, and MoE aux losses are
    injected with the same weight (set here on the stage), as the trainer does without pipelining.
    Built once per layout: `grid` (every rank's timetable) and `order` (this rank's actions).
    After `run`: `events` (this rank's compute intervals), `step_start`, `step_end`, and
    `peak_in_flight` (the most chunk-micro-batches whose activations were alive at once).
    """

    def __init__(self, stage, pp_group, schedule: str, num_micro: int, loss_fn=default_loss,
                 autocast=contextlib.nullcontext):
        self.stage, self.group, self.num_micro, self.loss_fn = stage, pp_group, num_micro, loss_fn
        # Entered around each forward and its loss only: backward must not run under autocast
        # (it would recompute fp32 regions such as the router's backward in the autocast dtype).
        self.autocast = autocast
        pp, virtual = stage.pp, stage.virtual
        if pp > 1:
            if pp_group is None or dist.get_world_size(pp_group) != pp:
                size = 0 if pp_group is None else dist.get_world_size(pp_group)
                raise ValueError(f"the stage was split for pp={pp}; the pp group has {size} ranks")
            if dist.get_rank(pp_group) != stage.pp_rank:
                raise ValueError(f"the stage is pp rank {stage.pp_rank}; this process is pp rank "
                                 f"{dist.get_rank(pp_group)}")
            self.peers = [dist.get_global_rank(pp_group, r) for r in range(pp)]
            # Under NCCL a batch of P2P ops that only some ranks join must not be the group's
            # first collective; this all-reduce (every pp rank, once) is.
            dist.all_reduce(torch.zeros(1, device=next(stage.parameters()).device), group=pp_group)
        self.pp, self.me, self.num_chunks = pp, stage.pp_rank, pp * virtual
        self.grid = timetable(schedule, pp, virtual, num_micro)
        self.order = [a for a in self.grid[self.me] if a is not None]
        stage.set_aux_loss_scale(1.0 / num_micro)
        self.events, self.step_start, self.step_end, self.peak_in_flight = [], 0.0, 0.0, 0

    def run(self, inputs: list, targets: list, before_action=None, after_action=None):
        """One step. Every rank passes the step's micro-batches (`inputs` tokens_BS, `targets`
        tokens_BS, num_micro each, the same on all pp ranks): the first stage reads the inputs,
        the last the targets, the others only their shapes. `before_action(action)` is called
        before each of this rank's actions (e.g. to arm a gradient reducer before a last backward),
        `after_action(action)` after it, once the time step's point-to-point traffic is done
        (so a data-parallel reduction never delays the activations or gradients a neighbour
        waits for).

        Returns (loss_sum, moe_outputs): the sum of the micro-batches' (unweighted) losses as a
        detached float64 scalar, zero except on the last stage (sum it over pp to have it everywhere), and per
        micro-batch the list of this rank's MoEOutputs in layer order (for StepStats.add).
        Gradients accumulate into the stage's parameters.

        Collectives: per time step one batch of isend/irecv over pp (hidden states to the next
        chunk's rank, their gradients back to the previous one); no device-to-host sync.
        """
        m = self.num_micro
        if len(inputs) != m or len(targets) != m:
            raise ValueError(f"the runner was built for {m} micro-batches; got {len(inputs)} "
                             f"inputs and {len(targets)} targets")
        param = next(self.stage.parameters())
        # Hidden states and their gradients travel in the residual stream's dtype (the
        # parameters', also under autocast), so receivers know every buffer's shape and dtype.
        batch, seq = targets[0].shape
        shape_BSD = (batch, seq // getattr(self.stage, "seq_split", 1), self.stage.cfg.dim)
        wire_dtype = self.stage.activation_dtype()
        # This step's buffers, keyed (chunk, micro): received inputs and output gradients, what
        # backward needs, MoE outputs; dropped when the step ends.
        loss_sum = torch.zeros((), dtype=torch.float64, device=param.device)
        self._state = dict(inputs=inputs, targets=targets, acts={}, grads={}, saved={}, moe={},
                           loss_sum=loss_sum)
        self.events, alive, self.peak_in_flight = [], 0, 0
        self.step_start = time.perf_counter()
        for step in range(len(self.grid[0])):
            ops = []
            action = self.grid[self.me][step]
            if action is not None:
                if before_action is not None:
                    before_action(action)
                start = time.perf_counter()
                sent = self._forward(action) if action.kind == "F" else self._backward(action)
                self.events.append(Event(action, start, time.perf_counter()))
                alive += 1 if action.kind == "F" else -1
                self.peak_in_flight = max(self.peak_in_flight, alive)
                if sent is not None:
                    peer, tensor = sent
                    if tensor.shape != shape_BSD or tensor.dtype != wire_dtype:
                        raise RuntimeError(f"{action}: sending {tuple(tensor.shape)} "
                                           f"{tensor.dtype}; receivers expect {shape_BSD} {wire_dtype}")
                    ops.append(dist.P2POp(dist.isend, tensor, self.peers[peer], self.group))
            for rank in range(self.pp):
                other = self.grid[rank][step]
                if rank == self.me or other is None:
                    continue
                target = self._receives(other)
                if target is not None:
                    buf = torch.empty(shape_BSD, dtype=wire_dtype, device=param.device)
                    self._state[target[0]][target[1]] = buf
                    ops.append(dist.P2POp(dist.irecv, buf, self.peers[rank], self.group))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            if action is not None and after_action is not None:
                after_action(action)
        self.step_end = time.perf_counter()
        state, self._state = self._state, None
        moe_outputs = [[out for j in sorted(state["moe"][n]) for out in state["moe"][n][j]]
                       for n in range(m)]
        return state["loss_sum"], moe_outputs

    def _owner(self, chunk: int) -> int:
        return chunk % self.pp

    def _receives(self, action: Action):
        """Where this rank files what `action` (on another rank) sends it, or None."""
        c, n = action.chunk, action.micro
        if action.kind == "F" and c < self.num_chunks - 1 and self._owner(c + 1) == self.me:
            return "acts", (c + 1, n)
        if action.kind == "B" and c > 0 and self._owner(c - 1) == self.me:
            return "grads", (c - 1, n)
        return None

    def _forward(self, action: Action):
        """Runs the chunk; returns (peer, tensor) to send, or None (last chunk, or kept local)."""
        state, (c, n) = self._state, action[1:]
        if c == 0:
            x = state["inputs"][n].to(next(self.stage.parameters()).device)
        else:
            x = state["acts"].pop((c, n)).requires_grad_()
        with self.autocast():
            out, moe_outputs = self.stage(x, chunk=c // self.pp)
            if c == self.num_chunks - 1:
                loss = self.loss_fn(out, state["targets"][n].to(out.device))
        # Keep only what statistics need: `y` and the injected loss hold activations and graph.
        state["moe"].setdefault(n, {})[c // self.pp] = [_statistics_only(o) for o in moe_outputs]
        if c == self.num_chunks - 1:
            state["loss_sum"] += loss.detach().to(torch.float64)
            state["saved"][(c, n)] = (x, loss / self.num_micro)
            return None
        state["saved"][(c, n)] = (x, out)
        if self._owner(c + 1) == self.me:      # the next chunk is ours too (pp=1, virtual>1)
            state["acts"][(c + 1, n)] = out.detach()
            return None
        return self._owner(c + 1), out.detach().contiguous()

    def _backward(self, action: Action):
        state, (c, n) = self._state, action[1:]
        x, out = state["saved"].pop((c, n))
        if c == self.num_chunks - 1:
            out.backward()
        else:
            torch.autograd.backward(out, state["grads"].pop((c, n)))
        del out
        if c == 0:
            return None
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        if self._owner(c - 1) == self.me:
            state["grads"][(c - 1, n)] = grad
            return None
        return self._owner(c - 1), grad.contiguous()
