"""Pipeline parallelism, the split: which layers each stage holds, and the stage module itself.

Talks on no process group: the schedules and their point-to-point traffic live in
schedules.py.

Legend: B batch (sequences), S sequence length, D model dim, V vocabulary.

The model's layers are cut into `pp * virtual` contiguous chunks (global chunk c holds layers
[sum(counts[:c]), sum(counts[:c+1]))). Pipeline rank r holds chunks r, r + pp, r + 2*pp, ...
(one chunk without virtual stages; `virtual` > 1 is interleaved 1F1B). The embedding lives with
chunk 0, the final norm and head with the last chunk.

| module          | lives on                              | name in the stage's state_dict  |
|-----------------|---------------------------------------|---------------------------------|
| embed           | pp rank 0 (chunk 0)                   | embed.weight                    |
| layers.<i>      | the rank holding layer i's chunk      | layers.<i>.* (the original i)   |
| norm, head      | pp rank pp-1 (the last chunk)         | norm.weight, head.weight        |
| rope tables     | every rank (buffers, not saved)       | -                               |

Names are the full model's, so checkpoints and MoE layer ids do not depend on the split.
Tied embeddings are refused when pp > 1: the tied weight would sit on two ranks and need its
own gradient all-reduce between the first and last stage.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .tensor import gather_sequence

__all__ = ["split_layers", "rank_chunks", "StageModule", "build_stage"]


def split_layers(num_layers: int, pp: int, virtual: int = 1,
                 pp_layers: list[int] | None = None) -> list[int]:
    """Layers per global chunk (pp * virtual of them, in model order). Pure maths, raises ValueError.

    Balanced by default, earlier chunks taking the remainder (5 layers over 2 stages -> [3, 2]);
    `pp_layers` gives the counts explicitly (one per chunk, each >= 1, summing to num_layers).
    """
    for name, value in (("parallel.pp", pp), ("parallel.pp_virtual", virtual),
                        ("model.num_layers", num_layers)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    num_chunks = pp * virtual
    if pp_layers is not None:
        counts = list(pp_layers)
        if len(counts) != num_chunks:
            raise ValueError(f"parallel.pp_layers={counts} has {len(counts)} entries; it needs one "
                             f"per stage chunk, parallel.pp={pp} * parallel.pp_virtual={virtual} "
                             f"= {num_chunks}")
        if any(c < 1 for c in counts):
            raise ValueError(f"parallel.pp_layers={counts}: every stage chunk needs >= 1 layer")
        if sum(counts) != num_layers:
            raise ValueError(f"parallel.pp_layers={counts} sums to {sum(counts)}, but "
                             f"model.num_layers={num_layers}")
        return counts
    if num_layers < num_chunks:
        raise ValueError(f"model.num_layers={num_layers} is fewer than the stage chunks, "
                         f"parallel.pp={pp} * parallel.pp_virtual={virtual} = {num_chunks} "
                         "(every chunk needs >= 1 layer)")
    base, extra = divmod(num_layers, num_chunks)
    return [base + (c < extra) for c in range(num_chunks)]


def rank_chunks(pp_rank: int, pp: int, virtual: int = 1) -> list[int]:
    """The global chunks pipeline rank `pp_rank` holds, in order (interleaved: r, r+pp, ...)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp rank {pp_rank} outside parallel.pp={pp}")
    return [pp_rank + j * pp for j in range(virtual)]


class _LayersById(nn.ModuleList):
    """A ModuleList whose children are named by their layer id (`layers.3.*` stays `layers.3.*`);
    iteration, len and integer indexing are positional, as in the full model's list."""

    def __init__(self, blocks):
        super().__init__()
        for block in blocks:
            self.add_module(str(block.layer_id), block)

    def __getitem__(self, idx):   # an int or a slice (a slice gives a plain list)
        return list(self._modules.values())[idx]


