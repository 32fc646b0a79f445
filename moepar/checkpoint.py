"""Checkpoints: layout-free safetensors shards written by their owners, JSON for the rest,
committed by an atomic rename.

    checkpoints/step_N/model-r<rank>.safetensors      tensors this rank owns, canonical names
    checkpoints/step_N/optimizer-r<rank>.safetensors  AdamW state: "<kind>/<canonical name>"
    checkpoints/step_N/rng-r<rank>.safetensors        that rank's torch RNG state
    checkpoints/step_N/index.json                     canonical name -> file
    checkpoints/step_N/state.json                     step, data position, resolved config
    checkpoints/step_N/manifest.json                  SHA-256 of every file above; written last

Canonical names are the model's parameter names, except that stacked experts are split by global
expert id: `layers.1.ffn.experts.w_in_EDH` [E_local, D, H] on a rank holding experts 4..7 is
written as `layers.1.ffn.experts.4.w_in` ... `.7.w_in`. So a checkpoint does not depend on the
layout that wrote it, and any layout can load it. Dense tensors are written by rank 0, experts by
the ranks with edp rank 0 (one replica each).

Every rank writes into `.step_N.tmp`; after a barrier rank 0 writes the index and the manifest
and renames the directory to `step_N`: a crash leaves only a temporary directory, which is never
loaded. Loading verifies the manifest on rank 0 first and every rank raises the same error.
No pickle anywhere.
"""

import hashlib
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from moepar.layers.experts import GroupedExperts
from moepar.parallel.tensor import full_tensor as tp_full_tensor
from moepar.parallel.tensor import local_shard
from moepar.parallel.zero import copy_full_into, full_tensor, shard_like

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "complete_steps",
           "verify_checkpoint", "commit", "recover_interrupted", "checkpoint_step",
           "CheckpointError", "Owner", "canonical_items"]

MANIFEST, INDEX, STATE = "manifest.json", "index.json", "state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


class Owner:
    """Which canonical tensors this rank writes: dense ones on rank 0 (one rank per pipeline
    stage), experts where edp == 0. Every canonical tensor has exactly one writer."""

    def __init__(self, rank: int = 0, world_size: int = 1, writes_experts: bool = True,
                 writes_dense: bool | None = None, tp_group=None):
        self.rank, self.world_size, self.writes_experts = rank, world_size, writes_experts
        self.writes_dense = rank == 0 if writes_dense is None else writes_dense
        # Tensor-parallel shards: parameter name -> TPShard (gathered to whole tensors on save,
        # sliced on load; every tp rank takes part, in the same order).
        self.tp_group, self.tp_specs = tp_group, {}

    def whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The layout-free tensor for parameter `name` (ZeRO-3 and tp shards gathered)."""
        t = full_tensor(t)
        spec = self.tp_specs.get(name)
        return t if spec is None or t.dim() == 0 else tp_full_tensor(t, spec, self.tp_group)

    def mine(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This tp rank's slice of the whole tensor `t` for parameter `name`."""
        spec = self.tp_specs.get(name)
        if spec is None or t.dim() == 0:
            return t
        return local_shard(t, spec, dist.get_rank(self.tp_group))

    def barrier(self):
        if self.world_size > 1:
            dist.barrier()

    def gather(self, obj):
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


# ---- canonical names -------------------------------------------------------------------------

