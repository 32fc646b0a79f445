"""Files moepar writes follow the umask, as `open()` and `torch.save` do: checkpoints, Hugging Face
exports and imports (safetensors' save_file alone would make them 0600), prepared data folders
(tests/unit/test_data_split.py)."""

import os
import pathlib

import pytest
import torch

from moepar.config import load_config
from moepar.filemode import umask
from moepar.hf.cli import main as convert

ROOT = pathlib.Path(__file__).resolve().parents[2]


def modes(folder: pathlib.Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in folder.rglob("*")}


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_checkpoints_and_conversions_follow_the_umask(tmp_path, mask):
    from moepar.train import Trainer
    old = os.umask(mask)
    try:
        assert umask() == mask
        torch.save({}, tmp_path / "reference.pt")         # what the files should match
        want = (tmp_path / "reference.pt").stat().st_mode & 0o777
        cfg = load_config(str(ROOT / "examples" / "tiny.toml"), [
            "--train.steps=1", "--train.global_batch_size=2", "--train.micro_batch_size=2",
            "--train.seq_len=16", "--run.tensorboard=false", "--run.log_every=0",
            "--model.qk_norm=head", f"--run.dir={tmp_path / 'run'}"])
        Trainer(cfg, log=lambda _m: None).run()
        assert convert(["--from", "moepar", str(tmp_path / "run"), "--to", "hf",
                        str(tmp_path / "hf")]) == 0
        assert convert(["--from", "hf", str(tmp_path / "hf"), "--to", "moepar",
                        str(tmp_path / "back")]) == 0
    finally:
        os.umask(old)
    assert want == 0o666 & ~mask
    for folder in ("run/checkpoints", "hf", "back"):
        found = modes(tmp_path / folder)
        files = {k: v for k, v in found.items() if (tmp_path / folder / k).is_file()}
        dirs = {k: v for k, v in found.items() if (tmp_path / folder / k).is_dir()}
        assert any(k.endswith(".safetensors") for k in files), folder
        assert set(files.values()) == {want}, (folder, files)
        assert set(dirs.values()) <= {0o777 & ~mask}, (folder, dirs)
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o777 & ~mask, folder
