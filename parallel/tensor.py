"""Tensor parallelism with sequence parallelism: shard attention, dense FFNs, embedding and head over tp.

Talks on the `tp` group. Legend: B batch, S sequence, s = S/tp (this rank's slice), D model dim,
H/G query/key-value heads, Hd head dim, F dense hidden dim, V vocabulary.

Between blocks every activation is split along the sequence (`x_BsD`): norms, residual adds and
MoE layers see S/tp positions of each sequence. Attention and dense FFNs gather the sequence on
the way in and reduce-scatter it on the way out:

| region                    | forward                        | backward                       |
|---------------------------|--------------------------------|--------------------------------|
| embedding (vocab.py)      | reduce-scatter along S         | all-gather along S             |
| attention / MLA / FFN in  | all-gather along S             | reduce-scatter along S         |
| attention / MLA / FFN out | reduce-scatter along S         | all-gather along S             |
| "full" q/k norm           | all-reduce sum of squares      | all-reduce                     |
| LM head in                | all-gather along S             | reduce-scatter along S         |
| loss (vocab.py)           | 2 all-reduces (per call)       | none                           |
| MoE router (sequence_     | 1 all-reduce of loss sums; with| none                           |
|   router.py)              | capacity, 1 all-gather of picks|                                |
|                           | (packed documents: the same    |                                |
|                           | calls, with documents' sums)   |                                |
| after backward            | reduce_sequence_parallel_grads: 1 all-reduce (partial grads)    |

| parameter                                     | on each tp rank                     | TPShard        |
|-----------------------------------------------|-------------------------------------|----------------|
| qkv_proj [q; k; v] and its bias               | [its H/tp q heads; the k heads, the | FusedShard:    |
|                                               | v heads they read]: G/tp kv heads   | dim 0, parts   |
|                                               | when tp divides G; when G < tp, the | q, k, v (k, v: |
|                                               | one kv head, shared by tp/G ranks   | replicas tp/G) |
| MLA q_proj / q_b_proj / kv_b_proj             | its H/tp heads (rows)               | dim 0          |
| o_proj, dense w_out                           | columns of its heads / hidden units | dim 1          |
| dense w_in (SwiGLU [gate; up])                | F/tp rows of gate and of up         | dim 0, 2 chunks|
| "full" q_norm, k_norm                         | its heads' features                 | dim 0 (k: as k)|
| embed, head                                   | Vp/tp rows of the padded vocabulary | dim 0, padding |
| norms, "head" q/k norms, MLA down-projections,| everything (replicated): gradients  | none           |
| routers, shared experts                       | are partial, summed over tp         |                |
| routed experts                                | untouched (ep); reduced over edp    | none           |

Which parameters are sharded is decided by the module that owns them (the classes below,
`VocabParallelEmbedding`, `GroupedExperts`), never by attributes on parameters. Replicated
parameters see a slice of the tokens (or heads) on each rank, and a kv head shared by tp/G
ranks sees their q heads only, so those gradients are partial: `reduce_sequence_parallel_grads`
sums them (over tp, and over each kv head's replicas: the k and v rows of qkv_proj, `Rows`) once
per step, after backward, in one all-reduce. Sums commute, so it may run before or after the data-parallel mean. Expert
gradients are not summed here: `edp` already spans the tp ranks of an expert's ep group.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moepar.layers.experts import FeedForward, GroupedExperts
from moepar.layers.mla import MLA
from moepar.layers.attention import Attention
from moepar.layers.model import Transformer

from .comm import all_gather_rows, group_size, reduce_scatter_rows, to_wire
from .grads import Rows, all_reduce_sum, rows_of
from .sequence_router import use_token_group
from .vocab import VocabParallelEmbedding, padded_vocab_size

__all__ = ["TPShard", "FusedShard", "copy_to_tp", "reduce_from_tp", "gather_sequence", "scatter_sequence",
           "ColumnParallelLinear", "RowParallelLinear", "ShardedRMSNorm", "check_tp", "apply_tp",
           "tp_shard_spec", "local_shard", "full_tensor", "tp_norm_parameters",
           "reduce_sequence_parallel_grads", "SequenceTokenGroup"]


# ---- collectives ----------------------------------------------------------------------------

def _all_reduce(x, group):
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


class _AllReduce(torch.autograd.Function):
    """forward: all-reduce (sum) if `forward_sum`, else identity; backward: likewise `backward_sum`."""

    @staticmethod
    def forward(ctx, x, group, forward_sum: bool, backward_sum: bool):
        ctx.group, ctx.backward_sum = group, backward_sum
        return _all_reduce(x, group) if forward_sum else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (_all_reduce(grad, ctx.group) if ctx.backward_sum else grad), None, None, None


def copy_to_tp(x, group):
    """Enters a tensor-parallel region: identity forward, all-reduce (sum) backward."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group, False, True)


