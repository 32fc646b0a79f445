"""Pipeline parallelism, the split: which layers each stage holds, and the stage itself, which is
the model with the modules its rank does not hold removed (`apply_pp`).

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
| mtp (MTP depths)| pp rank pp-1 (the last chunk)         | mtp.<k>.* (the embedding output |
|                 |                                       | comes from rank 0: see          |
|                 |                                       | pipeline_runner.py)             |
| rope tables     | every rank (buffers, not saved)       | -                               |

Names are the full model's, so checkpoints and MoE layer ids do not depend on the split. The
stage runs the model's own forward (layers/model.py `Transformer`): without the embedding it
takes hidden states, without the final norm it returns them, and `chunk_slices` gives each local
chunk's blocks; tensor parallelism's class (applied before the split) keeps its output, so the
last stage gathers the sequence before the head as the whole model does.
Tied embeddings are refused when pp > 1: the tied weight would sit on two ranks and need its
own gradient all-reduce between the first and last stage.
"""

from torch import nn

__all__ = ["split_layers", "rank_chunks", "apply_pp"]


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


def apply_pp(model, pp_rank: int, pp: int, virtual: int = 1, pp_layers: list[int] | None = None):
    """Makes `model` (a whole Transformer, built from the same seed on every rank) pipeline rank
    `pp_rank`'s stage, in place: it keeps its chunks' blocks (and the embedding on the first, the
    final norm and head on the last) and forgets the rest; returns it. Apply expert and tensor
    parallelism and recompute first (they change the blocks); data parallelism wraps the stage
    after."""
    cfg = model.cfg
    counts = split_layers(cfg.num_layers, pp, virtual, pp_layers)
    if cfg.tie_embeddings and pp > 1:
        raise ValueError("model.tie_embeddings=true with parallel.pp>1 is not supported: the "
                         "embedding (first stage) and head (last stage) would share a weight "
                         "across ranks; set model.tie_embeddings=false or parallel.pp=1")
    num_chunks = pp * virtual
    chunk_ids = rank_chunks(pp_rank, pp, virtual)
    starts = [sum(counts[:c]) for c in range(num_chunks + 1)]
    # Positions in the stage's layers of each local chunk's blocks (ids ascend with chunks).
    chunk_slices, blocks = [], []
    for c in chunk_ids:
        chunk_slices.append(slice(len(blocks), len(blocks) + counts[c]))
        blocks += [model.layers[i] for i in range(starts[c], starts[c + 1])]
    if chunk_ids[0] != 0:
        model.embed = None
    if chunk_ids[-1] != num_chunks - 1:
        model.norm = model.head = model.mtp = None
    model.layers = _LayersById(blocks)
    model.chunk_slices = chunk_slices
    return model
