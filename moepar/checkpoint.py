"""Checkpoints: every rank writes the boxes of canonical tensors it owns, never gathering; any
layout reads back just the boxes it needs; committed by an atomic rename written last.

    checkpoints/step_N/model-r<rank>.safetensors      boxes of canonical tensors this rank owns
    checkpoints/step_N/optimizer-r<rank>.safetensors  AdamW moments "<kind>/<canonical>", and
                                                      step counts "step/<canonical>"
    checkpoints/step_N/rng-r<rank>.safetensors        that rank's RNG states
    checkpoints/step_N/index.json                     canonical name -> shape, dtype, pieces
    checkpoints/step_N/state.json                     step, data position, resolved config
    checkpoints/step_N/manifest.json                  per file: size, SHA-256, block hashes

Canonical names are layout-free (layers/init.py): parameter names, with stacked experts split
by global expert id (`layers.1.ffn.experts.5.w_in`). A piece is a box (offsets, sizes) of one
canonical tensor stored under its own key (`name` when whole, `name@o0,o1` otherwise); the
index lists each tensor's pieces. Where a rank's tensor sits in the canonical ones is the
handle's map (parallel/shards.py), so:
- save: each rank streams the boxes it owns, one at a time, into its own file, hashing as it
  writes (replicas write once: parallel/handle.py decides); rank 0 gathers only the index
  entries and hashes, checks that the pieces tile every tensor, writes index, state and the
  manifest last, and renames `.step_N.tmp` to `step_N`;
- load: each rank intersects its boxes with the stored pieces, checks the headers and the
  hashed blocks those reads touch (and every small file), agrees with all ranks, and only then
  copies the intersections in: all ranks load, or all raise the same CheckpointError.
Host memory holds one box (or one stored piece's intersection) at a time. No pickle anywhere.

Nothing here deletes or replaces a folder it did not just write: a save never replaces an
existing step_N, and what a crash left behind is set aside as `step_N.incomplete-<time>` (under
the run lock, see moepar/rundir.py). Deleting is for pruning (run.keep_checkpoints) and an asked
overwrite: the folder is renamed away at once and removed by a background thread, so the other
ranks never wait in a collective while one rank deletes. A save whose boxes hold NaN or Inf is
refused on every rank and nothing is committed.
"""

import json
import math
import os
import re
import shutil
import threading
import time

import torch
import torch.distributed as dist

from moepar.parallel.shards import local_view
from moepar.tensorfile import (DTYPES, TensorFileError, box_bytes, check_blocks, dtype_name,
                               file_digest, read_box, read_header, write_tensors)

__all__ = ["save_checkpoint", "PendingSave", "load_checkpoint", "latest_checkpoint", "complete_steps",
           "verify_checkpoint", "commit", "recover_interrupted", "checkpoint_step",
           "CheckpointError", "read_canonical", "canonical_names", "read_state", "discard",
           "set_aside"]

MANIFEST, INDEX, STATE = "manifest.json", "index.json", "state.json"
FORMAT = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


# ---- ranks ------------------------------------------------------------------------------------

def _world(layout) -> int:
    return layout.dims.world_size if layout.meshes is not None else 1


def _barrier(layout):
    if _world(layout) > 1:
        dist.barrier()


def _gather_to_first(layout, obj) -> list | None:
    """Every rank's obj on rank 0 (None elsewhere)."""
    if _world(layout) == 1:
        return [obj]
    out = [None] * _world(layout) if layout.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _everyone(layout, obj) -> list:
    if _world(layout) == 1:
        return [obj]
    out = [None] * _world(layout)
    dist.all_gather_object(out, obj)
    return out


def _broadcast(layout, obj):
    if _world(layout) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- save -------------------------------------------------------------------------------------

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
        import threading
        import time
        start = time.perf_counter()
        self.root, self.step, self.engine, self.state, self.keep = ckpt_root, step, engine, state, keep
        layout = engine.layout
        self.final = os.path.join(ckpt_root, f"step_{step}")
        self.tmp = os.path.join(ckpt_root, f".step_{step}.tmp")
        if layout.rank == 0:
            if os.path.exists(self.tmp):     # a failed save of this step earlier in this process
                set_aside(self.tmp)
            os.makedirs(self.tmp)
        _barrier(layout)
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
        entries, written["optimizer"] = _plan_writes(
            moments, canonical, optim_file, stage, prefix=lambda lt: lt.name.split("/", 1)[0] + "/")
        for lt in moments:       # one step count per canonical tensor, with the box at its origin
            for seg in lt.segments:
                if seg.writes and not any(seg.canon.offsets) and lt.name.startswith("exp_avg/"):
                    key = f"step/{seg.name}"
                    entries.append((key, torch.float32, (),
                                    lambda t=steps[lt.name]: t.detach().float().cpu().reshape(())))
                    written["optimizer"][key] = [{"file": optim_file, "key": key, "offsets": [],
                                                  "sizes": []}]
        files[optim_file] = entries
        files[rng_file] = [(k, v.dtype, tuple(v.shape), lambda v=v: v)
                           for k, v in _rng_state().items()]
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
        everyone = _gather_to_first(layout, dict(self.written, error=self.error))
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
                index = _describe(index, self.engine.canonical)
                for name, obj in ((INDEX, index), (STATE, self.state)):
                    with open(os.path.join(self.tmp, name), "w") as f:
                        json.dump(obj, f, indent=1, sort_keys=True)
                try:
                    commit(self.tmp, self.final, step, _world(layout), known_hashes=hashes)
                    self._prune()
                except (OSError, CheckpointError) as e:
                    error = f"checkpoint step {step} could not be committed: {e}"
            if error and os.path.isdir(self.tmp):
                # this save's own folder: nothing of it is committed
                self.discarding.append(discard(self.tmp))
        error = _broadcast(layout, error)
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


