"""Reading a checkpoint: each rank intersects its boxes with the stored pieces and verifies the
hashed blocks those reads touch before any rank changes anything; plus whole-tensor reads for
export and the state and manifest checks.
"""

import math
import os
import re

import torch

from moepar.checkpoint.base import INDEX, MANIFEST, STATE, CheckpointError, volume_ok
from moepar.jsonfile import ANY, FileError, Int, List, Map, Num, Obj, OneOf, Opt, Str, read_json
from moepar.layers.init import canonical_tensors
from moepar.parallel.dims import Layout, ParallelDims
from moepar.parallel.placement import Placement
from moepar.parallel.shards import local_view
from moepar.tensorfile import (DTYPES, TensorFileError, box_bytes, check_blocks, read_box,
                               read_header)

# What a reader relies on in each small file, checked before anything is used (jsonfile.py).
_HEX = Str(pattern=r"[0-9a-f]{64}")
_DIGEST = OneOf(_HEX, Obj({"size": Int(), "sha256": _HEX, "block": Int(1),
                           "blocks": List(_HEX, min_len=1)}, required=("size", "block", "blocks")),
                kinds=(str, dict))
MANIFEST_SCHEMA = Obj({"format": Int(1, 1 << 16), "step": ANY, "world_size": Int(0, 1 << 24),
                       "files": Map(_DIGEST)}, required=("files",))
_DIMS = List(Int(0, 1 << 62))
_PIECE = Obj({"file": Str(), "key": Str(), "offsets": _DIMS, "sizes": _DIMS,
              "data_offsets": List(Int(), 2, 2)}, required=("file", "key", "offsets", "sizes"))
_ENTRY = OneOf(Str(), Obj({"shape": _DIMS, "dtype": Str(), "pieces": List(_PIECE)},
                          required=("shape", "pieces")), kinds=(str, dict))
INDEX_SCHEMA = Obj({"format": Int(1, 1 << 16), "model": Map(_ENTRY), "optimizer": Map(_ENTRY)},
                   required=("model",))
# step and data_position have their own check (_check_state); config sections are objects
# whose keys the resume compares; a dataset fingerprint is sources and weights.
STATE_SCHEMA = Obj({"config": Map(Map()), "loss_scale": Obj({"scale": Num(0), "finite_steps": Int()},
                                                             required=("scale", "finite_steps")),
                    "dataset": Opt(Obj({"sources": List(Map()), "weights": List(Num(0))},
                                       required=("sources", "weights"))),
                    "stop_reason": Str(), "layout": Str()}, required=("step",))
_RNG_FILE = re.compile(r"^rng-r(\d{5})\.safetensors$")
# Attention's separate q/k/v projections, as checkpoints held them before one qkv_proj replaced
# them (MLA's q_proj is another tensor: the model then has no qkv_proj of that name).
_UNFUSED = re.compile(r"^(.*\.attn)\.[qkv]_proj\.(weight|bias)$")


def read_manifest(path: str) -> dict:
    """A checkpoint folder's manifest.json, checked against MANIFEST_SCHEMA (CheckpointError)."""
    try:
        return read_json(os.path.join(path, MANIFEST), MANIFEST_SCHEMA)
    except FileError as e:
        raise CheckpointError(f"{e} ({MANIFEST} is unreadable)") from None


def manifest_files(path: str) -> list[str] | None:
    """The files a folder's manifest lists, or None when it has no readable manifest."""
    try:
        return list(read_manifest(path)["files"])
    except CheckpointError:
        return None