def _expert_modules(model) -> dict[str, GroupedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def _split_name(name: str, experts: dict):
    """('layers.1.ffn.experts', module, 'w_in') for an expert stack, else None."""
    owner, _, leaf = name.rpartition(".")
    if owner in experts:
        return owner, experts[owner], leaf.rsplit("_", 1)[0]
    return None


def canonical_items(model, named: dict[str, torch.Tensor], owner: Owner, per_param_scalar=False):
    """Yields (canonical name, tensor) this rank writes for tensors keyed by parameter name."""
    experts = _expert_modules(model)
    for name, tensor in named.items():
        split = _split_name(name, experts)
        if split is None:
            if owner.writes_dense:
                yield name, tensor
            continue
        if not owner.writes_experts:
            continue
        prefix, module, short = split
        for local in range(module.num_experts):
            value = tensor if (per_param_scalar and tensor.dim() == 0) else tensor[local]
            yield f"{prefix}.{module.expert_offset + local}.{short}", value


def _wanted(model, name: str, reader) -> torch.Tensor:
    """The tensor for parameter/buffer `name` of this rank's model, assembled from canonical ones."""
    experts = _expert_modules(model)
    split = _split_name(name, experts)
    if split is None:
        return reader(name)
    prefix, module, short = split
    return torch.stack([reader(f"{prefix}.{module.expert_offset + i}.{short}")
                        for i in range(module.num_experts)])


# ---- save -------------------------------------------------------------------------------------

def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _own(t: torch.Tensor, seen: set) -> torch.Tensor:
    """A CPU tensor with storage of its own (per-expert slices and shared scalars are views)."""
    t = t.detach().cpu().contiguous()
    if t.untyped_storage().nbytes() != t.nbytes or t.data_ptr() in seen:
        t = t.clone()
    seen.add(t.data_ptr())
    return t


def _save(tensors: dict, path: str) -> list[str]:
    if not tensors:
        return []
    seen: set = set()
    save_file({k: _own(v, seen) for k, v in tensors.items()}, path)
    _fsync(path)
    return list(tensors)


def _model_state(model, owner) -> dict[str, torch.Tensor]:
    """Parameter/buffer name -> whole tensor (ZeRO-3 and tp shards gathered: collectives, in
    order)."""
    return {name: owner.whole(name, t) for name, t in model.state_dict().items()}


def _optimizer_state(model, optimizer, owner) -> dict[str, torch.Tensor]:
    """'<kind>/<param name>' -> whole tensor, scalars (step) as 0-d tensors.

    A ZeRO-1/2 optimizer gathers its shards into whole parameters (`param_state`); ZeRO-3 state
    is DTensors, gathered one by one in parameter order (the same order on every rank).
    """
    per_param = (optimizer.param_state() if hasattr(optimizer, "param_state")
                 else optimizer.state)
    out = {}
    for name, p in model.named_parameters():
        for kind, value in sorted(per_param.get(p, {}).items()):
            value = owner.whole(name, value) if torch.is_tensor(value) else torch.tensor(value)
            out[f"{kind}/{name}"] = value
    return out


def save_checkpoint(ckpt_root: str, step: int, model, optimizer, state: dict, keep: int = 0,
                    owner: Owner | None = None) -> str:
    """Writes checkpoints/step_<step> atomically (collective when owner.world_size > 1)."""
    owner = owner or Owner()
    final = os.path.join(ckpt_root, f"step_{step}")
    tmp = os.path.join(ckpt_root, f".step_{step}.tmp")
    if owner.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    owner.barrier()
    tag = f"r{owner.rank:05d}"
    model_file, optim_file = f"model-{tag}.safetensors", f"optimizer-{tag}.safetensors"
    written = {"model": {}, "optimizer": {}}
    names = _save(dict(canonical_items(model, _model_state(model, owner), owner)),
                  os.path.join(tmp, model_file))
    written["model"].update({n: model_file for n in names})
    optim = {}
    for key, value in _optimizer_state(model, optimizer, owner).items():
        kind, name = key.split("/", 1)
        for canonical, tensor in canonical_items(model, {name: value}, owner, per_param_scalar=True):
            optim[f"{kind}/{canonical}"] = tensor
    names = _save(optim, os.path.join(tmp, optim_file))
    written["optimizer"].update({n: optim_file for n in names})
    _save({"torch_cpu": torch.get_rng_state()}, os.path.join(tmp, f"rng-{tag}.safetensors"))
    # Each rank hashes what it wrote (in parallel); rank 0 only adds its JSON files.
    mine = [f for f in (model_file, optim_file, f"rng-{tag}.safetensors")
            if os.path.isfile(os.path.join(tmp, f))]
    written["hashes"] = {f: _sha256(os.path.join(tmp, f)) for f in mine}
    written["expected"] = sorted(_canonical_names(model))   # a pipeline stage knows its own
    everyone = owner.gather(written)
    error = None
    if owner.rank == 0:
        index, hashes = {"model": {}, "optimizer": {}}, {}
        for part in everyone:
            hashes.update(part["hashes"])
            for kind in index:
                index[kind].update(part[kind])
        expected = set().union(*(part["expected"] for part in everyone))
        missing = sorted(expected - set(index["model"]))
        if missing:   # a rank wrote less than its share: never commit an incomplete checkpoint
            error = f"checkpoint step {step} would lack {len(missing)} tensor(s), e.g. {missing[:4]}"
        else:
            for name, obj in ((INDEX, index), (STATE, state)):
                with open(os.path.join(tmp, name), "w") as f:
                    json.dump(obj, f, indent=1, sort_keys=True)
                _fsync(os.path.join(tmp, name))
            commit(tmp, final, step, owner.world_size, known_hashes=hashes)
        if keep and error is None:
            # Keep this step and the newest keep-1 before it. Never touch later steps (another
            # branch of the run, say after --run.resume_from) and never the one just written.
            older = [s for s in complete_steps(ckpt_root) if s < step]
            for old_step in older[:max(len(older) - (keep - 1), 0)]:
                shutil.rmtree(os.path.join(ckpt_root, f"step_{old_step}"), ignore_errors=True)
    error = owner.broadcast(error)
    if error:
        raise CheckpointError(error)
    return final


def commit(tmp: str, final: str, step: int, world_size: int = 1, known_hashes: dict | None = None):
    """Writes tmp's manifest (SHA-256 of every file) last, then renames tmp to final atomically.

    `known_hashes` are files other ranks wrote and hashed themselves (a shared filesystem may not
    list them here yet); the rest of tmp is hashed here. An existing `final` is moved aside only
    once the new directory is whole, and removed after.
    """
    files = dict(known_hashes or {})
    for name in sorted(os.listdir(tmp)):
        if name not in files:
            files[name] = _sha256(os.path.join(tmp, name))
    manifest = {"step": step, "world_size": world_size, "files": dict(sorted(files.items()))}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    _fsync(os.path.join(tmp, MANIFEST))
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync(os.path.dirname(os.path.abspath(final)))


# ---- find, verify, load ------------------------------------------------------------------------

def complete_steps(ckpt_root: str) -> list[int]:
    """Steps with a committed directory holding a manifest, ascending."""
    if not os.path.isdir(ckpt_root):
        return []
    steps = []
    for name in os.listdir(ckpt_root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(ckpt_root, name, MANIFEST)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def recover_interrupted(ckpt_root: str) -> list[str]:
    """Finishes or discards what a crash during `commit` left behind; returns what it did.

    `.step_N.tmp` with a manifest was complete (the manifest is written last) but not renamed:
    it becomes step_N. `step_N.old` without step_N was a re-save caught between its two renames:
    it becomes step_N again. Temporary directories without a manifest are deleted.
    """
    done = []
    if not os.path.isdir(ckpt_root):
        return done
    for name in sorted(os.listdir(ckpt_root)):
        path = os.path.join(ckpt_root, name)
        tmp = re.match(r"^\.step_(\d+)\.tmp$", name)
        old = re.match(r"^step_(\d+)\.old$", name)
        if tmp:
            final = os.path.join(ckpt_root, f"step_{tmp.group(1)}")
            if os.path.isfile(os.path.join(path, MANIFEST)) and not os.path.exists(final):
                os.rename(path, final)
                done.append(f"committed {name} as step_{tmp.group(1)}")
            else:
                shutil.rmtree(path, ignore_errors=True)
                done.append(f"removed incomplete {name}")
        elif old:
            final = os.path.join(ckpt_root, f"step_{old.group(1)}")
            if os.path.exists(final):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)
                done.append(f"restored {name} as step_{old.group(1)}")
    return done


def checkpoint_step(path: str) -> int | None:
    """The step a committed checkpoint directory holds (from its manifest), or None."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(ckpt_root: str) -> str | None:
    steps = complete_steps(ckpt_root)
    return os.path.join(ckpt_root, f"step_{steps[-1]}") if steps else None


def verify_checkpoint(path: str) -> dict:
    """Checks the manifest and every file's SHA-256; returns {file: sha256} or raises CheckpointError."""
    files = _read_manifest(path)
    for name in files:
        _verify_file(path, name, files)
    return files


class _Reader:
    """Reads canonical tensors; verifies each file's SHA-256 against the manifest on first open."""

    def __init__(self, path: str, index: dict, manifest_files: dict | None = None):
        self.path, self.index, self.files, self.handles = path, index, manifest_files, {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.index:
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor {name!r}")
        file = self.index[name]
        if file not in self.handles:
            if self.files is not None:
                _verify_file(self.path, file, self.files)
            self.handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self.handles[file].get_tensor(name)


def _read_manifest(path: str) -> dict:
    """The manifest's {file: sha256}, with index.json and state.json verified; CheckpointError else."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path!r} has no {MANIFEST}: it was never committed")
    try:
        with open(manifest_path) as f:
            files = dict(json.load(f)["files"])
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is unreadable ({e})") from None
    for name in (INDEX, STATE):
        _verify_file(path, name, files)
    return files


def _verify_file(path: str, name: str, files: dict):
    if name not in files:
        raise CheckpointError(f"checkpoint {path!r}: {name} is not listed in {MANIFEST}")
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path!r} is missing {name}")
    if _sha256(file) != files[name]:
        raise CheckpointError(f"checkpoint {path!r}: {name} does not match its SHA-256 in "
                              f"{MANIFEST} (corrupt or modified)")


def load_checkpoint(path: str, model, optimizer=None, owner: Owner | None = None) -> dict:
    """Restores model (and optimizer, RNG) in place after verifying; returns state.json's dict.

    Works for any layout: each rank reads (and verifies the hashes of) only the files holding the
    canonical tensors its shard needs. Every rank's verdict is gathered before anything is
    changed, so either all ranks load or all raise the same CheckpointError.
    """
    owner = owner or Owner()
    error, loaded, optim, state = None, {}, {}, None
    # Under pipelining each rank's model is one stage: the whole model is the union.
    expected = set().union(*owner.gather(sorted(_canonical_names(model))))
    try:
        files = _read_manifest(path)
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
        with open(os.path.join(path, STATE)) as f:
            state = json.load(f)
        read = _Reader(path, index["model"], files)
        for name, target in model.state_dict().items():
            value = owner.mine(name, _wanted(model, name, read))
            if value.shape != target.shape:
                raise CheckpointError(f"checkpoint {path!r}: {name} has shape "
                                      f"{tuple(value.shape)}, the model expects {tuple(target.shape)}")
            loaded[name] = value
        extra = set(index["model"]) - expected
        if extra:
            raise CheckpointError(f"checkpoint {path!r} has tensors the model lacks: {sorted(extra)[:5]}")
        if optimizer is not None:
            optim = _read_optimizer(model, _Reader(path, index["optimizer"], files),
                                    index["optimizer"], owner)
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in owner.gather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    with torch.no_grad():
        for name, target in model.state_dict().items():
            copy_full_into(target, loaded[name])
    if optimizer is not None and hasattr(optimizer, "load_param_state"):
        optimizer.load_param_state(optim)
    else:
        for param, kinds in optim.items():
            optimizer.state[param].update({k: v if v.dim() == 0 else shard_like(v, param)
                                           for k, v in kinds.items()})
    rng = os.path.join(path, f"rng-r{owner.rank:05d}.safetensors")
    if os.path.isfile(rng):
        with safe_open(rng, framework="pt") as f:
            torch.set_rng_state(f.get_tensor("torch_cpu"))
    return state


def _canonical_names(model) -> set[str]:
    """Every canonical name a full model of this shape has (all experts, any layout)."""
    experts = _expert_modules(model)
    names = set()
    for name, tensor in model.state_dict().items():
        split = _split_name(name, experts)
        if split is None:
            names.add(name)
        else:
            prefix, module, short = split
            names.update(f"{prefix}.{g}.{short}" for g in range(module.num_global_experts))
    return names


def _read_optimizer(model, read, index, owner) -> dict:
    """{param: {kind: tensor}} for this rank's parameters (applied only once all ranks agree)."""
    kinds = sorted({key.split("/", 1)[0] for key in index})
    out = {}
    for name, param in model.named_parameters():
        state = out.setdefault(param, {})
        for kind in kinds:
            if kind == "step":
                # One step count per parameter; for experts, every expert's copy is the same.
                step = _wanted(model, name, lambda n: read(f"step/{n}"))
                state["step"] = step.flatten()[0].clone() if step.dim() else step
            else:
                whole = _wanted(model, name, lambda n, k=kind: read(f"{k}/{n}"))
                state[kind] = owner.mine(name, whole).to(dtype=param.dtype, device=param.device)
    return out
