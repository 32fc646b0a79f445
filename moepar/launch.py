"""`moepar train`: parse the command line, validate the config, start workers, run the Trainer.
The command and the launcher only: a process's own setup (device, process group, timeouts, dying
with the launcher) is moepar/process.py.

    moepar train CONFIG.toml [--nproc N] [--section.key=value ...] [--dry-run]
    moepar train CONFIG.toml --nproc N --nnodes N|MIN:MAX --rdzv-endpoint HOST:PORT
                 [--node-rank R] [--max-restarts K] [--rdzv-conf K=V,...] [--print-launch]

`--nproc N` validates the config for N ranks, takes run.dir's lock, then starts N local workers
with torch's own elastic launcher (what `torchrun` runs); under `torchrun` (or any launcher that
sets RANK and WORLD_SIZE) the process joins the given world instead. The multi-node flags
(moepar/cluster.py) go to the same launcher, with torch's c10d rendezvous. Workers started by
torch's launcher die with it (Linux: PR_SET_PDEATHSIG, process.die_with_launcher), so a killed
launcher leaves no orphans.

| exit | meaning                                                                        |
|------|--------------------------------------------------------------------------------|
| 0    | trained to train.steps (the last step is saved)                                |
| 1    | failed: a worker error, an unreadable checkpoint or data file, a timeout       |
| 2    | refused to start, nothing changed: a config error, run.dir in use or holding   |
|      | another run, nothing to resume, a resume that would change the run             |
| 3    | diverged: non-finite loss or grad norm for more than train.max_skipped_steps   |
|      | steps in a row (or once with on_nonfinite='stop'), or non-finite parameters;   |
|      | or a start refused because it would replay that (run.dir/diverged.json)        |
| 75   | preempted: SIGTERM; every rank finished the same step and saved it (75 is      |
|      | EX_TEMPFAIL: requeue, and continue with --run.resume=true)                     |
"""

import argparse
import os
import shlex
import signal
import sys
import time

import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from moepar.build import build_dims
from moepar.checkpoint import CheckpointError, latest_checkpoint, read_state
from moepar.cluster import launcher_argv, node_counts, pop_multinode
from moepar.config import config_reference, load_config, to_toml
from moepar.dryrun import dry_run_text
from moepar.fits import check_run_fits
from moepar.process import (EXIT_FAILED, LAUNCHER_ENV, die_with_launcher, end_process_group,
                            select_device)
from moepar.progress import start_summary
from moepar.rundir import RunDirError, RunLock
from moepar.train import NonFiniteError, Preempted, Trainer

__all__ = ["main", "launch", "FRESH_STORE_ENV", "build_parser", "EXIT_FAILED", "EXIT_REFUSED",
           "EXIT_DIVERGED", "EXIT_PREEMPTED"]

EXIT_REFUSED, EXIT_DIVERGED, EXIT_PREEMPTED = 2, 3, 75    # EXIT_FAILED (1): moepar/process.py

def restarts(launcher: list[str]) -> bool:
    """Whether torch's launcher arguments let it restart the workers."""
    return any(a.startswith("--max-restarts=") and a != "--max-restarts=0" for a in launcher)


