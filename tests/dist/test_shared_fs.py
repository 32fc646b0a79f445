"""The shared-filesystem check at start: every rank writes a token into run.dir and reads all
the others'. Ranks that each see another folder (as nodes with a node-local run.dir would) all
refuse with one error; one folder passes and leaves nothing behind."""

import os

import torch.distributed as dist

from moepar.cluster import check_shared_filesystem


def case_check(folder: str, per_rank: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = os.path.join(folder, f"node{rank}") if per_rank else folder
    try:
        check_shared_filesystem(run_dir, rank, world, settle_s=0.5)
    except ValueError as e:
        return str(e).replace(run_dir, "RUN_DIR")
    dist.barrier()       # rank 0 removes the check's folder after the others are done with it
    return sorted(os.listdir(run_dir))


def test_one_folder_passes_and_leaves_nothing(worlds, tmp_path):
    results = worlds(2).run(case_check, str(tmp_path), False)
    assert results == [[], []]


def test_node_local_folders_are_refused_on_every_rank(worlds, tmp_path):
    results = worlds(2).run(case_check, str(tmp_path), True)
    assert all(isinstance(r, str) for r in results), results
    assert results[0] == results[1]
    assert "is not one filesystem shared by all ranks: rank 0" in results[0]
    assert "does not see the files that ranks [1] wrote there" in results[0]
    assert "(2 rank(s) affected)" in results[0]


def case_trainer_refuses(folder: str):
    """The Trainer runs the check at start: node-local run dirs are refused before any file of
    the run (lock, config, checkpoints) is written."""
    from configs import tiny_config
    from moepar.rundir import RunDirError
    from moepar.train import Trainer
    rank = dist.get_rank()
    run_dir = os.path.join(folder, f"node{rank}")
    try:
        Trainer(tiny_config(run_dir, "--train.global_batch_size=8"), log=lambda _m: None)
    except RunDirError as e:
        return ("refused", "not one filesystem shared by all ranks" in str(e),
                sorted(os.listdir(run_dir)))
    return ("started",)


def test_trainer_refuses_node_local_run_dirs(worlds, tmp_path):
    results = worlds(2).run(case_trainer_refuses, str(tmp_path))
    assert all(r[:2] == ("refused", True) for r in results), results
    for _, _, files in results:      # nothing of the run was written before the refusal
        assert not {"run.lock", "config.toml", "metrics.jsonl", "checkpoints"} & set(files), files