def reduce_from_tp(x, group):
    """Leaves a tensor-parallel region: all-reduce (sum) forward, identity backward."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group, True, False)


def _sum_both_ways(x, group):
    """All-reduce (sum) forward and backward: every rank's copy of the sum feeds its own outputs."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group, True, True)


def gather_sequence(x_BsD, group):
    """[B, S/tp, ...] -> [B, S, ...]: all-gather forward, reduce-scatter (sum) backward.

    Under autocast the input travels in the autocast dtype (the next matmul casts it anyway)."""
    return all_gather_rows(to_wire(x_BsD).transpose(0, 1), group).transpose(0, 1)


def scatter_sequence(x_BSD, group):
    """[B, S, ...] partial sums -> [B, S/tp, ...] of the total: reduce-scatter forward, all-gather
    backward."""
    return reduce_scatter_rows(x_BSD.transpose(0, 1), group).transpose(0, 1)


# ---- layouts --------------------------------------------------------------------------------

@dataclass(frozen=True)
class TPShard:
    """How a full tensor maps to tp shards: along `dim`, the full tensor (plus `padding` zero
    rows at the end) is cut into `chunks` equal blocks ([gate; up] is 2), each block into
    tp/replicas pieces; rank r holds piece r // replicas of every block, concatenated. With
    replicas > 1 (kv heads fewer than tp) consecutive ranks hold the same piece, and each of
    their gradients is partial."""
    dim: int
    tp: int
    chunks: int = 1
    padding: int = 0
    replicas: int = 1

    def __post_init__(self):
        if self.tp % self.replicas or (self.replicas > 1 and (self.chunks > 1 or self.padding)):
            raise ValueError(f"{self}: replicas must divide tp, and replicated pieces are plain")

    @property
    def num_pieces(self) -> int:
        return self.tp // self.replicas


