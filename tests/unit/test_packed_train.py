"""A training step on packed, padded documents: its loss is the mean cross-entropy over every
counted token of the global batch (computed here by hand from the model and the batches), not
the mean of the micro-batches' means."""

import torch
import torch.nn.functional as F

from configs import packed_folder, tiny_config
from moepar.layers import Transformer
from moepar.train import Trainer


def test_step_loss_is_the_mean_over_counted_tokens(tmp_path):
    data = packed_folder(tmp_path, 40)
    cfg = tiny_config(tmp_path / "run", "--train.dtype=float64", "--train.steps=1",
                      "--train.global_batch_size=6", "--train.micro_batch_size=2",
                      "--run.checkpoint_every=0", "--data.source=tokens",
                      f"--data.path={data}", "--data.pack=documents",
                      "--data.pad=true")
    trainer = Trainer(cfg, log=lambda _m: None)
    model = Transformer(cfg.model, cfg.router).double()
    model.load_state_dict(trainer.model.state_dict())
    sums, counts, means = 0.0, 0, []
    with torch.no_grad():
        for i in range(3):
            inputs, targets, documents = trainer.sampler.batch(i)
            logits, _ = model(inputs, documents=documents)
            ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            counted = int((targets != -100).sum())
            sums, counts = sums + ce.item(), counts + counted
            means.append(ce.item() / counted)
    loss = trainer.run()[0]["loss"]
    assert abs(loss - sums / counts) < 1e-12
    assert abs(loss - sum(means) / 3) > 1e-6      # the micro-batches count different tokens
