"""The pipeline runner: executes a schedule (schedules.py) on this rank's stage, with the
point-to-point traffic between stages.

Talks on the `pp` group:

| when                      | collective                                                      |
|---------------------------|-----------------------------------------------------------------|
| once, at construction     | all-reduce of one element (NCCL wants a collective before P2P)  |
| once per step             | all-gather of 4 integers: every rank's (batch, sequence, dim,   |
|                           | wire dtype), so a disagreement raises on every rank, not a hang |
| each time step with work  | one batch_isend_irecv: hidden states to the next chunk's rank,  |
|                           | their gradients back; receives waited just before their use     |
|                           | (router.balance_loss='all_layers': in the same batch, 2E+1      |
|                           | float64 sums with the hidden states, E coefficients back)       |
|                           | (model.mtp_layers: the embedding output, mtp_link.py)           |
| per chunk forward, global | router.balance_scope='global': one all-reduce of the counts     |
| balance scope             | over `balance_group` (the stage's dp ranks), see below          |

The time steps are the lock-step grid of `schedules.timetable`: every rank knows what its
neighbours send at step t and posts the matching receives in the same batch, so no ordering can
deadlock. Sends and receives are asynchronous: a receive is waited right before the action that
consumes it, a send at the end of the step (its tensor is kept alive until then), so a rank
computes while its neighbours' traffic is in flight. Under bfloat16 training hidden states and
their gradients travel in bfloat16 (half the bytes) and are widened on arrival.
A balance loss over all MoE layers (layers/balance.py) needs every stage's counts of the
micro-batch before any stage's backward: each forward adds its chunk's sums (counts and
probability sums per expert, tokens) to the ones it received and sends them on with the hidden
states; the last chunk's rank finishes the loss (summing the counts over the dp ranks, global
scope) and the coefficient travels back with the gradients, so every stage's MoE layers read it
in their backward. per_layer at the global scope needs no traffic: each chunk finishes its own
layers after its forward.
Multi-token prediction (layers/mtp.py) runs on the last chunk and reads the main model's
embedding output from the first chunk's rank (mtp_link.py).
Action timings use CUDA events on GPUs (host timestamps would measure kernel launches) and host
timestamps on the CPU; they are read after the step.
"""

import contextlib
import time

import torch
import torch.distributed as dist

from moepar.layers.balance import BalanceStep, MicroBalance
from moepar.layers.mtp import MTPMicro

from .grads import all_reduce_sum
from .loss import cross_entropy
from .mtp_link import TAG, EmbeddingLink
from .schedules import FORWARD_ONLY, Action, Event, timetable

__all__ = ["PipelineRunner", "step_balance"]


def step_balance(model, group, device):
    """A BalanceStep for one step of `model` (a Transformer or a stage) when its balance loss is
    deferred, else None; the global scope's counts are summed over `group` (the dp ranks)."""
    cfg = model.router_cfg
    if not cfg.deferred_balance:
        return None
    reduce = None if group is None else (lambda t: all_reduce_sum([t], group))
    return BalanceStep(cfg, model.cfg.num_experts, model.cfg.top_k, reduce, device)

_WIRE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