@dataclass(frozen=True)
class FusedShard:
    """A tensor fused along dim 0 from parts of canonical lengths `sizes`, each cut by its own
    TPShard (qkv_proj: q by heads, k and v by kv heads, possibly replicated): rank r holds its
    piece of every part, concatenated in part order, so its q heads and the kv heads they read
    stay together and the local forward splits its own output."""
    sizes: tuple[int, ...]
    parts: tuple[TPShard, ...]
    dim: int = 0

    def __post_init__(self):
        bad = [p for n, p in zip(self.sizes, self.parts, strict=True)
               if p.dim != self.dim or p.chunks != 1 or p.padding or n % p.num_pieces]
        if bad or len({p.tp for p in self.parts}) != 1:
            raise ValueError(f"{self}: parts must be plain pieces along dim {self.dim} over one tp")

    @property
    def tp(self) -> int:
        return self.parts[0].tp

    @property
    def local_sizes(self) -> tuple[int, ...]:
        return tuple(n // p.num_pieces for n, p in zip(self.sizes, self.parts, strict=True))

    def replica_rows(self) -> list[tuple[int, int, int]]:
        """[(start, stop, replicas)]: local rows along dim 0 grouped by how many tp ranks hold
        them (adjacent parts with the same count merged)."""
        out, start = [], 0
        for n, part in zip(self.local_sizes, self.parts, strict=True):
            if out and out[-1][2] == part.replicas:
                out[-1] = (out[-1][0], start + n, part.replicas)
            else:
                out.append((start, start + n, part.replicas))
            start += n
        return out


def local_shard(full: torch.Tensor, spec: TPShard | FusedShard, tp_rank: int) -> torch.Tensor:
    """This rank's piece of a full (canonical) tensor; pure, no communication."""
    if isinstance(spec, FusedShard):
        return torch.cat([local_shard(part, s, tp_rank) for part, s in
                          zip(full.split(spec.sizes, spec.dim), spec.parts, strict=True)], spec.dim)
    if spec.padding:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padding
        full = torch.cat([full, full.new_zeros(pad_shape)], spec.dim)
    piece = tp_rank // spec.replicas
    blocks = full.chunk(spec.chunks, spec.dim)
    return torch.cat([b.chunk(spec.num_pieces, spec.dim)[piece] for b in blocks],
                     spec.dim).contiguous()


def full_tensor(local: torch.Tensor, spec: TPShard, group) -> torch.Tensor:
    """The full (canonical, unpadded) tensor from every rank's piece; inverse of local_shard.

    Forward only (tests compare against whole tensors with it): all_gather over `group`; every tp
    rank must call it, in the same order."""
    if isinstance(spec, FusedShard):
        return torch.cat([full_tensor(part, s, group) for part, s in
                          zip(local.split(spec.local_sizes, spec.dim), spec.parts, strict=True)],
                         spec.dim)
    pieces = [torch.empty_like(local) for _ in range(spec.tp)]
    if spec.tp > 1:
        dist.all_gather(pieces, local.contiguous(), group=group)
    else:
        pieces[0] = local
    blocks = zip(*(p.chunk(spec.chunks, spec.dim) for p in pieces[::spec.replicas]))
    full = torch.cat([torch.cat(block, spec.dim) for block in blocks], spec.dim)
    return full.narrow(spec.dim, 0, full.shape[spec.dim] - spec.padding)


# ---- sharded modules ------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y = x @ W_local.T + b_local: this rank's output features of the full sequence (no
    communication here; the caller gathers the sequence first)."""

    def __init__(self, linear: nn.Linear, spec: TPShard | FusedShard, tp_rank: int):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(local_shard(linear.weight.detach(), spec, tp_rank))
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(local_shard(linear.bias.detach(), spec, tp_rank))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y_partial = x_local @ W_local.T over this rank's input features; the caller sums the
    partials (reduce-scatter along the sequence). No bias: it would be added tp times."""

    def __init__(self, linear: nn.Linear, tp: int, tp_rank: int):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("RowParallelLinear takes no bias (the model's o_proj and w_out have none)")
        self.spec = TPShard(dim=1, tp=tp)
        self.weight = nn.Parameter(local_shard(linear.weight.detach(), self.spec, tp_rank))

    def forward(self, x):
        return F.linear(x, self.weight)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across tp ("full" q/k norm): the sum of squares is all-reduced
    (a piece held by `replicas` ranks is counted that many times, hence the division)."""

    def __init__(self, norm: nn.Module, spec: TPShard, tp_rank: int, group):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(local_shard(norm.weight.detach(), spec, tp_rank))
        self.eps, self.full_dim, self.group = norm.eps, norm.weight.shape[0], group

    def forward(self, x):
        # In float32 at least, as F.rms_norm computes. Forward all-reduce, backward all-reduce:
        # each rank's copy of the sum scales its own features.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        squares = _sum_both_ways(xf.pow(2).sum(-1, keepdim=True), self.group) / self.spec.replicas
        return (xf * torch.rsqrt(squares / self.full_dim + self.eps) * self.weight).to(x.dtype)


_SHARDED_MODULES = (ColumnParallelLinear, RowParallelLinear, ShardedRMSNorm, VocabParallelEmbedding)


# ---- sequence-parallel forwards (installed by apply_tp through a class swap) ---------------

class SequenceParallelAttention(Attention):
    """Grouped-query attention on this rank's H/tp q heads and the kv heads they read (G/tp, or
    one when G < tp): x_BsD in, x_BsD out (num_heads and num_kv_heads are the local counts).
    Packed documents: `mask` [B, 1, S, S] and per-row cos/sin cover the whole sequence, which
    attention sees gathered (no cache: training and evaluation only)."""

    def forward(self, x_BsD, cos_SHd, sin_SHd, cache=None, mask=None):
        y_BSD = self.local_forward(gather_sequence(x_BsD, self.tp_group), cos_SHd, sin_SHd,
                                   cache, mask)
        return scatter_sequence(y_BSD, self.tp_group)

    # The maths between the collectives (what parallel/compile.py compiles).
    local_forward = Attention.forward


class SequenceParallelMLA(MLA):
    """Latent attention on this rank's heads (num_heads is local); the down-projections and their
    norms are replicated and run on the gathered sequence; a document `mask` covers it whole."""

    def forward(self, x_BsD, cos_SR, sin_SR, cache=None, mask=None):
        y_BSD = self.local_forward(gather_sequence(x_BsD, self.tp_group), cos_SR, sin_SR, cache,
                                   mask)
        return scatter_sequence(y_BSD, self.tp_group)

    local_forward = MLA.forward


class SequenceParallelFeedForward(FeedForward):
    """The dense FFN on this rank's F/tp hidden units: x_BsD in, x_BsD out."""

    def forward(self, x_BsD):
        return scatter_sequence(self.local_forward(gather_sequence(x_BsD, self.tp_group)),
                                self.tp_group)

    local_forward = FeedForward.forward


