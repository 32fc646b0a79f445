"""The rank layout: one object that knows how ranks fold into dense and expert axes.

Two decompositions of the same ranks, `pp` outermost in both so pipeline groups coincide:

| layers                                   | mesh axes        | product                          |
|------------------------------------------|------------------|----------------------------------|
| dense (attention, embeddings, head, MLP) | (pp, dp, cp, tp) | world                            |
| experts                                  | (pp, edp, ep)    | world, with edp = dp*cp*tp / ep  |

Within one pipeline stage the dp*cp*tp ranks are numbered dp-major (rank = (dp_rank * cp +
cp_rank) * tp + tp_rank) and re-read as (edp, ep) with ep innermost, so an EP group is a block of
consecutive ranks: it is the tp group when ep == tp, and spans cp and dp ranks when ep > tp
(Megatron's parallel folding). Context parallelism (cp, parallel/context.py) adds two groups
beside the meshes' axes: `dp_cp` (dense gradients, the step's loss and statistics) and `cp_tp`
(the ranks holding pieces of the same sequences: the routers' token group); at cp = 1 they are
the dp and tp groups.

`ParallelDims` validates on construction, before any process group exists; `coords` is pure rank
maths; `build_meshes` makes the two DeviceMeshes (every axis gets a real group, size 1 included).
`Layout` (ParallelDims bound to a rank) also runs the few collectives over the whole world that the
trainer needs (barrier, rank 0's object, MAX/MIN of flags); each is a no-op at world size 1, so
the caller never branches on it.
"""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims", "Coords", "Meshes", "Layout"]


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int
    edp: int
    ep: int
    cp: int = 0


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    num_experts: int | None = None   # checked against ep when given
    gpus_per_node: int = 0           # processes per node; 0: the whole world is one node
    cp: int = 1                      # context parallel: ranks sharing each sequence

    def __post_init__(self):
        for name in ("world_size", "pp", "dp", "tp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name if name != 'world_size' else 'world size'}="
                                 f"{getattr(self, name)} must be >= 1")
        if self.pp * self.dp * self.cp * self.tp != self.world_size:
            cp = f"parallel.cp={self.cp} * " if self.cp > 1 else ""
            raise ValueError(f"world size {self.world_size} != parallel.pp={self.pp} * "
                             f"parallel.dp={self.dp} * {cp}parallel.tp={self.tp} "
                             f"(= {self.pp * self.dp * self.cp * self.tp})")
        if self.stage_size % self.ep:
            cp = ("parallel.cp * ", f"{self.cp} * ", "context, ") if self.cp > 1 else ("", "", "")
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.dp * {cp[0]}parallel.tp "
                             f"= {self.dp} * {cp[1]}{self.tp} = {self.stage_size} (experts fold "
                             f"over the dense data, {cp[2]}and tensor ranks of a stage)")
        node = self.gpus_per_node
        if node < 0 or (0 < node < self.world_size and self.world_size % node):
            raise ValueError(f"parallel.gpus_per_node={node} must divide the world size "
                             f"{self.world_size} (every node runs the same number of ranks)")
        if self.num_experts is not None and self.num_experts % self.ep:
            raise ValueError(f"model.num_experts={self.num_experts} must be divisible by "
                             f"parallel.ep={self.ep}")

    @classmethod
    def resolve(cls, world_size: int, pp: int = 1, dp: int = 0, tp: int = 1, ep: int = 1,
                num_experts: int | None = None, gpus_per_node: int = 0,
                cp: int = 1) -> "ParallelDims":
        """dp=0 means "the rest": world_size / (pp * cp * tp)."""
        for name, value in (("pp", pp), ("tp", tp), ("cp", cp)):
            if value < 1:
                raise ValueError(f"parallel.{name}={value} must be >= 1")
        if dp == 0:
            if world_size % (pp * cp * tp):
                cp_text = f" * parallel.cp={cp}" if cp > 1 else ""
                raise ValueError(f"world size {world_size} is not divisible by parallel.pp={pp} "
                                 f"* parallel.tp={tp}{cp_text}, so parallel.dp cannot be derived")
            dp = world_size // (pp * cp * tp)
        return cls(world_size, pp, dp, tp, ep, num_experts, gpus_per_node, cp)

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: dp * cp * tp."""
        return self.dp * self.cp * self.tp

    @property
    def dense_data_axis(self) -> str:
        """The axis dense gradients are reduced (and ZeRO-sharded) over: every rank holding the
        same dense shard, dp, times cp (its ranks saw other positions of the same sequences)."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def edp(self) -> int:
        return self.stage_size // self.ep

    def coords(self, rank: int) -> Coords:
        """Pure rank maths: this rank's index on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        pp_rank, in_stage = divmod(rank, self.stage_size)
        dp_rank, in_dp = divmod(in_stage, self.cp * self.tp)
        cp_rank, tp_rank = divmod(in_dp, self.tp)
        edp_rank, ep_rank = divmod(in_stage, self.ep)
        return Coords(pp_rank, dp_rank, tp_rank, edp_rank, ep_rank, cp_rank)

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks sharing every coordinate with `rank` except `axis` (pure maths); `axis`
        may also be "dp_cp" or "cp_tp" (those two axes vary)."""
        me = self.coords(rank)
        dense = axis in _DENSE_AXES or axis in _FOLDED
        keep = ("pp", "dp", "cp", "tp") if dense else ("pp", "edp", "ep")
        free = _FOLDED.get(axis, (axis,))
        return [r for r in range(self.world_size)
                if all(getattr(self.coords(r), a) == getattr(me, a) for a in keep if a not in free)]

    def build_meshes(self, device_type: str) -> "Meshes":
        """Both DeviceMeshes (needs an initialised default process group).

        Cached per layout and default process group: every mesh axis is a process group with its
        own communicator threads (gloo: several per group), and a process that builds several
        trainers (tests, notebooks) would otherwise pile them up.
        """
        key = (id(dist.distributed_c10d._get_default_group()), dist.get_rank(), device_type,
               self.pp, self.dp, self.tp, self.ep, self.cp)
        if key not in _MESHES:
            dense = init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.tp),
                                     mesh_dim_names=("pp", "dp", "cp", "tp"))
            expert = init_device_mesh(device_type, (self.pp, self.edp, self.ep),
                                      mesh_dim_names=("pp", "edp", "ep"))
            folded = self._folded_groups(device_type) if self.cp > 1 else {}
            _MESHES[key] = Meshes(dense, expert, folded)
        return _MESHES[key]

    def _folded_groups(self, device_type: str) -> dict:
        """{"dp_cp": 1-D DeviceMesh, "cp_tp": 1-D DeviceMesh} of this rank, each over a process
        group that every rank creates for every group of that axis, in the same order (what
        new_group requires); from_group wraps them for FSDP2, which takes meshes."""
        me, out = dist.get_rank(), {}
        for axis in _FOLDED:
            seen = set()
            for rank in range(self.world_size):
                ranks = tuple(self.group_ranks(axis, rank))
                if ranks in seen:
                    continue
                seen.add(ranks)
                group = dist.new_group(list(ranks))
                if me in ranks:
                    out[axis] = DeviceMesh.from_group(group, device_type, mesh_dim_names=(axis,))
        return out

    def describe(self) -> str:
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return (f"world {self.world_size} = pp {self.pp} x dp {self.dp}{cp} x tp {self.tp}; "
                f"experts: pp {self.pp} x edp {self.edp} x ep {self.ep}")

    # ---- nodes ---------------------------------------------------------------------------
    # Every group is an arithmetic progression of ranks (first member, stride, size): tp is
    # innermost, an EP group is a block of consecutive ranks of a stage, pp is outermost. So tp
    # stays inside a node whenever the node size is a multiple of tp, then ep whenever it is a
    # multiple of ep; dp, edp and pp span nodes first.
    def _progression(self, axis: str) -> tuple[int, int]:
        """(stride, size) of the groups of `axis` in rank order."""
        return {"tp": (1, self.tp), "cp": (self.tp, self.cp), "dp": (self.cp * self.tp, self.dp),
                "pp": (self.stage_size, self.pp), "ep": (1, self.ep),
                "edp": (self.ep, self.edp)}[axis]

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node if self.gpus_per_node else 0

    def spans_nodes(self, axis: str) -> bool:
        """True if some group of `axis` has ranks on more than one node (pure maths)."""
        if not self.gpus_per_node or self.gpus_per_node >= self.world_size:
            return False
        stride, size = self._progression(axis)
        return any(self.node_of(r) != self.node_of(r + (size - 1) * stride)
                   for r in range(self.world_size) if getattr(self.coords(r), axis) == 0)

    def describe_nodes(self) -> str:
        """Which groups stay inside a node and which span nodes, for the start-up log."""
        node = self.gpus_per_node
        if not node or node >= self.world_size:
            return f"one node of {self.world_size} ranks"
        axes = [a for a in ("tp", "cp", "ep", "dp", "edp", "pp") if self._progression(a)[1] > 1]
        inside = [a for a in axes if not self.spans_nodes(a)]
        across = [a for a in axes if self.spans_nodes(a)]
        return (f"{self.world_size // node} nodes of {node} ranks; inside a node: "
                f"{', '.join(inside) or 'none'}; across nodes: {', '.join(across) or 'none'}")


    def bind(self, rank: int, device) -> "Layout":
        """This layout seen from `rank` on `device`; builds the meshes when the world has more
        than one rank (a default process group must exist then)."""
        meshes = self.build_meshes(device.type) if self.world_size > 1 else None
        return Layout(self, rank, device, meshes)


