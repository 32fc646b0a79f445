"""Differentiable collectives: each is an autograd Function whose backward is the adjoint.

Talks on whatever group it is given (the expert-parallel `ep` group, in practice).

| function            | forward                                  | backward                                 | host sync |
|---------------------|------------------------------------------|------------------------------------------|-----------|
| all_to_all          | all_to_all_single, uneven splits         | all_to_all_single, splits swapped        | none      |
| all_to_all_start    | all_to_all_single, async_op=True         | waits the reverse (issued by _wait)      | none      |
| all_to_all_wait     | waits the rows started above             | issues the reverse all_to_all, async     | none      |
| all_gather_rows     | all_gather_into_tensor (equal rows)      | reduce_scatter_tensor (sum)              | none      |
| reduce_scatter_rows | reduce_scatter_tensor (sum, equal rows)  | all_gather_into_tensor                   | none      |

Split sizes are host lists supplied by the caller (the dispatcher's one sync per layer). Every
function short-circuits on a group of one rank, so callers never branch on the degree.

The start/wait pair lets compute run while rows travel, in both directions: the forward issues
the all-to-all in `start` and waits in `wait`; backward meets the two nodes in reverse, so the
reverse all-to-all is issued in `wait`'s backward, as soon as the gradient exists, and waited in
`start`'s backward, with the autograd work created between them (other chunks' experts) in
between. On NCCL an async collective runs on the process group's own stream and `wait` only
makes the current stream wait for it (no host sync); on gloo it runs on gloo's threads and
`wait` blocks the host (the "exposed" time `A2ATimer` measures).
"""

import threading
import time

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "all_gather_rows", "reduce_scatter_rows", "group_size", "to_wire",
           "all_gather_single", "reduce_scatter_single", "Flight", "flight", "all_to_all_start",
           "all_to_all_wait", "A2ATimer"]


def to_wire(x):
    """Hidden states in the autocast dtype before they travel (the experts would cast them on
    arrival anyway): under bf16 autocast the residual stream is fp32, and sending it as is would
    double the bytes. Outside autocast, a no-op."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def group_size(group) -> int:
    return dist.get_world_size(group)


def _a2a(x, out_splits: list[int], in_splits: list[int], group):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _timed_a2a(x, out_splits, in_splits, group, timer):
    started = time.perf_counter()
    out = _a2a(x, out_splits, in_splits, group)
    if timer is not None:
        timer.blocking(started)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, timer):
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        return _timed_a2a(x, out_splits, in_splits, group, timer)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _timed_a2a(grad, in_splits, out_splits, ctx.group, ctx.timer), None, None, None, None


def all_to_all(x, out_splits: list[int], in_splits: list[int], group, timer=None):
    """Rows x[sum(in_splits[:j]) : ...+in_splits[j]] go to rank j; returns rows received, by source.
    `timer` (an A2ATimer, or None) clocks it, forward and backward, as fully exposed."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group, timer)


