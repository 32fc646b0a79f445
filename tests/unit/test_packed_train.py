"""A training step on packed, padded documents: its loss is the mean cross-entropy over every
counted token of the global batch (computed here by hand from the model and the batches), not
the mean of the micro-batches' means; validation follows the same rules."""

import torch
import torch.nn.functional as F

from configs import packed_folder, tiny_config
from moepar.data.sources import validation_batches
from moepar.layers import Transformer
from moepar.train import Trainer
from moepar.validation import Validation


def test_step_loss_is_the_mean_over_counted_tokens(tmp_path):
    data = packed_folder(tmp_path, 80, val_fraction=0.3, val_tokens=200)
    cfg = tiny_config(tmp_path / "run", "--train.dtype=float64", "--train.steps=1",
                      "--train.global_batch_size=6", "--train.micro_batch_size=2",
                      "--run.checkpoint_every=0", "--data.source=tokens", f"--data.path={data}",
                      "--data.pack=documents", "--data.pad=true", "--train.eval_batches=1")
    trainer = Trainer(cfg, log=lambda _m: None)
    model = Transformer(cfg.model, cfg.router).double()
    model.load_state_dict(trainer.model.state_dict())
    train = [trainer.sampler.batch(i) for i in range(3)]
    val = validation_batches(cfg.data, 3, 2, cfg.train.seq_len)
    val_loss = Validation(cfg, trainer.dims, 0).run(trainer.engine)["val_loss"]
    assert abs(val_loss - _mean_over_tokens(model, val)[0]) < 1e-12
    want, mean_of_means = _mean_over_tokens(model, train)
    loss = trainer.run()[0]["loss"]
    assert abs(loss - want) < 1e-12
    assert abs(loss - mean_of_means) > 1e-6      # the micro-batches count different tokens


def _mean_over_tokens(model, batches):
    """(mean cross-entropy over the counted targets of all batches, mean of their means)."""
    sums, counts, means = 0.0, 0, []
    with torch.no_grad():
        for inputs, targets, documents in batches:
            logits, _ = model(inputs, documents=documents)
            ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            counted = int((targets != -100).sum())
            sums, counts = sums + ce.item(), counts + counted
            means.append(ce.item() / counted)
    return sums / counts, sum(means) / len(means)
