"""The run directory's rules: one run at a time, what a fresh start, a resume or an overwrite may
do with the files already there, and which config changes a resume accepts.

    <run.dir>/run.lock        an exclusive flock for the run's life; holds the owner's pid and host
    <run.dir>/config.toml     the resolved config, as run (never the input config file itself)
    <run.dir>/metrics.jsonl   one JSON object per step (rank 0)
    <run.dir>/tb/             TensorBoard events
    <run.dir>/checkpoints/    step_N committed; step_N.incomplete-<time> set aside, never deleted
    <run.dir>/diverged.json   written when the run diverges: the step, why, and its config

Who holds the lock: the process that starts the run. `moepar train` on one process takes it
itself; `moepar train --nproc N` takes it in the launcher before any worker starts and tells the
workers (MOEPAR_RUN_LOCK_PID, checked against their parent); under torchrun, srun or any launcher
that sets WORLD_SIZE, rank 0 takes it. A second start is refused naming the holder's pid and
host. The kernel drops the lock when its holder dies, so a crash never leaves it stale. The
lock file is opened without following symlinks and must be a regular file of one link: a
run.lock that points at (or is a hard link to) a user's file is refused, never written.

A start first makes every check (plan_run_start: crash recovery planned, plan_start,
refuse_replay, the resumed checkpoint's state, dataset and config, the per-step files), and only
then, holding the lock, changes run.dir (StartPlan.apply): a refused start (exit 2) has changed
nothing.
"""

import dataclasses
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time

from moepar.checkpoint import CheckpointError, checkpoint_step, complete_steps, discard, read_state
from moepar.checkpoint.folders import plan_recovery
from moepar.checkpoint.load import read_manifest
from moepar.config import load_config, to_dict, to_toml
from moepar.data.sources import check_same_dataset
from moepar.jsonfile import FileError, Int, Map, Obj, Str, open_regular, parse_json, read_json
from moepar.process import LAUNCHER_ENV

__all__ = ["RunDirError", "RunLock", "LOCK_FILE", "previous_run_files",
           "describe_checkpoints", "plan_start", "write_config", "config_changes",
           "HARMLESS_CHANGES", "DIVERGED_FILE", "record_divergence", "refuse_replay",
           "DivergenceReplay", "StartPlan", "plan_run_start", "check_history"]

LOCK_FILE = "run.lock"
DIVERGED_FILE = "diverged.json"
RUN_FILES = ("config.toml", "metrics.jsonl", "expert_load.jsonl", "tb", "checkpoints",
             DIVERGED_FILE)


class RunDirError(ValueError):
    """This start may not use run.dir as asked: it is in use, holds another run's files, or the
    checkpoint to resume from is missing or belongs to a different run. Nothing was changed."""


class DivergenceReplay(RunDirError):
    """This start would replay a divergence recorded in run.dir (see refuse_replay)."""


class RunLock:
    """An exclusive `flock` on <run.dir>/run.lock, held until `release` (or this process ends).

    A process holds a directory once: Trainers built one after another in one process (tests,
    notebooks) share the holding, counted; `flock` would otherwise refuse the second, as its locks
    belong to open files, not processes. That shared holding is the one piece of process-wide
    state here, and it holds file descriptors only."""

    _held: dict[str, list] = {}          # real path of the lock file -> [fd, holders]

    def __init__(self, run_dir: str):
        try:
            os.makedirs(run_dir, exist_ok=True)
        except (OSError, ValueError) as e:
            reason = "holds a NUL byte" if isinstance(e, ValueError) else e.strerror
            raise RunDirError(f"run.dir={run_dir!r} cannot be created ({reason}). Nothing was "
                              "changed") from None
        if not os.path.isdir(run_dir):
            raise RunDirError(f"run.dir={run_dir!r} is not a directory. Nothing was changed")
        # The directory is resolved, never the lock: a run.lock that is a symlink is refused,
        # not followed (it could point at any file of the user's).
        self.path = os.path.join(os.path.realpath(run_dir), LOCK_FILE)
        self.run_dir, self.supported, self.released = run_dir, True, False
        if self.path in RunLock._held:
            RunLock._held[self.path][1] += 1
            return
        fd = _open_lock(self.path, run_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirError(f"run.dir={run_dir!r} is in use by another run: {holder} holds "
                              f"{self.path}. Wait for that run to end (or stop it), or choose "
                              "another run.dir") from None
        except OSError as e:    # a filesystem without locks (some NFS or Lustre mounts)
            self.supported = False
            self.error = e.strerror
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                  "command": " ".join(sys.argv)[:1000]}).encode() + b"\n", 0)
        RunLock._held[self.path] = [fd, 1]

    def release(self):
        """Lets go of this holding; the lock goes with the last one. The file stays: removing
        it would let a waiting start lock a file that a third start then recreates."""
        if self.released or self.path not in RunLock._held:
            return
        self.released = True
        entry = RunLock._held[self.path]
        entry[1] -= 1
        if entry[1] == 0:
            del RunLock._held[self.path]
            os.close(entry[0])        # closing the last descriptor drops the flock