def _check_finite(key: str, tensor: torch.Tensor):
    """Refuses to write NaN or Inf (a diverged model is not a checkpoint)."""
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{key!r} holds non-finite values (NaN or Inf); a checkpoint "
                              "of a diverged model is not written")


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)


def _is_piece(piece, ndim: int) -> bool:
    """A stored piece's index entry has the fields and types a reader relies on."""
    return (isinstance(piece, dict) and isinstance(piece.get("file"), str)
            and isinstance(piece.get("key"), str)
            and all(_is_shape(piece.get(k)) and len(piece[k]) == ndim
                    for k in ("offsets", "sizes")))


def _volume_ok(pieces: list, shape, check_overlap: bool = True) -> bool:
    """The pieces tile a tensor of `shape`: inside it, pairwise disjoint, volumes summing up.
    (The pairwise test is quadratic: readers skip it for tensors cut into very many pieces,
    where inside-and-summing-up still refuses a damaged index.)"""
    boxes = [(p["offsets"], p["sizes"]) for p in pieces]
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or any(o < 0 or o + n > d for o, n, d in
                                             zip(offsets, sizes, shape)):
            return False
    for i, (a_off, a_size) in enumerate(boxes if check_overlap else []):
        for b_off, b_size in boxes[i + 1:]:
            if all(max(ao, bo) < min(ao + an, bo + bn)
                   for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size)):
                return False
    return sum(math.prod(s) for _, s in boxes) == math.prod(shape)


def _check_coverage(index: dict, canonical: dict, step: int) -> str | None:
    """Why the gathered pieces are not a whole checkpoint, or None."""
    missing = sorted(n for n in canonical if n not in index["model"])
    if missing:   # a rank wrote less than its share: never commit an incomplete checkpoint
        return f"checkpoint step {step} would lack {len(missing)} tensor(s), e.g. {missing[:4]}"
    bad = [n for n, pieces in index["model"].items()
           if n not in canonical or not _volume_ok(pieces, canonical[n].shape)]
    if index["optimizer"]:
        for kind in ("exp_avg", "exp_avg_sq"):
            for n, t in canonical.items():
                pieces = index["optimizer"].get(f"{kind}/{n}")
                if t.trainable and (pieces is None or not _volume_ok(pieces, t.shape)):
                    bad.append(f"{kind}/{n}")
    if bad:
        return (f"checkpoint step {step}: the pieces written do not tile {len(bad)} tensor(s) "
                f"exactly, e.g. {bad[:4]}")
    return None


def _describe(index: dict, canonical: dict) -> dict:
    """The index as written: each tensor's shape and dtype beside its pieces."""
    out = {"format": FORMAT, "model": {}, "optimizer": {}}
    for section in ("model", "optimizer"):
        for name, pieces in sorted(index[section].items()):
            base = name.split("/", 1)[1] if section == "optimizer" else name
            shape = [] if name.startswith("step/") else list(canonical[base].shape)
            dtype = torch.float32 if name.startswith("step/") else canonical[base].dtype
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


# ---- find -------------------------------------------------------------------------------------

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
    """Finishes or sets aside what a crash left behind; returns what it did. Call it only while
    holding the run lock (moepar/rundir.py): another live run's `.step_N.tmp` is not debris.

    `.step_N.tmp` with a manifest was complete (the manifest is written last) but not renamed:
    it becomes step_N. `step_N.old` without step_N (left by an older moepar's re-save) becomes
    step_N again. A `.step_N.tmp` without a manifest, and a `step_N` without one, are moved aside
    as `step_N.incomplete-<time>`, never deleted. Folders this module marked for deletion
    (`.discard-*`) are removed in the background.
    """
    done = []
    if not os.path.isdir(ckpt_root):
        return done
    for name in sorted(os.listdir(ckpt_root)):
        path = os.path.join(ckpt_root, name)
        tmp = re.match(r"^\.step_(\d+)\.tmp$", name)
        old = re.match(r"^step_(\d+)\.old$", name)
        step = _STEP_DIR.match(name)
        if tmp:
            final = os.path.join(ckpt_root, f"step_{tmp.group(1)}")
            if os.path.isfile(os.path.join(path, MANIFEST)) and not os.path.exists(final):
                os.rename(path, final)
                done.append(f"committed {name} as step_{tmp.group(1)}")
            else:
                done.append(f"set aside incomplete {name} as {os.path.basename(set_aside(path))}")
        elif step and os.path.isdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
            done.append(f"set aside {name}, which has no {MANIFEST}, as "
                        f"{os.path.basename(set_aside(path))}")
        elif old and not os.path.exists(os.path.join(ckpt_root, f"step_{old.group(1)}")):
            os.rename(path, os.path.join(ckpt_root, f"step_{old.group(1)}"))
            done.append(f"restored {name} as step_{old.group(1)}")
        elif name.startswith(".discard-"):
            _delete_in_background(path)
    return done


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S")