class A2ATimer:
    """Wall clock of a dispatcher's all-to-alls, forward and backward, for benchmarks (off unless
    one is set on the dispatcher). Every all-to-all gets an index in issue order, the same on
    every rank (collectives are issued in one order everywhere).

    `total`: the time at least one all-to-all was in flight (the union of issue-to-completion
    intervals, so queued chunks are not counted twice); `exposed`: the host's time issuing and
    blocked waiting, the part the overlap did not hide. A wait also covers the time until the
    last rank issues the same all-to-all (a peer still computing: expert load imbalance), so
    `split(last_issue)`, given the latest issue time of each all-to-all over the ranks (one host,
    one clock: the local benchmarks), parts `exposed` into that `peer_wait` and `comm` (the
    rest), and gives `on_wire`: the union of last-issue-to-completion intervals."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self.issue_times: list[float] = []     # per all-to-all, in issue order
            self.done_times: dict[int, float] = {}
            self.waits: list[tuple[int, float, float]] = []   # (index, blocked from, to)
            self.issuing = 0.0

    def _issue(self, started: float) -> int:
        self.issue_times.append(started)
        return len(self.issue_times) - 1

    @staticmethod
    def _union(spans) -> float:
        covered, end = 0.0, float("-inf")
        for lo, hi in sorted(spans):
            covered += max(0.0, hi - max(lo, end))
            end = max(end, hi)
        return covered

    @property
    def total(self) -> float:
        with self._lock:
            return self._union((self.issue_times[i], done) for i, done in self.done_times.items())

    @property
    def exposed(self) -> float:
        with self._lock:
            return self.issuing + sum(hi - lo for _, lo, hi in self.waits)

    def split(self, last_issue: list[float]) -> dict:
        """{'peer_wait', 'comm', 'on_wire'} in seconds; `last_issue[i]`: the latest time any rank
        issued all-to-all i (see the class docstring)."""
        with self._lock:
            if len(last_issue) != len(self.issue_times):
                raise ValueError(f"{len(last_issue)} issue times for {len(self.issue_times)} "
                                 "all-to-alls: the ranks issued different collectives")
            peer = sum(max(0.0, min(hi, last_issue[i]) - lo) for i, lo, hi in self.waits)
            blocked = sum(hi - lo for _, lo, hi in self.waits)
            on_wire = self._union((last_issue[i], max(done, last_issue[i]))
                                  for i, done in self.done_times.items())
            return {"peer_wait": peer, "comm": self.issuing + blocked - peer, "on_wire": on_wire}

    def blocking(self, started: float):
        """A synchronous collective that began at `started` and has just ended: all exposed."""
        now = time.perf_counter()
        with self._lock:
            index = self._issue(started)
            self.done_times[index] = now
            self.waits.append((index, started, now))

    def issued(self, work, started: float) -> int:
        """An asynchronous one, issued from `started` until now; returns its index for `waited`."""
        with self._lock:
            index = self._issue(started)
            self.issuing += time.perf_counter() - started
        work.get_future().add_done_callback(lambda _: self._completed(index))
        return index

    def waited(self, index: int, started: float):
        """The host blocked on all-to-all `index` from `started` until now."""
        now = time.perf_counter()
        with self._lock:
            self.waits.append((index, started, now))

    def _completed(self, index: int):
        now = time.perf_counter()
        with self._lock:   # runs on the communication thread
            self.done_times[index] = now


class Flight:
    """One asynchronous all-to-all and, in backward, its reverse: splits, group, work handles.
    Made before the rows exist (a dispatcher's plan holds the flights of its chunks), started by
    `all_to_all_start`, waited by `all_to_all_wait`. Buffers are dropped once waited, so no
    tensor outlives its use through this object."""

    def __init__(self, out_splits, in_splits, group, timer):
        self.out_splits, self.in_splits, self.group, self.timer = out_splits, in_splits, group, timer
        self.work = self.recv = self.grad_work = self.grad_recv = None

    def _send(self, x, out_splits, in_splits):
        started = time.perf_counter()
        recv = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        work = dist.all_to_all_single(recv, x.contiguous(), out_splits, in_splits,
                                      group=self.group, async_op=True)
        index = self.timer.issued(work, started) if self.timer is not None else None
        return recv, (work, index)

    def _wait(self, flight):
        work, index = flight
        started = time.perf_counter()
        work.wait()
        if self.timer is not None:
            self.timer.waited(index, started)

    def start(self, x):
        self.recv, self.work = self._send(x, self.out_splits, self.in_splits)
        return self.recv

    def finish(self):
        self._wait(self.work)
        self.work = self.recv = None

    def start_grad(self, grad):
        self.grad_recv, self.grad_work = self._send(grad, self.in_splits, self.out_splits)

    def finish_grad(self):
        self._wait(self.grad_work)
        grad, self.grad_work, self.grad_recv = self.grad_recv, None, None
        return grad


class _A2AStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        return flight.start(x)        # filled asynchronously: only _A2AWait reads it

    @staticmethod
    def backward(ctx, grad_recv):
        # grad_recv is travelling already (issued in _A2AWait.backward): wait for its reverse.
        return ctx.flight.finish_grad(), None


class _A2AWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv, flight):
        ctx.flight = flight
        flight.finish()
        return recv

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.start_grad(grad)
        return grad, None


def flight(out_splits: list[int], in_splits: list[int], group, timer=None) -> Flight | None:
    """The flight of one `all_to_all(x, out_splits, in_splits, group)` to start later; None on
    a group of one rank (the rows stay)."""
    if group_size(group) == 1:
        return None
    return Flight(out_splits, in_splits, group, timer)


def all_to_all_start(x, flight: Flight | None):
    """Issues the flight's all-to-all of x and returns at once: rows that must not be read
    before `all_to_all_wait(rows, flight)` returns them."""
    if flight is None:
        return x
    return _A2AStart.apply(x, flight)


def all_to_all_wait(rows, flight):
    """The rows of `all_to_all_start`, once they have arrived (see the module docstring)."""
    if flight is None:
        return rows
    return _A2AWait.apply(rows, flight)


# torch 2.13 renamed these (the old names warn); older torch has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x, group):
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x, group):
    out = x.new_empty((x.shape[0] // group_size(group),) + tuple(x.shape[1:]))
    reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


class _RowsCollective(torch.autograd.Function):
    """forward: `op(x, group)`; backward: its adjoint `adjoint(grad, group)` (gather <-> reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, op, adjoint):
        ctx.group, ctx.adjoint = group, adjoint
        return op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, ctx.group), None, None, None


def all_gather_rows(x, group):
    """Concatenates every rank's x (same shape on all ranks) along dim 0, in rank order."""
    if group_size(group) == 1:
        return x
    return _RowsCollective.apply(x, group, _gather, _reduce_scatter)


def reduce_scatter_rows(x, group):
    """Sums x over ranks and returns this rank's block of rows (dim 0 divisible by the size)."""
    if group_size(group) == 1:
        return x
    return _RowsCollective.apply(x, group, _reduce_scatter, _gather)