def _open_lock(path: str, run_dir: str) -> int:
    """The lock file's descriptor: created if missing, never through a symlink (O_NOFOLLOW), and
    only a regular file of one link (a FIFO cannot block: O_NONBLOCK; a hard link to a user's
    file is refused, as writing the holder would overwrite it)."""
    flags = (os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    what = f"run.dir={run_dir!r}: {path}"
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        reason = {errno.ELOOP: "is a symlink; moepar creates its lock file itself and never "
                               "writes through a link", errno.EISDIR: "is a directory",
                  errno.EACCES: "cannot be opened (permission denied)"}.get(e.errno, e.strerror)
        raise RunDirError(f"{what} {reason}. Remove it (or choose another run.dir); nothing "
                          "was changed") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        kind = "has other hard links" if stat.S_ISREG(st.st_mode) else "is not a regular file"
        raise RunDirError(f"{what} {kind}; a lock file is moepar's own. Remove it (or choose "
                          "another run.dir); nothing was changed")
    os.set_blocking(fd, True)
    return fd


def _read_holder(fd: int) -> str:
    """'pid P on host H (started T)' from a held lock file, as far as it can be read."""
    try:
        info = parse_json(os.pread(fd, 65536, 0) or b"{}", "run.lock", Obj({}))
        return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (started "
                f"{info.get('started', '?')}: {info.get('command', '?')})")
    except (OSError, ValueError, AttributeError):
        return "another process (its lock file is unreadable)"


def launcher_holds_lock(env=None) -> bool:
    """True in a worker whose parent is the `moepar train --nproc` launcher that holds the lock."""
    env = os.environ if env is None else env
    try:
        return int(env.get(LAUNCHER_ENV, "0")) == os.getppid()
    except ValueError:
        return False


def previous_run_files(run_dir: str, ignore: str | None = None) -> list[str]:
    """The files of a previous run in run_dir: config.toml (unless it is `ignore`, the input
    config), metrics.jsonl, expert_load.jsonl, tb/, checkpoints/ (when it holds anything),
    diverged.json."""
    found = []
    for name in RUN_FILES:
        path = os.path.join(run_dir, name)
        if name == "checkpoints" and os.path.isdir(path) and not os.listdir(path):
            continue
        if ignore and os.path.exists(path) and os.path.exists(ignore) and \
                os.path.samefile(path, ignore):
            continue
        if os.path.exists(path):
            found.append(name + ("/" if os.path.isdir(path) else ""))
    return found


def describe_checkpoints(ckpt_root: str) -> str:
    """What checkpoints/ holds, in words, for an error message."""
    if not os.path.isdir(ckpt_root):
        return f"{ckpt_root} does not exist"
    names = sorted(os.listdir(ckpt_root))
    if not names:
        return f"{ckpt_root} is empty"
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"{ckpt_root} holds {shown}"


def plan_start(run, ckpt_root: str, config_path: str | None = None,
               current: dict | None = None, steps: dict | None = None) -> tuple[str | None, list]:
    """(checkpoint to resume from or None for a fresh start, steps an asked overwrite deletes)
    for the [run] section `run`; RunDirError when the start would lose or mix up a previous
    run's files. Changes nothing. `steps`: {step: folder} of the complete checkpoints once
    recovery is done (default: the committed ones). `current`: this run's config as a dict
    (run.resume="auto" compares it with the config.toml of a previous start that saved no
    checkpoint yet)."""
    if steps is None:
        steps = {s: os.path.join(ckpt_root, f"step_{s}") for s in complete_steps(ckpt_root)}
    existing = sorted(steps)

    def latest_checkpoint(_root):
        return steps[existing[-1]] if existing else None
    if run.resume_from:
        step = checkpoint_step(run.resume_from)
        if step is None:
            try:
                read_manifest(run.resume_from)
                reason = "its manifest.json holds no step"
            except CheckpointError as e:
                reason = str(e)
            raise RunDirError(f"run.resume_from={run.resume_from!r} is not a committed "
                              f"checkpoint: {reason}")
        later = [s for s in existing if s > step]
        if later and not run.overwrite:
            raise RunDirError(f"run.dir={run.dir!r} holds checkpoints after step {step} of "
                              f"run.resume_from (steps {later}); they would be resumed by "
                              "--run.resume later or pruned. Pass --run.overwrite=true to "
                              "delete them, or use another run.dir")
        return run.resume_from, later
    if run.resume == "auto":
        path = latest_checkpoint(ckpt_root)
        if path is not None:
            return path, []
        found = previous_run_files(run.dir, ignore=config_path)
        if found and not run.overwrite:
            _same_run_or_refuse(run.dir, current, ", ".join(found))
        return None, existing
    if run.resume:
        path = latest_checkpoint(ckpt_root)
        if path is None:
            raise RunDirError(f"run.resume=true but there is no complete checkpoint to resume "
                              f"from: {describe_checkpoints(ckpt_root)}. Nothing was changed; "
                              "start without --run.resume (with --run.overwrite=true if "
                              "run.dir holds a previous run's files)")
        return path, []
    found = previous_run_files(run.dir, ignore=config_path)
    if found and not run.overwrite:
        what = (f"checkpoints (steps {existing}) and other files of a previous run "
                f"({', '.join(found)})" if existing else
                f"a previous run's files ({', '.join(found)})")
        raise RunDirError(f"run.dir={run.dir!r} already holds {what}; pass --run.resume=true "
                          "to continue it, --run.overwrite=true to replace it, or choose "
                          "another run.dir")
    return None, existing


def _same_run_or_refuse(run_dir: str, current: dict | None, found: str):
    """run.resume="auto" found a previous start's files but no checkpoint (an elastic restart
    before the first save): starting over is that run's own restart when its config.toml is this
    config (up to what a resume may change); anything else is another run, refused."""
    saved_path = os.path.join(run_dir, "config.toml")
    try:
        if not os.path.isfile(saved_path):
            raise ValueError("there is none")
        saved = to_dict(load_config(saved_path))
    except ValueError as e:
        raise RunDirError(f"run.resume=auto: run.dir={run_dir!r} holds a previous run's files "
                          f"({found}) but no complete checkpoint, and its config.toml cannot be "
                          f"read ({e}), so it may be another run; pass --run.overwrite=true to "
                          "replace it, or choose another run.dir") from None
    try:
        config_changes(saved, current or {}, [], saved_path)
    except RunDirError as e:
        raise RunDirError(f"run.resume=auto: run.dir={run_dir!r} holds another run's files "
                          f"({found}) and no complete checkpoint: {e}") from None


# ---- a divergence is not retried as it was ----------------------------------------------------

# Resuming before a divergence with the same config replays it: data order, seeds and resume are
# exact, so the same steps diverge again (torch's elastic agent restarts workers whatever their
# exit code, and a scheduler may requeue the job). Changes to these keys do not change that.
_REPLAY_NEUTRAL = ("run.", "parallel.", "train.device", "train.activation_checkpointing")


def record_divergence(run_dir: str, step: int, reason: str, config: dict):
    """Rank 0, when the run diverged at `step`: <run.dir>/diverged.json, whole or not at all."""
    path = os.path.join(run_dir, DIVERGED_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step, "reason": reason, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "config": config}, f)
    os.replace(path + ".tmp", path)