class StageModule(nn.Module):
    """This pipeline rank's part of a Transformer: its chunks' blocks (and embed / norm, head).

    `forward(x, chunk=j)` runs local chunk j (global chunk `chunk_ids[j]`): tokens_BS in on global
    chunk 0, x_BSD otherwise; x_BSD out, or logits_BSV from the last chunk. Returns
    (out, [MoEOutput of the chunk's MoE layers, in layer order]).
    """

    def __init__(self, model, pp_rank: int, pp: int, virtual: int = 1,
                 pp_layers: list[int] | None = None):
        super().__init__()
        cfg = model.cfg
        counts = split_layers(cfg.num_layers, pp, virtual, pp_layers)
        if cfg.tie_embeddings and pp > 1:
            raise ValueError("model.tie_embeddings=true with parallel.pp>1 is not supported: the "
                             "embedding (first stage) and head (last stage) would share a weight "
                             "across ranks; set model.tie_embeddings=false or parallel.pp=1")
        self.cfg, self.pp, self.pp_rank, self.virtual = cfg, pp, pp_rank, virtual
        self.router_cfg = model.router_cfg
        self.num_chunks = pp * virtual
        self.chunk_ids = rank_chunks(pp_rank, pp, virtual)
        starts = [sum(counts[:c]) for c in range(self.num_chunks + 1)]
        # Positions in self.layers of each local chunk's blocks (layer ids ascend with chunks).
        self.chunk_slices, blocks = [], []
        for c in self.chunk_ids:
            self.chunk_slices.append(slice(len(blocks), len(blocks) + counts[c]))
            blocks += [model.layers[i] for i in range(starts[c], starts[c + 1])]
        self.layer_ids = [b.layer_id for b in blocks]
        self.is_first = self.chunk_ids[0] == 0
        self.is_last = self.chunk_ids[-1] == self.num_chunks - 1
        self.embed = model.embed if self.is_first else None
        self.layers = _LayersById(blocks)
        self.norm = model.norm if self.is_last else None
        self.head = model.head if self.is_last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        # Under tensor parallelism (applied before the split) hidden states between blocks, and so
        # between stages, hold 1/tp of each sequence; the head gathers it back.
        self.seq_split = getattr(model, "tp_size", 1)
        self.tp_group = getattr(model, "tp_group", None)

    def moe_layers(self):
        """This rank's MoE layers in layer order (the order its MoE outputs come back in)."""
        return [block.ffn for block in self.layers if block.is_moe]

    def moe_indices(self) -> list[int]:
        """Positions of this rank's MoE layers in the full model's `moe_layers()` list (where the
        step statistics of each belong when the stages' statistics are put together)."""
        moe_ids = [i for i in range(self.cfg.num_layers) if self.cfg.is_moe_layer(i)]
        return [moe_ids.index(block.layer_id) for block in self.layers if block.is_moe]

    def set_aux_loss_scale(self, scale: float):
        for moe in self.moe_layers():
            moe.aux_loss_scale = scale

    def activation_dtype(self) -> torch.dtype:
        """The dtype of the hidden states between stages: the parameters' (the residual stream
        stays in it under autocast)."""
        return next(self.parameters()).dtype

    def forward(self, x, chunk: int = 0, balance=None):
        """`balance`: the micro-batch's holder of a deferred balance loss (layers/balance.py);
        the pipeline runner passes it and finishes it across the stages."""
        global_chunk = self.chunk_ids[chunk]
        if global_chunk == 0:
            seq = x.shape[1]
            if seq > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds model.max_seq_len="
                                 f"{self.cfg.max_seq_len}")
            x = self.embed(x)
        seq = x.shape[1] * self.seq_split      # rotary tables cover the whole sequence
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        moe_outputs = []
        for block in self.layers[self.chunk_slices[chunk]]:
            x, moe_out = block(x, cos, sin, balance)
            if moe_out is not None:
                moe_outputs.append(moe_out)
        if global_chunk == self.num_chunks - 1:
            x = self.norm(x)
            if self.seq_split > 1:
                x = gather_sequence(x, self.tp_group)
            weight = self.embed.weight if self.head is None else self.head.weight
            x = F.linear(x, weight)
        return x, moe_outputs


def build_stage(model, pp_rank: int, pp: int, virtual: int = 1,
                pp_layers: list[int] | None = None) -> StageModule:
    """This rank's StageModule, built from a full Transformer (built from the same seed on every
    rank). The stage takes the model's modules as they are (no copy): apply EP and activation
    checkpointing to the full model first; data parallelism / ZeRO wrap the stage after."""
    return StageModule(model, pp_rank, pp, virtual, pp_layers)