class _Checkpoint:
    """A committed checkpoint directory: manifest, index and state read and verified; stored
    pieces found by canonical name; headers read (and checked) once per file."""

    def __init__(self, path: str):
        self.path = path
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise CheckpointError(f"checkpoint {path!r} has no {MANIFEST}: it was never committed")
        manifest = read_manifest(path)
        self.files = manifest["files"]
        self.world_size = manifest.get("world_size", 0)
        self.step = manifest.get("step")
        for name in self.files:     # names only: nothing outside the folder is ever opened
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} lists {name!r}, which is "
                                      "not a file name inside the checkpoint")
        rng = sorted(int(m.group(1)) for m in map(_RNG_FILE.match, self.files) if m)
        if rng and rng != list(range(self.world_size)):
            raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} says world_size="
                                  f"{self.world_size} but lists the RNG files of ranks "
                                  f"{rng[:8]}{' ...' if len(rng) > 8 else ''} (one per rank "
                                  "that wrote it)")
        self.index = self._json(INDEX, INDEX_SCHEMA)
        self.state = self._json(STATE, STATE_SCHEMA)
        self.headers = {}

    def _json(self, name: str, schema):
        self.verify(name)
        try:
            return read_json(os.path.join(self.path, name), schema)
        except FileError as e:
            raise CheckpointError(str(e)) from None

    def verify(self, name: str, ranges=None):
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.path!r}: {name} is not listed in {MANIFEST}")
        try:
            check_blocks(os.path.join(self.path, name), self.files[name], ranges)
        except TensorFileError as e:
            raise CheckpointError(f"checkpoint {self.path!r}: {e}") from None

    def header(self, file: str):
        if file not in self.headers:
            if file not in self.files or os.path.basename(file) != file:
                raise CheckpointError(f"checkpoint {self.path!r}: {INDEX} names {file!r}, which "
                                      f"is not a file of the checkpoint")
            try:
                self.headers[file] = read_header(os.path.join(self.path, file))
            except TensorFileError as e:
                raise CheckpointError(f"checkpoint {self.path!r}: {e}") from None
        return self.headers[file]

    def entry(self, section: str, name: str) -> tuple[list | None, list]:
        """(shape or None, pieces [{file, key, offsets, sizes}]) of a stored tensor; format-1
        indexes map a name to the file holding it whole."""
        entry = self.index.get(section, {}).get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor {name!r}")
        if isinstance(entry, str):
            header, _ = self.header(entry)
            if name not in header:
                raise CheckpointError(f"checkpoint {self.path!r}: {entry} lacks {name!r}")
            shape = header[name]["shape"]
            return shape, [{"file": entry, "key": name, "offsets": [0] * len(shape),
                            "sizes": shape}]
        try:
            shape, pieces = list(entry["shape"]), list(entry["pieces"])
        except (KeyError, TypeError):
            raise CheckpointError(f"checkpoint {self.path!r}: {INDEX} entry {name!r} is "
                                  "malformed") from None
        ranks_fit = all(len(p["offsets"]) == len(p["sizes"]) == len(shape) for p in pieces)
        if not ranks_fit or not volume_ok(pieces, shape, check_overlap=len(pieces) <= 256):
            raise CheckpointError(f"checkpoint {self.path!r}: {INDEX} entry {name!r} has pieces "
                                  f"that do not tile its shape {shape!r} (malformed or damaged)")
        return shape, pieces

    def stored(self, piece: dict, want_dtype: torch.dtype, name: str):
        """(file, header entry, data start) of a piece, checked against its index entry."""
        file, key = piece.get("file"), piece.get("key")
        header, start = self.header(file)
        if key not in header:
            raise CheckpointError(f"checkpoint {self.path!r}: {file} lacks {key!r}")
        entry = header[key]
        if list(entry["shape"]) != list(piece.get("sizes", [])):
            raise CheckpointError(f"checkpoint {self.path!r}: {key!r} in {file} has shape "
                                  f"{entry['shape']}, the index says {piece.get('sizes')}")
        # The index records where the writer put each piece: a header changed after the save
        # (two same-shape tensors' offsets swapped, the file re-hashed) disagrees with it.
        if "data_offsets" in piece and piece["data_offsets"] != entry["data_offsets"]:
            raise CheckpointError(f"checkpoint {self.path!r}: {key!r} in {file} lies at bytes "
                                  f"{entry['data_offsets']} of the data, the index says "
                                  f"{piece['data_offsets']} (its header was changed after the "
                                  "save)")
        stored_dtype = DTYPES[entry["dtype"]][0]
        if stored_dtype.is_floating_point != want_dtype.is_floating_point:
            raise CheckpointError(f"checkpoint {self.path!r}: {name} is stored as "
                                  f"{entry['dtype']}, the model holds {want_dtype}")
        return file, entry, start