_DIVERGED_SCHEMA = Obj({"step": Int(0, (1 << 53) - 1), "reason": Str(), "time": Str(),
                        "config": Map(Map())}, required=("step", "reason", "config"))


def refuse_replay(run, resume_path: str | None, current: dict) -> bool:
    """DivergenceReplay when this start would replay a recorded divergence: it resumes from a
    checkpoint no later than the diverged step (or starts over) and its config differs from the
    diverged run's in none but replay-neutral keys. Changes nothing; returns True when the
    record is to go: a fresh start asked to overwrite replaces it (a resume keeps it, whatever
    run.overwrite deletes of later checkpoints: an elastic job restarted with the same flags
    must still not replay)."""
    path = os.path.join(run.dir, DIVERGED_FILE)
    if not os.path.lexists(path):
        return False
    if run.overwrite and resume_path is None:
        return True
    try:
        record = read_json(path, _DIVERGED_SCHEMA)
    except FileError as e:
        raise RunDirError(f"{path} is unreadable ({e}); it records a divergence of this run. "
                          "Delete it to start anyway") from None
    step, reason, saved = record["step"], record["reason"], record["config"]
    start = checkpoint_step(resume_path) if resume_path else 0
    if start is None or start > step:
        return False
    changes = _changes(saved, current)
    if any(_covering(key, _REPLAY_NEUTRAL) is None for key, _, _ in changes):
        return False
    where = f"resuming from step {start}" if resume_path else "starting over"
    raise DivergenceReplay(f"not retrying a divergence: {where} with the same config would "
                           f"replay step {step}, where the run diverged "
                           f"({record.get('time', '?')}; {path}): {reason}. Change what that "
                           f"advice says, or delete {path} to try anyway")


