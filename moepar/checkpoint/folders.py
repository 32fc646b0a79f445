"""The step folders under checkpoints/: which are committed, recovery after a crash (planned
first, applied only once a start has passed every check), setting aside and deleting in the
background.

Nothing here moves or deletes a folder moepar did not write. Ours is a folder that holds
`MARKER` (written into every `.step_N.tmp` as it is created, and into a folder before it is
renamed for deletion), or that holds only checkpoint files by moepar's names (older versions
wrote no marker), or whose manifest.json lists everything in it (a committed checkpoint); never
a symlink. Anything else under checkpoints/ (a user's `step_3/`, a `.discard-mine/`) is left
alone and reported. A save never replaces an existing step_N, and what a crash left behind is
set aside as `step_N.incomplete-<time>` (under the run lock, see moepar/rundir.py). Deleting is
for pruning (run.keep_checkpoints) and an asked overwrite: the folder is renamed away at once
and removed by a background thread, the marker last, so the other ranks never wait in a
collective while one rank deletes and a deletion cut short is still recognised as ours.
"""

import dataclasses
import os
import re
import shutil
import threading
import time

from moepar.checkpoint.base import CheckpointError, INDEX, MANIFEST, STATE
from moepar.checkpoint.load import manifest_files, read_manifest

MARKER = ".moepar-folder"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_OWN_FILE = re.compile(r"^(?:(?:model|optimizer|rng)-r\d{5}\.safetensors|" + "|".join(
    re.escape(n) for n in (INDEX, STATE, MANIFEST, MARKER)) + r")$")


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


