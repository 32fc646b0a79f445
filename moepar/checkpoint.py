"""Checkpoints: safetensors for every tensor, JSON for the rest, committed by an atomic rename.

    checkpoints/step_N/model.safetensors      parameters and buffers, by model name
    checkpoints/step_N/optimizer.safetensors  AdamW moments and step counts, "<kind>/<param name>"
    checkpoints/step_N/rng.safetensors        torch RNG states as uint8 tensors
    checkpoints/step_N/state.json             step, data position, resolved config
    checkpoints/step_N/manifest.json          SHA-256 of every file above; written last

A checkpoint is written under `.step_N.tmp`, fsynced, and renamed to `step_N`: a crash leaves
only a temporary directory, which `latest_checkpoint` never returns. Loading verifies the manifest
before touching the model. No pickle anywhere.
"""

import hashlib
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError"]

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optimizer_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for kind, value in optimizer.state.get(p, {}).items():
                value = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{kind}/{names[id(p)]}"] = value.detach().cpu().contiguous()
    return out


def save_checkpoint(ckpt_root: str, step: int, model, optimizer, state: dict, keep: int = 0) -> str:
    """Writes checkpoints/step_<step> atomically; returns its path. Keeps the newest `keep` (0: all)."""
    os.makedirs(ckpt_root, exist_ok=True)
    final = os.path.join(ckpt_root, f"step_{step}")
    tmp = os.path.join(ckpt_root, f".step_{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model_tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(model_tensors, os.path.join(tmp, "model.safetensors"))
    save_file(_optimizer_tensors(model, optimizer), os.path.join(tmp, "optimizer.safetensors"))
    save_file({"torch_cpu": torch.get_rng_state()}, os.path.join(tmp, "rng.safetensors"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    files = sorted(os.listdir(tmp))
    for name in files:
        _fsync(os.path.join(tmp, name))
    manifest = {"step": step, "files": {name: _sha256(os.path.join(tmp, name)) for name in files}}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    _fsync(os.path.join(tmp, MANIFEST))
    if os.path.exists(final):  # re-saving a step: move the old one aside only once the new is whole
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync(ckpt_root)
    if keep:
        for old_step in complete_steps(ckpt_root)[:-keep]:
            shutil.rmtree(os.path.join(ckpt_root, f"step_{old_step}"), ignore_errors=True)
    return final


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


def latest_checkpoint(ckpt_root: str) -> str | None:
    steps = complete_steps(ckpt_root)
    return os.path.join(ckpt_root, f"step_{steps[-1]}") if steps else None


def verify_checkpoint(path: str) -> dict:
    """Checks the manifest and every file's SHA-256; returns the manifest or raises CheckpointError."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path!r} has no {MANIFEST}: it was never committed")
    with open(manifest_path) as f:
        manifest = json.load(f)
    for name, digest in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path!r} is missing {name}")
        if _sha256(file) != digest:
            raise CheckpointError(f"checkpoint {path!r}: {name} does not match its SHA-256 in "
                                  f"{MANIFEST} (corrupt or modified)")
    return manifest


def load_checkpoint(path: str, model, optimizer=None) -> dict:
    """Restores model (and optimizer, RNG) in place after verifying; returns state.json's dict."""
    verify_checkpoint(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path!r} does not fit the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for name, value in tensors.items():
        if value.shape != expected[name].shape:
            raise CheckpointError(f"checkpoint {path!r}: {name} has shape {tuple(value.shape)}, "
                                  f"the model expects {tuple(expected[name].shape)}")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])
    if optimizer is not None:
        _load_optimizer(load_file(os.path.join(path, "optimizer.safetensors")), model, optimizer, path)
    torch.set_rng_state(load_file(os.path.join(path, "rng.safetensors"))["torch_cpu"])
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


def _load_optimizer(tensors, model, optimizer, path):
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        kind, name = key.split("/", 1)
        if name not in params:
            raise CheckpointError(f"checkpoint {path!r}: optimizer state for unknown parameter {name}")
        target = params[name]
        # AdamW keeps moments in the parameter's dtype and device; step stays a CPU float scalar.
        optimizer.state[target][kind] = (value.to(target) if value.dim() else value.clone())