def write_config(cfg, config_path: str | None = None) -> bool:
    """Writes <run.dir>/config.toml, the resolved config without one-shot flags (reusing the
    file must not resume from a stale path, delete checkpoints or accept changes), whole or not
    at all; never over the input config file itself (returns False then)."""

    target = os.path.join(cfg.run.dir, "config.toml")
    if config_path and os.path.exists(target) and os.path.samefile(config_path, target):
        return False
    saved = dataclasses.replace(cfg, run=dataclasses.replace(
        cfg.run, resume=False, resume_from="", overwrite=False, allow_changes=[]))
    with open(target + ".tmp", "w") as f:
        f.write(to_toml(saved))
    os.replace(target + ".tmp", target)
    return True


# ---- what a resume may change ------------------------------------------------------------------

# Keys (or whole sections, ending in '.') that do not change what the run computes; a resume
# reports their changes and goes on. Every other key changes the meaning of the run: the model,
# the router, the data order (seed, batch sizes, sequence length) or the optimization (lr, betas,
# eps, clipping, dtype); a resume refuses those unless --run.allow_changes names them.
HARMLESS_CHANGES = {
    "train.steps": "the run is extended or shortened; the learning-rate schedule follows the new "
                   "length from here on",
    "train.device": "the same numbers on another device",
    "train.activation_checkpointing": "recomputes instead of storing, same numbers",
    "train.compile": "the same maths in fused kernels (rounding may differ in the last bits)",
    "train.compile_backend": "the same maths in fused kernels (rounding may differ in the last "
                             "bits)",
    "train.on_nonfinite": "policy for bad steps",
    "train.max_skipped_steps": "policy for bad steps",
    "parallel.": "checkpoints reshard to any layout (same maths, see the numerics contract)",
    "run.": "where and how often the run reports and saves",
    "data.": "the dataset's identity is checked by its fingerprint instead",
}


def _flatten(tree: dict) -> dict:
    return {f"{section}.{key}": value for section, values in tree.items()
            if isinstance(values, dict) for key, value in values.items()}


def _covering(key: str, names) -> str | None:
    """The entry of `names` (a key, or a section ending in '.') that covers `key`, or None."""
    return next((n for n in names if key == n or (n.endswith(".") and key.startswith(n))), None)


def _harmless(key: str) -> str | None:
    name = _covering(key, HARMLESS_CHANGES)
    return None if name is None else HARMLESS_CHANGES[name]


def _changes(saved: dict, current: dict) -> list[tuple]:
    """(key, old, new) for every key both configs hold with different values (lists and tuples
    compare by items: a config read back from JSON or TOML has lists). Keys missing on either
    side (older or newer moepar) are not compared."""
    old, new = _flatten(saved), _flatten(current)
    out = []
    for key in sorted(set(old) & set(new)):
        a, b = old[key], new[key]
        if not (a == b or (isinstance(a, list | tuple) and isinstance(b, list | tuple)
                           and list(a) == list(b))):
            out.append((key, a, b))
    return out