# torch's c10d rendezvous (2.13) shares its agent's TCP store with the workers and keeps that
# store across restarts with no per-attempt key prefix, so after an elastic restart the workers
# of the new world can read their predecessors' gloo/NCCL addresses and fail to connect
# ("Connection refused"). Opting out of the sharing gives every round a fresh store, hosted by
# the round's worker rank 0 (on the first node's hostname as it resolves it): set only for jobs
# that can restart.
FRESH_STORE_ENV = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="moepar train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model from a TOML config; any config key can be overridden as "
                    "--section.key=value (or --section.key value), after CONFIG.",
        epilog="config keys (section.key = default  # meaning):\n" + config_reference())
    parser.add_argument("config", help="a run config (TOML), e.g. examples/tiny.toml")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="start N local worker processes (torch's elastic launcher); "
                             "ignored under torchrun, which sets the world itself")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, the layout, the parameter counts (total, "
                             "active per token, per rank) and each rank's planned memory, then "
                             "exit: nothing starts, nothing is written")
    parser.add_argument("--verbose", action="store_true",
                        help="print the whole resolved config at start (else a short summary; "
                             "the full one is always written to run.dir/config.toml)")
    nodes = parser.add_argument_group(
        "several nodes (torch's elastic launcher with c10d rendezvous; run the same command on "
        "every node)")
    nodes.add_argument("--nnodes", metavar="N|MIN:MAX",
                       help="nodes in the job; MIN:MAX is elastic (dp absorbs the change)")
    nodes.add_argument("--node-rank", metavar="R", help="this node's rank, 0..N-1 (fixed N)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="the rendezvous: the first node's address and a free port")
    nodes.add_argument("--rdzv-id", metavar="ID", help="the job's id (default moepar)")
    nodes.add_argument("--rdzv-conf", metavar="K=V,...",
                       help="torch's rendezvous settings (e.g. last_call_timeout=30)")
    nodes.add_argument("--max-restarts", metavar="K",
                       help="restart every worker up to K times when one fails (with "
                            "--run.resume=auto: from the newest complete checkpoint)")
    nodes.add_argument("--print-launch", action="store_true",
                       help="print the equivalent torchrun command and exit")
    return parser


def _parse(argv: list[str]):
    """(args, overrides) or raises ValueError; argparse handles --help and exits."""
    parser = build_parser()
    if argv and argv[0].startswith("--") and argv[0] not in ("-h", "--help"):
        raise ValueError(f"the config file comes first: moepar train CONFIG.toml [options], "
                         f"got {argv[0]!r} first")
    args, overrides = parser.parse_known_args(argv)
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be a positive integer")
    return args, overrides


def launch(nproc: int, argv: list[str], run_dir: str | None = None,
           launcher: list[str] | None = None) -> int:
    """Runs `moepar <argv>` in nproc local workers with torch's elastic launcher (torchrun's);
    returns the exit code the workers agree on (table above), else 1.

    The worker's arguments are handed over after parsing, never parsed by the launcher, so a
    worker option that looks like one of the launcher's (`--virtual` vs `--virtual-local-rank`)
    cannot be taken by it. On SIGTERM the launcher forwards it to the workers and waits for them
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, 30 by default, then SIGKILL); it exits 75 when they
    saved a checkpoint for it (found in `run_dir`), else 128 + the signal.

    `launcher`: torch.distributed.run's arguments (moepar/cluster.py's launcher_argv) for a job
    of several nodes or with restarts; default: one node, `--standalone`, no restarts. Over
    several nodes the workers' rank 0 takes run.dir's lock (this process is on one node only).
    """
    one_node = launcher is None or "--standalone" in launcher
    launcher = launcher or ["--standalone", f"--nproc_per_node={nproc}"]
    if restarts(launcher):
        os.environ.setdefault(*FRESH_STORE_ENV)
    args = torch_run.get_args_parser().parse_args([*launcher, "--module", "moepar"])
    args.training_script_args = list(argv)
    # The workers inherit the environment: for them alone (restored on return, so a later
    # launch from this process, e.g. torchrun started by a caller, never sees a stale pid).
    before = os.environ.get(LAUNCHER_ENV)
    if one_node:
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers' rank 0: "your launcher holds it"
    started = time.time()
    try:
        torch_run.run(args)
    except ChildFailedError as e:
        # Workers the agent stopped (SIGTERM) once another had failed say nothing of their own.
        codes = {failure.exitcode for failure in e.failures.values()} - {-signal.SIGTERM}
        if len(codes) == 1 and codes <= {EXIT_REFUSED, EXIT_DIVERGED, EXIT_PREEMPTED}:
            return codes.pop()       # every failed worker said the same (they agree by design)
        print(f"moepar: a worker failed:\n{e}", file=sys.stderr)
        return EXIT_FAILED
    except SignalException as e:
        if e.sigval == signal.SIGTERM and run_dir and _saved_for_preemption(run_dir, started):
            print("moepar: SIGTERM: the workers saved a checkpoint and stopped; continue with "
                  "--run.resume=true", file=sys.stderr)
            code = EXIT_PREEMPTED
        else:
            print(f"moepar: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr)
            code = 128 + int(e.sigval)
        # After a signal torch's agent leaves its rendezvous store running (on purpose, for
        # elastic restarts); its C++ threads make the interpreter's exit abort now and then
        # ("terminate called without an active exception", SIGABRT), so leave directly.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = before
    return 0


def _saved_for_preemption(run_dir: str, since: float) -> bool:
    """The newest checkpoint in run_dir was committed after `since` for a SIGTERM."""
    path = latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    try:
        return (path is not None and os.path.getmtime(os.path.join(path, "manifest.json")) >= since
                and read_state(path).get("stop_reason") == "preempted")
    except (OSError, CheckpointError):
        return False


def _check_node_counts(cfg, nproc: int, flags: dict):
    """Validates the layout at every world size the job may run at (each node count of
    --nnodes N or MIN:MAX, times --nproc), before any process starts."""
    if "--nnodes" not in flags:
        build_dims(cfg, nproc)
        return
    failures = []
    for nodes in node_counts(flags):
        try:
            build_dims(cfg, nodes * nproc)
        except ValueError as e:
            failures.append(f"at {nodes} node(s) x {nproc} process(es) = world {nodes * nproc}: "
                            f"{e}")
    if failures:
        raise ValueError("the layout does not fit every world this job may run at; "
                         + "; ".join(failures))


def _check_memory(cfg, nproc: int, under_launcher: bool, flags: dict):
    """moepar/fits.py's check of the ranks this process starts (or is): all --nproc local ranks
    from the launcher (one node), else this rank."""
    device = select_device(cfg.train.device, cfg.parallel.backend)
    if under_launcher:
        rank = int(os.environ.get("RANK", 0))
        check_run_fits(cfg, int(os.environ["WORLD_SIZE"]), [rank], device)
    elif not flags:
        check_run_fits(cfg, nproc, list(range(nproc)), device)


def main(argv: list[str]) -> int:
    die_with_launcher()                 # first: a worker must not outlive its launcher
    under_launcher = "WORLD_SIZE" in os.environ
    try:
        flags, print_launch, argv = pop_multinode(argv)
        args, overrides = _parse(argv)
        cfg = load_config(args.config, overrides)
        if under_launcher:
            if flags or print_launch:
                raise ValueError(f"{', '.join([*flags, *(['--print-launch'] * print_launch)])} "
                                 "are moepar train's launcher flags; under torchrun (WORLD_SIZE "
                                 "is set) the launcher is torchrun's own")
            build_dims(cfg, int(os.environ["WORLD_SIZE"]))  # before any collective
        else:
            launcher = launcher_argv(args.nproc, flags)
            _check_node_counts(cfg, args.nproc, flags)
    except ValueError as e:
        print(f"moepar: config error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if args.dry_run:           # pure arithmetic: no process, no lock, no run.dir
        world = int(os.environ.get("WORLD_SIZE", 0))
        try:
            text = (dry_run_text(cfg, world) if under_launcher else
                    dry_run_text(cfg, args.nproc, node_counts(flags) if "--nnodes" in flags
                                 else None))
        except ValueError as e:
            print(f"moepar: config error: {e}", file=sys.stderr)
            return EXIT_REFUSED
        if int(os.environ.get("RANK", 0)) == 0:
            print(text)
        return 0
    if print_launch:
        worker = [a for i, a in enumerate(argv) if not a.startswith("--nproc=") and
                  a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")]
        env = [f"{FRESH_STORE_ENV[0]}={FRESH_STORE_ENV[1]}"] if restarts(launcher) else []
        print(shlex.join([*env, "torchrun", *launcher, "-m", "moepar", "train", *worker]))
        return 0
    try:     # before any process or collective: the ranks on this machine must fit in memory
        _check_memory(cfg, args.nproc, under_launcher, flags)
    except ValueError as e:
        print(f"moepar: config error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if not under_launcher and (args.nproc > 1 or flags):
        lock = None
        if "--standalone" in launcher:   # one node: this process holds run.dir's lock
            try:
                lock = RunLock(cfg.run.dir)  # held until the workers are done
            except RunDirError as e:
                print(f"moepar: {e}", file=sys.stderr)
                return EXIT_REFUSED
            if not lock.supported:
                print(f"moepar: warning: run.dir={cfg.run.dir!r} does not support file locks "
                      f"({lock.error}): nothing stops a second run from using it",
                      file=sys.stderr)
        try:
            return launch(args.nproc, ["train", *argv], cfg.run.dir, launcher)
        finally:
            if lock is not None:
                lock.release()
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        print(to_toml(cfg) if args.verbose else start_summary(cfg, args.config, overrides),
              flush=True)
    clean = True        # the errors below are raised by every rank at the same point
    try:
        trainer = Trainer(cfg, log=lambda msg: print(msg, flush=True), config_path=args.config)
        trainer.run()
    except RunDirError as e:
        print(f"moepar: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except NonFiniteError as e:
        print(f"moepar: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except Preempted as e:
        print(f"moepar: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except ValueError as e:
        clean = False
        print(f"moepar: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BaseException:
        clean = False
        raise
    finally:
        end_process_group(clean)
    return 0
