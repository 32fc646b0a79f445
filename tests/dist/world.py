"""A persistent gloo process world for tests: spawned once per world size, reused by every test.

`World(size).run(case, *args, timeout=...)` runs the top-level function `case` on every rank (each
rank imports the case's module by name) and returns the per-rank results. The first failing rank's
traceback is raised here; a hang past the timeout kills the world (the next test respawns it), so
one bad collective fails one test instead of stalling the suite. Spawning costs seconds per
process on two cores, so worlds are shared for the whole pytest session.
"""

import multiprocessing as mp
import os
import pathlib
import sys
import traceback
from multiprocessing.connection import wait

from net import free_port

HERE = pathlib.Path(__file__).resolve().parent


class CaseError(AssertionError):
    pass


def _worker(rank: int, size: int, port: int, conn, paths: list[str]):
    sys.path[:0] = paths
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import importlib

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    while True:
        task = conn.recv()
        if task is None:
            break
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything, keep serving
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class World:
    def __init__(self, size: int):
        self.size = size
        self.procs, self.conns = [], []

    def start(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        paths = [str(HERE), str(HERE.parent)]
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, self.size, port, child, paths), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, case, *args, timeout: float = 120.0):
        if not self.alive:
            self.kill()
            self.start()
        for conn in self.conns:
            conn.send((case.__module__, case.__name__, args))
        results, errors = [None] * self.size, {}
        pending = dict(enumerate(self.conns))
        deadline = timeout
        import time
        start = time.monotonic()
        while pending:
            left = deadline - (time.monotonic() - start)
            if errors:   # the others may be stuck in a collective the failed rank never joined
                left = min(left, 10.0)
            ready = wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        status, value = "error", f"rank {rank} died"
                    del pending[rank]
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = value
        if pending:
            self.kill()
        if errors:
            rank = min(errors)
            raise CaseError(f"{case.__name__} failed on rank {rank} of {self.size}:\n{errors[rank]}")
        if pending:
            raise CaseError(f"{case.__name__} timed out after {timeout:.0f}s on ranks "
                            f"{sorted(pending)} of {self.size} (world killed)")
        return results

    def kill(self):
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []
