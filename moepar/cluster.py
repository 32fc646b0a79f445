"""Running on a cluster: the launcher arguments for several nodes (torch's elastic agent and its
c10d rendezvous do the work), and the check that run.dir is one filesystem for every rank.

    moepar train CFG --nproc 8 --nnodes 4 --rdzv-endpoint HOST:PORT [--node-rank R]
    moepar train CFG --nproc 8 --nnodes 2:4 --rdzv-endpoint HOST:PORT --max-restarts 3 --run.resume=auto

`--nnodes N` is a fixed world (every node must start; `--node-rank R` is checked against N, and
c10d numbers the nodes in the order they join); with `--nnodes MIN:MAX` the job is elastic: torch's agent restarts every worker when one fails (up to
`--max-restarts` times) and re-forms the world from the nodes that are there, and moepar
resumes from the newest complete checkpoint at the new world size (dp absorbs the change).
`--rdzv-conf KEY=VALUE,...` reaches torch's rendezvous (e.g. last_call_timeout, join_timeout);
`--max-restarts K` alone restarts the workers of one node. `--print-launch` prints the
equivalent `torchrun` command and exits (the recipes' tests use it).
"""

import os
import socket
import time
import uuid

import torch.distributed as dist

__all__ = ["MULTINODE_FLAGS", "pop_multinode", "launcher_argv", "node_counts",
           "check_shared_filesystem"]

# moepar train's flags for several nodes -> torch.distributed.run's
MULTINODE_FLAGS = {"--nnodes": "--nnodes", "--node-rank": "--node-rank",
                   "--rdzv-endpoint": "--rdzv-endpoint", "--rdzv-id": "--rdzv-id",
                   "--max-restarts": "--max-restarts", "--rdzv-conf": "--rdzv-conf"}


def pop_multinode(argv: list[str]) -> tuple[dict, bool, list[str]]:
    """({flag: value} of the multi-node flags, --print-launch given, the other arguments)."""
    found, rest, i, print_launch = {}, [], 0, False
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg == "--print-launch":
            print_launch = True
        elif name in MULTINODE_FLAGS:
            if "=" in arg:
                found[name] = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                found[name] = argv[i + 1]
                i += 1
            else:
                raise ValueError(f"{name} needs a value")
        else:
            rest.append(arg)
        i += 1
    return found, print_launch, rest


def _nodes(spec: str) -> tuple[int, int]:
    parts = spec.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise ValueError(f"--nnodes {spec!r} must be N or MIN:MAX") from None
    if len(parts) > 2 or low < 1 or high < low:
        raise ValueError(f"--nnodes {spec!r} must be N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def launcher_argv(nproc: int, flags: dict) -> list[str]:
    """torch.distributed.run's arguments for `nproc` workers on this node (before the module):
    one node alone (`--standalone`), or several with c10d rendezvous at --rdzv-endpoint."""
    if set(flags) <= {"--max-restarts"}:
        return ["--standalone", f"--nproc_per_node={nproc}",
                *_restarts(flags)]
    if "--rdzv-conf" in flags and "--nnodes" not in flags:
        raise ValueError("--rdzv-conf is for several nodes (with --nnodes and --rdzv-endpoint)")
    low, high = _nodes(flags.get("--nnodes", "1"))
    if "--rdzv-endpoint" not in flags:
        raise ValueError("--nnodes needs --rdzv-endpoint HOST:PORT (the first node's address, "
                         "where torch's c10d rendezvous runs)")
    host, _, port = flags["--rdzv-endpoint"].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint {flags['--rdzv-endpoint']!r} must be HOST:PORT")
    out = [f"--nnodes={low}:{high}" if low != high else f"--nnodes={low}",
           f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={flags['--rdzv-endpoint']}",
           f"--rdzv-id={flags.get('--rdzv-id', 'moepar')}"]
    if "--node-rank" in flags:
        if low != high:
            raise ValueError("--node-rank is for a fixed --nnodes N; elastic MIN:MAX ranks the "
                             "nodes by rendezvous")
        rank = flags["--node-rank"]
        if not rank.isdigit() or int(rank) >= low:
            raise ValueError(f"--node-rank {rank!r} must be 0 .. {low - 1} (one per node of "
                             f"--nnodes {low})")
        # Checked, not passed on: c10d ranks the nodes in the order they join (torch warns
        # that it ignores --node-rank with that backend).
    if "--rdzv-conf" in flags:
        out.append(f"--rdzv-conf={flags['--rdzv-conf']}")
    return out + _restarts(flags)


def _restarts(flags: dict) -> list[str]:
    if "--max-restarts" not in flags:
        return []
    value = flags["--max-restarts"]
    if not value.isdigit():
        raise ValueError(f"--max-restarts {value!r} must be a non-negative integer")
    return [f"--max-restarts={int(value)}"]


def node_counts(flags: dict) -> range:
    """The node counts the job may run at: N, or MIN..MAX for an elastic job."""
    low, high = _nodes(flags.get("--nnodes", "1"))
    return range(low, high + 1)


def check_shared_filesystem(run_dir: str, rank: int, world: int, settle_s: float = 5.0):
    """Every rank writes a token file into run_dir, then every rank looks for every token; if
    any rank misses one, every rank raises the same ValueError (a collective: every rank calls
    it). Checkpoints are written by every rank into run.dir and committed by rank 0, so they
    need one filesystem all nodes mount. A token that another node created may take a moment to
    appear over NFS: a rank looks again for up to `settle_s` seconds."""
    if world == 1:
        return
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)        # this check's id: its own folder, so a second
    parent = os.path.join(run_dir, ".moepar-fs-check")     # start on the same dir cannot mix in
    folder = os.path.join(parent, box[0])
    os.makedirs(folder, exist_ok=True)
    token = os.path.join(folder, str(rank))
    with open(token + ".tmp", "w") as f:
        f.write(socket.gethostname())
        f.flush()
        os.fsync(f.fileno())
    os.replace(token + ".tmp", token)
    dist.barrier()
    # One directory listing per look (not a lookup per rank: 2048 ranks would make 4M stats).
    deadline, expected = time.monotonic() + settle_s, {str(r) for r in range(world)}
    while True:
        try:
            names = set(os.listdir(folder))
        except FileNotFoundError:
            names = set()
        missing = sorted(int(r) for r in expected - names)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    seen = [None] * world
    dist.all_gather_object(seen, (socket.gethostname(), missing))   # every rank has looked
    os.remove(token)
    dist.barrier()                                # every token is gone: the folders can go
    if rank == 0:
        for path in (folder, parent):
            try:
                os.rmdir(path)
            except OSError:
                pass         # another start's check is using the parent, or a node-local copy
    blind = [(r, host, miss) for r, (host, miss) in enumerate(seen) if miss]
    if blind:
        r, host, miss = blind[0]
        raise ValueError(f"run.dir={run_dir!r} is not one filesystem shared by all ranks: rank "
                         f"{r} on {host} does not see the files that ranks {miss} wrote there "
                         f"({len(blind)} rank(s) affected). Every rank writes its checkpoint "
                         "files into run.dir and rank 0 commits them: put run.dir on a "
                         "filesystem every node mounts (NFS, Lustre, GPFS, ...)")