def _free_name(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... whichever does not exist yet."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def set_aside(path: str) -> str:
    """Renames a step folder that is not a whole checkpoint to `step_N.incomplete-<time>` beside
    it (kept for the user to inspect or delete); returns the new path."""
    base = os.path.basename(path.rstrip("/"))
    m = re.match(r"^\.?(step_\d+)", base)
    new = _free_name(os.path.join(os.path.dirname(path), f"{m.group(1) if m else base}"
                                                         f".incomplete-{_stamp()}"))
    os.rename(path, new)
    return new


def _delete_in_background(path: str) -> threading.Thread:
    thread = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                              name=f"discard-{os.path.basename(path)}", daemon=True)
    thread.start()
    return thread


def discard(path: str) -> threading.Thread:
    """Deletes a folder this run owns (pruned or overwritten checkpoints, a failed save of its
    own): renamed to `.discard-<name>-<time>` at once, so it is gone from every listing, then
    removed by a background thread. A crash mid-way leaves the `.discard-` folder, which the
    next start's recovery removes."""
    root, name = os.path.split(path.rstrip("/"))
    hidden = _free_name(os.path.join(root, f".discard-{name.lstrip('.')}-{_stamp()}"))
    os.rename(path, hidden)
    return _delete_in_background(hidden)


def checkpoint_step(path: str) -> int | None:
    """The step a committed checkpoint directory holds (from its manifest), or None."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            step = json.load(f)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int and step >= 0 else None


def latest_checkpoint(ckpt_root: str) -> str | None:
    steps = complete_steps(ckpt_root)
    return os.path.join(ckpt_root, f"step_{steps[-1]}") if steps else None


# ---- read -------------------------------------------------------------------------------------

class _Checkpoint:
    """A committed checkpoint directory: manifest, index and state read and verified; stored
    pieces found by canonical name; headers read (and checked) once per file."""

    def __init__(self, path: str):
        self.path = path
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise CheckpointError(f"checkpoint {path!r} has no {MANIFEST}: it was never committed")
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
            self.files = dict(manifest["files"])
            self.world_size = int(manifest.get("world_size", 0))
            self.step = manifest.get("step")
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is unreadable ({e})") from None
        for name in self.files:     # names only: nothing outside the folder is ever opened
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} lists {name!r}, which is "
                                      "not a file name inside the checkpoint")
        self.index = self._json(INDEX)
        self.state = self._json(STATE)
        if not isinstance(self.index, dict) or not isinstance(self.index.get("model"), dict):
            raise CheckpointError(f"checkpoint {path!r}: {INDEX} has no 'model' section")
        if not isinstance(self.state, dict):
            raise CheckpointError(f"checkpoint {path!r}: {STATE} is not a JSON object")
        self.headers = {}

    def _json(self, name: str):
        self.verify(name)
        try:
            with open(os.path.join(self.path, name)) as f:
                return json.load(f)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {self.path!r}: {name} is not valid JSON ({e})") from None

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
        if not _is_shape(shape) or not all(_is_piece(p, len(shape)) for p in pieces) or \
                not _volume_ok(pieces, shape, check_overlap=len(pieces) <= 256):
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
    """A whole (unsharded) Transformer seen as a one-process handle, for loading into it."""
    from moepar.layers.init import canonical_tensors
    from moepar.parallel.dims import Layout, ParallelDims
    from moepar.parallel.handle import ParallelModel
    device = next(model.parameters()).device
    layout = Layout(ParallelDims(1), 0, device, None)
    return ParallelModel(model, layout, canonical_tensors(model),
                         [b.layer_id for b in model.layers if b.is_moe], 0, None, 1,
                         model.cfg.vocab_size)


def load_checkpoint(path: str, target, optimizer: bool = False, restore_rng: bool = True) -> dict:
    """Restores the model (and AdamW state, RNG) of `target` (a ParallelModel, or a whole
    Transformer) in place after verifying; returns state.json's dict.

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
        if restore_rng and ckpt.world_size == _world(layout):
            rng_states = _read_rng(ckpt, f"rng-r{layout.rank:05d}.safetensors")
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in _everyone(layout, error) if e]
    if errors:
        raise CheckpointError(errors[0])
    _apply_reads(ckpt, model_reads + optim_reads)
    for tensor, value in steps:
        tensor.fill_(value)
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
    return states


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