class _Clock:
    """Timestamps for action intervals: CUDA events on GPUs, perf_counter on the CPU, converted
    to seconds since the step began only when read (no synchronisation inside the step)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start_event, self.start = None, 0.0

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self):
        self.start = time.perf_counter()
        self.start_event = self.now() if self.cuda else None

    def seconds(self, stamp) -> float:
        if not self.cuda:
            return stamp
        stamp.synchronize()
        return self.start + self.start_event.elapsed_time(stamp) / 1000.0


class PipelineRunner:
    """Runs one step's forwards and backwards of a pipeline stage (a Transformer after
    pipeline.py `apply_pp`: pp is the group's size, this rank its rank in it, and the stage's
    chunks its virtual stages) under a schedule.

    Each micro-batch's loss is weighted 1/num_micro before backward, and MoE aux losses are
    injected with the same weight (set here on the stage), as the trainer does without pipelining.
    Built once per layout: `grid` (every rank's timetable) and `order` (this rank's actions).
    After `run`: `events` (this rank's compute intervals), `step_start`, `step_end`,
    `peak_in_flight` (the most chunk-micro-batches whose activations were alive at once), and
    `balance_values` (per micro-batch this rank's part of a deferred balance loss, else None).
    `balance_group`: the dp ranks of this stage (global balance scope). `mtp_coeff` weights
    the mean MTP loss (model.mtp_layers); `mtp_sum`, after `run`, sums the micro-batches' mean
    MTP loss (unweighted, on the last stage; zero elsewhere and in evaluation).
    """

    def __init__(self, stage, num_micro: int, loss_fn=cross_entropy, *, pp_group=None,
                 schedule: str = "1f1b", autocast=contextlib.nullcontext,
                 act_dtype: torch.dtype | None = None, wire_dtype: torch.dtype | None = None,
                 balance_group=None, mtp_coeff: float = 0.0):
        self.stage, self.group, self.num_micro, self.loss_fn = stage, pp_group, num_micro, loss_fn
        self.balance_group, self.balance_values = balance_group, []
        self.mtp_coeff, self.mtp_sum, self.has_mtp = mtp_coeff, None, stage.cfg.mtp_layers > 0
        cfg, E = stage.router_cfg, stage.cfg.num_experts
        # all_layers: sizes of the sums sent with hidden states and of the coefficient sent back.
        self.balance_sizes = {"acts": 2 * E + 1, "grads": E} if (
            cfg.deferred_balance and cfg.balance_loss == "all_layers") else None
        # Entered around each forward and its loss; never around backward (it would recompute
        # float32 regions such as the router's backward in the autocast dtype).
        self.autocast = autocast
        pp = 1 if pp_group is None else dist.get_world_size(pp_group)
        self.virtual = virtual = stage.num_chunks
        self.device = next(stage.parameters()).device
        if pp > 1:
            self.peers = [dist.get_global_rank(pp_group, r) for r in range(pp)]
            # Under NCCL a batch of P2P ops that only some ranks join must not be the group's
            # first collective; this all-reduce (every pp rank, once) is.
            dist.all_reduce(torch.zeros(1, device=self.device), group=pp_group)
        self.pp, self.num_chunks = pp, pp * virtual
        self.me = 0 if pp_group is None else dist.get_rank(pp_group)
        self.grid = timetable(schedule, pp, virtual, num_micro)
        self.order = [a for a in self.grid[self.me] if a is not None]
        self._forward_grid = None
        # Hidden states arrive in the residual stream's dtype (default: the parameters'), and
        # travel in it or narrower.
        self.act_dtype = act_dtype or next(stage.parameters()).dtype
        self.wire_dtype = wire_dtype or self.act_dtype
        self.loss_scale = 1.0
        stage.set_aux_loss_scale(1.0 / num_micro)
        self.clock = _Clock(self.device)
        self._stamps, self.step_start, self.step_end, self.peak_in_flight = [], 0.0, 0.0, 0

    @property
    def events(self) -> list[Event]:
        """This rank's action intervals of the last step (seconds; read after the step)."""
        return [Event(a, self.clock.seconds(s), self.clock.seconds(e)) for a, s, e in self._stamps]

    def _agree_on_shape(self, shape_BSD: tuple):
        """Every pp rank checks that all ranks will exchange the same buffers: (batch, sequence,
        dim, wire dtype) all-gathered once per step; a mismatch raises on every rank (instead of
        a receive that waits forever)."""
        if self.pp == 1:
            return
        mine = torch.tensor([*shape_BSD, _WIRE_CODES[self.wire_dtype]], device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.pp)]
        dist.all_gather(everyone, mine, group=self.group)
        rows = [tuple(t.tolist()) for t in everyone]
        if len(set(rows)) > 1:
            raise RuntimeError(f"pipeline ranks disagree on the hidden-state buffers (batch, "
                               f"sequence, dim, dtype code) they exchange: {rows}; every rank "
                               "must get micro-batches of the same shape")

    def run(self, inputs: list, targets: list, before_action=None, after_action=None,
            forward_only: bool = False, documents: list | None = None,
            weights: list[float] | None = None):
        """One step. Every rank passes the step's micro-batches (`inputs` tokens_BS, `targets`
        tokens_BS, num_micro each, the same on all pp ranks): the first stage reads the inputs,
        the last the targets, the others only their shapes. `before_action(action)` is called
        before each of this rank's actions (e.g. to arm a gradient reducer before a last backward),
        `after_action(action)` after it, once the time step's point-to-point traffic is posted
        (so a data-parallel reduction never delays the activations or gradients a neighbour
        waits for). `forward_only`: forwards without autograd (evaluation), no backward.
        Packed documents (data.pack): `documents` per micro-batch, read by every stage (each
        builds its masks and positions), and `weights`, the last stage's loss multipliers.

        Returns (loss_sum, moe_outputs): the sum of the micro-batches' losses (times `weights`)
        as a detached float64 scalar, zero except on the last stage (sum it over pp to have it
        everywhere), and per micro-batch the list of this rank's MoEOutputs in layer order (for
        StepStats.add). Gradients accumulate into the stage's parameters.

        Collectives: see the module docstring; the shape agreement is the step's one host sync.
        """
        m = self.num_micro
        if len(inputs) != m or len(targets) != m:
            raise ValueError(f"the runner was built for {m} micro-batches; got {len(inputs)} "
                             f"inputs and {len(targets)} targets")
        grid = self.grid
        if forward_only:
            if self._forward_grid is None:
                self._forward_grid = timetable(FORWARD_ONLY, self.pp, self.virtual, m)
            grid = self._forward_grid
        batch, seq = targets[0].shape
        shape_BSD = (batch, seq // self.stage.seq_split, self.stage.cfg.dim)
        self._agree_on_shape(shape_BSD)
        # This step's buffers, keyed (chunk, micro): received inputs and output gradients, what
        # backward needs, MoE outputs; dropped when the step ends.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # Deferred balance loss: its maths for the step, holders per micro-batch, received sums
        # keyed (chunk, micro), coefficients and values per micro-batch.
        step_bal = None if forward_only else step_balance(self.stage, self.balance_group,
                                                          self.device)
        sizes = self.balance_sizes if step_bal is not None else None
        self._state = dict(inputs=inputs, targets=targets, documents=documents, weights=weights,
                           acts={}, grads={}, saved={}, moe={},
                           loss_sum=loss_sum, forward_only=forward_only, pending={},
                           balance=step_bal, holders={}, sums={}, coef={}, values={},
                           mtp=self.has_mtp and not forward_only,
                           link=EmbeddingLink(self._owner, self.num_chunks, self.me))
        self.mtp_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._stamps, alive, self.peak_in_flight = [], 0, 0
        keep, works = [], []   # tensors being sent (alive until their send completes), sends
        self.step_start = time.perf_counter()
        self.clock.begin()
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            for step in range(len(grid[0])):
                ops, recvs = [], []
                action = grid[self.me][step]
                if action is not None:
                    self._wait_inputs(action)
                    if before_action is not None:
                        before_action(action)
                    start = self.clock.now()
                    sent = self._forward(action) if action.kind == "F" else self._backward(action)
                    self._stamps.append((action, start, self.clock.now()))
                    alive += 1 if action.kind == "F" else -1
                    self.peak_in_flight = max(self.peak_in_flight, alive)
                    mtp_sent = self._state.pop("mtp_send", None)
                    if mtp_sent is not None:
                        keep.append(mtp_sent[1].to(self.wire_dtype).contiguous())
                        ops.append(dist.P2POp(dist.isend, keep[-1], self.peers[mtp_sent[0]],
                                              self.group, tag=TAG))
                    if sent is not None:
                        peer, tensor, extra = sent
                        if tuple(tensor.shape) != shape_BSD:
                            raise RuntimeError(f"{action}: sending {tuple(tensor.shape)}; "
                                               f"receivers expect {shape_BSD}")
                        tensor = tensor.to(self.wire_dtype).contiguous()
                        keep.append(tensor)
                        ops.append(dist.P2POp(dist.isend, tensor, self.peers[peer], self.group))
                        if extra is not None:   # balance sums or coefficient (tag 1)
                            keep.append(extra)
                            ops.append(dist.P2POp(dist.isend, extra, self.peers[peer], self.group,
                                                  tag=1))
                for rank in range(self.pp):
                    other = grid[rank][step]
                    target = None if rank == self.me or other is None else self._receives(other)
                    if target is not None:
                        buf = torch.empty(shape_BSD, dtype=self.wire_dtype, device=self.device)
                        bufs = [(buf, len(ops))]
                        ops.append(dist.P2POp(dist.irecv, buf, self.peers[rank], self.group))
                        if sizes is not None:
                            extra = torch.empty(sizes[target[0]], dtype=torch.float64,
                                                device=self.device)
                            bufs.append((extra, len(ops)))
                            ops.append(dist.P2POp(dist.irecv, extra, self.peers[rank], self.group,
                                                  tag=1))
                        recvs.append((target, bufs))
                    target = (None if rank == self.me or other is None or not self._state["mtp"]
                              else self._state["link"].receives(other))
                    if target is not None:
                        buf = torch.empty(shape_BSD, dtype=self.wire_dtype, device=self.device)
                        recvs.append((target, [(buf, len(ops))]))
                        ops.append(dist.P2POp(dist.irecv, buf, self.peers[rank], self.group,
                                              tag=TAG))
                if ops:
                    posted = dist.batch_isend_irecv(ops)
                    received = {index for _, bufs in recvs for _, index in bufs}
                    works += [w for i, w in enumerate(posted) if i not in received]
                    for target, bufs in recvs:
                        self._state["pending"][target] = [(posted[i], buf) for buf, i in bufs]
                if action is not None and after_action is not None:
                    after_action(action)
        # Every send completes before its tensor may go (each work is waited exactly once: a
        # gloo receive waited twice blocks forever); every receive was consumed by an action.
        for work in works:
            work.wait()
        del keep
        assert not self._state["pending"], f"receives never consumed: {self._state['pending']}"
        self.step_end = time.perf_counter()
        state, self._state = self._state, None
        moe_outputs = [[out for j in sorted(state["moe"][n]) for out in state["moe"][n][j]]
                       for n in range(m)]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.balance_values = [None if step_bal is None else state["values"].get(n, zero)
                               for n in range(m)]
        return state["loss_sum"], moe_outputs

    def _wait_inputs(self, action: Action):
        """Waits for the receives this action consumes and files them, widened to the
        residual stream's dtype."""
        c, n = action.chunk, action.micro
        kind = "acts" if action.kind == "F" else "grads"
        pending = self._state["pending"].pop((kind, (c, n)), None)
        if pending is not None:
            (work, buf), *extra = pending
            work.wait()
            self._state[kind][(c, n)] = buf.to(self.act_dtype)
            for work, buf in extra:
                work.wait()
                if kind == "acts":
                    self._state["sums"][(c, n)] = buf
                else:
                    self._set_coef(n, buf)

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
        training = not state["forward_only"]
        if c == 0:
            x = state["inputs"][n].to(self.device, non_blocking=True)
        else:
            x = state["acts"].pop((c, n))
            if training:
                x.requires_grad_()
        holder = None if state["balance"] is None else MicroBalance()
        last = self.num_chunks - 1
        mtp = None
        if state["mtp"] and c in (0, last):   # the embedding output goes from chunk 0 to the last
            mtp = MTPMicro(state["link"].take(("embeds", (c, n)), state["pending"], self.act_dtype,
                                              training) if c == last and c else None)
        with self.autocast():
            # The last chunk's loss replaces its head: from the final hidden states and the
            # head weight, never the logits (parallel/loss.py); given the gradient that backward
            # sends into it, it may form its gradients in forward.
            head_fn, grad_scale = None, self.loss_scale / self.num_micro
            if c == self.num_chunks - 1:
                targets = state["targets"][n].to(self.device, non_blocking=True)

                weight = 1.0 if state["weights"] is None else state["weights"][n]

                def head_fn(h, w, k=0):    # k: an MTP depth, k tokens further on (no scale)
                    return self.loss_fn(h, w, targets[:, k:],
                                        grad_scale=None if k else grad_scale * weight)
            packed = {} if state["documents"] is None else {
                "documents": state["documents"][n].to(self.device, non_blocking=True)}
            out, moe_outputs = self.stage(x, holder, chunk=c // self.pp, head_fn=head_fn,
                                          mtp=mtp, **packed)
            if c == self.num_chunks - 1:
                loss = out if state["weights"] is None else out * state["weights"][n]
        # Keep only what statistics need: `y` and the injected loss hold activations and graph.
        state["moe"].setdefault(n, {})[c // self.pp] = [o.statistics() for o in moe_outputs]
        sums = None if holder is None else self._finish_balance(action, holder)
        embeds = None
        if mtp is not None and c == 0 and last > 0:
            embeds = mtp.embeds_BSD
            state["mtp_send"] = state["link"].put("embeds", n, embeds.detach())
        if c == self.num_chunks - 1:
            state["loss_sum"] += loss.detach().to(torch.float64)
            if mtp is not None:
                mtp_mean = sum(mtp.losses) / len(mtp.losses)
                self.mtp_sum += mtp_mean.detach().to(torch.float64)
                loss = loss + self.mtp_coeff * mtp_mean
            if training:
                state["saved"][(c, n)] = (x, loss * grad_scale,
                                          None if mtp is None or c == 0 else mtp.embeds_BSD)
            return None
        if training:
            state["saved"][(c, n)] = (x, out, embeds)
        if self._owner(c + 1) == self.me:      # the next chunk is ours too (pp=1, virtual>1)
            state["acts"][(c + 1, n)] = out.detach()
            if sums is not None:
                state["sums"][(c + 1, n)] = sums
            return None
        return self._owner(c + 1), out.detach(), sums

    def _finish_balance(self, action: Action, holder: MicroBalance):
        """After a chunk's forward: per_layer (global scope) finishes the chunk's layers; for
        all_layers, returns the sums so far to send on, or, on the last chunk, finishes the
        micro-batch's loss and gives every holder of it on this rank the coefficient."""
        state, (c, n) = self._state, action[1:]
        step, values = state["balance"], state["values"]
        state["holders"].setdefault(n, []).append(holder)
        if self.balance_sizes is None:
            value = step.finish_layers(holder)
        else:
            sums = step.partial(holder, state["sums"].pop((c, n), None))
            if c < self.num_chunks - 1:
                return sums
            value = step.finish_all(state["holders"][n], sums)
            state["coef"][n] = holder.coef_E
        values[n] = value if n not in values else values[n] + value
        return None

    def _set_coef(self, n: int, coef_E):
        """A coefficient that came back with gradients: every holder of micro-batch n here."""
        self._state["coef"][n] = coef_E
        for holder in self._state["holders"].get(n, []):
            holder.set_coef(coef_E)

    def _backward(self, action: Action):
        state, (c, n) = self._state, action[1:]
        x, out, embeds = state["saved"].pop((c, n))
        if c == self.num_chunks - 1:
            out.backward()
            if embeds is not None:    # MTP's embedding input: its gradient to chunk 0
                grad = embeds.grad if embeds.grad is not None else torch.zeros_like(embeds)
                state["mtp_send"] = state["link"].put("embed_grads", n, grad)
        elif embeds is not None:      # chunk 0: the hidden states' and MTP's gradients at once
            grad = state["link"].take(("embed_grads", (c, n)), state["pending"], self.act_dtype,
                                      False)
            torch.autograd.backward([out, embeds], [state["grads"].pop((c, n)), grad])
        else:
            torch.autograd.backward(out, state["grads"].pop((c, n)))
        del out
        if c == 0:
            return None
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        if self._owner(c - 1) == self.me:
            state["grads"][(c - 1, n)] = grad
            return None
        coef = None if self.balance_sizes is None else state["coef"][n]
        return self._owner(c - 1), grad, coef