def _intersect(a_off, a_size, b_off, b_size):
    lo = [max(x, y) for x, y in zip(a_off, b_off, strict=True)]
    hi = [min(x + m, y + n) for x, m, y, n in zip(a_off, a_size, b_off, b_size, strict=True)]
    if any(h <= l for l, h in zip(lo, hi)) and lo:
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


def _plan_reads(ckpt: _Checkpoint, section: str, shards, canonical, name_of):
    """[(local tensor, segment, piece, file, header entry, data start, box)] to read, with every
    stored piece checked: shape, dtype, and that the pieces cover each segment's box."""
    reads = []
    for lt in shards:
        for seg in lt.segments:
            name = name_of(lt, seg)
            want_shape = list(canonical[seg.name].shape)
            shape, pieces = ckpt.entry(section, name)
            if shape is not None and list(shape) != want_shape:
                raise CheckpointError(f"checkpoint {ckpt.path!r}: {name} has shape "
                                      f"{tuple(shape)}, the model expects {tuple(want_shape)}")
            covered = 0
            for piece in pieces:
                box = _intersect(seg.canon.offsets, seg.canon.sizes,
                                 piece.get("offsets", []), piece.get("sizes", []))
                if box is None:
                    continue
                file, entry, start = ckpt.stored(piece, lt.tensor.dtype, name)
                covered += math.prod(box[1])
                reads.append((lt, seg, piece, file, entry, start, box))
            if covered != seg.canon.numel:
                raise CheckpointError(f"checkpoint {ckpt.path!r}: the stored pieces of {name} "
                                      f"do not cover the part this rank needs")
    return reads


def _check_reads(ckpt: _Checkpoint, reads):
    """Verifies the hashed blocks that every planned read touches (and each header)."""
    ranges: dict[str, list] = {}
    for _, _, piece, file, entry, start, (lo, sizes) in reads:
        rel = [o - p for o, p in zip(lo, piece["offsets"], strict=True)]
        ranges.setdefault(file, [(0, start)]).append(box_bytes(entry, start, rel, sizes))
    for file, spans in sorted(ranges.items()):
        ckpt.verify(file, spans)


def _apply_reads(ckpt: _Checkpoint, reads):
    with torch.no_grad():
        for lt, seg, piece, file, entry, start, (lo, sizes) in reads:
            rel = [o - p for o, p in zip(lo, piece["offsets"], strict=True)]
            data = read_box(os.path.join(ckpt.path, file), entry, start, rel, sizes)
            dest = local_view(lt.tensor, seg)
            for d, (o, s) in enumerate(zip(lo, seg.canon.offsets, strict=True)):
                dest = dest.narrow(d, o - s, sizes[d])
            dest.copy_(data, non_blocking=False)


def _local_engine(model):
    """Where a whole (unsharded) Transformer's tensors sit, for loading into it."""
    device = next(model.parameters()).device
    return Placement(model, Layout(ParallelDims(1), 0, device, None), canonical_tensors(model))