_MESHES: dict[tuple, "Meshes"] = {}
_DENSE_AXES = ("pp", "dp", "cp", "tp")
_FOLDED = {"dp_cp": ("dp", "cp"), "cp_tp": ("cp", "tp")}   # two dense axes read as one


@dataclass(frozen=True)
class Meshes:
    dense: object    # DeviceMesh (pp, dp, cp, tp)
    expert: object   # DeviceMesh (pp, edp, ep)
    folded: dict = None   # {"dp_cp", "cp_tp": 1-D DeviceMesh} under cp > 1; else absent

    def mesh(self, axis: str):
        """The 1-D DeviceMesh of `axis` (a folded axis at cp = 1 is its one non-trivial axis)."""
        if axis in _FOLDED:
            if self.folded:
                return self.folded[axis]
            axis = {"dp_cp": "dp", "cp_tp": "tp"}[axis]
        return (self.dense if axis in _DENSE_AXES else self.expert)[axis]

    def group(self, axis: str):
        return self.mesh(axis).get_group()


@dataclass(frozen=True)
class Layout:
    """A ParallelDims bound to one rank: its coordinates, its device and the meshes (None in a
    single process without a process group, where every group is None and every size 1)."""
    dims: ParallelDims
    rank: int
    device: object           # torch.device
    meshes: Meshes | None

    @property
    def coords(self) -> Coords:
        return self.dims.coords(self.rank)

    def group(self, axis: str):
        """The process group of `axis`, or None without meshes."""
        return None if self.meshes is None else self.meshes.group(axis)

    def size(self, axis: str) -> int:
        return getattr(self.dims, axis)

    # ---- the world's collectives: every rank calls them in the same order; alone, no-ops ----
    # Objects travel pickled (the default group's own object collectives): a host sync each,
    # for start-up, checkpoint and stop decisions, never per micro-batch.
    @property
    def world(self) -> int:
        """The processes in these collectives: the world size, or 1 without meshes (one process,
        also when it stands in for a rank of a larger layout)."""
        return self.dims.world_size if self.meshes is not None else 1

    def barrier(self):
        """Waits for every rank."""
        if self.world > 1:
            dist.barrier()

    def from_rank0(self, obj):
        """Rank 0's `obj` on every rank (broadcast_object_list)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_to_first(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0; None elsewhere (gather_object)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def everyone(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (all_gather_object)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def all_reduce(self, tensor, op: str):
        """`tensor` reduced in place over every rank by `op` ('max', 'min' or 'sum') and returned;
        no host sync (the caller reads it with the step's own)."""
        if self.world > 1:
            dist.all_reduce(tensor, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                                        "sum": dist.ReduceOp.SUM}[op])
        return tensor
