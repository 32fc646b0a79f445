"""The step runner without pipelining (pp = 1): the step's micro-batches one after another,
forward with the loss in place of the LM head (from the final hidden states and the head weight,
parallel/loss.py), backward, with the signature and hooks of `PipelineRunner`
(pipeline_runner.py), so the handle drives both the same way.

Talks on `balance_group` (the dp ranks) only for a deferred balance loss at the global scope:
one all-reduce of (L+1)*E numbers or fewer per micro-batch (layers/balance.py).
"""

import contextlib

import torch

from moepar.layers.balance import MicroBalance
from moepar.layers.mtp import MTPMicro

from .pipeline_runner import step_balance
from .loss import cross_entropy
from .schedules import Action

__all__ = ["LocalRunner"]


class LocalRunner:
    """Runs one step's micro-batches of a whole model. After `run`: `balance_values`, per
    micro-batch its weighted deferred balance loss (None when each router call trains its own);
    `mtp_sum`, the sum over micro-batches of their mean MTP loss (model.mtp_layers; unweighted,
    detached float64; zero in evaluation, which trains no MTP and reports the main loss only)."""

    def __init__(self, model, num_micro: int, loss_fn=cross_entropy, *,
                 autocast=contextlib.nullcontext, balance_group=None, mtp_coeff: float = 0.0):
        self.model, self.num_micro, self.loss_fn, self.autocast = model, num_micro, loss_fn, autocast
        self.mtp_coeff, self.mtp_sum = mtp_coeff, None
        self.order = [Action(kind, 0, n) for n in range(num_micro) for kind in "FB"]
        self.loss_scale = 1.0
        self.balance_group = balance_group
        self.balance_values = []
        model.set_aux_loss_scale(1.0 / num_micro)

    def run(self, inputs: list, targets: list, before_action=None, after_action=None,
            forward_only: bool = False, limit: int | None = None, documents: list | None = None,
            weights: list[float] | None = None):
        """The step's micro-batches (or the first `limit`); returns (loss sum, per micro-batch
        the MoE outputs' statistics). `forward_only`: no autograd, no backward (evaluation).
        Packed documents (data.pack): `documents` [B, S] per micro-batch (the model's), and
        `weights`, each micro-batch's loss multiplier (its share of the counted tokens)."""
        device = next(self.model.parameters()).device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        outputs, self.balance_values = [], []
        step = None if forward_only else step_balance(self.model, self.balance_group, device)
        self.mtp_sum = torch.zeros((), dtype=torch.float64, device=device)
        with_mtp = self.model.mtp is not None and not forward_only
        for n in range(self.num_micro if limit is None else limit):
            inputs_BS = inputs[n].to(device, non_blocking=True)
            targets_BS = targets[n].to(device, non_blocking=True)
            holder = None if step is None else MicroBalance()
            packed = {} if documents is None else {
                "documents": documents[n].to(device, non_blocking=True)}
            mtp = MTPMicro() if with_mtp else None
            # The gradient backward sends into the main loss, which the loss may then form in
            # forward (layers/loss.py); MTP depths' losses get none and scale in backward.
            grad_scale = self.loss_scale / self.num_micro
            main_scale = grad_scale * (1.0 if weights is None else weights[n])
            with self.autocast(), torch.no_grad() if forward_only else contextlib.nullcontext():
                # The loss in place of the head: from the final hidden states and head weight
                # (MTP depth k: against the targets k further on).
                loss, moe_outputs = self.model(
                    inputs_BS, holder, mtp=mtp,
                    head_fn=lambda h, w, k=0: self.loss_fn(
                        h, w, targets_BS[:, k:], grad_scale=None if k else main_scale),
                    **packed)
            if weights is not None:
                loss = loss * weights[n]
            if forward_only:
                loss_sum += loss
                continue
            self.balance_values.append(None if step is None else step.finish(holder))
            # Only statistics outlive the forward: the MoE outputs are not needed by backward
            # and go before it runs (the loss never forms the [B, S, V] logits).
            outputs.append([o.statistics() for o in moe_outputs])
            del moe_outputs
            backward = Action("B", 0, n)
            if before_action is not None:
                before_action(backward)
            trained = loss
            if mtp is not None:
                mtp_mean = sum(mtp.losses) / len(mtp.losses)
                self.mtp_sum += mtp_mean.detach().to(torch.float64)
                trained = loss + self.mtp_coeff * mtp_mean
            (trained * grad_scale).backward()
            if after_action is not None:
                after_action(backward)
            loss_sum += loss.detach()
        return loss_sum, outputs