class TensorParallelTransformer(Transformer):
    """forward(tokens_BS) -> (logits_BSVl, MoE outputs): this rank's vocabulary columns of the
    padded vocabulary, for every position; `head_fn` (the training loss) gets every position's
    final hidden states h_BSD and `head_weight` (this rank's [Vl, D] rows) instead, for
    `vocab_parallel_linear_cross_entropy`.

    MoE layers route this rank's S/tp positions; their routers' `SequenceTokenGroup` makes the
    capacity group and the balance and z losses those of the whole micro-batch (as at tp=1).
    """

    @property
    def seq_split(self) -> int:
        return self.tp_size

    def forward(self, x, balance=None, **kwargs):
        if not x.is_floating_point() and x.shape[1] % self.tp_size:
            raise ValueError(f"sequence length {x.shape[1]} must be divisible by "
                             f"parallel.tp={self.tp_size} (sequence parallelism splits it "
                             "between blocks)")
        return super().forward(x, balance, **kwargs)   # the blocks run on sequence slices x_BsD

    def final_hidden(self, x_BsD):
        """Final norm on this rank's slice, then the whole sequence (the head, `output`, takes it
        through this rank's vocabulary columns)."""
        return gather_sequence(self.norm(x_BsD), self.tp_group)


# ---- apply ----------------------------------------------------------------------------------

def check_tp(cfg, tp: int, seq_len: int | None = None):
    """Raises ValueError naming the fields when model `cfg` cannot be split over tp (no processes)."""
    if tp < 1:
        raise ValueError(f"parallel.tp={tp} must be >= 1")
    if cfg.num_heads % tp:
        raise ValueError(f"model.num_heads={cfg.num_heads} must be divisible by parallel.tp={tp} "
                         "(each tp rank computes whole heads)")
    if cfg.attention == "gqa" and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} and parallel.tp={tp}: one must "
                         "divide the other (kv heads are split over tp, or shared by tp/G ranks)")
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if dense and cfg.ffn_dim % tp:
        raise ValueError(f"model.ffn_dim={cfg.ffn_dim} must be divisible by parallel.tp={tp} "
                         f"(dense layers {dense} split their hidden units over tp)")
    if seq_len is not None and seq_len % tp:
        raise ValueError(f"train.seq_len={seq_len} must be divisible by parallel.tp={tp} "
                         "(sequence parallelism splits it between blocks)")


def _swap_class(module: nn.Module, cls: type, group, **attrs):
    # The class swap keeps the module object, its submodules and parameter names (FSDP2's
    # fully_shard does the same); only forward changes.
    module.__class__ = cls
    module.tp_group = group
    for name, value in attrs.items():
        setattr(module, name, value)


