"""Validation during training (every `train.eval_every` steps) and for `moepar eval`: the loss
and perplexity on fixed held-out batches, the same figure in every layout.

The batches are `train.eval_batches` global batches from the val split of the prepared folder(s)
(moepar.data.validation_batches): fixed windows, the same at every evaluation and every layout.
Each global batch is split over the dp ranks as a training step is (global micro-batch i goes to
dp rank i // local micro-batches) and runs forward only through the handle's runner (local or
pipeline), each micro-batch one capacity group as in training. val_loss is the mean over the
micro-batches of their mean cross-entropy (micro-batches have equal sizes: the mean per token),
val_ppl = exp(val_loss); the figure does not depend on the layout (tests/dist/test_eval_parity.py).
With data.pack='documents' the windows are cut into their documents (masks, positions, -100
targets at document ends) and val_loss is the mean over the counted tokens.
"""

import math

from moepar.data import sources

__all__ = ["Validation", "perplexity"]


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class Validation:
    """This rank's share of the validation batches (built before any process group exists);
    `run(engine)` returns {"val_loss", "val_ppl"}, the same on every rank (a collective)."""

    def __init__(self, cfg, dims, rank: int):
        t = cfg.train
        self.every, self.last = t.eval_every, t.steps
        num_micro = t.global_batch_size // t.micro_batch_size
        local, dp_rank = num_micro // dims.dp, dims.coords(rank).dp
        try:
            batches = sources.validation_batches(cfg.data, t.eval_batches * num_micro,
                                                 t.micro_batch_size, t.seq_len,
                                                 cfg.model.vocab_size)
        except ValueError as e:
            raise ValueError(f"validation (train.eval_batches={t.eval_batches}): {e}") from None
        self.num_micro = len(batches)
        first = dp_rank * local
        self.rounds = [batches[r * num_micro + first:r * num_micro + first + local]
                       for r in range(t.eval_batches)]
        # Packed documents: each micro-batch's mean weighted by its counted targets, so that
        # val_loss is the mean over every counted token (the training step's rule).
        self.weights = None
        if cfg.data.pack == "documents":
            counts = [int((b[1] != -100).sum()) for b in batches]
            total = max(sum(counts), 1)
            weights = [c * self.num_micro / total for c in counts]
            self.weights = [weights[r * num_micro + first:r * num_micro + first + local]
                            for r in range(t.eval_batches)]

    def _packed(self, i: int) -> dict:
        """Round i's documents and loss weights (data.pack), or nothing."""
        if self.weights is None:
            return {}
        return {"documents": [b[2] for b in self.rounds[i]], "weights": self.weights[i]}

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last)

    def run(self, engine) -> dict:
        loss_sum = sum(engine.evaluate([b[0] for b in r], [b[1] for b in r], **self._packed(i))
                       for i, r in enumerate(self.rounds))
        loss = float(loss_sum) / self.num_micro      # the one host sync
        return {"val_loss": loss, "val_ppl": perplexity(loss)}
