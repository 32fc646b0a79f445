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

The code, by side (a test that replaces a tensorfile function such as read_box or
write_tensors patches it on the module below that calls it, not on this package):

    base.py     CheckpointError, the file names and FORMAT, the collectives, the tiling check
    save.py     save_checkpoint, PendingSave (host staging, background write), commit
    folders.py  complete_steps, latest_checkpoint, checkpoint_step, plan_recovery (applied
                by recover_interrupted), set_aside, discard: what is committed, and never moving
                or deleting a folder moepar did not write (its marker)
    load.py     load_checkpoint (read planning, hash checks, all-or-nothing), verify_checkpoint, verify_listed,
                read_state, canonical_names, read_canonical
"""

from moepar.checkpoint.base import FORMAT, INDEX, MANIFEST, STATE, CheckpointError
from moepar.checkpoint.folders import (checkpoint_step, complete_steps, discard, latest_checkpoint,
                                       plan_recovery, recover_interrupted, set_aside)
from moepar.checkpoint.load import (canonical_names, load_checkpoint, read_canonical, read_state,
                                    verify_checkpoint, verify_listed)
from moepar.checkpoint.save import PendingSave, commit, save_checkpoint

__all__ = ["save_checkpoint", "PendingSave", "load_checkpoint", "latest_checkpoint", "complete_steps",
           "verify_checkpoint", "verify_listed", "commit", "recover_interrupted", "checkpoint_step",
           "CheckpointError", "read_canonical", "canonical_names", "read_state", "discard",
           "set_aside", "plan_recovery", "MANIFEST", "INDEX", "STATE", "FORMAT"]
