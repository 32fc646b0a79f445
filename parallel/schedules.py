"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B): which action each pipeline rank runs
when. Pure maths: no process group (pipeline_runner.py executes a schedule).

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

from typing import NamedTuple


__all__ = ["SCHEDULES", "Action", "Event", "check_schedule", "rank_order", "timetable",
           "peak_in_flight", "ideal_bubble", "measured_bubble", "FORWARD_ONLY"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
FORWARD_ONLY = "forward"   # evaluation: every micro-batch through every chunk, no backward


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
    if schedule == FORWARD_ONLY:
        return
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
    if schedule == FORWARD_ONLY:
        return [Action("F", r + j * pp, n) for n in range(m) for j in range(virtual)]
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
