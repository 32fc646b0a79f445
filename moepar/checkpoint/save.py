"""Writing a checkpoint: each rank stages and writes the boxes it owns (in the background if
asked), rank 0 checks that the pieces tile every tensor and commits with the manifest last.

A save whose boxes hold NaN or Inf is refused on every rank and nothing is committed.
"""

import json
import os
import threading
import time

import torch

from moepar.checkpoint.base import FORMAT, INDEX, MANIFEST, STATE, CheckpointError, volume_ok
from moepar.checkpoint.folders import MARKER, complete_steps, discard, mark, set_aside
from moepar.parallel.shards import local_view
from moepar.tensorfile import data_offsets, dtype_name, file_digest, write_tensors


class _HostStaging:
    """Device tensors to the host one at a time: through one reused pinned buffer and an async
    copy on CUDA (no full-size host copy of anything), as they are on the CPU."""

    def __init__(self):
        self.pinned = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cuda":
            return t.contiguous()
        nbytes = t.numel() * t.element_size()
        if self.pinned is None or self.pinned.numel() < nbytes:
            self.pinned = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        host = self.pinned[:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return host


def _key(name: str, seg, shape) -> str:
    whole = not any(seg.canon.offsets) and tuple(seg.canon.sizes) == tuple(shape)
    return name if whole else f"{name}@{','.join(map(str, seg.canon.offsets))}"


def _plan_writes(shards, canonical, file: str, stage, prefix=lambda lt: ""):
    """(safetensors entries, {canonical key: [piece]}) for the segments this rank writes."""
    entries, pieces = [], {}
    for lt in shards:
        for seg in lt.segments:
            if not seg.writes:
                continue
            name = prefix(lt) + seg.name
            key = _key(name, seg, canonical[seg.name].shape)
            entries.append((key, lt.tensor.dtype, tuple(seg.canon.sizes),
                            lambda lt=lt, seg=seg: stage(local_view(lt.tensor, seg))))
            pieces.setdefault(name, []).append({"file": file, "key": key,
                                                "offsets": list(seg.canon.offsets),
                                                "sizes": list(seg.canon.sizes)})
    return entries, pieces


def _rng_state() -> dict:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(ckpt_root: str, step: int, engine, state: dict, keep: int = 0) -> str:
    """Writes checkpoints/step_<step> atomically (a collective: every rank calls it)."""
    return PendingSave(ckpt_root, step, engine, state, keep, background=False).finish()


class PendingSave:
    """One checkpoint being written. With `background`, every box this rank writes is first
    copied to host memory (the only time training waits; `stall_s`), then a thread writes and
    hashes the files while training goes on; `finish` (a collective, called by every rank once
    all are `done`) commits. Without it, boxes stream to the files one at a time (no snapshot)
    and `finish` follows at once."""

    def __init__(self, ckpt_root: str, step: int, engine, state: dict, keep: int = 0,
                 background: bool = False):
        start = time.perf_counter()
        self.root, self.step, self.engine, self.state, self.keep = ckpt_root, step, engine, state, keep
        layout = engine.layout
        self.final = os.path.join(ckpt_root, f"step_{step}")
        self.tmp = os.path.join(ckpt_root, f".step_{step}.tmp")
        if layout.rank == 0:
            if os.path.exists(self.tmp):     # a failed save of this step earlier in this process
                set_aside(self.tmp)
            os.makedirs(self.tmp)
            mark(self.tmp)                   # ours: recovery may commit or set it aside
        layout.barrier()
        self.files, self.written = self._plan(background)
        self.error, self.thread = None, None
        self.discarding = []     # deletions this save started (pruning), for the caller to join
        if background:
            self.thread = threading.Thread(target=self._write, name=f"checkpoint-{step}",
                                           daemon=True)
            self.thread.start()
        else:
            self._write()
        self.stall_s = time.perf_counter() - start

    def _plan(self, snapshot: bool):
        """({file: safetensors entries}, the index entries this rank contributes)."""
        engine, tag = self.engine, f"r{self.engine.layout.rank:05d}"
        stage = _HostStaging()
        canonical = engine.canonical
        written = {"files": {}, "model": {}, "optimizer": {}}
        model_file, optim_file, rng_file = (f"{kind}-{tag}.safetensors"
                                            for kind in ("model", "optimizer", "rng"))
        files = {}
        files[model_file], written["model"] = _plan_writes(engine.model_shards(), canonical,
                                                           model_file, stage)
        moments, steps = engine.optimizer_shards()
        # train.optim_state_dtype: the index names the dtype the moments are stored in
        self.moment_dtype = moments[0].tensor.dtype if moments else None
        entries, written["optimizer"] = _plan_writes(
            moments, canonical, optim_file, stage, prefix=lambda lt: lt.name.split("/", 1)[0] + "/")
        for lt in moments:       # one step count per canonical tensor, with the box at its origin
            for seg in lt.segments:
                if seg.writes and not any(seg.canon.offsets) and lt.name.startswith(_STEP_KINDS):
                    key = f"step/{seg.name}"
                    entries.append((key, torch.float32, (),
                                    lambda t=steps[lt.name]: t.detach().float().cpu().reshape(())))
                    written["optimizer"][key] = [{"file": optim_file, "key": key, "offsets": [],
                                                  "sizes": []}]
        files[optim_file] = entries
        files[rng_file] = [(k, v.dtype, tuple(v.shape), lambda v=v: v)
                           for k, v in _rng_state().items()]
        for file, entries in files.items():   # where each piece lies, checked on load
            spans = data_offsets(entries)
            for section in ("model", "optimizer"):
                for pieces in written[section].values():
                    for piece in pieces:
                        if piece["file"] == file:
                            piece["data_offsets"] = spans[piece["key"]]
        if snapshot:     # own copies now: every tensor (step counts too) changes as training goes on
            files = {f: [(k, d, s, lambda v=produce().clone(): v) for k, d, s, produce in entries]
                     for f, entries in files.items()}
        return files, written

    def _write(self):
        try:
            for file, entries in self.files.items():
                if entries:
                    self.written["files"][file] = write_tensors(os.path.join(self.tmp, file),
                                                                entries, check=_check_finite)
        except Exception as e:   # reported by finish(), on every rank, through rank 0
            self.error = f"rank {self.engine.layout.rank} could not write its checkpoint files: {e}"
        self.files = None        # the snapshot goes as soon as it is on disk

    def done(self) -> bool:
        """This rank's files are written (or failed); no collective."""
        return self.thread is None or not self.thread.is_alive()

    def finish(self) -> str:
        """Commits: rank 0 checks every rank's pieces tile the model, writes the index, state and
        manifest, renames; all ranks raise the same CheckpointError otherwise (collective)."""
        if self.thread is not None:
            self.thread.join()
        layout, step = self.engine.layout, self.step
        everyone = layout.gather_to_first(dict(self.written, error=self.error))
        error = None
        if layout.rank == 0:
            error = next((part["error"] for part in everyone if part["error"]), None)
            index, hashes = {"format": FORMAT, "model": {}, "optimizer": {}}, {}
            for part in everyone:
                hashes.update(part["files"])
                for section in ("model", "optimizer"):
                    for name, pieces in part[section].items():
                        index[section].setdefault(name, []).extend(pieces)
            error = error or _check_coverage(index, self.engine.canonical, step)
            if error is None:
                index = _describe(index, self.engine.canonical, self.moment_dtype)
                for name, obj in ((INDEX, index), (STATE, self.state)):
                    with open(os.path.join(self.tmp, name), "w") as f:
                        json.dump(obj, f, indent=1, sort_keys=True)
                try:
                    commit(self.tmp, self.final, step, layout.world, known_hashes=hashes)
                    self._prune()
                except (OSError, CheckpointError) as e:
                    error = f"checkpoint step {step} could not be committed: {e}"
            if error and os.path.isdir(self.tmp):
                # this save's own folder: nothing of it is committed
                self.discarding.append(discard(self.tmp))
        error = layout.from_rank0(error)
        if error:
            raise CheckpointError(error)
        return self.final

    def _prune(self):
        """Keeps this step and the newest keep-1 before it. Never touches later steps (another
        branch of the run) and never the one just written."""
        if not self.keep:
            return
        older = [s for s in complete_steps(self.root) if s < self.step]
        for old_step in older[:max(len(older) - (self.keep - 1), 0)]:
            self.discarding.append(discard(os.path.join(self.root, f"step_{old_step}")))


# The optimizer tensor a parameter's step count is stored beside (AdamW's, Muon's).
_STEP_KINDS = ("exp_avg/", "momentum_buffer/")


def _check_finite(key: str, tensor: torch.Tensor):
    """Refuses to write NaN or Inf (a diverged model is not a checkpoint)."""
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{key!r} holds non-finite values (NaN or Inf); a checkpoint "
                              "of a diverged model is not written")


