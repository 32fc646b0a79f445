"""Debug check for all-to-alls: every rank's split sizes must agree before data moves.

Talks on the group it is given (the `ep` group). Off by default (`parallel.debug_splits`): it adds
one all_gather of 2*P integers per all-to-all and a host sync.

A wrong split (a bug, or ranks at different layers) makes `all_to_all_single` hang or corrupt
rows; this check all-gathers every rank's (send, recv) sizes, which cannot hang, and raises the
same error on every rank, naming the layer and the first disagreeing pair of ranks.
"""

import torch
import torch.distributed as dist

__all__ = ["check_splits", "split_check", "SplitMismatchError"]


class SplitMismatchError(RuntimeError):
    pass


def check_splits(send_splits: list[int], recv_splits: list[int], group, where: str, device=None):
    size = dist.get_world_size(group)
    mine = torch.tensor([send_splits, recv_splits], dtype=torch.long, device=device)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).tolist()   # one host read of all ranks' splits
    for src in range(size):
        for dst in range(size):
            sent, got = table[src][0][dst], table[dst][1][src]
            if sent != got:
                raise SplitMismatchError(
                    f"{where}: EP rank {src} sends {sent} rows to EP rank {dst}, which expects "
                    f"{got} (all-to-all split sizes disagree; the collective would hang)")


def _no_check(send_splits, recv_splits, what: str, device=None):
    pass


def split_check(debug: bool, group, layer_id: int):
    """The check a dispatcher binds at construction: `check(send, recv, what, device)` naming
    MoE layer `layer_id`, or a no-op when `debug` (parallel.debug_splits) is off."""
    if not debug:
        return _no_check

    def check(send_splits, recv_splits, what: str, device=None):
        check_splits(send_splits, recv_splits, group, f"MoE layer {layer_id} {what}", device)
    return check