def load_checkpoint(path: str, target, optimizer: bool = False, restore_rng: bool = True,
                    log=None) -> dict:
    """Restores the model (and AdamW state, RNG) of `target` (a ParallelModel, or a whole
    Transformer) in place after verifying; returns state.json's dict. Under bf16 training the
    float32 masters are read, and the compute weights written from them. A checkpoint of another
    world size has no RNG state for this layout: `log` is told it is not restored.

    Every rank reads and verifies only what its shards need; all verdicts are gathered before
    anything changes, so either all ranks load or all raise the same CheckpointError."""
    engine = target if hasattr(target, "model_shards") else _local_engine(target)
    layout, canonical = engine.layout, engine.canonical
    error = state = ckpt = None
    model_reads, optim_reads, steps = [], [], {}
    try:
        ckpt = _Checkpoint(path)
        state = ckpt.state
        extra = sorted(set(ckpt.index["model"]) - set(canonical))
        unfused = [n for n in extra if _UNFUSED.match(n)
                   and _UNFUSED.sub(r"\1.qkv_proj.\2", n) in canonical]
        if unfused:
            raise CheckpointError(
                f"checkpoint {path!r} holds attention's q, k and v as separate tensors (e.g. "
                f"{unfused[0]!r}): it was written before they became one fused qkv_proj, and "
                "is not read (docs/checkpoints.md: tensor names)")
        if extra:
            raise CheckpointError(f"checkpoint {path!r} has tensors the model lacks: {extra[:5]}")
        model_reads = _plan_reads(ckpt, "model", engine.model_shards(), canonical,
                                  lambda lt, seg: seg.name)
        if optimizer:
            moments, steps = engine.optimizer_shards(create=True)
            optim_reads = _plan_reads(ckpt, "optimizer", moments, canonical,
                                      lambda lt, seg: f"{lt.name.split('/', 1)[0]}/{seg.name}")
            steps = {key: (t, _step_name(moments, key)) for key, t in steps.items()}
        _check_reads(ckpt, model_reads + optim_reads)
        _check_state(ckpt)
        # The small reads happen now too: nothing changes until every rank has read everything.
        steps = [(tensor, _read_scalar(ckpt, name)) for tensor, name in steps.values()]
        rng_states = None
        if restore_rng and ckpt.world_size == layout.world:
            rng_states = _read_rng(ckpt, f"rng-r{layout.rank:05d}.safetensors")
        elif restore_rng and log is not None and layout.rank == 0:
            log(f"note: {path} was written by {ckpt.world_size} rank(s), this run has "
                f"{layout.world}: the random number generators are not restored (the data "
                "order and the initial values do not depend on them)")
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in layout.everyone(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    _apply_reads(ckpt, model_reads + optim_reads)
    for tensor, value in steps:
        tensor.fill_(value)
    engine.loaded()       # the compute weights follow the masters just read
    if rng_states is not None:
        torch.set_rng_state(rng_states["torch_cpu"])
        if "torch_cuda" in rng_states and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng_states["torch_cuda"])
    return state


_MAX_COUNT = 1 << 53        # a step or data position beyond this is damage, not a long run


def _check_state(ckpt: _Checkpoint):
    """state.json's step and data position: whole numbers in range, the step the manifest's."""
    for key in ("step", "data_position"):
        value = ckpt.state.get(key)
        if key not in ckpt.state and key == "data_position":
            continue
        if type(value) is not int or not 0 <= value < _MAX_COUNT:
            raise CheckpointError(f"checkpoint {ckpt.path!r}: {STATE} has {key}={value!r}, not "
                                  f"a whole number in [0, 2**53)")
    if ckpt.step is not None and ckpt.step != ckpt.state["step"]:
        raise CheckpointError(f"checkpoint {ckpt.path!r}: {STATE} says step "
                              f"{ckpt.state['step']}, {MANIFEST} says {ckpt.step!r}")


def _step_name(moments, key: str) -> str | None:
    """The stored step count for optimizer tensor `key`: that of its first canonical tensor."""
    lt = next(m for m in moments if m.name == key)
    return f"step/{lt.segments[0].name}" if lt.segments else None


