"""Multi-token prediction under pipeline parallelism: the main model's embedding output from the
first chunk's rank to the last chunk's (which holds the MTP depths, layers/mtp.py), and its
gradient back.

Talks on the `pp` group, inside the pipeline runner's batches (pipeline_runner.py), tag 2:

| when                               | message                                                  |
|------------------------------------|----------------------------------------------------------|
| forward of chunk 0, micro-batch n  | embedding output [B, S, D] -> the last chunk's rank      |
| backward of the last chunk, n      | its gradient [B, S, D] -> chunk 0's rank, added in chunk |
|                                    | 0's backward                                             |

One [B, S, D] message each way per micro-batch (one hop of hidden states), in the wire dtype.
The embedding weight stays on one rank with one gradient: no tied copy on the last stage whose
gradient and values would need their own all-reduce and checkpoint owner. With both chunks on one
rank (pp = 1, interleaved) the tensors stay local.
"""

from .schedules import Action

__all__ = ["EmbeddingLink", "TAG"]

TAG = 2


class EmbeddingLink:
    """Which MTP messages a rank receives, and where what it sends or keeps goes. Keys are
    (kind, (chunk, micro)), kind "embeds" (for the last chunk) or "embed_grads" (for chunk 0)."""

    def __init__(self, owner, num_chunks: int, me: int):
        self.owner, self.last, self.me = owner, num_chunks - 1, me
        self.local = {}

    def receives(self, action: Action):
        """The key this rank files the MTP message of `action` (another rank's) under, or None."""
        c, n = action.chunk, action.micro
        if action.kind == "F" and c == 0 and self.owner(self.last) == self.me:
            return "embeds", (self.last, n)
        if action.kind == "B" and c == self.last and self.owner(0) == self.me:
            return "embed_grads", (0, n)
        return None

    def put(self, kind: str, n: int, tensor):
        """Files `tensor` for its chunk (embeddings: the last; gradients: 0); returns
        (peer, tensor) to send when that chunk is another rank's, else None."""
        chunk = self.last if kind == "embeds" else 0
        if self.owner(chunk) == self.me:
            self.local[(kind, (chunk, n))] = tensor
            return None
        return self.owner(chunk), tensor

    def take(self, key, pending: dict, dtype, training: bool):
        """The message filed under `key`: kept locally, or received (waited now, widened to
        `dtype`); embeddings become a leaf that collects MTP's gradient when training."""
        posted = pending.pop(key, None)
        if posted is None:
            x = self.local.pop(key)
        else:
            (work, buf), = posted
            work.wait()
            x = buf.to(dtype)
        return x.requires_grad_() if training and key[0] == "embeds" else x