def config_changes(saved: dict | None, current: dict, allowed: list[str], where: str) -> list[str]:
    """Compares a checkpoint's config with this run's; returns lines describing accepted changes,
    raises RunDirError naming every change that alters the run and is not in `allowed` (see
    _changes for what counts as one)."""
    if saved is None:
        return []
    if not isinstance(saved, dict):
        raise RunDirError(f"{where}: state.json holds no readable config to compare with")
    notes, refused = [], []
    for key, a, b in _changes(saved, current):
        change = f"{key} {a!r} -> {b!r}"
        why = _harmless(key)
        if why:
            notes.append(f"{change} ({why})")
        elif key in allowed:
            notes.append(f"{change} (allowed by run.allow_changes)")
        else:
            refused.append((key, change))
    if refused:
        keys = ",".join(k for k, _ in refused)
        raise RunDirError(f"resuming {where} with a config that changes the meaning of the run: "
                          f"{'; '.join(c for _, c in refused)}. Resume with the checkpoint's "
                          f"values, or pass --run.allow_changes={keys} to accept "
                          f"{'this change' if len(refused) == 1 else 'these changes'}")
    return notes


# ---- a start: every check first, then the changes ---------------------------------------------

@dataclasses.dataclass
class StartPlan:
    """What a start will do in run.dir, decided by `plan_run_start` without changing anything;
    `apply` (rank 0, under the lock, once every check has passed) does it."""
    ckpt_root: str
    resume_path: str | None      # the checkpoint to resume from, where it is now
    notes: list                  # the config changes a resume accepts, in words
    recovery: object             # moepar.checkpoint.folders.Recovery
    doomed: list                 # steps an asked overwrite deletes
    drop_divergence: str | None  # diverged.json that an asked overwrite replaces

    def apply(self, log) -> tuple[str | None, list]:
        """(the resume path once recovery is done, the background deletions started)."""
        for message in self.recovery.apply():
            log(f"checkpoints: {message}")
        if self.drop_divergence:
            os.remove(self.drop_divergence)
        threads = [discard(os.path.join(self.ckpt_root, f"step_{s}")) for s in self.doomed]
        return self.recovery.final(self.resume_path), threads


def plan_run_start(cfg, ckpt_root: str, config_path: str | None, fingerprint) -> StartPlan:
    """Every check a start makes before it may change run.dir: what crash recovery would do,
    plan_start, refuse_replay, and for a resume the checkpoint's state (hash-checked), its
    dataset and config, and the per-step files that the resume trims. RunDirError (or
    DivergenceReplay, or CheckpointError for a damaged checkpoint) when the start is refused;
    nothing has changed then."""
    recovery = plan_recovery(ckpt_root)
    current = to_dict(cfg)
    path, doomed = plan_start(cfg.run, ckpt_root, config_path, current, steps=recovery.steps)
    drop = refuse_replay(cfg.run, path, current)
    notes = []
    if path:
        saved = read_state(path)
        try:
            check_same_dataset(saved.get("dataset"), fingerprint)
        except ValueError as e:
            raise RunDirError(f"{path}: {e}. Nothing was changed") from None
        notes = config_changes(saved.get("config"), current, cfg.run.allow_changes, path)
        check_history(cfg.run.dir)
    return StartPlan(ckpt_root, path, notes, recovery, doomed,
                     os.path.join(cfg.run.dir, DIVERGED_FILE) if drop else None)


_STEP_LINE = Obj({"step": Int(0, (1 << 53) - 1)})


def check_history(run_dir: str):
    """The per-step files a resume trims (metrics.jsonl, expert_load.jsonl) can be read: every
    complete line UTF-8 JSON, steps whole numbers (a torn last line is a crash's and fine).
    RunDirError naming the file and line otherwise, before anything changed."""
    for name in ("metrics.jsonl", "expert_load.jsonl"):
        path = os.path.join(run_dir, name)
        if not os.path.lexists(path):
            continue
        try:
            with open_regular(path) as f:
                lines = f.read().split(b"\n")[:-1]     # the last piece is torn or empty
            for number, line in enumerate(lines, start=1):
                parse_json(line, f"{path}:{number}", _STEP_LINE)
        except FileError as e:
            raise RunDirError(f"{e}: the resume would trim this file to the checkpoint's step; "
                              "repair or remove the line (or the file) and resume again. Nothing "
                              "was changed") from None