def _read_scalar(ckpt: _Checkpoint, name: str | None) -> float:
    """An AdamW step count: a whole number >= 0 (refused otherwise)."""
    if name is None:     # a shard holding only padding: any step count (they are all equal)
        name = next((n for n in ckpt.index.get("optimizer", {}) if n.startswith("step/")), None)
        if name is None:
            raise CheckpointError(f"checkpoint {ckpt.path!r} holds no optimizer step counts")
    shape, pieces = ckpt.entry("optimizer", name)
    if shape != [] or len(pieces) != 1:
        raise CheckpointError(f"checkpoint {ckpt.path!r}: {name} is not one scalar")
    file, entry, start = ckpt.stored(pieces[0], torch.float32, name)
    ckpt.verify(file, [box_bytes(entry, start, [], [])])
    value = float(read_box(os.path.join(ckpt.path, file), entry, start, [], []))
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise CheckpointError(f"checkpoint {ckpt.path!r}: {name} = {value}, not a step count")
    return value


def _read_rng(ckpt: _Checkpoint, file: str) -> dict:
    """This rank's RNG states, hash-checked and shaped like this process's own."""
    if file not in ckpt.files:
        raise CheckpointError(f"checkpoint {ckpt.path!r}: {file} is not listed in {MANIFEST} "
                              "(a resume on the same number of ranks restores every rank's RNG)")
    ckpt.verify(file)
    header, start = ckpt.header(file)
    want = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        want["torch_cuda"] = torch.cuda.get_rng_state()
    states = {}
    for key, entry in header.items():
        if key not in ("torch_cpu", "torch_cuda") or entry["dtype"] != "U8" or \
                len(entry["shape"]) != 1 or (key in want and entry["shape"][0] != want[key].numel()):
            raise CheckpointError(f"checkpoint {ckpt.path!r}: {file} holds {key!r} as "
                                  f"{entry['dtype']} {entry['shape']}, not an RNG state of "
                                  "this torch")
        states[key] = read_box(os.path.join(ckpt.path, file), entry, start, [0], entry["shape"])
    if "torch_cpu" not in states:
        raise CheckpointError(f"checkpoint {ckpt.path!r}: {file} lacks the CPU RNG state")
    try:      # on a scratch generator: a state torch refuses is found before anything changes
        torch.Generator().set_state(states["torch_cpu"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {ckpt.path!r}: {file} holds a 'torch_cpu' RNG state "
                              f"that torch refuses ({str(e).splitlines()[0]})") from None
    return states


def verify_listed(path: str, name: str) -> bool:
    """Whether the checkpoint's manifest lists file `name`, checked against its hashes if so
    (CheckpointError when it does not match); an unlisted file is not the checkpoint's."""
    ckpt = _Checkpoint(path)
    if name not in ckpt.files:
        return False
    ckpt.verify(name)
    return True


def verify_checkpoint(path: str) -> dict:
    """Checks the manifest and every file's hashes; returns the manifest's files or raises."""
    ckpt = _Checkpoint(path)
    for name in ckpt.files:
        ckpt.verify(name)
    return ckpt.files


def read_state(path: str) -> dict:
    """state.json of a committed checkpoint (manifest and hash checked)."""
    return _Checkpoint(path).state


def canonical_names(path: str) -> list[str]:
    """The model tensors a checkpoint holds (verified index)."""
    return sorted(_Checkpoint(path).index["model"])


def read_canonical(path: str, verify: bool = True):
    """Yields (canonical name, whole tensor) for every model tensor, one tensor in memory at a
    time, assembled from its pieces (for export); files verified first when `verify`."""
    ckpt = _Checkpoint(path)
    if verify:
        for name in ckpt.files:
            ckpt.verify(name)
    for name in sorted(ckpt.index["model"]):
        shape, pieces = ckpt.entry("model", name)
        out = None
        for piece in pieces:
            file, entry, start = ckpt.stored(piece, torch.float32, name)
            data = read_box(os.path.join(ckpt.path, file), entry, start, [0] * len(entry["shape"]),
                            entry["shape"])
            if out is None:
                out = torch.empty(shape, dtype=data.dtype)
            box = tuple(slice(o, o + n) for o, n in zip(piece["offsets"], piece["sizes"]))
            out[box] = data
        yield name, out