def _shard_attention(attn: Attention, tp: int, rank: int, group):
    heads, kv = attn.num_heads, attn.num_kv_heads
    # G < tp: rank r's q heads all read kv head r // (tp/G), held by those tp/G ranks alike.
    q_spec, kv_spec = TPShard(0, tp), TPShard(0, tp, replicas=max(tp // kv, 1))
    # Not a contiguous slice of the fused rows: each rank's q heads, then its k and v heads.
    qkv_spec = FusedShard(attn.qkv_sizes(), (q_spec, kv_spec, kv_spec))
    attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, qkv_spec, rank)
    if attn.qk_norm == "full":
        attn.q_norm = ShardedRMSNorm(attn.q_norm, q_spec, rank, group)
        attn.k_norm = ShardedRMSNorm(attn.k_norm, kv_spec, rank, group)
    attn.o_proj = RowParallelLinear(attn.o_proj, tp, rank)
    _swap_class(attn, SequenceParallelAttention, group, num_heads=heads // tp,
                num_kv_heads=kv // kv_spec.num_pieces)


def _shard_mla(mla: MLA, tp: int, rank: int, group):
    q_name = "q_b_proj" if mla.q_lora else "q_proj"
    for name in (q_name, "kv_b_proj"):   # rows grouped by head
        setattr(mla, name, ColumnParallelLinear(getattr(mla, name), TPShard(0, tp), rank))
    mla.o_proj = RowParallelLinear(mla.o_proj, tp, rank)
    _swap_class(mla, SequenceParallelMLA, group, num_heads=mla.num_heads // tp)


def _shard_feed_forward(ffn: FeedForward, tp: int, rank: int, group):
    chunks = 2 if ffn.activation == "swiglu" else 1
    ffn.w_in = ColumnParallelLinear(ffn.w_in, TPShard(0, tp, chunks), rank)
    ffn.w_out = RowParallelLinear(ffn.w_out, tp, rank)
    _swap_class(ffn, SequenceParallelFeedForward, group)


@torch.no_grad()
def apply_tp(model: Transformer, dims, meshes, seq_len: int | None = None) -> Transformer:
    """Shards `model` (built identically on every rank) over the tp group in place; returns it.

    Afterwards model(tokens_BS) takes the full token ids on every tp rank and returns this rank's
    vocabulary columns (see TensorParallelTransformer). Parameter names do not change; sharded
    ones are listed by `tp_shard_spec`.
    """
    cfg, tp = model.cfg, dims.tp
    check_tp(cfg, tp, seq_len)
    group = meshes.group("tp")
    rank = meshes.dense.get_local_rank("tp")
    vocab = cfg.vocab_size
    vocab_spec = TPShard(0, tp, padding=padded_vocab_size(vocab, tp) - vocab)
    local_vocab = padded_vocab_size(vocab, tp) // tp
    model.embed = VocabParallelEmbedding(local_shard(model.embed.weight.detach(), vocab_spec, rank),
                                         rank * local_vocab, vocab, group, vocab_spec)
    if model.head is not None:
        model.head = ColumnParallelLinear(model.head, vocab_spec, rank)
    for block in model.layers:
        if isinstance(block.attn, MLA):
            _shard_mla(block.attn, tp, rank, group)
        else:
            _shard_attention(block.attn, tp, rank, group)
        if not block.is_moe:
            _shard_feed_forward(block.ffn, tp, rank, group)
    _swap_class(model, TensorParallelTransformer, group, tp_size=tp)
    token_group = SequenceTokenGroup(group)
    for moe in model.moe_layers():     # routers of slices: chosen here, once (sequence_router.py)
        use_token_group(moe.router, token_group)
    return model


class SequenceTokenGroup:
    """The router's view of the tp group (sequence_router.py `SequenceParallelRouter`): each rank
    holds positions [r*s, (r+1)*s) of every sequence of the micro-batch.

    gather: [B, s, ...] -> [B, S, ...] (no gradient: capacity decisions); local: the inverse
    slice; total: all-reduce sum forward, gradient passed straight back (each rank's tokens get
    their share of the whole micro-batch's loss)."""

    def __init__(self, group):
        self.group, self.size = group, group_size(group)
        self.rank = dist.get_rank(group) if self.size > 1 else 0

    def gather(self, t_BsX):
        with torch.no_grad():
            return all_gather_rows(t_BsX.transpose(0, 1).contiguous(), self.group).transpose(0, 1)

    def local(self, t_BSX):
        s = t_BSX.shape[1] // self.size
        return t_BSX[:, self.rank * s:(self.rank + 1) * s]

    def total(self, t):
        return reduce_from_tp(t, self.group)


# ---- gradients and checkpoints --------------------------------------------------------------

def tp_shard_spec(model) -> dict[str, TPShard | FusedShard]:
    """{canonical parameter name: TPShard} for every tensor-parallel-sharded parameter; the rest
    are whole on every tp rank. Optimizer states of a parameter share its spec."""
    return {f"{prefix}.{name}": module.spec
            for prefix, module in model.named_modules() if isinstance(module, _SHARDED_MODULES)
            for name, _ in module.named_parameters(recurse=False)}


def _split(model):
    """(sharded [(param, spec)], replicated non-expert params), by owning module type."""
    sharded = [(p, m.spec) for m in model.modules() if isinstance(m, _SHARDED_MODULES)
               for p in m.parameters(recurse=False)]
    skip = {id(p) for p, _ in sharded} | {id(p) for m in model.modules()
                                          if isinstance(m, GroupedExperts) for p in m.parameters()}
    return sharded, [p for p in model.parameters() if id(p) not in skip]


def _replica_pieces(p, spec):
    """[(p or Rows of p, replicas)]: a sharded parameter as parts of one replica count each (a
    fused qkv_proj whose kv heads are shared by tp/G ranks: its q rows, then its k and v rows)."""
    if isinstance(spec, FusedShard):
        rows = spec.replica_rows()
        if len(rows) > 1:
            return [(Rows(p, start, stop), replicas) for start, stop, replicas in rows]
        return [(p, rows[0][2])]
    return [(p, spec.replicas)]


def tp_norm_parameters(model, group):
    """(sharded, replicated, extra replicas) for a global gradient norm: sum the squares of
    `sharded` over tp (a piece held by several ranks is listed on the first of them only), count
    `replicated` once (equal on every tp rank after reduce_sequence_parallel_grads), and clip but
    do not count the other holders' copies of a shared piece. A parameter whose rows differ in
    that (qkv_proj with shared kv heads) is listed as its `Rows`. Routed experts are in none of
    the lists (grads.py's expert group covers them)."""
    tp_rank = dist.get_rank(group) if group_size(group) > 1 else 0
    sharded, replicated = _split(model)
    pieces = [piece for p, spec in sharded for piece in _replica_pieces(p, spec)]
    first = [p for p, replicas in pieces if tp_rank % replicas == 0]
    return first, replicated, [p for p, replicas in pieces if tp_rank % replicas]


def _own_grad(p, rows=None):
    return rows_of(p.grad, rows)


def reduce_sequence_parallel_grads(model, group, grad_view=None):
    """Sums partial gradients in place, once per step after the last backward, in one all-reduce
    over tp (every tp rank, same parameters; no host sync): replicated parameters over all of tp;
    a kv piece held by tp/G ranks over those ranks (it travels in a zero slot per piece, so one
    all-reduce serves every replica set).

    `grad_view(p, rows=None)` is where p's gradient (of rows [start, stop) of dim 0) lives on
    this rank: p.grad by default, or under ZeRO this rank's part of its data-parallel shard (the
    same part on every tp rank of a dp rank). Sums commute, so this may run before or after the
    data-parallel reduction."""
    grad_view = grad_view or _own_grad
    sharded, replicated = _split(model)
    grads = [g for g in map(grad_view, replicated) if g is not None]
    slots = []   # (grad, replicas, zero-filled [pieces, numel] buffer) for kv pieces
    tp = group_size(group)
    tp_rank = dist.get_rank(group) if tp > 1 else 0
    for p, spec in sharded:
        for piece, replicas in _replica_pieces(p, spec):
            if replicas == 1:
                continue
            grad = (grad_view(piece.param, (piece.start, piece.stop)) if isinstance(piece, Rows)
                    else grad_view(piece))
            if grad is not None:
                buffer = grad.new_zeros(tp // replicas, grad.numel())
                buffer[tp_rank // replicas].copy_(grad.reshape(-1))
                slots.append((grad, replicas, buffer))
    all_reduce_sum(grads + [buffer for _, _, buffer in slots], group)
    for grad, replicas, buffer in slots:
        grad.copy_(buffer[tp_rank // replicas].view_as(grad))