def written_by_moepar(path: str) -> bool:
    """Whether moepar wrote the folder at `path` (see the module docstring): only such folders
    are ever moved or deleted."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if MARKER in names or all(_OWN_FILE.match(n) for n in names):
        return True
    listed = manifest_files(path)
    return listed is not None and set(names) <= set(listed) | {MANIFEST}


def mark(path: str):
    """Writes the marker into a folder moepar has just created (or is about to delete)."""
    with open(os.path.join(path, MARKER), "w") as f:
        f.write("written by moepar: this folder may be committed, set aside or deleted by it\n")


@dataclasses.dataclass
class Recovery:
    """What a crash left under checkpoints/ and what recovery will do with it (`plan_recovery`):
    `steps` are the complete checkpoints once recovery is done, each at the path it has now;
    nothing changes until `apply`."""
    root: str
    steps: dict            # step -> its folder now (step_N, or a .step_N.tmp to be committed)
    actions: list          # (message, function doing it)
    notes: list            # folders left alone, in words

    def final(self, path: str | None) -> str | None:
        """Where the checkpoint now at `path` is once recovery is done."""
        if path is None:
            return None
        step = next((s for s, p in self.steps.items() if p == path), None)
        return path if step is None else os.path.join(self.root, f"step_{step}")

    def apply(self) -> list[str]:
        """Does it (rank 0, under the run lock); returns what was done, then what was left."""
        done = []
        for message, do in self.actions:
            new = do()       # set_aside says where the folder went
            done.append(f"{message} as {os.path.basename(new)}" if isinstance(new, str) else message)
        return done + self.notes


def plan_recovery(ckpt_root: str) -> Recovery:
    """The recovery of checkpoints/, planned without changing anything. Apply it only while
    holding the run lock (moepar/rundir.py): another live run's `.step_N.tmp` is not debris.

    `.step_N.tmp` with a manifest was complete (the manifest is written last) but not renamed:
    it becomes step_N. `step_N.old` without step_N (left by an older moepar's re-save) becomes
    step_N again. A `.step_N.tmp` without a manifest, and a `step_N` without one, are moved aside
    as `step_N.incomplete-<time>`, never deleted. Folders marked for deletion (`.discard-*`) are
    removed in the background. Each only when moepar wrote it (`written_by_moepar`).
    """
    plan = Recovery(ckpt_root, {}, [], [])
    if not os.path.isdir(ckpt_root):
        return plan
    names = sorted(os.listdir(ckpt_root))
    for name in names:
        path = os.path.join(ckpt_root, name)
        tmp = re.match(r"^\.step_(\d+)\.tmp$", name)
        old = re.match(r"^step_(\d+)\.old$", name)
        step = _STEP_DIR.match(name)
        complete = os.path.isfile(os.path.join(path, MANIFEST))
        if step and complete:
            plan.steps[int(step.group(1))] = path
            continue
        if not (tmp or old or step or name.startswith(".discard-")) or not os.path.isdir(path):
            continue
        if not written_by_moepar(path):
            plan.notes.append(f"left {name} alone: moepar did not write it")
            continue
        if tmp or old:
            n = int((tmp or old).group(1))
            if complete and f"step_{n}" not in names and n not in plan.steps:
                plan.steps[n] = path
                final = os.path.join(ckpt_root, f"step_{n}")
                verb = "committed" if tmp else "restored"
                plan.actions.append((f"{verb} {name} as step_{n}",
                                     lambda a=path, b=final: os.rename(a, b)))
                continue
            if old:
                continue          # a re-save's leftover beside its step_N: left as it was
        if tmp or step:
            plan.actions.append((f"set aside {name}, which has no {MANIFEST}"
                                 if step else f"set aside incomplete {name}",
                                 lambda p=path: set_aside(p)))
        else:
            plan.actions.append((f"removing {name} in the background",
                                 lambda p=path: _delete_in_background(p)))
    return plan


def recover_interrupted(ckpt_root: str) -> list[str]:
    """plan_recovery(ckpt_root), applied at once; returns what it did (and left alone)."""
    return plan_recovery(ckpt_root).apply()


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S")


def _free_name(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... whichever does not exist yet."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def _refuse_foreign(path: str):
    if not written_by_moepar(path):
        raise CheckpointError(f"{path} was not written by moepar (no {MARKER}, and files that "
                              "are not a checkpoint's): it is left alone; move it away yourself")


def set_aside(path: str) -> str:
    """Renames a step folder that is not a whole checkpoint to `step_N.incomplete-<time>` beside
    it (kept for the user to inspect or delete); returns the new path. Refuses (CheckpointError)
    a folder moepar did not write."""
    _refuse_foreign(path)
    base = os.path.basename(path.rstrip("/"))
    m = re.match(r"^\.?(step_\d+)", base)
    new = _free_name(os.path.join(os.path.dirname(path), f"{m.group(1) if m else base}"
                                                         f".incomplete-{_stamp()}"))
    os.rename(path, new)
    return new


def _remove(path: str):
    """Deletes a folder of ours, its marker last: cut short, it is still recognisably ours."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if name != MARKER:
            child = os.path.join(path, name)
            if os.path.isdir(child) and not os.path.islink(child):
                shutil.rmtree(child, ignore_errors=True)
            else:
                try:
                    os.remove(child)
                except OSError:
                    pass
    shutil.rmtree(path, ignore_errors=True)


def _delete_in_background(path: str) -> threading.Thread:
    thread = threading.Thread(target=_remove, args=(path,),
                              name=f"discard-{os.path.basename(path)}", daemon=True)
    thread.start()
    return thread


def discard(path: str) -> threading.Thread:
    """Deletes a folder this run owns (pruned or overwritten checkpoints, a failed save of its
    own): renamed to `.discard-<name>-<time>` at once, so it is gone from every listing, then
    removed by a background thread. A crash mid-way leaves the `.discard-` folder, which the
    next start's recovery removes. Refuses (CheckpointError) a folder moepar did not write."""
    _refuse_foreign(path)
    if not os.path.exists(os.path.join(path, MARKER)):
        mark(path)
    root, name = os.path.split(path.rstrip("/"))
    hidden = _free_name(os.path.join(root, f".discard-{name.lstrip('.')}-{_stamp()}"))
    os.rename(path, hidden)
    return _delete_in_background(hidden)


def checkpoint_step(path: str) -> int | None:
    """The step a committed checkpoint directory holds (from its manifest), or None."""
    try:
        step = read_manifest(path)["step"]
    except (ValueError, KeyError):
        return None
    return step if type(step) is int and step >= 0 else None


def latest_checkpoint(ckpt_root: str) -> str | None:
    steps = complete_steps(ckpt_root)
    return os.path.join(ckpt_root, f"step_{steps[-1]}") if steps else None
