"""The step folders under checkpoints/: which are committed, recovery after a crash, setting
aside and deleting in the background.

Nothing here deletes or replaces a folder it did not just write: a save never replaces an
existing step_N, and what a crash left behind is set aside as `step_N.incomplete-<time>` (under
the run lock, see moepar/rundir.py). Deleting is for pruning (run.keep_checkpoints) and an asked
overwrite: the folder is renamed away at once and removed by a background thread, so the other
ranks never wait in a collective while one rank deletes.
"""

import json
import os
import re
import shutil
import threading
import time

from moepar.checkpoint.base import MANIFEST

_STEP_DIR = re.compile(r"^step_(\d+)$")


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