def _check_coverage(index: dict, canonical: dict, step: int) -> str | None:
    """Why the gathered pieces are not a whole checkpoint, or None."""
    missing = sorted(n for n in canonical if n not in index["model"])
    if missing:   # a rank wrote less than its share: never commit an incomplete checkpoint
        return f"checkpoint step {step} would lack {len(missing)} tensor(s), e.g. {missing[:4]}"
    bad = [n for n, pieces in index["model"].items()
           if n not in canonical or not volume_ok(pieces, canonical[n].shape)]
    if index["optimizer"]:
        for n, t in canonical.items():   # AdamW's two moments, or Muon's momentum (muon.py)
            kinds = (("momentum_buffer",) if f"momentum_buffer/{n}" in index["optimizer"]
                     else ("exp_avg", "exp_avg_sq"))
            for kind in kinds:
                pieces = index["optimizer"].get(f"{kind}/{n}")
                if t.trainable and (pieces is None or not volume_ok(pieces, t.shape)):
                    bad.append(f"{kind}/{n}")
    if bad:
        return (f"checkpoint step {step}: the pieces written do not tile {len(bad)} tensor(s) "
                f"exactly, e.g. {bad[:4]}")
    return None


def _describe(index: dict, canonical: dict, moment_dtype=None) -> dict:
    """The index as written: each tensor's shape and dtype beside its pieces (AdamW's moments in
    `moment_dtype`, default their parameter's)."""
    out = {"format": FORMAT, "model": {}, "optimizer": {}}
    for section in ("model", "optimizer"):
        for name, pieces in sorted(index[section].items()):
            base = name.split("/", 1)[1] if section == "optimizer" else name
            shape = [] if name.startswith("step/") else list(canonical[base].shape)
            dtype = (torch.float32 if name.startswith("step/") else
                     moment_dtype or canonical[base].dtype if section == "optimizer" else
                     canonical[base].dtype)
            out[section][name] = {"shape": shape, "dtype": dtype_name(dtype),
                                  "pieces": sorted(pieces, key=lambda p: p["offsets"])}
    return out


def commit(tmp: str, final: str, step: int, world_size: int = 1, known_hashes: dict | None = None):
    """Writes tmp's manifest (size, SHA-256 and block hashes of every file) last, then renames
    tmp to final atomically.

    `known_hashes` are files other ranks wrote and hashed themselves (a shared filesystem may not
    list them here yet); the rest of tmp is hashed here. An existing `final` is never replaced.
    """
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; a checkpoint is never replaced")
    files = dict(known_hashes or {})
    marker = os.path.join(tmp, MARKER)
    if os.path.exists(marker):     # a committed checkpoint is recognised by its manifest
        os.remove(marker)
    for name in sorted(os.listdir(tmp)):
        if name not in files:
            files[name] = file_digest(os.path.join(tmp, name))
    manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                "files": dict(sorted(files.items()))}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    fd = os.open(os.path.dirname(os.path.abspath(final)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
